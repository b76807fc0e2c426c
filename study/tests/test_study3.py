"""study/study3.py and study3_plan.py, the equal-time study's runner: U_m mini-batches as
repeated passes over the epoch, the lrs it carries, re-tunes or sweeps, the default plan's
order and cuts against the second study's committed rows and the committed budget, and a tiny
study end to end (the smoke suite: the image task's mlp at N = 2 on 96 made-up images, a second
a run): the rows' updates and evaluations, the halving, the seeds waiting for the tuning, a
resumed call that runs nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from study import study3 as runner, study3_plan, study3_suite

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def study3():
    return runner


@pytest.fixture(scope="module")
def plan():
    return study3_plan


def test_updates_as_passes_over_the_epoch(study3):
    assert study3.passes(["a", "b", "c"], 7) == ["a", "b", "c", "a", "b", "c", "a"]
    assert study3.passes(["a", "b", "c"], 2) == ["a", "b"]
    with pytest.raises(ValueError, match="no training"):
        study3.passes([], 3)


def test_neighbour_goes_toward_the_runner_up(plan):
    assert plan.neighbour(0.01, 0.02) == 0.02
    assert plan.neighbour(0.01, 0.005) == 0.005
    assert plan.neighbour(0.004, None) == 0.002  # no runner-up: half (a longer schedule)
    assert plan.neighbour(0.0025, 0.01) == 0.005
    # at an edge of the second study's grid: beyond it, where it never looked
    grid = [0.001, 0.002, 0.004, 0.008]
    assert plan.neighbour(0.008, 0.004, grid) == 0.016
    assert plan.neighbour(0.001, 0.002, grid) == 0.0005
    assert plan.neighbour(0.002, 0.004, grid) == 0.004


def _default_plan(study3, plan):
    suite = study3.SUITES["default"]
    rows2 = study3.study2_rows(suite)
    times = json.loads((ROOT / "study/results/study3/times.json").read_text())
    return suite, rows2, times, plan.plan_runs(suite, {}, times, rows2)


def test_the_dominated_cut_is_what_the_second_study_shows(study3, plan):
    suite = study3.SUITES["default"]
    dominated = plan.dominated_variants(study3.study2_rows(suite))
    # every method the plan drops is matched or beaten in every setting of the second study
    assert set(suite["cuts"]["dominated"]) <= set(dominated)
    # (the first dominator in the methods' order: spectrain matches or beats pipedream too, but
    # with the third seeds at N = 4 in, pipedream-2bw, listed before it, does as well)
    assert dominated["async-naive"] == "spectrain" and dominated["pipedream"] in ("pipedream-2bw", "spectrain")


def test_default_plan_follows_the_budget_plan(study3, plan):
    suite, rows2, times, runs = _default_plan(study3, plan)
    assert [r.index for r in runs] == list(range(len(runs)))
    assert all(r.status in ("ready", "waiting") for r in runs)
    variants = {r.variant for r in runs}
    # the dominated methods are gone from the second study's cells (pipeoptim at M = 1 stays in the
    # NAdam and Muon arms)
    assert not {r.variant for r in runs if r.optimizer in ("momentum", "adamw")} & set(suite["cuts"]["dominated"])
    assert {r.variant for r in runs if r.optimizer == "muon"} >= {"pipeoptim"}
    assert {"pipeoptim+MN", "pipeoptim-2bw", "xpipe"} <= variants
    # pipeoptim at M = 2 is xpipe's computation (study3_suite.SAME_AS): xpipe's runs only
    assert "pipeoptim+M2" not in variants and study3_suite.SAME_AS == {"pipeoptim+M2": "xpipe"}
    # the references first; N = 4 cut (the budget's first cut)
    phases = [r.phase for r in runs]
    assert phases[:12] == ["reference"] * 12
    assert {r.stages for r in runs} == {1, 8} and suite["cut_stages"] == [4]
    # planned again, every N = 8 run comes before any N = 4 run, with 2 seeds there
    both = plan.plan_runs({**suite, "stages": [8, 4]}, {}, times, rows2)
    last8 = max(i for i, r in enumerate(both) if r.stages == 8)
    assert all(r.stages != 4 for r in both[:last8]) and any(r.stages == 4 for r in both)
    assert {r.seed for r in both if r.stages == 4} == {0, 1}
    # item 4: NAdam (beta1 0.99) and Muon on the LM at N = 8 only, sequential swept there too
    for optimizer in ("nadam", "muon"):
        cell = [r for r in runs if (r.task, r.optimizer) == ("lm", optimizer)]
        assert {r.variant for r in cell} == {"sequential", "pipedream-2bw", "xpipe", "pipeoptim", "pipeoptim-2bw"}
        assert {r.stages for r in cell} == {1, 8}
        assert sorted({r.lr for r in cell if r.until == "third"}) == plan.sweep_grid(suite, "lm", optimizer)
    assert suite["optimizer_arms"]["beta1"] == {"nadam": 0.99}
    # carried lrs are the second study's; a re-tuned cell adds one neighbour
    from pipeoptim.lab.tasks.recipes import TUNED_LRS

    xpipe_image = [r for r in runs if (r.task, r.optimizer, r.variant, r.phase) == ("image", "momentum", "xpipe",
                                                                                  "seeds")]
    assert {r.lr for r in xpipe_image} == {TUNED_LRS[("image", "momentum", "xpipe")]}
    assert {r.lr_source for r in xpipe_image} == {"second study, carried over unchecked"}
    # re-tuned only where the second study's choice was at an edge of its grid: every method on
    # sentiment (0.008, the top), xpipe and pipeoptim+lr_correction on the LM (0.0005, the bottom)
    retuned = {(r.task, r.variant, r.lr) for r in runs if r.phase == "tune" and r.until is None}
    sentiment = ["pipedream-2bw", "spectrain", "xpipe", "pipeoptim+lr_correction", "pipeoptim+MN"]
    assert retuned == {("sentiment", v, lr) for v in sentiment for lr in (0.008, 0.016)} | {
        ("lm", v, lr) for v in ("xpipe", "pipeoptim+lr_correction") for lr in (0.0005, 0.00025)}
    assert TUNED_LRS[("lm", "adamw", "xpipe")] == 0.0005
    # each run's U_m is the budget's, each reference sequential's U
    for r in runs:
        expected = 2577 if (r.task, r.variant) == ("image", "sequential") else None
        if expected:
            assert r.updates == expected
        elif r.variant != "sequential":
            assert r.updates == times["cells"][r.task][r.optimizer]["stages"][str(r.stages)]["budget"]["updates"][
                r.variant]
    # the plan at the second study's seconds per update: 1,008 core-minutes with N = 4 and 3 seeds,
    # 604 without N = 4 and with 2 seeds at N = 8 (docs/study_plan.md: the runs cost 1.6-1.9x
    # that in CPU time, hence the cuts), 559 once pipeoptim+M2 is xpipe's line
    total = sum(r.minutes for r in runs)
    assert 555 < total <= 565
    assert {r.seed for r in runs if r.stages == 8} == {0, 1}


def test_shards_split_the_plan(study3, plan):
    _, _, _, runs = _default_plan(study3, plan)
    a, b = plan.shard_runs(runs, (0, 2)), plan.shard_runs(runs, (1, 2))
    assert {r.index for r in a} | {r.index for r in b} == set(range(len(runs)))
    assert not {r.index for r in a} & {r.index for r in b}


def _smoke_times(updates):
    """A budget for the smoke suite: image x momentum at N = 2."""
    cell = {"sequential": {"seconds_per_batch": 0.04}, "stages": {}}
    for n, per_variant in updates.items():
        cell["stages"][str(n)] = {
            "variants": {v: {"seconds_per_batch": 0.12 / u} for v, u in per_variant.items()},
            "budget": {"fastest": {"schedule": "zb-h1", "microbatches": n}, "seconds_per_batch": 0.01,
                       "sequential_updates": 12, "budget_seconds": 0.12, "updates": per_variant}}
    return {"format": "pipeoptim-study3-times", "version": 1, "cells": {"image": {"momentum": cell}}}


def test_tiny_study_end_to_end(study3, tiny_images, tmp_path, capsys):
    times = tmp_path / "times.json"
    times.write_text(json.dumps(_smoke_times({2: {"pipeoptim+M2": 14, "pipeoptim-2bw": 12}})))
    args = ["--suite", "smoke", "--out", str(tmp_path / "study"), "--times", str(times),
            "--methods", "sequential,pipeoptim+M2,pipeoptim-2bw", "--stages", "2"]
    assert study3.main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "study/runs.jsonl").read_text().splitlines()]
    got = [(r["phase"], r["until"], r["variant"], r["stages"], r["lr"], r["seed"], r["updates"]) for r in rows]
    swept_winner = next(r["lr"] for r in rows if r["variant"] == "pipeoptim-2bw" and r["until"] == "end")
    assert got[:8] == [
        ("reference", None, "sequential", 1, 0.01, 0, 12), ("reference", None, "sequential", 1, 0.01, 1, 12),
        # pipeoptim-2bw was never tuned: 2 lrs to the first third (the evaluation nearest 12 / 3)
        ("tune", "third", "pipeoptim-2bw", 2, 0.01, 0, 12), ("tune", "third", "pipeoptim-2bw", 2, 0.04, 0, 12),
        # pipeoptim+M2 carries pipeoptim's lr and re-tunes it against one neighbour, both to the end
        ("tune", None, "pipeoptim+M2", 2, 0.01, 0, 14), ("tune", None, "pipeoptim+M2", 2, 0.005, 0, 14),
        ("tune", "end", "pipeoptim-2bw", 2, swept_winner, 0, 12),
        ("seeds", None, "pipeoptim+M2", 2, max(rows[4:6], key=lambda r: (r["validation_metric"], -r["lr"]))["lr"],
         1, 14)]
    assert got[8] == ("seeds", None, "pipeoptim-2bw", 2, swept_winner, 1, 12) and len(got) == 9
    whole = rows[4]
    # 14 updates: one pass of the 12 mini-batches and 2 of the next, evaluated every 4 and at the end
    assert [e["updates"] for e in whole["evaluations"]] == [4, 8, 12, 14]
    assert whole["epochs"] == pytest.approx(14 / 12) and whole["microbatches"] == 2
    assert whole["seconds_per_batch"] == pytest.approx(0.12 / 14) and 0 < whole["final_metric"] <= 1
    assert whole["cpu_seconds"] > 0  # what the run cost the cores, whoever shared them
    third = rows[2]
    assert third["stopped_at"] == 4 and [e["updates"] for e in third["evaluations"]] == [4]
    assert rows[6]["resumed"] is True and [e["updates"] for e in rows[6]["evaluations"]] == [4, 8, 12]
    assert rows[6]["microbatches"] == 2  # pipeoptim-2bw at M = N
    assert not list((tmp_path / "study").glob("runs/*/checkpoints/*"))  # nothing left to resume
    before = (tmp_path / "study/runs.jsonl").read_text()
    capsys.readouterr()
    assert study3.main(args) == 0
    assert (tmp_path / "study/runs.jsonl").read_text() == before
    assert "nothing left to run" in capsys.readouterr().out


def _final_row(variant, stages, lr, seed, final, phase="seeds"):
    return {"task": "lm", "optimizer": "adamw", "variant": variant, "stages": stages, "lr": lr, "seed": seed,
            "phase": phase, "until": None, "updates": 100, "final_metric": final}


def test_a_second_seed_is_cut_where_seed_0_ended_decisively_behind(plan):
    rows = {str(i): row for i, row in enumerate([
        _final_row("sequential", 1, 0.004, 0, 60.0, "reference"), _final_row("sequential", 1, 0.004, 1, 50.0,
                                                                             "reference"),
        _final_row("sequential", 1, 0.002, 0, 900.0, "tune"),  # another lr: not the reference
        _final_row("xpipe", 8, 0.001, 0, 66.5), _final_row("xpipe", 8, 0.002, 0, 300.0, "tune"),
        {**_final_row("spectrain", 8, 0.001, 0, 60.0), "until": "third"},  # a first third decides nothing
        {**_final_row("pipedream", 8, 0.001, 0, None), "diverged": "loss nan"}])}

    def decide(variant, lr, gap=0.2, higher=False):
        return plan.decided_by_seed0(rows, "lm", "adamw", variant, 8, lr, 0.004, higher, gap)

    # perplexity (lower is better): the reference's mean is 55; 66.5 is 20.9 % behind it
    status, why = decide("xpipe", 0.001)
    assert (status, why) == ("dropped", "seed 0 ended 21% behind the synchronous pipeline (the decisive-gap cut)")
    assert decide("xpipe", 0.001, gap=0.21) == ("ready", "")
    assert decide("xpipe", 0.002)[0] == "dropped"  # its tuning run is its seed 0
    assert decide("spectrain", 0.001)[0] == "waiting"  # no whole seed-0 run yet
    assert decide("pipedream", 0.001) == ("ready", "")  # a diverged seed 0: run the next
    # accuracy (higher is better): 66.5 is ahead of 55, never cut
    assert decide("xpipe", 0.001, higher=True) == ("ready", "")
    assert plan.decided_by_seed0(rows, "lm", "adamw", "xpipe", 8, 0.001, 0.0001, False, 0.2) == ("ready", "")


def test_the_decisive_gap_cut_on_the_committed_rows(study3, plan):
    suite, rows2, times, _ = _default_plan(study3, plan)
    rows = plan.load_rows(ROOT / "study/results/study3/runs.jsonl")
    runs = plan.plan_runs(suite, rows, times, rows2)
    dropped = [r for r in runs if r.status == "dropped"]
    assert suite["cuts"]["decisive_gap"] == 0.4
    assert all(r.phase == "seeds" and r.seed == 1 and r.task == "lm" and "decisive-gap" in r.why for r in dropped)
    # xpipe with AdamW ended 86 % behind (107.1 against 57.6): cut; pipeoptim-2bw 24 % (71.2): run
    cut = {(r.optimizer, r.variant) for r in dropped}
    assert ("adamw", "xpipe") in cut and ("adamw", "pipeoptim-2bw") not in cut
    # no seed is cut on image or sentiment
    assert not [r for r in runs if r.task != "lm" and r.status != "done"]


def test_a_claimed_run_is_held_until_its_holder_lets_go(study3, tmp_path):
    folder = tmp_path / "run"
    assert not study3.held_elsewhere(folder)
    with study3.claim(folder) as mine:
        assert mine is not None and study3.held_elsewhere(folder)
        with study3.claim(folder) as other:
            assert other is None
        assert (folder / study3.CLAIM).read_text() == f"{os.getpid()}\n"  # a look leaves the holder's pid
    assert not study3.held_elsewhere(folder)
    # a worker that dies holding a run leaves nothing stale: the kernel lets go of its lock
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); sys.stdin.read()", str(folder / study3.CLAIM)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert study3.held_elsewhere(folder)
    finally:
        holder.kill()
        holder.wait()
    assert not study3.held_elsewhere(folder)


def test_a_worker_skips_the_run_another_worker_holds(study3, tiny_images, tmp_path, capsys):
    times = tmp_path / "times.json"
    times.write_text(json.dumps(_smoke_times({2: {"pipeoptim+M2": 14}})))
    study = tmp_path / "study"
    args = ["--suite", "smoke", "--out", str(study), "--times", str(times), "--methods", "sequential",
            "--stages", "2"]
    with study3.claim(study / "runs" / "image-momentum-sequential-N1-lr0.01-seed0") as mine:
        assert mine is not None
        assert study3.main(args) == 0
    rows = [json.loads(line) for line in (study / "runs.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["seed"]) for r in rows] == [("sequential", 1)]
    assert "waits for another worker" in capsys.readouterr().out
    assert study3.main(args) == 0  # let go: the next call takes it
    rows = [json.loads(line) for line in (study / "runs.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["seed"]) for r in rows] == [("sequential", 1), ("sequential", 0)]


def test_first_puts_a_variants_ready_runs_first(study3, tiny_images, tmp_path):
    times = tmp_path / "times.json"
    times.write_text(json.dumps(_smoke_times({2: {"pipeoptim+M2": 14}})))
    args = ["--suite", "smoke", "--out", str(tmp_path / "study"), "--times", str(times),
            "--methods", "sequential,pipeoptim+M2", "--stages", "2", "--max-runs", "1"]
    assert study3.main(args + ["--first", "pipeoptim+M2"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "study/runs.jsonl").read_text().splitlines()]
    assert [(r["phase"], r["variant"], r["lr"]) for r in rows] == [("tune", "pipeoptim+M2", 0.01)]
    assert study3.main(args) == 0  # without it, the plan's order: the reference first
    rows = [json.loads(line) for line in (tmp_path / "study/runs.jsonl").read_text().splitlines()]
    assert [(r["phase"], r["variant"]) for r in rows][1] == ("reference", "sequential")


def test_the_default_suite_can_be_written_as_json(study3):
    """The study writes its suite beside its rows: the default suite (whose lr grids are keyed by
    (task, optimizer)) must survive json.dumps."""
    suite = study3_suite.SUITES["default"]
    text = json.dumps(study3.json_keys({"suite": "default", **suite}), default=str)
    assert json.loads(text)["lr_grid"]["lm/nadam"] == [5e-4, 4e-3]


def test_a_sweep_whose_best_is_at_an_edge_runs_one_lr_beyond_it(study3, plan):
    suite, rows2, times, runs = _default_plan(study3, plan)
    grid = plan.sweep_grid(suite, "lm", "nadam")
    assert grid == [0.0005, 0.001, 0.002, 0.004]
    rows = {}

    def row(lr, until, perplexity, seed=0, phase="tune"):
        fields = {"task": "lm", "optimizer": "nadam", "variant": "sequential", "stages": 1, "lr": lr, "seed": seed,
                  "phase": phase, "until": until, "updates": 2000, "validation_metric": perplexity}
        rows[plan.row_key(fields)] = fields

    def mine(runs):
        return [(r.phase, r.until, r.lr, r.seed, r.status) for r in runs
                if (r.task, r.optimizer, r.variant) == ("lm", "nadam", "sequential")]

    for lr, ppl in zip(grid, (126.0, 103.0, 92.0, 88.0)):  # the larger the better, after a third
        row(lr, "third", ppl)
    row(0.004, "end", 60.0)  # the top of the grid wins at the end too
    row(0.002, "end", 62.0)
    got = mine(plan.plan_runs(suite, rows, times, rows2))
    assert ("tune", None, 0.008, 0, "ready") in got  # one step beyond the edge, a whole run
    assert suite["cuts"]["seeds_at"][8] == [0, 1]  # seed 0 is the tuning's run
    assert [g for g in got if g[0] == "reference"] == [("reference", None, None, 1, "waiting")]
    row(0.008, None, 61.0)  # beyond the edge is worse: the references run at the edge's lr
    assert {(g[2], g[4]) for g in mine(plan.plan_runs(suite, rows, times, rows2)) if g[0] == "reference"} == {
        (0.004, "ready")}
    row(0.008, None, 59.0)  # better: they run there (and nothing goes further: one step only)
    got = mine(plan.plan_runs(suite, rows, times, rows2))
    assert {(g[2], g[4]) for g in got if g[0] == "reference"} == {(0.008, "ready")}
    assert not [g for g in got if g[2] == 0.016]
    # an interior winner runs nothing more; without extend_edges, neither does an edge
    row(0.002, "end", 55.0)
    assert not [g for g in mine(plan.plan_runs(suite, rows, times, rows2)) if g[2] == 0.008 and g[0] == "tune"]
    row(0.002, "end", 62.0)
    assert not [g for g in mine(plan.plan_runs({**suite, "extend_edges": False}, rows, times, rows2))
                if g[2] == 0.008]
