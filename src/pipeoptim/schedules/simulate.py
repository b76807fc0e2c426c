"""Simulate a schedule: when each action starts and ends, bubbles, memory, deadlocks.

Given per-stage costs of F and B (and W for split backwards), an optional update cost and a
per-message transfer cost, every action starts as soon as its rank is free and its dependencies
(:mod:`.deps`) have finished, plus the transfer cost when a dependency ran on another rank. A
forward paired with a backward (``Schedule.pairs``) waits for the dependencies of both, and the
two run one after the other, as on the CPU (a GPU build overlapping them would take less). The
result is the timeline a perfect executor would produce; a schedule whose dependencies can never
be met raises :class:`DeadlockError` naming the blocked actions.
"""
from __future__ import annotations

import gc
from collections import Counter, defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate, repeat
from operator import attrgetter
from typing import Dict, List, Optional, Union

from .actions import COMPUTE_KINDS, Action, Kind, Schedule
from .deps import dependency_rules, schedule_dependencies

Number = Union[int, float]


class DeadlockError(ValueError):
    """The schedule cannot run: some actions wait for work that never happens first."""

    def __init__(self, blocked: Dict[Action, List[Action]]):
        self.blocked = {Action(*a): [Action(*d) for d in deps] for a, deps in blocked.items()}
        parts = [f"{a} waits for {', '.join(map(str, deps))}" for a, deps in self.blocked.items()]
        super().__init__("schedule deadlocks: " + "; ".join(parts))


@dataclass
class Costs:
    """Per-stage costs. ``weight`` is the W part of a split backward (I costs backward - weight);
    ``evaluation``: a forward-only evaluation micro-batch ``E`` (None: the forward's)."""

    forward: List[float]
    backward: List[float]
    weight: List[float]
    update: float = 0.0
    comm: float = 0.0
    evaluation: Optional[List[float]] = None

    @classmethod
    def uniform(cls, num_stages: int, forward: Number = 1.0, backward: Number = 1.0,
                weight: Optional[Number] = None, update: Number = 0.0, comm: Number = 0.0) -> "Costs":
        w = backward / 2 if weight is None else weight
        if not 0 <= w <= backward:
            raise ValueError(f"W cost {w} must lie between 0 and the backward cost {backward}")
        return cls([float(forward)] * num_stages, [float(backward)] * num_stages,
                   [float(w)] * num_stages, float(update), float(comm))

    def of(self, action: Action) -> float:
        s = action.stage
        if action.kind is Kind.F:
            return self.forward[s]
        if action.kind is Kind.B:
            return self.backward[s]
        if action.kind is Kind.I:
            return self.backward[s] - self.weight[s]
        if action.kind is Kind.W:
            return self.weight[s]
        if action.kind is Kind.U:
            return self.update
        if action.kind is Kind.E:
            return self.forward[s] if self.evaluation is None else self.evaluation[s]
        return 0.0

    def by_kind(self) -> Dict[Kind, List[float]]:
        """Cost per kind and stage, ``table[kind][stage]``: :meth:`of` as one lookup."""
        n = len(self.forward)
        return {Kind.F: list(self.forward), Kind.B: list(self.backward),
                Kind.I: [b - w for b, w in zip(self.backward, self.weight)],
                Kind.W: list(self.weight), Kind.U: [self.update] * n,
                Kind.E: list(self.forward if self.evaluation is None else self.evaluation)}

    @property
    def equal_stages(self) -> bool:
        return (len(set(self.forward)) == 1 and len(set(self.backward)) == 1
                and len(set(self.weight)) == 1)


@dataclass(slots=True)
class Timed:
    rank: int
    action: Action
    start: float
    end: float


@dataclass
class SimResult:
    """What :func:`simulate` found."""

    schedule: Schedule
    costs: Costs
    timeline: List[Timed]
    makespan: float
    busy: List[float]                 #: busy time per rank
    peak_activations: List[int]       #: per model stage, micro-batches whose activations are held

    @cached_property
    def end_of(self) -> Dict[Action, float]:
        """When each action ends (built on first use: a sizeable share of a large simulation)."""
        return {t.action: t.end for t in self.timeline}

    @property
    def bubble_fraction(self) -> float:
        """1 - busy / (ranks * makespan): the share of rank-time spent idle."""
        if self.makespan == 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.schedule.num_ranks * self.makespan)


def peak_activations(schedule: Schedule, split: Optional[bool] = None) -> List[int]:
    """Per stage, the most micro-batches whose forward ran and whose backward has not freed them.

    A full backward frees its micro-batch; of a split one only ``W`` does. ``split`` is
    read off the schedule when not given.
    """
    if split is None:
        split = schedule.split_backward
    # +1 per forward, -1 per release, in the order the ranks' lists give (rank 0's first): the
    # peak is the largest running sum, or 0. map and accumulate walk the actions in C, and most
    # ranks hold one stage, whose kinds need no sorting out: the large asynchronous schedules
    # have hundreds of thousands of actions.
    kinds_of: Dict[int, List[Kind]] = defaultdict(list)
    for order in schedule.orders:
        present = set(map(attrgetter("stage"), order))
        if len(present) == 1:
            kinds_of[present.pop()].extend(map(attrgetter("kind"), order))
        else:
            for stage, kind, _ in order:
                kinds_of[stage].append(kind)
    change = {Kind.F: 1, Kind.B: -1, Kind.W: -1} if split else {Kind.F: 1, Kind.B: -1}
    peaks = [0] * schedule.num_stages
    for stage, kinds in kinds_of.items():
        peaks[stage] = max(0, max(accumulate(map(change.get, kinds, repeat(0)))))
    return peaks


@contextmanager
def gc_paused():
    """Pause the cyclic garbage collector. Generating and simulating a large schedule allocate
    hundreds of thousands of small objects, none of them cyclic; the collections they trigger
    traverse every object of the process (all of torch's too) and cost more than the work."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def simulate(schedule: Schedule, costs: Optional[Costs] = None) -> SimResult:
    """Run ``schedule`` against ``costs`` (default: F = B = 1 on every stage, no transfer cost).

    Each rank runs its list in order until an action's dependency has not finished yet; the rank
    then waits for that one action, and resumes (checking all the dependencies again) when it ends.
    """
    if costs is None:
        costs = Costs.uniform(schedule.num_stages)
    if len(costs.forward) != schedule.num_stages:
        raise ValueError(f"costs given for {len(costs.forward)} stages, schedule has {schedule.num_stages}")
    num_ranks, stages, rank_of = schedule.num_ranks, range(schedule.num_stages), schedule.stage_to_rank
    every = [a for order in schedule.orders for a in order]
    if len(set(every)) != len(every):
        twice = next(a for a, count in Counter(every).items() if count > 1)
        raise ValueError(f"{schedule.name}: action {twice} appears twice")
    split = schedule.split_backward
    rules = dependency_rules(schedule, split)

    # The rules as tables, so that the loop below calls no function and builds no tuple for an
    # action that can run. For each kind and stage, ``ends[kind][stage]`` maps an index to the end
    # time of that action, and ``waiters[kind][stage]`` an index not run yet to the ranks waiting
    # for it: dicts keyed by int are cheaper to probe than dicts keyed by Action. Running an action
    # takes ``steps[kind][stage]``: its duration, its ends and waiters, and its same-index
    # dependencies as (their ends, their waiters, the transfer delay) triples.
    ends = {kind: [{} for _ in stages] for kind in COMPUTE_KINDS}
    waiters = {kind: [{} for _ in stages] for kind in COMPUTE_KINDS}
    cost = costs.by_kind()
    steps = {kind: [(cost[kind][s], ends[kind][s], waiters[kind][s],
                     [(ends[k][d], waiters[k][d], costs.comm if rank_of[d] != rank_of[s] else 0.0)
                      for d, k in rules.same_index[kind][s]] if kind in rules.same_index else [])
                    for s in stages]
             for kind in COMPUTE_KINDS}
    _U, window_kind = Kind.U, rules.window_kind
    walk_windows = _U not in rules.same_index  # several micro-batches per update
    pairs = schedule.pairs or None
    # a split schedule's whole backward B(s, i) also ends I(s, i) and W(s, i) (torch's DualPipeV mixes them)
    halves = {s: ((ends[Kind.I][s], waiters[Kind.I][s]), (ends[Kind.W][s], waiters[Kind.W][s]))
              for s in stages} if split else None
    _B = Kind.B

    pointer = [0] * num_ranks
    free_at = [0.0] * num_ranks
    busy = [0.0] * num_ranks
    timeline: List[Timed] = []
    record = timeline.append
    work = deque(range(num_ranks))
    with gc_paused():
        while work:
            rank = work.popleft()
            order = schedule.orders[rank]
            ptr, t_free, spent, length = pointer[rank], free_at[rank], busy[rank], len(order)
            while ptr < length:
                action = order[ptr]
                stage, kind, index = action
                try:
                    duration, own_ends, own_waiters, needs = steps[kind][stage]
                except KeyError:
                    raise ValueError(f"no dependency rule for {action} "
                                     "(simulate before lowering communication)") from None
                start, wait_list, wait_for = t_free, None, None
                for dep_ends, dep_waiters, delay in needs:
                    done = dep_ends.get(index)
                    if done is None:
                        wait_list, wait_for = dep_waiters, index
                        break
                    done += delay
                    if done > start:
                        start = done
                if kind is _U and walk_windows and wait_list is None:
                    dep_ends = ends[window_kind][stage]  # same stage, so same rank: no transfer
                    for j in rules.window(stage, index):
                        done = dep_ends.get(j)
                        if done is None:
                            wait_list, wait_for = waiters[window_kind][stage], j
                            break
                        if done > start:
                            start = done
                if pairs is not None and wait_list is None and action in pairs:
                    # the pair starts once the backward's inputs are there too
                    b_stage, b_kind, b_index = pairs[action]
                    for dep_ends, dep_waiters, delay in steps[b_kind][b_stage][3]:
                        done = dep_ends.get(b_index)
                        if done is None:
                            wait_list, wait_for = dep_waiters, b_index
                            break
                        done += delay
                        if done > start:
                            start = done
                if wait_list is not None:  # resume this rank when the missing action has run
                    wait_list.setdefault(wait_for, []).append(rank)
                    break
                t_free = start + duration
                own_ends[index] = t_free
                spent += t_free - start
                record(Timed(rank, action, start, t_free))
                ptr += 1
                if own_waiters and index in own_waiters:
                    work.extend(own_waiters.pop(index))
                if halves is not None and kind is _B:
                    for half_ends, half_waiters in halves[stage]:
                        half_ends[index] = t_free
                        if index in half_waiters:
                            work.extend(half_waiters.pop(index))
            pointer[rank], free_at[rank], busy[rank] = ptr, t_free, spent

    heads = [order[ptr] for order, ptr in zip(schedule.orders, pointer) if ptr < len(order)]
    if heads:
        deps_of = schedule_dependencies(schedule)

        def missing(head: Action) -> List[tuple]:
            partner = schedule.pair_of(head)  # a pair waits for its backward's inputs too
            return [(s, k, i) for a in (head, partner) if a is not None for s, k, i in deps_of(a)
                    if i not in ends[k][s]]

        raise DeadlockError({head: missing(head) for head in heads})
    makespan = max(map(attrgetter("end"), timeline), default=0.0)
    return SimResult(schedule, costs, timeline, makespan, busy, peak_activations(schedule, split))


def analytic_bubble_fraction(schedule: Schedule, costs: Costs) -> Optional[float]:
    """The closed-form bubble fraction where one is known for these costs, else None.

    * gpipe and 1f1b-flush, equal stages, no transfer or update cost: (N-1)/(M+N-1);
    * async 1F1B over K micro-batches with F = B on equal stages: (N-1)/(K+N-1);
    * interleaved 1F1B with v chunks, equal stages, M a multiple of N: (N-1)/(v*M+N-1).
    """
    if not costs.equal_stages or costs.comm != 0 or costs.update != 0:
        return None
    n, m = schedule.num_ranks, schedule.microbatches_per_update
    if schedule.name in ("gpipe", "1f1b-flush"):
        return (n - 1) / (m + n - 1)
    if schedule.name in ("async-1f1b", "2bw") and costs.forward[0] == costs.backward[0]:
        k = schedule.num_microbatches
        return (n - 1) / (k + n - 1)
    if schedule.name == "interleaved-1f1b" and m % n == 0 and schedule.num_updates == 1:
        v = schedule.num_stages // n
        return (n - 1) / (v * m + n - 1)
    return None

