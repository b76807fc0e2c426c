"""1F1B with a flush (DAPPLE, PipeDream-Flush): warm-up, alternate, drain, then one update."""
from __future__ import annotations

from .actions import B, F, Schedule, U, check_positive, straight


def one_f_one_b_flush(num_stages: int, microbatches: int, batches: int = 1) -> Schedule:
    """Stage k runs ``min(N-1-k, M)`` warm-up forwards, then forward/backward pairs, then the
    remaining backwards, then its update; the same for each of ``batches`` mini-batches.

    Stage k never holds more than ``N-k`` micro-batches' activations (GPipe holds ``M``).
    """
    check_positive(stages=num_stages, microbatches=microbatches, batches=batches)
    orders = []
    for stage in range(num_stages):
        warmup = min(num_stages - 1 - stage, microbatches)
        order = []
        for t in range(batches):
            base = t * microbatches
            order += [F(stage, base + i) for i in range(warmup)]
            for j in range(microbatches - warmup):
                order += [F(stage, base + warmup + j), B(stage, base + j)]
            order += [B(stage, base + j) for j in range(microbatches - warmup, microbatches)]
            order.append(U(stage, t))
        orders.append(order)
    return Schedule("1f1b-flush", num_stages, num_stages, batches * microbatches, microbatches,
                    orders, synchronous=True, **straight(num_stages))
