"""Optimizers by name, for the command line: each name maps to a ``torch.optim`` class and the
keyword arguments it needs. The Python API takes any factory instead.

``muon`` is ``torch.optim.Muon`` on the hidden weight matrices and AdamW on the rest, one
optimizer per stage (:class:`pipeoptim.muon_adamw.MuonWithAdamW`; which parameters go where:
:func:`pipeoptim.muon_adamw.split_for_muon`): ``lr`` is Muon's, ``adamw_lr`` AdamW's (default
``lr / 10``), ``momentum`` Muon's (default 0.95), ``beta1`` AdamW's; a non-zero ``weight_decay``
is both parts' (else torch's defaults, Muon 0.1 and AdamW 0.01, as ``adamw`` keeps AdamW's).
``delay-nadamw`` is pipeoptim's own :class:`pipeoptim.delay_nadamw.DelayNAdamW`: NAdamW with a
constant beta1 (default 0.99) whose Nesterov look-ahead spans the stage's gradient delay (after
Ajanthan et al., ICML 2025; the formulation is ours); a zero ``weight_decay`` keeps its default,
0.01 decoupled, as ``adamw`` keeps AdamW's.
``beta1`` sets the first moment's decay of the optimizers with ``betas`` (beta2 stays 0.999).

The table names the classes rather than holding them, so that :func:`optimizer_names` (the
choices of ``--optimizer``) is available without importing torch; :func:`make_optimizer`
imports it, and a class of pipeoptim's own is imported by its builder when the factory builds the
optimizer (:data:`_OWN`)."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Dict, Iterable, Tuple

if TYPE_CHECKING:
    import torch

#: name -> (class name in torch.optim, or in pipeoptim for a name of :data:`_OWN`, keyword
#: arguments besides lr)
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
    "muon": ("Muon", {}),
    "delay-nadamw": ("DelayNAdamW", {}),
}

#: the optimizers ``beta1`` applies to (muon: its AdamW part)
BETA1_OPTIMIZERS = ("adam", "adamw", "adamax", "nadam", "radam", "muon", "delay-nadamw")


def optimizer_names() -> list[str]:
    """The names ``--optimizer`` accepts, in the table's order."""
    return list(_OPTIMIZERS)


def _build(cls: type, kwargs: Dict, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return cls(params, **kwargs)


def _build_delay_nadamw(kwargs: Dict, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    from ..delay_nadamw import DelayNAdamW

    return DelayNAdamW(params, **kwargs)


#: the names whose class is pipeoptim's own -> a module-level builder ``(kwargs, params)``, which
#: imports the class when it builds (so the factory stays picklable and this module torch-free)
_OWN: Dict[str, Callable[[Dict, Iterable[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "delay-nadamw": _build_delay_nadamw,
}


def _build_muon(kwargs: Dict, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    from ..muon_adamw import MuonWithAdamW, split_for_muon

    return MuonWithAdamW(*split_for_muon(params), **kwargs)


#: the optimizers ``momentum`` applies to
MOMENTUM_OPTIMIZERS = ("momentum", "nesterov", "rmsprop", "muon")


def check_options(name: str, lr: float | None = None, weight_decay: float = 0.0, momentum: float | None = None,
                  beta1: float | None = None, adamw_lr: float | None = None) -> None:
    """Refuse a bad optimizer setting with a ValueError naming the option (no torch needed, so
    the command line refuses it before loading anything)."""
    if name not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of: {', '.join(_OPTIMIZERS)}")
    if lr is not None and not lr > 0:
        raise ValueError(f"the learning rate must be positive, got {lr}")
    if weight_decay < 0:
        raise ValueError(f"weight decay must be >= 0, got {weight_decay}")
    if momentum is not None and name not in MOMENTUM_OPTIMIZERS:
        raise ValueError(f"--momentum applies to {', '.join(MOMENTUM_OPTIMIZERS[:-1])} and "
                         f"{MOMENTUM_OPTIMIZERS[-1]}, not {name}")
    if beta1 is not None:
        if name not in BETA1_OPTIMIZERS:
            raise ValueError(f"--beta1 applies to {', '.join(BETA1_OPTIMIZERS)}, not {name}")
        if not 0 <= beta1 < 1:
            raise ValueError(f"--beta1 must lie in [0, 1), got {beta1}")
    if adamw_lr is not None:
        if name != "muon":
            raise ValueError(f"--adamw-lr applies to muon (its AdamW part), not {name}")
        if not adamw_lr > 0:
            raise ValueError(f"--adamw-lr must be positive, got {adamw_lr}")


def make_optimizer(name: str, lr: float, weight_decay: float = 0.0, momentum: float | None = None,
                   beta1: float | None = None, adamw_lr: float | None = None,
                   ) -> Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]:
    """A factory ``params -> optimizer`` (picklable, so a distributed launch can carry it)."""
    check_options(name, lr, weight_decay, momentum, beta1, adamw_lr)
    import torch

    if name == "muon":
        if not hasattr(torch.optim, "Muon"):
            raise ValueError(f"--optimizer muon needs torch.optim.Muon (torch >= 2.9); this torch is {torch.__version__}")
        kwargs: Dict = {"lr": lr, "adamw_lr": lr / 10 if adamw_lr is None else adamw_lr}
        if weight_decay:
            kwargs.update(weight_decay=weight_decay, adamw_weight_decay=weight_decay)
        if momentum is not None:
            kwargs["momentum"] = momentum
        if beta1 is not None:
            kwargs["betas"] = (beta1, 0.999)
        return functools.partial(_build_muon, kwargs)
    class_name, kwargs = _OPTIMIZERS[name]
    kwargs = dict(kwargs, lr=lr)
    if weight_decay:
        kwargs["weight_decay"] = weight_decay
    if momentum is not None:
        kwargs["momentum"] = momentum
    if beta1 is not None:
        kwargs["betas"] = (beta1, 0.999)
    if name in _OWN:
        return functools.partial(_OWN[name], kwargs)
    return functools.partial(_build, getattr(torch.optim, class_name), kwargs)
