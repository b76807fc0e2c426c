"""ZB-V: two model chunks per rank in a V shape, with split backwards (zero bubble, V schedule).

The placement (rank 0 holds the first and the last stage, rank N - 1 the two middle ones, whose
boundary stays in one process) and the halves ``I`` and ``W``: (docs/architecture.md, "Chunks:
several stages per process" and "Split backward"). The orders are those of a list schedule with
unit costs (F = I = W = 1, no transfer time): at each step every rank runs the ready action it
prefers: an ``I`` (the oldest micro-batch first), then a forward of its second chunk, then a
forward of its first chunk while fewer than N micro-batches it started there are in flight (not
yet through its ``W``), then a ``W``. An order read off an execution respects every dependency,
so it cannot deadlock. Each mini-batch ends with a flush and one update per stage: the result
equals non-pipelined training. (torch's ``ScheduleZBVZeroBubble`` uses a hand-written pattern;
this one is derived, same placement.)"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

from .actions import Action, Kind, Schedule, check_positive
from .concat import repeat


def v_placement(num_ranks: int) -> List[int]:
    """The rank of each of the 2N stages: 0, 1, ..., N-1, N-1, ..., 1, 0."""
    return [s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(2 * num_ranks)]


def _one_batch(n: int, m: int) -> List[List[Tuple[int, Kind, int]]]:
    """Per rank, the (stage, kind, micro-batch) it runs for one mini-batch of ``m``."""
    last = 2 * n - 1
    rank_of = v_placement(n)
    done: Set[Tuple[int, Kind, int]] = set()
    left = {(s, kind, i) for s in range(2 * n) for kind in (Kind.F, Kind.I, Kind.W) for i in range(m)}
    in_flight: Dict[int, int] = {r: 0 for r in range(n)}  # first-chunk micro-batches started, W not run
    orders: List[List[Tuple[int, Kind, int]]] = [[] for _ in range(n)]

    def ready(s: int, kind: Kind, i: int) -> bool:
        if kind is Kind.F:
            return s == 0 or (s - 1, Kind.F, i) in done
        if kind is Kind.I:
            return (s, Kind.F, i) in done and (s == last or (s + 1, Kind.I, i) in done)
        return (s, Kind.I, i) in done

    while left:
        picked = []
        for r in range(n):
            first, second = r, last - r  # the rank's two stages, in chain order
            options = [a for a in left if rank_of[a[0]] == r and ready(*a)]
            if not options:
                continue

            def best(kind: Kind, stages: Tuple[int, ...]):
                found = [a for a in options if a[1] is kind and a[0] in stages]
                # the oldest micro-batch first; among backwards, the later stage first
                return min(found, key=lambda a: (a[2], -a[0])) if found else None

            choice = (best(Kind.I, (first, second)) or best(Kind.F, (second,))
                      or (best(Kind.F, (first,)) if in_flight[r] < n else None)
                      or best(Kind.W, (first, second)))
            if choice is None:
                continue
            picked.append(choice)
            orders[r].append(choice)
            if choice[1] is Kind.F and choice[0] == first:
                in_flight[r] += 1
            elif choice[1] is Kind.W and choice[0] == first:
                in_flight[r] -= 1
        if not picked:  # cannot happen for a valid dependency graph; say so rather than loop
            raise RuntimeError(f"zb-v list schedule made no progress at N={n}, M={m}")
        for a in picked:
            left.discard(a)
            done.add(a)
    return orders


def zb_v(num_ranks: int, microbatches: int, batches: int = 1) -> Schedule:
    """ZB-V over ``num_ranks`` ranks (2N stages), ``microbatches`` per mini-batch."""
    check_positive(stages=num_ranks, microbatches=microbatches, batches=batches)
    return v_schedule("zb-v", num_ranks, microbatches, batches, _one_batch(num_ranks, microbatches))


def v_schedule(name: str, num_ranks: int, microbatches: int, batches: int, one: Sequence[Sequence[Tuple]],
               pairs: Optional[Dict[Action, Action]] = None) -> Schedule:
    """On the V placement, per rank its (stage, kind, micro-batch) of one mini-batch (``one``;
    ``pairs`` among them) then its two stages' updates, for each of ``batches`` mini-batches."""
    n = num_ranks
    orders = [list(map(Action._make, order)) + [Action(s, Kind.U, 0) for s in sorted((r, 2 * n - 1 - r))]
              for r, order in enumerate(one)]
    return repeat(Schedule(name, 2 * n, n, microbatches, microbatches, orders, stage_to_rank=v_placement(n),
                           pipelines=[list(range(2 * n))], synchronous=True, options={"chunks": 2},
                           pairs=dict(pairs or {})), batches)
