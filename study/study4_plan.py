"""Issue 38's arm of the equal-time study: the published fixes for delay, and the close calls.

The same harness and rules as issue 23's study (study/study3.py runs it with ``--suite
delay_fixes``; its rows go to ``study/results/study3-delay_fixes/runs.jsonl``): the
synchronous pipeline's time sets the budget B, each variant trains U_m = floor(B / s_m)
updates with the recipe scaled to U_m, the lr is chosen on the validation split and the test
metric is read at the end. What this arm adds (its arms, in the order they run, so that an
interrupted arm has the most telling rows first):

1. **Error feedback** (``+ef``: ``error_feedback=True``) on the methods with a one-update delay,
   pipedream-2bw and pipeoptim-2bw (XPipe's delay is up to 4 updates at N = 8: not one), on
   the LM with AdamW (where every asynchronous method is furthest behind), then with Muon, then
   on image (pipeoptim-2bw with momentum and AdamW).
2. **The close calls settled**: the third seed of XPipe and of the synchronous pipeline with
   Muon on the LM, and of pipeoptim-2bw with AdamW on image (the synchronous side has 3).
3. **The delay-aware Nesterov step** (``--optimizer delay-nadamw``, beta1 = 0.99 for every
   variant, the synchronous one included: the arm tunes it for none) on the LM: the
   synchronous pipeline, pipeoptim, xpipe and pipeoptim-2bw.

Each new (variant, cell) is tuned as issue 23 re-tuned a carried lr: the lr of the study's
choice for the variant the fix is added to (its base variant; for the new optimizer, the NAdam
arm's choice with the same beta1, the closest optimizer the study tuned) and one neighbour
(a factor 2: beyond the edge of the grid when the choice lies at one, else toward its
runner-up), both to the end at seed 0; the better on validation gets seed 1. A seed 1 is
dropped where seed 0 ended more than the decisive gap behind the synchronous pipeline with the
same optimizer, as in issue 23's study.

U_m and s_m: a ``+ef`` variant's are its base variant's (the correction is two passes over the
weights per update: 1.5 ms of a 191 ms update of the LM's model on one thread, a fit 1.02x,
study/error_feedback_cost.py), and
the new optimizer's cell takes NAdam's budgets (one adaptive optimizer for another; the budget
is the synchronous pipeline's compute). Minutes per run: the CPU minutes of the base variant's
whole runs in issue 23's study (the plan of that study underestimated them 1.6-1.9x).
"""
from __future__ import annotations

import copy
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

from study import study2_plan
from study.study3_plan import Run, decided_by_seed0, neighbour, row_key
from study.study3_suite import sequential_updates
from pipeoptim.lab.tasks import get_task

#: variants of this arm -> the variant whose lr, U_m and cost they carry
BASE_VARIANT = {"pipedream-2bw+ef": "pipedream-2bw", "pipeoptim-2bw+ef": "pipeoptim-2bw"}
#: optimizers of this arm -> the study's optimizer whose budgets and tuned lrs they carry
BASE_OPTIMIZER = {"delay-nadamw": "nadam"}


def base_variant(variant: str) -> str:
    return BASE_VARIANT.get(variant, variant)


def base_optimizer(optimizer: str) -> str:
    return BASE_OPTIMIZER.get(optimizer, optimizer)


def alias_times(times: Dict[str, Any]) -> Dict[str, Any]:
    """The times file with this arm's optimizers and variants filled in from their bases (a copy)."""
    out = copy.deepcopy(times)
    for task, by_opt in out["cells"].items():
        for new, old in BASE_OPTIMIZER.items():
            if old in by_opt:
                by_opt[new] = copy.deepcopy(by_opt[old])
        for cell in by_opt.values():
            for at_n in cell["stages"].values():
                for new, old in BASE_VARIANT.items():
                    if old in at_n["variants"]:
                        at_n["variants"][new] = at_n["variants"][old]
                    if old in at_n["budget"]["updates"]:
                        at_n["budget"]["updates"][new] = at_n["budget"]["updates"][old]
    return out


def study_choice(rows3: Dict[str, Dict[str, Any]], task: str, optimizer: str, variant: str,
                 stages: int) -> Tuple[Optional[float], Optional[float], List[float]]:
    """(chosen lr, runner-up or None, every lr tried) of issue 23's tuning of a variant, on
    validation (its tuning runs to the end, at seed 0); where it carried an lr over unchecked (the
    reference, the seeds of a carried variant), that lr."""
    def matching(phases: Sequence[str]) -> List[Tuple[float, Dict[str, Any]]]:
        return [(r["lr"], r) for r in rows3.values()
                if (r["task"], r["optimizer"], r["variant"], r["stages"]) == (task, optimizer, variant, stages)
                and r["phase"] in phases and r.get("until") != "third" and (r["seed"] == 0 or phases != ("tune",))]
    found = matching(("tune",)) or matching(("reference", "seeds"))
    ranked = study2_plan.ranked_lrs(found, get_task(task).higher_is_better)
    tried = sorted({lr for lr, _ in found} | {r["lr"] for r in rows3.values()
                   if (r["task"], r["optimizer"], r["variant"], r["stages"]) == (task, optimizer, variant, stages)})
    return (ranked[0] if ranked else None), (ranked[1] if len(ranked) > 1 else None), tried


def run_cpu_minutes(rows3: Dict[str, Dict[str, Any]], task: str, optimizer: str, variant: str, stages: int,
                    fallback: float) -> float:
    """The median CPU minutes of issue 23's whole runs of the base variant in the cell."""
    values = [r.get("cpu_seconds") or r["seconds"] for r in rows3.values()
              if (r["task"], r["optimizer"], r["variant"], r["stages"]) == (task, optimizer, variant, stages)
              and r.get("until") != "third" and not r.get("diverged")]
    return statistics.median(values) / 60 if values else fallback


def plan_runs(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]], times: Dict[str, Any],
              rows3: Dict[str, Dict[str, Any]]) -> List[Run]:
    """Every run of the arm in order, with lr, U_m, status against ``rows`` (this arm's) and
    minutes. ``rows3``: issue 23's rows (the lrs carried, the references, the costs)."""
    runs: List[Run] = []
    both = {**rows3, **rows}
    times = alias_times(times)

    def updates_of(task: str, optimizer: str, variant: str, stages: int) -> int:
        if variant == "sequential":
            return sequential_updates(suite, task)
        return int(times["cells"][task][optimizer]["stages"][str(stages)]["budget"]["updates"][variant])

    def add(run: Run, status: str = "ready", why: str = "") -> None:
        run.updates = updates_of(run.task, run.optimizer, run.variant, run.stages)
        run.index, run.status, run.why = len(runs), status, why
        run.minutes = run_cpu_minutes(rows3, run.task, base_optimizer(run.optimizer), base_variant(run.variant),
                                      run.stages, 10.0)
        if run.status == "ready" and row_key(run.key_fields()) in both:
            run.status = "done"
        runs.append(run)

    rows3_opts = {r["optimizer"] for r in rows3.values()}

    def stages_of(variant: str, arm: Dict[str, Any]) -> int:
        return 1 if variant == "sequential" else arm["stages"]

    def pair(task: str, optimizer: str, variant: str, stages: int) -> Tuple[List[float], str]:
        """The two lrs a new (variant, cell) is tuned at, and where they come from."""
        carried_opt, carried_variant = base_optimizer(optimizer), base_variant(variant)
        lr, runner_up, tried = study_choice(rows3, task, carried_opt, carried_variant, stages)
        if lr is None:
            raise ValueError(f"issue 23's study has no tuned lr for {carried_variant} on {task} x {carried_opt}")
        source = f"{carried_variant} with {carried_opt}'s lr in issue 23's study and one neighbour"
        return [lr, neighbour(lr, runner_up, tried if len(tried) > 1 else ())], source

    def chosen(task: str, optimizer: str, variant: str, stages: int) -> Tuple[Optional[float], str, str]:
        lrs, _ = pair(task, optimizer, variant, stages)
        found = [(lr, both.get(row_key(Run("tune", task, optimizer, variant, stages, 0, lr,
                                           updates=updates_of(task, optimizer, variant, stages)).key_fields())))
                 for lr in lrs]
        missing = [f"{lr:g}" for lr, r in found if r is None]
        if missing:
            return None, "waiting", f"{variant}'s tuning at lr {', '.join(missing)}"
        ranked = study2_plan.ranked_lrs(found, get_task(task).higher_is_better)
        return (ranked[0], "ready", "") if ranked else (None, "dropped", f"{variant} diverged at every lr")

    def reference_lr(task: str, optimizer: str) -> Optional[float]:
        """The synchronous pipeline's lr with this optimizer: issue 23's, or this arm's choice."""
        if optimizer in rows3_opts and optimizer not in BASE_OPTIMIZER:
            return study_choice(rows3, task, optimizer, "sequential", 1)[0]
        return chosen(task, optimizer, "sequential", 1)[0]

    for arm in suite["arms"]:
        task, optimizer = arm["task"], arm["optimizer"]
        if arm["kind"] == "seeds":  # the close calls: one more seed at the study's own lr
            for variant in arm["variants"]:
                n = stages_of(variant, arm)
                lr = study_choice(rows3, task, optimizer, variant, n)[0]
                for seed in arm["seeds"]:
                    add(Run("reference" if variant == "sequential" else "seeds", task, optimizer, variant, n, seed,
                            lr, lr_source="issue 23's choice (a further seed)"))
            continue
        for variant in arm["variants"]:  # a new fix or optimizer: tuned at seed 0, then seed 1
            n = stages_of(variant, arm)
            lrs, source = pair(task, optimizer, variant, n)
            for lr in lrs:
                add(Run("tune", task, optimizer, variant, n, 0, lr, lr_source=source))
        for variant in arm["variants"]:
            n = stages_of(variant, arm)
            lr, status, why = chosen(task, optimizer, variant, n)
            gap = suite.get("decisive_gap")
            if gap and variant != "sequential" and status == "ready":
                status, why = decided_by_seed0(both, task, optimizer, variant, n, lr,
                                               reference_lr(task, optimizer), get_task(task).higher_is_better, gap)
            for seed in arm["seeds"][1:]:
                add(Run("reference" if variant == "sequential" else "seeds", task, optimizer, variant, n, seed, lr,
                        lr_source="chosen on validation"), status, why)
    return runs


def arm_of(run: Run, suite: Dict[str, Any]) -> str:
    """The arm's name a run belongs to (for the report)."""
    for arm in suite["arms"]:
        if (arm["task"], arm["optimizer"]) == (run.task, run.optimizer) and run.variant in arm["variants"]:
            return arm["name"]
    return ""


def total_minutes(runs: Sequence[Run]) -> float:
    return sum(r.minutes for r in runs if r.status != "dropped")
