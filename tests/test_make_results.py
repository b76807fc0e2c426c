"""The study report's arithmetic: scoring of diverged runs, verdicts, and the per-stage diagnostic."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "make_results.py"
_spec = importlib.util.spec_from_file_location("make_results", _path)
make_results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_results)


def run(method, seed, metric, *, diverged=False, errors=None):
    return {"task": "image", "optimizer": "adam", "stages": 1 if method == "sequential" else 4,
            "method": method, "seed": seed, "lr": 1e-3, "sweep": False, "metric": "accuracy",
            "final_metric": None if diverged else metric, "best_metric": None if diverged else metric,
            "final_loss": 0.5, "diverged": "loss became nan" if diverged else None,
            "weight_copies": [2, 2, 2, 1], "microbatches": 1, "prediction_error": errors or [],
            "epochs_detail": [{"epoch": 0, "metric": metric}]}


def test_a_diverged_run_scores_zero_and_is_counted():
    st = make_results.Setting("image", "adam", 4, [run("pipeoptim", 0, 0.8), run("pipeoptim", 1, 0.0, diverged=True)], {})
    assert st.final("pipeoptim") == pytest.approx((0.4, 0.565685424949238))
    assert st.diverged("pipeoptim") == 1


def test_lower_is_better_a_diverged_run_scores_infinity_and_loses():
    def ppl(method, seed, value, diverged=False):
        return {**run(method, seed, value, diverged=diverged), "task": "lm", "metric": "perplexity"}

    st = make_results.Setting("lm", "adam", 4, [ppl("sequential", 0, 50.0), ppl("sequential", 1, 52.0),
                                                ppl("pipeoptim", 0, 40.0), ppl("pipeoptim", 1, 0.0, diverged=True),
                                                ppl("pipedream", 0, 0.0, diverged=True)], {})
    assert not st.higher
    assert st.final("pipeoptim") == (float("inf"), 0.0) and st.diverged("pipeoptim") == 1
    assert make_results.verdict(st.final("pipeoptim"), st.final("sequential"), st.higher)[0] == "loses"
    assert make_results.verdict(st.final("pipeoptim"), st.final("pipedream"), st.higher)[0] == "ties"
    assert make_results.verdict((40.0, 1.0), (50.0, 1.0), st.higher)[0] == "wins"


def test_verdicts_tie_within_the_larger_spread():
    assert make_results.verdict((0.80, 0.01), (0.79, 0.02), True)[0] == "ties"
    assert make_results.verdict((0.80, 0.01), (0.75, 0.02), True)[0] == "wins"
    assert make_results.verdict((0.80, 0.01), (0.75, 0.02), False)[0] == "loses"   # lower is better


def test_stage_errors_average_over_seeds_and_give_the_ratio():
    e = lambda p, s: {"probes": 3, "prediction_error": p, "staleness_error": s}  # noqa: E731
    runs = [run("pipeoptim", 0, 0.8, errors=[e(1.0, 4.0), {"probes": 0}]),
            run("pipeoptim", 1, 0.8, errors=[e(3.0, 4.0), {"probes": 0}])]
    assert make_results.stage_errors(runs) == [{"stage": 0, "prediction": 2.0, "staleness": 4.0, "ratio": 0.5}]


def test_a_shortfall_names_the_stage_with_the_largest_prediction_error():
    e = lambda p, s: {"probes": 3, "prediction_error": p, "staleness_error": s}  # noqa: E731
    rows = [run("sequential", s, 0.90) for s in (0, 1, 2)]
    rows += [run("pipeoptim", s, 0.70 + 0.01 * s, errors=[e(1e-3, 4e-3), e(5e-3, 6e-3), e(1e-4, 1e-3)])
             for s in (0, 1, 2)]
    text = "\n".join(make_results.conclusions([make_results.Setting("image", "adam", 4, rows, {})]))
    assert "image, adam, N=4: loses (71.00 against 90.00, -19.00 at a spread of 1.00)" in text
    assert "the largest prediction error is at stage 1 (5.0e-03, 0.83 of its staleness error)" in text
    assert "trains as well as sequential: does not hold (0 of 1)" in text
