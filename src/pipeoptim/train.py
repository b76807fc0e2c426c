"""The Python API: ``pipeoptim.train(model, batches, method=..., ...)``.

It copies the model, splits the copy into stages, gives every stage an optimizer (from the
caller's factory) and the method's weight policy, and runs the method's schedule epoch by epoch
on the chosen runtime. The caller's model is never modified; the trained copy comes back in
:class:`TrainResult`.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .methods import get_method
from .partition import plan_partition
from .runtime.build import OptimizerFactory, build_stages
from .runtime.local import run_schedule
from .runtime.microbatch import batch_size, split_batch
from .runtime.stage import TraceEntry

Batch = Tuple[Any, torch.Tensor]


class NonFiniteLoss(RuntimeError):
    """Training produced a NaN or infinite loss."""


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
            partitioner: str, micro_batches: Optional[int], method_options: Dict[str, Any]) -> RunSpec:
    """Check a run's settings before any work starts; errors are ValueErrors that say the fix."""
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


def train(model: nn.Sequential, batches: Sequence[Batch], *, method: str, optimizer: OptimizerFactory,
          loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], stages: Optional[int] = None,
          partition: Optional[Sequence[int]] = None, partitioner: str = "uniform", epochs: int = 1,
          micro_batches: Optional[int] = None, runtime: str = "local", continuous: bool = False,
          evaluate: Optional[Callable[[nn.Module], float]] = None,
          on_batch: Optional[Callable[[int, float], None]] = None,
          on_epoch: Optional[Callable[[int, Dict[str, Any]], None]] = None,
          **method_options: Any) -> TrainResult:
    """Train a copy of ``model`` on ``batches`` with a pipeline method.

    ``batches`` is one epoch of (input, target) mini-batches; ``optimizer`` is called with each
    stage's parameters; ``partition`` lists layers per stage (else ``stages`` with the
    ``partitioner``, ``uniform`` or ``params``). ``micro_batches`` splits each mini-batch for the
    methods that use micro-batches (default: the method's own). ``evaluate(model)`` is called
    after each epoch and its value recorded. ``continuous`` runs all epochs as one schedule with
    no drain between them. Method options (``steps``, ``backward``, ``sgd_momentum``,
    ``vertical_sync``) go in as keyword arguments.
    """
    if runtime != "local":
        raise ValueError(f"runtime {runtime!r} is started from the command line "
                         f"(pipeoptim train --runtime distributed); the Python API runs 'local'")
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    if not batches:
        raise ValueError("no mini-batches to train on")
    spec = resolve(model, method=method, stages=stages, partition=partition, partitioner=partitioner,
                   micro_batches=micro_batches, method_options=method_options)
    meth = get_method(method)
    trained = copy.deepcopy(model)
    trained.train()
    pipeline = build_stages(trained, spec.partition, meth, spec.options, optimizer, loss_fn)

    micro: List = []
    for inputs, target in batches:
        micro += split_batch(inputs, target, spec.microbatches)
    samples = sum(batch_size(x) for x, _ in batches)

    losses: List[float] = []
    epoch_metrics: List[Dict[str, Any]] = []
    start = time.perf_counter()
    rounds = [(0, epochs)] if continuous else [(e, 1) for e in range(epochs)]
    for first_epoch, count in rounds:
        epoch_start = time.perf_counter()
        schedule = meth.build_schedule(spec.stages, spec.microbatches, len(batches) * count)
        data = micro * count
        base = len(losses)

        def record(window: int, loss: float) -> None:
            if not math.isfinite(loss):
                raise NonFiniteLoss(f"loss became {loss} at mini-batch {window % len(batches)} of "
                                    f"epoch {first_epoch + window // len(batches)}")
            if on_batch is not None:
                on_batch(base + window, loss)

        window_losses = run_schedule(pipeline, schedule, data, on_loss=record,
                                     trace_offset=first_epoch * len(micro))
        losses += [window_losses[w] for w in range(len(batches) * count)]
        seconds = time.perf_counter() - epoch_start
        for e in range(count):
            chunk = losses[base + e * len(batches): base + (e + 1) * len(batches)]
            entry: Dict[str, Any] = {"epoch": first_epoch + e, "loss": sum(chunk) / len(chunk),
                                     "seconds": seconds / count,
                                     "samples_per_second": samples * count / seconds}
            epoch_metrics.append(entry)
        if evaluate is not None:
            epoch_metrics[-1]["metric"] = float(evaluate(trained))
            trained.train()
        if on_epoch is not None:
            on_epoch(epoch_metrics[-1]["epoch"], epoch_metrics[-1])
    elapsed = time.perf_counter() - start

    trace = sorted((e for s in pipeline for e in s.trace), key=lambda e: (e.stage, e.microbatch, e.kind != "F"))
    metrics = {
        "method": method, "options": spec.options, "stages": spec.stages, "partition": spec.partition,
        "microbatches": spec.microbatches, "epochs": epoch_metrics,
        "samples_per_second": samples * epochs / elapsed, "seconds": elapsed,
        "weight_versions": [round(s.policy.versions_peak, 3) for s in pipeline],
        "weight_versions_design": meth.weight_versions(spec.stages, **spec.options),
        "stage_seconds": [{k: s.time[k] / max(1, s.count[k]) for k in s.time} for s in pipeline],
    }
    return TrainResult(losses, trace, trained, metrics)
