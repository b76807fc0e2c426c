"""DualPipeV: two model chunks per rank in a V, a forward paired with another micro-batch's backward.

DeepSeek-V3's DualPipe folded into a V (as zb-v's placement), the forward of one micro-batch
run together with the backward of another on the same rank.

Placement: zb-v's (``zbv.v_placement``): rank r holds stage r (its *first* chunk) and stage
2N-1-r (its *second*). The order of one mini-batch of M >= 2N micro-batches on rank r, in eight
phases (the shape of torch's ``ScheduleDualPipeV``, which DeepSeek's open DualPipe defines):

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
overlap them: ``runtime/executor.py``), so this order trains exactly as zb-v's does, equal to
sequential training. Each mini-batch ends with a flush and one update per stage."""
from __future__ import annotations

from collections import deque
from typing import Dict, List, Tuple

from .actions import Action, Kind, Schedule, check_positive
from .zbv import v_schedule

_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W


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
