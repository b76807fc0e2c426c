"""The schedules of two model chunks per rank on the V placement (ZB-V and DualPipeV).

The placement (:func:`v_placement`: rank r holds stage r, its *first* chunk, and stage 2N-1-r,
its *second*; rank N - 1 the two middle ones, whose boundary stays in one process) and the
halves ``I`` and ``W``: (docs/architecture.md, "Chunks: several stages per process" and "Split
backward"). Each mini-batch ends with a flush and one update per stage: the result equals
non-pipelined training.

**ZB-V** (zero bubble, V schedule): the orders are those of a list schedule with unit costs
(F = I = W = 1, no transfer time): at each step every rank runs the ready action it prefers: an
``I`` (the oldest micro-batch first), then a forward of its second chunk, then a forward of its
first chunk while fewer than N micro-batches it started there are in flight (not yet through its
``W``), then a ``W``. An order read off an execution respects every dependency, so it cannot
deadlock. (torch's ``ScheduleZBVZeroBubble`` uses a hand-written pattern; this one is derived,
same placement.)

**DualPipeV**: DeepSeek-V3's DualPipe folded into a V, the forward of one micro-batch run
together with the backward of another on the same rank. The order of one mini-batch of
M >= 2N micro-batches on rank r, in eight phases (the shape of torch's ``ScheduleDualPipeV``,
which DeepSeek's open DualPipe defines):

1. 2(N-1-r) forwards of the first chunk;
2. r+1 times: a forward of the first chunk, then one of the second;
3. N-1-r times: the second chunk's input half ``I``, the oldest weight half ``W`` pending, a
   forward of the second chunk;
4. M-2N+r+1 times: a forward of the first chunk *paired* with a whole backward ``B`` of the
   second (on the last rank the first such pair runs as two plain actions), then a forward of the
   second paired with a backward of the first;
5. N-1-r times: a backward of the second chunk, then a forward of the second paired with a
   backward of the first;
6. r+1 times: a backward of the second chunk, then one of the first; from the middle of the
   phase on (the second chunk's first on an odd rank, the first chunk's on an even one) they are
   split, their ``W`` left for later;
7. N-1-r times: a pending ``W``, a backward of the first chunk (split if phase 6 split);
8. r+1 pending ``W``.

Each chunk takes its micro-batches in order, forwards and backwards alike, and a ``W`` runs the
oldest pending one. A pair (``Schedule.pairs``, torch's ``OVERLAP_F_B``) names two independent
passes on two chunks; the executor runs the forward, then the backward (where a GPU build would
overlap them: ``runtime/executor.py``), so this order trains exactly as zb-v's does."""
from __future__ import annotations

from collections import deque
from typing import Dict, List, Optional, Sequence, Set, Tuple

from .actions import Action, Kind, Schedule, check_positive
from .concat import repeat

_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W


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


# -- DualPipeV --------------------------------------------------------------------------------------
def _rank_order(n: int, m: int, r: int) -> Tuple[List[Action], Dict[Action, Action]]:
    """Rank ``r``'s actions of one mini-batch and its pairs (forward -> backward)."""
    first, second = r, 2 * n - 1 - r
    order: List[Action] = []
    pairs: Dict[Action, Action] = {}
    forwards = {first: 0, second: 0}   # the next micro-batch of each chunk's forward
    backwards = {first: 0, second: 0}  # ... and of its backward (whole or input half)
    pending: deque = deque()           # input halves whose weight half has not run

    def forward(stage: int) -> Action:
        a = Action(stage, _F, forwards[stage])
        forwards[stage] += 1
        order.append(a)
        return a

    def backward(stage: int, split: bool = False) -> Action:
        a = Action(stage, _I if split else _B, backwards[stage])
        backwards[stage] += 1
        order.append(a)
        if split:
            pending.append(Action(stage, _W, a.index))
        return a

    def weight() -> None:
        if pending:
            order.append(pending.popleft())

    def pair(f_stage: int, b_stage: int) -> None:
        f = forward(f_stage)
        pairs[f] = backward(b_stage)

    for _ in range(2 * (n - 1 - r)):
        forward(first)
    for _ in range(r + 1):
        forward(first)
        forward(second)
    for _ in range(n - 1 - r):
        backward(second, split=True)
        weight()
        forward(second)
    for step in range(m - 2 * n + r + 1):
        if step == 0 and r == n - 1:  # the turn of the V: the two run as plain actions
            forward(first)
            backward(second)
        else:
            pair(first, second)
        pair(second, first)
    for _ in range(n - 1 - r):
        backward(second)
        pair(second, first)
    split, middle = False, (r + 1) // 2
    for step in range(r + 1):
        split = split or (step == middle and r % 2 == 1)
        backward(second, split)
        split = split or (step == middle and r % 2 == 0)
        backward(first, split)
    for _ in range(n - 1 - r):
        weight()
        backward(first, split)
    for _ in range(r + 1):
        weight()
    return order, pairs


def _kept(order: List[Action], pairs: Dict[Action, Action], m: int) -> Tuple[List[Action], Dict[Action, Action]]:
    """The order and pairs of micro-batches below ``m`` only (a pair missing one half: a plain action)."""
    return ([a for a in order if a.index < m],
            {f: b for f, b in pairs.items() if f.index < m and b.index < m})


def dualpipev(num_ranks: int, microbatches: int, batches: int = 1) -> Schedule:
    """DualPipeV over ``num_ranks`` ranks (2N stages), ``microbatches`` per mini-batch,
    ``batches`` mini-batches, each ending with one update per stage. With fewer than 2N
    micro-batches (which torch refuses) the order of 2N with the others left out: leaving out
    whole micro-batches keeps an order free of deadlock."""
    check_positive(stages=num_ranks, microbatches=microbatches, batches=batches)
    n, m = num_ranks, microbatches
    one = [_kept(*_rank_order(n, max(m, 2 * n), r), m) for r in range(n)]
    pairs = {f: b for _, rank_pairs in one for f, b in rank_pairs.items()}
    return v_schedule("dualpipev", n, m, batches, [order for order, _ in one], pairs)
