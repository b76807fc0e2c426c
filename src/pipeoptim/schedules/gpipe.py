"""GPipe: all forwards of a mini-batch's micro-batches, then all backwards, then one update."""
from __future__ import annotations

from .actions import B, F, Schedule, U, check_positive, straight


def gpipe(num_stages: int, microbatches: int, batches: int = 1) -> Schedule:
    """``batches`` mini-batches of ``microbatches`` micro-batches each, a flush before every update.

    Backwards run in micro-batch order, as in ``torch.distributed.pipelining.ScheduleGPipe``.
    """
    check_positive(stages=num_stages, microbatches=microbatches, batches=batches)
    orders = []
    for stage in range(num_stages):
        order = []
        for t in range(batches):
            window = range(t * microbatches, (t + 1) * microbatches)
            order += [F(stage, i) for i in window]
            order += [B(stage, i) for i in window]
            order.append(U(stage, t))
        orders.append(order)
    return Schedule("gpipe", num_stages, num_stages, batches * microbatches, microbatches, orders,
                    synchronous=True, **straight(num_stages))
