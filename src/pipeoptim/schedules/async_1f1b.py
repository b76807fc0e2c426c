"""Asynchronous 1F1B (PipeDream, PipeOptim, SpecTrain, XPipe): no flush, an update per window;
and PipeDream-2BW's, the same over m >= N micro-batches per update.

The orders, and the staleness ``min(t, w_k)`` of mini-batch t's forward at stage k with one
micro-batch per update, that weight stashing and weight prediction deal with: (docs/architecture.md,
"Schedules as data"). With 2BW's windows, window t runs on version t-1 (the older of two
buffers), whatever the depth: a delay of one update ("Weight versions per method")."""
from __future__ import annotations

from ..errors import option
from .actions import Action, Kind, Schedule, actions_of, check_positive, one_f_one_b, straight


def async_1f1b(num_stages: int, batches: int, microbatches_per_update: int = 1,
               *, name: str = "async-1f1b") -> Schedule:
    """``batches`` update windows of ``microbatches_per_update`` micro-batches, drained at the end.

    A continuous run over several epochs is one call with ``batches`` = all windows of all epochs.
    """
    check_positive(stages=num_stages, batches=batches, microbatches_per_update=microbatches_per_update)
    m = microbatches_per_update
    total = batches * m
    orders = []
    for stage in range(num_stages):
        steps = [[b] for b in actions_of(stage, Kind.B, range(total))]
        for u in range(batches):  # U when a window's last backward has run
            steps[(u + 1) * m - 1].append(Action(stage, Kind.U, u))
        orders.append(one_f_one_b(actions_of(stage, Kind.F, range(total)), steps, min(num_stages - 1 - stage, total)))
    return Schedule(name, num_stages, num_stages, total, m, orders, synchronous=False,
                    options={"microbatches_per_update": m}, **straight(num_stages))


def two_bw(num_stages: int, microbatches: int, batches: int = 1) -> Schedule:
    """PipeDream-2BW: asynchronous 1F1B over micro-batches, one update every m >= N."""
    if microbatches < num_stages:
        raise ValueError(f"2bw needs micro-batches per update m >= stages N (got m={microbatches}, "
                         f"N={num_stages}); with fewer, a window's forwards would need a third "
                         f"weight version. Use {option('micro_batches', num_stages)} or more.")
    return async_1f1b(num_stages, batches, microbatches, name="2bw")
