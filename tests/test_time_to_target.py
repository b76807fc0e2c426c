"""Time-to-target arithmetic (issue 16): the target from a reference, the first update at which
a curve reaches it in either direction, never reaching it, and the time on N devices."""
from __future__ import annotations

import pytest

from pipeoptim.lab.time_to_target import (TargetResult, against_reference, curve_from_evaluations, reaches,
                                      target_from_reference, time_to_target, updates_to_target)

ACCURACY = [(0, 0.1), (100, 0.6), (200, 0.85), (300, 0.891), (400, 0.9), (500, 0.88)]
PERPLEXITY = [(0, 2000.0), (250, 400.0), (500, 150.0), (750, 101.0), (1000, 99.0)]


def test_the_target_is_99_or_101_percent_of_the_reference():
    assert target_from_reference(0.9, higher_is_better=True) == 0.891
    assert target_from_reference(0.5, higher_is_better=True) == 0.495
    assert target_from_reference(100.0, higher_is_better=False) == 101.0
    assert target_from_reference(200.0, higher_is_better=False) == 202.0
    assert target_from_reference(0.8, higher_is_better=True, tolerance=0.0) == 0.8
    assert target_from_reference(0.8, higher_is_better=True, tolerance=0.5) == 0.4


def test_the_first_update_that_reaches_the_target_higher_is_better():
    assert updates_to_target(ACCURACY, 0.891, higher_is_better=True) == 300   # reached exactly
    assert updates_to_target(ACCURACY, 0.85, higher_is_better=True) == 200
    assert updates_to_target(ACCURACY, 0.1, higher_is_better=True) == 0       # from the start
    assert updates_to_target(ACCURACY, 0.89, higher_is_better=True) == 300    # the first, not the last


def test_lower_is_better_perplexity():
    assert updates_to_target(PERPLEXITY, 101.0, higher_is_better=False) == 750  # reached exactly
    assert updates_to_target(PERPLEXITY, 150.5, higher_is_better=False) == 500
    assert updates_to_target(PERPLEXITY, 98.0, higher_is_better=False) is None
    assert reaches(99.0, 101.0, higher_is_better=False) and not reaches(101.5, 101.0, higher_is_better=False)


def test_never_reached_and_nan():
    assert updates_to_target(ACCURACY, 0.95, higher_is_better=True) is None
    assert time_to_target(ACCURACY, 0.95, True, seconds_per_batch=0.2) is None
    assert updates_to_target([(10, float("nan")), (20, 0.5)], 0.4, higher_is_better=True) == 20
    assert updates_to_target([], 0.4, higher_is_better=True) is None


def test_time_is_updates_times_seconds_per_mini_batch():
    assert time_to_target(ACCURACY, 0.891, True, seconds_per_batch=0.25) == 75.0
    assert time_to_target(PERPLEXITY, 101.0, False, seconds_per_batch=0.5) == 375.0
    # a method twice as fast per mini-batch that needs 1.5x the updates still arrives first
    slower_curve = [(u * 1.5, m) for u, m in ACCURACY]
    assert time_to_target(slower_curve, 0.891, True, 0.125) == 56.25 < 75.0


def test_against_a_reference_run():
    assert against_reference(ACCURACY, 0.9, True, seconds_per_batch=0.25) == TargetResult(0.891, 300, 75.0)
    assert against_reference(PERPLEXITY, 100.0, False, seconds_per_batch=2.0) == TargetResult(101.0, 750, 1500.0)
    missed = against_reference(ACCURACY, 0.95, True, seconds_per_batch=0.25)
    assert missed == TargetResult(0.9405, None, None)


def test_a_curve_from_a_runs_evaluations():
    evaluations = [{"epoch": 0, "batch": 4, "updates": 4, "metric": 0.5, "seconds": 1.0},
                   {"epoch": 0, "batch": 8, "updates": 8, "metric": 0.7, "seconds": 2.0}]
    assert curve_from_evaluations(evaluations) == [(4, 0.5), (8, 0.7)]


@pytest.mark.parametrize("call,message", [
    (lambda: target_from_reference(0.0, True), "must be positive and finite"),
    (lambda: target_from_reference(float("nan"), False), "must be positive and finite"),
    (lambda: target_from_reference(0.9, True, tolerance=1.0), r"tolerance must be in \[0, 1\)"),
    (lambda: updates_to_target([(10, 0.5), (5, 0.6)], 0.5, True), "sort the points by updates"),
    (lambda: time_to_target(ACCURACY, 0.5, True, seconds_per_batch=0.0), "must be a positive time"),
])
def test_bad_input_is_refused_naming_the_fix(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_module_needs_no_torch():
    """The report's arithmetic runs where only the JSONL is (a fresh interpreter: this one has torch)."""
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parent.parent / "src"
    code = "import sys, pipeoptim.lab.time_to_target; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(src)}, timeout=60)
    assert done.stdout.strip() == "False", done.stderr
