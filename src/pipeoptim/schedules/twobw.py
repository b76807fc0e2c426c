"""PipeDream-2BW: asynchronous 1F1B over micro-batches, one update every m >= N micro-batches.

Window t runs on version t-1 (the older of two buffers), whatever the depth: a delay of one
update (docs/architecture.md, "Weight versions per method")."""
from __future__ import annotations

from .actions import Schedule
from .async_1f1b import async_1f1b


def two_bw(num_stages: int, microbatches: int, batches: int = 1) -> Schedule:
    if microbatches < num_stages:
        raise ValueError(f"2bw needs micro-batches per update m >= stages N (got m={microbatches}, "
                         f"N={num_stages}); with fewer, a window's forwards would need a third "
                         f"weight version. Use micro_batches={num_stages} or more (--micro-batches).")
    return async_1f1b(num_stages, batches, microbatches, name="2bw")
