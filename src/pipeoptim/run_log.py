"""A run's numbers in TensorBoard and Weights & Biases, where people watch training, written by
one process, rank 0: TensorBoard event files with ``fit(log_dir=DIR)`` (``pipeoptim train
--tensorboard DIR``), a Weights & Biases run with ``wandb=PROJECT`` (``--wandb PROJECT``).

fit (:class:`pipeoptim.fit.FitRun`) hands a :class:`RunLog` what it hands its callbacks (and the
command line writes to ``metrics.jsonl``): each mini-batch's loss, each evaluation's entry, each
epoch's entry, and at the end the run's metrics; the lrs are read from the stages' own record of
each update (:class:`pipeoptim.runtime.record.UpdateEntry`, the ``TrainResult``'s
``update_trace``). Nothing is computed again. Every value is written against the step, the
mini-batches trained so far in the Pipeline's life (each mini-batch is one update of every stage,
an fp16 update skipped aside), with the wall time it was written at, steps in increasing order:

* ``train/loss``: the loss of mini-batch ``step`` (1, 2, ...), as ``on_batch`` receives it;
* ``train/lr``: the lr of update ``step`` (``train/lr/stage{k}`` per stage once the stages' lrs
  differ, as a delay correction makes them; ``/group{g}`` per parameter group where a stage has
  several). A mini-batch's loss waits for its update's lrs, and both are written together;
* ``eval/metric``: each evaluation (every ``eval_every``, each epoch's end), at the step it
  evaluated;
* at each epoch's end (a continuous run: its end) ``train/epoch_loss`` and
  ``train/samples_per_second``, the epoch's; with ``diagnose_every``, per stage
  ``diagnostic/stage{k}/prediction_error`` and ``diagnostic/stage{k}/staleness_error``;
* at the end ``run/samples_per_second`` (the TrainResult's) and per stage
  ``memory/stage{k}/state_bytes`` (its training state's total: ``state_memory``) and
  ``memory/stage{k}/activations_peak_bytes``.

A run measures no bubble (``pipeoptim bench`` does). Under torchrun the losses reach rank 0 at
each drain (a checkpoint, an evaluation, an epoch's end) and are written then, and the lrs are
those of the stages rank 0 holds. The packages are imported when a run asks for them, so the
engine imports without either; a run that asks for one that is not installed is refused, with
the command that installs it, before it trains.
"""
from __future__ import annotations

import importlib
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .errors import option

#: how to install what each sink needs, as a refusal names it
INSTALL = {"tensorboard": "pip install tensorboard (in a clone of pipeoptim: pip install '.[lab]')",
           "wandb": "pip install wandb"}


def _module(name: str) -> Any:
    """The module ``name``, or None where it cannot be imported."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def check_run_log(log_dir: Any, wandb: Optional[str]) -> None:
    """Refuse, with the command that installs it, a ``log_dir`` without the tensorboard package
    or a ``wandb`` project without the wandb package (on every rank alike)."""
    if log_dir is not None and _module("tensorboard") is None:
        raise ValueError(f"{option('log_dir')} writes TensorBoard event files, which needs the tensorboard "
                         f"package: {INSTALL['tensorboard']}")
    if wandb is not None and _module("wandb") is None:
        raise ValueError(f"{option('wandb')} logs to Weights & Biases, which needs the wandb package: "
                         f"{INSTALL['wandb']}")


class TensorBoardSink:
    """Scalars to TensorBoard event files in ``log_dir`` with torch's ``SummaryWriter``;
    ``purge_step``: a resumed run's first step (TensorBoard drops what an earlier run wrote
    from there on)."""

    def __init__(self, log_dir: Any, purge_step: Optional[int] = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def scalars(self, step: int, values: Dict[str, float]) -> None:
        walltime = time.time()
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step, walltime=walltime)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Scalars to a Weights & Biases run of ``project`` (``wandb.init(project=...)``; wandb
    reads ``WANDB_MODE``, e.g. offline, itself)."""

    def __init__(self, project: str) -> None:
        self.run = importlib.import_module("wandb").init(project=project)

    def scalars(self, step: int, values: Dict[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


class RunLog:
    """What one process writes of a run to its sinks, steps in increasing order. ``stages``: the
    stages this process holds (their records give each update's lrs)."""

    def __init__(self, sinks: List[Any], stages: List[Any]) -> None:
        self.sinks, self.stages = sinks, stages
        self.read = [len(s.record.updates) for s in stages]  #: per stage, update entries read
        self.lrs: Dict[int, Dict[int, Tuple[float, ...]]] = {}  #: step -> stage -> lrs, not written yet
        self.losses: Dict[int, float] = {}                      #: step -> loss, not written yet
        self.per_stage = False  #: the stages' lrs differed at some update: one curve per stage since

    # -- what fit hands it ----------------------------------------------------------------------
    def batch(self, step: int, loss: float) -> None:
        """Mini-batch ``step``'s loss; written with its update's lrs once those are known."""
        self.losses[step] = loss
        self.write_ready()

    def evaluation(self, step: int, entry: Dict[str, Any]) -> None:
        """An evaluation's entry (``on_eval``'s), of the weights after ``step`` mini-batches."""
        self.write_through(step)
        self.write(step, {"eval/metric": entry["metric"]})
        self.flush()

    def epoch(self, step: int, entry: Dict[str, Any]) -> None:
        """An epoch's entry (``on_epoch``'s), at its end after ``step`` mini-batches."""
        self.write_through(step)
        values = {"train/epoch_loss": entry["loss"], "train/samples_per_second": entry["samples_per_second"]}
        for k, d in enumerate(entry.get("prediction_error") or []):
            if d.get("probes"):
                values[f"diagnostic/stage{k}/prediction_error"] = d["prediction_error"]
                values[f"diagnostic/stage{k}/staleness_error"] = d["staleness_error"]
        self.write(step, values)
        self.flush()

    def finish(self, step: int, metrics: Dict[str, Any]) -> None:
        """The run's metrics (the TrainResult's), after its last mini-batch, ``step``."""
        self.write_through(None)
        values = {"run/samples_per_second": metrics["samples_per_second"]}
        for k, (state, held) in enumerate(zip(metrics["state_memory"], metrics["activations"])):
            values[f"memory/stage{k}/state_bytes"] = state["total"]
            values[f"memory/stage{k}/activations_peak_bytes"] = held["peak_bytes"]
        self.write(step, values)

    def wrap(self, on_batch: Optional[Callable[..., Any]], on_eval: Optional[Callable[..., Any]],
             on_epoch: Optional[Callable[..., Any]], eval_step: Callable[[Dict[str, Any]], int],
             epoch_step: Callable[[], int]) -> Dict[str, Callable[..., Any]]:
        """fit's callbacks, each writing here first and then calling the caller's own:
        ``on_batch(index, loss)`` (step ``index + 1``), ``on_eval(entry)`` (step
        ``eval_step(entry)``), ``on_epoch(epoch, entry)`` (step ``epoch_step()``)."""
        def batch(index: int, loss: float) -> None:
            self.batch(index + 1, loss)
            if on_batch is not None:
                on_batch(index, loss)

        def evaluation(entry: Dict[str, Any]) -> None:
            self.evaluation(eval_step(entry), entry)
            if on_eval is not None:
                on_eval(entry)

        def epoch(number: int, entry: Dict[str, Any]) -> None:
            self.epoch(epoch_step(), entry)
            if on_epoch is not None:
                on_epoch(number, entry)
        return {"on_batch": batch, "on_eval": evaluation, "on_epoch": epoch}

    # -- writing ----------------------------------------------------------------------------------
    def read_updates(self) -> int:
        """Take the stages' new update entries; the last update every stage has recorded (-1: none)."""
        for i, stage in enumerate(self.stages):
            entries = stage.record.updates
            for entry in entries[self.read[i]:]:
                self.lrs.setdefault(entry.update + 1, {})[entry.stage] = entry.lrs
            self.read[i] = len(entries)
        return min((s.record.updates[-1].update if s.record.updates else -1 for s in self.stages), default=-1)

    def write_ready(self) -> None:
        """Write each pending step whose loss and lrs are both known, in order, up to the first
        that is not."""
        updated = self.read_updates() + 1
        for step in sorted(set(self.losses) | set(self.lrs)):
            if step not in self.losses or step > updated:
                return
            self.write_step(step)

    def write_through(self, last: Optional[int]) -> None:
        """Write every pending step up to ``last`` (None: all), with what is known of it."""
        self.read_updates()
        for step in sorted(set(self.losses) | set(self.lrs)):
            if last is not None and step > last:
                return
            self.write_step(step)

    def write_step(self, step: int) -> None:
        values = {"train/loss": self.losses.pop(step)} if step in self.losses else {}
        by_stage = self.lrs.pop(step, {})
        self.per_stage = self.per_stage or len(set(by_stage.values())) > 1
        shown = by_stage if self.per_stage else dict(list(by_stage.items())[:1])
        for stage, lrs in sorted(shown.items()):
            name = f"train/lr/stage{stage}" if self.per_stage else "train/lr"
            for g, lr in enumerate(lrs):
                values[name if len(lrs) == 1 else f"{name}/group{g}"] = lr
        self.write(step, values)

    def write(self, step: int, values: Dict[str, float]) -> None:
        if values:
            for sink in self.sinks:
                sink.scalars(step, values)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_run_log(settings: Any, rank: int, stages: List[Any], first_step: int) -> Optional[RunLog]:
    """The RunLog of fit's ``settings`` (its ``log_dir`` and ``wandb``, their packages checked
    by :func:`check_run_log` first) on rank 0, None elsewhere or where neither is given.
    ``first_step``: the run's first mini-batch, from 1 (more: a resumed run, or a later ``fit``)."""
    if rank != 0 or (settings.log_dir is None and settings.wandb is None):
        return None
    sinks: List[Any] = []
    try:
        if settings.log_dir is not None:
            sinks.append(TensorBoardSink(settings.log_dir, purge_step=first_step if first_step > 1 else None))
        if settings.wandb is not None:
            sinks.append(WandbSink(settings.wandb))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return RunLog(sinks, stages)
