"""Learning-rate schedules by name, for the command line and the studies. The Python API takes
any ``torch.optim.lr_scheduler`` factory instead; these build a ``LambdaLR``.

* ``constant``: the peak lr throughout (no scheduler).
* ``warmup-cosine``: linear warm-up from lr/W to the peak over the first W updates, then cosine
  decay to ``floor`` (default 10%) of the peak at the last update.
* ``step``: linear warm-up over W updates (if any), then the peak, times 0.1 from half of the
  updates on and 0.01 from three quarters on.

``warmup_steps`` defaults to 5% of the updates for ``warmup-cosine`` (at least 1, at most a third
of them: none in a run of one or two updates, so that a short run keeps updates after it) and 0
for ``step``.
This module imports torch only when a factory is called, so the command line can list the
names without loading it.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

LR_SCHEDULES = ("constant", "warmup-cosine", "step")
#: warmup-cosine's default warm-up: this share of the run's updates, at least 1, at most
#: ``1 / WARMUP_MOST`` of them
WARMUP_SHARE, WARMUP_MOST = 0.05, 3


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
    """The warm-up of a run of ``total`` updates: ``warmup_steps`` where given, else the
    schedule's own, scaled to the run (see the module's docstring)."""
    if warmup_steps is not None:
        return warmup_steps
    if name != "warmup-cosine":
        return 0
    return min(max(1, round(WARMUP_SHARE * total)), total // WARMUP_MOST)


def warmup_note(name: str, total: int, warmup_steps: Optional[int]) -> Optional[str]:
    """What a run says of its warm-up where the schedule's own was cut to fit a short run of
    ``total`` updates (None where it was not, or ``warmup_steps`` was given)."""
    if warmup_steps is not None or name != "warmup-cosine" or total // WARMUP_MOST >= 1:
        return None
    return (f"no warm-up: a run of {_updates(total)} is too short for the recipe's ({WARMUP_SHARE * 100:g} % of "
            f"the updates, at least 1, at most a third of them; --warmup-steps W sets it)")


def _updates(count: int) -> str:
    return f"{count} update" + ("" if count == 1 else "s")


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
    if warmup >= total_updates:  # only one given: the default fits the run
        fewer = f"--warmup-steps {total_updates - 1}" + (" or fewer" if total_updates > 2 else "")
        raise ValueError(f"--warmup-steps {warmup} leaves no update after the warm-up "
                         f"({_updates(total_updates)} in the run): give {fewer}, or a longer run "
                         f"(more --epochs, a larger --limit)")
    return functools.partial(_lambda_lr, name, total_updates, warmup, floor)
