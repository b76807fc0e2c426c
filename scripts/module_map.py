"""The map of modules in docs/architecture.md, generated from the modules' own docstrings.

Each module of ``src/pipeoptim`` is listed with the first sentence of its docstring (a
folder's line: its ``__init__.py``'s), folders before the modules they hold, in the tree's order; so the map cannot drift from the code, and a
module says what it is for in one place. ``tests/test_docs.py`` holds the map in the document to
this output.

    python scripts/module_map.py            # print the map
    python scripts/module_map.py --write    # rewrite the map's block in docs/architecture.md
"""
from __future__ import annotations

import argparse
import ast
import sys
import textwrap
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "pipeoptim"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
HEADING = "\n## Map of modules\n"
COLUMN = 28   #: where descriptions start (names are indented by two spaces a folder level)
WIDTH = 100


def first_sentence(path: Path) -> str:
    """The first sentence of a module's docstring, on one line (a module without one: an error)."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        raise SystemExit(f"{path.relative_to(ROOT)} has no docstring: say in one sentence what it is for")
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    paragraph = _outside_parentheses(paragraph + " ", ". ") or paragraph  # its first sentence
    sentence = paragraph.rstrip(".:;").replace("``", "")
    if len(sentence) > WIDTH - COLUMN:  # a long one: its head, where a colon ends one
        head = _outside_parentheses(sentence, ": ")
        if head is not None and len(head) >= 24:
            sentence = head
    return sentence


def _outside_parentheses(text: str, mark: str) -> "str | None":
    """``text`` up to the first ``mark`` that stands outside parentheses and backquotes."""
    depth, quoted = 0, False
    for index, char in enumerate(text):
        quoted ^= char == "`"
        depth += {"(": 1, ")": -1}.get(char, 0)
        if not quoted and depth == 0 and text.startswith(mark, index):
            return text[:index]
    return None


def entry(name: str, depth: int, description: str) -> List[str]:
    head = "  " * depth + name
    lines = textwrap.wrap(description, WIDTH - COLUMN) or [""]
    first = head.ljust(COLUMN) + lines[0] if len(head) < COLUMN else head + "\n" + " " * COLUMN + lines[0]
    return [first.rstrip()] + [(" " * COLUMN + line).rstrip() for line in lines[1:]]


def walk(folder: Path, depth: int) -> List[str]:
    lines: List[str] = []
    modules = sorted(p for p in folder.glob("*.py") if p.name != "__init__.py")
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        lines += entry(sub.name + "/", depth, first_sentence(sub / "__init__.py"))
        lines += walk(sub, depth + 1)
    for module in modules:
        lines += entry(module.name, depth, first_sentence(module))
    return lines


def module_map() -> str:
    """The map's block: the package's folder (its ``__init__.py``'s sentence), then the tree; a
    folder's line stands for its ``__init__.py``."""
    root = entry("src/pipeoptim/", 0, first_sentence(PACKAGE / "__init__.py"))
    return "\n".join(root + walk(PACKAGE, 1)) + "\n"


def replace_block(text: str, block: str) -> str:
    """``text`` (the document) with its map's fenced block replaced by ``block``."""
    head, section = text.split(HEADING, 1)
    before, _, after = section.split("```", 2)
    return head + HEADING + before + "```\n" + block + "```" + after


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the block in docs/architecture.md")
    args = parser.parse_args(argv)
    block = module_map()
    if args.write:
        ARCHITECTURE.write_text(replace_block(ARCHITECTURE.read_text(), block))
    else:
        sys.stdout.write(block)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
