"""study/study5_plan.py, issue 41's translation cell of the equal-time study: every variant
tuned afresh at the cell's two lrs (seed 0), the next seeds following the better lr on
validation, the decisive-gap cut, the closest asynchronous variant's third seed chosen once
every seed 0 and 1 is in, and the minutes within the issue's budget."""
from __future__ import annotations

import pytest

from study import study3_plan, study3_suite, study5_plan


@pytest.fixture(scope="module")
def arm():
    return study5_plan


@pytest.fixture(scope="module")
def inputs():
    plan3 = study3_plan
    suite = study3_suite.SUITES["translation"]
    # budgets as study3_times writes them: U = 1,224 for the synchronous pipeline's time
    updates = {"xpipe": 1078, "pipeoptim": 717, "pipeoptim-2bw": 1246, "pipedream-2bw": 1246, "spectrain": 717}
    cell = {"stages": {"8": {"variants": {v: {} for v in updates}, "budget": {"updates": dict(updates)}}}}
    times = {"cells": {"translation": {"adamw": cell, "muon": cell}}}
    return suite, times, plan3


def _row(run, validation, final):
    return {**run.key_fields(), "validation_metric": validation, "final_metric": final, "diverged": None,
            "higher_is_better": True, "seconds": 60.0}


def test_the_plan_before_any_run(arm, inputs):
    suite, times, _ = inputs
    runs = arm.plan_runs(suite, {}, times)
    ready = [(r.optimizer, r.variant, r.lr) for r in runs if r.status == "ready"]
    assert ready[:4] == [("adamw", "sequential", 0.002), ("adamw", "sequential", 0.004),
                         ("adamw", "xpipe", 0.002), ("adamw", "xpipe", 0.004)]
    # 7 variants x 2 lrs with AdamW, 5 x 2 with Muon: every tuning run is ready at once
    assert len(ready) == 24 and {r.seed for r in runs if r.status == "ready"} == {0}
    # then seeds 1 (and the synchronous pipeline's seed 2) and the closest variant's seed 2 wait
    assert len(runs) == 24 + 8 + 6 + 2 and sum(r.status == "waiting" for r in runs) == 16
    upd = {(r.optimizer, r.variant): r.updates for r in runs}
    assert upd[("adamw", "sequential")] == 204 * 6 and upd[("adamw", "pipeoptim-2bw+ef")] == 1246  # its base's
    assert [r.stages for r in runs[:3]] == [1, 1, 8]
    # minutes: U_m x the CPU seconds per update + evaluations + the test decode
    seq = runs[0]
    assert seq.minutes == pytest.approx((1224 * 0.342 + 12 * 1.5 + 2.5) / 60)
    assert arm.total_minutes(runs) < suite["budget_minutes"]


def test_seeds_follow_the_better_lr_and_the_closest_variant_gets_a_third(arm, inputs):
    suite, times, plan3 = inputs
    suite = {**suite, "extend_edges": False}  # (the extension: the next test)
    rows = {}

    def put(run, validation, final):
        rows[plan3.row_key(run.key_fields())] = _row(run, validation, final)

    tune = [r for r in arm.plan_runs(suite, {}, times) if (r.optimizer, r.phase) == ("adamw", "tune")]
    scores = {"sequential": (10, 9), "xpipe": (9.5, 9.2), "pipeoptim": (8, 8.5), "pipeoptim-2bw": (9, 8.9),
              "pipedream-2bw": (4, 4.2), "spectrain": (3, 2), "pipeoptim-2bw+ef": (9.1, 9.0)}
    for run in tune:  # the lr 2e-3 run is better on validation except for pipeoptim
        low, high = scores[run.variant]
        value = max(low, high) if (run.lr == 0.002) != (run.variant == "pipeoptim") else min(low, high)
        put(run, value, value)
    runs = arm.plan_runs(suite, rows, times)
    seeds = {(r.variant, r.seed): r for r in runs if r.optimizer == "adamw" and r.phase != "tune"}
    assert seeds[("sequential", 1)].lr == seeds[("sequential", 2)].lr == 0.002
    assert seeds[("pipeoptim", 1)].lr == 0.004 and seeds[("pipeoptim", 1)].status == "ready"
    # spectrain's seed 0 ended 78 % behind the synchronous pipeline's 10: its seed 1 is cut
    assert seeds[("spectrain", 1)].status == "dropped" and "decisive-gap" in seeds[("spectrain", 1)].why
    closest = [r for r in runs if r.optimizer == "adamw" and "closest" in r.lr_source]
    assert len(closest) == 1 and closest[0].status == "waiting"
    for run in runs:  # every seed 1 in: xpipe's mean is the best of the asynchronous ones
        if run.optimizer == "adamw" and run.phase in ("reference", "seeds") and run.status == "ready":
            put(run, 9.0, {"xpipe": 9.4, "pipeoptim-2bw+ef": 9.3}.get(run.variant, 8.0))
    again = arm.plan_runs(suite, rows, times)
    third = [r for r in again if r.optimizer == "adamw" and "closest" in r.lr_source][0]
    assert (third.variant, third.seed, third.lr, third.status) == ("xpipe", 2, 0.002, "ready")


def test_an_optimum_at_an_edge_of_the_grid_tunes_one_lr_beyond_it(arm, inputs):
    """Once a variant's two tuning runs are in, the better one at an edge of the grid adds a
    third a factor 2 beyond it (up from the top, down from the bottom); its seeds wait for it and
    then follow the best of the three."""
    suite, times, plan3 = inputs
    rows = {}

    def put(run, value):
        rows[plan3.row_key(run.key_fields())] = _row(run, value, value)

    tune = {(r.variant, r.lr): r for r in arm.plan_runs(suite, {}, times) if r.optimizer == "adamw"}
    put(tune[("sequential", 0.002)], 11.6)
    put(tune[("sequential", 0.004)], 15.3)    # the top edge: 8e-3 next
    put(tune[("xpipe", 0.002)], 4.1)
    put(tune[("xpipe", 0.004)], 1.9)          # the bottom edge: 1e-3 next
    runs = arm.plan_runs(suite, rows, times)
    extra = {(r.variant, r.lr): r for r in runs if r.phase == "tune" and r.optimizer == "adamw"
             and r.lr not in (0.002, 0.004)}
    assert set(extra) == {("sequential", 0.008), ("xpipe", 0.001)}
    assert all(r.status == "ready" and "beyond the grid's edge" in r.lr_source for r in extra.values())
    seeds = {(r.variant, r.seed): r for r in runs if r.optimizer == "adamw" and r.phase != "tune"}
    assert seeds[("sequential", 1)].status == "waiting" and "0.008" in seeds[("sequential", 1)].why
    put(extra[("sequential", 0.008)], 14.0)   # worse than 4e-3: the choice stays 4e-3
    put(extra[("xpipe", 0.001)], 5.0)         # better: 1e-3
    again = {(r.variant, r.seed): r for r in arm.plan_runs(suite, rows, times)
             if r.optimizer == "adamw" and r.phase != "tune"}
    assert (again[("sequential", 1)].lr, again[("sequential", 1)].status) == (0.004, "ready")
    # xpipe's seed 0 at 1e-3 ended 67 % behind the synchronous pipeline: its seed 1 is cut
    assert (again[("xpipe", 1)].lr, again[("xpipe", 1)].status) == (0.001, "dropped")
    # one extension only: the 1e-3 at xpipe's new edge does not add 5e-4
    assert not [r for r in arm.plan_runs(suite, rows, times) if r.lr == 0.0005]
