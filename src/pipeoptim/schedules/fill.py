"""Forward-only work in a synchronous schedule's bubbles: an evaluation's micro-batches placed
into the idle time of the first mini-batch after the weights they evaluate.

``E(k, j)`` is stage k's forward of evaluation micro-batch j (numbered on their own, from 0). In a
synchronous schedule stage k holds the same weights from the start of the schedule (a drain) to
its first update ``U(k, 0)``, so an ``E(k, j)`` run anywhere before that update, after
``E(k-1, j)``, computes what a drained evaluation before the schedule computes. The update itself
may move later: nothing but stage k's next forward (of mini-batch 1) waits for it, so the region
an ``E`` may use on stage k runs from the schedule's start to that forward's start, less the
update's cost (docs/architecture.md, "Evaluation in the bubbles").

:func:`plan_fill` places the E actions by list scheduling against costs: each evaluation
micro-batch in turn, each stage in chain order, into the first idle gap of that stage (from the
simulated timeline of the schedule) after its last forward of mini-batch 0 that holds its cost
after its previous stage's ``E`` has ended (so every link carries mini-batch 0's activations,
then the evaluation's in order, then mini-batch 1's: the distributed executor's links deliver in
the order sent). A micro-batch whose every ``E`` lands in a gap is *filled*: it moves no training action,
so the schedule's makespan stays. Where no gap holds an ``E``, it goes after the stage's last
backward of mini-batch 0, before the update (the rest, which delays the next mini-batch by about
what draining for it would cost). The plan reads only mini-batch 0 and the first forward of
mini-batch 1, so that one plan serves the schedule built for any number of mini-batches (the
streaming property the executors rely on: docs/architecture.md, "Schedules as data").
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from .actions import Action, Kind, Schedule
from .simulate import Costs, simulate


@dataclass(frozen=True)
class FillPlan:
    """Where the E actions of ``evaluations`` micro-batches go: ``before[rank]`` maps an action of
    that rank's order to the E actions inserted right before it, in order. ``filled``: the
    micro-batches whose every E runs in idle time (the first ``filled`` of them; the rest delay
    the schedule). ``starts``: the planned start of each E, for tests and the renderers."""

    evaluations: int
    filled: int
    before: Tuple[Dict[Action, Tuple[Action, ...]], ...]
    starts: Dict[Action, float]

    def apply(self, schedule: Schedule) -> Schedule:
        """``schedule`` (built by the same builder as the planned one, for any number of
        mini-batches) with the E actions in their places."""
        if len(schedule.orders) != len(self.before):
            raise ValueError(f"a fill planned for {len(self.before)} ranks, {schedule.name} has "
                             f"{len(schedule.orders)}")
        orders = []
        for rank, order in enumerate(schedule.orders):
            inserts = self.before[rank]
            placed: List[Action] = []
            found = 0
            for action in order:
                extra = inserts.get(action)
                if extra:
                    placed.extend(extra)
                    found += 1
                placed.append(action)
            if found != len(inserts):
                raise ValueError(f"{schedule.name}: rank {rank}'s order lacks actions the fill was "
                                 f"planned around (plan it on the same method's schedule)")
            orders.append(placed)
        options = {**schedule.options, "evaluations": self.evaluations}
        return replace(schedule, orders=orders, options=options)


def check_fillable(schedule: Schedule) -> None:
    """Forward-only work fills the bubbles of a synchronous schedule of one straight chain with
    one stage per rank; anything else raises ValueError naming what to use instead."""
    if not schedule.synchronous:
        raise ValueError(f"{schedule.name} is asynchronous: its weights change between the forwards of "
                         f"one mini-batch, so no stretch of it holds the weights of one update; evaluate "
                         f"drained (eval_in_bubbles=False)")
    if schedule.num_ranks != schedule.num_stages or len(schedule.pipelines) != 1:
        raise ValueError(f"{schedule.name} holds several stages per rank or several pipelines; evaluation "
                         f"in the bubbles places one stage per rank (gpipe, 1f1b-flush, zb-h1): evaluate "
                         f"drained (eval_in_bubbles=False)")
    if any(a.kind is Kind.E for order in schedule.orders for a in order):
        raise ValueError(f"{schedule.name} already holds forward-only work")
    if schedule.pairs:
        raise ValueError(f"{schedule.name} pairs forwards with backwards (OVERLAP_F_B), between which no "
                         f"forward-only work may go: evaluate drained (eval_in_bubbles=False)")


class _Gap:
    """Idle time of one stage: from ``free`` to ``end``, before the action ``before``."""

    __slots__ = ("free", "end", "before", "placed")

    def __init__(self, free: float, end: float, before: Action) -> None:
        self.free, self.end, self.before, self.placed = free, end, before, []


def plan_fill(schedule: Schedule, evaluations: int, costs: Optional[Costs] = None) -> FillPlan:
    """Place ``evaluations`` forward-only micro-batches into ``schedule``'s idle time before each
    stage's first update (list scheduling, see the module's docstring); ``costs`` default to
    :meth:`Costs.uniform` (an E costs a forward unless ``costs.evaluation`` says otherwise)."""
    check_fillable(schedule)
    if evaluations < 0:
        raise ValueError(f"evaluations must be 0 or more, got {evaluations}")
    n = schedule.num_stages
    costs = costs if costs is not None else Costs.uniform(n)
    result = simulate(schedule, costs)
    when = {t.action: (t.start, t.end) for t in result.timeline}
    chain = schedule.pipelines[0]
    gaps: List[List[_Gap]] = []
    tails: List[_Gap] = []
    for stage in chain:
        order = schedule.orders[schedule.stage_to_rank[stage]]
        first_update = next(p for p, a in enumerate(order) if a.kind is Kind.U)
        after = order[first_update + 1] if first_update + 1 < len(order) else None
        region_end = (when[after][0] if after is not None else result.makespan) - costs.update
        last_forward = max(p for p, a in enumerate(order[:first_update]) if a.kind is Kind.F)
        stage_gaps, free = [], when[order[last_forward]][1]
        for action in order[last_forward + 1:first_update]:
            start, end = when[action]
            if start > free:
                stage_gaps.append(_Gap(free, start, action))
            free = end
        tail = _Gap(free, region_end, order[first_update])
        gaps.append(stage_gaps + [tail])
        tails.append(tail)
    starts: Dict[Action, float] = {}
    filled, all_fit = 0, True
    cursor = [0] * n  # per stage: the gap its last E went into (E's keep their order on a stage)
    for j in range(evaluations):
        ready, fits = 0.0, True
        for pos, stage in enumerate(chain):
            action = Action(stage, Kind.E, j)
            cost = costs.of(action)
            if pos > 0:
                ready += costs.comm
            chosen = None
            for g in range(cursor[pos], len(gaps[pos])):
                gap = gaps[pos][g]
                if max(gap.free, ready) + cost <= gap.end:
                    chosen, cursor[pos] = gap, g
                    break
            if chosen is None:  # no idle time holds it: before the update, delaying it
                chosen, cursor[pos], fits = tails[pos], len(gaps[pos]) - 1, False
            start = max(chosen.free, ready)
            chosen.free = ready = start + cost
            chosen.placed.append(action)
            starts[action] = start
        all_fit = all_fit and fits
        filled += all_fit
    before = [{} for _ in range(schedule.num_ranks)]
    for pos, stage in enumerate(chain):
        for gap in gaps[pos]:
            if gap.placed:
                before[schedule.stage_to_rank[stage]][gap.before] = tuple(gap.placed)
    return FillPlan(evaluations, filled, tuple(before), starts)


def forward_alone(stage_to_rank: Sequence[int], last: int, evaluations: int) -> Schedule:
    """Forward-only work alone, on a drained pipeline: E micro-batches 0 .. ``evaluations`` - 1
    through the model once (stages 0 .. ``last``: every stage, or a mirrored method's first
    pipeline, whose second holds replicas of the same pieces), stage k on rank
    ``stage_to_rank[k]``. Each rank runs its stages' E's micro-batch after micro-batch, in chain
    order (pipelined over the ranks: a drained evaluation, a call of the pipelined model)."""
    n = len(stage_to_rank)
    chains = [list(range(last + 1))] + ([list(range(last + 1, n))] if last + 1 < n else [])
    orders: List[List[Action]] = [[] for _ in range(max(stage_to_rank) + 1)]
    for j in range(evaluations):
        for k in chains[0]:
            orders[stage_to_rank[k]].append(Action(k, Kind.E, j))
    return Schedule("forward-only", n, len(orders), 0, 1, orders, list(stage_to_rank), chains, synchronous=True,
                    options={"evaluations": evaluations})


def drain_first(schedule: Schedule, evaluations: int) -> Schedule:
    """``schedule`` after a drained evaluation of ``evaluations`` micro-batches: every stage runs
    its E actions first, in order (:func:`forward_alone`'s, pipelined)."""
    check_fillable(schedule)
    alone = forward_alone(schedule.stage_to_rank, schedule.num_stages - 1, evaluations)
    orders = [first + list(order) for first, order in zip(alone.orders, schedule.orders)]
    return replace(schedule, orders=orders, options={**schedule.options, "evaluations": evaluations})
