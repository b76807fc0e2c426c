"""benchmarks/ is a package (``python -m benchmarks.<name>`` from the repository root): its modules
import each other as ``benchmarks.<name>``, never by a bare script name with the folder put on
``sys.path``, and no two of them import each other, directly or round a longer circle. Read from
the sources with ``ast`` (test_layers.py's import graph and cycle finder), nothing imported."""
from __future__ import annotations

import ast
from pathlib import Path

from test_layers import import_cycles, import_graph

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_benchmarks_is_a_package_without_an_import_circle():
    assert (BENCHMARKS / "__init__.py").exists()
    graph = import_graph(BENCHMARKS, "benchmarks")
    assert "benchmarks.make_results3" in graph and "benchmarks.common" in graph["benchmarks.make_results3"]
    assert import_cycles(graph) == []


def test_no_sys_path_and_no_bare_script_imports():
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")}
    found = []
    for path in sorted(BENCHMARKS.rglob("*.py")):
        source = path.read_text()
        if "sys.path" in source:
            found.append(f"{path.name}: sys.path")
        for node in ast.walk(ast.parse(source)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.name}:{node.lineno}: import {n}" for n in names if n and n.split(".")[0] in scripts]
    assert found == []


def test_the_cycle_finder_sees_a_circle_between_two_scripts(tmp_path):
    # the circle this package once had: make_results2 <-> make_results2_findings
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "report.py").write_text("def generate():\n    from bench.findings import lines\n")
    (tmp_path / "findings.py").write_text("from bench.report import generate\n")
    assert import_cycles(import_graph(tmp_path, "bench")) == [["bench.findings", "bench.report"]]
