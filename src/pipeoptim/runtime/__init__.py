"""Executing schedules: one stage implementation (stage.py) and one executor (executor.py), which
walks each rank's lowered order in one process (local.py) or under torchrun (distributed.py).
Its names are imported on first use: ``runtime.defaults`` imports no torch.
"""
from __future__ import annotations

from typing import Any

_LAZY = {"Stage": "stage", "TraceEntry": "stage", "run_schedule": "local"}  #: name -> submodule


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Stage", "TraceEntry", "run_schedule"]
