"""Interleaved 1F1B (Megatron-LM): each rank holds ``v`` model chunks, stage ``c*N + r`` on rank r.

Micro-batches go through the ranks in groups of N, one chunk at a time, so a rank can start its
second chunk while later ranks still work on the first: the bubble shrinks by a factor v at the
price of v times more messages. Needs M to be a multiple of N, as Megatron does.
"""
from __future__ import annotations

from .actions import Action, Kind, Schedule, U, check_positive


def interleaved_1f1b(num_ranks: int, microbatches: int, chunks: int = 2, batches: int = 1) -> Schedule:
    check_positive(stages=num_ranks, microbatches=microbatches, chunks=chunks, batches=batches)
    if microbatches % num_ranks:
        raise ValueError(f"interleaved-1f1b needs micro-batches to be a multiple of the ranks "
                         f"(got M={microbatches}, N={num_ranks}); try micro_batches="
                         f"{num_ranks * max(1, microbatches // num_ranks)} (--micro-batches)")
    n, v, m = num_ranks, chunks, microbatches
    total = m * v  # virtual steps per rank and mini-batch

    def virtual(step: int, backward: bool, rank: int, base: int) -> Action:
        chunk = (step // n) % v
        if backward:
            chunk = v - 1 - chunk
        micro = (step // (n * v)) * n + step % n
        return Action(chunk * n + rank, Kind.B if backward else Kind.F, base + micro)

    orders = []
    for rank in range(n):
        warmup = min((n - rank - 1) * 2 + (v - 1) * n, total)
        order = []
        for t in range(batches):
            base = t * m
            order += [virtual(i, False, rank, base) for i in range(warmup)]
            for j in range(total - warmup):
                order += [virtual(warmup + j, False, rank, base), virtual(j, True, rank, base)]
            order += [virtual(j, True, rank, base) for j in range(total - warmup, total)]
            order += [U(c * n + rank, t) for c in range(v)]
        orders.append(order)
    stages = n * v
    return Schedule("interleaved-1f1b", stages, n, batches * m, m, orders,
                    stage_to_rank=[s % n for s in range(stages)], pipelines=[list(range(stages))],
                    synchronous=True, options={"chunks": v})
