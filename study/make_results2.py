"""The second study's report (issue 16: which pipeline reaches the target first, trained with the
recipe people use, every method given sequential's updates), and its figures (``results2/``). No
number is typed by hand. ``docs/results.md`` carries it below the equal-time report
(``python -m study.make_results3`` writes both; this module has no command of its own).

Reads the study's rows (``runs.jsonl``, written by the second study's runner, benchmarks/study2.py,
whose last version is in commit 6bb0f1e; its plan is study2_plan.py) and the predicted time per
mini-batch of each method on N devices (``times.json``, ``study/study2_times.py``). Its data
per setting is make_results2_data.py's.

How the numbers are made:

* A method's *setting* is (task, optimizer, N). Its learning rate is the one the sweep chose on the
  validation split (``study2_plan.best_lr``); its runs are the sweep's run at that lr (seed 0, N = 8)
  and the seeds' runs. ``sequential`` has no stages: the same runs are its row at every N.
* The *final metric* is the test split's, once at the end; a diverged run scores the worst value
  (0, or an infinite perplexity). Mean ± standard deviation over the seeds that are in.
* The *target* is 99 % of ``sequential``'s mean final validation metric (101 % for perplexity),
  and a run's *updates to target* are those of its first evaluation on the validation split at or
  past it (``pipeoptim.lab.time_to_target``). The *time to target* on N devices is those updates times
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

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional

from study import study2_plan
from study.common import ROOT, fmt, mean_sd
# (the data, re-exported: the tests read it from here)
from study.make_results2_data import (HEADLINE, LEVELS, RIVALS, SCALE, SYNCHRONOUS_PIPELINES,  # noqa: F401
                                           Method, Setting, digits_of, final_score, method_rows,
                                           run_updates_to_target, seconds_per_batch, seeds_text, settings_of,
                                           stage_errors, sweep_points, value)
from study.make_results2_findings import (TRANSLATION, caveats, conclusions, confirmations, depth_lines,
                                               error_gap_lines, level_lines, throughput_section)
from study.make_results2_plots import curves_plot, sensitivity_plot


# --------------------------------------------------------------------------------------------
# the report's parts


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
    lrs = study2_plan.sweep_lrs(suite, task, optimizer)
    lines = ["| method | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | chosen |",
             "|---|" + "---|" * (len(lrs) + 1)]
    for variant in ["sequential", *suite["methods"]]:
        cells = []
        for _, kind, metric in sweep_points(suite, rows, task, optimizer, variant):
            cells.append({"end": value(metric, scale, digits), "third": f"({value(metric, scale, digits)})",
                          "diverged": "diverged", "missing": "·"}[kind])
        lr, _, _ = study2_plan.best_lr(suite, rows, task, optimizer, variant)
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | {'-' if lr is None else f'{lr:g}'} |")
    return lines


def status_line(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]]) -> str:
    runs = study2_plan.plan_runs(suite, rows)
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
    """The recipe table: per task, its model, batch, epochs, updates, split, evaluations, clipping
    and the lrs swept."""
    lines = ["| task | model | batch | epochs | updates | validation split | evaluated every | clipping | "
             "optimizers | peak lrs swept |", "|---|---|---|---|---|---|---|---|---|---|"]
    for task, spec in suite["tasks"].items():
        optimizers = [o for t, o in suite["cells"] if t == task]
        n = study2_plan.batches_per_epoch(spec) * spec["epochs"]
        lrs = "; ".join(f"{o}: " + ", ".join(f"{lr:g}" for lr in study2_plan.sweep_lrs(suite, task, o))
                        for o in optimizers)
        lines.append(f"| {task} | {spec['model']} | {spec['batch_size']} | {spec['epochs']} | {n} | "
                     f"{spec['holdout']} | {spec['eval_every']} | {spec['clip_grad'] or 'none'} | "
                     f"{', '.join(optimizers)} | {lrs} |")
    return lines


def generate(study: Path, out: Path, suite_name: Optional[str] = None, plots: bool = True,
             name: Optional[str] = "results-equal-updates.md") -> str:
    """Write ``out/name`` (and ``out/results2/*.png`` with ``plots``) from the study folder;
    return the markdown (``name`` None: write the figures only; docs/results.md is this report
    below the equal-time one, written by make_results3.py)."""
    suite = study2_plan.SUITES[suite_name or json.loads((study / "suite.json").read_text())["suite"]]
    rows = study2_plan.load_rows(study / "runs.jsonl")
    times_file = study / "times.json"
    times = json.loads(times_file.read_text()) if times_file.exists() else None
    settings = settings_of(suite, rows, times)
    out.mkdir(parents=True, exist_ok=True)
    figures = out / "results2"
    if plots:
        figures.mkdir(parents=True, exist_ok=True)
    rel = study.resolve().relative_to(ROOT) if study.resolve().is_relative_to(ROOT) \
        else study
    lines = ["# Does an asynchronous pipeline reach the target sooner? Results of the second study", "",
             f"Generated by `study/make_results2.py` from `{rel}/runs.jsonl` and `{rel}/times.json` "
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
