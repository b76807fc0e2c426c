"""The layers of the package (docs/architecture.md, "Layers"): each module
imports only modules of its own layer or of the layers below it, and no two modules import each
other, directly or around a circle.

The imports are read from the source with ``ast``, not by importing anything: every ``import``
and ``from ... import`` anywhere in a module (at the top, inside functions, under
``if TYPE_CHECKING``), relative or absolute; ``importlib.import_module("pipeoptim.x")`` with a
literal name; and the ``_LAZY`` tables of package ``__init__`` files (name -> submodule, served
on first use). ``from package import name`` counts as an import of the submodule
``package.name`` where that is a module, else of the package. Importing ``a.b.c`` also runs the
``__init__`` of ``a`` and ``a.b``; those implicit imports are Python's, not the module's, and are
not counted (else every module would import the package's top).

The table, lowest layer first (a module not in it fails the test: a new module gets a layer when
it is added):

====================  =========================================================================
layer                 modules
====================  =========================================================================
leaves                errors, compat (torch's private APIs, each behind a named function),
                      partition, graph_split, plan_defaults, muon_adamw, delay_nadamw,
                      batches (the forms a mini-batch takes)
schedules, weights    schedules/ (schedules as data, simulator, renderers), weights/ (policies,
                      prediction)
methods               methods (the registry: name -> schedule, policy, options)
runtime               runtime/ (stage, the local and distributed executors and the streamed
                      segment they share, the resolved run and its layout, building stages, the
                      process lifecycle of a stage, where a user's error in a pass happened)
API                   pipeline (pipeoptim.Pipeline), prepare, world (where the stages run: the
                      local world, the checkpoint writer and reader), torchrun (the Pipeline under
                      torchrun), fit (fit's loop), training (pipeoptim.train), profile, throughput
                      (a profiled model's time per method), planning and recommendation (a plan
                      of any model and the rule it recommends by), options (every option, defined once),
                      checkpoint (a run's checkpoint files, the stages' state by parameter name),
                      tensor_plan (the layers a tensor-parallel run splits), run_log (a run's
                      scalars to TensorBoard or Weights & Biases), config and checks (the options
                      as objects, their refusals), fit_checks (fit's refusals)
lab                   lab/: tasks/, experiment (task + method + run folder), planner, plots,
                      optimizers and lr schedules by name, launcher (torchrun's agent, the stage
                      worker), run_folder, bench_worker, time_to_target (the study's arithmetic)
command line          cli/, __main__, the package's __init__
====================  =========================================================================
"""
from __future__ import annotations

import ast
import fnmatch
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Set, Tuple

PACKAGE = "pipeoptim"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE

#: (layer, module patterns relative to the package; "" is the package's own __init__), lowest first
LAYERS: List[Tuple[str, List[str]]] = [
    ("leaves", ["errors", "compat", "partition", "graph_split", "state_names", "plan_defaults", "muon_adamw", "delay_nadamw",
                "batches"]),
    ("schedules, weights", ["schedules", "schedules.*", "weights", "weights.*"]),
    ("methods", ["methods"]),
    ("runtime", ["runtime", "runtime.*"]),
    ("API", ["pipeline", "config", "checks", "fit_checks", "prepare", "world", "fit", "training", "profile", "stage_timing", "torchrun", "throughput", "planning",
             "recommendation", "options", "tensor_plan", "run_log",
             "checkpoint"]),
    ("lab", ["lab", "lab.*"]),
    ("command line", ["cli", "cli.*", "__main__", ""]),
]


# ---------------------------------------------------------------------------------------------
# the checker


def find_modules(root: Path, package: str) -> Dict[str, Path]:
    """Every module of the package under ``root``: dotted name -> file (a package's name maps
    to its ``__init__.py``)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join([package] + parts)] = path
    return found


def imports_of(name: str, path: Path, modules: Iterable[str]) -> Set[str]:
    """The modules of the package that module ``name`` (file ``path``) imports."""
    modules = set(modules)
    root = name.split(".")[0]
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]  # the package relative imports start in
    targets: Set[str] = set()

    def add(dotted: str) -> None:
        while dotted and dotted not in modules:  # `import a.b.C` (C not a module) is a.b
            dotted = dotted.rpartition(".")[0]
        if dotted and dotted.split(".")[0] == root:
            targets.add(dotted)

    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base_name = _from_base(node, here)
            for alias in node.names:
                sub = f"{base_name}.{alias.name}"
                add(sub if sub in modules else base_name)
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            add(node.args[0].value)
        elif is_package and isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) \
                and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            for value in node.value.values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    add(f"{name}.{value.value}")
    targets.discard(name)
    return targets


def _from_base(node: ast.ImportFrom, here: str) -> str:
    """The dotted module a ``from ... import`` reads from; ``here`` is the package that relative
    imports start in."""
    if not node.level:
        return node.module or ""
    base = here.split(".")
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def _is_import_module(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or \
           (isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))


def import_graph(root: Path, package: str) -> Dict[str, Set[str]]:
    modules = find_modules(root, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def layer_of(module: str, package: str, layers: List[Tuple[str, List[str]]]) -> int:
    """The index of the module's layer in ``layers`` (-1: not in the table)."""
    relative = module[len(package) + 1:] if module != package else ""
    for index, (_, patterns) in enumerate(layers):
        if any(relative == p if p in ("", "__main__") else fnmatch.fnmatchcase(relative, p) for p in patterns):
            return index
    return -1


def upward_imports(graph: Dict[str, Set[str]], package: str,
                   layers: List[Tuple[str, List[str]]]) -> List[str]:
    """One line per import of a higher layer: 'a (layer) imports b (higher layer)'."""
    found = []
    for module, targets in sorted(graph.items()):
        mine = layer_of(module, package, layers)
        for target in sorted(targets):
            theirs = layer_of(target, package, layers)
            if theirs > mine:
                found.append(f"{module} ({layers[mine][0]}) imports {target} ({layers[theirs][0]})")
    return found


def import_cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    cycles: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules (~100)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(root: Path, package: str) -> List[str]:
    """One line per place where a module of the package uses another module's underscore name,
    'module:LINE: target._name': ``from target import _name`` (relative or absolute, also when
    ``_name`` is a module), ``target._name`` where ``target`` is bound by an import of a module
    of the package (``import p.x``, ``import p.x as y``, ``from p import x``, anywhere in the
    module), and a ``_LAZY`` entry that serves a name ``_name``. Dunder names (``__version__``)
    are not private; a module's own names, and other packages' (``os._exit``), are not counted."""
    modules = find_modules(root, package)
    found = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        bound: Dict[str, str] = {}  # an expression (a name, or a dotted name) -> the module it is
        nodes = list(ast.walk(tree))
        for node in nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] != package:
                        continue
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:  # `import a.b.c` makes a, a.b and a.b.c reachable
                        parts = alias.name.split(".")
                        for i in range(1, len(parts) + 1):
                            bound[".".join(parts[:i])] = ".".join(parts[:i])
            elif isinstance(node, ast.ImportFrom):
                base = _from_base(node, here)
                if base.split(".")[0] != package:
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in modules:
                        bound[alias.asname or alias.name] = sub
                    if _private(alias.name) and base != name:
                        found.append((name, node.lineno, f"{base}.{alias.name}"))
            elif is_package and isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) \
                    and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
                for key, value in zip(node.value.keys, node.value.values):
                    if isinstance(key, ast.Constant) and isinstance(value, ast.Constant) and _private(str(key.value)):
                        found.append((name, node.lineno, f"{name}.{value.value}.{key.value}"))
        for node in nodes:
            if isinstance(node, ast.Attribute) and _private(node.attr):
                target = bound.get(ast.unparse(node.value))
                if target is not None and target != name:
                    found.append((name, node.lineno, f"{target}.{node.attr}"))
    return [f"{module}:{line}: {what}" for module, line, what in sorted(found)]


# ---------------------------------------------------------------------------------------------
# the package


def test_every_module_has_a_layer():
    graph = import_graph(SRC, PACKAGE)
    assert len(graph) > 50  # the walk found the package
    unmapped = [m for m in graph if layer_of(m, PACKAGE, LAYERS) < 0]
    assert unmapped == [], f"give these modules a layer in LAYERS (and docs/architecture.md): {unmapped}"


def test_no_module_imports_a_higher_layer():
    assert upward_imports(import_graph(SRC, PACKAGE), PACKAGE, LAYERS) == []


def test_no_import_cycles():
    assert import_cycles(import_graph(SRC, PACKAGE)) == []


def test_no_module_imports_another_modules_private_names():
    """What two modules share has a public name: no module of the package imports another's
    underscore names (tests and benchmarks may; they are not checked)."""
    assert private_imports(SRC, PACKAGE) == []


def test_the_runtime_reaches_nothing_above_it():
    """Issue 13 item 3, stated directly: runtime/, schedules/ and weights/ import only the
    leaves, schedules/weights, methods and the runtime itself."""
    graph = import_graph(SRC, PACKAGE)
    allowed = {"errors", "compat", "partition", "plan_defaults", "methods", "delay_nadamw", "batches"}
    for module, targets in graph.items():
        if module.startswith((f"{PACKAGE}.runtime", f"{PACKAGE}.schedules", f"{PACKAGE}.weights")):
            for target in targets:
                rel = target[len(PACKAGE) + 1:]
                assert rel in allowed or rel.split(".")[0] in ("runtime", "schedules", "weights"), \
                    f"{module} imports {target}"
    # and the imports that used to be there are seen where they are now (the walk sees inside functions)
    lab = f"{PACKAGE}.lab"
    assert f"{PACKAGE}.cli.common" not in graph[f"{lab}.launcher"]
    assert {f"{lab}.tasks", f"{lab}.stage_worker"} <= graph[f"{lab}.launcher"]
    assert {f"{lab}.experiment", f"{lab}.bench_worker",
            f"{PACKAGE}.runtime.control"} <= graph[f"{lab}.stage_worker"]
    assert f"{lab}.launcher" in graph[f"{PACKAGE}.cli.bench"]


def test_the_engine_imports_nothing_of_the_lab_or_the_command_line():
    """The engine (every module but lab/, cli/, __main__) stands alone: it imports no module of
    the lab or the command line, and no third-party package beyond torch, numpy and tqdm at
    import time (matplotlib only inside the one function that draws a PNG)."""
    graph = import_graph(SRC, PACKAGE)
    above = (f"{PACKAGE}.lab", f"{PACKAGE}.cli", f"{PACKAGE}.__main__")
    engine = [m for m in graph if not m.startswith(above)]
    assert len(engine) > 40 and f"{PACKAGE}.pipeline" in engine
    reached = {(m, t) for m in engine for t in graph[m] if t.startswith(above)}
    assert reached == set()
    outside = {}
    for name, path in find_modules(SRC, PACKAGE).items():
        if name.startswith(above):
            continue
        for node in ast.parse(path.read_text()).body:  # module level only: what `import` runs
            tops = [a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import) else \
                [node.module.split(".")[0]] if isinstance(node, ast.ImportFrom) and not node.level else []
            for top in tops:
                if top not in ENGINE_PACKAGES and top not in sys.stdlib_module_names:
                    outside.setdefault(name, set()).add(top)
    assert outside == {}


#: what the engine may import at module level beyond the standard library (pyproject's dependencies)
ENGINE_PACKAGES = {"torch", "numpy", "tqdm", PACKAGE}


# ---------------------------------------------------------------------------------------------
# the checker can fail: a small package with an upward import (inside a function) and a cycle


def _write(root: Path, files: Dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


SYNTHETIC_LAYERS = [("low", ["low", "sub", "sub.*"]), ("high", ["high", "top", ""])]


def test_the_checker_finds_an_upward_import_inside_a_function_and_a_cycle(tmp_path):
    _write(tmp_path / "pkg", {
        "__init__.py": "_LAZY = {'Thing': 'top'}\n",
        "low.py": "def later():\n    from .high import x  # upward, and a cycle with high\n    return x\n",
        "high.py": "from . import low\nx = 1\n",
        "top.py": "import pkg.high\n",
        "sub/__init__.py": "",
        "sub/deep.py": "from ..low import later\nfrom .. import top  # upward, two levels of package\n",
        "sub/ok.py": "from pkg.sub import deep\nimport importlib\nm = importlib.import_module('pkg.low')\n",
    })
    graph = import_graph(tmp_path / "pkg", "pkg")
    assert graph == {
        "pkg": {"pkg.top"}, "pkg.low": {"pkg.high"}, "pkg.high": {"pkg.low"}, "pkg.top": {"pkg.high"},
        "pkg.sub": set(), "pkg.sub.deep": {"pkg.low", "pkg.top"}, "pkg.sub.ok": {"pkg.sub.deep", "pkg.low"},
    }
    assert upward_imports(graph, "pkg", SYNTHETIC_LAYERS) == [
        "pkg.low (low) imports pkg.high (high)",
        "pkg.sub.deep (low) imports pkg.top (high)",
    ]
    assert import_cycles(graph) == [["pkg.high", "pkg.low"]]


def test_the_checker_passes_a_clean_package_and_names_an_unmapped_module(tmp_path):
    _write(tmp_path / "pkg", {
        "__init__.py": "from .high import x\n",
        "low.py": "import os\nimport json as j\nfrom typing import Any\n",
        "high.py": "from .low import j\nfrom pkg.sub.deep import y\nx = 1\n",
        "sub/__init__.py": "",
        "sub/deep.py": "from .. import low\ny = 2\n",
        "stray.py": "",
    })
    graph = import_graph(tmp_path / "pkg", "pkg")
    assert upward_imports(graph, "pkg", SYNTHETIC_LAYERS) == []
    assert import_cycles(graph) == []
    assert [m for m in graph if layer_of(m, "pkg", SYNTHETIC_LAYERS) < 0] == ["pkg.stray"]


def test_the_private_name_checker_finds_each_form(tmp_path):
    _write(tmp_path / "pkg", {
        "__init__.py": "__version__ = '1'\n_LAZY = {'Thing': 'low', '_hidden': 'low'}\n",
        "low.py": "_x = _y = _z = _w = _v = 1\npublic = 2\n_own = 3\nprint(_own)\n",
        "_impl.py": "",
        "high.py": (
            "import os\n"
            "import pkg.low\n"
            "import pkg.low as L\n"
            "from . import low as near\n"
            "from .low import _x, public\n"            # 5: _x
            "from pkg.low import _y as y\n"            # 6: _y
            "from . import _impl\n"                    # 7: a private module
            "a = pkg.low._z + L._w + near._v\n"        # 8: three
            "b = pkg.__version__ + near.public\n"      # dunder, public: fine
            "os._exit\n"                               # another package's: not counted
            "class C:\n"
            "    _mine = 1\n"
            "    def f(self):\n"
            "        from .low import _x  # 14\n"
            "        return self._mine\n"
        ),
        "sub/__init__.py": "",
        "sub/deep.py": "from .. import low\nfrom ..low import _v\nlow._x\n",
    })
    assert private_imports(tmp_path / "pkg", "pkg") == [
        "pkg:2: pkg.low._hidden",
        "pkg.high:5: pkg.low._x",
        "pkg.high:6: pkg.low._y",
        "pkg.high:7: pkg._impl",
        "pkg.high:8: pkg.low._v",
        "pkg.high:8: pkg.low._w",
        "pkg.high:8: pkg.low._z",
        "pkg.high:14: pkg.low._x",
        "pkg.sub.deep:2: pkg.low._v",
        "pkg.sub.deep:3: pkg.low._x",
    ]


def test_the_private_name_checker_passes_a_package_without_them(tmp_path):
    _write(tmp_path / "pkg", {
        "__init__.py": "from .low import public\n__all__ = ['public']\n",
        "low.py": "_own = 1\npublic = _own + 1\n",
        "high.py": "import pkg.low\nfrom . import low\nfrom .low import public\nx = pkg.low.public + low.__name__\n",
    })
    assert private_imports(tmp_path / "pkg", "pkg") == []
