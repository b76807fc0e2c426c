"""1F1B with a flush (DAPPLE, PipeDream-Flush) and its flushed relatives: GPipe, interleaved 1F1B
(Megatron-LM) and ZB-H1 (zero bubble), each mini-batch ending in every stage's update."""
from __future__ import annotations

from typing import List

from ..errors import option
from .actions import Action, Kind, Schedule, actions_of, check_positive, one_f_one_b, straight
from .concat import repeat

_F, _B, _I, _W, _U = Kind.F, Kind.B, Kind.I, Kind.W, Kind.U


def gpipe(num_stages: int, microbatches: int, batches: int = 1) -> Schedule:
    """All forwards of a mini-batch, then all backwards in micro-batch order (as
    ``torch.distributed.pipelining.ScheduleGPipe``), then the update."""
    check_positive(stages=num_stages, microbatches=microbatches, batches=batches)
    n, m = num_stages, microbatches
    orders = [actions_of(k, _F, range(m)) + actions_of(k, _B, range(m)) + [Action(k, _U, 0)] for k in range(n)]
    return repeat(Schedule("gpipe", n, n, m, m, orders, synchronous=True, **straight(n)), batches)


def one_f_one_b_flush(num_stages: int, microbatches: int, batches: int = 1) -> Schedule:
    """Stage k runs ``min(N-1-k, M)`` warm-up forwards, then forward/backward pairs, then the
    remaining backwards, then its update. Stage k never holds more than ``N-k`` micro-batches'
    activations (GPipe holds ``M``)."""
    check_positive(stages=num_stages, microbatches=microbatches, batches=batches)
    n, m = num_stages, microbatches
    orders = [one_f_one_b(actions_of(k, _F, range(m)), [[b] for b in actions_of(k, _B, range(m))], min(n - 1 - k, m))
              + [Action(k, _U, 0)] for k in range(n)]
    return repeat(Schedule("1f1b-flush", n, n, m, m, orders, synchronous=True, **straight(n)), batches)


def interleaved_1f1b(num_ranks: int, microbatches: int, chunks: int = 2, batches: int = 1) -> Schedule:
    """Interleaved 1F1B: each rank holds ``v`` model chunks, stage ``c*N + r`` on rank r.

    Micro-batches go through the ranks in groups of N, one chunk at a time, so a rank can start
    its second chunk while later ranks still work on the first: the bubble shrinks by a factor v
    at the price of v times more messages. Needs M to be a multiple of N, as Megatron does."""
    check_positive(stages=num_ranks, microbatches=microbatches, chunks=chunks, batches=batches)
    if microbatches % num_ranks:
        raise ValueError(f"interleaved-1f1b needs micro-batches to be a multiple of the ranks "
                         f"(got M={microbatches}, N={num_ranks}); try "
                         f"{option('micro_batches', num_ranks * max(1, microbatches // num_ranks))}")
    n, v, m = num_ranks, chunks, microbatches
    total = m * v  # virtual steps per rank and mini-batch

    def virtual(step: int, backward: bool, rank: int) -> Action:
        chunk = (step // n) % v
        if backward:
            chunk = v - 1 - chunk
        return Action(chunk * n + rank, _B if backward else _F, (step // (n * v)) * n + step % n)

    orders: List[List[Action]] = []
    for rank in range(n):
        forwards = [virtual(i, False, rank) for i in range(total)]
        steps = [[virtual(j, True, rank)] for j in range(total)]
        warmup = min((n - rank - 1) * 2 + (v - 1) * n, total)
        orders.append(one_f_one_b(forwards, steps, warmup) + [Action(c * n + rank, _U, 0) for c in range(v)])
    stages = n * v
    return repeat(Schedule("interleaved-1f1b", stages, n, m, m, orders, stage_to_rank=[s % n for s in range(stages)],
                           pipelines=[list(range(stages))], synchronous=True, options={"chunks": v}), batches)


def zb_h1(num_stages: int, microbatches: int, batches: int = 1) -> Schedule:
    """ZB-H1 (Qi et al., zero bubble pipeline parallelism): 1F1B with the backward split in two.

    ``I`` computes the input gradient, which the previous stage waits for; ``W`` computes the
    weight gradient, which nobody waits for. Stage k runs 1F1B with I in place of B and defers
    its W's by k micro-batches, so the chain of input gradients reaches stage 0 sooner and the
    deferred W's fill the cool-down. Stage k then holds up to N micro-batches' activations, the
    same peak as stage 0 of 1F1B: the same memory, a smaller bubble."""
    check_positive(stages=num_stages, microbatches=microbatches, batches=batches)
    n, m = num_stages, microbatches
    orders: List[List[Action]] = []
    for k in range(n):
        delay = min(k, m)
        steps = [[Action(k, _I, j)] + ([Action(k, _W, j - delay)] if j >= delay else []) for j in range(m)]
        order = one_f_one_b(actions_of(k, _F, range(m)), steps, min(n - 1 - k, m))
        orders.append(order + actions_of(k, _W, range(m - delay, m)) + [Action(k, _U, 0)])
    return repeat(Schedule("zb-h1", n, n, m, m, orders, synchronous=True, **straight(n)), batches)
