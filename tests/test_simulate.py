"""Tests for the schedule simulator: bubbles, memory, weight versions, deadlocks, costs."""
from __future__ import annotations

import pytest

from pipeoptim.methods import get_method
from pipeoptim.schedules import (Action, Costs, DeadlockError, Kind, Schedule, analytic_bubble_fraction,
                                 build_schedule, schedule_names, simulate)
from pipeoptim.schedules.actions import straight

MS = [1, 2, 3, 5, 8, 13, 32]
COSTS = [(1, 1), (1, 2), (2, 3), (0.5, 1.5)]


def bubble(name, n, m, t=1, forward=1.0, backward=2.0, **kw):
    """Bubble fraction of ``name`` with equal costs on every stage (the schedule built for them)."""
    probe = build_schedule(name, n, m, t, **kw)
    costs = Costs.uniform(probe.num_stages, forward, backward)
    return simulate(build_schedule(name, n, m, t, costs=costs, **kw), costs).bubble_fraction


@pytest.mark.parametrize("name", ["gpipe", "1f1b-flush"])
@pytest.mark.parametrize("n", range(1, 17))
def test_synchronous_bubble_is_n_minus_1_over_m_plus_n_minus_1(name, n):
    for m in MS:
        for f, b in COSTS:
            s = build_schedule(name, n, m)
            costs = Costs.uniform(n, f, b)
            result = simulate(s, costs)
            expected = (n - 1) / (m + n - 1)
            assert result.bubble_fraction == pytest.approx(expected, abs=1e-12), (m, f, b)
            assert analytic_bubble_fraction(s, costs) == pytest.approx(expected, abs=1e-12)
            assert result.makespan == pytest.approx((m + n - 1) * (f + b), abs=1e-9)
            assert result.busy == pytest.approx([m * (f + b)] * n)


@pytest.mark.parametrize("name", ["gpipe", "1f1b-flush"])
def test_synchronous_bubble_repeats_per_minibatch(name):
    # T mini-batches flush T times: the same fraction, T times the makespan
    for t in (1, 2, 5):
        result = simulate(build_schedule(name, 4, 8, t), Costs.uniform(4, 1, 2))
        assert result.makespan == pytest.approx(t * 11 * 3)
        assert result.bubble_fraction == pytest.approx(3 / 11, abs=1e-12)


@pytest.mark.parametrize("n,m", [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (6, 6), (6, 12),
                                 (8, 8), (8, 16)])
def test_interleaved_bidirectional_and_zero_bubble_beat_1f1b_flush(n, m):
    reference = bubble("1f1b-flush", n, m)
    assert reference == pytest.approx((n - 1) / (m + n - 1), abs=1e-12)
    for name in ("interleaved-1f1b", "bidirectional", "zb-h1"):
        assert bubble(name, n, m) < reference - 1e-9, name


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_interleaved_bubble_is_n_minus_1_over_v_m_plus_n_minus_1(n, m):
    for v in (1, 2, 3):
        s = build_schedule("interleaved-1f1b", n, m, chunks=v)
        costs = Costs.uniform(s.num_stages)
        expected = (n - 1) / (v * m + n - 1)
        assert simulate(s, costs).bubble_fraction == pytest.approx(expected, abs=1e-12)
        assert analytic_bubble_fraction(s, costs) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n,m", [(2, 2), (4, 4), (4, 8), (8, 8)])
def test_zero_bubble_h1_bubble(n, m):
    # ZB-H1: (N-1)(F + I - W) idle per rank, against M(F + I + W) work; F = I = W = 1 here
    s = build_schedule("zb-h1", n, m)
    result = simulate(s, Costs.uniform(n, 1, 2, weight=1))
    assert result.makespan == pytest.approx(3 * m + (n - 1))
    assert result.bubble_fraction == pytest.approx((n - 1) / (3 * m + n - 1), abs=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_async_bubble_over_t_batches(n):
    previous = 1.0
    for t in (1, 2, 4, 16, 64, 256):
        for f in (1.0, 2.5):  # F = B
            s = build_schedule("async-1f1b", n, 1, t)
            costs = Costs.uniform(n, f, f)
            result = simulate(s, costs)
            expected = (n - 1) / (t + n - 1)
            assert result.bubble_fraction == pytest.approx(expected, abs=1e-12)
            assert analytic_bubble_fraction(s, costs) == pytest.approx(expected, abs=1e-12)
            assert result.makespan == pytest.approx(2 * f * (t + n - 1))
        if n > 1:
            assert expected < previous
        previous = expected
    assert previous < (n - 1) / 256 + 1e-12  # toward 0 as T grows


def test_async_bubble_with_microbatches_counts_all_of_them():
    # 2bw: K = T * m micro-batches flow through one pipeline
    s = build_schedule("2bw", 4, 4, 3)
    assert simulate(s).bubble_fraction == pytest.approx(3 / (12 + 3), abs=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_peak_activations(n):
    m = 2 * n
    assert simulate(build_schedule("1f1b-flush", n, m, 2)).peak_activations == [n - k for k in range(n)]
    assert simulate(build_schedule("async-1f1b", n, 1, m)).peak_activations == [n - k for k in range(n)]
    assert simulate(build_schedule("gpipe", n, m, 2)).peak_activations == [m] * n
    # fewer micro-batches than stages: 1F1B holds at most M
    assert simulate(build_schedule("1f1b-flush", n, 1)).peak_activations == [1] * n
    # zero bubble H1: the same peak as 1F1B's first stage, on every stage
    assert simulate(build_schedule("zb-h1", n, m)).peak_activations == [n] * n


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_weight_versions_per_stage(n):
    assert get_method("pipedream").weight_versions(n) == [n - k for k in range(n)]
    assert get_method("pipedream").weight_versions(n, vertical_sync=True) == [n] * n
    # PipeOptim: the live weights and a cache where it predicts; the last stage predicts over
    # s = 0 updates (exact, paper) and holds its live weights alone, s = 1 with the authors' code
    assert get_method("pipeoptim").weight_versions(n) == [2] * (n - 1) + [1]
    assert get_method("pipeoptim").weight_versions(n, steps="code") == [2] * n
    predicted = get_method("pipeoptim").weight_versions(n, backward="predicted")
    assert predicted == [2 + n - 1 - k for k in range(n - 1)] + [1]
    assert get_method("gpipe").weight_versions(n) == [1] * n
    assert get_method("pipedream-2bw").weight_versions(n) == ([1] if n == 1 else [2] * n)


def two_stage(orders) -> Schedule:
    return Schedule("hand-made", 2, 2, 1, 1, [[Action.parse(a) for a in row] for row in orders],
                    synchronous=True, **straight(2))


def test_deadlock_backward_before_its_forward_names_the_blocked_actions():
    s = two_stage([["0B0", "0F0", "0U0"], ["1F0", "1B0", "1U0"]])
    with pytest.raises(DeadlockError) as info:
        simulate(s)
    message = str(info.value)
    assert message == "schedule deadlocks: 0B0 waits for 0F0, 1B0; 1F0 waits for 0F0"
    assert info.value.blocked == {Action(0, Kind.B, 0): [Action(0, Kind.F, 0), Action(1, Kind.B, 0)],
                                  Action(1, Kind.F, 0): [Action(0, Kind.F, 0)]}
    assert isinstance(info.value, ValueError)


def test_deadlock_cycle_across_ranks():
    # stage 1 runs B1 before F0's backward exists; stage 0 waits for 1B0 which waits for 1F0...
    s = Schedule("cycle", 2, 2, 2, 2, [[Action.parse(a) for a in row] for row in
                                       [["0F0", "0F1", "0B1", "0B0", "0U0"],
                                        ["1F0", "1B1", "1F1", "1B0", "1U0"]]],
                 synchronous=True, **straight(2))
    with pytest.raises(DeadlockError, match=r"0B1 waits for 1B1; 1B1 waits for 1F1$"):
        simulate(s)


def test_an_action_twice_is_an_error():
    s = two_stage([["0F0", "0F0", "0B0"], ["1F0", "1B0"]])
    with pytest.raises(ValueError, match="action 0F0 appears twice"):
        simulate(s)


@pytest.mark.parametrize("comm", [0.0, 0.25, 1.0, 3.0])
def test_comm_cost_on_the_critical_path_gpipe_n2_m1(comm):
    # F0 on rank 0, send, F0 and B0 on rank 1, send back, B0 on rank 0: two messages
    s = build_schedule("gpipe", 2, 1)
    result = simulate(s, Costs.uniform(2, 1, 2, comm=comm))
    assert result.makespan == pytest.approx(1 + comm + 1 + 2 + comm + 2)
    start = {str(t.action): t.start for t in result.timeline}
    assert start["1F0"] == pytest.approx(1 + comm)
    assert start["0B0"] == pytest.approx(4 + 2 * comm)


def test_comm_cost_between_stages_on_one_rank_is_free():
    s = build_schedule("interleaved-1f1b", 1, 1, chunks=2)  # both chunks on rank 0
    assert simulate(s, Costs.uniform(2, comm=5.0)).makespan == pytest.approx(4.0)


def test_update_cost_adds_to_each_rank():
    s = build_schedule("gpipe", 3, 4, 2)
    plain = simulate(s, Costs.uniform(3, 1, 2))
    slow = simulate(s, Costs.uniform(3, 1, 2, update=0.5))
    assert slow.makespan == pytest.approx(plain.makespan + 2 * 0.5)
    assert slow.busy == pytest.approx([b + 2 * 0.5 for b in plain.busy])


def test_stages_with_different_costs_bottleneck_at_the_slowest():
    s = build_schedule("async-1f1b", 3, 1, 100)
    costs = Costs([1.0, 3.0, 1.0], [1.0, 3.0, 1.0], [0.5, 1.5, 0.5])
    result = simulate(s, costs)
    assert result.busy[1] == pytest.approx(600.0)
    # stage 1 never idles once 0F0 arrives: 0F0, then all of stage 1's work, then 0B99
    assert result.makespan == pytest.approx(1 + 600 + 1)
    assert analytic_bubble_fraction(s, costs) is None


@pytest.mark.parametrize("name,n,m,t,costs", [
    ("bidirectional", 4, 4, 1, dict()),
    ("zb-h1", 4, 4, 1, dict()),
    ("async-1f1b", 4, 1, 8, dict(backward=2.0)),          # F != B
    ("2bw", 4, 4, 2, dict(backward=2.0)),
    ("gpipe", 4, 4, 1, dict(comm=0.1)),                   # transfer cost
    ("1f1b-flush", 4, 4, 1, dict(update=1.0)),            # update cost
    ("interleaved-1f1b", 2, 4, 2, dict()),                # several mini-batches
])
def test_analytic_is_none_without_a_closed_form(name, n, m, t, costs):
    s = build_schedule(name, n, m, t)
    assert analytic_bubble_fraction(s, Costs.uniform(s.num_stages, **costs)) is None


def test_default_costs_are_unit_and_stage_count_is_checked():
    s = build_schedule("gpipe", 2, 2)
    assert simulate(s).makespan == pytest.approx(6.0)
    with pytest.raises(ValueError, match="costs given for 3 stages, schedule has 2"):
        simulate(s, Costs.uniform(3))


@pytest.mark.parametrize("name", schedule_names())
def test_timeline_respects_rank_order_and_dependencies(name):
    s = build_schedule(name, 4, 8, 2)
    costs = Costs.uniform(s.num_stages, 1, 2, comm=0.5)
    result = simulate(s, costs)
    assert len(result.timeline) == sum(len(o) for o in s.orders)
    by_rank = {}
    for t in result.timeline:
        assert t.end - t.start == pytest.approx(costs.of(t.action))
        by_rank.setdefault(t.rank, []).append(t)
    for rank, timed in by_rank.items():
        assert [t.action for t in timed] == s.orders[rank]
        assert all(a.end <= b.start + 1e-12 for a, b in zip(timed, timed[1:]))
    assert result.makespan == max(t.end for t in result.timeline)
    assert 0 <= result.bubble_fraction < 1
