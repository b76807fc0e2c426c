"""benchmarks/ and study/ are packages (``python -m benchmarks.<name>``, ``python -m study.<name>``
from the repository root): their modules import each other as ``benchmarks.<name>`` and
``study.<name>``, never by a bare script name with the folder put on ``sys.path``; no two of them
import each other, directly or round a longer circle; and neither package imports the other (the
benchmarks measure the library, the study harness runs and reports the equal-time study). Read
from the sources with ``ast`` (test_layers.py's import graph and cycle finder), nothing imported."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from test_layers import import_cycles, import_graph

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("benchmarks", "study")


@pytest.mark.parametrize("package, module, imported", [("benchmarks", "benchmarks.link_threads",
                                                        "benchmarks.peer_runs"),
                                                       ("study", "study.make_results3", "study.common")])
def test_a_package_without_an_import_circle(package, module, imported):
    assert (ROOT / package / "__init__.py").exists()
    graph = import_graph(ROOT / package, package)
    assert module in graph and imported in graph[module]
    assert import_cycles(graph) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_sys_path_no_bare_script_imports_and_not_the_other_package(package):
    folder = ROOT / package
    scripts = {p.stem for p in folder.glob("*.py")}
    other = next(p for p in PACKAGES if p != package)
    found = []
    for path in sorted(folder.rglob("*.py")):
        source = path.read_text()
        if "sys.path" in source:
            found.append(f"{path.name}: sys.path")
        for node in ast.walk(ast.parse(source)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.name}:{node.lineno}: import {n}" for n in names
                      if n and n.split(".")[0] in scripts | {other}]
    assert found == []


def test_the_cycle_finder_sees_a_circle_between_two_scripts(tmp_path):
    # the circle this package once had: make_results2 <-> make_results2_findings
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "report.py").write_text("def generate():\n    from bench.findings import lines\n")
    (tmp_path / "findings.py").write_text("from bench.report import generate\n")
    assert import_cycles(import_graph(tmp_path, "bench")) == [["bench.findings", "bench.report"]]
