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
* Two readings of the shortfalls: per setting, Spearman's rank correlation across the asynchronous
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

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:  # the study's scripts sit beside this file, also when a test imports it
    sys.path.insert(0, str(BENCHMARKS))
import study2  # noqa: E402
from study2_times import seconds_per_batch as lookup_seconds  # noqa: E402
from make_results import fmt, mean_sd, verdict  # noqa: E402  (the first study's arithmetic, tested there)

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


def sensitivity_plot(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]], task: str, optimizer: str,
                     metric: str, higher: bool, scale: float, folder: Optional[Path]) -> str:
    """Final validation metric against the peak lr, a curve per method; the file's name (written
    into ``folder``; None: only the name)."""
    name = f"sensitivity-{task}-{optimizer}.png"
    if folder is None:
        return name
    fig, ax = plt.subplots(figsize=(7, 4.2))
    diverged: List[Tuple[float, str]] = []
    for i, variant in enumerate(["sequential", *suite["methods"]]):
        points = sweep_points(suite, rows, task, optimizer, variant)
        color = "black" if variant == "sequential" else f"C{i}"
        xs = [lr for lr, kind, _ in points if kind in ("end", "third")]
        ys = [m * scale for _, kind, m in points if kind in ("end", "third")]
        ax.plot(xs, ys, color=color, linewidth=1.2, label=variant)
        for lr, kind, m in points:
            if kind == "end":
                ax.plot([lr], [m * scale], "o", color=color, markersize=4)
            elif kind == "third":
                ax.plot([lr], [m * scale], "o", color=color, markersize=4, markerfacecolor="white")
            elif kind == "diverged":
                diverged.append((lr, color))
    # zoomed on the good end (a near-chance first third would flatten every other curve; the sweep
    # table has every value), then the diverged lrs at the worst end: the bottom for accuracy, the top
    # for perplexity
    values = [m * scale for v in ["sequential", *suite["methods"]]
              for _, kind, m in sweep_points(suite, rows, task, optimizer, v) if kind in ("end", "third")]
    if values:
        best = max(values) if higher else min(values)
        low, high = (max(min(values), 0.85 * best), best + 0.02 * abs(best)) if higher else \
            (0.95 * best, min(max(values), 1.6 * best))
        ax.set_ylim(low, high)
    worst = ax.get_ylim()[0 if higher else 1]
    for lr, color in diverged:
        ax.plot([lr], [worst], "x", color=color, markersize=7)
    lrs = study2.sweep_lrs(suite, task, optimizer)
    ax.set_xscale("log")
    ax.set_xlim(min(lrs) / 1.3, max(lrs) * 1.3)  # (also when no point is in yet)
    ax.set(xlabel="peak learning rate", ylabel=f"validation {metric}",
           title=f"{task}, {optimizer}, N={max(suite['stages'])}: filled = whole run, hollow = first third, "
                 f"x = diverged; values far from the best off the axis (the table has them)")
    ax.title.set_fontsize(8)
    if ax.get_legend_handles_labels()[0]:  # (a panel may have no curve yet)
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(folder / name, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return name


def curves_plot(st: Setting, folder: Optional[Path]) -> str:
    """The validation metric against updates and against predicted time on N devices, a curve
    per method (its first seed); the file's name (written into ``folder``; None: only the name)."""
    name = f"curves-{st.task}-{st.optimizer}-N{st.stages}.png"
    if folder is None:
        return name
    fig, (by_updates, by_time) = plt.subplots(1, 2, figsize=(12, 4.2))
    target = st.target()
    for i, (variant, method) in enumerate(st.methods.items()):
        if not method.ok:
            continue
        run = method.ok[0]  # the first seed that did not diverge
        color = "black" if variant == "sequential" else f"C{i}"
        updates = [e["updates"] for e in run["evaluations"]]
        metrics = [e["metric"] * st.scale for e in run["evaluations"]]
        by_updates.plot(updates, metrics, color=color, linewidth=1.2, label=variant)
        seconds = st.seconds(variant)
        if seconds is not None:
            label = "sequential, as gpipe/1f1b-flush" if variant == "sequential" else variant
            by_time.plot([u * seconds for u in updates], metrics, color=color, linewidth=1.2, label=label)
    for ax, xlabel in ((by_updates, "updates"), (by_time, f"predicted seconds on {st.stages} devices")):
        if target is not None:
            ax.axhline(target * st.scale, color="grey", linestyle="--", linewidth=0.8)
        ax.set(xlabel=xlabel, ylabel=f"validation {st.metric}")
        if not st.higher:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # (a panel may have no curve yet)
            ax.legend(fontsize=7)
    by_updates.set_title(f"{st.name()}: first seed of each method; dashed: the target", fontsize=9)
    fig.tight_layout()
    fig.savefig(folder / name, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return name


def holds(tally: Dict[str, int]) -> str:
    """A claim over settings: holds when won or tied in at least three quarters, does not hold
    when lost in half or more, else holds in part (the first study's rule)."""
    total = sum(tally.values())
    if not total:
        return "untested (no setting has both methods' runs yet)"
    if tally.get("loses", 0) * 2 >= total:
        return "does not hold"
    return "holds" if (tally.get("wins", 0) + tally.get("ties", 0)) * 4 >= 3 * total else "holds in part"


def count(tally: Dict[str, int]) -> str:
    return f"{tally.get('wins', 0)} wins, {tally.get('ties', 0)} ties, {tally.get('loses', 0)} losses"


def diagnosis(st: Setting, variant: str) -> str:
    """What the diagnostic says of a method's shortfall in a setting."""
    errors = stage_errors(st.methods[variant].rows)
    if not errors:
        return "no diagnostic (every seed diverged)" if st.methods[variant].rows else "no runs"
    worst = max(errors, key=lambda e: e["prediction"])
    ratios = ", ".join("-" if e["ratio"] != e["ratio"] else f"{e['ratio']:.2f}" for e in errors)
    known = [e for e in errors if e["ratio"] == e["ratio"]]
    if all(abs(e["ratio"] - 1) < 1e-9 for e in known):
        reading = "no prediction: the error is the staleness itself"
    elif all(e["ratio"] < 1 for e in known):
        least = max(known, key=lambda e: e["ratio"])
        reading = (f"the prediction removes {1 - least['ratio']:.0%}-{1 - min(e['ratio'] for e in known):.0%} "
                   f"of the staleness error, least at stage {least['stage']}")
    else:
        worse = [str(e["stage"]) for e in errors if not e["ratio"] < 1]
        reading = f"the forward's weights are no closer than the latest at stage(s) {', '.join(worse)}"
    return (f"{reading}; the forward's weights are farthest from the backward's at stage {worst['stage']} "
            f"({worst['prediction']:.1e}); their error over the staleness error by stage: {ratios}")


def conclusions(settings: Sequence[Setting], suite: Dict[str, Any]) -> List[str]:
    """The paper's claims and the issue's question, each as per-setting verdicts."""
    claim1: Dict[str, List[str]] = {v: [] for v in HEADLINE}
    tally1: Dict[str, Dict[str, int]] = {v: defaultdict(int) for v in HEADLINE}
    claim2: List[str] = []
    tally2: Dict[str, Dict[str, int]] = {r: defaultdict(int) for r in RIVALS}
    sooner: List[str] = []
    tally_sooner: Dict[str, Dict[str, int]] = defaultdict(lambda: defaultdict(int))
    shortfalls: List[str] = []
    for st in settings:
        if not st.methods["sequential"].rows:
            continue
        seq = st.final("sequential")
        d = digits_of(st)
        for variant in HEADLINE:
            if variant not in st.methods or not st.methods[variant].rows:
                continue
            word, diff, spread = verdict(st.final(variant), seq, st.higher)
            tally1[variant][word] += 1
            claim1[variant].append(f"  - {st.name()}: {word} ({value(st.final(variant)[0], st.scale, d)} against "
                                   f"{value(seq[0], st.scale, d)}, {diff * st.scale:+.{d}f} at a spread of "
                                   f"{spread * st.scale:.{d}f}; {seeds_text(st.seeds(variant))} against "
                                   f"{st.seeds('sequential')})")
        if "pipeoptim" in st.methods and st.methods["pipeoptim"].rows:
            parts = []
            for rival in RIVALS:
                if rival in st.methods and st.methods[rival].rows:
                    word, diff, _ = verdict(st.final("pipeoptim"), st.final(rival), st.higher)
                    tally2[rival][word] += 1
                    parts.append(f"{rival} {word} ({diff * st.scale:+.{d}f})")
            if parts:
                claim2.append(f"  - {st.name()}: " + ", ".join(parts))
        sync, sync_note = st.synchronous_time()
        line = []
        for variant in suite["methods"]:
            method = st.methods[variant]
            if not method.rows:
                continue
            ttt = st.time_to_target(variant)
            updates = st.updates_to_target(variant)
            if ttt is None and updates and any(u is None for u in updates):
                word = "never"
                reached = sum(u is not None for u in updates)
                line.append(f"{variant} does not reach it ({reached} of {seeds_text(len(updates))})")
            elif ttt is None or sync is None:
                continue
            else:
                word, _, _ = verdict(ttt, sync, higher=False)  # less time is better
                word = {"wins": "sooner", "ties": "ties", "loses": "later"}[word]
                line.append(f"{variant} {word} ({sync[0] / ttt[0]:.2f}x)")
            tally_sooner[variant][word] += 1
            behind, _, spread = verdict(st.final(variant), seq, st.higher)
            if word == "never" or behind == "loses":
                why = "does not reach the target" if word == "never" else \
                    f"falls behind sequential by {abs(st.final(variant)[0] - seq[0]) * st.scale:.{d}f} " \
                    f"(spread {spread * st.scale:.{d}f})"
                if word == "never" and behind == "loses":
                    why += f" and ends {abs(st.final(variant)[0] - seq[0]) * st.scale:.{d}f} behind"
                shortfalls.append(f"  - {st.name()}, {variant}: {why}; {diagnosis(st, variant)}")
        if line and sync is not None:
            sooner.append(f"  - {st.name()} (synchronous pipeline: {fmt(sync, 1.0, 1)} s{sync_note}): "
                          + "; ".join(line))
    out = ["**The question: does an asynchronous pipeline reach the target sooner?** Per setting, each "
           "method's predicted time to first reach the target on N devices against the synchronous "
           "pipeline's (sequential's updates at the faster of gpipe and 1f1b-flush), with the ratio "
           "synchronous time / method time (above 1: sooner):", ""]
    out += sooner or ["  - no setting has both sequential's runs and a time per mini-batch yet"]
    out += ["", "In short: " + "; ".join(
        f"{v}: {t.get('sooner', 0)} sooner, {t.get('ties', 0)} ties, {t.get('later', 0)} later, "
        f"{t.get('never', 0)} never" for v, t in tally_sooner.items()) + ".", ""]
    out += ["**Claim 1: PipeOptim trains as well as synchronous training** (final test metric against "
            "`sequential`, each at its own best learning rate):", ""]
    for variant in HEADLINE:
        out += [f"`{variant}`: {holds(tally1[variant])} ({count(tally1[variant])})", ""] + claim1[variant] + [""]
    out += ["**Claim 2: PipeOptim trains better than PipeDream, PipeDream-2BW, SpecTrain and XPipe** "
            "(PipeOptim's verdict and lead per setting): "
            + "; ".join(f"against {r}: {holds(tally2[r])} ({count(tally2[r])})" for r in RIVALS), ""]
    out += claim2 + [""]
    out += ["**Where an asynchronous method does not reach the target or falls behind `sequential` beyond "
            "the seed spread**, and what the diagnostic says:", ""]
    out += shortfalls or ["  - none"]
    return out + [""]


def depth_lines(settings: Sequence[Setting], suite: Dict[str, Any]) -> List[str]:
    """Does a shallower pipeline (less staleness: a delay of up to N - 1 updates at the first
    stage) bring each asynchronous method closer to sequential? Its final test metric minus
    sequential's, per cell and N, at the lr its sweep chose."""
    depths = sorted(suite["stages"], reverse=True)
    if len(depths) < 2:
        return []
    deep, shallow = depths[0], depths[-1]
    by_key = {(s.task, s.optimizer, s.stages): s for s in settings}
    rows, better, compared = [], 0, 0
    for task, optimizer in suite["cells"]:
        cell = [by_key.get((task, optimizer, n)) for n in depths]
        if any(st is None or not st.methods["sequential"].rows for st in cell):
            continue
        for variant in suite["methods"]:
            gaps = []
            for st in cell:
                if st.methods[variant].rows:
                    mean = st.final(variant)[0] - st.final("sequential")[0]
                    gaps.append((mean, st.seeds(variant), st))
                else:
                    gaps.append(None)
            if all(g is None for g in gaps):
                continue
            cells = ["-" if g is None else f"{g[0] * g[2].scale:+.{digits_of(g[2])}f} ({seeds_text(g[1])})"
                     for g in gaps]
            if gaps[0] is not None and gaps[-1] is not None:
                compared += 1
                better += (gaps[-1][0] - gaps[0][0]) * (1 if cell[0].higher else -1) > 0
            rows.append(f"| {task}, {optimizer} | {variant} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    metric_note = "percentage points of accuracy, negative: behind; perplexity, positive: behind"
    return [f"**Does a shallower pipeline close the gap?** Each asynchronous method's final test metric minus "
            f"sequential's ({metric_note}), at N = " + ", ".join(str(n) for n in depths)
            + f"; at N = {shallow} the first stage of an asynchronous 1F1B pipeline runs its forward up to "
            f"{shallow - 1} updates before its backward instead of {deep - 1} (pipedream-2bw: one update at any "
            f"N). Every N uses the lr the N = {deep} sweep chose. Of {compared} (method, "
            f"cell) pairs with runs at both, {better} end closer to sequential (or further ahead) at "
            f"N = {shallow}.", "",
            "| cell | method | " + " | ".join(f"N = {n}" for n in depths) + " |",
            "|---|---|" + "---|" * len(depths)] + rows + [""]


def ranks(values: Sequence[float]) -> List[float]:
    """1-based ranks, ties sharing their mean rank (as Spearman's correlation wants them)."""
    # statistics.correlation(method="ranked") does this from Python 3.12; the project supports 3.10
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (nan when either side is constant)."""
    try:
        return statistics.correlation(ranks(a), ranks(b))
    except statistics.StatisticsError:
        return math.nan


def error_gap_lines(settings: Sequence[Setting], suite: Dict[str, Any]) -> List[str]:
    """Does the diagnostic explain the gaps? Per setting, across the asynchronous methods, the rank
    correlation between the forward's weight error (mean over the stages) and how far the method
    ends behind sequential."""
    lines = []
    for st in settings:
        if not st.methods["sequential"].rows:
            continue
        seq = st.final("sequential")[0]
        points = []
        for variant in suite["methods"]:
            errors = stage_errors(st.methods[variant].rows)
            final = st.final(variant)[0]
            if errors and math.isfinite(final):
                behind = (seq - final) * (1 if st.higher else -1)
                points.append((variant, statistics.mean(e["prediction"] for e in errors), behind))
        if len(points) < 3:
            continue
        rho = spearman([p[1] for p in points], [p[2] for p in points])
        d = digits_of(st)
        low, high = min(points, key=lambda p: p[1]), max(points, key=lambda p: p[1])
        lines.append(f"  - {st.name()}: {rho:+.2f} over {len(points)} methods (smallest error: {low[0]}, "
                     f"{low[1]:.1e}, {low[2] * st.scale:.{d}f} behind; largest: {high[0]}, {high[1]:.1e}, "
                     f"{high[2] * st.scale:.{d}f} behind)")
    if not lines:
        return []
    return ["**Does the diagnostic explain the gaps?** Per setting, across the asynchronous methods, Spearman's "
            "rank correlation between the forward's weight error (its distance from the weights live at the "
            "backward, relative to those, averaged over the stages, probes and seeds) and how far the "
            "method's final test metric ends behind sequential's (+1: the larger the error, the further "
            "behind). Each method runs at its own lr, and the error grows with the lr, so this compares "
            "methods as tuned, not at equal step sizes:", ""] + lines + [""]


def throughput_section(settings: Sequence[Setting], times: Optional[Dict[str, Any]]) -> List[str]:
    """Claim 3 (1F1B's throughput with 2 weight copies), the predicted times and the N = 2 check."""
    out = ["**Claim 3: PipeOptim runs at asynchronous 1F1B's throughput with at most 2 weight copies.** ", ""]
    if times is None:
        return out + ["No time per mini-batch is in yet (`benchmarks/study2_times.py`).", ""]
    most_copies: List[float] = []
    ratios: List[float] = []
    for st in settings:
        po, naive = st.seconds("pipeoptim"), st.seconds("async-naive")
        flush = seconds_per_batch(times, st.task, st.optimizer, st.stages, "1f1b-flush")
        gpipe = seconds_per_batch(times, st.task, st.optimizer, st.stages, "gpipe")
        seq1 = seconds_per_batch(times, st.task, st.optimizer, 1, "sequential")
        if None in (po, naive, flush, gpipe):
            continue
        copies = [c for v in ("pipeoptim",) if v in st.methods
                  for r in st.methods[v].ok for c in r.get("weight_copies") or []]
        pd_copies = [c for v in ("pipedream",) if v in st.methods
                     for r in st.methods[v].ok for c in r.get("weight_copies") or []]
        most_copies += copies
        ratios.append(naive / po)
        out.append(f"  - {st.name()}: predicted {po * 1000:.1f} ms per mini-batch: {naive / po:.2f}x "
                   f"async-naive's throughput, {flush / po:.2f}x 1f1b-flush's, {gpipe / po:.2f}x gpipe's"
                   + (f", {seq1 / po:.2f}x one device's" if seq1 else "")
                   + (f"; at most {max(copies):g} weight copies per stage (pipedream: up to {max(pd_copies):g})"
                      if copies and pd_copies else ""))
    if ratios:
        verdict_word = "holds" if min(ratios) >= 0.95 and (not most_copies or max(most_copies) <= 2) else "does not hold"
        out += ["", f"Verdict: {verdict_word} (predicted {min(ratios):.2f}-{max(ratios):.2f}x async-naive's "
                    f"throughput; at most {max(most_copies) if most_copies else float('nan'):g} weight copies "
                    f"per stage in the runs)."]
    measured = [entry["methods"]["pipeoptim"]["measured_seconds_per_batch"]
                / entry["methods"]["async-naive"]["measured_seconds_per_batch"]
                for per_optimizer in (times.get("check_n2") or {}).get("cells", {}).values()
                for entry in per_optimizer.values()]
    out += ["", "The simulator does not charge the prediction's own cost (the same time for every "
            "asynchronous 1F1B method)"
            + (f"; measured on the distributed runtime at N = 2 (below), PipeOptim takes "
               f"{min(measured):.2f}-{max(measured):.2f}x async-naive's time per mini-batch." if measured else "."),
            ""]
    check = times.get("check_n2")
    if check:
        out += check_lines(check)
    return out


def check_lines(check: Dict[str, Any]) -> List[str]:
    """The simulator against the distributed runtime at N = 2 (times.json's check_n2 section,
    ``benchmarks/study2_times.py --check-n2``)."""
    lines = ["**The simulator against the distributed runtime at N = 2** (`benchmarks/study2_times.py "
             "--check-n2`: `pipeoptim bench`, one process per stage on this machine's 2 cores, against the "
             "simulator's prediction for the same mini-batches from the same kind of profile; "
             "sequential: one process, one thread):", "",
             "| task | optimizer | method | predicted ms / mini-batch | measured | measured / predicted |",
             "|---|---|---|---|---|---|"]
    ratios, loads, speedups = [], [], []
    for task, per_optimizer in sorted(check.get("cells", {}).items()):
        for optimizer, entry in sorted(per_optimizer.items()):
            loads += [entry["load_average"]["start"][0], entry["load_average"]["end"][0]]
            speedups.append((task, optimizer, *(
                min(entry["methods"][m][key] for m in SYNCHRONOUS_PIPELINES) / entry["methods"]["pipeoptim"][key]
                for key in ("seconds_per_batch", "measured_seconds_per_batch"))))
            for method, row in entry["methods"].items():
                ratio = row.get("measured_over_predicted")
                if ratio is not None and method != "sequential":
                    ratios.append(ratio)
                measured = row.get("measured_seconds_per_batch")
                lines.append(f"| {task} | {optimizer} | {method} | {row['seconds_per_batch'] * 1000:.2f} | "
                             f"{'-' if measured is None else f'{measured * 1000:.2f}'} | "
                             f"{'-' if ratio is None else f'{ratio:.2f}'} |")
    if ratios:
        lines += ["", f"On 2 devices the distributed runtime takes {min(ratios):.2f}-{max(ratios):.2f}x the "
                      f"predicted time per mini-batch (transfers, which the prediction counts as free, are in "
                      f"the measurement; 1-minute load average {min(loads):.1f}-{max(loads):.1f} while "
                      f"measuring). What the time to target turns on is the asynchronous pipeline's speed-up "
                      f"over the faster synchronous one: "
                      + "; ".join(f"{t} {o}: predicted {p:.2f}x, measured {m:.2f}x" for t, o, p, m in speedups)
                      + ". The times to target use the predictions as they are: where the measurement's "
                        "speed-up is smaller, a 'sooner' ratio overstates the asynchronous methods' lead by "
                        "as much."]
    return lines + [""]


def confirmations(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]], settings: Sequence[Setting]) -> List[str]:
    """gpipe and 1f1b-flush against sequential at its lr and seed 0 (equal by construction)."""
    out = []
    confirm = suite["confirm"]
    for task in dict.fromkeys(t for t, o in suite["cells"] if o == confirm["optimizer"]):
        st = next(s for s in settings if (s.task, s.optimizer) == (task, confirm["optimizer"]))
        seq = st.methods["sequential"]
        if not seq.rows:
            continue
        base = seq.rows[0]
        for variant in confirm["methods"]:
            row = rows.get(study2.row_key(study2.Run("confirm", task, confirm["optimizer"], variant,
                                                     max(suite["stages"]), 0, seq.lr).key_fields()))
            if row is None:
                continue
            if row.get("diverged"):
                out.append(f"  - {task}, {variant}: diverged ({row['diverged']})")
                continue
            spread = mean_sd([final_score(r, st.higher) for r in seq.rows])[1]
            out.append(f"  - {task}, {variant} (N = {row['stages']}, {row.get('microbatches')} micro-batches): "
                       f"final test {st.metric} {value(row['final_metric'], st.scale, 4)} against sequential's "
                       f"{value(base['final_metric'], st.scale, 4)}"
                       + (f" (sequential's standard deviation over {len(seq.rows)} seeds: "
                          f"{value(spread, st.scale, 2)})" if len(seq.rows) > 1 else "")
                       + f"; final training loss {row['final_loss']:.6f} against {base['final_loss']:.6f} "
                       f"(difference {row['final_loss'] - base['final_loss']:+.1e})")
    if not out:
        return []
    return ["**gpipe and 1f1b-flush against sequential** (one confirmation run each, at sequential's best "
            "lr, seed 0). They compute sequential's updates, equal within 1e-6 in the test suite's short "
            "runs; over thousands of updates two things separate them: the gradient of a mini-batch is "
            "summed over micro-batches in another order (rounding, which training amplifies, as any "
            "change of seed does), and a model with dropout (the LSTM, the GPT; not the VGG) draws its "
            "masks per micro-batch, in the order the runtime runs the stages' forwards, which differs between "
            "the two schedules. So the two pipelines equal each other on the VGG, not with dropout; "
            "against sequential, read the difference beside sequential's own seed spread:", ""] + out + [""]


def level_lines(st: Setting) -> List[str]:
    """Whether sequential reached the level the issue asks of the task."""
    seq = st.methods["sequential"]
    if not seq.rows or st.task not in LEVELS:
        return ["`sequential`'s level: not in yet."]
    bar, reads = LEVELS[st.task]
    mean, _ = st.final("sequential")
    met = mean >= bar if st.higher else mean <= bar
    return [f"`sequential`'s level: a final test {st.metric} of {value(mean, st.scale, digits_of(st))} "
            f"({seeds_text(len(seq.rows))}); the issue asks for {reads}: {'met' if met else 'not met'}."]


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


def recipe(suite: Dict[str, Any]) -> List[str]:
    lines = ["| task | model | batch | epochs | updates | validation split | evaluated every | clipping | "
             "optimizers | peak lrs swept |", "|---|---|---|---|---|---|---|---|---|---|"]
    for task, spec in suite["tasks"].items():
        optimizers = [o for t, o in suite["cells"] if t == task]
        n = study2.batches_per_epoch(spec) * spec["epochs"]
        lrs = "; ".join(f"{o}: " + ", ".join(f"{lr:g}" for lr in study2.sweep_lrs(suite, task, o))
                        for o in optimizers)
        lines.append(f"| {task} | {spec['model']} | {spec['batch_size']} | {spec['epochs']} | {n} | "
                     f"{spec['holdout']} | {spec['eval_every']} | {spec['clip_grad'] or 'none'} | "
                     f"{', '.join(optimizers)} | {lrs} |")
    return lines


def caveats(settings: Sequence[Setting], suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]]) -> List[str]:
    """What the data allow and what they do not, counted from the rows."""
    seeds_in: Dict[int, int] = defaultdict(int)  # settings by the fewest seeds any of their methods has
    for st in settings:
        counts = [len(m.rows) for m in st.methods.values() if m.rows]
        if counts:
            seeds_in[min(counts)] += 1
    diverged: Dict[str, List[int]] = defaultdict(lambda: [0, 0])
    for row in rows.values():
        diverged[row["variant"]][1] += 1
        diverged[row["variant"]][0] += bool(row.get("diverged"))
    clipped = [t for t, spec in suite["tasks"].items() if spec["clip_grad"]]
    n_small = min(suite["stages"])
    out = ["**Caveats the data show.**", ""]
    out.append("  - Seeds: " + (", ".join(f"{n} setting{'s' if n != 1 else ''} rest on {k} seed{'s' if k != 1 else ''}"
                                         for k, n in sorted(seeds_in.items())) or "no setting has runs yet")
               + f" (the plan has {len(suite['seeds'])}); with one seed there is no spread, and a tie can only "
                 "be an exact equality, so those verdicts are weaker than they read.")
    out.append(f"  - N = {n_small} runs each method at the lr its N = {max(suite['stages'])} sweep chose: a "
               "method whose best lr grows with less staleness is under-tuned there (sequential is not), "
               f"so the N = {n_small} results are a lower bound for the asynchronous methods.")
    out.append("  - The halving stops 2 of the 4 lrs after a third of the run: the sensitivity plots' hollow "
               "points are one-third values, and an lr that would have overtaken after a third is missed.")
    out.append("  - Runs that diverged (loss NaN or infinite), of the rows in, per method: "
               + ", ".join(f"{v} {d}/{n}" for v, (d, n) in sorted(diverged.items())) + ".")
    if clipped:
        out.append(f"  - Clipping ({', '.join(clipped)}): synchronous methods clip by the whole model's norm, "
                   "as sequential does; an asynchronous stage never holds one mini-batch's whole gradient, "
                   "so it clips by its own norm, a looser clip in total.")
    out.append("  - Time to target is updates times a predicted time per mini-batch: the simulator from "
               "a profile of the model on this machine's CPU, for N devices as fast as that CPU and free "
               "transfers; the prediction's own cost is not charged (the N = 2 check "
               "measures it, with the simulator's error). The target is seen only at evaluations, so updates to "
               "target are upper bounds, coarse by one evaluation interval.")
    out.append("  - The models are small enough for 2 CPU cores (an 8-block VGG, an 8-block LSTM, a GPT with "
               "d 64 and 8 layers); the asynchronous methods' staleness is set by N, not by the model, "
               "but larger models and longer runs may change how much it costs.")
    out.append("  - `pipeoptim+lr_correction` is the correction the first look (issue 15, "
               "`benchmarks/results/first_look.md`, one seed, final test metric) found to be the only one "
               "that helped; the study's validation sweeps compare it with plain `pipeoptim` in every cell. "
               + correction_text(suite, rows))
    return out + [""]


def correction_text(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]]) -> str:
    """The correction choice on the validation split (study2's ``correction`` phase), per cell."""
    corrections = suite.get("corrections")
    if not corrections:
        return "No other correction entered the study."
    names = {v: v.replace(corrections["base"] + "+", "+") for v in corrections["candidates"]}
    head = (f"Whether another correction beside it would do better was checked on the validation split at "
            f"N = {max(suite['stages'])}, seed 0 and its best lr (whole runs): the delay-scaled lr alone against "
            f"it with {' and with '.join(f'`{n}`' for n in names.values())}")
    cells = []
    for task, optimizer in suite["cells"]:
        choice = study2.correction_choice(suite, rows, task, optimizer)
        if choice is None:
            cells.append(f"{task} x {optimizer}: not run yet")
            continue
        scores = ", ".join(f"{names.get(v, 'alone')} {'diverged' if x is None else f'{x:.4g}'}"
                           for v, x in choice["scores"].items())
        verdict = ("the delay-scaled lr alone stays best" if choice["chosen"] == corrections["base"] else
                   f"`{names[choice['chosen']]}` would be better" if choice["chosen"] else "all diverged")
        cells.append(f"{task} x {optimizer} ({choice['metric']}: {scores}): {verdict}")
    return head + ". " + "; ".join(cells) + "."


TRANSLATION = ("**Translation was left out.** In the first study (`docs/results-v1.md`) `sequential` reached "
               "BLEU 2.55 with Adam (mean of 3 seeds, at the end of its runs); the issue asks for BLEU 8 within the budget before the "
               "task enters the study, and the study's whole budget (8 hours of the 2 cores, shared by every "
               "method, seed and learning rate) is far below what a transformer needs on the verse pairs to "
               "get there, so its runs would compare methods that have not learned to translate.")


def generate(study: Path, out: Path, suite_name: Optional[str] = None, plots: bool = True,
             name: Optional[str] = "results-equal-updates.md") -> str:
    """Write ``out/name`` (and ``out/results2/*.png`` with ``plots``) from the study folder;
    return the markdown (``name`` None: write the figures only; docs/results.md is this report
    below the equal-time one, written by make_results3.py)."""
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
