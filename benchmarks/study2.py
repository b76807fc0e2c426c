"""Issue 16's study: which pipeline reaches the target first, trained with the recipe people use.

Every run of every method, ``sequential`` included, uses the same recipe: linear warm-up over 5%
of the updates, cosine decay to 10% of the peak lr (``pipeoptim.lr_schedules``' warmup-cosine),
gradient clipping where the task has it, a validation split held out of the training data
(tuning reads only it; the test metric is measured once, on the final model), and an evaluation
every ``eval_every`` mini-batches: the curves that ``pipeoptim.time_to_target`` reads. The
budget and its cuts are docs/study_plan.md's; ``SUITES`` below holds their numbers.

Phases, per cell (task, optimizer):

* ``sweep`` (N = 8, seed 0): 4 log-spaced peak lrs per method, with successive halving. All 4
  train the first third of the updates (to the evaluation nearest a third, where they
  checkpoint and stop: rows with ``until: "third"``); the 2 best on the validation metric
  resume from that checkpoint to the end (``until: "end"``), exactly as uninterrupted runs. A
  method's best lr is the better of the two at the end, on validation.
* ``seeds``: seeds 1 and 2 at each method's best lr at N = 8 (seed 0 is its sweep run), seeds
  0-2 at N = 4 with the N = 8 best lr, ``sequential`` once per cell (it has no N); and the
  confirmations (rows with phase ``confirm``): ``gpipe`` and ``1f1b-flush`` once per task, at
  N = 8 with AdamW, sequential's best lr and seed 0.
* ``correction`` (added after the study ran, placed last so that no earlier run moved): which
  correction ``pipeoptim+lr_correction`` should carry, chosen on the validation split. At N = 8,
  seed 0 and its best lr, its own sweep run (the delay-scaled lr alone) against the same lr with
  the scheduled horizon, and with the prediction warmed up over the lr's warm-up (whole runs);
  ``--choice`` prints each cell's scores and pick.

Each finished run (and each first third) appends one line to ``runs.jsonl`` in the study
folder, with a single O_APPEND write; a second call skips what is in the file. Runs train in
folders under the study folder's ``runs/``, checkpointing at every evaluation, so a run that was
interrupted restarts from its last checkpoint; a run's checkpoints are deleted once its line is
written (and those of the lrs the halving drops, once it has chosen). A phase whose inputs are
not all in yet (the sweep's winners, sequential's best lr) is skipped with a line saying what it
waits for: call again later (or pass ``--wait``) and it continues.

    .venv/bin/python benchmarks/study2.py --plan          # the runs, minutes each, the core-minutes
    .venv/bin/python benchmarks/study2.py --shard 0/2 --wait 60 &
    .venv/bin/python benchmarks/study2.py --shard 1/2 --wait 60
    .venv/bin/python benchmarks/study2.py --suite smoke --out /tmp/study2-smoke   # seconds a run

``--shard i/n`` takes the runs whose place in the whole plan is i modulo n, so processes that
share the study folder never run the same run; each trains on one thread. ``--phase``,
``--tasks`` and ``--methods`` narrow what a call runs, ``--max-runs`` how many. The text tasks
read their data from ``PIPEOPTIM_CACHE`` (the Bible dump and tokenizer for the LM).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from pipeoptim.checkpoint import checkpoint_name, latest_checkpoint, read_manifest
from pipeoptim.errors import NonFiniteLoss
from pipeoptim.experiment import RunConfig, load_data, run_experiment
from pipeoptim.lr_schedules import default_warmup
from pipeoptim.methods import get_method
from pipeoptim.tasks import get_task

BENCHMARKS = Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:  # study.py sits beside this file, also when a test imports it by path
    sys.path.insert(0, str(BENCHMARKS))
from study import append_line  # noqa: E402  (one O_APPEND write per row, shared by the studies)

RESULTS = BENCHMARKS / "results"
LR_SCHEDULE = "warmup-cosine"  #: 5% linear warm-up, then cosine to 10% of the peak (the defaults)

#: the study's name for a method with options -> (method, method options)
CORRECTED = {"pipeoptim+lr_correction": ("pipeoptim", {"lr_correction": "delay"}),
             # the correction choice's other candidates (the plan's item "choosing pipeoptim's
             # correction"): the first look's best pairs with the delay-scaled lr. LR_WARMUP stands
             # for the lr schedule's own warm-up (5 % of the run's updates), resolved per task
             "pipeoptim+lr_correction+horizon": ("pipeoptim", {"lr_correction": "delay", "horizon": "scheduled"}),
             "pipeoptim+lr_correction+prediction_warmup": ("pipeoptim", {"lr_correction": "delay",
                                                                         "prediction_warmup": "lr-warmup"})}
LR_WARMUP = "lr-warmup"
#: methods that equal sequential numerically: no staleness to diagnose
SYNCHRONOUS = ("sequential", "gpipe", "1f1b-flush")

SUITES: Dict[str, Dict[str, Any]] = {
    "default": {
        # cut 3: momentum SGD on image only; sentiment and the LM with AdamW (sequential with
        # momentum does not reach a level worth comparing on text)
        "cells": [("image", "momentum"), ("image", "adamw"), ("sentiment", "adamw"), ("lm", "adamw")],
        # per task: the model, its data (train_examples: after the holdout and limit; what the plan
        # counts mini-batches from, checked against the loaded data at run time), the recipe, the
        # sweep's lr range per optimizer (4 log-spaced values from low to high), and the measured
        # cost (benchmarks/step_times.py, one thread: seconds per step of sequential, seconds per
        # evaluation of the validation split, and of the test split once at the end)
        "tasks": {
            # the full 60,000 images, 5,000 held out: 859 mini-batches x 3 epochs = 2,577 updates
            "image": {"model": "vgg", "limit": None, "holdout": 5000, "train_examples": 55000,
                      "batch_size": 64, "epochs": 3, "eval_every": 300, "clip_grad": None,
                      # momentum: pipeoptim diverged at 0.01 in the first look (N = 8), sequential's
                      # best was 0.02 in the first study; the range covers both
                      "lr": {"momentum": (0.0025, 0.02), "adamw": (5e-4, 4e-3)},
                      "seconds_per_step": 0.067, "eval_seconds": 1.3, "test_seconds": 2.6},
            # cut 7: 3 epochs of the full data (477 updates); the validation split is the task's
            # own (1,275 snippets). Clipped: the usual practice for (deep) LSTMs. Synchronous
            # methods clip by the whole model's norm (clip_scope global: equal to sequential), the
            # asynchronous ones per stage (no stage holds one mini-batch's whole gradient at once)
            "sentiment": {"model": "lstm-deep", "limit": None, "holdout": 1275, "train_examples": 10200,
                          "batch_size": 64, "epochs": 3, "eval_every": 80, "clip_grad": 1.0,
                          "lr": {"adamw": (1e-3, 8e-3)},
                          "seconds_per_step": 0.289, "eval_seconds": 1.8, "test_seconds": 1.8},
            # cut 6: the narrower GPT (d 64, 2 heads, MLP 256, 8 layers: 10 blocks; the MODELS entry
            # of tasks/lm.py) at batch 16. 2,000 updates as 2 epochs of 16,000 blocks (the plan's
            # 1.65 epochs of the full split, in whole epochs so that the lr schedule spans the run)
            "lm": {"model": "gpt-narrow", "limit": 16000, "holdout": 300, "train_examples": 16000,
                   "batch_size": 16, "epochs": 2, "eval_every": 200, "clip_grad": 1.0,
                   "lr": {"adamw": (5e-4, 4e-3)},
                   "seconds_per_step": 0.097, "eval_seconds": 0.4, "test_seconds": 1.4},
        },
        # cut 4: the sweep at N = 8 only; N = 4 runs each method at its N = 8 best lr
        "stages": [8, 4],
        "lrs": 4,
        # cut 5: successive halving; all lrs train the first third, the best 2 (validation) the rest
        "halving": {"share": 1 / 3, "keep": 2},
        "seeds": [0, 1, 2],
        # cut 1 (sequential once for both N) is in the plan's shape; the 7 asynchronous methods
        "methods": ["async-naive", "pipedream", "pipedream-2bw", "spectrain", "xpipe", "pipeoptim",
                    "pipeoptim+lr_correction"],
        # cut 2: gpipe and 1f1b-flush equal sequential (a tested invariant): one run each per task
        "confirm": {"methods": ["gpipe", "1f1b-flush"], "optimizer": "adamw"},
        # the plan's cost per run relative to sequential's step time on the local runtime (the
        # first study's measurements: the asynchronous methods about 1.0-1.2x, gpipe and
        # 1f1b-flush up to 1.9x with their N micro-batches)
        "cost_factor": {"sequential": 1.0, "gpipe": 1.7, "1f1b-flush": 1.7, "asynchronous": 1.1},
        "diagnose_every": 25,  # micro-batches between probes of the prediction error (as the first look)
        # which correction pipeoptim+lr_correction should carry, chosen on the validation split at
        # the sweep's N, seed 0 and the base's best lr: the base's own sweep run against each
        # candidate, whole runs (the plan's 3 candidates x 4 cells, 2 of them new runs)
        "corrections": {"base": "pipeoptim+lr_correction",
                        "candidates": ["pipeoptim+lr_correction+horizon", "pipeoptim+lr_correction+prediction_warmup"]},
    },
    # a tiny suite for tests and a check of the machinery: seconds a run
    "smoke": {
        "cells": [("image", "momentum")],
        "tasks": {
            # 384 images of the 59,872 left after the holdout, batch 32: 12 updates, evaluations at
            # 4, 8, 12. No clipping, so that the gpipe confirmation equals sequential
            "image": {"model": "mlp", "limit": 384, "holdout": 128, "train_examples": 384,
                      "batch_size": 32, "epochs": 1, "eval_every": 4, "clip_grad": None,
                      "lr": {"momentum": (0.01, 0.04)},
                      "seconds_per_step": 0.004, "eval_seconds": 0.05, "test_seconds": 0.2},
        },
        "stages": [4, 2],
        "lrs": 2,
        "halving": {"share": 1 / 3, "keep": 1},
        "seeds": [0, 1],
        "methods": ["pipeoptim", "pipeoptim+lr_correction"],
        "confirm": {"methods": ["gpipe"], "optimizer": "momentum"},
        "cost_factor": {"sequential": 1.0, "gpipe": 1.7, "1f1b-flush": 1.7, "asynchronous": 1.1},
        "diagnose_every": 2,
        "corrections": {"base": "pipeoptim+lr_correction", "candidates": ["pipeoptim+lr_correction+horizon"]},
    },
}


# --------------------------------------------------------------------------------------------
# the plan


@dataclasses.dataclass
class Run:
    """One planned run (or a first third, or the rest of a sweep run), and where it stands."""

    phase: str             #: sweep, confirm or seeds
    task: str
    optimizer: str
    variant: str           #: the study's name for the method (with its options)
    stages: int
    seed: int
    lr: Optional[float]    #: None until the runs it depends on are in
    until: Optional[str] = None  #: sweep runs: "third" (stop there) or "end" (resume to the end)
    index: int = 0         #: place in the whole plan; --shard i/n runs index % n == i
    status: str = "ready"  #: ready, waiting (for other runs' rows), dropped (nothing to run), done
    why: str = ""          #: what a waiting or dropped run waits for or lacks
    minutes: float = 0.0   #: estimated core-minutes

    @property
    def method(self) -> str:
        return variant_method(self.variant)[0]

    @property
    def options(self) -> Dict[str, Any]:
        return variant_method(self.variant)[1]

    def key_fields(self) -> Dict[str, Any]:
        return {"task": self.task, "optimizer": self.optimizer, "method": self.method, "options": self.options,
                "stages": self.stages, "lr": self.lr, "seed": self.seed, "phase": self.phase, "until": self.until}

    def folder_name(self) -> str:
        """The run folder: a sweep run's third and its end share one (the end resumes it)."""
        return f"{self.task}-{self.optimizer}-{self.variant}-N{self.stages}-lr{self.lr:g}-seed{self.seed}"

    def label(self) -> str:
        lr = f"{self.lr:g}" if self.lr is not None else "?"
        part = f" ({self.until})" if self.until else ""
        return (f"{self.phase}{part} {self.task} {self.optimizer} {self.variant} N={self.stages} lr {lr} "
                f"seed {self.seed}")


def variant_method(variant: str) -> Tuple[str, Dict[str, Any]]:
    """(method, method options) of one of the study's methods."""
    method, options = CORRECTED.get(variant, (variant, {}))
    return method, dict(options)


def row_key(row: Dict[str, Any]) -> str:
    """What identifies a run in runs.jsonl (a Run's key_fields, or a row)."""
    return "|".join([row["task"], row["optimizer"], row["method"], json.dumps(row["options"], sort_keys=True),
                     str(row["stages"]), repr(float(row["lr"])), str(row["seed"]), row["phase"],
                     str(row.get("until"))])


def load_rows(path: Path) -> Dict[str, Dict[str, Any]]:
    """The rows of runs.jsonl by key (the first of duplicates; a torn last line is ignored)."""
    rows: Dict[str, Dict[str, Any]] = {}
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a killed writer: its run is simply run again
        rows.setdefault(row_key(row), row)
    return rows


def log_spaced(low: float, high: float, count: int) -> List[float]:
    """``count`` peak lrs from ``low`` to ``high``, equal ratios apart (3 significant digits)."""
    if count == 1:
        return [low]
    return [float(f"{low * (high / low) ** (i / (count - 1)):.3g}") for i in range(count)]


def sweep_lrs(suite: Dict[str, Any], task: str, optimizer: str) -> List[float]:
    low, high = suite["tasks"][task]["lr"][optimizer]
    return log_spaced(low, high, suite["lrs"])


def drain_points(batches_per_epoch: int, epochs: int, eval_every: int) -> List[int]:
    """Mini-batches trained at each evaluation (and checkpoint): every ``eval_every`` mini-batches
    of an epoch, counted from the epoch's start, and each epoch's end (Pipeline.fit's points)."""
    points = []
    for epoch in range(epochs):
        base = epoch * batches_per_epoch
        points += [base + k for k in range(eval_every, batches_per_epoch, eval_every)]
        points.append(base + batches_per_epoch)
    return points


def stop_point(batches_per_epoch: int, epochs: int, eval_every: int, share: float) -> int:
    """Where a sweep run's first part stops: the evaluation nearest ``share`` of the updates
    (the later one on a tie), never the last (the run must have a rest to continue)."""
    total = batches_per_epoch * epochs
    points = [p for p in drain_points(batches_per_epoch, epochs, eval_every) if p < total]
    if not points:
        raise ValueError(f"a run of {total} mini-batches evaluated every {eval_every} has no evaluation "
                         f"before its end to stop the sweep's first part at")
    return min(points, key=lambda p: (abs(p - share * total), -p))


def batches_per_epoch(spec: Dict[str, Any]) -> int:
    return spec["train_examples"] // spec["batch_size"]  # the last incomplete batch is dropped


def cost_factor(suite: Dict[str, Any], variant: str) -> float:
    factors = suite["cost_factor"]
    return factors.get(variant_method(variant)[0], factors["asynchronous"])


def estimate_minutes(suite: Dict[str, Any], task: str, variant: str, start: int, end: int) -> float:
    """Core-minutes of training mini-batches ``start`` to ``end`` (and the evaluations there; the
    test split once if the run ends), from the measured seconds per step and per evaluation."""
    spec = suite["tasks"][task]
    n = batches_per_epoch(spec)
    total = n * spec["epochs"]
    evaluations = sum(start < p <= end for p in drain_points(n, spec["epochs"], spec["eval_every"]))
    seconds = (end - start) * spec["seconds_per_step"] * cost_factor(suite, variant)
    seconds += evaluations * spec["eval_seconds"] + (spec["test_seconds"] if end == total else 0.0)
    return seconds / 60


def score(row: Dict[str, Any], higher_is_better: bool) -> Optional[float]:
    """The row's validation metric, signed so that more is better; None if it diverged (or the
    metric is not finite, as a perplexity that overflowed)."""
    value = row.get("validation_metric")
    if row.get("diverged") or value is None or not math.isfinite(value):
        return None
    return value if higher_is_better else -value


def ranked_lrs(rows: Sequence[Tuple[float, Dict[str, Any]]], higher_is_better: bool) -> List[float]:
    """The lrs of (lr, row) pairs best first on validation, diverged ones left out; a tie goes
    to the smaller lr."""
    scored = [(s, lr) for lr, row in rows if (s := score(row, higher_is_better)) is not None]
    return [lr for _, lr in sorted(scored, key=lambda item: (-item[0], item[1]))]


def sweep_run(suite: Dict[str, Any], task: str, optimizer: str, variant: str, lr: Optional[float],
              until: str) -> Run:
    stages = 1 if variant == "sequential" else max(suite["stages"])
    return Run("sweep", task, optimizer, variant, stages, 0, lr, until)


def halving_winners(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]], task: str, optimizer: str,
                    variant: str) -> Tuple[Optional[List[float]], str]:
    """The lrs that continue to the end (the best ``keep`` first thirds on validation), or None
    and which first thirds are not in yet."""
    lrs = sweep_lrs(suite, task, optimizer)
    thirds = [(lr, rows.get(row_key(sweep_run(suite, task, optimizer, variant, lr, "third").key_fields())))
              for lr in lrs]
    missing = [f"{lr:g}" for lr, row in thirds if row is None]
    if missing:
        return None, f"the sweep's first thirds of {variant} at lr {', '.join(missing)}"
    higher = get_task(task).higher_is_better
    return ranked_lrs(thirds, higher)[:suite["halving"]["keep"]], ""


def best_lr(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]], task: str, optimizer: str,
            variant: str) -> Tuple[Optional[float], str, str]:
    """(lr, status, why): the method's best lr on validation at the end of the sweep ("ready"),
    or None with "waiting" (and for what) or "dropped" (every lr diverged)."""
    winners, why = halving_winners(suite, rows, task, optimizer, variant)
    if winners is None:
        return None, "waiting", why
    if not winners:
        return None, "dropped", f"every lr of {variant} diverged in the sweep's first third"
    ends = [(lr, rows.get(row_key(sweep_run(suite, task, optimizer, variant, lr, "end").key_fields())))
            for lr in winners]
    missing = [f"{lr:g}" for lr, row in ends if row is None]
    if missing:
        return None, "waiting", f"the sweep's ends of {variant} at lr {', '.join(missing)}"
    ranked = ranked_lrs(ends, get_task(task).higher_is_better)
    if not ranked:
        return None, "dropped", f"{variant} diverged at every lr the halving kept"
    return ranked[0], "ready", ""


def plan_runs(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]]) -> List[Run]:
    """Every run of the suite in the order they are run (the sweeps' first thirds of every
    cell, their ends, the confirmations, the seeds), each with its lr where known, its status
    against ``rows`` and its estimated core-minutes."""
    runs: List[Run] = []
    variants = ["sequential", *suite["methods"]]
    sweep_stages = max(suite["stages"])

    def add(run: Run, status: str = "ready", why: str = "", start: int = 0, end: Optional[int] = None) -> None:
        spec = suite["tasks"][run.task]
        total = batches_per_epoch(spec) * spec["epochs"]
        run.index, run.status, run.why = len(runs), status, why
        run.minutes = estimate_minutes(suite, run.task, run.variant, start, total if end is None else end)
        if status == "ready" and row_key(run.key_fields()) in rows:
            run.status = "done"
        runs.append(run)

    def third(task: str) -> int:
        spec = suite["tasks"][task]
        return stop_point(batches_per_epoch(spec), spec["epochs"], spec["eval_every"], suite["halving"]["share"])

    for task, optimizer in suite["cells"]:  # the sweeps' first thirds
        for variant in variants:
            for lr in sweep_lrs(suite, task, optimizer):
                add(sweep_run(suite, task, optimizer, variant, lr, "third"), end=third(task))
    for task, optimizer in suite["cells"]:  # the halving's winners, to the end
        for variant in variants:
            winners, why = halving_winners(suite, rows, task, optimizer, variant)
            for rank in range(suite["halving"]["keep"]):
                if winners is None:
                    add(sweep_run(suite, task, optimizer, variant, None, "end"), "waiting", why, start=third(task))
                elif rank < len(winners):
                    add(sweep_run(suite, task, optimizer, variant, winners[rank], "end"), start=third(task))
                else:
                    add(sweep_run(suite, task, optimizer, variant, None, "end"), "dropped",
                        f"{len(winners)} lr(s) of {variant} did not diverge in the first third", start=third(task))
    confirm = suite["confirm"]
    for task in dict.fromkeys(t for t, o in suite["cells"] if o == confirm["optimizer"]):
        lr, status, why = best_lr(suite, rows, task, confirm["optimizer"], "sequential")
        for variant in confirm["methods"]:
            add(Run("confirm", task, confirm["optimizer"], variant, sweep_stages, 0, lr), status,
                why and f"sequential's best lr: {why}")
    # seeds in rounds: each (variant, N) gets its next seed before any gets its third, so that an
    # interrupted study has N = 4 and a second seed everywhere before a third seed anywhere
    per_stages = {stages: suite["seeds"][1:] if stages == sweep_stages else list(suite["seeds"])
                  for stages in suite["stages"]}
    for round_ in range(max(len(seeds) for seeds in per_stages.values())):
        for stages in suite["stages"]:
            if round_ >= len(per_stages[stages]):
                continue
            seed = per_stages[stages][round_]
            for task, optimizer in suite["cells"]:
                for variant in variants:
                    if variant == "sequential" and stages != sweep_stages:
                        continue  # no stages: once per cell
                    lr, status, why = best_lr(suite, rows, task, optimizer, variant)
                    n = 1 if variant == "sequential" else stages
                    add(Run("seeds", task, optimizer, variant, n, seed, lr), status, why)
    # the correction choice last, so that adding it left every earlier run's place (and shard) as it was
    corrections = suite.get("corrections")
    for task, optimizer in suite["cells"] if corrections else ():
        lr, status, why = best_lr(suite, rows, task, optimizer, corrections["base"])
        for variant in corrections["candidates"]:
            add(Run("correction", task, optimizer, variant, sweep_stages, 0, lr), status, why)
    return runs


def correction_choice(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]], task: str,
                      optimizer: str) -> Optional[Dict[str, Any]]:
    """The correction choice of one cell once its runs are in: ``{"lr", "scores": {variant:
    validation metric or None if diverged}, "chosen": variant}`` (the best on validation; a tie
    keeps the base, then the earlier candidate), or None while a run is missing."""
    corrections = suite["corrections"]
    lr, status, _ = best_lr(suite, rows, task, optimizer, corrections["base"])
    if status != "ready":
        return None
    runs = {corrections["base"]: sweep_run(suite, task, optimizer, corrections["base"], lr, "end")}
    runs.update({v: Run("correction", task, optimizer, v, max(suite["stages"]), 0, lr)
                 for v in corrections["candidates"]})
    found = {variant: rows.get(row_key(run.key_fields())) for variant, run in runs.items()}
    if any(row is None for row in found.values()):
        return None
    higher = get_task(task).higher_is_better
    scores = {variant: score(row, higher) for variant, row in found.items()}
    ranked = sorted((s, -i, v) for i, (v, s) in enumerate(scores.items()) if s is not None)
    return {"lr": lr, "metric": get_task(task).metric,
            "scores": {v: found[v].get("validation_metric") if s is not None else None for v, s in scores.items()},
            "chosen": ranked[-1][2] if ranked else None}


def shard_runs(runs: Sequence[Run], shard: Tuple[int, int]) -> List[Run]:
    index, count = shard
    return [run for run in runs if run.index % count == index]


# --------------------------------------------------------------------------------------------
# running


class ReachedStop(Exception):
    """A sweep run trained its first part and checkpointed the evaluation it stops at."""


class UntilCheckpoint:
    """One epoch of training mini-batches that ends the run once the checkpoint ``manifest``
    exists: Pipeline.fit drains, evaluates and checkpoints at the stop point, then asks for the
    next mini-batch (or the next epoch's first), and gets :class:`ReachedStop` instead. The
    checkpoint is the one an uninterrupted run writes there, so resuming from it continues the
    same run (same lr schedule over the whole run, same data order, same drains)."""

    def __init__(self, batches: Sequence[Any], manifest: Path) -> None:
        self.batches = batches
        self.manifest = manifest

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches:
            if self.manifest.exists():
                raise ReachedStop
            yield batch


def has_checkpoint(folder: Path) -> bool:
    return latest_checkpoint(folder / "checkpoints") is not None


def train_until(cfg: RunConfig, folder: Path, data: Any, manifest: Path, label: str,
                options: Dict[str, Any]) -> Tuple[bool, Dict[str, Any]]:
    """Train a run's first part, resuming from its folder's last checkpoint if it has one, until
    the checkpoint ``manifest`` is written (at once if it already was: a call stopped between
    the checkpoint and the row). Returns (resumed, the checkpoint's manifest); ``options`` are
    run_experiment's (quiet output, the task, the diagnostic)."""
    resumed = has_checkpoint(folder)
    if not manifest.exists():
        try:
            run_experiment(cfg, out_dir=folder, resume=resumed,
                           data=dataclasses.replace(data, train=UntilCheckpoint(data.train, manifest)), **options)
        except ReachedStop:
            pass
        else:
            raise RuntimeError(f"{label}: trained to the end without reaching its stop point ({manifest.parent.name})")
    return resumed, read_manifest(manifest.parent)


def drop_checkpoints(folder: Path) -> None:
    """Free the disk once a run's checkpoints will never be resumed (the run folder's summary,
    metrics.jsonl and curves stay)."""
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)


def run_config(run: Run, spec: Dict[str, Any]) -> RunConfig:
    """The run's settings: the recipe, identical for every method (checkpoints at the
    evaluations, so that they add no drain of their own)."""
    return RunConfig(task=run.task, model=spec["model"], method=run.method, stages=run.stages,
                     optimizer=run.optimizer, lr=run.lr, epochs=spec["epochs"], batch_size=spec["batch_size"],
                     limit=spec["limit"], seed=run.seed, holdout=spec["holdout"], eval_every=spec["eval_every"],
                     checkpoint_every=spec["eval_every"], lr_schedule=LR_SCHEDULE, clip_grad=spec["clip_grad"],
                     # synchronous methods clip by the whole model's norm, as sequential does (equal runs);
                     # an asynchronous stage never holds one mini-batch's whole gradient: per stage
                     clip_scope="global" if get_method(run.method).synchronous and spec["clip_grad"] else "stage",
                     method_options=resolve_options(run.options, batches_per_epoch(spec) * spec["epochs"]))


def resolve_options(options: Dict[str, Any], updates: int) -> Dict[str, Any]:
    """A variant's method options for a run of ``updates`` updates: LR_WARMUP becomes the lr
    schedule's own warm-up length."""
    return {k: default_warmup(LR_SCHEDULE, updates, None) if v == LR_WARMUP else v for k, v in options.items()}


def curve(evaluations: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The evaluations as time to target reads them: updates, metric, training seconds."""
    return [{"updates": e["updates"], "metric": e["metric"], "seconds": round(e["seconds"], 2)} for e in evaluations]


def execute(run: Run, suite: Dict[str, Any], study: Path, data_cache: Dict[Any, Any]) -> Dict[str, Any]:
    """Train ``run`` (a first third, the rest of one, or a whole run) and return its row."""
    spec = suite["tasks"][run.task]
    task = get_task(run.task)
    cfg = run_config(run, spec)
    resolved = cfg.resolved(task)
    data_key = (run.task, run.seed, resolved.batch_size, resolved.limit, resolved.holdout)
    if data_key not in data_cache:
        data_cache.clear()
        data_cache[data_key] = load_data(task, resolved)
    data = data_cache[data_key]
    per_epoch = len(data.train)
    if per_epoch != batches_per_epoch(spec):
        print(f"note: {run.task} has {per_epoch} mini-batches per epoch, the plan counted "
              f"{batches_per_epoch(spec)} (train_examples); the stop point follows the data", flush=True)
    total = per_epoch * spec["epochs"]
    folder = study / "runs" / run.folder_name()
    row: Dict[str, Any] = {**run.key_fields(), "variant": run.variant, "model": spec["model"],
                           "epochs": spec["epochs"], "batch_size": resolved.batch_size, "limit": spec["limit"],
                           "holdout": spec["holdout"], "eval_every": spec["eval_every"],
                           "clip_grad": spec["clip_grad"], "lr_schedule": LR_SCHEDULE, "updates": total,
                           "metric": task.metric, "higher_is_better": task.higher_is_better,
                           "folder": str(folder.relative_to(study))}
    quiet = dict(show_progress=False, log=lambda *a, **k: None, task=task,
                 diagnose_every=0 if run.method in SYNCHRONOUS else suite["diagnose_every"])
    started = time.time()
    try:
        if run.until == "third":
            stop = stop_point(per_epoch, spec["epochs"], spec["eval_every"], suite["halving"]["share"])
            manifest = folder / "checkpoints" / checkpoint_name(*divmod(stop, per_epoch)) / "manifest.json"
            row["resumed"], state = train_until(cfg, folder, data, manifest, run.label(), quiet)
            evaluations = state["evaluations"]
            if not evaluations or evaluations[-1]["batch"] != stop:
                raise RuntimeError(f"{manifest}: the last evaluation is not at mini-batch {stop}")
            row.update(diverged=None, stopped_at=stop, final_metric=None,
                       validation_metric=evaluations[-1]["metric"], evaluations=curve(evaluations),
                       train_seconds=round(state["train_seconds"], 1),
                       epoch_losses=[e["loss"] for e in state["epoch_metrics"]],
                       prediction_error=[e.get("prediction_error") for e in state["epoch_metrics"]])
        else:
            row["resumed"] = has_checkpoint(folder)
            summary = run_experiment(cfg, out_dir=folder, resume=row["resumed"], data=data, **quiet)
            evaluations = summary["evaluations"]
            row.update(diverged=None, final_metric=summary["final_metric"],
                       validation_metric=summary["validation_metric"], best_validation=summary["best_metric"],
                       evaluations=curve(evaluations),
                       train_seconds=round(evaluations[-1]["seconds"], 1) if evaluations else None,
                       final_loss=summary["final_loss"], epoch_losses=[e["loss"] for e in summary["epochs_detail"]],
                       # per epoch, each epoch's probes: a resume carries the epochs before it over
                       # (the summary's run-wide value covers only the part since the resume)
                       prediction_error=[e.get("prediction_error") for e in summary["epochs_detail"]],
                       weight_copies=summary["weight_copies"], weight_copies_design=summary["weight_copies_design"],
                       microbatches=summary["microbatches"], resolved_options=summary["options"],
                       samples_per_second=summary["samples_per_second"],
                       predicted_samples_per_second=summary["predicted_samples_per_second"])
    except NonFiniteLoss as error:  # a diverged run is a result of the study, not a failure
        row.update(diverged=str(error), final_metric=None, validation_metric=None)
    row["seconds"] = round(time.time() - started, 1)
    return row


def finished(row: Dict[str, Any]) -> bool:
    """Whether the row's run folder will never be resumed again."""
    return bool(row.get("diverged")) or row.get("until") != "third"


def drop_halved(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]], study: Path) -> None:
    """Delete the checkpoints of the first thirds the halving did not keep."""
    for task, optimizer in suite["cells"]:
        for variant in ["sequential", *suite["methods"]]:
            winners, _ = halving_winners(suite, rows, task, optimizer, variant)
            if winners is None:
                continue
            for lr in sweep_lrs(suite, task, optimizer):
                if lr not in winners:
                    run = sweep_run(suite, task, optimizer, variant, lr, "third")
                    drop_checkpoints(study / "runs" / run.folder_name())


def missing_models(suite: Dict[str, Any]) -> Dict[str, str]:
    """Tasks whose model is not (yet) one of the task's models -> what to say about it."""
    missing = {}
    for name, spec in suite["tasks"].items():
        models = get_task(name).model_names()
        if spec["model"] not in models:
            missing[name] = f"task {name} has no model {spec['model']!r} (it has {', '.join(models)})"
    return missing


# --------------------------------------------------------------------------------------------
# the command line


def selected(run: Run, args: argparse.Namespace) -> bool:
    phases = {"sweep": ("sweep",), "seeds": ("seeds", "confirm"), "correction": ("correction",),
              "all": ("sweep", "seeds", "confirm", "correction")}
    return (run.phase in phases[args.phase] and (not args.tasks or run.task in args.tasks.split(","))
            and (not args.methods or run.variant in args.methods.split(",")))


def describe_suite(suite: Dict[str, Any]) -> List[str]:
    sweep_stages = max(suite["stages"])
    lines = [f"cells: {', '.join(f'{t} x {o}' for t, o in suite['cells'])}; N = {sweep_stages} (the sweep), "
             f"then {', '.join(str(n) for n in suite['stages'] if n != sweep_stages)}; "
             f"seeds {suite['seeds']}; {suite['lrs']} lrs, the best {suite['halving']['keep']} of each first "
             f"{suite['halving']['share']:.2g} continue"]
    for task, spec in suite["tasks"].items():
        n = batches_per_epoch(spec)
        total = n * spec["epochs"]
        stop = stop_point(n, spec["epochs"], spec["eval_every"], suite["halving"]["share"])
        lrs = "; ".join(f"{o} {', '.join(f'{lr:g}' for lr in sweep_lrs(suite, task, o))}"
                        for t, o in suite["cells"] if t == task)
        lines.append(f"{task}: {spec['model']}, {n} mini-batches of {spec['batch_size']} x {spec['epochs']} epochs = "
                     f"{total} updates, evaluated every {spec['eval_every']} on {spec['holdout']} held out, "
                     f"clip {spec['clip_grad']}; first part to update {stop}; lrs {lrs}")
    return lines


def print_plan(suite_name: str, suite: Dict[str, Any], runs: Sequence[Run]) -> None:
    print(f"suite {suite_name}")
    for line in describe_suite(suite):
        print("  " + line)
    for task, why in missing_models(suite).items():
        print(f"  note: {why}: its runs cannot start until the model exists")
    print()
    print(f"{'#':>4} {'phase':<10} {'until':<5} {'task':<10} {'optimizer':<9} {'method':<24} {'N':>2} "
          f"{'lr':>8} {'seed':>4} {'min':>6}  status")
    for run in runs:
        lr = f"{run.lr:g}" if run.lr is not None else "best" if run.until != "end" else "winner"
        print(f"{run.index:>4} {run.phase:<10} {run.until or '':<5} {run.task:<10} {run.optimizer:<9} "
              f"{run.variant:<24} {run.stages:>2} {lr:>8} {run.seed:>4} {run.minutes:>6.2f}  "
              f"{run.status}{': ' + run.why if run.why else ''}")
    print()
    groups: Dict[str, List[Run]] = {}
    for run in runs:
        name = "confirm" if run.phase == "confirm" else f"{run.task} x {run.optimizer}"
        groups.setdefault(name, []).append(run)
    print(f"{'cell':<20} {'rows':>5} {'runs':>5} {'core-min':>9}")
    for name, group in [*groups.items(), ("total", list(runs))]:
        counted = [r for r in group if r.status != "dropped"]
        trainings = [r for r in counted if r.until != "end"]  # an end continues its third's run
        print(f"{name:<20} {len(counted):>5} {len(trainings):>5} {sum(r.minutes for r in counted):>9.1f}")
    counted = [r for r in runs if r.status != "dropped"]
    total = sum(r.minutes for r in counted)
    left = sum(r.minutes for r in counted if r.status != "done")
    phases: Dict[str, int] = {}
    for run in counted:
        name = run.phase + (f" {run.until}" if run.until else "")
        phases[name] = phases.get(name, 0) + 1
    print(f"\nrows per phase: {', '.join(f'{k} {v}' for k, v in phases.items())}")
    print(f"total: {len([r for r in counted if r.until != 'end'])} runs in {len(counted)} rows, "
          f"{total:.0f} core-minutes ({total / 120:.1f} h on 2 cores); "
          f"{sum(r.status == 'done' for r in counted)} rows done, {left:.0f} core-minutes left")


def parse_shard(text: str) -> Tuple[int, int]:
    index, count = (int(x) for x in text.split("/"))
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard i/n needs 0 <= i < n, got {text}")
    return index, count


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="default", choices=list(SUITES))
    parser.add_argument("--out", type=Path, help="the study folder (default benchmarks/results/study2, "
                                                 "or study2-SUITE for another suite)")
    parser.add_argument("--plan", action="store_true",
                        help="print the planned runs, minutes each and the core-minutes, and run nothing")
    parser.add_argument("--shard", type=parse_shard, default=(0, 1),
                        help="i/n: run the runs whose place in the plan is i modulo n")
    parser.add_argument("--phase", default="all", choices=["sweep", "seeds", "correction", "all"],
                        help="sweep: the lr sweeps with halving; seeds: the seeds and the confirmations; "
                             "correction: the correction choice of pipeoptim+lr_correction on validation")
    parser.add_argument("--choice", action="store_true",
                        help="print the correction choice of every cell whose runs are in, and run nothing")
    parser.add_argument("--tasks", help="comma-separated subset of the suite's tasks")
    parser.add_argument("--methods", help="comma-separated subset of the study's methods (sequential, "
                                          "gpipe, ..., pipeoptim+lr_correction)")
    parser.add_argument("--max-runs", type=int, help="stop after this many runs")
    parser.add_argument("--wait", type=float, default=0.0,
                        help="seconds between looks for the other shards' rows when this shard's next runs "
                             "wait for them (default 0: stop, and continue on the next call)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    suite = SUITES[args.suite]
    study = args.out or RESULTS / ("study2" if args.suite == "default" else f"study2-{args.suite}")
    runs_file = study / "runs.jsonl"
    if args.plan:
        print_plan(args.suite, suite, plan_runs(suite, load_rows(runs_file)))
        return 0
    if args.choice:
        rows = load_rows(runs_file)
        for task, optimizer in suite["cells"]:
            choice = correction_choice(suite, rows, task, optimizer)
            scores = ("runs not in yet" if choice is None else f"lr {choice['lr']:g}, validation {choice['metric']}: "
                      + ", ".join(f"{v} {'diverged' if s is None else f'{s:.4f}'}" for v, s in choice["scores"].items())
                      + f"; chosen: {choice['chosen']}")
            print(f"{task} x {optimizer}: {scores}")
        return 0

    torch.set_num_threads(args.threads)
    study.mkdir(parents=True, exist_ok=True)
    (study / "suite.json").write_text(json.dumps({"suite": args.suite, **suite}, indent=2))
    blocked = missing_models(suite)
    for why in blocked.values():
        print(f"skipping its runs: {why}", flush=True)
    data_cache: Dict[Any, Any] = {}
    started, done_here = time.time(), 0
    said: List[str] = []
    while True:
        rows = load_rows(runs_file)  # other shards append to the same file
        drop_halved(suite, rows, study)
        mine = [run for run in shard_runs(plan_runs(suite, rows), args.shard)
                if selected(run, args) and run.task not in blocked]
        ready = [run for run in mine if run.status == "ready"]
        waiting = [run for run in mine if run.status == "waiting"]
        if args.max_runs is not None and done_here >= args.max_runs:
            print(f"stopped after {done_here} runs (--max-runs); {len(ready) + len(waiting)} left in this shard")
            break
        if not ready:
            reasons = sorted({f"{run.phase} {run.task} {run.optimizer}: waits for {run.why}" for run in waiting})
            if reasons != said:  # (said once, not at every look while waiting)
                for reason in reasons:
                    print(f"skipped, {reason}", flush=True)
                said = reasons
            if waiting and args.wait > 0:
                time.sleep(args.wait)
                continue
            print(f"shard {args.shard[0]}/{args.shard[1]}: "
                  f"{'nothing left to run' if not waiting else 'call again once those are in'}; "
                  f"{done_here} runs in {time.time() - started:.0f} s; rows in {runs_file}", flush=True)
            break
        run = ready[0]
        row = execute(run, suite, study, data_cache)
        append_line(runs_file, row)
        if finished(row):
            drop_checkpoints(study / row["folder"])
        done_here += 1
        result = (f"diverged ({row['diverged']})" if row["diverged"] else
                  f"validation {row['metric']} {row['validation_metric']:.4f}"
                  + (f", test {row['final_metric']:.4f}" if row["final_metric"] is not None else ""))
        print(f"[{time.time() - started:7.0f}s] {run.label()}: {result} in {row['seconds'] / 60:.1f} min "
              f"(planned {run.minutes:.1f}); {len(ready) - 1} ready, {len(waiting)} waiting", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
