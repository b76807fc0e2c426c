"""``Pipeline.fit``'s training loop, as named steps: :class:`FitRun`.

One FitRun is one call of :meth:`pipeoptim.pipeline.Pipeline.fit`: it resumes from the newest
whole checkpoint if asked and there is one (else it starts from the beginning; either way rank 0
says so on stderr, with the layout that wrote the checkpoint where it differs from this one:
:func:`say`), feeds the loader's mini-batches epoch by epoch, drains where a segment ends (a
checkpoint, an evaluation, an epoch's end), evaluates, checkpoints, keeps the epochs' metrics
and the run's clock (training time less evaluations and checkpoint writes), and assembles the
:class:`TrainResult`. It drives the Pipeline only through its public steps (``step``,
``flush``) and its world (:mod:`pipeoptim.world`), so it runs the same in one process and
under torchrun. With ``log_dir`` or ``wandb``, rank 0 writes what its callbacks receive to
TensorBoard or Weights & Biases (:mod:`pipeoptim.run_log`).
"""
from __future__ import annotations

import base64
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from .batches import loader_item
from .checkpoint import schedule_digest, set_rng_state
from .fit_checks import check_loader
from .config import FitConfig
from .run_log import check_run_log, open_run_log
from .runtime.microbatch import batch_size
from .runtime.spec import checkpoint_settings, next_drain
from .runtime.state_memory import state_memory
from .runtime.stage import TraceEntry, UpdateEntry
from .world import PendingCheckpoint, load_checkpoint, save_checkpoint

Batch = Tuple[Any, torch.Tensor]
Metric = Callable[[Any, torch.Tensor], Any]


@dataclass
class TrainResult:
    """What a run produced."""

    losses: List[float]                 #: one per mini-batch, in batch order, all epochs
    version_trace: List[TraceEntry]     #: per (stage, micro-batch, pass): version and steps
    #: the trained copy of the whole model, on every rank: under torchrun each stage's weights
    #: are gathered into every rank's copy (as :meth:`~pipeoptim.pipeline.Pipeline.model` does)
    model: nn.Module
    metrics: Dict[str, Any] = field(default_factory=dict)
    #: per (stage, update): the learning rates that update applied
    update_trace: List[UpdateEntry] = field(default_factory=list)


class FitRun:
    """One run of ``fit`` over ``loader`` (see :meth:`pipeoptim.pipeline.Pipeline.fit`)."""

    def __init__(self, pipe: "Pipeline", loader: Iterable[Batch], settings: FitConfig) -> None:  # noqa: F821
        self.pipe, self.loader, self.settings = pipe, loader, settings
        #: the checkpoint folder (None: no checkpoints)
        self.store = Path(settings.checkpoint_dir) if settings.checkpoint_dir is not None else None
        try:
            self.num_batches: Optional[int] = len(loader)  # type: ignore[arg-type]
        except TypeError:
            self.num_batches = None
        check_loader(self.num_batches)
        check_run_log(settings.log_dir, settings.wandb)  # their packages, before any work
        self.segment, self.run_info = checkpoint_settings(pipe.spec, self.num_batches, settings.checkpoint_every,
                                                          settings.eval_every)
        # a user's own schedule (None: the method's): a resume must run the same one
        self.run_info["schedule"] = schedule_digest(pipe.method.order) if pipe.method.order is not None else None
        self.epoch_metrics: List[Dict[str, Any]] = []
        self.evaluations: List[Dict[str, Any]] = []
        self.seconds_before = 0.0       #: training time of the run before its checkpoint (after a resume)
        self.start = (0, 0)             #: (epoch, mini-batch) the run starts from
        self.resume_rng: Optional[Dict[str, Any]] = None
        self.epoch_rng: Optional[torch.Tensor] = None
        self.batch_base = pipe.batches_done  #: mini-batches fed before this run
        self.probes_seen = [0] * len(pipe.stages)
        # seconds not spent training: every evaluation, checkpoint writes, and the evaluations within
        # an epoch (the throughputs leave out these only, not epoch-end evaluations or writes)
        self.paused = {"eval": 0.0, "save": 0.0, "mid_eval": 0.0, "mid_eval_epoch": 0.0}
        self.started = self.epoch_start = 0.0
        #: a checkpoint being written in the background (``async_checkpoint``), not named yet
        self.pending: Optional[PendingCheckpoint] = None

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> TrainResult:
        if self.settings.resume:
            self.resume()
        log = open_run_log(self.settings, self.pipe.rank, self.pipe.stages, self.pipe.batches_done + 1)
        if log is None:
            return self.train()
        # log_dir / wandb: rank 0's log is fed what the callbacks are fed, then the result's metrics
        self.settings = self.settings.replace(**log.wrap(
            self.settings.on_batch, self.settings.on_eval, self.settings.on_epoch,
            eval_step=lambda entry: self.batch_base + entry["batch"], epoch_step=lambda: self.pipe.batches_done))
        try:
            result = self.train()
            log.finish(self.pipe.batches_done, result.metrics)
        finally:
            log.close()
        return result

    def train(self) -> TrainResult:
        """Train from ``self.start`` to the end; the result."""
        pipe, settings = self.pipe, self.settings
        first_loss = 0 if settings.resume and sum(self.start) else len(pipe.losses)
        self.started = self.epoch_start = time.perf_counter()
        samples_at_start = pipe.samples_done
        with pipe.reporting(settings.on_batch, lambda index: self.label(index - first_loss)):
            sizes: List[Tuple[int, int, int]] = []  # continuous runs: (epoch, mini-batches, samples)
            for epoch in range(self.start[0], settings.epochs):
                batches, samples = self.train_epoch(epoch)
                if settings.continuous:
                    sizes.append((epoch, batches, samples))
                else:
                    self.end_epoch(epoch, batches, samples)
            if settings.continuous:
                self.end_continuous(sizes)
        self.finish_pending()
        elapsed = time.perf_counter() - self.started - self.paused["mid_eval"]
        result = self.result(pipe.samples_done - samples_at_start, elapsed)
        result.metrics["evaluations"] = self.evaluations
        return result

    def label(self, index: int) -> str:
        """How an error names the run's ``index``-th mini-batch."""
        if self.num_batches is None:
            return f"mini-batch {index}"
        return f"mini-batch {index % self.num_batches} of epoch {index // self.num_batches}"

    def resume(self) -> None:
        """Load the newest whole checkpoint, if any, and continue from its position; rank 0 says
        which (and any newer one passed over), or that there is none."""
        pipe = self.pipe
        found, passed = load_checkpoint(pipe.world, self.store, pipe.stages, self.run_info, pipe.state_names)
        for reason in passed:
            say(pipe, f"passed over a checkpoint that is not whole: {reason}")
        if found is None:
            say(pipe, f"{restart_words()}no checkpoint in {self.store} yet: training from the beginning")
            return
        folder, manifest, self.resume_rng = found
        now, before = layout_of(pipe), manifest.get("layout")
        changed = f"; written by {layout_words(before)}, now {layout_words(now)}" if before and before != now \
            else f" ({layout_words(now)})"
        say(pipe, f"{restart_words()}resumed from {folder} (epoch {manifest['epoch']}, mini-batch "
                  f"{manifest['batch']}){changed}")
        pipe.losses = list(manifest["losses"])
        per_epoch = self.run_info["batches_per_epoch"]
        pipe.batches_done = manifest["batch"] + manifest["epoch"] * per_epoch if per_epoch else len(pipe.losses)
        pipe.samples_done = int(manifest.get("samples_done", 0))
        self.epoch_metrics = manifest["epoch_metrics"]
        self.evaluations = list(manifest.get("evaluations", []))
        self.seconds_before = float(manifest.get("train_seconds", 0.0))
        self.start = (manifest["epoch"], manifest["batch"])
        self.epoch_rng = _decode_rng(manifest.get("epoch_rng"))
        self.batch_base = 0

    def train_epoch(self, epoch: int) -> Tuple[int, int]:
        """Feed one epoch (after a resume: the rest of it), draining, evaluating and
        checkpointing where due within it; (mini-batches, samples) fed."""
        pipe, settings, num_batches = self.pipe, self.settings, self.num_batches
        skip = self.start[1] if epoch == self.start[0] else 0
        if self.resume_rng is not None and not skip:
            set_rng_state(self.resume_rng)  # the loader is created from the checkpoint's RNG
            self.resume_rng = None
        if skip and self.epoch_rng is not None:
            torch.set_rng_state(self.epoch_rng)  # as when this epoch's loader was first created
        epoch_rng_now = torch.get_rng_state()
        batch, samples = 0, 0
        for item in self.loader:
            inputs, target = loader_item(item)  # a dict batch: the Pipeline finds its labels
            if batch < skip:
                batch += 1
                continue
            if self.resume_rng is not None:
                set_rng_state(self.resume_rng)  # the loader is positioned: continue the checkpoint's RNG
                self.resume_rng = None
            pipe.step(inputs, target, segment_length=self.segment_length(epoch, batch) if pipe.drained else None)
            samples += batch_size(inputs)
            batch += 1
            if settings.continuous or batch == num_batches:
                continue
            checkpoint_due = bool(settings.checkpoint_every) and batch % settings.checkpoint_every == 0
            eval_due = bool(settings.eval_every) and batch % settings.eval_every == 0
            if checkpoint_due or eval_due:
                pipe.flush()  # a segment ends at every checkpoint and every evaluation
                if eval_due:
                    began = time.perf_counter()
                    # a checkpoint here records the evaluations so far: this one must be among them
                    if settings.eval_in_bubbles and not (checkpoint_due and self.store is not None):
                        self.evaluation_in_bubbles(epoch)
                    else:
                        self.evaluation(epoch)
                    self.paused["mid_eval_epoch"] += time.perf_counter() - began
                if checkpoint_due and self.store is not None:
                    self.save(epoch, batch, epoch_rng_now)
        if batch == 0:
            raise ValueError(f"the loader yielded no mini-batches in epoch {epoch}")
        if num_batches is not None and batch != num_batches:
            raise ValueError(f"the loader yielded {batch} mini-batches in epoch {epoch} but its "
                             f"len() is {num_batches}")
        return batch, samples

    def segment_length(self, epoch: int, batch: int) -> Optional[int]:
        """How many mini-batches the segment starting now holds, if known: up to the next
        checkpoint or evaluation, or the epoch's end (a continuous run: the run's end)."""
        if self.num_batches is None:
            return None
        if self.settings.continuous:
            return self.num_batches * (self.settings.epochs - epoch) - batch
        return next_drain(batch, self.num_batches, (self.segment, self.settings.eval_every)) - batch

    def end_epoch(self, epoch: int, batches: int, samples: int) -> None:
        """Drain, record the epoch, evaluate, checkpoint."""
        pipe = self.pipe
        pipe.flush()
        seconds = time.perf_counter() - self.epoch_start - self.paused["mid_eval_epoch"]
        self.close_epoch(epoch, seconds, samples, pipe.losses[len(pipe.losses) - batches:])
        self.finish_epoch_entry(epoch)
        if self.store is not None:
            self.save(epoch + 1, 0, None)
        self.epoch_start = time.perf_counter()
        self.paused["mid_eval"] += self.paused["mid_eval_epoch"]
        self.paused["mid_eval_epoch"] = 0.0

    def end_continuous(self, sizes: List[Tuple[int, int, int]]) -> None:
        """A continuous run's one drain: every epoch recorded, the time shared out evenly."""
        pipe = self.pipe
        pipe.flush()
        per_epoch = (time.perf_counter() - self.epoch_start) / max(1, len(sizes))
        index = len(pipe.losses) - sum(b for _, b, _ in sizes)
        for epoch, count, samples in sizes:
            self.close_epoch(epoch, per_epoch, samples, pipe.losses[index:index + count])
            index += count
        self.finish_epoch_entry(sizes[-1][0])

    def close_epoch(self, epoch: int, seconds: float, samples: int, losses: List[float]) -> None:
        self.epoch_metrics.append({"epoch": epoch, "loss": sum(losses) / len(losses), "seconds": seconds,
                                   "samples_per_second": samples / seconds if seconds > 0 else 0.0})

    def finish_epoch_entry(self, epoch: int) -> None:
        """The last epoch's diagnostics and evaluation; then ``on_epoch``."""
        pipe, entry = self.pipe, self.epoch_metrics[-1]
        if any(s.probes.every for s in pipe.stages):
            own = [s.probes.summary(i) for s, i in zip(pipe.stages, self.probes_seen)]
            self.probes_seen = [len(s.probes.rows) for s in pipe.stages]
            entry["prediction_error"] = pipe.world.all_stages(own, "gathering the diagnostic")
        value = self.evaluation(epoch)
        if value is not None:
            entry["metric"] = value
        if self.settings.on_epoch is not None:
            self.settings.on_epoch(entry["epoch"], entry)

    # -- evaluations and checkpoints --------------------------------------------------------
    def train_seconds(self) -> float:
        """The run's training time so far: fit's time less evaluations and checkpoint writes."""
        return self.seconds_before + time.perf_counter() - self.started - self.paused["eval"] - self.paused["save"]

    def evaluation(self, epoch: int) -> Optional[float]:
        """Evaluate the drained pipeline and record it (once per point: a drain at the epoch's
        end may already have evaluated); None without anything to evaluate."""
        pipe, settings = self.pipe, self.settings
        if self.evaluations and self.evaluations[-1]["batch"] == pipe.batches_done - self.batch_base:
            return self.evaluations[-1]["metric"]
        if settings.evaluate is None and settings.eval_loader is None:
            return None
        record = self.recorder(epoch)
        began = time.perf_counter()
        if settings.evaluate is not None:
            value = pipe.evaluate_model(settings.evaluate)
        else:
            value = pipe.evaluate(settings.eval_loader, settings.metric)
        self.paused["eval"] += time.perf_counter() - began
        record(value)
        return value

    def evaluation_in_bubbles(self, epoch: int) -> None:
        """Ask for the evaluation of the drained pipeline's weights in the next mini-batch's
        bubbles (``eval_in_bubbles``); recorded as :meth:`evaluation` records it, once known."""
        self.pipe.evaluate_in_bubbles(self.settings.eval_loader, self.settings.metric, on_done=self.recorder(epoch))

    def recorder(self, epoch: int) -> Callable[[float], None]:
        """The function that records the evaluation at this point once its value is known: its
        entry (``seconds``: the training time now) among the evaluations, then ``on_eval``."""
        entry = {"epoch": epoch, "batch": self.pipe.batches_done - self.batch_base,
                 "updates": int(self.pipe.stages[0].policy.version), "metric": None, "seconds": self.train_seconds()}

        def record(value: float) -> None:
            entry["metric"] = value
            self.evaluations.append(entry)
            if self.settings.on_eval is not None:
                self.settings.on_eval(entry)
        return record

    def save(self, epoch: int, batch: int, rng: Optional[torch.Tensor]) -> None:
        """Checkpoint the drained pipeline at (epoch, batch); ``rng``: the epoch's RNG at its start."""
        pipe, began = self.pipe, time.perf_counter()
        fields = {**self.run_info, "losses": pipe.losses, "epoch_metrics": self.epoch_metrics,
                  "samples_done": pipe.samples_done, "epoch_rng": _encode_rng(rng),
                  "evaluations": self.evaluations, "train_seconds": self.train_seconds(), "layout": layout_of(pipe)}
        self.finish_pending()  # (one in the background at a time: this one after the last is named)
        self.pending = save_checkpoint(pipe.world, self.store, pipe.stages, (epoch, batch), fields,
                                       background=self.settings.async_checkpoint, names=pipe.state_names)
        self.paused["save"] += time.perf_counter() - began

    def finish_pending(self) -> None:
        """Wait for the checkpoint written in the background, then name it the latest."""
        pending, self.pending = self.pending, None
        if pending is not None:
            began = time.perf_counter()
            pending.finish()
            self.paused["save"] += time.perf_counter() - began

    # -- the result -------------------------------------------------------------------------
    def result(self, samples: int, elapsed: float) -> TrainResult:
        """The losses, traces, metrics and trained model of the run, the same on every rank."""
        pipe, spec = self.pipe, self.pipe.spec
        design = pipe.method.weight_versions(spec.stages, **spec.options)
        reports = pipe.world.all_stages([stage_report(s, pipe.world, design[s.index]) for s in pipe.stages],
                                        "gathering the stages' measurements")
        trace = sorted((e for r in reports for e in r["trace"]), key=lambda e: (e.stage, e.microbatch, e.kind != "F"))
        diagnosing = any(r["diagnostics"] is not None for r in reports)
        metrics = {
            "method": spec.method, "options": spec.options, "stages": spec.stages, "chunks": spec.chunks,
            "partition": spec.partition, "microbatches": spec.microbatches, "epochs": self.epoch_metrics,
            "samples_per_second": samples / elapsed if elapsed > 0 else 0.0, "seconds": elapsed,
            "weight_versions": [r["versions"] for r in reports],
            "weight_versions_design": design, "state_memory": [r["state_memory"] for r in reports],
            "stage_seconds": [r["seconds"] for r in reports],
            "stage_busy_seconds": [r["busy_seconds"] for r in reports],
            "stage_passes": [r["passes"] for r in reports],
            "activations": [r["activations"] for r in reports],
            "prediction_error": [r["diagnostics"] for r in reports] if diagnosing else None,
            "devices": [r["device"] for r in reports], "precision": pipe.config.precision,
            "processes": pipe.world.processes, "comm": [r["comm"] for r in reports],
            "compilations": [r["compilations"] for r in reports],
        }
        updates = [u for r in reports for u in r["updates"]]
        return TrainResult(list(pipe.losses), trace, pipe.model(), metrics, updates)


def stage_report(stage: Any, world: Any, design_versions: int) -> Dict[str, Any]:
    """What one stage measured (the metrics' per-stage entries): ``busy_seconds`` per kind (F, B
    with both halves of a split one, U), ``comm`` per link (bytes, seconds waited), ``activations``
    (``runtime/held.py``), ``state_memory`` beside ``design_versions``' closed form."""
    record = stage.record
    return {"versions": round(stage.policy.versions_peak, 3), "trace": record.trace, "updates": record.updates,
            "state_memory": state_memory(stage, design_versions),
            "seconds": {k: record.time[k] / max(1, record.count[k]) for k in record.time},
            "busy_seconds": dict(record.time), "passes": dict(record.count),
            "diagnostics": stage.probes.summary() if stage.probes.every else None,
            "device": str(stage.device), "comm": world.comm_stats(), "activations": stage.held.report(),
            "compilations": stage.compilations}


def layout_of(pipe: Any) -> Dict[str, Any]:
    """The layout a checkpoint records of the run that wrote it (a resumed run's log names both)."""
    return {"stages": pipe.spec.ranks, "chunks": pipe.spec.chunks, "replicas": pipe.data_parallel_size,
            "sharded": bool(pipe.config.shard_replicas), "processes": pipe.world.processes}


def layout_words(layout: Dict[str, Any]) -> str:
    """``2 stages x 2 replicas (sharded) on 4 processes``."""
    plural = lambda n, word: f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("s") else "s")  # noqa: E731
    text = plural(layout["stages"], "stage")
    if layout.get("chunks", 1) > 1:
        text += f" of {layout['chunks']} chunks"
    if layout.get("replicas", 1) > 1:
        text += f" x {layout['replicas']} replicas" + (" (sharded)" if layout.get("sharded") else "")
    return text + f" on {plural(layout.get('processes', 1), 'process')}"


def restart_words() -> str:
    """``torchrun restart K of at most M: `` in a process torchrun's agent restarted, else nothing."""
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return f"torchrun restart {count} of at most {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}: " if count else ""


def say(pipe: Any, text: str) -> None:
    """One line of the run's log on stderr, from rank 0 alone (one write: the ranks share torchrun's stderr)."""
    if pipe.rank == 0:
        sys.stderr.write(f"pipeoptim: {text}\n")
        sys.stderr.flush()


def _encode_rng(state: Optional[torch.Tensor]) -> Optional[str]:
    return base64.b64encode(state.numpy().tobytes()).decode() if state is not None else None


def _decode_rng(text: Optional[str]) -> Optional[torch.Tensor]:
    if not text:
        return None
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()
