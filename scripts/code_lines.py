"""The engine's code lines: every module of ``src/pipeoptim`` but ``lab/`` and ``cli/``, counting
the lines that hold code (not docstrings, comments or blank lines), so that a change's size is
read alike from one commit to the next.

    python scripts/code_lines.py              # the total
    python scripts/code_lines.py --modules    # and each module's count
    python scripts/code_lines.py --root DIR   # another checkout's (e.g. a git worktree of an older commit)
"""
from __future__ import annotations

import argparse
import ast
import io
import tokenize
from pathlib import Path
from typing import Dict

ROOT = Path(__file__).resolve().parents[1]
SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def code_lines(source: str) -> int:
    """Lines of ``source`` that hold a token of code outside a module's, class's or function's docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in SKIPPED:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docstrings)
    return len(lines)


def engine_lines(root: Path) -> Dict[str, int]:
    """Each engine module of the checkout at ``root``: its code lines."""
    package = root / "src" / "pipeoptim"
    return {str(path.relative_to(package)): code_lines(path.read_text())
            for path in sorted(package.rglob("*.py")) if path.relative_to(package).parts[0] not in ("lab", "cli")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to count (default: this one)")
    parser.add_argument("--modules", action="store_true", help="print each module's count too")
    args = parser.parse_args()
    counts = engine_lines(args.root)
    if args.modules:
        for name, count in counts.items():
            print(f"{count:6d}  {name}")
    print(f"engine code lines: {sum(counts.values())} in {len(counts)} modules")


if __name__ == "__main__":
    main()
