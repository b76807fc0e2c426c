"""Bidirectional pipelines: two pipelines of the same model pieces run in opposite directions.

Two placements (docs/architecture.md, "Bidirectional pipelines"):

* ``bidirectional`` (Chimera's shape): N pieces, each pipeline one stage per rank. Rank r holds
  stage r of the "down" pipeline (stages 0..N-1) and stage N-1-r of the "up" pipeline (stages
  N..2N-1; stage N+j is the up pipeline's j-th stage, a replica of stage j).
* ``bitpipe`` (BitPipe's shape): 2N pieces, each pipeline a V over the ranks. The down pipeline
  (stages 0..2N-1) goes 0, 1, ..., N-1, N-1, ..., 0, as ZB-V places it; the up pipeline
  (stages 2N..4N-1, stage 2N+j a replica of stage j) goes N-1, ..., 0, 0, ..., N-1. Each V's
  turn is two stages on one rank: a hand-off in memory, no message. Rank r holds four stages,
  and the same four pieces as rank N-1-r.

The down pipeline takes the first half of a mini-batch's micro-batches, the up pipeline the
rest, and each fills the other's bubbles. The two replicas of a piece sum their gradients before
the update (an all-reduce the simulator does not charge for).

The order is found by list scheduling against the given costs: whenever a rank is free it runs
the ready action that can start first, backwards before forwards, and a stage at position p of
its pipeline of L stages starts a forward only while it holds fewer than L-p micro-batches,
1F1B's bound. An order read off such an execution respects every dependency, so it cannot
deadlock. Each rank ends each mini-batch with its stages' updates in the order of their pieces,
so the two replicas of a piece reach their update at the same point of their ranks' orders.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from .actions import Action, Kind, Schedule, check_positive
from .deps import schedule_dependencies
from .simulate import Costs
from .v_shape import v_placement


def bidirectional_placement(num_ranks: int) -> List[int]:
    """The rank of each of ``bidirectional``'s 2N stages: 0, 1, ..., N-1, then N-1, ..., 0."""
    return list(range(num_ranks)) + [num_ranks - 1 - j for j in range(num_ranks)]


def bitpipe_placement(num_ranks: int) -> List[int]:
    """The rank of each of ``bitpipe``'s 4N stages: the down V (0 .. N-1 .. 0), then the up V
    (N-1 .. 0 .. N-1)."""
    down = v_placement(num_ranks)
    return down + [num_ranks - 1 - r for r in down]


def bidirectional(num_ranks: int, microbatches: int, batches: int = 1,
                  costs: Optional[Costs] = None) -> Schedule:
    """Chimera's two pipelines of N pieces over ``num_ranks`` ranks (2N stages)."""
    return _two_pipelines("bidirectional", num_ranks, microbatches, batches, costs,
                          bidirectional_placement)


def bitpipe(num_ranks: int, microbatches: int, batches: int = 1,
            costs: Optional[Costs] = None) -> Schedule:
    """BitPipe's two V-shaped pipelines of 2N pieces over ``num_ranks`` ranks (4N stages)."""
    return _two_pipelines("bitpipe", num_ranks, microbatches, batches, costs, bitpipe_placement)


def _two_pipelines(name: str, num_ranks: int, microbatches: int, batches: int,
                   costs: Optional[Costs], placement) -> Schedule:
    check_positive(stages=num_ranks, microbatches=microbatches, batches=batches)
    if microbatches % 2:
        raise ValueError(f"{name} needs an even number of micro-batches (got {microbatches}), "
                         f"half for each direction")
    n, m = num_ranks, microbatches
    stage_to_rank = placement(n)
    stages = len(stage_to_rank)
    # every mini-batch is flushed and priced alike, so each gets mini-batch 0's order, its
    # micro-batches and update shifted (found once: the search is the costly part)
    first = _one_batch(name, m, stage_to_rank, costs or Costs.uniform(stages))
    orders: List[List[Action]] = [[] for _ in range(n)]
    for t in range(batches):
        for rank in range(n):
            orders[rank] += [Action(a.stage, a.kind, t if a.kind is Kind.U else a.index + t * m) for a in first[rank]]
    return Schedule(name, stages, n, batches * m, m, orders, stage_to_rank=stage_to_rank,
                    pipelines=_pipelines(stages), synchronous=True)


def _pipelines(stages: int) -> List[List[int]]:
    """The down pipeline's stages, then the up pipeline's (half of them each)."""
    return [list(range(stages // 2)), list(range(stages // 2, stages))]


def _one_batch(name: str, m: int, stage_to_rank: List[int], costs: Costs) -> List[List[Action]]:
    """Each rank's order of mini-batch 0 (micro-batches 0..m-1, update 0), by list scheduling."""
    n, stages = max(stage_to_rank) + 1, len(stage_to_rank)
    length = stages // 2  # stages per pipeline
    down, up = _pipelines(stages)
    position = {s: s % length for s in range(stages)}
    micro = {s: list(range(m // 2)) for s in down}
    micro |= {s: list(range(m // 2, m)) for s in up}
    skeleton = Schedule(name, stages, n, m, m,
                        [[Action(s, Kind.F, i) for s in range(stages) if stage_to_rank[s] == r for i in micro[s]]
                         for r in range(n)],
                        stage_to_rank=stage_to_rank, pipelines=[down, up], synchronous=True)
    deps_of = schedule_dependencies(skeleton)
    forwarded = {s: 0 for s in range(stages)}
    backwarded = {s: 0 for s in range(stages)}
    end: Dict[tuple, float] = {}
    free_at = [0.0] * n
    orders: List[List[Action]] = [[] for _ in range(n)]
    for _ in range(stages * (m // 2) * 2):
        best = None
        for s in range(stages):
            rank, mics = stage_to_rank[s], micro[s]
            candidates = []
            if backwarded[s] < len(mics):
                candidates.append(Action(s, Kind.B, mics[backwarded[s]]))
            if forwarded[s] < len(mics) and forwarded[s] - backwarded[s] < length - position[s]:
                candidates.append(Action(s, Kind.F, mics[forwarded[s]]))
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
    for rank in range(n):  # in the order of their pieces, on every rank
        pieces = sorted((s for s in range(stages) if stage_to_rank[s] == rank), key=lambda s: (s % length, s))
        orders[rank] += [Action(s, Kind.U, 0) for s in pieces]
    return orders
