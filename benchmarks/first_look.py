"""A first look at the delay corrections at N = 8 (issue 15): not the study, one seed, one lr.

For each (task, optimizer) of image (vgg, the full 60,000 images, 2 epochs) and lm (gpt, a fixed
number of updates), with a linear warm-up over 5% of the updates and cosine decay to 10% (the
recipe of ``pipeoptim.lr_schedules``, identical for every run):

* ``sequential`` (the target), ``pipeoptim`` (the paper's method), and ``pipeoptim`` with each
  correction alone: ``lr_correction=delay`` (T: 30% of the updates), ``horizon=scheduled``,
  ``delta=ema`` (decay 0.9), ``prediction_warmup`` and ``sync_warmup`` (both over the lr
  warm-up's updates);
* then the best pair: the two single corrections with the best final metric, together.

Each finished run is one line of ``benchmarks/results/first_look.jsonl`` (final and best metric,
per-stage prediction/staleness error ratios with and without the corrections, seconds); a
second call skips what is done, so it resumes where it stopped. ``--shard i/n`` runs every n-th
run, so two processes of one thread each share the two cores:

    .venv/bin/python benchmarks/first_look.py --shard 0/2 & .venv/bin/python benchmarks/first_look.py --shard 1/2
    .venv/bin/python benchmarks/first_look.py --pairs        # the best pairs, once the singles are in
    .venv/bin/python benchmarks/first_look.py --table        # the markdown table of what is done
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from pipeoptim.errors import NonFiniteLoss
from pipeoptim.experiment import RunConfig, run_experiment
from pipeoptim.tasks import get_task
from study import append_line

RESULTS = Path(__file__).resolve().parent / "results" / "first_look.jsonl"
STAGES = 8
WARMUP_SHARE = 0.05
DIAGNOSE_EVERY = 25  # micro-batches between probes of the prediction error

#: per task: model, examples, epochs, peak lr per optimizer, gradient clipping
TASKS: Dict[str, Dict[str, Any]] = {
    "image": {"model": "vgg", "limit": None, "epochs": 2, "clip_grad": None,
              "lr": {"momentum": 0.01, "adam": 1e-3}},
    # 12,800 blocks of 64 tokens at batch 32: 400 updates (about 5 minutes of sequential training)
    "lm": {"model": "gpt", "limit": 12800, "epochs": 1, "clip_grad": 1.0,
           "lr": {"momentum": 0.05, "adam": 1e-3}},
}
OPTIMIZERS = ("momentum", "adam")
SINGLES = ("lr_correction", "horizon", "delta", "prediction_warmup", "sync_warmup")


def correction_options(name: str, updates: int) -> Dict[str, Any]:
    """The method options of one correction, sized to a run of ``updates`` updates."""
    warmup = max(1, round(WARMUP_SHARE * updates))
    return {"lr_correction": {"lr_correction": "delay"},  # T: check_run's default, 30% of the updates
            "horizon": {"horizon": "scheduled"},
            "delta": {"delta": "ema"},
            "prediction_warmup": {"prediction_warmup": warmup},
            "sync_warmup": {"sync_warmup": warmup}}[name]


def variant_options(variant: str, updates: int) -> Tuple[str, Dict[str, Any]]:
    """(method, options) of a variant: sequential, pipeoptim, one correction, or "a+b"."""
    if variant in ("sequential", "pipeoptim"):
        return variant, {}
    options: Dict[str, Any] = {}
    for name in variant.split("+"):
        options.update(correction_options(name, updates))
    return "pipeoptim", options


def row_key(task: str, optimizer: str, variant: str) -> str:
    return f"{task}|{optimizer}|{variant}"


def load_rows() -> Dict[str, Dict[str, Any]]:
    if not RESULTS.exists():
        return {}
    rows = {}
    for line in RESULTS.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row_key(row["task"], row["optimizer"], row["variant"])] = row
    return rows


def run_one(task_name: str, optimizer: str, variant: str, data_cache: Dict) -> Dict[str, Any]:
    spec = TASKS[task_name]
    task = get_task(task_name)
    data_key = (task_name, spec["limit"])
    if data_key not in data_cache:
        data_cache.clear()
        data_cache[data_key] = task.load(batch_size=task.default_batch_size, limit=spec["limit"], seed=0)
    data = data_cache[data_key]
    updates = len(data.train) * spec["epochs"]
    method, options = variant_options(variant, updates)
    cfg = RunConfig(task=task_name, model=spec["model"], method=method, stages=STAGES if method != "sequential" else 1,
                    optimizer=optimizer, lr=spec["lr"][optimizer], epochs=spec["epochs"], limit=spec["limit"],
                    seed=0, lr_schedule="warmup-cosine", clip_grad=spec["clip_grad"], method_options=options)
    started = time.time()
    row: Dict[str, Any] = {"task": task_name, "optimizer": optimizer, "variant": variant, "method": method,
                           "options": options, "stages": cfg.stages, "lr": cfg.lr, "updates": updates,
                           "epochs": spec["epochs"], "clip_grad": spec["clip_grad"]}
    try:
        summary = run_experiment(cfg, out_dir=None, show_progress=False, log=lambda *a, **k: None, task=task,
                                 data=data, diagnose_every=DIAGNOSE_EVERY if method != "sequential" else 0)
    except NonFiniteLoss as error:
        row.update(diverged=str(error), final_metric=None, best_metric=None)
    else:
        row.update(diverged=None, metric=summary["metric"], final_metric=summary["final_metric"],
                   best_metric=summary["best_metric"], final_loss=summary["final_loss"],
                   resolved_options=summary["options"], prediction_error=summary["prediction_error"],
                   weight_copies=summary["weight_copies"],
                   epoch_metrics=[e.get("metric") for e in summary["epochs_detail"]])
    row["seconds"] = round(time.time() - started, 1)
    return row


def planned(pairs: bool, rows: Dict[str, Dict[str, Any]]) -> List[Tuple[str, str, str]]:
    runs = []
    for task in TASKS:
        for optimizer in OPTIMIZERS:
            if pairs:
                pair = best_pair(task, optimizer, rows)
                if pair is not None:
                    runs.append((task, optimizer, pair))
            else:
                runs += [(task, optimizer, v) for v in ("sequential", "pipeoptim", *SINGLES)]
    return runs


def best_pair(task: str, optimizer: str, rows: Dict[str, Dict[str, Any]]) -> Optional[str]:
    """The two single corrections with the best final metric (None until all singles are in)."""
    singles = [rows.get(row_key(task, optimizer, name)) for name in SINGLES]
    if any(r is None for r in singles):
        return None
    higher = get_task(task).higher_is_better
    worst = float("-inf") if higher else float("inf")
    ranked = sorted(zip(SINGLES, singles), reverse=higher,
                    key=lambda item: worst if item[1]["final_metric"] is None else item[1]["final_metric"])
    return "+".join(sorted(name for name, _ in ranked[:2]))


def ratios(row: Dict[str, Any], which: Optional[str] = None) -> str:
    """Per stage, the prediction/staleness error ratio (``which``: a variant of the diagnostic)."""
    parts = []
    for d in row.get("prediction_error") or []:
        if not d or not d.get("probes"):
            continue
        error = d["prediction_error"] if which is None else d.get("variants", {}).get(which)
        if error is None or not d["staleness_error"]:
            continue
        parts.append(f"{error / d['staleness_error']:.2f}")
    return " ".join(parts) or "-"


def table(rows: Dict[str, Dict[str, Any]]) -> str:
    lines = []
    for task in TASKS:
        for optimizer in OPTIMIZERS:
            got = [r for r in rows.values() if r["task"] == task and r["optimizer"] == optimizer]
            if not got:
                continue
            first = got[0]
            lines += ["", f"**{task}, {optimizer}, lr {first['lr']:g}, {first['updates']} updates, N = {STAGES}**", "",
                      "| run | final metric | best | prediction/staleness per stage (0..6) | same probes, no correction | minutes |",
                      "|---|---|---|---|---|---|"]
            order = ["sequential", "pipeoptim", *SINGLES]
            for row in sorted(got, key=lambda r: order.index(r["variant"]) if r["variant"] in order else 99):
                metric = "diverged" if row["diverged"] else f"{row['final_metric']:.4f}"
                best = "-" if row["diverged"] else f"{row['best_metric']:.4f}"
                plain = ratios(row, "no correction") if row["options"] else "-"
                lines.append(f"| {row['variant']} | {metric} | {best} | {ratios(row) if row['method'] != 'sequential' else '-'} "
                             f"| {plain} | {row['seconds'] / 60:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard", default="0/1", help="i/n: run every n-th planned run, starting at i")
    parser.add_argument("--pairs", action="store_true", help="run the best pair of each (task, optimizer)")
    parser.add_argument("--tasks", help="comma-separated subset of: " + ", ".join(TASKS))
    parser.add_argument("--table", action="store_true", help="print the markdown table and stop")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    rows = load_rows()
    if args.table:
        print(table(rows))
        return
    torch.set_num_threads(args.threads)
    index, count = (int(x) for x in args.shard.split("/"))
    runs = [r for r in planned(args.pairs, rows) if not args.tasks or r[0] in args.tasks.split(",")]
    mine = [r for i, r in enumerate(runs) if i % count == index and row_key(*r) not in rows]
    print(f"{len(mine)} runs to do in shard {args.shard} ({len(runs)} planned)", flush=True)
    cache: Dict = {}
    for task, optimizer, variant in mine:
        row = run_one(task, optimizer, variant, cache)
        append_line(RESULTS, row)
        result = "diverged" if row["diverged"] else f"{row['final_metric']:.4f}"
        print(f"{task} {optimizer} {variant}: {result} in {row['seconds'] / 60:.1f} min; "
              f"ratios {ratios(row)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
