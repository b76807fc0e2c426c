"""Tasks by name: the data sets and models that `pipeoptim train --task NAME` runs."""
from __future__ import annotations

from typing import Dict

from .base import MissingDataError, Task, TaskData

_TASKS: Dict[str, str] = {
    "image": "pipeoptim.tasks.image:ImageTask",
    "lm": "pipeoptim.tasks.lm:LanguageModelTask",
    "sentiment": "pipeoptim.tasks.sentiment:SentimentTask",
    "translation": "pipeoptim.tasks.translation:TranslationTask",
}


def task_names() -> list[str]:
    return list(_TASKS)


def get_task(name: str) -> Task:
    """Instantiate the task called ``name`` (imports its module lazily)."""
    import importlib

    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(_TASKS)}")
    module_name, class_name = _TASKS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)()


__all__ = ["MissingDataError", "Task", "TaskData", "get_task", "task_names"]
