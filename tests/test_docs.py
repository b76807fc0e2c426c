"""The documentation stands alone: docs/architecture.md maps every module of the package, every
section the code, the tests and the documents cite by its heading exists, nothing cites a file
outside the repository, and the README's options table is the one the option table writes.

Read as text; only the README's options table imports what writes it (pipeoptim.options, no torch).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGE = "src/pipeoptim/"

#: references to files that readers of the repository do not have (joined at run time, so that
#: neither this file nor its compiled form matches itself)
OUTSIDE = (".".join(["DESIGN", "md"]), "/".join(["..", "shared"]), "/".join(["", "work", "shared"]))


def map_block(text: str) -> str:
    """The first fenced block after the heading "Map of modules"."""
    section = text.split("\n## Map of modules\n", 1)[1]
    return section.split("```", 2)[1]


def mapped_paths(block: str) -> Set[str]:
    """The files and folders a map lists, as paths: an entry is a line whose first word ends in
    ``.py`` or ``/`` and starts at an even indentation below the description column; two spaces
    more than a folder's entry put it inside that folder."""
    paths: Set[str] = set()
    folders: List[Tuple[int, str]] = []  # (indentation, path) of the folders open above
    for line in block.splitlines():
        match = re.match(r"^( *)(\S+)", line)
        if not match:
            continue
        indent, word = len(match.group(1)), match.group(2)
        if indent % 2 or indent >= 20 or not (word.endswith(".py") or word.endswith("/")):
            continue  # a description's continuation
        while folders and folders[-1][0] >= indent:
            folders.pop()
        path = (folders[-1][1] if folders else "") + word
        paths.add(path)
        if word.endswith("/"):
            folders.append((indent, path))
            paths.add(path + "__init__.py")  # a folder's line stands for its __init__.py
    return paths


def package_modules(root: Path) -> Set[str]:
    return {path.relative_to(root).as_posix() for path in (root / PACKAGE).rglob("*.py")}


def headings(text: str) -> Set[str]:
    return {line.lstrip("#").strip() for line in text.splitlines() if re.match(r"^#{2,4} ", line)}


def _flat(text: str) -> str:
    """Lines joined with single spaces, without the comment markers that start wrapped lines."""
    return re.sub(r"\s*\n\s*(?:#:?\s*)?", " ", text)


_CITATION = re.compile(r'architecture\.md,?\s+((?:"[^"]+"(?:,\s*|\s+and\s+)?)+)')
_SEE = re.compile(r'\bsee "([^"]+)"')


def cited_sections(text: str, own: bool = False) -> Iterator[str]:
    """The headings of docs/architecture.md that ``text`` cites: ``docs/architecture.md, "A"`` (or
    ``"A" and "B"``); in the file itself (``own``), also ``see "A"``."""
    flat = _flat(text)
    for match in _CITATION.finditer(flat):
        yield from re.findall(r'"([^"]+)"', match.group(1))
    if own:
        yield from _SEE.findall(flat)


def text_files(root: Path) -> Iterator[Path]:
    """The repository's files that cite: src/, tests/, docs/ (the generated reports included),
    benchmarks/, study/ and examples/ sources, and the README."""
    yield root / "README.md"
    for folder in ("src", "tests", "docs", "benchmarks", "study", "examples"):
        for path in sorted((root / folder).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".md", ".txt", ".toml", ".cfg", ".ini"):
                yield path


# ---------------------------------------------------------------------------------------------
# the repository


def test_the_module_map_lists_every_module_of_the_package():
    listed = {p for p in mapped_paths(map_block(ARCHITECTURE.read_text())) if p.startswith(PACKAGE)}
    modules = package_modules(ROOT)
    assert len(modules) > 50  # the walk found the package
    missing = sorted(modules - listed)
    gone = sorted(p for p in listed - modules if p.endswith(".py"))
    assert missing == [], f"add these modules to the map in docs/architecture.md: {missing}"
    assert gone == [], f"the map in docs/architecture.md lists modules that do not exist: {gone}"


def test_the_module_map_is_the_one_the_docstrings_make():
    """The map is generated from each module's docstring (``python scripts/module_map.py
    --write`` rewrites it): a module says what it is for in one place."""
    module_map = load_script("module_map")
    assert map_block(ARCHITECTURE.read_text()).lstrip("\n") == module_map.module_map(), \
        "docs/architecture.md's map is stale: run python scripts/module_map.py --write"


def test_every_cited_section_of_the_architecture_exists():
    sections = headings(ARCHITECTURE.read_text())
    wrong: Dict[str, List[str]] = {}
    count = 0
    for path in text_files(ROOT):
        if path == Path(__file__).resolve():
            continue  # this file's examples cite headings that do not exist
        for cited in cited_sections(path.read_text(errors="replace"), own=path == ARCHITECTURE):
            count += 1
            if cited not in sections:
                wrong.setdefault(str(path.relative_to(ROOT)), []).append(cited)
    assert count > 10  # the citations were found
    assert wrong == {}, f"no such heading in docs/architecture.md: {wrong}"


def test_nothing_cites_a_file_outside_the_repository():
    found = []
    for path in text_files(ROOT):
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if any(name in line for name in OUTSIDE):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == [], "cite docs/architecture.md instead:\n" + "\n".join(found)


def test_the_readme_lists_every_option_as_the_option_table_has_it():
    from study.make_results3_advice import OPTIONS_END, OPTIONS_START, options_table, readme_with_options

    readme = (ROOT / "README.md").read_text()
    assert readme_with_options(readme) == readme, \
        "README.md's options table is out of date: run .venv/bin/python -m study.make_results3 --readme"
    # a stale table is rewritten whole
    start = readme.index(OPTIONS_START) + len(OPTIONS_START)
    stale = readme[:start] + "| old |\n" + readme[readme.index(OPTIONS_END):]
    assert stale != readme and readme_with_options(stale) == readme
    from pipeoptim.options import OPTIONS

    table = options_table()
    assert all(f"`{o.name}" in table for o in OPTIONS)


def test_the_readme_opens_with_what_a_user_needs_and_stays_short():
    """Install and the quickstart come first, the two commands of the contract are there, and the
    README stays a user's page (the studies and measurements live in docs/)."""
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= 320, f"README.md has {len(lines)} lines: move detail to docs/ (at most 320)"
    sections = [line for line in lines if line.startswith("## ")]
    assert sections[:2] == ["## Install", "## Quickstart: a transformers causal LM"], sections
    assert "make demo" in readme and "make test" in readme


# ---------------------------------------------------------------------------------------------
# the checkers can fail


def test_the_map_reader_follows_the_folders_and_skips_descriptions():
    block = """
src/pkg/
  __init__.py         the package
  a.py                a module whose description runs on
                      over.py two lines: not an entry
  sub/                a folder
    b.py              in it
    deeper/
      c.py            two folders down
  d.py                back at the top
tools/                another tree
"""
    folders = {"src/pkg/", "src/pkg/sub/", "src/pkg/sub/deeper/", "tools/"}  # each stands for its __init__.py
    assert mapped_paths(block) == folders | {f + "__init__.py" for f in folders} | {
        "src/pkg/a.py", "src/pkg/sub/b.py", "src/pkg/sub/deeper/c.py", "src/pkg/d.py"}


def test_a_module_missing_from_the_map_is_found(tmp_path):
    for name in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py", "sub/new.py"):
        (tmp_path / PACKAGE / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / PACKAGE / name).write_text("")
    block = "src/pipeoptim/\n  __init__.py\n  a.py\n  sub/\n    __init__.py\n    b.py\n"
    assert package_modules(tmp_path) - mapped_paths(block) == {"src/pipeoptim/sub/new.py"}


def test_citations_are_read_across_wrapped_lines_and_comments():
    text = ('x = 1  # see docs/architecture.md, "Weight versions per\n'
            '    #: method" and "Layers"; and (docs/architecture.md "Glossary")\n'
            'also see "Nothing" (only inside the file itself)\n')
    assert list(cited_sections(text)) == ["Weight versions per method", "Layers", "Glossary"]
    assert list(cited_sections(text, own=True))[-1] == "Nothing"
