"""study/make_results2.py, the second study's report: its arithmetic (scores, updates and time
to target, the synchronous reference, the per-stage diagnostic, the verdicts) on a hand-made study
of the smoke suite whose every number is known, and the same file on a second run (the committed
docs/results.md, which carries this report below the equal-time one, is tested in
test_make_results3.py)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from study import common, make_results2, make_results2_data, make_results2_findings, study2_plan

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report():
    return make_results2


@pytest.fixture(scope="module")
def findings(report):
    return make_results2_findings


# the hand-made study: validation curves at the smoke suite's evaluations (4, 8, 12 updates)
CURVES = {
    ("sequential", 1): [0.5, 0.8, 0.9],                 # target 0.99 * 0.9 = 0.891
    ("pipeoptim", 4): [0.6, 0.85, 0.9],                 # reaches it at 12
    ("pipeoptim+lr_correction", 4): [0.7, 0.895, 0.9],  # at 8
    ("pipeoptim", 2): [0.6, 0.8, 0.85],                 # never
    ("pipeoptim+lr_correction", 2): [0.9, 0.9, 0.9],    # at 4
    ("gpipe", 4): [0.5, 0.8, 0.9],                      # the confirmation: sequential's numbers
}
#: predicted seconds per mini-batch on N devices
TIMES = {("1f1b-flush", 4): 0.2, ("gpipe", 4): 0.25, ("pipeoptim", 4): 0.1, ("async-naive", 4): 0.1,
         ("1f1b-flush", 2): 0.3, ("gpipe", 2): 0.3, ("pipeoptim", 2): 0.2, ("async-naive", 2): 0.19,
         ("sequential", 1): 0.35}


def _row(report, run, *, diverged=False):
    curve = CURVES.get((run.variant, run.stages), [0.5, 0.6, 0.7])
    if run.until == "third":
        curve = curve[:1]
    # lr 0.04 is worse after the first third, so the halving keeps 0.01 for everyone
    curve = [m - (0.1 if run.lr == 0.04 else 0.0) for m in curve]
    seed_shift = 0.01 * run.seed if run.variant == "pipeoptim+lr_correction" and run.stages == 4 else 0.0
    curve = [m + seed_shift for m in curve]
    evaluations = [{"updates": 4 * (i + 1), "metric": m, "seconds": 1.0} for i, m in enumerate(curve)]
    stage_errors = [[{"probes": 2, "prediction_error": 0.001 * (k + 1), "staleness_error": 0.004} for k in
                     range(run.stages - 1)]]
    return {**run.key_fields(), "variant": run.variant, "diverged": "loss became nan" if diverged else None,
            "validation_metric": None if diverged else curve[-1],
            "final_metric": None if diverged or run.until == "third" else curve[-1] - 0.01,
            "evaluations": evaluations, "final_loss": 0.25, "seconds": 6.0, "microbatches": 1,
            "weight_copies": [2.0] * (run.stages - 1) + [1.0], "prediction_error": stage_errors}


def _study(report, folder: Path) -> Path:
    """Every run of the smoke suite's plan, in plan order, with the rows above."""
    study2 = study2_plan
    append_line = common.append_line
    suite = study2.SUITES["smoke"]
    rows = {}
    folder.mkdir(parents=True, exist_ok=True)
    with_rows = folder / "runs.jsonl"
    for _ in range(10):  # each pass makes the next runs ready (their lrs come from the rows before)
        for run in study2.plan_runs(suite, rows):
            if run.status == "ready":
                append_line(with_rows, _row(report, run))
        rows = study2.load_rows(with_rows)
    (folder / "suite.json").write_text(json.dumps({"suite": "smoke", **suite}))
    (folder / "times.json").write_text("{}")  # (the seconds fixture stands in for its lookups)
    return folder


@pytest.fixture
def seconds(report, monkeypatch):
    monkeypatch.setattr(make_results2_data, "seconds_per_batch",
                        lambda times, task, optimizer, stages, method: TIMES.get((method, stages)))


def test_scores_and_updates_to_target(report):
    assert report.final_score({"final_metric": 0.8}, True) == 0.8
    assert report.final_score({"final_metric": 0.8, "diverged": "nan"}, True) == 0.0
    assert report.final_score({"final_metric": None, "diverged": "nan"}, False) == math.inf
    row = {"evaluations": [{"updates": 4, "metric": 0.5}, {"updates": 8, "metric": 0.9}, {"updates": 12, "metric": 0.95}]}
    assert report.run_updates_to_target(row, 0.9, True) == 8
    assert report.run_updates_to_target(row, 0.96, True) is None
    assert report.run_updates_to_target({**row, "diverged": "nan"}, 0.1, True) is None
    perplexity = {"evaluations": [{"updates": 200, "metric": 300.0}, {"updates": 400, "metric": 120.0}]}
    assert report.run_updates_to_target(perplexity, 121.2, False) == 400


def test_stage_errors_weigh_every_probe_of_every_epoch(report):
    rows = [{"prediction_error": [[{"probes": 1, "prediction_error": 1.0, "staleness_error": 2.0}],
                                  [{"probes": 3, "prediction_error": 3.0, "staleness_error": 2.0}]]},
            {"prediction_error": [None, [{"probes": 4, "prediction_error": 1.0, "staleness_error": 4.0}]]},
            {"diverged": "nan", "prediction_error": [[{"probes": 9, "prediction_error": 99.0, "staleness_error": 1.0}]]}]
    (stage,) = report.stage_errors(rows)
    assert stage["prediction"] == pytest.approx((1 + 9 + 4) / 8)
    assert stage["staleness"] == pytest.approx((2 + 6 + 16) / 8)
    assert stage["ratio"] == pytest.approx(14 / 24)


def test_holds_counts_settings_as_the_first_study(report, findings):
    assert findings.holds({"wins": 2, "ties": 1, "loses": 1}) == "holds"
    assert findings.holds({"wins": 1, "ties": 1, "loses": 1}) == "holds in part"
    assert findings.holds({"wins": 1, "loses": 1}) == "does not hold"
    assert findings.holds({}).startswith("untested")


def test_time_to_target_against_the_synchronous_pipeline(report, seconds, tmp_path):
    study = _study(report, tmp_path / "study")
    plan = study2_plan
    suite = plan.SUITES["smoke"]
    settings = {s.stages: s for s in report.settings_of(suite, plan.load_rows(study / "runs.jsonl"), None)}
    n4, n2 = settings[4], settings[2]
    assert n4.methods["sequential"].lr == 0.01 and len(n4.methods["sequential"].rows) == 2
    assert n4.target() == pytest.approx(0.891)
    # sequential's updates at the faster synchronous pipeline: 12 x min(0.2, 0.25)
    assert n4.seconds("sequential") == 0.2 and n4.time_to_target("sequential") == pytest.approx((2.4, 0.0))
    assert n4.updates_to_target("pipeoptim") == [12, 12]
    assert n4.time_to_target("pipeoptim") == pytest.approx((1.2, 0.0))
    assert n4.updates_to_target("pipeoptim+lr_correction") == [8, 8]
    # the seeds' final test metrics 0.89 and 0.90: mean and standard deviation
    mean, sd = n4.final("pipeoptim+lr_correction")
    assert mean == pytest.approx(0.895) and sd == pytest.approx(0.01 / math.sqrt(2))
    assert n2.updates_to_target("pipeoptim") == [None, None] and n2.time_to_target("pipeoptim") is None
    assert n2.time_to_target("pipeoptim+lr_correction") == pytest.approx((0.8, 0.0))


def test_a_sequential_seed_short_of_the_target_leaves_the_reference_on_the_others(report, findings, seconds):
    """The target is 99 % of sequential's mean, so a seed can end short of it: the synchronous time
    is then the mean over the seeds that reach it, and the report says how many do."""
    def row(seed, curve):
        return {"seed": seed, "final_metric": curve[-1], "validation_metric": curve[-1],
                "evaluations": [{"updates": 4 * (i + 1), "metric": m} for i, m in enumerate(curve)]}

    methods = {"sequential": report.Method("sequential", 0.01, [row(0, [0.5, 0.95]), row(1, [0.9, 0.95]),
                                                                row(2, [0.5, 0.8])]),
               "pipeoptim": report.Method("pipeoptim", 0.01, [row(0, [0.9, 0.9])])}
    st = report.Setting("image", "momentum", 4, "accuracy", True, methods)
    assert st.target() == pytest.approx(0.99 * 0.9)  # the mean of 0.95, 0.95, 0.8
    assert st.updates_to_target("sequential") == [8, 4, None]
    assert st.time_to_target("sequential") is None
    assert st.synchronous_time() == (pytest.approx((1.2, 0.4 * 2 ** 0.5)), ", 2 of 3 seeds reach it")
    text = "\n".join(findings.conclusions([st], {"methods": ["pipeoptim"]}))
    assert "  - image, momentum, N=4 (synchronous pipeline: 1.2 ± 0.6 s, 2 of 3 seeds reach it): " \
           "pipeoptim sooner (3.00x)" in text


def test_the_report_says_what_the_numbers_give(report, seconds, tmp_path):
    study = _study(report, tmp_path / "study")
    text = report.generate(study, tmp_path / "docs", plots=False)
    assert "  - image, momentum, N=4 (synchronous pipeline: 2.4 ± 0.0 s): pipeoptim sooner (2.00x); " \
           "pipeoptim+lr_correction sooner (3.00x)" in text
    assert "  - image, momentum, N=2 (synchronous pipeline: 3.6 ± 0.0 s): pipeoptim does not reach it " \
           "(0 of 2 seeds); pipeoptim+lr_correction sooner (4.50x)" in text
    assert "pipeoptim: 1 sooner, 0 ties, 0 later, 1 never" in text
    # claim 1: the final test metrics 0.89 against 0.89 (N = 4), 0.84 against 0.89 (N = 2)
    assert "  - image, momentum, N=4: ties (89.00 against 89.00, +0.00 at a spread of 0.00; 2 seeds against 2)" in text
    assert "  - image, momentum, N=2: loses (84.00 against 89.00, -5.00 at a spread of 0.00; 2 seeds against 2)" in text
    # the shortfall names the stage with the largest prediction error and the ratios
    assert ("  - image, momentum, N=2, pipeoptim: does not reach the target and ends 5.00 behind; the prediction "
            "removes 75%-75% of the staleness error, least at stage 0; the forward's weights are farthest from the "
            "backward's at stage 0 (1.0e-03); their error over the staleness error by stage: 0.25") in text
    assert "| pipeoptim | 0.01 | 2 | 89.00 ± 0.00 | 90.00 ± 0.00 | 12, 12 | 0.1000 | 1.2 ± 0.0 | 2.00x sooner | 2 |" in text
    # claim 3: the time per mini-batch against async-naive's, the synchronous pipelines' and one device's
    assert ("  - image, momentum, N=4: predicted 100.0 ms per mini-batch: 1.00x async-naive's throughput, "
            "2.00x 1f1b-flush's, 2.50x gpipe's, 3.50x one device's") in text
    assert "Verdict: holds (predicted 0.95-1.00x async-naive's throughput; at most 2 weight copies" in text
    # the sweep: 0.01 whole, 0.04 after its first third only
    assert "| pipeoptim | 90.00 | (50.00) | 0.01 |" in text
    # depth: final test metric minus sequential's 89.00 at N = 4 and N = 2
    assert "| image, momentum | pipeoptim | +0.00 (2 seeds) | -5.00 (2 seeds) |" in text
    assert "| image, momentum | pipeoptim+lr_correction | +0.50 (2 seeds) | +0.00 (2 seeds) |" in text
    assert "Of 2 (method, cell) pairs with runs at both, 0 end closer to sequential" in text
    assert ("  - image, gpipe (N = 4, 1 micro-batches): final test accuracy 89.0000 against sequential's 89.0000 "
            "(sequential's standard deviation over 2 seeds: 0.00); final training loss 0.250000 against 0.250000 (difference +0.0e+00)") in text


def test_depth_counts_closer_by_the_metric_direction(report, findings):
    """A perplexity that falls from N = 8 to N = 4 is closer to sequential; an accuracy that falls is not."""
    def setting(task, stages, metric, higher, finals):
        methods = {v: report.Method(v, 0.01, [{"final_metric": f, "seed": 0} for f in fs]) for v, fs in finals.items()}
        return report.Setting(task, "adamw", stages, metric, higher, methods)

    suite = {"stages": [8, 4], "cells": [("lm", "adamw"), ("image", "adamw")], "methods": ["pipeoptim", "xpipe"]}
    settings = [setting("lm", 8, "perplexity", False, {"sequential": [50.0], "pipeoptim": [80.0], "xpipe": [60.0]}),
                setting("lm", 4, "perplexity", False, {"sequential": [50.0], "pipeoptim": [70.0], "xpipe": []}),
                setting("image", 8, "accuracy", True, {"sequential": [0.9], "pipeoptim": [0.89], "xpipe": [0.88]}),
                setting("image", 4, "accuracy", True, {"sequential": [0.9], "pipeoptim": [0.88], "xpipe": [0.89]})]
    text = "\n".join(findings.depth_lines(settings, suite))
    assert "| lm, adamw | pipeoptim | +30.0 (1 seed) | +20.0 (1 seed) |" in text
    assert "| lm, adamw | xpipe | +10.0 (1 seed) | - |" in text
    assert "| image, adamw | pipeoptim | -1.00 (1 seed) | -2.00 (1 seed) |" in text
    assert "Of 3 (method, cell) pairs with runs at both, 2 end closer" in text
    assert "up to 3 updates before its backward instead of 7" in text


def test_spearman_and_the_error_gap_correlation(report, findings):
    assert findings.ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]
    assert findings.spearman([1, 2, 3], [10, 20, 40]) == pytest.approx(1.0)
    assert findings.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(findings.spearman([1, 1, 1], [1, 2, 3]))

    def rows(error, final):
        probe = [{"probes": 1, "prediction_error": error, "staleness_error": 1.0}]
        return [{"final_metric": final, "seed": 0, "prediction_error": [probe]}]

    methods = {"sequential": report.Method("sequential", 0.01, [{"final_metric": 50.0, "seed": 0}]),
               "a": report.Method("a", 0.01, rows(1e-3, 60.0)), "b": report.Method("b", 0.01, rows(2e-3, 55.0)),
               "c": report.Method("c", 0.01, rows(3e-3, 90.0))}
    settings = [report.Setting("lm", "adamw", 8, "perplexity", False, methods)]
    text = "\n".join(findings.error_gap_lines(settings, {"methods": ["a", "b", "c"]}))
    # behind by 10, 5, 40 at errors 1, 2, 3 (x 1e-3): ranks (2, 1, 3) against (1, 2, 3) -> 0.5
    assert ("  - lm, adamw, N=8: +0.50 over 3 methods (smallest error: a, 1.0e-03, 10.0 behind; largest: c, "
            "3.0e-03, 40.0 behind)") in text


def test_a_second_run_writes_the_same_file(report, seconds, tmp_path):
    study = _study(report, tmp_path / "study")
    first = report.generate(study, tmp_path / "a", plots=True)
    second = report.generate(study, tmp_path / "b", plots=False)
    assert first == second == (tmp_path / "a" / "results-equal-updates.md").read_text()
    assert sorted(p.name for p in (tmp_path / "a" / "results2").iterdir()) == [
        "curves-image-momentum-N2.png", "curves-image-momentum-N4.png", "sensitivity-image-momentum.png"]


def test_no_name_writes_no_markdown(report, seconds, tmp_path):
    study = _study(report, tmp_path / "study")
    text = report.generate(study, tmp_path / "c", plots=False, name=None)
    assert text.startswith("# Does an asynchronous pipeline reach the target sooner?")
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").glob("*.md"))
