"""Tests for pipeoptim.schedules.render and csv_io: CSV, Chrome trace, text and PNG."""
from __future__ import annotations

import json
import struct

import pytest

from pipeoptim.schedules import Costs, Kind, build_schedule, schedule_names, simulate
from pipeoptim.schedules import csv_io, render
from pipeoptim.schedules.lower import lower

CASES = [(1, 2, 1), (2, 2, 2), (3, 6, 2), (4, 8, 1), (4, 4, 3)]


def built(name, n, m, t):
    return build_schedule(name, n, m, t)


# -- CSV ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", schedule_names())
@pytest.mark.parametrize("n,m,t", CASES)
def test_csv_round_trips_every_schedule(tmp_path, name, n, m, t):
    s = built(name, n, m, t)
    path = csv_io.write_csv(s, tmp_path / f"{name}.csv")
    back = csv_io.read_csv(path, name=name)
    assert back.orders == s.orders
    assert back.num_stages == s.num_stages and back.num_ranks == s.num_ranks
    assert back.stage_to_rank == s.stage_to_rank
    assert back.pipelines == s.pipelines
    assert back.num_microbatches == s.num_microbatches
    assert back.microbatches_per_update == s.microbatches_per_update
    if t > 1:  # with one update a synchronous and an asynchronous order cannot be told apart
        assert back.synchronous == s.synchronous
    # the schedule read back simulates to the same timeline
    assert simulate(back).makespan == simulate(s).makespan


def test_csv_of_1f1b_flush_n2_m2_has_empty_cells_where_idle(tmp_path):
    path = csv_io.write_csv(built("1f1b-flush", 2, 2, 1), tmp_path / "s.csv")
    assert path.read_bytes() == (b"0F0,0F1,,0B0,,0B1,0U0\r\n"
                                 b",1F0,1B0,1F1,1B1,1U0\r\n")
    assert csv_io.to_csv_rows(built("1f1b-flush", 2, 2, 1), updates=False) == [
        ["0F0", "0F1", "", "0B0", "", "0B1"],
        ["", "1F0", "1B0", "1F1", "1B1"],
    ]


def test_csv_rows_ignore_the_costs_of_a_result():
    s = built("gpipe", 3, 2, 1)
    slow = simulate(s, Costs.uniform(3, 1, 5, comm=2))
    assert csv_io.to_csv_rows(slow) == csv_io.to_csv_rows(s) == [
        ["0F0", "0F1", "", "", "", "", "0B0", "0B1", "0U0"],
        ["", "1F0", "1F1", "", "", "1B0", "1B1", "1U0"],
        ["", "", "2F0", "2F1", "2B0", "2B1", "2U0"],
    ]


def test_csv_of_split_backward_gives_i_and_w_one_step_each():
    rows = csv_io.to_csv_rows(built("zb-h1", 2, 2, 1))
    assert rows == [["0F0", "0F1", "", "0I0", "0W0", "0I1", "0W1", "0U0"],
                    ["", "1F0", "1I0", "1F1", "1I1", "1W0", "1W1", "1U0"]]


@pytest.mark.parametrize("name,n,m,t", [("gpipe", 3, 4, 2), ("1f1b-flush", 4, 8, 2),
                                         ("async-1f1b", 4, 1, 6), ("2bw", 3, 3, 2), ("zb-h1", 3, 4, 2)])
def test_csv_without_updates_loads_in_torch_and_reads_back_with_added_updates(tmp_path, name, n, m, t):
    s = built(name, n, m, t)
    path = csv_io.write_csv(s, tmp_path / "torch.csv", updates=False)
    text = path.read_text()
    assert "U" not in text
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for row in csv_io.to_csv_rows(s, updates=False):
        for cell in row:
            action = schedules._Action.from_str(cell)
            assert (action is None) == (cell == "")
            if action is not None:
                assert str(action) == cell
    back = csv_io.read_csv(path, microbatches_per_update=m, add_updates=True)
    assert back.orders == s.orders
    plain = csv_io.read_csv(path, microbatches_per_update=m)
    assert plain.orders == [[a for a in order if a.kind is not Kind.U] for order in s.orders]


def test_csv_reads_torch_dump_of_its_own_schedule(tmp_path):
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    path = tmp_path / "torch.csv"
    # the shape torch's _dump_csv writes: csv.writer rows of _Action or None
    F, B = schedules._ComputationType.FORWARD, schedules._ComputationType.FULL_BACKWARD
    order = {0: [schedules._Action(0, F, 0), None, schedules._Action(0, B, 0)],
             1: [None, schedules._Action(1, F, 0), schedules._Action(1, B, 0)]}
    import csv
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for rank in order:
            writer.writerow(order[rank])
    s = csv_io.read_csv(path, add_updates=True)
    assert [[str(a) for a in o] for o in s.orders] == [["0F0", "0B0", "0U0"], ["1F0", "1B0", "1U0"]]
    assert simulate(s).makespan == 4


def test_csv_rejects_lowered_schedules_and_bad_files(tmp_path):
    with pytest.raises(ValueError, match="no communication"):
        csv_io.to_csv_rows(lower(built("gpipe", 2, 2, 1)))
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,1F0\n,1B0\n")
    with pytest.raises(ValueError, match="stage 1 appears on rows 0 and 1"):
        csv_io.read_csv(bad)
    bad.write_text("0F0,0SEND_F0\n")
    with pytest.raises(ValueError, match="is communication"):
        csv_io.read_csv(bad)
    bad.write_text("0F0,zz\n")
    with pytest.raises(ValueError, match="not an action"):
        csv_io.read_csv(bad)
    bad.write_text("0F0\n2F0\n")
    with pytest.raises(ValueError, match=r"numbered 0..S-1, found \[0, 2\]"):
        csv_io.read_csv(bad)


# -- Chrome trace ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", schedule_names())
def test_chrome_trace_has_one_complete_event_per_action(tmp_path, name):
    s = built(name, 4, 4, 2)
    result = simulate(s, Costs.uniform(s.num_stages, 1, 2.5, update=0.25))
    trace = render.to_chrome_trace(result)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(result.timeline) == sum(len(o) for o in s.orders)
    for event, timed in zip(events, result.timeline):
        assert event["name"] == str(timed.action)
        assert event["pid"] == 0 and event["tid"] == timed.rank
        assert event["ts"] == pytest.approx(timed.start * 1000)
        assert event["dur"] == pytest.approx((timed.end - timed.start) * 1000)
        assert event["args"] == {"stage": timed.action.stage, "kind": timed.action.kind.value,
                                 "index": timed.action.index, "start": timed.start, "end": timed.end}
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == dict(enumerate(render.row_labels(s)))
    path = render.write_chrome_trace(result, tmp_path / "trace.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(trace))


def test_chrome_trace_unit_is_configurable():
    result = simulate(built("gpipe", 2, 1, 1), Costs.uniform(2, 1, 2))
    events = [e for e in render.to_chrome_trace(result, us_per_unit=1.0)["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"]) for e in events] == [
        ("0F0", 0.0, 1.0), ("1F0", 1.0, 1.0), ("1B0", 2.0, 2.0), ("1U0", 4.0, 0.0),
        ("0B0", 4.0, 2.0), ("0U0", 6.0, 0.0)]


# -- text -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,n,m,t", [("gpipe", 2, 3, 1), ("1f1b-flush", 3, 4, 1),
                                         ("async-1f1b", 4, 1, 6), ("zb-h1", 3, 3, 1),
                                         ("interleaved-1f1b", 2, 2, 1), ("bidirectional", 2, 2, 1)])
def test_text_shows_every_action_and_the_bubble(name, n, m, t):
    s = built(name, n, m, t)
    result = simulate(s)
    text = render.to_text(result, width=400)
    lines = text.splitlines()
    assert f"bubble {result.bubble_fraction:.1%}" in lines[0]
    rows = lines[1:1 + s.num_ranks]
    labels = render.row_labels(s)
    several = any(len(s.stages_of_rank(r)) > 1 for r in range(s.num_ranks))
    for rank, row in enumerate(rows):
        assert row.lstrip().startswith(labels[rank])
        timeline = row.split("|")[1]
        for a in s.orders[rank]:
            if a.kind is Kind.U:
                continue
            assert (str(a) if several else f"{a.kind.value}{a.index}") in timeline, a
        # zero-cost updates are marked U, one per update
        assert timeline.count("U") == sum(1 for a in s.orders[rank] if a.kind is Kind.U) or several
        # idle time is visible exactly where the rank idles
        idle_columns = timeline.count(".")
        scale = len(timeline) / result.makespan
        assert idle_columns == pytest.approx((result.makespan - result.busy[rank]) * scale, abs=1)
    assert lines[-1].startswith("legend:")


def test_text_gpipe_n2_m2_exact():
    text = render.to_text(simulate(built("gpipe", 2, 2, 1)), width=24)
    assert text.splitlines()[1:4] == [
        "stage 0 |F0--F1--........B0==B1=U|",
        "stage 1 |....F0--F1--B0==B1=U....|",
        "   time  0                      6",
    ]


def test_text_squeezes_labels_when_narrow():
    result = simulate(built("async-1f1b", 4, 1, 64))
    rows = render.to_text(result, width=60).splitlines()[1:5]
    for row in rows:  # 134 units in 60 columns: boxes of one column, labels cut to the letter
        timeline = row.split("|")[1]
        assert len(timeline) == 60
        assert set(timeline) <= set("FB-=U.")


# -- PNG ------------------------------------------------------------------------------------------
def png_dimensions(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("name,n,m,t,pixels", [
    ("async-1f1b", 4, 1, 8, (1200, 370)),
    ("gpipe", 2, 4, 1, (1200, 270)),
    ("zb-h1", 4, 4, 1, (1200, 370)),
    ("interleaved-1f1b", 4, 4, 1, (1200, 370)),
    ("bidirectional", 8, 8, 1, (1200, 570)),
])
def test_png_is_written_with_the_expected_size(tmp_path, name, n, m, t, pixels):
    s = built(name, n, m, t)
    result = simulate(s, Costs.uniform(s.num_stages, 1, 2))
    path = render.to_png(result, tmp_path / "s.png", title=f"{name} test")
    assert path.stat().st_size > 10_000
    assert png_dimensions(path) == pixels == render.png_size(result)


def test_png_size_follows_width_and_dpi(tmp_path):
    result = simulate(built("gpipe", 3, 3, 1))
    path = render.to_png(result, tmp_path / "s.png", width=8, dpi=50)
    assert png_dimensions(path) == (400, 160) == render.png_size(result, width=8, dpi=50)
