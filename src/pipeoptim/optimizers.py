"""Optimizers by name, for the command line: each name maps to a ``torch.optim`` class and the
keyword arguments it needs. The Python API takes any factory instead."""
from __future__ import annotations

import functools
from typing import Callable, Dict, Iterable, Tuple

import torch

_OPTIMIZERS: Dict[str, Tuple[type, Dict]] = {
    "sgd": (torch.optim.SGD, {}),
    "momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "nesterov": (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    "adam": (torch.optim.Adam, {}),
    "adamw": (torch.optim.AdamW, {}),
    "rmsprop": (torch.optim.RMSprop, {}),
    "adagrad": (torch.optim.Adagrad, {}),
    "adadelta": (torch.optim.Adadelta, {}),
    "adamax": (torch.optim.Adamax, {}),
    "nadam": (torch.optim.NAdam, {}),
    "radam": (torch.optim.RAdam, {}),
}


def optimizer_names() -> list[str]:
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
    cls, kwargs = _OPTIMIZERS[name]
    kwargs = dict(kwargs, lr=lr)
    if weight_decay:
        kwargs["weight_decay"] = weight_decay
    if momentum is not None:
        if "momentum" not in kwargs and cls is not torch.optim.RMSprop:
            raise ValueError(f"--momentum applies to momentum, nesterov and rmsprop, not {name}")
        kwargs["momentum"] = momentum
    return functools.partial(_build, cls, kwargs)
