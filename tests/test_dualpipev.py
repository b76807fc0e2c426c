"""DualPipeV and the schedules torch writes (issue 52): `dualpipev` (zb-v's V placement, a
forward paired with another micro-batch's backward) equals sequential training; torch's own
DualPipeV, ZBV and interleaved orders (from its schedule classes at 4 ranks) are read from its
compute-only CSV, executed through ``Pipeline(schedule=...)`` and equal sequential; a CSV written
by hand runs too, and a malformed or deadlocking one is refused before any work, naming the
action. The torchrun side: tests/torchrun_dualpipev.py in tests/conftest.py's shared jobs."""
from __future__ import annotations

import csv
import json
import re

import pytest
import torch
from torch import nn

import pipeoptim
from conftest import Crash, batches, crash_at, mlp
from pipeoptim.cli import main
from pipeoptim.schedules import Costs, Kind, build_schedule, csv_io, simulate
from pipeoptim.schedules.lower import lower
from pipeoptim.throughput import predict
from test_memory import measured, simulated_in_flight, synthetic
from torch_orders import CLASSES, torch_rows
from torchrun_jobs import run_here

LOSS = nn.functional.cross_entropy
HERE_SCRIPT = "tests/torchrun_dualpipev.py"


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def _train(method=None, data=6, **kw):
    return pipeoptim.train(mlp(depth=8), batches(data), loss_fn=LOSS, optimizer=adam,
                           **({"method": method} if method else {}), **kw)


def _assert_equal(got, expected, count=6):
    assert len(got.losses) == len(expected.losses) == count
    assert got.losses == pytest.approx(expected.losses, rel=1e-12, abs=0)
    for (name, a), b in zip(got.model.named_parameters(), expected.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=name)
    moved = [(a - b).abs().max() for a, b in zip(expected.model.parameters(), mlp(depth=8).parameters())]
    assert min(moved) > 1e-4  # the run trained every weight


def _cells(rows):
    return [[c for c in row if c] for row in rows]


def _write(path, rows):
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    return path


# -- the order -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,m", [(2, 4), (3, 6), (4, 8), (4, 12), (5, 11)])
def test_dualpipev_orders_as_torchs_dualpipev_and_writes_its_pairs(n, m):
    s = build_schedule("dualpipev", n, m)
    ours = csv_io.to_csv_rows(s, updates=False)
    assert _cells(ours) == _cells(torch_rows("dualpipev", n, m))
    assert s.stage_to_rank == [min(k, 2 * n - 1 - k) for k in range(2 * n)]  # the V
    assert s.pairs and all(f.kind is Kind.F and b.kind is Kind.B for f, b in s.pairs.items())
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for cell in (c for row in ours for c in row if c):
        assert str(schedules._Action.from_str(cell)) == cell


def test_a_pair_is_lowered_with_both_receives_before_it_and_simulated_whole():
    s = build_schedule("dualpipev", 3, 6)
    f, b = next((f, b) for f, b in s.pairs.items() if f.stage == 1 and b.stage == 4)  # rank 1's
    order = lower(s).orders[1]
    at = order.index(f)
    assert order[at - 2:at + 4] == [(1, Kind.RECV_F, f.index), (4, Kind.RECV_B, b.index), f, b,
                                    (1, Kind.SEND_F, f.index), (4, Kind.SEND_B, b.index)]
    timed = {t.action: t for t in simulate(s, Costs.uniform(6, 1, 2, comm=0.5)).timeline}
    assert timed[b].start == timed[f].end  # one after the other, as on the CPU
    assert simulate(build_schedule("dualpipev", 4, 8)).makespan == 38


# -- equal to sequential, one process -------------------------------------------------------------
@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (3, 6), (2, 3)])
def test_dualpipev_equals_sequential(n, m):
    reference = _train("sequential", micro_batches=m)
    got = _train("dualpipev", stages=n, micro_batches=m)
    _assert_equal(got, reference)


def test_dualpipev_takes_2n_micro_batches_and_places_a_v():
    pipe = pipeoptim.Pipeline(mlp(depth=8), method="dualpipev", stages=3, loss_fn=LOSS, optimizer=adam)
    assert (pipe.spec.stages, pipe.spec.chunks, pipe.spec.microbatches) == (6, 2, 6)
    assert pipe.placement == [0, 1, 2, 2, 1, 0]


def test_a_dualpipev_run_resumes_mid_epoch_to_the_uninterrupted_run(tmp_path):
    def run(folder, **kw):
        torch.manual_seed(123)
        return _train("dualpipev", data=8, stages=2, epochs=2, checkpoint_dir=folder, checkpoint_every=3, **kw)

    expected = run(tmp_path / "full").losses
    with pytest.raises(Crash):
        run(tmp_path / "cut", on_batch=crash_at(11))
    assert run(tmp_path / "cut", resume=True).losses == expected and len(expected) == 16


def test_the_planner_prices_dualpipev_as_the_simulator_runs_it():
    prof = synthetic(4)
    row = predict("dualpipev", prof, [1, 1, 1, 1], microbatches=4, batches=2, batch_size=8, speeds=[1.0, 2.0])
    costs = Costs([0.001, 0.0005, 0.0005, 0.001], [0.002, 0.001, 0.001, 0.002], [0.001, 0.0005, 0.0005, 0.001])
    result = simulate(build_schedule("dualpipev", 2, 4, 2), costs)
    assert row["makespan_seconds"] == pytest.approx(result.makespan)
    assert row["bubble_fraction"] == pytest.approx(result.bubble_fraction)
    assert [r["rank"] for r in row["memory"]] == [0, 1, 1, 0]
    assert [r["in_flight_microbatches"] for r in row["memory"]] == result.peak_activations == [4, 3, 2, 1]


def test_dualpipev_holds_the_activations_the_simulator_counts():
    """2 processes x 2 chunks, M = 4: each model stage's measured peak of micro-batches held
    (whole backwards free theirs, split ones at the weight half) is the simulator's."""
    stages = measured("dualpipev", partition=(1, 1, 1, 2))
    assert [s["peak_microbatches"] for s in stages] == simulated_in_flight("dualpipev") == [4, 3, 2, 1]


# -- torch's orders, read and run ------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CLASSES))
def test_torchs_orders_at_four_ranks_round_trip_and_train_as_sequential(tmp_path, name):
    rows = torch_rows(name, 4, 8)
    path = _write(tmp_path / f"{name}.csv", rows)
    read = csv_io.read_csv(path, add_updates=True)
    assert (read.num_ranks, read.num_stages, read.microbatches_per_update) == (4, 8, 8)
    again = csv_io.from_csv_rows(csv_io.to_csv_rows(read, updates=False), add_updates=True)
    assert again.orders == read.orders and again.pairs == read.pairs
    assert _cells(csv_io.to_csv_rows(read, updates=False)) == _cells(rows)
    assert bool(read.pairs) == (name == "dualpipev")
    reference = _train("sequential", micro_batches=8)
    _assert_equal(_train(schedule=path), reference)


def test_a_hand_written_csv_and_a_schedule_object_run_through_the_pipeline(tmp_path, capsys):
    """Two ranks, one stage each, three micro-batches; split and whole backwards mixed, a pair."""
    path = tmp_path / "mine.csv"
    path.write_text("0F0,0F1,,0I0,0F2,0W0,0B1,,0B2\n,1F0,1B0,1F1,(1F2;1B1)OVERLAP_F_B,,1B2\n")
    reference = _train("sequential", micro_batches=3)
    pipe = pipeoptim.Pipeline(mlp(depth=8), schedule=str(path), loss_fn=LOSS, optimizer=adam)
    assert (pipe.spec.stages, pipe.spec.microbatches, pipe.placement) == (2, 3, [0, 1])
    got = pipe.fit(batches(6))
    _assert_equal(got, reference)
    schedule = csv_io.read_csv(path, add_updates=True)
    _assert_equal(_train(schedule=schedule, method="1f1b-flush", stages=2, micro_batches=3), reference)
    with pytest.raises(ValueError, match="pairs forwards with backwards"):
        pipe.fit(batches(2), eval_every=1, eval_in_bubbles=True, eval_loader=batches(1))
    assert main(["schedule", "--from-csv", str(path), "--batches", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["schedule"], report["ranks"], report["microbatches"], report["batches"]) == ("mine", 2, 3, 2)
    assert report["makespan"] == 17



def test_a_schedule_runs_checkpoint_resumes_with_that_schedule_only(tmp_path):
    """A checkpoint of a ``schedule=`` run records its actions' digest (not its name): a resume with
    another schedule, or with the method's own, is refused naming the fix; with the same actions (a
    Schedule object read from the file) it reaches the uninterrupted run's losses."""
    from pipeoptim.checkpoint import schedule_digest
    from pipeoptim.errors import CheckpointError

    mine = tmp_path / "mine.csv"
    mine.write_text("0F0,0F1,,0I0,0F2,0W0,0B1,,0B2\n,1F0,1B0,1F1,(1F2;1B1)OVERLAP_F_B,,1B2\n")
    other = _write(tmp_path / "other.csv", [["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"],
                                              ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]])

    def run(folder, **kw):
        torch.manual_seed(123)
        return _train(data=8, epochs=2, checkpoint_dir=folder, checkpoint_every=3, **kw)

    expected = run(tmp_path / "full", schedule=mine).losses
    with pytest.raises(Crash):
        run(tmp_path / "cut", schedule=mine, on_batch=crash_at(11))
    digest = schedule_digest(csv_io.read_csv(mine, add_updates=True))
    store = tmp_path / "cut"
    newest = store / json.loads((store / "latest.json").read_text())["checkpoint"]
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["schedule"] == digest and manifest["method"] == "zb-h1"
    fix = "resume with the schedule that wrote it, or give another checkpoint_dir to train from the beginning"
    theirs = schedule_digest(csv_io.read_csv(other, add_updates=True))
    with pytest.raises(CheckpointError, match=re.escape(f"the schedule= whose actions' digest is {digest[:12]} wrote "
                                                        f"it, but this run has the schedule= whose actions' digest "
                                                        f"is {theirs[:12]}: {fix}")):
        run(tmp_path / "cut", schedule=other, resume=True)
    with pytest.raises(CheckpointError, match=re.escape(f"this run has zb-h1's own schedule (no schedule=): {fix}")):
        run(tmp_path / "cut", method="zb-h1", stages=2, micro_batches=3, resume=True)
    again = csv_io.read_csv(mine, name="renamed", add_updates=True)
    assert run(tmp_path / "cut", schedule=again, resume=True).losses == expected and len(expected) == 16

REFUSED = [
    ("0B0,0F0\n,1F0,1B0\n", "rank 0 runs 0B0 before 0F0"),
    ("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", "deadlocks: 0B0 waits for 1B0; 1F1 waits for 0F1"),
    ("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n", "no 0B1"),
    ("0F0,1F0\n,1B0,0B0\n", "1B0: stage 1 appears on rows 0 and 1"),
    ("0F0,0F1,0B0,0B1\n1F0,(1F1;1B1)OVERLAP_F_B,1B0\n", "(1F1;1B1) runs a micro-batch's backward with its own"),
    ("0F0,(0B0;0F1)OVERLAP_F_B,0B1\n1F0,1B0\n", "must pair a forward with a backward"),
    ("0F0,0UNSHARD,0B0\n1F0,1B0\n", "'0UNSHARD' is torch's FSDP action"),
    ("0F0,0SEND_F0,0B0\n1F0,1B0\n", "is communication"),
]


@pytest.mark.parametrize("text,says", REFUSED, ids=[s.split(":")[0][:24] for _, s in REFUSED])
def test_a_malformed_or_deadlocking_csv_is_refused_before_any_work_naming_the_action(tmp_path, text, says):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    model = mlp(depth=8)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=re.escape(says)):
        pipeoptim.Pipeline(model, schedule=path, loss_fn=LOSS, optimizer=adam)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert main(["schedule", "--from-csv", str(path)]) == 2


def test_schedule_options_that_contradict_the_schedule_are_refused(tmp_path):
    path = _write(tmp_path / "zbv.csv", torch_rows("zbv", 2, 4))
    for options, says in [(dict(method="pipeoptim"), "pipeoptim is asynchronous"),
                          (dict(stages=3), "stages=3, but schedule zbv has 2: drop stages="),
                          (dict(micro_batches=2), "micro_batches=2, but schedule zbv has 4"),
                          (dict(partition=[2, 2, 4]), "runs 4 stages; the partition [2, 2, 4] lists 3")]:
        with pytest.raises(ValueError, match=re.escape(says)):
            pipeoptim.Pipeline(mlp(depth=8), schedule=path, loss_fn=LOSS, optimizer=adam, **options)
    with pytest.raises(ValueError, match="no such file"):
        pipeoptim.Pipeline(mlp(depth=8), schedule=tmp_path / "none.csv", loss_fn=LOSS, optimizer=adam)


# -- under torchrun (the shared jobs) -----------------------------------------------------------------
def _runs(text):
    return {r["run"]: r for r in map(json.loads, text.strip().splitlines()) if r}


@pytest.mark.parametrize("nproc", [2, 4])
def test_dualpipev_and_torchs_order_under_torchrun_equal_one_process_and_sequential(request, nproc):
    job = request.getfixturevalue(f"torchrun_{nproc}")
    spread = _runs("\n".join(job.lines(f"dualpipev-{nproc}", rank=0)))
    local = _runs(run_here(HERE_SCRIPT, nproc))
    assert sorted(spread) == ["dualpipev", "torch-dualpipev"] and sorted(local) == sorted([*spread, "sequential"])
    reference = local["sequential"]
    for run in ("dualpipev", "torch-dualpipev"):
        assert (spread[run]["processes"], local[run]["processes"]) == (nproc, 1)
        assert spread[run]["losses"] == local[run]["losses"], run
        assert spread[run]["weights"] == local[run]["weights"], run
        assert spread[run]["losses"] == pytest.approx(reference["losses"], rel=1e-12, abs=0), run
        for name, value in spread[run]["weights"].items():
            torch.testing.assert_close(torch.tensor(value), torch.tensor(reference["weights"][name]),
                                       rtol=1e-12, atol=1e-14)
