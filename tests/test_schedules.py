"""Tests for the schedule generators, the action strings and lowering (pipeoptim.schedules)."""
from __future__ import annotations

from collections import Counter

import pytest

from pipeoptim.schedules import Action, Kind, build_schedule, schedule_names
from pipeoptim.schedules.async_1f1b import async_1f1b
from pipeoptim.schedules.lower import lower

# (stages N, micro-batches per update M, mini-batches T) valid for every generator
SIZES = [(1, 2, 1), (2, 2, 1), (2, 4, 3), (3, 6, 2), (4, 4, 1), (4, 8, 2), (6, 12, 1)]


def orders_as_text(schedule) -> list[str]:
    return [" ".join(map(str, order)) for order in schedule.orders]


@pytest.mark.parametrize("name", schedule_names())
@pytest.mark.parametrize("n,m,t", SIZES)
def test_every_microbatch_has_one_forward_and_one_backward_per_stage(name, n, m, t):
    s = build_schedule(name, n, m, t)
    counts = Counter((a.stage, a.kind) for order in s.orders for a in order)
    per_stage = Counter()
    for order in s.orders:
        for a in order:
            per_stage[(a.stage, a.kind, a.index)] += 1
    assert max(per_stage.values()) == 1  # no action twice
    assert s.num_microbatches == m * t
    for stage in range(s.num_stages):
        forwards = {a.index for a in s.stage_actions(stage) if a.kind is Kind.F}
        # a bidirectional schedule sends half the micro-batches down, half up
        expected = m * t // 2 if name in ("bidirectional", "bitpipe") else m * t
        assert len(forwards) == counts[(stage, Kind.F)] == expected
        if s.split_backward:  # each micro-batch's backward split in two, or (dualpipev mixes) whole
            inputs = {a.index for a in s.stage_actions(stage) if a.kind is Kind.I}
            weights = {a.index for a in s.stage_actions(stage) if a.kind is Kind.W}
            whole = {a.index for a in s.stage_actions(stage) if a.kind is Kind.B}
            assert inputs == weights and not inputs & whole and inputs | whole == forwards
            assert counts[(stage, Kind.B)] == (len(whole) if name == "dualpipev" else 0)
        else:
            assert {a.index for a in s.stage_actions(stage) if a.kind is Kind.B} == forwards
        updates = [a.index for a in s.stage_actions(stage) if a.kind is Kind.U]
        assert updates == list(range(t)) == list(range(s.num_updates))
    # every action sits on the rank its stage is placed on
    for rank, order in enumerate(s.orders):
        assert all(s.stage_to_rank[a.stage] == rank for a in order)


@pytest.mark.parametrize("name", schedule_names())
def test_backward_after_forward_and_update_after_its_window(name):
    s = build_schedule(name, 4, 8, 2)
    for rank, order in enumerate(s.orders):
        position = {a: i for i, a in enumerate(order)}
        for a in order:
            if a.kind in (Kind.B, Kind.I):
                assert position[Action(a.stage, Kind.F, a.index)] < position[a]
            if a.kind is Kind.W:
                assert position[Action(a.stage, Kind.I, a.index)] < position[a]
            if a.kind is Kind.U:
                last = Kind.W if s.split_backward else Kind.B
                before = [Action(a.stage, last, j) for j in s.update_window(a.index)
                          if Action(a.stage, last, j) in position]
                assert before and all(position[b] < position[a] for b in before)


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("t", [1, 3, 8, 20])
def test_async_1f1b_warmup_is_n_minus_1_minus_k(n, t):
    s = async_1f1b(n, t)
    for k, order in enumerate(s.orders):
        leading = 0
        while leading < len(order) and order[leading].kind is Kind.F:
            leading += 1
        # the warm-up forwards, plus the first steady-state forward (or all when T is small)
        assert leading == min(n - 1 - k + 1, t)
        assert [a.index for a in order[:leading]] == list(range(leading))
        # steady state: F(w+j), B(j), U(j)
        w = min(n - 1 - k, t)
        steady = order[w:w + 3 * (t - w)]
        assert [str(a) for a in steady] == [x for j in range(t - w)
                                            for x in (f"{k}F{w + j}", f"{k}B{j}", f"{k}U{j}")]


def test_async_1f1b_exact_order_n3_t4():
    assert orders_as_text(build_schedule("async-1f1b", 3, 1, 4)) == [
        "0F0 0F1 0F2 0B0 0U0 0F3 0B1 0U1 0B2 0U2 0B3 0U3",
        "1F0 1F1 1B0 1U0 1F2 1B1 1U1 1F3 1B2 1U2 1B3 1U3",
        "2F0 2B0 2U0 2F1 2B1 2U1 2F2 2B2 2U2 2F3 2B3 2U3",
    ]


def test_async_1f1b_with_microbatches_updates_every_window():
    # 2bw-style: two micro-batches per update, an update after every second backward
    assert orders_as_text(async_1f1b(2, 2, 2)) == [
        "0F0 0F1 0B0 0F2 0B1 0U0 0F3 0B2 0B3 0U1",
        "1F0 1B0 1F1 1B1 1U0 1F2 1B2 1F3 1B3 1U1",
    ]


def test_1f1b_flush_exact_order_n3_m4():
    assert orders_as_text(build_schedule("1f1b-flush", 3, 4, 1)) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3 0U0",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3 1U0",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2U0",
    ]


def test_1f1b_flush_fewer_microbatches_than_stages():
    assert orders_as_text(build_schedule("1f1b-flush", 3, 1, 2)) == [
        "0F0 0B0 0U0 0F1 0B1 0U1",
        "1F0 1B0 1U0 1F1 1B1 1U1",
        "2F0 2B0 2U0 2F1 2B1 2U1",
    ]


def test_gpipe_exact_order_n2_m2_t2():
    assert orders_as_text(build_schedule("gpipe", 2, 2, 2)) == [
        "0F0 0F1 0B0 0B1 0U0 0F2 0F3 0B2 0B3 0U1",
        "1F0 1F1 1B0 1B1 1U0 1F2 1F3 1B2 1B3 1U1",
    ]


def test_zb_h1_exact_order_n2_m3():
    # stage k defers its W's by k micro-batches
    assert orders_as_text(build_schedule("zb-h1", 2, 3, 1)) == [
        "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2 0U0",
        "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2 1U0",
    ]


def test_interleaved_places_stage_c_n_plus_r_on_rank_r():
    s = build_schedule("interleaved-1f1b", 2, 2, 1, chunks=2)
    assert s.num_stages == 4 and s.num_ranks == 2
    assert s.stage_to_rank == [0, 1, 0, 1]
    assert orders_as_text(s) == [
        "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1 0U0 2U0",
        "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1 1U0 3U0",
    ]


def test_bidirectional_places_two_pipelines_in_opposite_directions():
    s = build_schedule("bidirectional", 4, 4, 1)
    assert s.num_stages == 8 and s.num_ranks == 4
    assert s.stage_to_rank == [0, 1, 2, 3, 3, 2, 1, 0]
    assert s.pipelines == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert {a.index for a in s.stage_actions(0) if a.kind is Kind.F} == {0, 1}
    assert {a.index for a in s.stage_actions(4) if a.kind is Kind.F} == {2, 3}


@pytest.mark.parametrize("n,m", [(2, 1), (4, 3), (8, 7)])
def test_2bw_rejects_fewer_microbatches_than_stages(n, m):
    with pytest.raises(ValueError, match=rf"m >= stages N \(got m={m}, N={n}\)"):
        build_schedule("2bw", n, m, 1)
    assert build_schedule("2bw", n, n, 1).microbatches_per_update == n


@pytest.mark.parametrize("n,m", [(2, 3), (4, 6), (3, 4)])
def test_interleaved_rejects_microbatches_not_multiple_of_ranks(n, m):
    with pytest.raises(ValueError, match=rf"multiple of the ranks \(got M={m}, N={n}\)"):
        build_schedule("interleaved-1f1b", n, m, 1)


def test_bidirectional_rejects_odd_microbatches():
    with pytest.raises(ValueError, match="even number of micro-batches"):
        build_schedule("bidirectional", 2, 3, 1)


@pytest.mark.parametrize("name", schedule_names())
@pytest.mark.parametrize("bad", [dict(stages=0), dict(microbatches=0), dict(batches=0)])
def test_generators_reject_non_positive_sizes(name, bad):
    args = dict(stages=2, microbatches=2, batches=1) | bad
    # 2bw checks m >= N first, which m = 0 fails as well
    with pytest.raises(ValueError, match=r"must be a positive integer|m >= stages N \(got m=0"):
        build_schedule(name, **args)


def test_unknown_schedule_lists_the_names():
    with pytest.raises(ValueError, match="unknown schedule 'nope'; choose one of: gpipe"):
        build_schedule("nope", 2)


def test_lower_async_n3_t3_inserts_send_and_recv():
    lowered = lower(build_schedule("async-1f1b", 3, 1, 3))
    assert orders_as_text(lowered) == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0RECV_B0 0B0 0U0 0RECV_B1 0B1 0U1 0RECV_B2 0B2 0U2",
        "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 1RECV_B0 1B0 1SEND_B0 1U0 "
        "1RECV_F2 1F2 1SEND_F2 1RECV_B1 1B1 1SEND_B1 1U1 1RECV_B2 1B2 1SEND_B2 1U2",
        "2RECV_F0 2F0 2B0 2SEND_B0 2U0 2RECV_F1 2F1 2B1 2SEND_B1 2U1 2RECV_F2 2F2 2B2 2SEND_B2 2U2",
    ]
    with pytest.raises(ValueError, match="already lowered"):
        lower(lowered)


def test_lower_keeps_same_rank_neighbours_local_and_sends_split_input_grads():
    # interleaved: stage 1 -> 2 crosses ranks, nothing is sent between stages on one rank
    lowered = lower(build_schedule("interleaved-1f1b", 2, 2, 1))
    rank0 = [str(a) for a in lowered.orders[0]]
    assert "2RECV_F0" in rank0 and "0SEND_F0" in rank0 and "0RECV_F0" not in rank0
    # zero bubble: the input-gradient half I sends; W does not
    zb = [str(a) for a in lower(build_schedule("zb-h1", 2, 2, 1)).orders[1]]
    assert zb == ["1RECV_F0", "1F0", "1I0", "1SEND_B0", "1RECV_F1", "1F1", "1I1", "1SEND_B1",
                  "1W0", "1W1", "1U0"]


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize("stage,index", [(0, 0), (3, 17), (12, 1024)])
def test_action_parse_round_trips_every_kind(kind, stage, index):
    action = Action(stage, kind, index)
    text = f"{stage}{kind.value}{index}"
    assert str(action) == repr(action) == text
    assert Action.parse(text) == action
    assert Action.parse(f"  {text} ") == action
    assert hash(Action.parse(text)) == hash((stage, kind, index))


@pytest.mark.parametrize("text", ["", "F0", "0X1", "0F", "-1F0", "0SEND0", "a0F0"])
def test_action_parse_rejects_garbage(text):
    with pytest.raises(ValueError, match="not an action"):
        Action.parse(text)
