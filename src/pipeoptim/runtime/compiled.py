"""A stage's forward through ``torch.compile``, its compilations counted.

The compiled function takes the weight version of each pass as graph inputs, so a pass on
another version runs the same graph (dynamo guards on dtypes, shapes, strides and
``requires_grad``, never on values). Each stage compiles its own copy of the pass function:
dynamo's cache of graphs is per code object and limited to 8 entries, which stages sharing one
would fill together and fall back to eager without an error. The backward of a compiled forward
is one graph (``split_backward.backward_together``)."""
from __future__ import annotations

import os
import shutil
import sysconfig
import types
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import nn
from torch.func import functional_call

from ..compat import compile_backend
from ..errors import option
from .defaults import COMPILE_BACKENDS

#: what ``compile=True`` means: torch's default backend
DEFAULT_BACKEND = "inductor"


def backend_of(compile: Union[bool, str, None]) -> Optional[str]:
    """The backend that ``Pipeline(compile=...)`` names: None (off) for False/None, the default
    for True, else the name given (a ValueError names the fix where torch has no such backend)."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return DEFAULT_BACKEND
    if not isinstance(compile, str):
        raise ValueError(f"{option('compile')} must be True, False or a torch.compile backend's name "
                         f"({', '.join(COMPILE_BACKENDS)}), got {compile!r}")
    try:
        compile_backend(compile)
    except Exception:  # torch raises its own InvalidBackend; any failure means the same to the user
        raise ValueError(f"{option('compile', compile)}: torch.compile has no backend of that name; use one of "
                         f"{', '.join(COMPILE_BACKENDS)} (or True for {DEFAULT_BACKEND})") from None
    return compile


def missing_toolchain(backend: Optional[str], device_types: Tuple[str, ...]) -> Optional[str]:
    """Why ``backend`` (None: no compilation) cannot compile here, in one line (None: it can).
    Inductor's CPU code is C++ built at run time, which needs a C++ compiler and Python's
    headers; the other backends and the GPU's Triton kernels need neither."""
    if backend != "inductor" or "cpu" not in device_types:
        return None
    compiler = os.environ.get("CXX") or next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
    headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if compiler is None or not shutil.which(compiler):
        return (f"{option('compile', True)} on the CPU needs a C++ compiler for torch's inductor backend and none "
                f"was found (install one: apt-get install g++), or pass {option('compile', 'aot_eager')} (no "
                f"compiler, less speed)")
    if not os.path.exists(headers):
        return (f"{option('compile', True)} on the CPU needs Python's headers for torch's inductor backend "
                f"({headers} is missing: apt-get install python3-dev), or pass {option('compile', 'aot_eager')}")
    return None


def _run(module: nn.Module, weights: Optional[Dict[str, torch.Tensor]], args: Tuple[Any, ...]) -> Any:
    if weights is None:
        return module(*args)
    return functional_call(module, weights, args)


class CompiledForward:
    """``module``'s forward, compiled once per stage with ``backend`` and called with the weight
    version of each pass. ``compilations``: how many graphs the backend has compiled so far."""

    def __init__(self, module: nn.Module, backend: str) -> None:
        self.module = module
        self.backend = backend
        self.compilations = 0
        inner = compile_backend(backend)

        def counting(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
            self.compilations += 1
            return inner(graph, example_inputs)

        # a code object of its own: its own cache of graphs (module docstring)
        own = types.FunctionType(_run.__code__.replace(), _run.__globals__, f"stage_forward_{id(self):x}")
        self._compiled = torch.compile(own, backend=counting)

    def __call__(self, weights: Optional[Dict[str, torch.Tensor]], args: Tuple[Any, ...]) -> Any:
        """The pass on ``weights`` (name -> tensor; None: the module's own parameters)."""
        return self._compiled(self.module, weights, args)
