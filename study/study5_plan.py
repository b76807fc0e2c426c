"""Issue 41's cell of the equal-time study: translation, the paper's third task, at N = 8 with
AdamW and with Muon.

The same harness and rules as issue 23's study (study/study3.py runs it with ``--suite
translation``; its rows go to ``study/results/study3-translation/runs.jsonl``): the
synchronous pipeline's predicted time for sequential's U updates (its fastest schedule and M,
``study/study3_times.py --suite translation``) sets the budget B; each variant trains
U_m = floor(B / s_m) updates with the recipe scaled to U_m; its lr is chosen on the validation
split (BLEU on the first 300 pairs of the task's valid split); the test BLEU is read at the end.
No earlier study tuned this task, so every variant is tuned afresh. Per arm (AdamW, then Muon),
in this order, so that an interrupted arm has the most telling rows first:

1. ``tune``, seed 0: each variant at the arm's two lrs (the suite's ``lr`` grid for the task),
   both to the end, the synchronous pipeline first; where the better lies at an edge of the
   grid (``extend_edges``), one more a factor 2 beyond it, to the end;
2. ``reference`` / ``seeds``, seed 1: each variant at the lr that was better on validation (the
   decisive-gap cut drops the seed of a variant whose seed 0 ended more than ``decisive_gap`` of
   the synchronous pipeline's BLEU behind it); the synchronous pipeline's seed 2;
3. ``seeds``, seed 2 of the asynchronous variant closest to the synchronous pipeline (the best
   mean test BLEU over its seeds 0 and 1), once every variant's seeds 0 and 1 are in.

A ``+ef`` variant's U_m is its base variant's (error feedback's two passes cost 2 % of an
update: study/error_feedback_cost.py). Minutes per run: U_m x the variant's CPU seconds per
update on the local runtime (study/translation_cost.py), plus its evaluations on
validation and the final test decode.
"""
from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

from study import study2_plan
from study.study3_plan import Run, decided_by_seed0, row_key
from study.study3_suite import sequential_updates
from study.study4_plan import alias_times
from pipeoptim.lab.tasks import get_task

TASK = "translation"


def run_minutes(suite: Dict[str, Any], optimizer: str, variant: str, updates: int) -> float:
    """CPU minutes of a whole run: its updates, its evaluations on validation, the test decode."""
    spec = suite["tasks"][TASK]
    per_update = suite["cpu_seconds_per_update"][optimizer][variant]
    evaluations = updates // spec["eval_every"]
    return (updates * per_update + evaluations * spec["eval_seconds"] + spec["test_seconds"]) / 60


def finals(rows: Dict[str, Dict[str, Any]], optimizer: str, variant: str, stages: int,
           lr: Optional[float]) -> Dict[int, Optional[float]]:
    """Seed -> final test metric of the whole runs of a variant at ``lr`` (None: diverged)."""
    return {r["seed"]: r.get("final_metric") for r in rows.values()
            if (r["task"], r["optimizer"], r["variant"], r["stages"], r["lr"]) == (TASK, optimizer, variant, stages, lr)
            and r.get("until") != "third"}


def closest(rows: Dict[str, Dict[str, Any]], optimizer: str, lrs: Dict[str, Optional[float]], stages: int,
            seeds: Sequence[int], higher: bool) -> Optional[str]:
    """The asynchronous variant whose mean final metric over ``seeds`` (those it has: a seed the
    decisive-gap cut dropped is not there) is the best, or None where every one diverged.
    ``lrs``: each variant's chosen lr (None: out)."""
    means = {}
    for variant, lr in lrs.items():
        if variant == "sequential" or lr is None:
            continue
        values = [v for seed, v in finals(rows, optimizer, variant, stages, lr).items() if seed in seeds and v is not None]
        if values:
            means[variant] = statistics.mean(values)
    return (max if higher else min)(means, key=means.get) if means else None


def plan_runs(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]], times: Dict[str, Any],
              _unused: Optional[Dict[str, Dict[str, Any]]] = None) -> List[Run]:
    """Every run of the cell in order, with lr, U_m, status against ``rows`` and minutes."""
    runs: List[Run] = []
    times = alias_times(times)
    higher = get_task(TASK).higher_is_better
    grid = suite["tasks"][TASK]["lr"]

    def updates_of(optimizer: str, variant: str, stages: int) -> int:
        if variant == "sequential":
            return sequential_updates(suite, TASK)
        try:
            return int(times["cells"][TASK][optimizer]["stages"][str(stages)]["budget"]["updates"][variant])
        except KeyError:
            raise KeyError(f"no budget for {TASK} x {optimizer} at N = {stages} in the times file: run "
                           f"python -m study.study3_times --suite translation") from None

    def add(run: Run, status: str = "ready", why: str = "") -> None:
        run.updates = updates_of(run.optimizer, run.variant, run.stages)
        run.index, run.status, run.why = len(runs), status, why
        run.minutes = run_minutes(suite, run.optimizer, run.variant, run.updates)
        if run.status == "ready" and row_key(run.key_fields()) in rows:
            run.status = "done"
        runs.append(run)

    def tune_row(optimizer: str, variant: str, stages: int, lr: float) -> Optional[Dict[str, Any]]:
        return rows.get(row_key(Run("tune", TASK, optimizer, variant, stages, 0, lr,
                                    updates=updates_of(optimizer, variant, stages)).key_fields()))

    def tune_lrs(optimizer: str, variant: str, stages: int) -> List[float]:
        """The grid's two lrs, and (``extend_edges``) once both are in, one a factor 2 beyond the
        better where it lies at an edge of the grid: an optimum the grid does not bracket."""
        lrs = list(grid[optimizer])
        found = [(lr, tune_row(optimizer, variant, stages, lr)) for lr in lrs]
        if not suite.get("extend_edges") or any(r is None for _, r in found):
            return lrs
        ranked = study2_plan.ranked_lrs(found, higher)
        if ranked and ranked[0] in (min(lrs), max(lrs)):
            lrs.append(ranked[0] * 2 if ranked[0] == max(lrs) else ranked[0] / 2)
        return lrs

    def chosen(optimizer: str, variant: str, stages: int) -> Tuple[Optional[float], str, str]:
        """(the best lr on validation of those tuned, status, why)."""
        found = [(lr, tune_row(optimizer, variant, stages, lr)) for lr in tune_lrs(optimizer, variant, stages)]
        missing = [f"{lr:g}" for lr, r in found if r is None]
        if missing:
            return None, "waiting", f"{variant}'s tuning at lr {', '.join(missing)}"
        ranked = study2_plan.ranked_lrs(found, higher)
        return (ranked[0], "ready", "") if ranked else (None, "dropped", f"{variant} diverged at every lr")

    for arm in suite["arms"]:
        optimizer = arm["optimizer"]
        stages_of = {v: 1 if v == "sequential" else arm["stages"] for v in arm["variants"]}
        for variant in arm["variants"]:
            for lr in tune_lrs(optimizer, variant, stages_of[variant]):
                beyond = lr not in grid[optimizer]
                add(Run("tune", TASK, optimizer, variant, stages_of[variant], 0, lr,
                        lr_source=("one beyond the grid's edge, where the better of its two lay (seed 0)" if beyond
                                   else f"the cell's grid {', '.join(f'{x:g}' for x in grid[optimizer])} (seed 0)")))
        picks = {v: chosen(optimizer, v, stages_of[v]) for v in arm["variants"]}
        reference_lr = picks["sequential"][0]
        for variant in arm["variants"]:
            lr, status, why = picks[variant]
            if variant != "sequential" and status == "ready":
                status, why = decided_by_seed0(rows, TASK, optimizer, variant, arm["stages"], lr, reference_lr,
                                               higher, suite["decisive_gap"])
            seeds = suite["seeds"][1:] + (suite["close_seeds"] if variant == "sequential" else [])
            for seed in seeds:
                add(Run("reference" if variant == "sequential" else "seeds", TASK, optimizer, variant,
                        stages_of[variant], seed, lr, lr_source="chosen on validation"), status, why)
        # the closest asynchronous variant's further seed, once every asynchronous seed 0 and 1 is
        # in or dropped (planned meanwhile at the cost of the dearest variant, the lr unknown)
        pending = [r for r in runs if r.optimizer == optimizer and r.variant != "sequential"
                   and r.status in ("ready", "waiting")]
        lrs = {v: (picks[v][0] if picks[v][1] == "ready" else None) for v in arm["variants"]}
        name = None if pending else closest(rows, optimizer, lrs, arm["stages"], suite["seeds"], higher)
        stand_in = name or max((v for v in arm["variants"] if v != "sequential"),
                               key=lambda v: suite["cpu_seconds_per_update"][optimizer][v])
        why = ("every asynchronous seed 0 and 1" if pending else "an asynchronous variant that did not diverge")
        for seed in suite["close_seeds"]:
            run = Run("seeds", TASK, optimizer, stand_in, arm["stages"], seed, lrs[stand_in] if name else None,
                      lr_source="chosen on validation (the closest asynchronous variant)")
            add(run, "ready" if name else ("waiting" if pending else "dropped"),
                "" if name else f"the closest variant, chosen after {why}")
    return runs


def total_minutes(runs: Sequence[Run]) -> float:
    return sum(r.minutes for r in runs if r.status != "dropped")
