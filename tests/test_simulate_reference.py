"""The fast simulator against a straightforward reference, on random small schedules.

:func:`simulate` reads the dependency rules as tables and :func:`peak_activations`,
``Schedule.split_backward`` and :func:`actions_of` walk actions in C; each must give exactly what
the plain per-action code below gives: the same timeline (order included), float for float, the
same busy times and peaks, and the same deadlock and lowering errors.
"""
from __future__ import annotations

import random
from collections import defaultdict, deque
from dataclasses import replace

import pytest

from pipeoptim.schedules import Action, Costs, DeadlockError, Kind, build_schedule, schedule_names, simulate
from pipeoptim.schedules.actions import actions_of
from pipeoptim.schedules.deps import schedule_dependencies
from pipeoptim.schedules.lower import lower
from pipeoptim.schedules.simulate import peak_activations


# -- the reference: one dependency function call and one dict keyed by Action per action ----------
def reference_split(schedule) -> bool:
    return any(a.kind is Kind.I for order in schedule.orders for a in order)


def reference_dependencies(schedule):
    split = reference_split(schedule)
    backward_kind = Kind.I if split else Kind.B
    last_backward = Kind.W if split else Kind.B
    m = schedule.microbatches_per_update
    runs = None
    if len(schedule.pipelines) > 1:
        runs = {(a.stage, a.index) for order in schedule.orders for a in order if a.kind is Kind.F}

    def dependencies(action):
        s, kind, i = action
        if kind is Kind.F:
            p = schedule.prev_stage(s)
            return [] if p is None else [(p, Kind.F, i)]
        if kind in (Kind.B, Kind.I):
            n = schedule.next_stage(s)
            return [(s, Kind.F, i)] if n is None else [(s, Kind.F, i), (n, backward_kind, i)]
        if kind is Kind.W:
            return [(s, Kind.I, i)]
        if kind is Kind.U:
            return [(s, last_backward, j) for j in range(i * m, (i + 1) * m)
                    if runs is None or (s, j) in runs]
        raise ValueError(f"no dependency rule for {action} (simulate before lowering communication)")

    return dependencies


def reference_peaks(schedule):
    # a split schedule may run some backwards whole (dualpipev): B frees its micro-batch too
    release = (Kind.W, Kind.B) if reference_split(schedule) else (Kind.B,)
    peaks, live = [0] * schedule.num_stages, [0] * schedule.num_stages
    for order in schedule.orders:
        for a in order:
            if a.kind is Kind.F:
                live[a.stage] += 1
                peaks[a.stage] = max(peaks[a.stage], live[a.stage])
            elif a.kind in release:
                live[a.stage] -= 1
    return peaks


def reference_simulate(schedule, costs):
    """(timeline as (rank, action, start, end) tuples, end of each action, busy), or raises."""
    deps_of = reference_dependencies(schedule)
    split = reference_split(schedule)

    def needs(action):  # a forward paired with a backward starts once the backward's inputs are there too
        partner = schedule.pairs.get(action)
        return deps_of(action) + (deps_of(partner) if partner is not None else [])

    rank_of = schedule.stage_to_rank
    end, timeline = {}, []
    halves = {}  # the I and W a whole backward B stands for, in a schedule that splits others
    pointer, free_at, busy = [0] * schedule.num_ranks, [0.0] * schedule.num_ranks, [0.0] * schedule.num_ranks
    waiting = defaultdict(list)
    work = deque(range(schedule.num_ranks))
    while work:
        rank = work.popleft()
        order = schedule.orders[rank]
        while pointer[rank] < len(order):
            action = order[pointer[rank]]
            start, missing = free_at[rank], None
            for d in needs(action):
                if d not in end and d not in halves:
                    missing = d
                    break
                start = max(start, end.get(d, halves.get(d)) + (costs.comm if rank_of[d[0]] != rank else 0.0))
            if missing is not None:
                waiting[missing].append(rank)
                break
            free_at[rank] = end[action] = start + costs.of(action)
            busy[rank] += free_at[rank] - start
            timeline.append((rank, action, start, free_at[rank]))
            pointer[rank] += 1
            work.extend(waiting.pop(action, []))
            if split and action.kind is Kind.B:  # a whole backward ends both halves
                for half in (Kind.I, Kind.W):
                    halves[(action.stage, half, action.index)] = end[action]
                    work.extend(waiting.pop((action.stage, half, action.index), []))
    blocked = {}
    for rank, order in enumerate(schedule.orders):
        if pointer[rank] < len(order):
            head = order[pointer[rank]]
            blocked[head] = [d for d in needs(head) if d not in end and d not in halves]
    if blocked:
        raise DeadlockError(blocked)
    return timeline, end, busy


# -- random cases -------------------------------------------------------------------------------------
def random_costs(rng: random.Random, stages: int) -> Costs:
    forward = [rng.choice([0.5, 1.0, 1.5, 2.0, 3.0]) for _ in range(stages)]
    backward = [rng.choice([1.0, 2.0, 2.5, 4.0]) for _ in range(stages)]
    weight = [b * rng.choice([0.0, 0.25, 0.5, 1.0]) for b in backward]
    return Costs(forward, backward, weight, update=rng.choice([0.0, 0.0, 0.5]),
                 comm=rng.choice([0.0, 0.0, 0.1, 1.0]))


def random_schedule(rng: random.Random, name: str):
    """A small schedule of the generator ``name``, drawn until the generator accepts the sizes."""
    while True:
        n, m, t, v = rng.randint(1, 5), rng.randint(1, 10), rng.randint(1, 3), rng.randint(1, 3)
        try:
            return build_schedule(name, n, m, t, chunks=v)
        except ValueError:  # e.g. interleaved-1f1b needs M a multiple of N, 2bw M >= N
            continue


def outcome(run, schedule, costs):
    """("ran", timeline, end of each action in timeline order, busy), or ("raised", type, message)."""
    try:
        timeline, end, busy = run(schedule, costs)
    except ValueError as error:  # DeadlockError, or an action without a rule
        return "raised", type(error).__name__, str(error)
    return "ran", timeline, list(end.items()), busy


def fast(schedule, costs):
    result = simulate(schedule, costs)
    timeline = [(t.rank, t.action, t.start, t.end) for t in result.timeline]
    assert result.makespan == max((t[3] for t in timeline), default=0.0)
    assert result.peak_activations == reference_peaks(schedule)
    return timeline, result.end_of, result.busy


def reference(schedule, costs):
    return reference_simulate(schedule, costs)


def with_orders(schedule, orders):
    return replace(schedule, orders=orders)


@pytest.mark.parametrize("seed", range(40))
def test_simulate_matches_the_reference_on_random_schedules(seed):
    rng = random.Random(seed)
    for name in schedule_names():
        schedule = random_schedule(rng, name)
        costs = random_costs(rng, schedule.num_stages)
        # as built, then with a few actions swapped within a rank (often a deadlock)
        swapped = []
        for order in schedule.orders:
            order = list(order)
            for _ in range(rng.randint(0, 2)):
                i, j = rng.randrange(len(order)), rng.randrange(len(order))
                order[i], order[j] = order[j], order[i]
            swapped.append(order)
        for case in (schedule, with_orders(schedule, swapped)):
            assert outcome(fast, case, costs) == outcome(reference, case, costs), (name, seed)


def test_deadlocks_and_lowered_schedules_give_the_reference_errors():
    s = build_schedule("async-1f1b", 3, 2, 2)
    late_update = [list(order) for order in s.orders]
    late_update[0].insert(0, late_update[0].pop(late_update[0].index(Action(0, Kind.U, 0))))
    for case in (with_orders(s, late_update), lower(s), lower(build_schedule("zb-h1", 2, 2))):
        costs = Costs.uniform(case.num_stages)
        want = outcome(reference, case, costs)
        assert want[0] == "raised" and outcome(fast, case, costs) == want


@pytest.mark.parametrize("name", schedule_names())
def test_dependency_rules_match_the_reference(name):
    rng = random.Random(name)
    for _ in range(5):
        s = random_schedule(rng, name)
        fast_deps, ref_deps = schedule_dependencies(s), reference_dependencies(s)
        for order in s.orders:
            for a in order:
                assert fast_deps(a) == ref_deps(a), a
        assert s.split_backward == reference_split(s)
        assert peak_activations(s) == reference_peaks(s)


def test_peaks_where_a_rank_holds_several_stages_or_a_stage_sits_on_two_ranks():
    s = build_schedule("interleaved-1f1b", 2, 4, 2, chunks=3)
    assert peak_activations(s) == reference_peaks(s)
    odd = with_orders(s, [s.orders[0] + s.orders[1][:5], s.orders[1][5:]])
    assert peak_activations(odd) == reference_peaks(odd)


def test_actions_of_builds_the_same_actions():
    for kind in Kind:
        built = actions_of(3, kind, range(5, 9))
        assert built == [Action(3, kind, i) for i in range(5, 9)]
        assert all(type(a) is Action and a.kind is kind for a in built)
    assert actions_of(0, Kind.F, []) == []
