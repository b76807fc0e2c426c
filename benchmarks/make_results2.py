"""The second study's report (issue 16: which pipeline reaches the target first, trained with the
recipe people use, every method given sequential's updates), and its figures (``results2/``). No
number is typed by hand. ``docs/results.md`` carries it below the equal-time report
(``benchmarks/make_results3.py`` writes both); alone:

    .venv/bin/python benchmarks/make_results2.py [--study benchmarks/results/study2] [--out runs/report2]

Reads the study's rows (``runs.jsonl``, written by ``benchmarks/study2.py``) and the predicted time
per mini-batch of each method on N devices (``times.json``, ``benchmarks/study2_times.py``).

How the numbers are made:

* A method's *setting* is (task, optimizer, N). Its learning rate is the one the sweep chose on the
  validation split (``study2.best_lr``); its runs are the sweep's run at that lr (seed 0, N = 8)
  and the seeds' runs. ``sequential`` has no stages: the same runs are its row at every N.
* The *final metric* is the test split's, once at the end; a diverged run scores the worst value
  (0, or an infinite perplexity). Mean ± standard deviation over the seeds that are in.
* The *target* is 99 % of ``sequential``'s mean final validation metric (101 % for perplexity),
  and a run's *updates to target* are those of its first evaluation on the validation split at or
  past it (``pipeoptim.time_to_target``). The *time to target* on N devices is those updates times
  the method's predicted seconds per mini-batch there; ``sequential``'s curve is also the
  synchronous pipelines' (gpipe and 1f1b-flush compute the same updates, a tested invariant), so
  the synchronous reference on N devices is its updates times the faster of the two.
* Verdicts compare means over seeds; a difference within the larger of the two standard deviations
  is a tie (with one seed there is no spread: any difference decides, and the report says how many
  seeds each comparison rests on).
* Two readings of the shortfalls (make_results2_findings.py, with the conclusions): per setting, Spearman's rank correlation across the asynchronous
  methods between the forward's weight error (the diagnostic, mean over stages) and how far each
  ends behind ``sequential``; and per cell, each method's gap to ``sequential`` at N = 8 beside
  N = 4 (less staleness, the same lr).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

BENCHMARKS = Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:  # the study's scripts sit beside this file, also when a test imports it
    sys.path.insert(0, str(BENCHMARKS))
import study2  # noqa: E402
from study2_times import seconds_per_batch as lookup_seconds  # noqa: E402
from make_results import fmt, mean_sd  # noqa: E402  (the first study's arithmetic, tested there)

from pipeoptim.time_to_target import target_from_reference, updates_to_target  # noqa: E402

SCALE = {"accuracy": 100.0}  #: accuracy in percent; perplexity as is
HEADLINE = ["pipeoptim", "pipeoptim+lr_correction"]
#: the level the issue asks sequential to reach on each task, for the comparison to be worth making:
#: (bar, how it reads); perplexity's bar is "well below the unigram's 470.1" (README), read as half of it
LEVELS = {"image": (0.90, "at or above 90 % test accuracy"), "sentiment": (0.72, "at or above 72 %"),
          "lm": (235.0, "well below the unigram's perplexity of 470.1 (here: at most half of it)")}
RIVALS = ["pipedream", "pipedream-2bw", "spectrain", "xpipe"]
SYNCHRONOUS_PIPELINES = ["gpipe", "1f1b-flush"]


# --------------------------------------------------------------------------------------------
# the arithmetic (tested in tests/test_make_results2.py)


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
        method = study2.variant_method(variant)[0]
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
    lr, status, why = study2.best_lr(suite, rows, task, optimizer, variant)
    if lr is None:
        return Method(variant, None, [], why)
    sweep_stages = max(suite["stages"])
    n = 1 if variant == "sequential" else stages
    found = []
    if variant == "sequential" or stages == sweep_stages:
        found.append(rows[study2.row_key(study2.sweep_run(suite, task, optimizer, variant, lr, "end").key_fields())])
    for seed in suite["seeds"]:
        key = study2.row_key(study2.Run("seeds", task, optimizer, variant, n, seed, lr).key_fields())
        if key in rows:
            found.append(rows[key])
    return Method(variant, lr, sorted(found, key=lambda r: r["seed"]))


def settings_of(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]],
                times: Optional[Dict[str, Any]]) -> List[Setting]:
    from pipeoptim.tasks import get_task

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
    for lr in study2.sweep_lrs(suite, task, optimizer):
        end = rows.get(study2.row_key(study2.sweep_run(suite, task, optimizer, variant, lr, "end").key_fields()))
        third = rows.get(study2.row_key(study2.sweep_run(suite, task, optimizer, variant, lr, "third").key_fields()))
        row, kind = (end, "end") if end else (third, "third") if third else (None, "missing")
        if row is not None and (row.get("diverged") or row.get("validation_metric") is None):
            kind = "diverged"
        out.append((lr, kind, row["validation_metric"] if kind in ("end", "third") else None))
    return out


# --------------------------------------------------------------------------------------------
# the report's parts


def value(x: Optional[float], scale: float, digits: int = 2) -> str:
    return "-" if x is None or x != x else f"{x * scale:.{digits}f}"


def digits_of(st: Setting) -> int:
    return 2 if st.metric == "accuracy" else 1


def seeds_text(n: int) -> str:
    return f"{n} seed{'s' if n != 1 else ''}"


def setting_table(st: Setting) -> List[str]:
    d, m = digits_of(st), st.metric
    target = st.target()
    lines = [f"| method | lr | seeds | final test {m} | final validation {m} | updates to target "
             f"(per seed) | s / mini-batch on {st.stages} devices | time to target (s) | "
             f"vs synchronous | weight copies (max) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    sync_time, _ = st.synchronous_time()
    for variant, method in st.methods.items():
        if not method.rows:
            lines.append(f"| {variant} | - | 0 | - | - | - | - | - | - | - |")
            continue
        final = fmt(st.final(variant), st.scale, d)
        if method.diverged:
            final += f" ({method.diverged} diverged)"
        validation = fmt(mean_sd([r["validation_metric"] for r in method.ok]), st.scale, d)
        updates = st.updates_to_target(variant) if target is not None else []
        per_seed = ", ".join("never" if u is None else f"{u:.0f}" for u in updates) or "-"
        seconds = st.seconds(variant)
        ttt = sync_time if variant == "sequential" else st.time_to_target(variant)
        ratio = "-"
        if variant == "sequential":
            ratio = "reference" if ttt else "-"
        elif ttt and sync_time:
            ratio = f"{sync_time[0] / ttt[0]:.2f}x sooner" if ttt[0] <= sync_time[0] else \
                f"{ttt[0] / sync_time[0]:.2f}x later"
        copies = "1" if variant == "sequential" else \
            (f"{max(method.ok[0]['weight_copies']):g}" if method.ok and method.ok[0].get("weight_copies") else "-")
        name = f"{variant} (as gpipe/1f1b-flush)" if variant == "sequential" else variant
        lines.append(f"| {name} | {method.lr:g} | {len(method.rows)} | {final} | {validation} | {per_seed} | "
                     f"{'-' if seconds is None else f'{seconds:.4f}'} | "
                     f"{'-' if ttt is None else fmt(ttt, 1.0, 1)} | {ratio} | {copies} |")
    return lines


def diagnostic_table(st: Setting) -> List[str]:
    errors = {v: stage_errors(m.rows) for v, m in st.methods.items() if v != "sequential" and m.rows}
    errors = {v: e for v, e in errors.items() if e}
    if not errors:
        return []
    stages = max(len(e) for e in errors.values())
    lines = ["The diagnostic per stage: the error of the weights each forward used (their distance from "
             "the weights live at its backward, relative to those), as a ratio to the *staleness error* "
             "(the same distance for the latest weights at the forward, what asynchronous 1F1B uses "
             "unpredicted), with the error itself in brackets; averaged over every probe, epoch and seed. "
             "Below 1: the forward's weights were closer to the backward's than the latest were (the "
             "prediction helps); 1.00: the latest weights (async-naive, pipedream); above 1: older than "
             "the latest (pipedream-2bw's weights lag by up to one more update; '-' where the latest "
             "were exact, as at its last stage):", "",
             "| method | " + " | ".join(f"stage {k}" for k in range(stages)) + " |",
             "|---|" + "---|" * stages]
    for variant, per_stage in errors.items():
        cells = {e["stage"]: ("-" if e["ratio"] != e["ratio"] else f"{e['ratio']:.2f}") + f" ({e['prediction']:.1e})"
                 for e in per_stage}
        lines.append(f"| {variant} | " + " | ".join(cells.get(k, "-") for k in range(stages)) + " |")
    return lines + [""]


def sweep_table(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]], task: str, optimizer: str,
                scale: float, digits: int) -> List[str]:
    lrs = study2.sweep_lrs(suite, task, optimizer)
    lines = ["| method | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | chosen |",
             "|---|" + "---|" * (len(lrs) + 1)]
    for variant in ["sequential", *suite["methods"]]:
        cells = []
        for _, kind, metric in sweep_points(suite, rows, task, optimizer, variant):
            cells.append({"end": value(metric, scale, digits), "third": f"({value(metric, scale, digits)})",
                          "diverged": "diverged", "missing": "·"}[kind])
        lr, _, _ = study2.best_lr(suite, rows, task, optimizer, variant)
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | {'-' if lr is None else f'{lr:g}'} |")
    return lines


def status_line(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]]) -> str:
    runs = study2.plan_runs(suite, rows)
    states: Dict[str, int] = defaultdict(int)
    for run in runs:
        states[run.status] += 1
    minutes = sum(r.get("seconds", 0) for r in rows.values()) / 60
    left = sum(run.minutes for run in runs if run.status in ("ready", "waiting"))
    return (f"{len(rows)} rows of {len(runs)} planned runs in ({states['done']} done, "
            f"{states['ready'] + states['waiting']} still to run, {states['dropped']} dropped because "
            f"every lr they depend on diverged); {minutes:.0f} core-minutes of training so far, about "
            f"{left:.0f} planned to go.")


def generate(study: Path, out: Path, suite_name: Optional[str] = None, plots: bool = True,
             name: Optional[str] = "results-equal-updates.md") -> str:
    """Write ``out/name`` (and ``out/results2/*.png`` with ``plots``) from the study folder;
    return the markdown (``name`` None: write the figures only; docs/results.md is this report
    below the equal-time one, written by make_results3.py)."""
    from make_results2_findings import (TRANSLATION, caveats, conclusions, confirmations, depth_lines,
                                        error_gap_lines, level_lines, recipe, throughput_section)
    from make_results2_plots import curves_plot, sensitivity_plot

    suite = study2.SUITES[suite_name or json.loads((study / "suite.json").read_text())["suite"]]
    rows = study2.load_rows(study / "runs.jsonl")
    times_file = study / "times.json"
    times = json.loads(times_file.read_text()) if times_file.exists() else None
    settings = settings_of(suite, rows, times)
    out.mkdir(parents=True, exist_ok=True)
    figures = out / "results2"
    if plots:
        figures.mkdir(parents=True, exist_ok=True)
    rel = study.resolve().relative_to(BENCHMARKS.parent) if study.resolve().is_relative_to(BENCHMARKS.parent) \
        else study
    lines = ["# Does an asynchronous pipeline reach the target sooner? Results of the second study", "",
             f"Generated by `benchmarks/make_results2.py` from `{rel}/runs.jsonl` and `{rel}/times.json` "
             f"(`benchmarks/study2.py`, plan and cuts in [study_plan.md](study_plan.md)). "
             + status_line(suite, rows), "",
             "The recipe, identical for every method: linear warm-up over the first 5 % of the updates, then "
             "cosine decay to 10 % of the peak learning rate; the peak learning rate tuned per method on a "
             "validation split held out of the training data (successive halving: 4 log-spaced peaks train "
             "the first third, the 2 best on validation train to the end, the best at the end is kept), then "
             "more seeds at it. Test metrics are measured once, at the end. Methods run on the local runtime "
             "(every stage in one process, one thread), which computes exactly what the distributed runtime "
             "computes; time on N devices is predicted by the schedule simulator from a profile of each "
             "model. The first study (a few hundred updates, no schedule, sequential's lr for everyone) is "
             "[results-v1.md](results-v1.md).", ""]
    lines += recipe(suite) + [""]
    lines += ["## Conclusions", ""]
    lines += conclusions(settings, suite)
    lines += error_gap_lines(settings, suite)
    lines += depth_lines(settings, suite)
    lines += throughput_section(settings, times)
    lines += confirmations(suite, rows, settings)
    lines += caveats(settings, suite, rows)
    lines += [TRANSLATION, ""]
    for task, optimizer in suite["cells"]:
        cell = [s for s in settings if (s.task, s.optimizer) == (task, optimizer)]
        st = cell[0]
        lines += [f"## {task}, {optimizer}", "",
                  f"Learning-rate sweep at N = {max(suite['stages'])} (validation {st.metric} at the end; in "
                  f"brackets: after the first third only, for the lrs the halving stopped; ·: not run yet):", ""]
        lines += sweep_table(suite, rows, task, optimizer, st.scale, digits_of(st)) + [""]
        # (the links do not depend on --no-plots: the markdown is the same either way)
        figure = sensitivity_plot(suite, rows, task, optimizer, st.metric, st.higher, st.scale,
                                  figures if plots else None)
        lines += [f"![sensitivity](results2/{figure})", ""]
        lines += level_lines(st) + [""]
        for st in cell:
            reference, target = st.reference(), st.target()
            level = "" if reference is None else \
                (f" sequential reaches a final validation {st.metric} of {value(reference, st.scale, digits_of(st))}"
                 f"; the target is {value(target, st.scale, digits_of(st))}.")
            lines += [f"### {st.name()}", "", f"Mean ± standard deviation over the seeds in.{level}", ""]
            lines += setting_table(st) + [""]
            lines += diagnostic_table(st)
            if any(m.ok for m in st.methods.values()):
                figure = curves_plot(st, figures if plots else None)
                lines += [f"![curves](results2/{figure})", ""]
    text = "\n".join(lines) + "\n"
    if name is not None:
        (out / name).write_text(text)
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", type=Path, default=study2.RESULTS / "study2",
                        help="the study folder: runs.jsonl, suite.json, times.json")
    parser.add_argument("--out", type=Path, default=BENCHMARKS.parent / "runs" / "report2",
                        help="where the report and results2/ go (default runs/report2; docs/results.md, this "
                             "report below the equal-time one, is benchmarks/make_results3.py's)")
    parser.add_argument("--name", default="results-equal-updates.md", help="the markdown's file name")
    parser.add_argument("--suite", choices=list(study2.SUITES),
                        help="the suite the rows belong to (default: the study folder's suite.json)")
    parser.add_argument("--no-plots", action="store_true", help="write the markdown only")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    text = generate(args.study, args.out, args.suite, plots=not args.no_plots, name=args.name)
    print(f"written: {args.out / args.name} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
