"""study/study2_plan.py, issue 16's study plan, which its report (make_results2.py) and the
equal-time study (study3*.py) read the second study's rows through: the runs of each phase, the
log-spaced lrs, the halving on the validation metric, the seeds waiting for the sweep, the
correction choice and the shards, without training. (The study's runner, benchmarks/study2.py,
and its end-to-end test are in commit 6bb0f1e.)"""
from __future__ import annotations

import json
import types

import pytest

from study import common, study2_plan


@pytest.fixture(scope="module")
def study2():
    plan = study2_plan
    return types.SimpleNamespace(**vars(plan), append_line=common.append_line)


def _plan_tuples(runs):
    return [(r.phase, r.until, r.variant, r.stages, r.seed, r.lr, r.status) for r in runs]


def test_smoke_plan_is_exactly_the_runs_asked_for(study2):
    runs = study2.plan_runs(study2.SUITES["smoke"], {})
    assert [r.index for r in runs] == list(range(len(runs)))
    assert _plan_tuples(runs) == [
        # the sweep at the largest N (sequential has none), seed 0, both lrs to the first third
        ("sweep", "third", "sequential", 1, 0, 0.01, "ready"),
        ("sweep", "third", "sequential", 1, 0, 0.04, "ready"),
        ("sweep", "third", "pipeoptim", 4, 0, 0.01, "ready"),
        ("sweep", "third", "pipeoptim", 4, 0, 0.04, "ready"),
        ("sweep", "third", "pipeoptim+lr_correction", 4, 0, 0.01, "ready"),
        ("sweep", "third", "pipeoptim+lr_correction", 4, 0, 0.04, "ready"),
        # the halving keeps 1 of 2: unknown until both thirds are in
        ("sweep", "end", "sequential", 1, 0, None, "waiting"),
        ("sweep", "end", "pipeoptim", 4, 0, None, "waiting"),
        ("sweep", "end", "pipeoptim+lr_correction", 4, 0, None, "waiting"),
        ("confirm", None, "gpipe", 4, 0, None, "waiting"),
        # seed 0 at N = 4 is the sweep's run; sequential once; N = 2 all seeds; in rounds:
        # every setting's next seed before any setting's last
        ("seeds", None, "sequential", 1, 1, None, "waiting"),
        ("seeds", None, "pipeoptim", 4, 1, None, "waiting"),
        ("seeds", None, "pipeoptim+lr_correction", 4, 1, None, "waiting"),
        ("seeds", None, "pipeoptim", 2, 0, None, "waiting"),
        ("seeds", None, "pipeoptim+lr_correction", 2, 0, None, "waiting"),
        ("seeds", None, "pipeoptim", 2, 1, None, "waiting"),
        ("seeds", None, "pipeoptim+lr_correction", 2, 1, None, "waiting"),
        # the correction choice, last: at the sweep's N and seed, the base's best lr
        ("correction", None, "pipeoptim+lr_correction+horizon", 4, 0, None, "waiting"),
    ]
    corrected = [r for r in runs if r.variant == "pipeoptim+lr_correction"]
    assert {(r.method, json.dumps(r.options)) for r in corrected} == {("pipeoptim", '{"lr_correction": "delay"}')}
    assert "first thirds of pipeoptim at lr 0.01, 0.04" in runs[7].why
    # 12 updates evaluated at 4, 8, 12: the first part stops at 4 (a third)
    assert study2.drain_points(12, 1, 4) == [4, 8, 12]
    assert study2.stop_point(12, 1, 4, 1 / 3) == 4


def test_default_plan_follows_the_budget_plan(study2):
    suite = study2.SUITES["default"]
    runs = study2.plan_runs(suite, {})
    phases = {}
    for run in runs:
        phases[(run.phase, run.until)] = phases.get((run.phase, run.until), 0) + 1
    # 4 cells x 8 methods x 4 lrs; the 2 best of each to the end; 3 tasks x gpipe, 1f1b-flush;
    # seeds: 4 cells x (8 x 2 at N = 8 + 7 x 3 at N = 4)
    # and the correction choice: 4 cells x 2 candidates beside the base's own sweep run
    assert phases == {("sweep", "third"): 128, ("sweep", "end"): 64, ("confirm", None): 6, ("seeds", None): 148,
                      ("correction", None): 8}
    assert len([r for r in runs if r.until != "end"]) == 290  # an end continues its third's run
    assert [r.index for r in runs if r.phase == "correction"] == list(range(346, 354))  # no earlier run moved
    assert {r.stages for r in runs if r.variant == "sequential"} == {1}
    assert {(r.task, r.optimizer) for r in runs if r.phase == "confirm"} == {("image", "adamw"), ("sentiment", "adamw"),
                                                                            ("lm", "adamw")}
    for task, optimizer in suite["cells"]:
        lrs = study2.sweep_lrs(suite, task, optimizer)
        assert len(lrs) == 4 and lrs == sorted(lrs)
        ratios = [b / a for a, b in zip(lrs, lrs[1:])]
        assert ratios == pytest.approx([ratios[0]] * 3, rel=1e-3)  # log-spaced
    assert study2.sweep_lrs(suite, "image", "momentum") == [0.0025, 0.005, 0.01, 0.02]
    stops = {task: study2.stop_point(study2.batches_per_epoch(spec), spec["epochs"], spec["eval_every"], 1 / 3)
             for task, spec in suite["tasks"].items()}
    assert stops == {"image": 859, "sentiment": 159, "lm": 600}  # image, sentiment: the first epoch's end
    # docs/study_plan.md: 198, 198, 158, 212 core-minutes per cell, 30 for the confirmations
    minutes = {}
    for run in runs:
        if run.phase == "correction":
            continue  # planned apart: 3 candidates x 4 cells in the plan's 40 core-minutes
        name = "confirm" if run.phase == "confirm" else f"{run.task} {run.optimizer}"
        minutes[name] = minutes.get(name, 0.0) + run.minutes
    assert minutes == pytest.approx({"image momentum": 198, "image adamw": 198, "sentiment adamw": 158,
                                     "lm adamw": 212, "confirm": 30}, rel=0.02)


def _third(study2, suite, task, optimizer, variant, lr, validation, diverged=None):
    run = study2.sweep_run(suite, task, optimizer, variant, lr, "third")
    return {**run.key_fields(), "variant": variant, "validation_metric": validation, "final_metric": None,
            "diverged": diverged}


def _end(study2, suite, task, optimizer, variant, lr, validation, test):
    run = study2.sweep_run(suite, task, optimizer, variant, lr, "end")
    return {**run.key_fields(), "variant": variant, "validation_metric": validation, "final_metric": test,
            "diverged": None}


def test_halving_keeps_the_two_best_on_validation(study2, tmp_path):
    suite = study2.SUITES["default"]
    path = tmp_path / "runs.jsonl"
    # image, momentum, pipeoptim: 0.01 diverged; the best two by validation are 0.005 and 0.02
    for lr, value, diverged in [(0.0025, 0.80, None), (0.005, 0.85, None), (0.01, None, "loss became nan"),
                                (0.02, 0.83, None)]:
        study2.append_line(path, _third(study2, suite, "image", "momentum", "pipeoptim", lr, value, diverged))
    # lm (perplexity, lower is better): the best two are the two lowest; a tie goes to the smaller lr
    for lr, value in [(0.0005, 150.0), (0.001, 120.0), (0.002, 120.0), (0.004, float("inf"))]:
        study2.append_line(path, _third(study2, suite, "lm", "adamw", "xpipe", lr, value))
    runs = study2.plan_runs(suite, study2.load_rows(path))

    def ends(task, optimizer, variant):
        return [(r.lr, r.status) for r in runs if r.phase == "sweep" and r.until == "end"
                and (r.task, r.optimizer, r.variant) == (task, optimizer, variant)]

    assert ends("image", "momentum", "pipeoptim") == [(0.005, "ready"), (0.02, "ready")]
    assert ends("lm", "adamw", "xpipe") == [(0.001, "ready"), (0.002, "ready")]
    assert ends("image", "momentum", "xpipe") == [(None, "waiting"), (None, "waiting")]
    # the seeds wait for the ends, not just the thirds
    seeds = [r for r in runs if r.phase == "seeds" and r.task == "image" and r.optimizer == "momentum"
             and r.variant == "pipeoptim"]
    assert len(seeds) == 2 + 3 and {r.status for r in seeds} == {"waiting"}
    assert "ends of pipeoptim at lr 0.005, 0.02" in seeds[0].why

    # the ends: 0.005 has the better test metric, 0.02 the better validation metric, which decides
    study2.append_line(path, _end(study2, suite, "image", "momentum", "pipeoptim", 0.005, 0.88, 0.90))
    study2.append_line(path, _end(study2, suite, "image", "momentum", "pipeoptim", 0.02, 0.89, 0.87))
    runs = study2.plan_runs(suite, study2.load_rows(path))
    seeds = [r for r in runs if r.phase == "seeds" and r.task == "image" and r.optimizer == "momentum"
             and r.variant == "pipeoptim"]
    assert [(r.stages, r.seed, r.lr, r.status) for r in seeds] == [
        (8, 1, 0.02, "ready"), (4, 0, 0.02, "ready"),
        (8, 2, 0.02, "ready"), (4, 1, 0.02, "ready"), (4, 2, 0.02, "ready")]
    # the confirmations wait for sequential's best lr with AdamW
    assert {r.status for r in runs if r.phase == "confirm"} == {"waiting"}


def test_the_correction_choice_runs_at_the_bases_best_lr_and_picks_the_best_on_validation(study2, tmp_path):
    suite = study2.SUITES["default"]
    path = tmp_path / "runs.jsonl"
    base = "pipeoptim+lr_correction"
    for lr, value in zip(study2.sweep_lrs(suite, "lm", "adamw"), [150.0, 140.0, 160.0, 170.0]):
        study2.append_line(path, _third(study2, suite, "lm", "adamw", base, lr, value))

    def corrections():
        runs = study2.plan_runs(suite, study2.load_rows(path))
        return [(r.variant, r.stages, r.seed, r.lr, r.status) for r in runs
                if r.phase == "correction" and r.task == "lm"]

    assert {status for *_, status in corrections()} == {"waiting"}  # the halving's ends are not in
    study2.append_line(path, _end(study2, suite, "lm", "adamw", base, 0.0005, 120.0, 121.0))
    study2.append_line(path, _end(study2, suite, "lm", "adamw", base, 0.001, 125.0, 119.0))
    assert corrections() == [("pipeoptim+lr_correction+horizon", 8, 0, 0.0005, "ready"),
                             ("pipeoptim+lr_correction+prediction_warmup", 8, 0, 0.0005, "ready")]
    assert study2.correction_choice(suite, study2.load_rows(path), "lm", "adamw") is None  # candidates not in

    def candidate(variant, validation, diverged=None):
        run = study2.Run("correction", "lm", "adamw", variant, 8, 0, 0.0005)
        return {**run.key_fields(), "variant": variant, "validation_metric": validation, "diverged": diverged}

    study2.append_line(path, candidate("pipeoptim+lr_correction+horizon", 118.5))
    study2.append_line(path, candidate("pipeoptim+lr_correction+prediction_warmup", None, "loss became nan"))
    choice = study2.correction_choice(suite, study2.load_rows(path), "lm", "adamw")
    # perplexity: lower is better; a diverged candidate scores nothing
    assert choice == {"lr": 0.0005, "metric": "perplexity", "chosen": "pipeoptim+lr_correction+horizon",
                      "scores": {base: 120.0, "pipeoptim+lr_correction+horizon": 118.5,
                                 "pipeoptim+lr_correction+prediction_warmup": None}}


def test_every_lr_diverged_drops_the_rest(study2, tmp_path):
    suite = study2.SUITES["default"]
    path = tmp_path / "runs.jsonl"
    for lr in study2.sweep_lrs(suite, "sentiment", "adamw"):
        study2.append_line(path, _third(study2, suite, "sentiment", "adamw", "async-naive", lr, None, "nan"))
    runs = [r for r in study2.plan_runs(suite, study2.load_rows(path))
            if r.task == "sentiment" and r.variant == "async-naive" and r.until != "third"]
    assert {r.status for r in runs} == {"dropped"} and len(runs) == 2 + 2 + 3


def test_shards_split_the_plan_between_processes(study2):
    runs = study2.plan_runs(study2.SUITES["default"], {})
    first, second = study2.shard_runs(runs, (0, 2)), study2.shard_runs(runs, (1, 2))
    assert not {r.index for r in first} & {r.index for r in second}
    assert len(first) + len(second) == len(runs)
    assert abs(sum(r.minutes for r in first) - sum(r.minutes for r in second)) < 0.05 * sum(r.minutes for r in runs)
