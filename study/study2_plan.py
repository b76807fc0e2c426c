"""The second study's settings and plan: the suites, a planned run, the lr sweep with successive
halving, the seeds, the confirmations and the correction choice, each run's status against the
rows in, and the shards. Its runner (benchmarks/study2.py, last in commit 6bb0f1e) is gone: its
rows are data (study/results/study2/), and the second study's report (make_results2.py) and
the equal-time study (study3*.py: its suite, carried lrs and recipe) read them through this plan."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from study.common import keyed_rows
from pipeoptim.lab.tasks import get_task

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
        # cost (study/step_times.py, one thread: seconds per step of sequential, seconds per
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
    return keyed_rows(path, row_key)


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
