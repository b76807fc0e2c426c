"""Simulate a schedule: when each action starts and ends, bubbles, memory, deadlocks.

Given per-stage costs of F and B (and W for split backwards), an optional update cost and a
per-message transfer cost, every action starts as soon as its rank is free and its dependencies
(:mod:`.deps`) have finished, plus the transfer cost when a dependency ran on another rank. The
result is the timeline a perfect executor would produce; a schedule whose dependencies can never
be met raises :class:`DeadlockError` naming the blocked actions.
"""
from __future__ import annotations

import gc
from collections import Counter, defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

from .actions import Action, Kind, Schedule
from .deps import schedule_dependencies

Number = Union[int, float]


class DeadlockError(ValueError):
    """The schedule cannot run: some actions wait for work that never happens first."""

    def __init__(self, blocked: Dict[Action, List[Action]]):
        self.blocked = {Action(*a): [Action(*d) for d in deps] for a, deps in blocked.items()}
        parts = [f"{a} waits for {', '.join(map(str, deps))}" for a, deps in self.blocked.items()]
        super().__init__("schedule deadlocks: " + "; ".join(parts))


@dataclass
class Costs:
    """Per-stage costs. ``weight`` is the W part of a split backward (I costs backward - weight)."""

    forward: List[float]
    backward: List[float]
    weight: List[float]
    update: float = 0.0
    comm: float = 0.0

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
        return 0.0

    def by_kind(self) -> Dict[Kind, List[float]]:
        """Cost per kind and stage, ``table[kind][stage]``: :meth:`of` as one lookup."""
        n = len(self.forward)
        return {Kind.F: list(self.forward), Kind.B: list(self.backward),
                Kind.I: [b - w for b, w in zip(self.backward, self.weight)],
                Kind.W: list(self.weight), Kind.U: [self.update] * n}

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
    end_of: Dict[Action, float] = field(repr=False, default_factory=dict)

    @property
    def bubble_fraction(self) -> float:
        """1 - busy / (ranks * makespan): the share of rank-time spent idle."""
        if self.makespan == 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.schedule.num_ranks * self.makespan)

    def throughput(self, samples_per_microbatch: int = 1) -> float:
        """Micro-batch samples per unit of time."""
        return self.schedule.num_microbatches * samples_per_microbatch / self.makespan


def peak_activations(schedule: Schedule) -> List[int]:
    """Per stage, the most micro-batches whose forward ran and whose backward has not freed them.

    A full backward frees its micro-batch; with a split backward only ``W`` does.
    """
    release = Kind.W if schedule.split_backward else Kind.B
    peaks = [0] * schedule.num_stages
    live = [0] * schedule.num_stages
    for order in schedule.orders:
        for a in order:
            if a.kind is Kind.F:
                live[a.stage] += 1
                peaks[a.stage] = max(peaks[a.stage], live[a.stage])
            elif a.kind is release:
                live[a.stage] -= 1
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
    """Run ``schedule`` against ``costs`` (default: F = B = 1 on every stage, no transfer cost)."""
    if costs is None:
        costs = Costs.uniform(schedule.num_stages)
    if len(costs.forward) != schedule.num_stages:
        raise ValueError(f"costs given for {len(costs.forward)} stages, schedule has {schedule.num_stages}")
    deps_of = schedule_dependencies(schedule)
    rank_of = schedule.stage_to_rank
    end: Dict[Action, float] = {}
    pointer = [0] * schedule.num_ranks
    free_at = [0.0] * schedule.num_ranks
    busy = [0.0] * schedule.num_ranks
    timeline: List[Timed] = []
    waiting: Dict[Action, List[int]] = defaultdict(list)
    work = deque(range(schedule.num_ranks))
    every = [a for order in schedule.orders for a in order]
    if len(set(every)) != len(every):
        twice = next(a for a, count in Counter(every).items() if count > 1)
        raise ValueError(f"{schedule.name}: action {twice} appears twice")

    comm, cost = costs.comm, costs.by_kind()
    with gc_paused():
        while work:
            rank = work.popleft()
            order = schedule.orders[rank]
            ptr, t_free, length = pointer[rank], free_at[rank], len(order)
            while ptr < length:
                action = order[ptr]
                start, missing = t_free, None
                for d in deps_of(action):
                    done = end.get(d)
                    if done is None:
                        missing = d
                        break
                    if rank_of[d[0]] != rank:
                        done += comm
                    if done > start:
                        start = done
                if missing is not None:  # resume this rank when `missing` finishes
                    waiting[missing].append(rank)
                    break
                stage, kind, _ = action
                t_free = start + cost[kind][stage]
                end[action] = t_free
                busy[rank] += t_free - start
                timeline.append(Timed(rank, action, start, t_free))
                ptr += 1
                if action in waiting:
                    work.extend(waiting.pop(action))
            pointer[rank], free_at[rank] = ptr, t_free

    blocked = {}
    for rank, order in enumerate(schedule.orders):
        if pointer[rank] < len(order):
            head = order[pointer[rank]]
            blocked[head] = [d for d in deps_of(head) if d not in end]
    if blocked:
        raise DeadlockError(blocked)
    makespan = max((t.end for t in timeline), default=0.0)
    return SimResult(schedule, costs, timeline, makespan, busy, peak_activations(schedule), end)


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

