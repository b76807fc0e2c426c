"""Issue 61's confirmation of the equal-time study: per task at N = 8, the asynchronous arm and the
synchronous arm chosen on validation (study/selection.py), each run again on fresh seeds no choice
ever read; the verdict rests on these runs alone (study/make_results7.py tests them).

The same harness and recipe as issue 23's study (study/study3.py runs it with ``--suite confirm``;
its rows go to ``study/results/study3-confirm/runs.jsonl``), over every earlier arm's rows. Its
runs, in this order:

1. **Equal effort**: where the synchronous pipeline's lr was carried over from the second study
   at an edge of its grid (image, sentiment and the LM with AdamW), sequential at seed 0 a factor 2
   beyond it (phase ``tune``), as the asynchronous arms were re-tuned at an edge. Until a task's
   bracketing runs are in, its synchronous arm is not chosen (its runs wait).
2. **Fresh seeds**, in rounds (seed 100 of every task's two arms, then 101, then 102; phase
   ``confirm``): the synchronous arm as sequential's runs (U updates), the asynchronous one at
   U_m = floor(B / (s_m x cost)), ``cost`` the measured CPU time its options add per update
   (error feedback's 1.9 %: study/results/error_feedback_cost.json), 1 for the others.
3. **Two more seeds a side** (103, 104) where the first three leave the question open by the
   rule fixed here before any run (stats.is_open): on the three seeds' validation metric, the
   one-sided Welch p of "the asynchronous arm is better" lies in [0.05 / 4, 1/2).

Minutes per run: the median CPU minutes of the earlier whole runs (not resumed) of the variant in
the cell, else on the task with any optimizer; their wall minutes where no row has its CPU time;
else study6_plan.cpu_minutes's guess."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from study import make_results6
from study.make_results4 import merged
from study.make_results5 import with_translation
from study.selection import Choice, blind, brackets, choose, prior_settings
from study.stats import is_open, welch
from study.study3_plan import Run, row_key
from study.study3_suite import VARIANTS, sequential_updates
from study.study6_plan import cpu_minutes
from pipeoptim.lab.tasks import get_task


def inputs(suite: Dict[str, Any], times: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
    """(every cell's budgets, the variants aliased; the earlier arms' rows by key)."""
    rows, times = prior_rows(suite)
    return times, {row_key(r): r for r in rows}


def merged_arms(study: Path, delay_fixes: Optional[Path], translation: Optional[Path],
                feedback: Optional[Path]) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """Every earlier arm's rows and budgets in one list and one times table: issue 23's study with
    issue 38's, 41's and 51's arms merged in (each left out where its folder is None or empty); what
    the report (make_results3.generate) and the confirmation's choice read."""
    rows, times = with_translation(*merged(study, delay_fixes), translation)
    return make_results6.with_feedback(rows, times, feedback)


def prior_rows(suite: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """The earlier arms' rows and budgets, merged as the report merges them."""
    prior = {k: Path(v) for k, v in suite["prior"].items()}
    return merged_arms(prior["study"], prior["delay_fixes"], prior["translation"], prior["feedback"])


def minutes_of(rows: Dict[str, Dict[str, Any]], task: str, optimizer: str, variant: str, stages: int) -> float:
    """A run's CPU minutes, as the module's docstring says."""
    def median(same_optimizer: bool, field: str) -> Optional[float]:
        values = [r.get(field) for r in rows.values()
                  if (r["task"], r["variant"], r["stages"]) == (task, variant, stages) and r.get(field)
                  and (r["optimizer"] == optimizer or not same_optimizer) and r.get("until") != "third"
                  and not r.get("diverged") and not r.get("resumed")]
        return statistics.median(values) / 60 if values else None

    return (median(True, "cpu_seconds") or median(False, "cpu_seconds") or median(True, "seconds")
            or median(False, "seconds") or cpu_minutes(rows, task, optimizer, variant, stages))


def option_costs(suite: Dict[str, Any]) -> Dict[str, float]:
    """option -> the factor it multiplies an update's time by (measured)."""
    return {option: float(json.loads(Path(path).read_text())["ratio"]) for option, path in suite["costs"].items()}


def cost_of(variant: str, costs: Dict[str, float]) -> float:
    """The factor ``variant``'s options add to its base method's time per update."""
    options = VARIANTS[variant][1] if variant in VARIANTS else {}
    return math.prod(costs[o] for o, on in options.items() if on is True and o in costs)


def confirm_updates(times: Dict[str, Any], choice: Choice, suite: Dict[str, Any]) -> int:
    """The updates a confirmation run of ``choice`` trains: U for the synchronous pipeline, else
    floor(B / (s_m x cost))."""
    if choice.synchronous:
        return sequential_updates(suite, choice.task)
    at_n = times["cells"][choice.task][choice.optimizer]["stages"][str(choice.stages)]
    seconds = at_n["variants"][choice.variant]["seconds_per_batch"] * cost_of(choice.variant, option_costs(suite))
    return int(at_n["budget"]["budget_seconds"] / seconds)


def choices(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]], times: Dict[str, Any],
            prior: Dict[str, Dict[str, Any]],
            bracketed: Optional[Dict[Tuple[str, str], Tuple[float, float]]] = None) -> Dict[str, Dict[str, Any]]:
    """task -> selection.choose's answer (the arms chosen on validation, or what they wait for);
    ``bracketed``: selection.brackets(), where the caller has it."""
    settings = prior_settings(prior.values(), times)
    bracketed = brackets() if bracketed is None else bracketed
    own = list(rows.values())
    return {task: choose(settings, own, task, suite["stages"], bracketed) for task in suite["order"]}


def confirmation_rows(rows: Dict[str, Dict[str, Any]], choice: Choice, seeds: Sequence[int]) -> List[Dict[str, Any]]:
    """The confirmation runs of ``choice`` among ``rows`` at ``seeds``."""
    n = 1 if choice.synchronous else choice.stages
    return [r for r in rows.values() if r["phase"] == "confirm" and (r["task"], r["optimizer"], r["variant"],
            r["stages"], r["lr"]) == (choice.task, choice.optimizer, choice.run_variant, n, choice.lr)
            and r["seed"] in seeds]


def opened(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]], task: str,
           picked: Dict[str, Any]) -> Tuple[str, str]:
    """(status, why) of a task's further seeds under the rule fixed beforehand (validation only)."""
    sync, asynchronous = picked["synchronous"], picked["asynchronous"]
    if sync is None or asynchronous is None:
        return "waiting", f"{task}'s arms"
    first = [blind(confirmation_rows(rows, c, suite["seeds"])) for c in (asynchronous, sync)]
    if any(len(r) < len(suite["seeds"]) for r in first):
        return "waiting", f"{task}'s first {len(suite['seeds'])} fresh seeds a side"
    higher = get_task(task).higher_is_better
    values = [[r["validation_metric"] for r in group if r.get("validation_metric") is not None] for group in first]
    if any(len(v) < 2 for v in values):
        return "dropped", "a diverged arm: its runs decide"
    p = welch(values[0], values[1], higher).p
    if is_open(p):
        return "ready", f"open after {len(suite['seeds'])} seeds (validation p = {p:.3f})"
    return "dropped", f"decided after {len(suite['seeds'])} seeds (validation p = {p:.3f}, outside [0.0125, 0.5))"


def plan_runs(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]], times: Dict[str, Any],
              prior: Dict[str, Dict[str, Any]]) -> List[Run]:
    """Every run in order, with lr, updates, status against ``rows`` (this suite's) and minutes."""
    runs: List[Run] = []
    both = {**prior, **rows}

    def add(run: Run, status: str = "ready", why: str = "") -> None:
        run.index, run.status, run.why = len(runs), status, why
        run.minutes = minutes_of(both, run.task, run.optimizer, run.variant, run.stages)
        if run.status == "ready" and run.lr is not None and row_key(run.key_fields()) in rows:
            run.status = "done"
        runs.append(run)

    bracketed = brackets()
    for (task, optimizer), (carried, beyond) in bracketed.items():  # 1. equal effort
        add(Run("tune", task, optimizer, "sequential", 1, 0, beyond, updates=sequential_updates(suite, task),
                lr_source=f"one factor 2 beyond the second study's {carried:g}, at its grid's edge (seed 0)"))
    picked = choices(suite, rows, times, prior, bracketed)

    def arm_runs(task: str, seeds: Sequence[int], status: str = "ready", why: str = "") -> List[Tuple[Run, str, str]]:
        out = []
        for kind in ("synchronous", "asynchronous"):
            choice: Optional[Choice] = picked[task][kind]
            for seed in seeds:
                if choice is None:
                    waits = ", ".join(f"{t} x {o}" for t, o in picked[task]["waiting"]) or task
                    out.append((Run("confirm", task, "?", "sequential" if kind == "synchronous" else kind,
                                    1 if kind == "synchronous" else suite["stages"], seed, None),
                                "waiting", f"the bracketing run of {waits}"))
                    continue
                run = Run("confirm", task, choice.optimizer, choice.run_variant, 1 if choice.synchronous else
                          choice.stages, seed, choice.lr, updates=confirm_updates(times, choice, suite),
                          lr_source=f"chosen on validation ({choice.why})")
                out.append((run, status, why))
        return out

    for seed in suite["seeds"]:  # 2. fresh seeds, in rounds
        for task in suite["order"]:
            for run, status, why in arm_runs(task, [seed]):
                add(run, status, why)
    for task in suite["order"]:  # 3. two more where the question is open
        status, why = opened(suite, rows, task, picked[task])
        for run, s, w in arm_runs(task, suite["open_seeds"], status, why):
            add(run, s, w)
    return runs
