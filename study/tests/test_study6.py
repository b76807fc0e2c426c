"""study/study6_plan.py, issue 51's arms over the earlier arms' rows (fixture rows here): the
image advice's third seed, translation with Muon and error feedback tuned by the translation
cell's rules, the feedback-aware prediction at plain error feedback's lr and seeds, the order
(the most telling first) and the budget's cut from the end."""
from __future__ import annotations

import pytest

from study import study3_suite, study6_plan
from study.study3_plan import Run, row_key
from study.study3_suite import variant_spec

EF, AWARE = study6_plan.EF, study6_plan.AWARE
UPDATES = {"lm": 2046, "image": 3200, "translation": 1246}


def _times():
    def cell(task):
        return {"stages": {"8": {"variants": {"pipeoptim-2bw": {"seconds_per_batch": 0.1}},
                                 "budget": {"updates": {"pipeoptim-2bw": UPDATES[task]}}}}}
    return {"cells": {"lm": {"adamw": cell("lm"), "muon": cell("lm")}, "image": {"adamw": cell("image")},
                      "translation": {"adamw": cell("translation"), "muon": cell("translation")}}}


def _put(rows, phase, task, optimizer, variant, lr, seed, validation, final, cpu=600.0, **extra):
    stages = 1 if variant == "sequential" else 8
    updates = 1000 if variant == "sequential" else UPDATES[task]
    run = Run(phase, task, optimizer, variant, stages, seed, lr, updates=updates)
    rows[row_key(run.key_fields())] = {**run.key_fields(), "validation_metric": validation, "final_metric": final,
                                       "diverged": None, "cpu_seconds": cpu, "seconds": cpu, **extra}


@pytest.fixture
def prior():
    rows = {}
    # image x adamw (higher is better): +ef chose 2e-3 (seeds 0, 1); the synchronous pipeline 90.8
    _put(rows, "tune", "image", "adamw", "sequential", 0.001, 0, 0.91, 0.908)
    _put(rows, "tune", "image", "adamw", EF, 0.002, 0, 0.912, 0.910, cpu=225.0)
    _put(rows, "tune", "image", "adamw", EF, 0.001, 0, 0.907, 0.904, cpu=227.0)
    _put(rows, "seeds", "image", "adamw", EF, 0.002, 1, 0.915, 0.917, cpu=222.0)
    # lm (lower is better): +ef chose 2e-3 with AdamW, 2e-2 with Muon
    _put(rows, "tune", "lm", "adamw", "sequential", 0.004, 0, 50.0, 55.0)
    _put(rows, "tune", "lm", "adamw", EF, 0.002, 0, 59.8, 67.1, cpu=434.0)
    _put(rows, "tune", "lm", "adamw", EF, 0.001, 0, 66.8, 74.8, cpu=430.0)
    _put(rows, "seeds", "lm", "adamw", EF, 0.002, 1, 62.3, 69.6, cpu=444.0)
    _put(rows, "tune", "lm", "muon", "sequential", 0.04, 0, 42.0, 46.8)
    _put(rows, "tune", "lm", "muon", EF, 0.02, 0, 43.8, 48.7, cpu=634.0)
    _put(rows, "tune", "lm", "muon", EF, 0.04, 0, 44.5, 49.8, cpu=662.0)
    _put(rows, "seeds", "lm", "muon", EF, 0.02, 1, 44.1, 49.1, cpu=558.0)
    # translation x adamw: +ef chose 4e-3, seeds 0-2 (the closest variant); a resumed row's
    # CPU time is a part's and is not read
    _put(rows, "tune", "translation", "adamw", "sequential", 0.004, 0, 15.3, 15.3)
    _put(rows, "tune", "translation", "adamw", EF, 0.004, 0, 14.07, 14.39, cpu=178.0, resumed=True)
    _put(rows, "tune", "translation", "adamw", EF, 0.002, 0, 11.6, 11.9, cpu=514.0)
    _put(rows, "seeds", "translation", "adamw", EF, 0.004, 1, 14.7, 14.97, cpu=521.0)
    _put(rows, "seeds", "translation", "adamw", EF, 0.004, 2, 14.6, 14.75, cpu=488.0)
    # translation x muon: the synchronous pipeline at 4e-2; pipeoptim-2bw the closest (seed 2)
    _put(rows, "tune", "translation", "muon", "sequential", 0.04, 0, 14.4, 14.96)
    _put(rows, "tune", "translation", "muon", "sequential", 0.02, 0, 12.0, 12.5)
    _put(rows, "tune", "translation", "muon", "pipeoptim-2bw", 0.04, 0, 14.0, 14.4, cpu=504.0)
    _put(rows, "seeds", "translation", "muon", "pipeoptim-2bw", 0.04, 1, 15.0, 14.3, cpu=514.0)
    _put(rows, "seeds", "translation", "muon", "pipeoptim-2bw", 0.04, 2, 14.2, 14.6, cpu=471.0)
    return rows


@pytest.fixture
def suite():
    return study3_suite.SUITES["feedback"]


def _plan(suite, rows, prior):
    return study6_plan.plan_runs(suite, rows, _times(), prior)


def test_the_variant_turns_both_options_on():
    assert variant_spec(AWARE, 8) == ("pipeoptim-2bw", {"error_feedback": True, "predict_feedback": True}, None)


def test_the_plan_before_any_run(suite, prior):
    runs = _plan(suite, {}, prior)
    got = [(r.task, r.optimizer, r.variant, r.seed, r.lr, r.status) for r in runs]
    assert got[:7] == [
        ("image", "adamw", EF, 2, 0.002, "ready"),                      # the advice's third seed first
        ("translation", "muon", EF, 0, 0.02, "ready"), ("translation", "muon", EF, 0, 0.04, "ready"),
        ("lm", "adamw", AWARE, 0, 0.002, "ready"), ("lm", "muon", AWARE, 0, 0.02, "ready"),
        ("translation", "adamw", AWARE, 0, 0.004, "ready"), ("image", "adamw", AWARE, 0, 0.002, "ready")]
    # then the further seeds wait: Muon's seed 1, the aware seeds 1, then every seed 2; the aware
    # variant takes plain error feedback's seeds (image's with its third)
    later = [(r.task, r.optimizer, r.variant, r.seed, r.status) for r in runs[7:]]
    assert later == [("translation", "muon", EF, 1, "waiting"), ("lm", "adamw", AWARE, 1, "waiting"),
                     ("lm", "muon", AWARE, 1, "waiting"), ("translation", "adamw", AWARE, 1, "waiting"),
                     ("image", "adamw", AWARE, 1, "waiting"), ("translation", "muon", EF, 2, "waiting"),
                     ("translation", "adamw", AWARE, 2, "waiting"), ("image", "adamw", AWARE, 2, "waiting")]
    # U_m: pipeoptim-2bw's; minutes: the median of the cell's whole runs of the variant, else of
    # its base (+ef for +ef+aware, pipeoptim-2bw for +ef): the resumed row is not read
    by = {(r.task, r.optimizer, r.variant, r.seed): r for r in runs}
    assert by[("lm", "muon", AWARE, 0)].updates == 2046
    assert by[("image", "adamw", AWARE, 0)].minutes == pytest.approx(225.0 / 60)
    assert by[("translation", "adamw", AWARE, 0)].minutes == pytest.approx(514.0 / 60)
    assert by[("translation", "muon", EF, 0)].minutes == pytest.approx(504.0 / 60)
    assert study6_plan.total_minutes(runs) == pytest.approx(sum(r.minutes for r in runs))
    assert study6_plan.total_minutes(runs) <= suite["budget_minutes"]


def test_muon_translation_follows_the_cells_rules(suite, prior):
    rows = {}
    # 4e-2 better on validation, at the grid's top edge: 8e-2 is tuned too
    _put(rows, "tune", "translation", "muon", EF, 0.02, 0, 13.0, 13.1)
    _put(rows, "tune", "translation", "muon", EF, 0.04, 0, 14.5, 14.6)
    runs = _plan(suite, rows, prior)
    tune = [(r.lr, r.status) for r in runs if (r.task, r.optimizer, r.phase) == ("translation", "muon", "tune")]
    assert tune == [(0.02, "done"), (0.04, "done"), (0.08, "ready")]
    seed1 = next(r for r in runs if (r.task, r.optimizer, r.seed) == ("translation", "muon", 1))
    assert seed1.status == "waiting" and "0.08" in seed1.why
    _put(rows, "tune", "translation", "muon", EF, 0.08, 0, 14.0, 14.2)
    runs = _plan(suite, rows, prior)
    seed1 = next(r for r in runs if (r.task, r.optimizer, r.seed) == ("translation", "muon", 1))
    assert (seed1.lr, seed1.status) == (0.04, "ready")
    # its seeds 0 and 1 average 14.65, above pipeoptim-2bw's 14.35: it is the closest, seed 2 runs
    _put(rows, "seeds", "translation", "muon", EF, 0.04, 1, 14.6, 14.7)
    seed2 = next(r for r in _plan(suite, rows, prior) if (r.task, r.optimizer, r.seed) == ("translation", "muon", 2))
    assert (seed2.lr, seed2.status) == (0.04, "ready")
    # ... and not where they average below it (the same row, another final metric)
    _put(rows, "seeds", "translation", "muon", EF, 0.04, 1, 14.6, 13.0)
    seed2 = next(r for r in _plan(suite, rows, prior) if (r.task, r.optimizer, r.seed) == ("translation", "muon", 2))
    assert seed2.status == "dropped" and "stays the closest" in seed2.why


def test_a_seed_0_far_behind_cuts_the_aware_variants_next_seeds(suite, prior):
    rows = {}
    _put(rows, "seeds", "lm", "adamw", AWARE, 0.002, 0, 70.0, 90.0)   # 64 % behind 55: cut
    _put(rows, "seeds", "image", "adamw", AWARE, 0.002, 0, 0.91, 0.921)  # 0.011 from +ef's 0.910: beyond 0.005
    runs = _plan(suite, rows, prior)
    status = {(r.task, r.optimizer, r.variant, r.seed): r.status for r in runs}
    assert status[("lm", "adamw", AWARE, 0)] == "done" and status[("lm", "adamw", AWARE, 1)] == "dropped"
    assert status[("image", "adamw", AWARE, 1)] == status[("image", "adamw", AWARE, 2)] == "ready"


def test_a_seed_0_within_plain_feedbacks_spread_of_its_pair_cuts_the_aware_variants_next_seeds(suite, prior):
    """image: plain +ef ended 0.910 and 0.917 (seed spread 0.0049); the aware seed 0 at 0.913, 0.003
    from its pair, drops seeds 1 and 2; translation: 14.80 against plain's 14.39 (spread 0.30) does not."""
    rows = {}
    _put(rows, "seeds", "image", "adamw", AWARE, 0.002, 0, 0.91, 0.913)
    _put(rows, "seeds", "translation", "adamw", AWARE, 0.004, 0, 14.5, 14.80)
    runs = {(r.task, r.optimizer, r.variant, r.seed): r for r in _plan(suite, rows, prior)}
    for seed in (1, 2):
        cut = runs[("image", "adamw", AWARE, seed)]
        assert cut.status == "dropped" and "0.003 from pipeoptim-2bw+ef's seed 0" in cut.why
        assert "seed spread 0.00495" in cut.why
        assert runs[("translation", "adamw", AWARE, seed)].status == "ready"


def test_over_budget_the_last_runs_are_cut_first(suite, prior, capsys):
    small = {**suite, "budget_minutes": 40}
    runs = _plan(small, {}, prior)
    cut = [r for r in runs if r.why.startswith(study6_plan.CUT)]
    kept = [r for r in runs if r not in cut]
    assert study6_plan.total_minutes(runs) <= 40 < study6_plan.total_minutes(kept) + cut[-1].minutes
    # what is kept is a prefix of the plan: the advice's seed, Muon's tuning, the LM's aware seeds 0
    # (3.75 + 2 x 8.4 + 7.23 + 10.57 = 38.4 minutes; translation's next 8.57 would pass 40)
    assert [r.index for r in kept] == list(range(len(kept))) and len(kept) == 5
    study6_plan.print_cuts(runs)
    out = capsys.readouterr().out
    assert out.startswith(f"cut: {len(cut)} runs") and "image adamw pipeoptim-2bw+ef+aware N=8 lr 0.002 seed 2" in out


def test_every_planned_run_has_the_seconds_per_batch_its_worker_reads():
    """The times a worker hands each run (study3.execute -> seconds_per_batch) are the planner's:
    every variant planned, ``+ef`` and ``+ef+aware`` included, has pipeoptim-2bw's s_m."""
    from study.study3_times import TIMES, read_times, seconds_per_batch

    suite = study3_suite.SUITES["feedback"]
    times, prior = study6_plan.inputs(suite, read_times(TIMES))
    runs = study6_plan.plan_runs(suite, {}, times, prior)
    assert {r.variant for r in runs} >= {EF, AWARE}
    for run in runs:
        base = seconds_per_batch(times, run.task, run.optimizer, run.stages, "pipeoptim-2bw")
        assert seconds_per_batch(times, run.task, run.optimizer, run.stages, run.variant) == base
