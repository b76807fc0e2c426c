"""The Python API: ``pipeoptim.train(model, batches, method=..., ...)``.

It copies the model, splits the copy into stages, gives every stage an optimizer (from the
caller's factory) and the method's weight policy, and runs the method's schedule epoch by epoch
on the chosen runtime. The caller's model is never modified; the trained copy comes back in
:class:`TrainResult`.
"""
from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .errors import NonFiniteLoss
from .checkpoint import (checkpoint_name, latest_checkpoint, load_stage, prune, read_manifest,
                         save_manifest, save_stage, set_rng_state)
from .methods import get_method
from .partition import plan_partition
from .runtime.build import OptimizerFactory, build_stages
from .runtime.local import run_schedule
from .runtime.microbatch import batch_size, split_batch
from .runtime.stage import TraceEntry

Batch = Tuple[Any, torch.Tensor]


@dataclass
class TrainResult:
    """What a run produced."""

    losses: List[float]                 #: one per mini-batch, in batch order, all epochs
    version_trace: List[TraceEntry]     #: per (stage, micro-batch, pass): version and steps
    model: nn.Sequential                #: the trained copy of the model
    metrics: Dict[str, Any] = field(default_factory=dict)


@dataclass
class RunSpec:
    """A resolved run: method, options, stage count, partition and micro-batches."""

    method: str
    options: Dict[str, Any]
    stages: int
    partition: List[int]
    microbatches: int


def resolve(model: nn.Sequential, *, method: str, stages: Optional[int], partition: Optional[Sequence[int]],
            partitioner: str, micro_batches: Optional[int], method_options: Dict[str, Any],
            epochs: int = 1, batches: Sequence = (None,)) -> RunSpec:
    """Check a run's settings before any work starts; errors are ValueErrors that say the fix."""
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    if not batches:
        raise ValueError("no mini-batches to train on")
    m = get_method(method)
    options = m.resolve_options(method_options)
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"model must be an nn.Sequential of stage-able blocks, got {type(model).__name__}")
    if method == "sequential":
        n, sizes = 1, [len(model)]
    else:
        if partition is not None:
            n = len(partition)
            if stages is not None and stages != n:
                raise ValueError(f"stages={stages} but the partition {list(partition)} has {n} stages")
        elif stages is None:
            raise ValueError("give stages=N or partition=[layers per stage]")
        else:
            n = stages
        sizes = plan_partition(model, n, partitioner, partition)
    micro = m.microbatches(n, micro_batches)
    if micro < 1:
        raise ValueError(f"micro-batches must be at least 1, got {micro}")
    if m.schedule == "2bw" and micro < n:
        raise ValueError(f"pipedream-2bw needs micro-batches >= stages ({micro} < {n}); "
                         f"use micro_batches={n}")
    return RunSpec(method, options, n, sizes, micro)


def checkpoint_settings(spec: RunSpec, num_batches: int, checkpoint_every: Optional[int],
                        continuous: bool) -> Tuple[int, Dict[str, Any]]:
    """The drain interval in mini-batches and the facts a checkpoint's manifest must match to be
    resumed (method, stages, partition, micro-batches, options, batches per epoch, interval)."""
    if checkpoint_every is not None and checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be at least 1, got {checkpoint_every}")
    if continuous and checkpoint_every:
        raise ValueError("a continuous run never drains, so it cannot checkpoint every K batches; "
                         "drop continuous or checkpoint_every")
    segment = checkpoint_every or num_batches
    return segment, {"method": spec.method, "stages": spec.stages, "partition": spec.partition,
                     "microbatches": spec.microbatches, "options": spec.options,
                     "batches_per_epoch": num_batches, "segment": segment}


def segments(epochs: int, num_batches: int, segment: int, continuous: bool,
             start: Tuple[int, int] = (0, 0)) -> List[Tuple[int, int, int]]:
    """The schedules a run is cut into, as (epoch, first mini-batch, mini-batches), from the
    position ``start`` (epoch, batch) on: one per ``segment`` mini-batches (the pipeline
    drains, and may checkpoint, after each), or a single one over all epochs if ``continuous``."""
    if continuous:
        return [(0, 0, num_batches * epochs)]
    return [(e, b, min(segment, num_batches - b)) for e in range(epochs)
            for b in range(0, num_batches, segment) if (e, b) >= start]


def save_checkpoint(store: Path, pipeline: Sequence, run_info: Dict[str, Any], *, epoch: int, batch: int,
                    losses: List[float], epoch_metrics: List[Dict[str, Any]]) -> Path:
    """Save every stage at a drained point; the manifest records where to continue."""
    folder = store / checkpoint_name(epoch, batch)
    sums = {stage.index: save_stage(stage, folder) for stage in pipeline}
    save_manifest(folder, {**run_info, "epoch": epoch, "batch": batch, "losses": losses,
                           "epoch_metrics": epoch_metrics}, sums)
    prune(store, keep=2)
    return folder


def resume_from(store: Path, pipeline: Sequence, run_info: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Load the newest checkpoint in ``store`` into the stages; None if there is none yet."""
    folder = latest_checkpoint(store)
    if folder is None:
        return None
    manifest = read_manifest(folder, expect=json.loads(json.dumps(run_info)))
    state = None
    for stage in pipeline:
        state = load_stage(folder, manifest, stage)
    if state is not None:
        set_rng_state(state["rng"])
    return manifest


def train(model: nn.Sequential, batches: Sequence[Batch], *, method: str, optimizer: OptimizerFactory,
          loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], stages: Optional[int] = None,
          partition: Optional[Sequence[int]] = None, partitioner: str = "uniform", epochs: int = 1,
          micro_batches: Optional[int] = None, runtime: str = "local", continuous: bool = False,
          evaluate: Optional[Callable[[nn.Module], float]] = None,
          on_batch: Optional[Callable[[int, float], None]] = None,
          on_epoch: Optional[Callable[[int, Dict[str, Any]], None]] = None,
          checkpoint_dir: Optional[str | Path] = None, checkpoint_every: Optional[int] = None,
          resume: bool = False, diagnose_every: int = 0, **method_options: Any) -> TrainResult:
    """Train a copy of ``model`` on ``batches`` with a pipeline method.

    ``batches`` is one epoch of (input, target) mini-batches; ``optimizer`` is called with each
    stage's parameters; ``partition`` lists layers per stage (else ``stages`` with the
    ``partitioner``, ``uniform`` or ``params``). ``micro_batches`` splits each mini-batch for the
    methods that use micro-batches (default: the method's own). ``evaluate(model)`` is called
    after each epoch and its value recorded. ``continuous`` runs all epochs as one schedule with
    no drain between them. Method options (``steps``, ``backward``, ``sgd_momentum``,
    ``vertical_sync``) go in as keyword arguments.

    With ``checkpoint_dir``, the pipeline drains and every stage is saved every
    ``checkpoint_every`` mini-batches and at each epoch's end (:mod:`pipeoptim.checkpoint`);
    ``resume=True`` continues from the newest checkpoint there, and the losses after it equal
    those of an uninterrupted run with the same checkpoint interval, batch for batch.

    ``diagnose_every=K`` measures, for every K-th micro-batch at every stage, how far the weights
    its forward used were from the weights live at its backward, against how far the stale,
    unpredicted weights were (``metrics["prediction_error"]``, per stage, over the run; and each
    epoch's own in ``metrics["epochs"][e]["prediction_error"]``).
    """
    if runtime != "local":
        raise ValueError(f"runtime {runtime!r} is started from the command line "
                         f"(pipeoptim train --runtime distributed); the Python API runs 'local'")
    spec = resolve(model, method=method, stages=stages, partition=partition, partitioner=partitioner,
                   micro_batches=micro_batches, method_options=method_options, epochs=epochs,
                   batches=batches)
    meth = get_method(method)
    trained = copy.deepcopy(model)
    trained.train()
    pipeline = build_stages(trained, spec.partition, meth, spec.options, optimizer, loss_fn)
    for stage in pipeline:
        stage.diagnose_every = diagnose_every

    micro: List = []
    for inputs, target in batches:
        micro += split_batch(inputs, target, spec.microbatches)
    samples = sum(batch_size(x) for x, _ in batches)
    per_batch = spec.microbatches
    num_batches = len(batches)
    segment, run_info = checkpoint_settings(spec, num_batches, checkpoint_every, continuous)
    store = Path(checkpoint_dir) if checkpoint_dir is not None else None

    losses: List[float] = []
    epoch_metrics: List[Dict[str, Any]] = []
    start_epoch, start_batch = 0, 0
    if resume:
        if store is None:
            raise ValueError("resume=True needs checkpoint_dir")
        state = resume_from(store, pipeline, run_info)
        if state is not None:
            losses, epoch_metrics = state["losses"], state["epoch_metrics"]
            start_epoch, start_batch = state["epoch"], state["batch"]

    start = time.perf_counter()
    plan = segments(epochs, num_batches, segment, continuous, start=(start_epoch, start_batch))
    trained_samples = 0
    epoch_start = time.perf_counter()
    probes_seen = [0] * len(pipeline)  # the diagnostics of each epoch are its own probes
    for epoch, first, count in plan:
        base = len(losses)

        def record(window: int, loss: float, epoch=epoch, first=first, base=base) -> None:
            if not math.isfinite(loss):
                raise NonFiniteLoss(f"loss became {loss} at mini-batch {(first + window) % num_batches} "
                                    f"of epoch {epoch + (first + window) // num_batches}")
            if on_batch is not None:
                on_batch(base + window, loss)

        schedule = meth.build_schedule(spec.stages, per_batch, count)
        data = (micro * epochs) if continuous else micro[first * per_batch:(first + count) * per_batch]
        window_losses = run_schedule(pipeline, schedule, data, on_loss=record,
                                     trace_offset=(epoch * num_batches + first) * per_batch)
        losses += [window_losses[w] for w in range(count)]
        trained_samples += sum(batch_size(x) for x, _ in batches[first:first + count]) if not continuous \
            else samples * epochs
        ends_epoch = continuous or first + count == num_batches
        if ends_epoch:
            seconds = time.perf_counter() - epoch_start
            for e in range(epochs if continuous else 1):
                chunk = losses[(epoch + e) * num_batches:(epoch + e + 1) * num_batches]
                epoch_metrics.append({"epoch": epoch + e, "loss": sum(chunk) / len(chunk),
                                      "seconds": seconds / (epochs if continuous else 1),
                                      "samples_per_second": samples * (epochs if continuous else 1) / seconds})
            if diagnose_every:
                epoch_metrics[-1]["prediction_error"] = [s.diagnostics_summary(i) for s, i in zip(pipeline, probes_seen)]
                probes_seen = [len(s.diagnostics) for s in pipeline]
            if evaluate is not None:
                epoch_metrics[-1]["metric"] = float(evaluate(trained))
                trained.train()
            if on_epoch is not None:
                on_epoch(epoch_metrics[-1]["epoch"], epoch_metrics[-1])
            epoch_start = time.perf_counter()
        if store is not None and not continuous:
            next_epoch, next_batch = (epoch + 1, 0) if ends_epoch else (epoch, first + count)
            save_checkpoint(store, pipeline, run_info, epoch=next_epoch, batch=next_batch,
                            losses=losses, epoch_metrics=epoch_metrics)
    elapsed = time.perf_counter() - start

    trace = sorted((e for s in pipeline for e in s.trace), key=lambda e: (e.stage, e.microbatch, e.kind != "F"))
    metrics = {
        "method": method, "options": spec.options, "stages": spec.stages, "partition": spec.partition,
        "microbatches": spec.microbatches, "epochs": epoch_metrics,
        "samples_per_second": trained_samples / elapsed if elapsed > 0 else 0.0, "seconds": elapsed,
        "weight_versions": [round(s.policy.versions_peak, 3) for s in pipeline],
        "weight_versions_design": meth.weight_versions(spec.stages, **spec.options),
        "stage_seconds": [{k: s.time[k] / max(1, s.count[k]) for k in s.time} for s in pipeline],
        "prediction_error": [s.diagnostics_summary() for s in pipeline] if diagnose_every else None,
    }
    return TrainResult(losses, trace, trained, metrics)
