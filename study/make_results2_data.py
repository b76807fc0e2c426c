"""The second study's data (issue 16, every method given sequential's updates), as its report
(study/make_results2.py), findings (make_results2_findings.py) and figures
(make_results2_plots.py) read it: per setting (task, optimizer, N), each method's runs at the lr
the sweep chose, its final test metric over the seeds, the target and the time to it on N devices
(the predicted seconds per mini-batch of the study's ``times.json``). The equal-time study reuses
its scores (make_results3_arith.py) and its settings (study3_plan.py: the lrs carried over).
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from study import study2_plan
from study.common import mean_sd
from study.study2_times import seconds_per_batch as lookup_seconds
from pipeoptim.lab.time_to_target import target_from_reference, updates_to_target

SCALE = {"accuracy": 100.0}  #: accuracy in percent; perplexity as is
HEADLINE = ["pipeoptim", "pipeoptim+lr_correction"]
#: the level the issue asks sequential to reach on each task, for the comparison to be worth making:
#: (bar, how it reads); perplexity's bar is "well below the unigram's 470.1" (README), read as half of it
LEVELS = {"image": (0.90, "at or above 90 % test accuracy"), "sentiment": (0.72, "at or above 72 %"),
          "lm": (235.0, "well below the unigram's perplexity of 470.1 (here: at most half of it)")}
RIVALS = ["pipedream", "pipedream-2bw", "spectrain", "xpipe"]
SYNCHRONOUS_PIPELINES = ["gpipe", "1f1b-flush"]


# --------------------------------------------------------------------------------------------
# the arithmetic (tested in study/tests/test_make_results2.py)


def final_score(row: Dict[str, Any], higher: bool) -> float:
    """The run's final test metric; a diverged run scores the worst (0, or infinity when lower
    is better)."""
    if row.get("diverged") or row.get("final_metric") is None:
        return 0.0 if higher else math.inf
    return row["final_metric"]


def run_updates_to_target(row: Dict[str, Any], target: float, higher: bool) -> Optional[float]:
    """Updates to the first validation evaluation at or past ``target``; None if never (or diverged)."""
    if row.get("diverged"):
        return None
    return updates_to_target([(e["updates"], e["metric"]) for e in row["evaluations"]], target, higher)


def stage_errors(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, float]]:
    """Per stage, the prediction and staleness errors averaged over every probe of every epoch of
    the (non-diverged) runs, and their ratio (below 1: the forward's weights were closer to the
    backward's than the stale weights were; exactly 1 for a method that does not predict)."""
    sums: Dict[int, List[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for row in rows:
        if row.get("diverged"):
            continue
        for epoch in row.get("prediction_error") or []:
            for stage, probe in enumerate(epoch or []):
                n = probe.get("probes") or 0
                if n:
                    sums[stage][0] += n
                    sums[stage][1] += n * probe["prediction_error"]
                    sums[stage][2] += n * probe["staleness_error"]
    out = []
    for stage in sorted(sums):
        n, p, s = sums[stage]
        out.append({"stage": stage, "prediction": p / n, "staleness": s / n,
                    "ratio": (p / s) if s > 0 else float("nan")})
    return out


def seconds_per_batch(times: Optional[Dict[str, Any]], task: str, optimizer: str, stages: int,
                      method: str) -> Optional[float]:
    """The predicted seconds per mini-batch of ``method`` on ``stages`` devices (``times.json``),
    or None where the study has no prediction."""
    if not times:
        return None
    try:
        return lookup_seconds(times, task, optimizer, stages, method)
    except (KeyError, ValueError):
        return None


# --------------------------------------------------------------------------------------------
# the study's data, per setting


@dataclass
class Method:
    """One method's runs in one setting (at its chosen lr)."""

    variant: str
    lr: Optional[float]
    rows: List[Dict[str, Any]]
    why: str = ""  #: why there are no rows (waiting, every lr diverged)

    @property
    def ok(self) -> List[Dict[str, Any]]:
        return [r for r in self.rows if not r.get("diverged")]

    @property
    def diverged(self) -> int:
        return sum(1 for r in self.rows if r.get("diverged"))


@dataclass
class Setting:
    """A task, optimizer and stage count: every method's runs at its own best lr, the target,
    and each method's predicted time per mini-batch on N devices."""

    task: str
    optimizer: str
    stages: int
    metric: str
    higher: bool
    methods: Dict[str, Method]
    times: Optional[Dict[str, Any]] = None
    scale: float = field(init=False)

    def __post_init__(self) -> None:
        self.scale = SCALE.get(self.metric, 1.0)

    def name(self) -> str:
        return f"{self.task}, {self.optimizer}, N={self.stages}"

    def final(self, variant: str) -> Tuple[float, float]:
        method = self.methods.get(variant)
        return mean_sd([final_score(r, self.higher) for r in method.rows]) if method else (math.nan, math.nan)

    def seeds(self, variant: str) -> int:
        method = self.methods.get(variant)
        return len(method.rows) if method else 0

    def reference(self) -> Optional[float]:
        """sequential's mean final validation metric (None until it is in)."""
        seq = self.methods.get("sequential")
        values = [r["validation_metric"] for r in seq.ok] if seq else []
        return statistics.mean(values) if values else None

    def target(self) -> Optional[float]:
        reference = self.reference()
        return None if reference is None else target_from_reference(reference, self.higher)

    def seconds(self, variant: str) -> Optional[float]:
        """Predicted seconds per mini-batch on N devices; sequential's: the faster synchronous
        pipeline's (the same updates as sequential)."""
        if variant == "sequential":
            options = [seconds_per_batch(self.times, self.task, self.optimizer, self.stages, m)
                       for m in SYNCHRONOUS_PIPELINES]
            options = [s for s in options if s is not None]
            return min(options) if options else None
        method = study2_plan.variant_method(variant)[0]
        return seconds_per_batch(self.times, self.task, self.optimizer, self.stages, method)

    def updates_to_target(self, variant: str) -> List[Optional[float]]:
        target = self.target()
        method = self.methods.get(variant)
        if target is None or method is None:
            return []
        return [run_updates_to_target(r, target, self.higher) for r in method.rows]

    def time_to_target(self, variant: str, every_seed: bool = True) -> Optional[Tuple[float, float]]:
        """(mean, sd) seconds to target on N devices over the seeds, None unless every seed
        reached it (``every_seed``; else at least one, the mean over those) and the time per
        mini-batch is known."""
        updates, seconds = self.updates_to_target(variant), self.seconds(variant)
        reached = [u for u in updates if u is not None]
        if not reached or seconds is None or (every_seed and len(reached) < len(updates)):
            return None
        return mean_sd([u * seconds for u in reached])

    def synchronous_time(self) -> Tuple[Optional[Tuple[float, float]], str]:
        """The synchronous reference's time to target and, where some of sequential's seeds end
        short of the target (it is 99 % of their mean), how many reach it: the reference is then
        the mean over those."""
        updates = self.updates_to_target("sequential")
        reached = sum(u is not None for u in updates)
        note = "" if reached == len(updates) else f", {reached} of {seeds_text(len(updates))} reach it"
        return self.time_to_target("sequential", every_seed=False), note


def method_rows(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]], task: str, optimizer: str,
                variant: str, stages: int) -> Method:
    """The method's runs in the setting: at the lr the sweep chose, the sweep's own run (seed 0 at
    the sweep's N) and the seeds'."""
    lr, status, why = study2_plan.best_lr(suite, rows, task, optimizer, variant)
    if lr is None:
        return Method(variant, None, [], why)
    sweep_stages = max(suite["stages"])
    n = 1 if variant == "sequential" else stages
    found = []
    if variant == "sequential" or stages == sweep_stages:
        found.append(rows[study2_plan.row_key(study2_plan.sweep_run(suite, task, optimizer, variant, lr, "end").key_fields())])
    for seed in suite["seeds"]:
        key = study2_plan.row_key(study2_plan.Run("seeds", task, optimizer, variant, n, seed, lr).key_fields())
        if key in rows:
            found.append(rows[key])
    return Method(variant, lr, sorted(found, key=lambda r: r["seed"]))


def settings_of(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]],
                times: Optional[Dict[str, Any]]) -> List[Setting]:
    from pipeoptim.lab.tasks import get_task

    out = []
    for task, optimizer in suite["cells"]:
        higher = get_task(task).higher_is_better
        metric = get_task(task).metric
        for stages in suite["stages"]:
            methods = {v: method_rows(suite, rows, task, optimizer, v, stages)
                       for v in ["sequential", *suite["methods"]]}
            out.append(Setting(task, optimizer, stages, metric, higher, methods, times))
    return out


def sweep_points(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]], task: str, optimizer: str,
                 variant: str) -> List[Tuple[float, str, Optional[float]]]:
    """Per lr of the sweep: (lr, what the point is: "end", "third", "diverged" or "missing", the
    final validation metric, else the first third's)."""
    out = []
    for lr in study2_plan.sweep_lrs(suite, task, optimizer):
        end = rows.get(study2_plan.row_key(study2_plan.sweep_run(suite, task, optimizer, variant, lr, "end").key_fields()))
        third = rows.get(study2_plan.row_key(study2_plan.sweep_run(suite, task, optimizer, variant, lr, "third").key_fields()))
        row, kind = (end, "end") if end else (third, "third") if third else (None, "missing")
        if row is not None and (row.get("diverged") or row.get("validation_metric") is None):
            kind = "diverged"
        out.append((lr, kind, row["validation_metric"] if kind in ("end", "third") else None))
    return out


# --------------------------------------------------------------------------------------------
# the numbers as the report prints them


def value(x: Optional[float], scale: float, digits: int = 2) -> str:
    return "-" if x is None or x != x else f"{x * scale:.{digits}f}"


def digits_of(st: Setting) -> int:
    return 2 if st.metric == "accuracy" else 1


def seeds_text(n: int) -> str:
    return f"{n} seed{'s' if n != 1 else ''}"
