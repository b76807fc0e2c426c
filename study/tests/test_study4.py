"""study/study4_plan.py and make_results4.py, issue 38's arm of the equal-time study: the
plan over issue 23's committed rows (the lrs each fix carries, its neighbour, the order, the
budgets filled in from the bases), the seeds waiting for the tuning and following the better lr
on validation, the decisive-gap cut, and the report's arithmetic (the share of a gap closed)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from study import make_results4, study3_plan, study3_suite, study4_plan

ROOT = Path(__file__).resolve().parents[2]
STUDY3 = ROOT / "study/results/study3"


@pytest.fixture(scope="module")
def arm():
    return study4_plan


@pytest.fixture(scope="module")
def inputs(arm):
    plan3 = study3_plan
    suite = study3_suite.SUITES["delay_fixes"]
    times = json.loads((STUDY3 / "times.json").read_text())
    return suite, times, plan3.load_rows(STUDY3 / "runs.jsonl"), plan3


def test_the_plan_over_the_committed_rows(arm, inputs):
    suite, times, rows3, _ = inputs
    runs = arm.plan_runs(suite, {}, times, rows3)
    ready = [(r.task, r.optimizer, r.variant, r.lr, r.seed) for r in runs if r.status == "ready"]
    assert ready[:4] == [("lm", "adamw", "pipedream-2bw+ef", 0.001, 0),
                         ("lm", "adamw", "pipedream-2bw+ef", 0.0005, 0),
                         ("lm", "adamw", "pipeoptim-2bw+ef", 0.002, 0),
                         ("lm", "adamw", "pipeoptim-2bw+ef", 0.001, 0)]
    # the close calls: seed 2 at issue 23's lrs (Muon's synchronous pipeline tuned to 0.04, xpipe 0.02)
    assert ("lm", "muon", "xpipe", 0.02, 2) in ready and ("lm", "muon", "sequential", 0.04, 2) in ready
    assert ("image", "adamw", "pipeoptim-2bw", 0.002, 2) in ready
    # the delay-aware step starts from the NAdam arm's choices
    assert ("lm", "delay-nadamw", "sequential", 0.004, 0) in ready
    assert ("lm", "delay-nadamw", "xpipe", 0.0005, 0) in ready
    assert len(runs) == 33 and sum(r.status == "waiting" for r in runs) == 10  # the seeds 1
    assert 300 < arm.total_minutes(runs) < 360  # within the budget
    # U_m of a +ef variant and of the new optimizer: their bases'
    upd = {(r.optimizer, r.variant): r.updates for r in runs}
    base = times["cells"]["lm"]["adamw"]["stages"]["8"]["budget"]["updates"]
    assert upd[("adamw", "pipedream-2bw+ef")] == base["pipedream-2bw"]
    assert upd[("delay-nadamw", "xpipe")] == times["cells"]["lm"]["nadam"]["stages"]["8"]["budget"]["updates"]["xpipe"]


def _row(run, validation, final):
    return {**run.key_fields(), "validation_metric": validation, "final_metric": final, "diverged": None,
            "higher_is_better": False, "seconds": 60.0}


def test_seed_1_follows_the_better_lr_and_the_decisive_gap_cut(arm, inputs):
    suite, times, rows3, plan3 = inputs
    runs = arm.plan_runs(suite, {}, times, rows3)
    tune = [r for r in runs if (r.optimizer, r.phase) == ("adamw", "tune") and r.task == "lm"]
    rows = {}
    # pipedream-2bw+ef: the neighbour wins on validation, close to the synchronous pipeline (57.6)
    rows[plan3.row_key(tune[0].key_fields())] = _row(tune[0], 70.0, 69.0)
    rows[plan3.row_key(tune[1].key_fields())] = _row(tune[1], 60.0, 59.0)
    # pipeoptim-2bw+ef: its better lr ends 60 % behind: seed 1 is cut
    rows[plan3.row_key(tune[2].key_fields())] = _row(tune[2], 92.0, 92.0)
    rows[plan3.row_key(tune[3].key_fields())] = _row(tune[3], 95.0, 95.0)
    again = arm.plan_runs(suite, rows, times, rows3)
    seeds = {r.variant: r for r in again if (r.task, r.optimizer, r.seed) == ("lm", "adamw", 1)}
    assert (seeds["pipedream-2bw+ef"].lr, seeds["pipedream-2bw+ef"].status) == (0.0005, "ready")
    assert seeds["pipeoptim-2bw+ef"].status == "dropped" and "decisive-gap" in seeds["pipeoptim-2bw+ef"].why
    assert sum(r.status == "done" for r in again) == 4


def test_times_are_filled_in_from_the_bases(arm, inputs):
    _, times, _, _ = inputs
    filled = arm.alias_times(times)
    at8 = filled["cells"]["lm"]["adamw"]["stages"]["8"]
    assert at8["variants"]["pipeoptim-2bw+ef"] == at8["variants"]["pipeoptim-2bw"]
    assert filled["cells"]["lm"]["delay-nadamw"]["stages"]["8"]["budget"] == \
        filled["cells"]["lm"]["nadam"]["stages"]["8"]["budget"]
    assert "delay-nadamw" not in times["cells"]["lm"]  # a copy: the file's dict untouched


def test_gap_closed():
    report = make_results4
    assert report.gap_closed(87.5, 67.5, 57.5) == pytest.approx(2 / 3)
    assert report.gap_closed(87.5, 50.0, 57.5) == pytest.approx(1.25)   # past the synchronous pipeline
    assert report.gap_closed(0.90, 0.88, 0.91) == pytest.approx(-2.0)    # higher is better: wider
    assert report.gap_closed(57.5, 50.0, 57.5) is None
    assert report.gap_closed(math.inf, 60.0, 57.5) is None
    # with the direction: a base already ahead of the synchronous pipeline had no gap to close
    assert report.gap_closed(91.13, 91.36, 90.82, higher=True) is None
    assert report.gap_closed(0.90, 0.88, 0.91, higher=True) == pytest.approx(-2.0)
    assert report.gap_closed(87.5, 67.5, 57.5, higher=False) == pytest.approx(2 / 3)


def test_the_planner_prices_error_feedback_with_the_measured_ratio():
    """pipeoptim plan's +ef candidates cost the time study/error_feedback_cost.py measured."""
    from pipeoptim.throughput import FEEDBACK_TIME_RATIO

    measured = json.loads((ROOT / "study/results/error_feedback_cost.json").read_text())
    assert FEEDBACK_TIME_RATIO == round(measured["ratio"], 4), \
        "study/results/error_feedback_cost.json changed: set pipeoptim.throughput.FEEDBACK_TIME_RATIO to its ratio"


def test_the_nadam_arm_is_torchs_nadam_without_weight_decay():
    """What the report says of the study's NAdam against AsyncPP's code: torch's NAdam, betas
    (0.99, 0.999), momentum decay 0.004, no weight decay (so its decoupling changes nothing)."""
    import torch

    from pipeoptim.lab.config import RunConfig
    from pipeoptim.lab.optimizers import make_optimizer

    beta1 = study3_suite.SUITES["delay_fixes"]["optimizer_arms"]["beta1"]["nadam"]
    built = make_optimizer("nadam", 1e-3, RunConfig().weight_decay, beta1=beta1)([torch.nn.Parameter(torch.zeros(2))])
    group = built.param_groups[0]
    assert type(built) is torch.optim.NAdam and group["betas"] == (0.99, 0.999)
    assert (group["momentum_decay"], group["weight_decay"], group["decoupled_weight_decay"]) == (0.004, 0.0, False)
    assert make_results4.nadam_lines()[0].startswith("**The NAdam arm and AsyncPP's code.**")
