"""The engine a user drives: ``pipeoptim.Pipeline``.

A Pipeline takes plain PyTorch objects (a model, a loss function, factories for the optimizer and
the learning-rate scheduler) and trains a copy of the model with a pipeline method, stage by
stage, on the devices given, driven by :meth:`Pipeline.fit` (its loop is
:class:`pipeoptim.fit.FitRun`) or by hand with :meth:`Pipeline.step` and :meth:`Pipeline.flush`
(README.md, "The Python API"). The loader is any iterable of ``(inputs, target)`` or of dict
batches (:mod:`pipeoptim.batches`), read lazily, one mini-batch per step, so host memory does not
grow with the epoch. Between drains the pipeline runs one schedule (a *segment*); an asynchronous
method drains only at a flush (docs/architecture.md, "Schedules as data"). Where the stages run
is the Pipeline's *world* (:mod:`pipeoptim.world`, :mod:`pipeoptim.torchrun`); the Pipeline asks
it, never which one it is."""
from __future__ import annotations

import contextlib
import copy
import inspect
import math
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

import torch
from torch import nn

from .batches import BatchForm
from .checks import check_model, check_options, check_pipeline, method_of
from .config import FitConfig, PipelineConfig, keyword_parameters, missing_required
from .errors import NonFiniteLoss
from .fit import Batch, FitRun, Metric, TrainResult
from .fit_checks import check_fit
from .options import describe, of_scope
from .prepare import build_model_stages, first_inputs, needs_example
from .runtime import named_state
from .runtime.defaults import CLIP_SCOPES
from .runtime.forward_only import BubbleWork, ForwardOnly, StageEvalMode, check_fills
from .runtime.microbatch import Weighing, batch_size
from .runtime.replicas import copy_to_replicas
from .runtime.spec import RunSpec
from .runtime.stage import Stage
from .state_names import StateNames
from .torchrun import Torchrun
from .world import LocalWorld, OnStageDevices, World, model_device, one_device, resolve_devices, whole_model

__all__ = ["Pipeline", "TrainResult", "OnStageDevices", "resolve_devices", "Batch", "Metric", "CLIP_SCOPES"]


class Pipeline:
    """A copy of ``model`` split into pipeline stages, trained with ``method``.

    Args:
        model: an initialised ``nn.Sequential`` of stage-able blocks (blocks may pass tuples of
            tensors), or any ``nn.Module`` whose forward ``torch.export`` can trace (a GPT with a
            ``ModuleList`` of blocks, its head tied to its embedding), split at its candidate
            points (docs/architecture.md, "Splitting any module"; a weight read by several
            stages stays one, "Tied weights"). It is copied, never modified; :meth:`model`
            returns the trained copy, of the model's class, whose parameters keep their names.
        {options}

        Every keyword but ``model`` is defined once, with its type and default, in
        :mod:`pipeoptim.options` (the list above and the signature are made from it), and held
        whole in ``pipe.config`` (:class:`pipeoptim.config.PipelineConfig`; :meth:`from_config`
        takes one); a method's own options are passed as keywords too (which methods take each:
        :func:`pipeoptim.options.takers`; the delay corrections: :mod:`pipeoptim.weights.corrections`).

    Under ``torchrun --nproc-per-node N`` each process runs one stage (see
    :mod:`pipeoptim.torchrun`): every rank builds the Pipeline and iterates the same loader;
    ``stages`` defaults to the number of processes.
    """

    def __init__(self, model: nn.Module, **options: Any) -> None:
        missing_required(("pipeline",), options, "Pipeline()")
        self._build(model, PipelineConfig.of(**options))

    @classmethod
    def from_config(cls, model: nn.Module, config: PipelineConfig) -> "Pipeline":
        """The Pipeline of ``model`` with the options ``config`` holds (:mod:`pipeoptim.config`),
        as ``Pipeline(model, **config.keywords())`` builds it."""
        pipe = cls.__new__(cls)
        pipe._build(model, config)
        return pipe

    def _build(self, model: nn.Module, config: PipelineConfig) -> None:
        check_model(model)
        self.config = config  #: every option, as given (pipeoptim.config.PipelineConfig)
        self.method = method_of(config)  # config.method, or running config.schedule (checked now)
        check_options(self.method, config)  # before a torchrun job is joined
        self.world: World = config.world if config.world is not None else (
            Torchrun.join(config.devices, config.timeout, config.threads) or LocalWorld())
        self._form = BatchForm(model_loss=config.loss_fn is None)  #: how mini-batches are read (pipeoptim.batches)
        #: each micro-batch's share of its mini-batch's loss (loss_normalization)
        self._weighing = Weighing(config.loss_normalization, model, own_loss=config.loss_fn is None)
        self._model = copy.deepcopy(model)
        self._model.train()
        self._given_on = model_device(model)  #: where the model was given: model()'s default device
        #: the run resolved by the checks, once (runtime/spec.RunSpec; its cut once the model is split)
        self.spec: RunSpec = check_pipeline(config, model, self.world, self.method)
        #: the stages this process holds: all of them, or under torchrun its own one
        self.stages: List[Stage] = []
        #: where stages 2..N begin (a chunked method's pieces 2.., a mirrored method's first
        #: pipeline's), as the modules that begin them: a traced model's submodules, as
        #: ``split_points=`` takes them (``["layers.2"]``), or an ``nn.Sequential``'s children, its layer
        #: indices (``["3"]``: stage 2 begins at layer 3); None until the model is split
        self.split_points: Optional[List[str]] = None
        self.devices: List[torch.device] = []  #: each stage's device, once the model is split
        #: the pipeline rank of each stage (Method.stage_ranks: s mod N, or a V for zb-v)
        self.placement: List[int] = []
        self.losses: List[float] = []    #: every completed mini-batch's loss, in order
        self.batches_done = 0            #: mini-batches fed so far (the trace numbering)
        self.samples_done = 0
        self._executor: Optional[Any] = None
        self._bubbles = BubbleWork()     #: forward-only work for the next segment's bubbles
        self._segment_start = 0          #: index of the open segment's first mini-batch
        #: the model's state-dict names, for checkpoints of a traced model (state_names.StateNames)
        self.state_names: Optional[StateNames] = None
        self._on_batch: Optional[Callable[[int, float], None]] = None
        self._label: Callable[[int], str] = lambda index: f"mini-batch {index}"
        if config.example_input is not None or not needs_example(model, config.partitioner):
            self.prepare(None if config.example_input is None else self._form.example_input(config.example_input))

    @property
    def prepared(self) -> bool:
        """Whether the model is split into its stages (at construction, or at the first
        mini-batch when a traced model has no ``example_input``)."""
        return self.spec.partition is not None

    @property
    def recompute(self) -> List[bool]:
        """Per stage, whether it recomputes its forward in the backward."""
        return self.spec.recompute

    def prepare(self, example_input: Any = None) -> None:
        """Split the model into stages (tracing it on ``example_input`` unless it is an
        ``nn.Sequential``), build this process's stages and connect them. The Pipeline does it
        itself, at construction or on its first mini-batch; nothing happens if already done."""
        if self.prepared:
            return
        built = build_model_stages(self.world, self._model, example_input, self.config, self.method, self.spec)
        self.spec, self.stages, self.devices, self.placement = built.spec, built.stages, built.devices, built.placement
        self.split_points, self._eval_mode = built.split_points, built.eval_mode
        if not isinstance(self._model, nn.Sequential):  # a traced model: its stages name a tied weight once
            self.state_names = StateNames(self._model)

    # -- driving by hand ----------------------------------------------------------------------
    @property
    def microbatches(self) -> int:
        """Micro-batches per mini-batch."""
        return self.spec.microbatches

    @property
    def compilations(self) -> List[Optional[int]]:
        """Per stage this process holds, the graphs torch.compile has made of its forward so far
        (None: the stage runs eagerly). Swapping weight versions adds none."""
        return [s.compilations for s in self.stages]

    def step(self, inputs: Any, target: Optional[torch.Tensor] = None, *,
             segment_length: Optional[int] = None) -> List[float]:
        """Feed one mini-batch, ``step(inputs, target)`` or ``step(batch)`` for a dict batch (see
        ``loss_fn``); return the losses of the mini-batches completed meanwhile (an
        asynchronous pipeline reports a mini-batch's loss when its last stage has it).

        ``segment_length``: read only when this mini-batch opens a segment (the pipeline is
        drained): how many mini-batches will be fed before the next :meth:`flush`, when known.
        The schedule is then built once for exactly that many; without it its horizon grows as
        mini-batches come (the same actions, planned in steps)."""
        inputs, target = self._form.pair(inputs, target)  # a dict batch: its labels are the target
        if not self.prepared:  # a traced model without example_input: its first mini-batch is the example
            self.prepare(self._form.example(inputs, target))
        size = batch_size(inputs)
        micro = self._weighing.split(inputs, target, self.spec.microbatches, self.world)
        if self._executor is None:
            extra = self._bubbles.open(lambda: self._schedule_for(2, first_batch=self.batches_done),
                                       size / self.spec.microbatches)
            self._executor = self.world.executor(self.stages, self._schedule_for, expected=segment_length,
                                                 trace_offset=self.batches_done * self.spec.microbatches,
                                                 clip_global=self.spec.global_clip, **extra)
            self._segment_start = self.batches_done
        self.batches_done += 1
        self.samples_done += size
        self._executor.feed(micro)
        return self._collect()

    def flush(self) -> List[float]:
        """Drain: finish every mini-batch fed, so that every stage holds one set of weights.
        Returns the losses completed meanwhile. An evaluation asked for in the bubbles that no
        mini-batch came to hold runs now, drained."""
        if self._bubbles.waiting is not None and self._executor is None:
            work, self._bubbles.waiting = self._bubbles.waiting, None
            work.run_drained(self.world, self.model_stages, self._eval_mode.evaluating)
        if self._executor is None:
            return []
        try:
            self._executor.finish()
            self._bubbles.drained(lambda value: self.world.share(value, self.spec.stages - 1,
                                                                  "sharing the evaluation"))
            done = self._collect(wait=True)
            if self.world.losses_at_drain:  # every rank gets the last stage's losses, and checks them
                start = self._segment_start
                # this rank's, already returned by step() (none where they are halves of windows)
                known = 0 if self.world.partial_losses else len(self.losses) - start - len(done)
                segment = self.world.share_losses(self.losses[start:])
                self.losses[start:] = segment
                done = segment[max(0, known):]
                for index, loss in enumerate(segment, start=start):
                    self._record(index, loss)
            return done
        finally:
            self._executor = None
            self._bubbles.drained(None)

    @contextlib.contextmanager
    def reporting(self, on_batch: Optional[Callable[[int, float], None]] = None,
                  label: Optional[Callable[[int], str]] = None) -> Iterator[None]:
        """While open: ``on_batch(index, loss)`` is called for each mini-batch as its loss is
        known (``index`` counts every mini-batch this Pipeline was fed), and ``label(index)``
        names a mini-batch in errors (a non-finite loss) instead of "mini-batch INDEX".
        :meth:`fit` reports through it."""
        saved = self._on_batch, self._label
        self._on_batch = on_batch
        if label is not None:
            self._label = label
        try:
            yield
        finally:
            self._on_batch, self._label = saved

    def close(self) -> None:
        """Under torchrun: end this process's part of the job now (wait for the sends in flight,
        destroy the process groups this Pipeline made, the job's too if it started it). It runs
        by itself at the script's exit, while the interpreter is whole; call it, or use the
        Pipeline as a context manager, to end earlier. A closed Pipeline cannot train or gather
        again. One process: nothing to release."""
        self.world.close()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def rank(self) -> int:
        """This process's rank under torchrun; 0 in a single process (print on rank 0)."""
        return self.world.rank

    @property
    def data_parallel_rank(self) -> int:
        """Which replica of the pipeline this process belongs to (its data shard); known before
        a traced model is split (the layout says it)."""
        if self.stages:
            return self.world.replica
        layout = self.spec.layout
        return self.world.rank // (layout.ranks * layout.tensor)

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the pipeline (1 without data parallelism)."""
        return self.world.replicas if self.stages else self.spec.layout.replicas

    @property
    def drained(self) -> bool:
        """No mini-batch fed since the last :meth:`flush` (every stage holds one set of weights)."""
        return self._executor is None or not self._executor.fed_batches

    def _schedule_for(self, batches: int, first_batch: Optional[int] = None):
        """The open segment's schedule for ``batches`` mini-batches, with the forward-only work
        it carries; ``first_batch``: the plain schedule of a segment starting there instead."""
        schedule = self.method.build_schedule(self.spec.ranks, self.spec.microbatches, batches,
                                              first_batch=self._segment_start if first_batch is None else first_batch,
                                              options=self.spec.options, chunks=self.spec.chunks)
        return self._bubbles.carried(schedule) if first_batch is None else schedule

    def _collect(self, wait: bool = False) -> List[float]:
        """The losses completed in this process. Where the world shares them at the drain, they
        are checked and reported there, on every rank at once (so that all stop at the same
        mini-batch)."""
        done = []
        for window, loss in self._executor.take_completed(wait):
            index = self._segment_start + window
            assert index == len(self.losses), "losses complete in mini-batch order"
            self.losses.append(loss)
            if not self.world.partial_losses:
                done.append(loss)
            if not self.world.losses_at_drain:
                self._record(index, loss)
        return done

    def _record(self, index: int, loss: float) -> None:
        if not math.isfinite(loss):
            raise NonFiniteLoss(f"loss became {loss} at {self._label(index)}")
        if self._on_batch is not None:
            self._on_batch(index, loss)

    @property
    def model_stages(self) -> List[Stage]:
        """The stages that make up the model once, in order: every stage, or a bidirectional
        run's first pipeline (its second holds replicas of the same pieces)."""
        return [s for s in self.stages if s.replica_of is None]

    # -- evaluation ---------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, loader: Iterable[Batch], metric: Optional[Metric] = None) -> float:
        """Forward only, stage by stage on the live weights (no prediction), in eval mode.

        ``metric(output, target)`` gives a mini-batch's value (a number or a 0-dim tensor,
        a mean over the mini-batch); the result is the mean over all samples. Without a metric,
        the mean loss over every real item (``loss_normalization``), a model that computes its
        own loss run with its labels. The pipeline must be drained (:meth:`flush`); split on the
        loader's first mini-batch if none came yet."""
        self._require_drained("evaluate", loader)
        loader = self._form.pairs(loader)  # a dict batch as (inputs, labels)
        score = metric or self.model_stages[-1].loss_fn
        with self._eval_mode.evaluating():  # a traced model: its eval-mode graph meanwhile
            return self.world.evaluate(self.model_stages, loader, score, self._weighing.evaluation(metric))

    def evaluate_in_bubbles(self, loader: Iterable[Batch], metric: Optional[Metric] = None,
                            on_done: Optional[Callable[[float], None]] = None) -> None:
        """:meth:`evaluate` of the drained pipeline's weights, run in the idle time of the next
        mini-batch's schedule before each stage's update (docs/architecture.md, "Evaluation in
        the bubbles"): ``on_done(value)`` receives what :meth:`evaluate` returns now, to the bit,
        during the next :meth:`step` (or at the next :meth:`flush` if none comes). The loader is
        read now, whole, and held until then. Synchronous methods, one stage per rank."""
        self._require_drained("evaluate_in_bubbles", loader)
        self._in_bubbles("evaluate_in_bubbles", lambda: list(self._form.pairs(loader)),
                         score=metric or self.model_stages[-1].loss_fn, on_done=on_done,
                         weight=self._weighing.evaluation(metric))

    def forward_in_bubbles(self, inputs: Iterable[Any], on_output: Callable[[int, Any], None]) -> None:
        """A user's forward-only work, run as :meth:`evaluate_in_bubbles` runs an evaluation:
        ``on_output(j, output)`` receives the model's output (eval mode, no gradients, the last
        stage's device and, under torchrun, process) for the j-th of ``inputs``, each run whole."""
        self._in_bubbles("forward_in_bubbles", lambda: [(x, None) for x in inputs], on_output=on_output)

    def _in_bubbles(self, what: str, read: Callable[[], List[Any]], **work: Any) -> None:
        self._require_drained(what)
        self.check_fills_bubbles()
        mode = self._eval_mode  # a traced model swaps in its eval-mode graph; else each stage's own mode
        eval_mode = StageEvalMode() if mode.traced is None else lambda stage: mode.evaluating()
        self._bubbles.queue(lambda: ForwardOnly(read(), eval_mode, self.model_stages,
                                                at_drain=self.world.losses_at_drain, **work))

    def check_fills_bubbles(self) -> None:
        """Raise ValueError, naming the fix, where this pipeline cannot evaluate in the bubbles."""
        check_fills(self.world.fills_bubbles, self.spec.method, self.method.synchronous,
                    self._schedule_for(2, first_batch=self.batches_done))

    def evaluate_model(self, evaluate: Callable[[nn.Module], float]) -> float:
        """``evaluate(model)`` of the trained model (a function written for a model on one device;
        under torchrun its calls ``model(inputs)`` run through the stages on their devices:
        ``runtime/forward_only.PipelinedModel``), measured once and returned on every rank.
        The pipeline must be drained; the model is back in training mode afterwards."""
        self._require_drained("evaluate_model")
        return self.world.evaluate_model(self._model, self.model_stages, evaluate, self._eval_mode.evaluating)

    @torch.no_grad()
    def forward(self, inputs: Any) -> Any:
        """The model's output for ``inputs``, through every stage on its device (no gradients,
        the live weights, the current train/eval mode). One process only: under torchrun use
        :meth:`evaluate`, or :meth:`model` for the whole model."""
        self._form.refuse_model_loss("forward")
        self.prepare(inputs)
        with contextlib.nullcontext() if self._model.training else self._eval_mode.evaluating():
            return self.world.forward(self.model_stages, inputs)  # a traced model: the graph of its mode

    def model(self, device: Optional[Any] = None) -> nn.Module:
        """The trained model whole on ``device`` (default: where the model given was), its names
        and tied weights as given: the Pipeline's own copy where every stage trains there, else a
        copy made now (:func:`pipeoptim.world.whole_model`). Call :meth:`flush` first for weights
        every mini-batch fed has updated; under torchrun every rank must call it (it gathers)."""
        target = self._given_on if device is None else one_device(device)
        if not self.prepared:  # nothing trained yet
            return whole_model(self._model, target)
        return self.world.gather_model(self._model, self.model_stages, target)

    # -- state --------------------------------------------------------------------------------
    def _require_drained(self, what: str, loader: Optional[Iterable[Batch]] = None) -> None:
        """Drained and split (on ``loader``'s first mini-batch, if given and none came yet)."""
        if not self.prepared and loader is not None:
            self.prepare(first_inputs(loader, self._form))
        if not self.prepared:
            raise RuntimeError(f"{what} needs the model split into stages: feed a mini-batch first, "
                               f"or give the Pipeline example_input=")
        if not self.drained:
            raise RuntimeError(f"{what} needs a drained pipeline: call flush() first")

    def state_dict(self) -> Dict[str, Any]:
        """Model, per-stage optimizer, scheduler and weight-policy state, keyed by the original
        parameter names, so that it loads into a Pipeline with another partition (exactly, for
        the synchronous methods; an asynchronous one resumes as after a drain, its optimizer and
        predictor state carried over by name). The pipeline must be drained."""
        self._require_drained("state_dict")
        self._refuse_sharded("state_dict()")
        stages = self.world.all_stages([named_state.stage_state(stage) for stage in self.stages],
                                       "gathering the stages' state")
        return {"format": 1, "method": self.spec.method, "partition": list(self.spec.partition),
                "model": {k: v.detach().to("cpu", copy=True) for k, v in self.model().state_dict().items()},
                "stages": stages,
                "losses": list(self.losses), "batches_done": self.batches_done,
                "samples_done": self.samples_done}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s output (from this partition or another)."""
        self._require_drained("load_state_dict")
        self._refuse_sharded("load_state_dict()")
        if state.get("method") != self.spec.method:
            raise ValueError(f"state is of method {state.get('method')!r}, this pipeline runs "
                             f"{self.spec.method!r}")
        missing = set(self._model.state_dict()) - set(state["model"])
        if missing:
            raise ValueError(f"state does not fit this model: no {', '.join(sorted(missing)[:3])}")
        self._model.load_state_dict(state["model"])
        copy_to_replicas(self.stages)  # a bidirectional run's second pipeline: copies of the model's pieces
        named_state.load_stages(self.stages, state["stages"])
        self.losses = list(state.get("losses", []))
        self.batches_done = int(state.get("batches_done", 0))
        self.samples_done = int(state.get("samples_done", 0))

    def _refuse_sharded(self, what: str) -> None:
        if any(stage.shards is not None for stage in self.stages):
            raise ValueError(f"{what} holds whole tensors in one process; a pipeline sharded over its "
                             f"replicas keeps its state with fit(checkpoint_dir=...), torch's distributed "
                             f"checkpoint of the shards (pipe.model().state_dict() gives the weights)")

    # -- training loop ------------------------------------------------------------------------
    def fit(self, loader: Iterable[Batch], epochs: int = 1, **options: Any) -> TrainResult:
        """Train for ``epochs`` passes over ``loader`` (any iterable of ``(inputs, target)`` or of
        dict batches, see ``loss_fn``), iterated once per epoch; ``len()`` is used when it exists,
        not required. Returns the :class:`TrainResult` (its ``model``: the trained model, gathered
        on every rank under torchrun).

        Options (defined in :mod:`pipeoptim.options`):
        {options}

        The pipeline drains at each epoch's end, every ``checkpoint_every`` and every
        ``eval_every``: a synchronous method trains exactly as without them, an asynchronous
        one restarts its warm-up after each drain. Every evaluation, the epoch-end ones
        included, is recorded in ``TrainResult.metrics["evaluations"]`` and passed to
        ``on_eval(entry)`` as ``{"epoch", "batch", "updates", "metric", "seconds"}``: the epoch
        (0-based), the mini-batches trained so far in the run, the optimizer updates applied so
        far (each stage's weight version), the value, and the training time so far (fit's time
        less evaluations and checkpoint writes).
        """
        config = FitConfig.of(epochs=epochs, **options)
        check_fit(config)
        if not self.prepared:
            self.prepare(first_inputs(loader, self._form))
        self._require_drained("fit")
        if config.eval_in_bubbles:
            self.check_fills_bubbles()
        return FitRun(self, loader, config).run()


Pipeline.__doc__ = Pipeline.__doc__.replace("{options}", describe(of_scope("pipeline", "method"))[8:])
Pipeline.fit.__doc__ = Pipeline.fit.__doc__.replace("{options}", describe(of_scope("fit"))[8:])
_P = inspect.Parameter  # the signatures help() and IDEs show: every option of the table, as it defines it
Pipeline.__init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [_P("self", _P.POSITIONAL_OR_KEYWORD), _P("model", _P.POSITIONAL_OR_KEYWORD, annotation="nn.Module"),
     *keyword_parameters("pipeline"), _P("method_options", _P.VAR_KEYWORD)], return_annotation=None)
Pipeline.fit.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [_P("self", _P.POSITIONAL_OR_KEYWORD), _P("loader", _P.POSITIONAL_OR_KEYWORD, annotation="Iterable[Batch]"),
     _P("epochs", _P.POSITIONAL_OR_KEYWORD, default=1, annotation="int"), *keyword_parameters("fit", skip=("epochs",))],
    return_annotation="TrainResult")
