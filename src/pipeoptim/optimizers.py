"""Optimizers by name, for the command line: each name maps to a ``torch.optim`` class and the
keyword arguments it needs. The Python API takes any factory instead.

The table names the classes rather than holding them, so that :func:`optimizer_names` (the
choices of ``--optimizer``) is available without importing torch; :func:`make_optimizer`
imports it."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Dict, Iterable, Tuple

if TYPE_CHECKING:
    import torch

#: name -> (class name in torch.optim, keyword arguments besides lr)
_OPTIMIZERS: Dict[str, Tuple[str, Dict]] = {
    "sgd": ("SGD", {}),
    "momentum": ("SGD", {"momentum": 0.9}),
    "nesterov": ("SGD", {"momentum": 0.9, "nesterov": True}),
    "adam": ("Adam", {}),
    "adamw": ("AdamW", {}),
    "rmsprop": ("RMSprop", {}),
    "adagrad": ("Adagrad", {}),
    "adadelta": ("Adadelta", {}),
    "adamax": ("Adamax", {}),
    "nadam": ("NAdam", {}),
    "radam": ("RAdam", {}),
}


def optimizer_names() -> list[str]:
    """The names ``--optimizer`` accepts, in the table's order."""
    return list(_OPTIMIZERS)


def _build(cls: type, kwargs: Dict, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return cls(params, **kwargs)


def make_optimizer(name: str, lr: float, weight_decay: float = 0.0,
                   momentum: float | None = None) -> Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]:
    """A factory ``params -> optimizer`` (picklable, so a distributed launch can carry it)."""
    if name not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of: {', '.join(_OPTIMIZERS)}")
    if not lr > 0:
        raise ValueError(f"the learning rate must be positive, got {lr}")
    if weight_decay < 0:
        raise ValueError(f"weight decay must be >= 0, got {weight_decay}")
    import torch

    class_name, kwargs = _OPTIMIZERS[name]
    cls = getattr(torch.optim, class_name)
    kwargs = dict(kwargs, lr=lr)
    if weight_decay:
        kwargs["weight_decay"] = weight_decay
    if momentum is not None:
        if "momentum" not in kwargs and cls is not torch.optim.RMSprop:
            raise ValueError(f"--momentum applies to momentum, nesterov and rmsprop, not {name}")
        kwargs["momentum"] = momentum
    return functools.partial(_build, cls, kwargs)
