"""Bidirectional pipelines (Chimera, BitPipe style): two pipelines run in opposite directions.

Rank r holds stage r of the "down" pipeline (model stages 0..N-1) and stage N-1-r of the "up"
pipeline (model stages N..2N-1; stage N+j is the up pipeline's j-th stage, a replica of model
stage j). The down pipeline takes the first half of a mini-batch's micro-batches, the up
pipeline the rest, and each fills the other's bubbles. The two replicas of a model stage sum
their gradients before the update (an all-reduce the simulator does not charge for).

The order is found by list scheduling against the given costs: whenever a rank is free it runs
the ready action that can start first, backwards before forwards, and a stage at position p of
its pipeline starts a forward only while it holds fewer than N-p micro-batches, 1F1B's bound.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from .actions import Action, B, F, Kind, Schedule, U, check_positive
from .deps import schedule_dependencies
from .simulate import Costs


def bidirectional(num_ranks: int, microbatches: int, batches: int = 1,
                  costs: Optional[Costs] = None) -> Schedule:
    check_positive(stages=num_ranks, microbatches=microbatches, batches=batches)
    if microbatches % 2:
        raise ValueError(f"bidirectional needs an even number of micro-batches (got {microbatches}), "
                         f"half for each direction")
    n, m = num_ranks, microbatches
    down, up = list(range(n)), list(range(n, 2 * n))
    stage_to_rank = list(range(n)) + [n - 1 - j for j in range(n)]
    costs = costs or Costs.uniform(2 * n)
    position = {s: s for s in down} | {n + j: j for j in range(n)}
    orders: List[List[Action]] = [[] for _ in range(n)]
    for t in range(batches):
        base = t * m
        micro = {s: list(range(base, base + m // 2)) for s in down}
        micro |= {s: list(range(base + m // 2, base + m)) for s in up}
        skeleton = Schedule("bidirectional", 2 * n, n, batches * m, m,
                            [[F(s, i) for s in range(2 * n) if stage_to_rank[s] == r for i in micro[s]]
                             for r in range(n)],
                            stage_to_rank=stage_to_rank, pipelines=[down, up], synchronous=True)
        deps_of = schedule_dependencies(skeleton)
        forwarded = {s: 0 for s in range(2 * n)}
        backwarded = {s: 0 for s in range(2 * n)}
        end: Dict[tuple, float] = {}
        free_at = [0.0] * n
        for _ in range(2 * n * (m // 2) * 2):
            best = None
            for s in range(2 * n):
                rank, mics = stage_to_rank[s], micro[s]
                candidates = []
                if backwarded[s] < len(mics):
                    candidates.append(B(s, mics[backwarded[s]]))
                if forwarded[s] < len(mics) and forwarded[s] - backwarded[s] < n - position[s]:
                    candidates.append(F(s, mics[forwarded[s]]))
                for action in candidates:
                    deps = deps_of(action)
                    if any(d not in end for d in deps):
                        continue
                    start = free_at[rank]
                    for d in deps:
                        start = max(start, end[d] + (costs.comm if stage_to_rank[d[0]] != rank else 0.0))
                    is_forward = action.kind is Kind.F
                    key = (start, is_forward, -position[s] if is_forward else position[s], rank)
                    if best is None or key < best[0]:
                        best = (key, rank, action, start)
            _, rank, action, start = best
            end[action] = start + costs.of(action)
            free_at[rank] = end[action]
            orders[rank].append(action)
            (forwarded if action.kind is Kind.F else backwarded)[action.stage] += 1
        for rank in range(n):  # in the order of their pieces, on every rank: the two replicas of
            # a piece (ranks j and N-1-j) reach their update at the same point of their orders
            pieces = sorted([rank, 2 * n - 1 - rank], key=lambda s: s % n)
            orders[rank] += [U(s, t) for s in pieces]
    return Schedule("bidirectional", 2 * n, n, batches * m, m, orders, stage_to_rank=stage_to_rank,
                    pipelines=[down, up], synchronous=True)
