"""The engine a user drives: ``pipeoptim.Pipeline``.

A Pipeline takes plain PyTorch objects (an ``nn.Sequential``, a loss function, factories for
the optimizer and the learning-rate scheduler) and trains a copy of the model with a pipeline
method, stage by stage, on the devices given. It is driven in one of two ways, one
implementation::

    pipe = pipeoptim.Pipeline(model, method="pipeoptim", stages=4, loss_fn=F.cross_entropy,
                              optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                              lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, warmup))
    result = pipe.fit(loader, epochs=3, eval_loader=test_loader, metric=accuracy)

    # or by hand
    for x, y in loader:
        losses = pipe.step(x, y)    # the mini-batch losses that completed meanwhile
    losses += pipe.flush()          # drain: every stage has applied every mini-batch

The loader is any iterable of ``(inputs, target)`` (a ``DataLoader``, a generator, a list) and
is read lazily: one mini-batch per :meth:`Pipeline.step`, so host memory does not grow with the
epoch. Between drains the pipeline runs one schedule (a *segment*); :meth:`Pipeline.flush` ends
it. An asynchronous method drains only at a flush (the end of an epoch, a checkpoint, an
evaluation; docs/architecture.md, "Schedules as data").
"""
from __future__ import annotations

import base64
import copy
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .checkpoint import (checkpoint_name, latest_checkpoint, load_stage, prune, read_manifest,
                         save_manifest, save_stage, set_rng_state)
from .errors import NonFiniteLoss
from .methods import get_method
from .runtime import named_state
from .runtime.build import OptimizerFactory, SchedulerFactory, build_stages
from .runtime.defaults import DEFAULT_TIMEOUT
from .runtime.distributed import DistributedExecutor
from .runtime.local import LocalExecutor
from .runtime.microbatch import batch_size, split_batch
from .runtime.spec import RunSpec, checkpoint_settings, next_drain, resolve
from .runtime.stage import PRECISIONS, Stage, TraceEntry, UpdateEntry, to_device
from .torchrun import Torchrun, layout

Batch = Tuple[Any, torch.Tensor]
Metric = Callable[[Any, torch.Tensor], Any]
DeviceSpec = Union[str, torch.device, Sequence[Union[str, torch.device]]]
CLIP_SCOPES = ("stage", "global")


@dataclass
class TrainResult:
    """What a run produced."""

    losses: List[float]                 #: one per mini-batch, in batch order, all epochs
    version_trace: List[TraceEntry]     #: per (stage, micro-batch, pass): version and steps
    model: nn.Sequential                #: the trained copy of the model
    metrics: Dict[str, Any] = field(default_factory=dict)
    #: per (stage, update): the learning rates that update applied
    update_trace: List[UpdateEntry] = field(default_factory=list)


class OnStageDevices(nn.Module):
    """The trained model as one module whose forward runs each stage's layers on that stage's
    device, moving the activations between them, and returns the output on the CPU: what a
    task's evaluation (written for a model on one device) can call when the stages are spread.
    ``train()``/``eval()`` reach the model inside."""

    def __init__(self, model: nn.Sequential, stages: Sequence[Stage]) -> None:
        super().__init__()
        self.model = model
        self._parts = [(stage.module, stage.device) for stage in stages]

    def forward(self, inputs: Any) -> Any:
        value = inputs
        for module, device in self._parts:
            value = module(to_device(value, device))
        return to_device(value, torch.device("cpu"))


def resolve_devices(devices: DeviceSpec, stages: int) -> List[torch.device]:
    """One device per stage. ``"auto"``: ``cuda:0..N-1`` when N GPUs are visible, the GPUs in
    contiguous blocks when fewer are (stage k on ``cuda:k*G//N``), else the CPU. One device
    (``"cpu"``, ``"cuda:1"``) puts every stage there; a list gives stage k ``devices[k]``."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if isinstance(devices, str) and devices == "auto":
        if visible == 0:
            return [torch.device("cpu")] * stages
        return [torch.device("cuda", k * visible // stages) for k in range(stages)]
    if isinstance(devices, (str, torch.device)):
        devices = [devices] * stages
    try:
        chosen = [torch.device(d) for d in devices]
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"devices: {error}; give 'auto', a device such as 'cpu' or 'cuda:0', or "
                         f"one per stage") from None
    if len(chosen) != stages:
        raise ValueError(f"devices lists {len(chosen)} devices for {stages} stages; give one per "
                         f"stage, one device for all, or 'auto'")
    for d in chosen:
        if d.type == "cuda":
            index = d.index if d.index is not None else 0
            if index >= visible:
                raise ValueError(f"device {d} does not exist: {visible} CUDA device(s) visible; "
                                 f"use devices='auto' or fewer stages per GPU")
        elif d.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise ValueError("device mps is not available on this machine")
    return [torch.device("cuda", d.index or 0) if d.type == "cuda" else d for d in chosen]


class Pipeline:
    """A copy of ``model`` split into pipeline stages, trained with ``method``.

    Args:
        model: an initialised ``nn.Sequential`` of stage-able blocks (blocks may pass tuples of
            tensors). It is copied, never modified; :meth:`model` returns the trained copy, whose
            parameters keep the original names.
        method: a name from :func:`pipeoptim.method_names` (``sequential``, ``gpipe``,
            ``1f1b-flush``, ``async-naive``, ``pipedream``, ``pipedream-2bw``, ``spectrain``,
            ``xpipe``, ``pipeoptim``).
        loss_fn: ``loss_fn(output, target) -> scalar tensor``, a mean over the mini-batch.
        optimizer: ``optimizer(params) -> torch.optim.Optimizer``, called once per stage with that
            stage's parameters.
        stages / partition / partitioner: ``stages=N`` cut by ``partitioner`` (``uniform`` or
            ``params``), or ``partition=[layers per stage]``.
        micro_batches: micro-batches per mini-batch for the methods that use them (default: the
            method's own: N for gpipe and 1f1b-flush, 2 for xpipe, 1 for the others).
        lr_scheduler: ``lr_scheduler(optimizer) -> LRScheduler``, called once per stage. Each
            stage steps its scheduler right after its own update, so update j has the same lr on
            every stage whatever the method; the prediction reads the group's lr as it is then.
        clip_grad_norm: clip the gradient norm to this before every update.
        clip_scope: ``"stage"`` (default) clips each stage's gradient on its own;
            ``"global"`` clips by the norm over all stages (as torchtitan does), for synchronous
            methods only: an asynchronous stage never holds the same mini-batch's gradients as
            the others at the moment it updates.
        precision: ``"fp32"`` or ``"bf16"``: forwards and backwards under ``torch.autocast`` of
            each stage's device; parameters, gradients, optimizer state and prediction stay fp32.
        devices: ``"auto"``, one device for every stage, or one per stage (see
            :func:`resolve_devices`). Inputs go to the first stage's device, targets to the
            last's, activations and gradients between the stages' devices.
        diagnose_every: every K-th micro-batch, measure how far the weights its forward used
            were from those live at its backward (``metrics["prediction_error"]``); 0: off.
        timeout: under torchrun, seconds a stage waits for a peer before the run fails.
        threads: under torchrun on the CPU, compute threads per stage process (default 1, so
            that N processes on N cores do not oversubscribe them); None leaves torch's.
        data_parallel: under torchrun, D replicas of the N-stage pipeline (WORLD_SIZE = N x D;
            default: inferred from WORLD_SIZE and the stages). Each replica reads its own shard
            of the data (give the loader a ``DistributedSampler(dataset, num_replicas=
            pipe.data_parallel_size, rank=pipe.data_parallel_rank)``; every stage of a replica
            iterates the same shard); before every update each stage averages its gradients over
            its replicas (buckets sent during the last backward), so weights, optimizer state and
            predictions stay identical. Losses and metrics are the means over the replicas.
        **method_options: the method's own options: ``steps``, ``backward``, ``sgd_momentum``
            for pipeoptim; ``vertical_sync`` for pipedream; and the delay corrections, all off
            by default (formulas and costs in :mod:`pipeoptim.weights.corrections`):

            * ``lr_correction="delay"`` with ``lr_correction_steps=T`` (async-naive, pipedream,
              spectrain, xpipe, pipeoptim): PipeMare's lr(t) / tau_k ** (1 - min(t/T, 1)) at
              stage k, tau_k = N-1-k; the prediction uses the corrected lr.
            * ``sync_warmup=K`` (the same methods): the run's first K mini-batches with 1F1B and
              a flush, then the method's asynchronous schedule.
            * ``horizon="scheduled"`` (spectrain, xpipe, pipeoptim): predict over the
              scheduler's lrs of the next s updates instead of s * lr(t).
            * ``delta="ema"`` with ``ema_decay`` (default 0.9) (the same three): Delta is the
              moving average of the updates applied, per unit lr; one more weight copy.
            * ``prediction_warmup=T`` (the same three): the step count ramps as s * min(1, t/T).

    Under ``torchrun --nproc-per-node N`` each process runs one stage (see
    :mod:`pipeoptim.torchrun`): every rank builds the Pipeline and iterates the same loader;
    ``stages`` defaults to the number of processes.
    """

    def __init__(self, model: nn.Sequential, *, method: str = "pipeoptim",
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], optimizer: OptimizerFactory,
                 stages: Optional[int] = None, partition: Optional[Sequence[int]] = None,
                 partitioner: str = "uniform", micro_batches: Optional[int] = None,
                 lr_scheduler: Optional[SchedulerFactory] = None,
                 clip_grad_norm: Optional[float] = None, clip_scope: str = "stage",
                 precision: str = "fp32", devices: DeviceSpec = "auto", diagnose_every: int = 0,
                 timeout: float = DEFAULT_TIMEOUT, threads: Optional[int] = 1,
                 data_parallel: Optional[int] = None, **method_options: Any) -> None:
        if not isinstance(model, nn.Sequential):
            raise ValueError(f"model must be an nn.Sequential of stage-able blocks, got "
                             f"{type(model).__name__}; wrap its layers, e.g. nn.Sequential(*blocks)")
        if not callable(loss_fn):
            raise ValueError("loss_fn must be a function (output, target) -> scalar loss")
        if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError("optimizer must be a factory called with each stage's parameters, "
                             "e.g. lambda params: torch.optim.SGD(params, lr=0.1), not an optimizer")
        if lr_scheduler is not None and (not callable(lr_scheduler) or hasattr(lr_scheduler, "step")):
            raise ValueError("lr_scheduler must be a factory called with each stage's optimizer, "
                             "e.g. lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, f), not a scheduler")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if clip_scope not in CLIP_SCOPES:
            raise ValueError(f"clip_scope must be 'stage' or 'global', got {clip_scope!r}")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be a positive max norm, got {clip_grad_norm}")
        if diagnose_every < 0:
            raise ValueError(f"diagnose_every must be 0 (off) or more, got {diagnose_every}")
        self._torchrun = Torchrun.join(devices, timeout, threads)
        replicas = 1
        if self._torchrun is None and data_parallel not in (None, 1):
            raise ValueError(f"data_parallel={data_parallel} needs torchrun with N x {data_parallel} "
                             f"processes (one per stage of each replica)")
        if self._torchrun is not None:
            n, replicas = layout(self._torchrun.world, method, stages, partition, data_parallel)
            if partition is None and method != "sequential":
                stages = n
        self.spec: RunSpec = resolve(model, method=method, stages=stages, partition=partition,
                                     partitioner=partitioner, micro_batches=micro_batches,
                                     method_options=method_options)
        self.method = get_method(method)
        if clip_scope == "global" and clip_grad_norm is not None and not self.method.synchronous:
            raise ValueError(f"clip_scope='global' needs every stage to hold the same mini-batch's "
                             f"gradients when it updates, which only synchronous methods do; "
                             f"{method} updates each stage at its own time: use clip_scope='stage'")
        if self._torchrun is None:
            self.devices = resolve_devices(devices, self.spec.stages)
        else:  # this process's stage on this process's device; the others are elsewhere
            self.devices = [self._torchrun.device] * self.spec.stages
        self.precision = precision
        self._model = copy.deepcopy(model)
        self._model.train()
        self._optimizer_factory = optimizer
        self.stages: List[Stage] = build_stages(
            self._model, self.spec.partition, self.method, self.spec.options, optimizer, loss_fn,
            lr_scheduler=lr_scheduler, clip_grad_norm=clip_grad_norm if clip_scope == "stage" else None,
            precision=precision, devices=self.devices,
            only=self._torchrun.rank % self.spec.stages if self._torchrun is not None else None)
        if self._torchrun is not None:
            self._torchrun.connect(self.spec.stages, replicas)
            self.stages[0].grad_sync = self._torchrun.gradient_averager()
        for stage in self.stages:
            stage.diagnose_every = diagnose_every
        self.clip_global = clip_grad_norm if clip_scope == "global" else None
        self.losses: List[float] = []    #: every completed mini-batch's loss, in order
        self.batches_done = 0            #: mini-batches fed so far (the trace numbering)
        self.samples_done = 0
        self._executor: Optional[LocalExecutor] = None
        self._segment_start = 0          #: index of the open segment's first mini-batch
        self._expected: Optional[int] = None
        self._on_batch: Optional[Callable[[int, float], None]] = None
        self._label: Callable[[int], str] = lambda index: f"mini-batch {index}"

    # -- driving by hand ----------------------------------------------------------------------
    @property
    def microbatches(self) -> int:
        """Micro-batches per mini-batch."""
        return self.spec.microbatches

    def step(self, inputs: Any, target: torch.Tensor) -> List[float]:
        """Feed one mini-batch; return the losses of the mini-batches completed meanwhile (an
        asynchronous pipeline reports a mini-batch's loss when its last stage has it)."""
        size = batch_size(inputs)
        micro = split_batch(inputs, target, self.spec.microbatches)
        if self._executor is None:
            offset = self.batches_done * self.spec.microbatches
            if self._torchrun is None:
                self._executor = LocalExecutor(self.stages, self._schedule_for, expected=self._expected,
                                               trace_offset=offset, clip_global=self.clip_global)
            else:
                self._executor = DistributedExecutor(self.stages[0], self._torchrun.comm, self._schedule_for,
                                                     expected=self._expected, trace_offset=offset,
                                                     clip_global=self.clip_global)
            self._segment_start = self.batches_done
        self.batches_done += 1
        self.samples_done += size
        self._executor.feed(micro)
        return self._collect()

    def flush(self) -> List[float]:
        """Drain: finish every mini-batch fed, so that every stage holds one set of weights.
        Returns the losses completed meanwhile."""
        if self._executor is None:
            return []
        try:
            self._executor.finish()
            done = self._collect(wait=True)
            if self._torchrun is not None:  # every rank gets the last stage's losses, and checks them
                segment = self._torchrun.share_losses(self.losses[self._segment_start:])
                if not self._torchrun.is_last:
                    self.losses += segment
                    done = segment
                for index, loss in enumerate(segment, start=self._segment_start):
                    self._record(index, loss)
            return done
        finally:
            self._executor = None
            self._expected = None

    def close(self) -> None:
        """Under torchrun: end this process's part of the job now (wait for the sends in flight,
        destroy the process groups this Pipeline made, the job's too if it started it). It runs
        by itself at the script's exit, while the interpreter is whole; call it, or use the
        Pipeline as a context manager, to end earlier. A closed Pipeline cannot train or gather
        again. One process: nothing to release."""
        if self._torchrun is not None:
            self._torchrun.leave()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def rank(self) -> int:
        """This process's rank under torchrun; 0 in a single process (print on rank 0)."""
        return self._torchrun.rank if self._torchrun is not None else 0

    @property
    def data_parallel_rank(self) -> int:
        """Which replica of the pipeline this process belongs to (its data shard)."""
        return self._torchrun.replica if self._torchrun is not None else 0

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the pipeline (1 without data parallelism)."""
        return self._torchrun.replicas if self._torchrun is not None else 1

    @property
    def drained(self) -> bool:
        """No mini-batch fed since the last :meth:`flush` (every stage holds one set of weights)."""
        return self._executor is None or not self._executor.fed_batches

    def _schedule_for(self, batches: int):
        return self.method.build_schedule(self.spec.stages, self.spec.microbatches, batches,
                                          first_batch=self._segment_start, options=self.spec.options)

    def _collect(self, wait: bool = False) -> List[float]:
        """The losses completed in this process. Under torchrun they are checked and reported
        at the drain, on every rank at once (so that all stop at the same mini-batch)."""
        done = []
        for window, loss in self._executor.take_completed(wait):
            index = self._segment_start + window
            assert index == len(self.losses), "losses complete in mini-batch order"
            self.losses.append(loss)
            done.append(loss)
            if self._torchrun is None:
                self._record(index, loss)
        return done

    def _record(self, index: int, loss: float) -> None:
        if not math.isfinite(loss):
            raise NonFiniteLoss(f"loss became {loss} at {self._label(index)}")
        if self._on_batch is not None:
            self._on_batch(index, loss)

    # -- evaluation ---------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, loader: Iterable[Batch], metric: Optional[Metric] = None) -> float:
        """Forward only, stage by stage on the live weights (no prediction), in eval mode.

        ``metric(output, target)`` gives a mini-batch's value (a number or a 0-dim tensor,
        a mean over the mini-batch); the result is the mean over all samples. Without a metric,
        the mean loss. The pipeline must be drained (:meth:`flush`)."""
        self._require_drained("evaluate")
        score = metric or self.stages[-1].loss_fn
        was_training = self._model.training
        if self._torchrun is not None:
            self._model.eval()
            try:
                return self._torchrun.evaluate(self.stages[0], loader, score)
            finally:
                self._model.train(was_training)
        self._model.eval()
        total, count = 0.0, 0
        values = []
        try:
            for inputs, target in loader:
                out = self.forward(inputs)
                n = batch_size(inputs)
                with self.stages[-1].autocast():
                    values.append((score(out, to_device(target, self.devices[-1])), n))
                count += n
        finally:
            self._model.train(was_training)
        if count == 0:
            raise ValueError("the evaluation loader yielded no mini-batches")
        for value, n in values:  # read back once the device has all the work queued
            total += float(value) * n
        return total / count

    @torch.no_grad()
    def forward(self, inputs: Any) -> Any:
        """The model's output for ``inputs``, through every stage on its device (no gradients,
        the live weights, the current train/eval mode). One process only: under torchrun use
        :meth:`evaluate`, or :meth:`model` for the whole model."""
        if self._torchrun is not None:
            raise RuntimeError("forward() runs the stages of one process; under torchrun use "
                               "evaluate(loader, metric) or model()")
        value = inputs
        for stage in self.stages:
            with stage.autocast():
                value = stage.module(to_device(value, stage.device))
        return value

    def model(self) -> nn.Sequential:
        """The trained model (the Pipeline's own copy, stage k's layers on ``devices[k]``), with
        the original parameter names. Call :meth:`flush` first for weights every mini-batch fed
        has updated. Under torchrun every rank must call it: each stage's weights are gathered
        into every rank's copy."""
        if self._torchrun is not None:
            own = {k: v.detach().to("cpu", copy=True) for k, v in self.stages[0].module.state_dict().items()}
            merged: Dict[str, torch.Tensor] = {}
            for part in self._torchrun.gather(own, "gathering the model's weights"):
                merged.update(part)
            self._model.load_state_dict(merged)
        return self._model

    # -- state --------------------------------------------------------------------------------
    def _require_drained(self, what: str) -> None:
        if not self.drained:
            raise RuntimeError(f"{what} needs a drained pipeline: call flush() first")

    def state_dict(self) -> Dict[str, Any]:
        """Model, per-stage optimizer, scheduler and weight-policy state, keyed by the original
        parameter names, so that it loads into a Pipeline with another partition (exactly, for
        the synchronous methods; an asynchronous one resumes as after a drain, its optimizer and
        predictor state carried over by name). The pipeline must be drained."""
        self._require_drained("state_dict")
        stages = [named_state.stage_state(stage) for stage in self.stages]
        if self._torchrun is not None:
            stages = self._torchrun.gather(stages[0], "gathering the stages' state")
        return {"format": 1, "method": self.spec.method, "partition": list(self.spec.partition),
                "model": {k: v.detach().to("cpu", copy=True) for k, v in self.model().state_dict().items()},
                "stages": stages,
                "losses": list(self.losses), "batches_done": self.batches_done,
                "samples_done": self.samples_done}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s output (from this partition or another)."""
        self._require_drained("load_state_dict")
        if state.get("method") != self.spec.method:
            raise ValueError(f"state is of method {state.get('method')!r}, this pipeline runs "
                             f"{self.spec.method!r}")
        missing = set(self._model.state_dict()) - set(state["model"])
        if missing:
            raise ValueError(f"state does not fit this model: no {', '.join(sorted(missing)[:3])}")
        self._model.load_state_dict(state["model"])
        named_state.load_stages(self.stages, state["stages"])
        self.losses = list(state.get("losses", []))
        self.batches_done = int(state.get("batches_done", 0))
        self.samples_done = int(state.get("samples_done", 0))

    # -- training loop ------------------------------------------------------------------------
    def fit(self, loader: Iterable[Batch], epochs: int = 1, *,
            eval_loader: Optional[Iterable[Batch]] = None, metric: Optional[Metric] = None,
            evaluate: Optional[Callable[[nn.Sequential], float]] = None,
            eval_every: Optional[int] = None,
            on_batch: Optional[Callable[[int, float], None]] = None,
            on_epoch: Optional[Callable[[int, Dict[str, Any]], None]] = None,
            on_eval: Optional[Callable[[Dict[str, Any]], None]] = None,
            checkpoint_dir: Optional[Union[str, Path]] = None, checkpoint_every: Optional[int] = None,
            resume: bool = False, continuous: bool = False) -> TrainResult:
        """Train for ``epochs`` passes over ``loader`` (any iterable of ``(inputs, target)``,
        iterated once per epoch; ``len()`` is used when it exists, not required).

        After each epoch the pipeline drains and is evaluated: ``evaluate(model)`` if given,
        else :meth:`evaluate` on ``eval_loader`` with ``metric``; the value is the epoch's
        ``metric``. ``on_batch(index, loss)`` is called as each mini-batch's loss completes,
        ``on_epoch(epoch, entry)`` after each epoch. ``continuous`` runs every epoch in one
        schedule, with no drain between epochs (evaluation only at the end).

        ``eval_every=K`` also drains and evaluates every K mini-batches of an epoch (counted
        from the epoch's start, as ``checkpoint_every``), for curves of the metric against
        updates and time. Every evaluation, the epoch-end ones included, is recorded in
        ``TrainResult.metrics["evaluations"]`` and passed to ``on_eval(entry)`` as
        ``{"epoch", "batch", "updates", "metric", "seconds"}``: the epoch (0-based), the
        mini-batches trained so far in the run, the optimizer updates applied so far (each
        stage's weight version), the value, and the training wall time so far (fit's time less
        the time spent evaluating and writing checkpoints). An evaluation needs one set of
        weights, so the pipeline drains there, as at a checkpoint: a synchronous method
        (``sequential``, ``gpipe``, ``1f1b-flush``) trains exactly as without ``eval_every``, but
        an asynchronous one restarts its warm-up after each drain, so its losses and metrics
        depend on K (a smaller K means fewer stale updates). ``eval_every`` needs ``evaluate``
        or ``eval_loader`` and cannot be combined with ``continuous``.

        With ``checkpoint_dir`` the pipeline drains and every stage is saved every
        ``checkpoint_every`` mini-batches and at each epoch's end; ``resume=True`` continues
        from the newest checkpoint there, to the same losses as an uninterrupted run (the
        run must have the same ``checkpoint_every`` and ``eval_every``, so that it drains at
        the same points; the evaluations made before the checkpoint are carried over). The
        loader must then give the same mini-batches in the same order: a list, or a
        ``DataLoader`` that shuffles with torch's global generator (its state at the start of
        the epoch is restored before the loader is iterated again; the mini-batches already
        trained are read and skipped).
        """
        if epochs < 1:
            raise ValueError(f"epochs must be at least 1, got {epochs}")
        if eval_loader is not None and evaluate is not None:
            raise ValueError("give evaluate=fn(model) or eval_loader (with metric), not both")
        if eval_every is not None and evaluate is None and eval_loader is None:
            raise ValueError("eval_every needs something to evaluate: give evaluate=fn(model) or "
                             "eval_loader (with metric)")
        self._require_drained("fit")
        try:
            num_batches: Optional[int] = len(loader)  # type: ignore[arg-type]
        except TypeError:
            num_batches = None
        if num_batches == 0:
            raise ValueError("the loader yields no mini-batches (is it empty, or is batch_size "
                             "larger than the data set with drop_last=True?)")
        segment, run_info = checkpoint_settings(self.spec, num_batches, checkpoint_every, continuous,
                                                eval_every)
        store = Path(checkpoint_dir) if checkpoint_dir is not None else None
        if resume and store is None:
            raise ValueError("resume=True needs checkpoint_dir")

        epoch_metrics: List[Dict[str, Any]] = []
        evaluations: List[Dict[str, Any]] = []
        seconds_before = 0.0  # training time of the run before its checkpoint (after a resume)
        start_epoch, start_batch, resume_rng, epoch_rng = 0, 0, None, None
        batch_base = self.batches_done  # mini-batches fed before this run
        if resume:
            found = self._resume_from(store, run_info)
            if found is not None:
                manifest, resume_rng = found
                epoch_metrics = manifest["epoch_metrics"]
                evaluations = list(manifest.get("evaluations", []))
                seconds_before = float(manifest.get("train_seconds", 0.0))
                start_epoch, start_batch = manifest["epoch"], manifest["batch"]
                epoch_rng = _decode_rng(manifest.get("epoch_rng"))
                batch_base = 0
        base = 0 if resume and start_epoch + start_batch else len(self.losses)  # this run's first loss

        self._on_batch = on_batch
        started = time.perf_counter()
        samples_at_start = self.samples_done
        epoch_start = time.perf_counter()
        probes_seen = [0] * len(self.stages)
        # seconds not spent training: every evaluation, checkpoint writes, and the evaluations
        # within an epoch (which the epochs' and the run's throughput leave out; as before
        # eval_every, they include the epoch-end evaluations and the checkpoint writes)
        paused = {"eval": 0.0, "save": 0.0, "mid_eval": 0.0, "mid_eval_epoch": 0.0}

        def label(index: int) -> str:
            if num_batches is None:
                return f"mini-batch {index - base}"
            return f"mini-batch {(index - base) % num_batches} of epoch {(index - base) // num_batches}"
        self._label = label

        def train_seconds() -> float:
            return seconds_before + time.perf_counter() - started - paused["eval"] - paused["save"]

        def evaluation(epoch: int, value: Optional[float] = None) -> Optional[float]:
            """Evaluate the drained pipeline (or take ``value``, already measured) and record it."""
            trained = self.batches_done - batch_base
            if evaluations and evaluations[-1]["batch"] == trained:
                return evaluations[-1]["metric"]  # a drain at the epoch's end already evaluated
            seconds = train_seconds()
            if value is None:
                began = time.perf_counter()
                value = self._epoch_metric(evaluate, eval_loader, metric)
                paused["eval"] += time.perf_counter() - began
            if value is None:
                return None
            entry = {"epoch": epoch, "batch": trained, "updates": int(self.stages[0].policy.version),
                     "metric": value, "seconds": seconds}
            evaluations.append(entry)
            if on_eval is not None:
                on_eval(entry)
            return value

        def save(epoch: int, batch: int, rng: Optional[torch.Tensor]) -> None:
            began = time.perf_counter()
            self._save(store, run_info, epoch, batch, epoch_metrics, rng,
                       {"evaluations": evaluations, "train_seconds": train_seconds()})
            paused["save"] += time.perf_counter() - began

        def close_epoch(epoch: int, seconds: float, samples: int, losses: List[float]) -> None:
            entry = {"epoch": epoch, "loss": sum(losses) / len(losses), "seconds": seconds,
                     "samples_per_second": samples / seconds if seconds > 0 else 0.0}
            epoch_metrics.append(entry)

        def finish_epoch_entry(epoch: int) -> None:
            nonlocal probes_seen
            entry = epoch_metrics[-1]
            if any(s.diagnose_every for s in self.stages):
                entry["prediction_error"] = [s.diagnostics_summary(i) for s, i in zip(self.stages, probes_seen)]
                probes_seen = [len(s.diagnostics) for s in self.stages]
                if self._torchrun is not None:
                    entry["prediction_error"] = [part for parts in self._torchrun.gather(
                        entry["prediction_error"], "gathering the diagnostic") for part in parts]
            value = evaluation(epoch)
            if value is not None:
                entry["metric"] = value
            if on_epoch is not None:
                on_epoch(entry["epoch"], entry)

        try:
            epoch_sizes: List[Tuple[int, int, int]] = []  # continuous runs: (epoch, mini-batches, samples)
            for epoch in range(start_epoch, epochs):
                skip = start_batch if epoch == start_epoch else 0
                if resume_rng is not None and not skip:
                    set_rng_state(resume_rng)  # the loader is created from the checkpoint's RNG
                    resume_rng = None
                if skip and epoch_rng is not None:
                    torch.set_rng_state(epoch_rng)  # as when this epoch's loader was first created
                epoch_rng_now = torch.get_rng_state()
                batch, samples = 0, 0
                for inputs, target in loader:
                    if batch < skip:
                        batch += 1
                        continue
                    if resume_rng is not None:
                        set_rng_state(resume_rng)  # the loader is positioned: continue the checkpoint's RNG
                        resume_rng = None
                    if self._executor is None:
                        self._expected = self._segment_length(batch, num_batches, (segment, eval_every),
                                                              continuous, epoch, epochs)
                    self.step(inputs, target)
                    samples += batch_size(inputs)
                    batch += 1
                    if continuous or batch == num_batches:
                        continue
                    checkpoint_due = bool(checkpoint_every) and batch % checkpoint_every == 0
                    eval_due = bool(eval_every) and batch % eval_every == 0
                    if checkpoint_due or eval_due:
                        self.flush()  # a segment ends at every checkpoint and every evaluation
                        if eval_due:
                            began = time.perf_counter()
                            evaluation(epoch)
                            paused["mid_eval_epoch"] += time.perf_counter() - began
                        if checkpoint_due and store is not None:
                            save(epoch, batch, epoch_rng_now)
                if batch == 0:
                    raise ValueError(f"the loader yielded no mini-batches in epoch {epoch}")
                if num_batches is not None and batch != num_batches:
                    raise ValueError(f"the loader yielded {batch} mini-batches in epoch {epoch} but its "
                                     f"len() is {num_batches}")
                if continuous:
                    epoch_sizes.append((epoch, batch, samples))
                    continue
                self.flush()
                close_epoch(epoch, time.perf_counter() - epoch_start - paused["mid_eval_epoch"], samples,
                            self.losses[len(self.losses) - batch:])
                finish_epoch_entry(epoch)
                if store is not None:
                    save(epoch + 1, 0, None)
                epoch_start = time.perf_counter()
                paused["mid_eval"] += paused["mid_eval_epoch"]
                paused["mid_eval_epoch"] = 0.0
            if continuous:
                self.flush()
                seconds = time.perf_counter() - epoch_start
                per_epoch = seconds / max(1, len(epoch_sizes))
                index = len(self.losses) - sum(b for _, b, _ in epoch_sizes)
                for epoch, count, samples in epoch_sizes:
                    close_epoch(epoch, per_epoch, samples, self.losses[index:index + count])
                    index += count
                finish_epoch_entry(epoch_sizes[-1][0])
        finally:
            self._on_batch = None
        elapsed = time.perf_counter() - started - paused["mid_eval"]
        result = self._result(epoch_metrics, self.samples_done - samples_at_start, elapsed)
        result.metrics["evaluations"] = evaluations
        return result

    def _segment_length(self, batch: int, num_batches: Optional[int], intervals: Sequence[Optional[int]],
                        continuous: bool, epoch: int, epochs: int) -> Optional[int]:
        """How many mini-batches the segment starting now holds, if known: up to the next
        checkpoint or evaluation (``intervals``), or the epoch's end."""
        if num_batches is None:
            return None
        if continuous:
            return num_batches * (epochs - epoch) - batch
        return next_drain(batch, num_batches, intervals) - batch

    def _epoch_metric(self, evaluate, eval_loader, metric) -> Optional[float]:
        if evaluate is not None and self._torchrun is not None:
            model = self.model()  # every rank gathers; each replica's first stage evaluates, on the CPU
            value = None
            if self._torchrun.stage == 0:
                cpu = model if self._torchrun.device.type == "cpu" else copy.deepcopy(model).cpu()
                value = float(evaluate(cpu))
                model.train()
            return float(self._torchrun.share(value, 0, "sharing the evaluation"))
        if evaluate is not None:
            on_cpu = all(d.type == "cpu" for d in self.devices)
            value = float(evaluate(self._model if on_cpu else OnStageDevices(self._model, self.stages)))
            self._model.train()
            return value
        if eval_loader is not None:
            return self.evaluate(eval_loader, metric)
        return None

    # -- checkpoints --------------------------------------------------------------------------
    def _save(self, store: Path, run_info: Dict[str, Any], epoch: int, batch: int,
              epoch_metrics: List[Dict[str, Any]], epoch_rng: Optional[torch.Tensor],
              extra: Optional[Dict[str, Any]] = None) -> Path:
        """Checkpoint every stage at (epoch, batch); ``extra`` goes into the manifest as is."""
        folder = store / checkpoint_name(epoch, batch)
        more = {"samples_done": self.samples_done, "epoch_rng": _encode_rng(epoch_rng), **(extra or {})}
        if self._torchrun is not None:  # every rank its stage file, the first rank the manifest
            self._torchrun.save(store, self.stages[0], run_info, (epoch, batch), self.losses, epoch_metrics,
                                more)
            return folder
        sums = {stage.index: save_stage(stage, folder) for stage in self.stages}
        save_manifest(folder, {**run_info, "epoch": epoch, "batch": batch, "losses": self.losses,
                               "epoch_metrics": epoch_metrics, **more}, sums)
        prune(store, keep=2)
        return folder

    def _resume_from(self, store: Path, run_info: Dict[str, Any]):
        """Load the newest checkpoint in ``store``; its manifest and RNG state (applied once
        the loader is positioned), or None if there is none yet."""
        if self._torchrun is not None:
            found = self._torchrun.resume(store, self.stages[0], run_info)
            if found is None:
                return None
            manifest, rng = found
            state = {"rng": rng}
        else:
            folder = latest_checkpoint(store)
            if folder is None:
                return None
            manifest = read_manifest(folder, expect=json.loads(json.dumps(run_info)))
            state = None
            for stage in self.stages:
                state = load_stage(folder, manifest, stage)
        self.losses = list(manifest["losses"])
        batches = manifest["batch"] + manifest["epoch"] * (run_info["batches_per_epoch"] or 0)
        self.batches_done = batches if run_info["batches_per_epoch"] else len(self.losses)
        self.samples_done = int(manifest.get("samples_done", 0))
        return manifest, state["rng"] if state is not None else None

    def _stage_reports(self) -> List[Dict[str, Any]]:
        """What each stage measured, in stage order (gathered from every process under torchrun)."""
        reports = [{"versions": round(s.policy.versions_peak, 3), "trace": s.trace, "updates": s.updates,
                    "seconds": {k: s.time[k] / max(1, s.count[k]) for k in s.time},
                    "diagnostics": s.diagnostics_summary() if s.diagnose_every else None,
                    "device": str(s.device)} for s in self.stages]
        if self._torchrun is not None:
            reports = self._torchrun.gather(reports[0], "gathering the stages' measurements")
        return reports

    def _result(self, epoch_metrics: List[Dict[str, Any]], samples: int, elapsed: float) -> TrainResult:
        reports = self._stage_reports()
        trace = sorted((e for r in reports for e in r["trace"]),
                       key=lambda e: (e.stage, e.microbatch, e.kind != "F"))
        diagnosing = any(r["diagnostics"] is not None for r in reports)
        spec = self.spec
        metrics = {
            "method": spec.method, "options": spec.options, "stages": spec.stages,
            "partition": spec.partition, "microbatches": spec.microbatches, "epochs": epoch_metrics,
            "samples_per_second": samples / elapsed if elapsed > 0 else 0.0, "seconds": elapsed,
            "weight_versions": [r["versions"] for r in reports],
            "weight_versions_design": self.method.weight_versions(spec.stages, **spec.options),
            "stage_seconds": [r["seconds"] for r in reports],
            "prediction_error": [r["diagnostics"] for r in reports] if diagnosing else None,
            "devices": [r["device"] for r in reports], "precision": self.precision,
            "processes": self._torchrun.world if self._torchrun is not None else 1,
        }
        updates = [u for r in reports for u in r["updates"]]
        return TrainResult(list(self.losses), trace, self._model, metrics, updates)


def _encode_rng(state: Optional[torch.Tensor]) -> Optional[str]:
    return base64.b64encode(state.numpy().tobytes()).decode() if state is not None else None


def _decode_rng(text: Optional[str]) -> Optional[torch.Tensor]:
    if not text:
        return None
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()
