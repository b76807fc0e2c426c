"""Forward-only work in a synchronous schedule's bubbles (schedules/fill.py, issue 39 item 2):
where list scheduling places an evaluation's E actions, what they cost in the simulator, filled
against drained, and that one plan serves the schedule of any length."""
from __future__ import annotations

import pytest

from pipeoptim.schedules.actions import Action, Kind
from pipeoptim.schedules.deps import schedule_dependencies
from pipeoptim.schedules.fill import check_fillable, drain_first, plan_fill
from pipeoptim.schedules.registry import build_schedule
from pipeoptim.schedules.simulate import Costs, simulate


def orders_text(schedule) -> list:
    return [" ".join(map(str, order)) for order in schedule.orders]


def makespan(schedule, costs=None) -> float:
    return simulate(schedule, costs).makespan


def test_gpipe_two_stages_fills_the_middle_of_stage_0_and_the_cool_down_of_stage_1():
    """gpipe N=2 M=2, F=B=1: stage 0 idles in [2, 4] between its forwards and backwards, stage 1
    in [5, 7] between its last backward and mini-batch 1's first forward (its update moves after
    the E's). Two evaluation micro-batches fit there; the makespan stays 12, a drained
    evaluation before the schedule makes it 14."""
    base = build_schedule("gpipe", 2, 2, 2)
    plan = plan_fill(base, 2)
    filled = plan.apply(base)
    assert plan.filled == 2
    assert orders_text(filled) == ["0F0 0F1 0E0 0E1 0B0 0B1 0U0 0F2 0F3 0B2 0B3 0U1",
                                   "1F0 1F1 1B0 1B1 1E0 1E1 1U0 1F2 1F3 1B2 1B3 1U1"]
    assert plan.starts == {Action.parse("0E0"): 2.0, Action.parse("0E1"): 3.0,
                           Action.parse("1E0"): 5.0, Action.parse("1E1"): 6.0}
    result = simulate(filled)
    assert result.makespan == makespan(base) == 12.0
    assert {str(t.action): (t.start, t.end) for t in result.timeline if t.action.kind is Kind.E} == \
        {"0E0": (2.0, 3.0), "0E1": (3.0, 4.0), "1E0": (5.0, 6.0), "1E1": (6.0, 7.0)}
    assert makespan(drain_first(base, 2)) == 14.0


def test_what_the_bubbles_cannot_hold_runs_before_the_update_and_costs_less_than_draining():
    """A third micro-batch finds no gap: it runs after the last backward, before the update
    (stage 0 in [6, 7], stage 1 in [7, 8]): the schedule ends 1 later (13), drained 3 later (15)."""
    base = build_schedule("gpipe", 2, 2, 2)
    plan = plan_fill(base, 3)
    assert plan.filled == 2
    assert orders_text(plan.apply(base))[0].startswith("0F0 0F1 0E0 0E1 0B0 0B1 0E2 0U0 0F2")
    assert plan.starts[Action.parse("0E2")] == 6.0 and plan.starts[Action.parse("1E2")] == 7.0
    assert makespan(plan.apply(base)) == 13.0
    assert makespan(drain_first(base, 3)) == 15.0


@pytest.mark.parametrize("name, evaluations, filled, base, fill, drained", [
    ("gpipe", 4, 4, 42.0, 42.0, 46.0),
    ("gpipe", 8, 8, 42.0, 42.0, 50.0),
    ("1f1b-flush", 4, 4, 42.0, 42.0, 46.0),
    ("1f1b-flush", 8, 5, 42.0, 45.0, 50.0),
    ("zb-h1", 4, 1, 30.0, 33.0, 34.0),
])
def test_four_stages_with_backwards_twice_the_forwards(name, evaluations, filled, base, fill, drained):
    """N=4, M=4, two mini-batches, F=1, B=2 (zb-h1: I=W=1): how many evaluation micro-batches
    run free, and the makespans without evaluation, filled and drained. (1f1b-flush and zb-h1
    idle between the forwards of stages 1..3 too, but an E there would cross the activation
    link ahead of a forward's that stage 0 sent before it.)"""
    costs = Costs.uniform(4, forward=1, backward=2, weight=1)
    schedule = build_schedule(name, 4, 4, 2)
    plan = plan_fill(schedule, evaluations, costs)
    assert plan.filled == filled
    assert (makespan(schedule, costs), makespan(plan.apply(schedule), costs),
            makespan(drain_first(schedule, evaluations), costs)) == (base, fill, drained)


def test_the_simulator_prices_an_evaluation_forward_apart_from_a_training_one():
    """costs.evaluation: an evaluation mini-batch twice a training micro-batch's size costs 2."""
    base = build_schedule("gpipe", 2, 2, 2)
    costs = Costs.uniform(2)
    costs.evaluation = [2.0, 2.0]
    plan = plan_fill(base, 1, costs)
    assert plan.filled == 1 and plan.starts == {Action.parse("0E0"): 2.0, Action.parse("1E0"): 5.0}
    result = simulate(plan.apply(base), costs)
    assert [(t.start, t.end) for t in result.timeline if t.action.kind is Kind.E] == [(2.0, 4.0), (5.0, 7.0)]
    assert result.makespan == 12.0


def test_one_plan_serves_the_schedule_of_any_length_as_a_prefix():
    """The executors build a segment's orders for a horizon and drain on those for the data fed:
    the planned schedule for 1, 2 and 5 mini-batches agree where they overlap."""
    plan = plan_fill(build_schedule("1f1b-flush", 3, 3, 2), 4)
    built = {t: plan.apply(build_schedule("1f1b-flush", 3, 3, t)) for t in (1, 2, 5)}
    for rank in range(3):
        one, two, five = (built[t].orders[rank] for t in (1, 2, 5))
        assert two[:len(one)] == one and five[:len(two)] == two
    assert all(simulate(s).makespan > 0 for s in built.values())  # none deadlocks


def test_every_link_carries_mini_batch_0_then_the_evaluation_then_mini_batch_1():
    """The distributed executor's links deliver in order: on every stage the E's come after its
    last forward of mini-batch 0 and before its first of mini-batch 1, in micro-batch order."""
    costs = Costs.uniform(4, forward=1, backward=2, weight=1)
    for name in ("gpipe", "1f1b-flush", "zb-h1"):
        base = build_schedule(name, 4, 4, 2)
        for order in plan_fill(base, 8, costs).apply(base).orders:
            seen = [(a.kind, a.index) for a in order if a.kind in (Kind.F, Kind.E)]
            assert seen == [(Kind.F, i) for i in range(4)] + [(Kind.E, j) for j in range(8)] + \
                [(Kind.F, i) for i in range(4, 8)], name


def test_e_depends_on_the_previous_stages_e_and_parses():
    deps = schedule_dependencies(build_schedule("gpipe", 3, 1, 1))
    assert deps(Action.parse("2E4")) == [(1, Kind.E, 4)] and deps(Action.parse("0E4")) == []
    assert str(Action.parse("1E0")) == "1E0"


@pytest.mark.parametrize("name, words", [("async-1f1b", "asynchronous"),
                                         ("interleaved-1f1b", "several stages per rank"),
                                         ("zb-v", "several stages per rank")])
def test_schedules_without_one_update_per_stretch_are_refused_with_the_fix(name, words):
    with pytest.raises(ValueError, match=f"{words}.*eval_in_bubbles=False"):
        check_fillable(build_schedule(name, 2, 2, 2))
