"""Learning-rate schedules by name, for the command line and the studies. The Python API takes
any ``torch.optim.lr_scheduler`` factory instead; these build a ``LambdaLR``.

* ``constant``: the peak lr throughout (no scheduler).
* ``warmup-cosine``: linear warm-up from lr/W to the peak over the first W updates, then cosine
  decay to ``floor`` (default 10%) of the peak at the last update.
* ``step``: linear warm-up over W updates (if any), then the peak, times 0.1 from half of the
  updates on and 0.01 from three quarters on.

``warmup_steps`` defaults to 5% of the updates for ``warmup-cosine`` and 0 for ``step``.
This module imports torch only when a factory is called, so the command line can list the
names without loading it.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

LR_SCHEDULES = ("constant", "warmup-cosine", "step")


def lr_multiplier(name: str, update: int, total: int, warmup: int, floor: float = 0.1) -> float:
    """The factor on the peak lr applied by update number ``update`` (0-based) of ``total``."""
    if name == "constant":
        return 1.0
    if warmup and update < warmup:
        return (update + 1) / warmup
    if name == "warmup-cosine":
        span = max(1, total - 1 - warmup)
        progress = min(1.0, (update - warmup) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if name == "step":
        return 0.01 if update >= 0.75 * total else 0.1 if update >= 0.5 * total else 1.0
    raise ValueError(f"unknown lr schedule {name!r}; choose one of: {', '.join(LR_SCHEDULES)}")


def default_warmup(name: str, total: int, warmup_steps: Optional[int]) -> int:
    if warmup_steps is not None:
        return warmup_steps
    return max(1, round(0.05 * total)) if name == "warmup-cosine" else 0


def _lambda_lr(name: str, total: int, warmup: int, floor: float, optimizer: Any) -> Any:
    import torch

    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_multiplier, name, total=total, warmup=warmup, floor=floor))


def make_lr_schedule(name: str, total_updates: int, warmup_steps: Optional[int] = None,
                     floor: float = 0.1) -> Optional[Callable[[Any], Any]]:
    """A factory ``optimizer -> LambdaLR`` for ``total_updates`` updates (picklable), or None
    for ``constant``. Errors are ValueErrors that name the fix."""
    if name not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {name!r}; choose one of: {', '.join(LR_SCHEDULES)}")
    if warmup_steps is not None and warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be 0 or more, got {warmup_steps}")
    if name == "constant":
        if warmup_steps:
            raise ValueError("--warmup-steps needs --lr-schedule warmup-cosine or step")
        return None
    if total_updates < 1:
        raise ValueError(f"an lr schedule needs at least one update, got {total_updates}")
    warmup = default_warmup(name, total_updates, warmup_steps)
    if warmup >= total_updates:
        raise ValueError(f"--warmup-steps {warmup} leaves no update after the warm-up "
                         f"({total_updates} updates in the run)")
    return functools.partial(_lambda_lr, name, total_updates, warmup, floor)
