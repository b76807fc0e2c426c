"""pipeoptim: pipeline-parallel training with optimizer-dependent weight prediction (PipeOptim)
and the methods it is compared with, on one runtime, for any PyTorch 2.x, CPU or GPU.

``import pipeoptim`` does not import torch: :class:`Pipeline`, :func:`train`,
:func:`plan`, :class:`TrainResult` and :class:`NonFiniteLoss` are imported on first use, so that the
command line (``pipeoptim --help``, ``pipeoptim schedule``) starts without it.
"""
from __future__ import annotations

from typing import Any

from .methods import METHODS, get_method, method_names

__version__ = "0.1.0"
__all__ = ["Pipeline", "train", "plan", "TrainResult", "NonFiniteLoss", "METHODS", "get_method", "method_names"]

#: served on first use from the module that defines them (they import torch); each is then kept
#: as the package's attribute. The function ``train`` lives in the submodule ``training``, whose
#: name differs from it: importing that submodule never replaces the function here.
_LAZY = {"train": "training", "plan": "planning", "TrainResult": "pipeline", "Pipeline": "pipeline",
         "NonFiniteLoss": "errors"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
