"""Tasks by name: the data sets and models that `pipeoptim train --task NAME` runs.

Importing this package does not import torch: the command line lists :func:`task_names` and
catches :class:`MissingDataError` before any task is loaded. :class:`Task` and
:class:`TaskData` (from :mod:`pipeoptim.lab.tasks.base`, which needs torch) are imported on first use.
"""
from __future__ import annotations

from typing import Any, Dict

from ...errors import MissingDataError

_TASKS: Dict[str, str] = {
    "image": "pipeoptim.lab.tasks.image:ImageTask",
    "lm": "pipeoptim.lab.tasks.lm:LanguageModelTask",
    "sentiment": "pipeoptim.lab.tasks.sentiment:SentimentTask",
    "translation": "pipeoptim.lab.tasks.translation:TranslationTask",
}

_FROM_BASE = ("Task", "TaskData")  #: names served lazily from pipeoptim.lab.tasks.base


def task_names() -> list[str]:
    return list(_TASKS)


def get_task(name: str) -> "Task":
    """Instantiate the task called ``name`` (imports its module lazily)."""
    import importlib

    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(_TASKS)}")
    module_name, class_name = _TASKS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)()


def __getattr__(name: str) -> Any:
    """``Task`` and ``TaskData``, imported from :mod:`pipeoptim.lab.tasks.base` on first use."""
    if name in _FROM_BASE:
        from . import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MissingDataError", "Task", "TaskData", "get_task", "task_names"]
