"""Asynchronous 1F1B (PipeDream, PipeOptim, SpecTrain, XPipe): no flush, an update per window.

The orders, and the staleness ``min(t, w_k)`` of mini-batch t's forward at stage k with one
micro-batch per update, that weight stashing and weight prediction deal with: (docs/architecture.md,
"Schedules as data")."""
from __future__ import annotations

from .actions import Kind, Schedule, actions_of, check_positive, straight


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
        warmup = min(num_stages - 1 - stage, total)
        forwards = actions_of(stage, Kind.F, range(total))
        backwards = actions_of(stage, Kind.B, range(total))
        updates = actions_of(stage, Kind.U, range(batches))
        order = forwards[:warmup]
        for j in range(total):  # F(warmup + j) while forwards remain, B(j), U when a window ends
            if warmup + j < total:
                order.append(forwards[warmup + j])
            order.append(backwards[j])
            if (j + 1) % m == 0:
                order.append(updates[j // m])
        orders.append(order)
    return Schedule(name, num_stages, num_stages, total, m, orders, synchronous=False,
                    options={"microbatches_per_update": m}, **straight(num_stages))
