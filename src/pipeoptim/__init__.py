"""pipeoptim: pipeline-parallel training with optimizer-dependent weight prediction (PipeOptim)
and the methods it is compared with, on one runtime, for any PyTorch 2.x, CPU or GPU.

``import pipeoptim`` does not import torch: :class:`Pipeline`, :func:`train`,
:func:`plan`, :class:`TrainResult` and :class:`NonFiniteLoss` are imported on first use, so that the
command line (``pipeoptim --help``, ``pipeoptim schedule``) starts without it.
"""
from __future__ import annotations

import sys
import types
from typing import Any

from .methods import METHODS, get_method, method_names

__version__ = "0.1.0"
__all__ = ["Pipeline", "train", "plan", "TrainResult", "NonFiniteLoss", "METHODS", "get_method", "method_names"]

#: served on first use from the module that defines them (they import torch)
_LAZY = {"train": "train", "plan": "planning", "TrainResult": "pipeline", "Pipeline": "pipeline",
         "NonFiniteLoss": "errors"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """The package's module type. Importing the submodule :mod:`pipeoptim.train` makes Python set
    the package attribute ``train`` to that submodule, which would hide the function
    ``pipeoptim.train``; this keeps the function there, as the eager import used to."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "train" and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.train":
            value = value.train
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
