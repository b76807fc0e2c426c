"""Model preparation for a Pipeline: resolve the run, split the model, find tied weights.

An ``nn.Sequential`` is split by layers (``partition`` = layers per stage); any other module is
traced (:mod:`pipeoptim.graph_split`) and cut at candidate points, ``partition`` then counting
units (docs/architecture.md, "Splitting any module"). There the ``uniform`` partitioner (the
default) counts the units that hold parameters, and ``time`` (opt-in: a profile differs between
runs and machines) balances each unit's profiled forward+backward time on the example input and
prints the cut it chose, so that it can be given again. A tied weight stays one parameter, owned
by the first stage that reads it (docs/architecture.md, "Tied weights")."""
from __future__ import annotations

import contextlib
import difflib
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .batches import LABELS, BatchForm, loader_item, model_loss
from .graph_split import TracedModel, trace
from .methods import Method, clip_scope_for, get_method
from .partition import plan_time_partition
from .profile import profile_model
from .config import PipelineConfig
from .runtime.build import build_stages, recompute_per_stage, split_for
from .runtime.compiled import backend_of, missing_toolchain
from .runtime.defaults import CLIP_SCOPES, PRECISIONS
from .runtime.layout import chunks_of
from .runtime.sharding import fsdp_available
from .runtime.spec import RunSpec, resolve
from .runtime.stage import Stage
from .world import World

PARTITIONERS = ("uniform", "params", "time")


@dataclass
class PreparedModel:
    """The resolved run and the model cut into stage modules (over the Pipeline's own copy)."""

    spec: RunSpec
    parts: List[nn.Module]              #: one module per stage, sharing the copy's parameters
    #: tied parameters: id(parameter) -> the stages that read it (the first one owns it)
    ties: Dict[int, List[int]] = field(default_factory=dict)
    tied_names: Dict[int, List[str]] = field(default_factory=dict)  #: id -> its names in the stages
    split_points: Optional[List[str]] = None   #: where stages 2..N begin (traced models)
    traced: Optional[TracedModel] = None       #: the trace (None for an nn.Sequential)


def check_settings(method: Method, config: PipelineConfig) -> None:
    """Refuse a Pipeline's settings that cannot work, before anything is built (each a ValueError
    naming the fix)."""
    loss_fn, optimizer, lr_scheduler = config.loss_fn, config.optimizer, config.lr_scheduler
    precision, clip_grad_norm, clip_scope = config.precision, config.clip_grad_norm, config.clip_scope
    diagnose_every = config.diagnose_every
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError("loss_fn must be a function (output, target) -> scalar loss, or None for a model "
                         "that computes its own loss from batch['labels']")
    if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError("optimizer must be a factory called with each stage's parameters, "
                         "e.g. lambda params: torch.optim.SGD(params, lr=0.1), not an optimizer")
    if lr_scheduler is not None and (not callable(lr_scheduler) or hasattr(lr_scheduler, "step")):
        raise ValueError("lr_scheduler must be a factory called with each stage's optimizer, "
                         "e.g. lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, f), not a scheduler")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if clip_scope not in CLIP_SCOPES:
        raise ValueError(f"clip_scope must be one of {', '.join(map(repr, CLIP_SCOPES))}, got {clip_scope!r}")
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ValueError(f"clip_grad_norm must be a positive max norm, got {clip_grad_norm}")
    if diagnose_every < 0:
        raise ValueError(f"diagnose_every must be 0 (off) or more, got {diagnose_every}")
    if clip_scope == "global" and clip_grad_norm is not None and method.mirrored:
        raise ValueError(f"clip_scope='global' over {method.name}'s two replicas of each piece is not supported "
                         f"yet (the norm would count each piece twice): use clip_scope='stage'")
    if clip_scope == "global" and clip_grad_norm is not None and not method.synchronous:
        raise ValueError(f"clip_scope='global' needs every stage to hold the same mini-batch's "
                         f"gradients when it updates, which only synchronous methods do; "
                         f"{method.name} updates each stage at its own time: use clip_scope='stage'")


def check_model_settings(world: World, model: nn.Module, method: Method, settings: PipelineConfig) -> None:
    """Refuse, when the Pipeline is built, the model settings that need no trace to be found
    wrong (the layout the world cannot hold, and :func:`check_split`), so that the error comes
    before the loader and the processes start, not at the first mini-batch."""
    backend_of(settings.compile)
    layout = world.layout(method, settings.stages, settings.partition, settings.chunks, settings.data_parallel)
    if settings.shard_replicas:
        check_sharding(world, layout, settings)
    if backend_of(settings.compile) is not None:
        check_compile(settings)
    check_split(model, method, settings.stages, settings.partition, settings.split_points, settings.chunks)


def check_sharding(world: World, layout: Any, settings: PipelineConfig) -> None:
    """``shard_replicas``: what the job must be for it (each a ValueError naming the fix)."""
    if not isinstance(settings.shard_replicas, bool):
        raise ValueError(f"shard_replicas must be True or False, got {settings.shard_replicas!r}")
    if world.processes == 1:
        raise ValueError("shard_replicas=True shards each stage over its data-parallel replicas, which "
                         "run as processes: start N x D processes with torchrun (D >= 2), e.g. "
                         "torchrun --nproc-per-node 4 for 2 stages x 2 replicas, or drop shard_replicas")
    if layout.replicas < 2:
        raise ValueError(f"shard_replicas=True needs D >= 2 replicas to shard over, but WORLD_SIZE "
                         f"{world.processes} holds {layout.stages} stage(s) x 1 replica: start "
                         f"{2 * (layout.stages or 1)} processes or give fewer stages")
    if not fsdp_available():
        raise ValueError(f"shard_replicas=True needs torch's FSDP2 (fully_shard, torch >= 2.6); this "
                         f"is torch {torch.__version__}: upgrade torch or drop shard_replicas")


def check_compile(settings: PipelineConfig) -> None:
    """``compile`` beside the other settings (a ValueError naming the fix, in one line); the
    toolchain it needs is checked on the stages' devices, once they are placed
    (:func:`build_model_stages`)."""
    if settings.shard_replicas:
        raise ValueError("compile and shard_replicas do not run together yet (FSDP's hooks around a "
                         "compiled stage): drop one of them")


def check_split(model: nn.Module, method: Method, stages: Optional[int], partition: Optional[Sequence[int]],
                points: Optional[Sequence[str]], chunks: Optional[int]) -> None:
    """Refuse a cut that is wrong before any trace: split points for an ``nn.Sequential``, beside
    a partition, naming no submodule, or against ``stages``; chunks on a traced model."""
    v = chunks_of(method, chunks, partition)
    if isinstance(model, nn.Sequential):
        if points is not None:
            raise ValueError("split_points names submodules of a traced model; for an nn.Sequential "
                             "give partition=[layers per stage]")
        return
    if v > 1:
        raise ValueError(f"{method.name} places {v} model chunks per process, which needs an nn.Sequential "
                         f"for now; give the model as an nn.Sequential of its blocks, or a one-chunk "
                         f"method (1f1b-flush, zb-h1)")
    if points is None:
        return
    if partition is not None:
        raise ValueError("give split_points= or partition=, not both")
    names = {name for name, _ in model.named_modules() if name}
    for point in points:
        if point not in names:
            near = difflib.get_close_matches(point, sorted(names), n=3)
            raise ValueError(f"split point {point!r} names no submodule of the model"
                             + (f"; did you mean {', '.join(map(repr, near))}?" if near else
                                "; give qualified names from model.named_modules(), e.g. 'layers.2'"))
    if stages is not None and stages != len(points) + 1:
        raise ValueError(f"stages={stages} but {len(points)} split points make {len(points) + 1} "
                         f"stages; give {stages - 1} split points or stages={len(points) + 1}")


def needs_example(model: nn.Module, partitioner: Optional[str]) -> bool:
    """Whether preparing ``model`` needs an example input (a traced model, or the time profile)."""
    return not isinstance(model, nn.Sequential) or partitioner == "time"


def prepare(model: nn.Module, example: Any, *, method: str, stages: Optional[int],
            partition: Optional[Sequence[int]], split_points: Optional[Sequence[str]],
            partitioner: Optional[str], micro_batches: Optional[int], method_options: Dict[str, Any],
            agree: Callable[[Any, str], Any] = lambda value, what: value,
            chunks: Optional[int] = None, late: Optional[str] = None) -> PreparedModel:
    """Resolve the run and cut ``model`` (the Pipeline's copy, whose parameters the stages will
    train) into stages. ``example`` is an input mini-batch (needed for a traced model and for
    ``partitioner="time"``; None otherwise). ``partitioner`` None: ``uniform``, a cut that depends on
    the model alone (the same in every launcher and run). ``agree(value, what)`` gives every process
    rank 0's value (a partition from a profile, which would differ between processes).
    ``chunks``: model chunks per process for a chunked method (``stages`` then counts processes
    and the model is cut into ``stages x chunks`` pieces). ``late``: the keyword input of
    ``example`` the last stage takes (the labels of a model that computes its own loss). Bad
    settings raise ValueError naming the fix."""
    if late is not None and isinstance(model, nn.Sequential):
        raise ValueError("an nn.Sequential returns no loss of its own: give the Pipeline loss_fn=fn(output, target)")
    partitioner = partitioner or "uniform"
    v = chunks_of(get_method(method), chunks, partition)
    if partitioner not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {partitioner!r}; choose {', '.join(PARTITIONERS)}")
    check_split(model, get_method(method), stages, partition, split_points, chunks)
    if isinstance(model, nn.Sequential):
        sizes = partition
        if partitioner == "time" and partition is None and method != "sequential":
            pieces = stages * get_method(method).pieces_per_rank(v)
            sizes = agree(_time_sizes(model, example, pieces), "agreeing on the partition")
        spec = resolve(model, method=method, stages=stages, partition=sizes,
                       partitioner="uniform" if partitioner == "time" else partitioner,
                       micro_batches=micro_batches, method_options=method_options, chunks=chunks)
        return PreparedModel(spec, split_for(get_method(method), model, spec.partition))
    traced = trace(model, example, late)
    if late is not None:
        model_loss(traced.output_example())  # refused now, on every process, if it holds no loss
    units = traced.unit_modules()
    if split_points is not None:
        sizes: Optional[List[int]] = traced.sizes_for_points(list(split_points))
    else:
        sizes = list(partition) if partition is not None else None
        if stages is not None and stages > traced.units and method != "sequential":
            raise ValueError(f"{stages} stages need {stages} candidate points; "
                             f"{type(model).__name__} has {traced.units} ({', '.join(traced.candidates)}): "
                             f"use stages={traced.units} or fewer")
        if sizes is None and partitioner == "time" and stages is not None and method != "sequential":
            sizes = agree(_time_sizes(units, example, stages), "agreeing on the partition")
    spec = resolve(units, method=method, stages=stages if sizes is None else len(sizes), partition=sizes,
                   partitioner="uniform" if partitioner == "time" else partitioner,
                   micro_batches=micro_batches, method_options=method_options)
    parts = traced.stage_modules(spec.partition)
    prepared = PreparedModel(spec, parts, split_points=traced.points_for_sizes(spec.partition), traced=traced)
    _find_ties(traced, prepared)
    return prepared


def _time_sizes(units: nn.Sequential, example: Any, stages: Optional[int]) -> List[int]:
    if stages is None:
        raise ValueError("give stages=N (or partition=[layers per stage])")
    with torch.random.fork_rng(devices=[]):  # dropout while profiling draws from torch's generator
        profile = profile_model(units, example, warmup=1, repeats=3)
    return plan_time_partition(units, stages, profile.layer_costs(include_loss=False))


def _find_ties(traced: TracedModel, prepared: PreparedModel) -> None:
    for param, holders in traced.shared_parameters(prepared.parts).items():
        prepared.ties[id(param)] = holders
        prepared.tied_names[id(param)] = [name for name, p in traced.model.named_parameters(remove_duplicate=False)
                                          if p is param]


def _describe_ties(prepared: PreparedModel) -> str:
    return "; ".join(f"parameter {' = '.join(prepared.tied_names[key])} is read by stages "
                     f"{', '.join(map(str, holders))}" for key, holders in prepared.ties.items())


def say_cut(model: nn.Module, prepared: PreparedModel) -> None:
    """Print the cut the ``time`` partitioner chose (on stderr, once per job), as the keyword that
    gives it again: a profile is measured, so another run may choose another."""
    given = (f"split_points={prepared.split_points}" if prepared.split_points is not None
             else f"partition={list(prepared.spec.partition)}")
    print(f"pipeoptim: partitioner='time' cut {type(model).__name__} into {prepared.spec.stages} stages: "
          f"give Pipeline({given}) to use this cut again", file=sys.stderr, flush=True)


def check_tie_devices(prepared: PreparedModel, devices: Sequence[torch.device], local: bool) -> None:
    """In one process a tied parameter is one tensor, so its holders must share a device."""
    for key, holders in prepared.ties.items():
        places = {str(devices[k]) for k in holders}
        if local and len(places) > 1:
            raise ValueError(f"{_describe_ties(prepared)} on devices {', '.join(sorted(places))}; in one "
                             f"process a tied weight is one tensor: put those stages on one device")


def first_inputs(loader: Iterable, form: BatchForm) -> Any:
    """What the model is called with for ``loader``'s first mini-batch (its inputs; a dict batch's
    keyword tensors, read by ``form``), read without disturbing torch's global random state (a
    shuffling DataLoader draws its order from it), to trace the model on."""
    if iter(loader) is loader:
        raise ValueError("the loader is a one-pass iterator, so its first mini-batch cannot be read "
                         "ahead to trace the model: give the Pipeline example_input=")
    state = torch.random.get_rng_state()
    try:
        for item in loader:
            return form.example(*form.pair(*loader_item(item)))
    finally:
        torch.random.set_rng_state(state)
    raise ValueError("the loader yielded no mini-batches")


def build_model_stages(world: World, model: nn.Module, example: Any, method: Method, settings: PipelineConfig
                       ) -> Tuple[RunSpec, List[Stage], List[torch.device], Optional[List[str]], "EvalMode",
                                  List[int]]:
    """Split ``model`` (the Pipeline's copy), build the stages this process holds on their
    devices and connect them: (the resolved run, the stages, every stage's device, the split
    points of a traced model, the evaluation mode of the stages, the rank of every stage)."""
    layout = world.layout(method, settings.stages, settings.partition, settings.chunks, settings.data_parallel)
    if method.mirrored and (layout.replicas > 1 or settings.shard_replicas):
        raise ValueError(f"{method.name} already holds two replicas of each piece; with data_parallel > 1 or "
                         f"shard_replicas it is not supported yet: run one pipeline (WORLD_SIZE = stages)")
    replicas = layout.replicas
    prepared = prepare(model, example, method=settings.method, stages=layout.stages, partition=settings.partition,
                       split_points=settings.split_points, partitioner=settings.partitioner,
                       micro_batches=settings.micro_batches, method_options=settings.method_options,
                       agree=world.agree, chunks=settings.chunks,
                       late=LABELS if settings.loss_fn is None else None)
    spec = prepared.spec
    chose = settings.partition is None and settings.split_points is None and settings.method != "sequential"
    if settings.partitioner == "time" and chose and world.rank == 0:  # a cut the profile chose, not the user
        say_cut(model, prepared)
    devices = world.place(settings.devices, spec.stages)
    backend = backend_of(settings.compile)
    problem = missing_toolchain(backend, tuple(sorted({d.type for d in devices})))
    if problem:
        raise ValueError(problem)
    check_tie_devices(prepared, devices, local=world.processes == 1)
    placement = method.stage_ranks(spec.ranks, spec.chunks)  # the rank of each stage
    rank = world.own_rank(spec.ranks)
    only = None if rank is None else [k for k, r in enumerate(placement) if r == rank]
    per_stage = clip_scope_for(method, settings.clip_scope) == "stage"
    stages = build_stages(model, spec.partition, method, spec.options, settings.optimizer,
                          settings.loss_fn or model_loss, config=settings,
                          lr_scheduler=settings.lr_scheduler, clip_grad_norm=settings.clip_grad_norm if per_stage else None,
                          precision=settings.precision, devices=devices, only=only,
                          parts=prepared.parts, ties=prepared.ties,
                          recompute=recompute_per_stage(settings.recompute, spec.stages),
                          shards=world.stage_shards(spec.ranks, replicas, method.synchronous)
                          if settings.shard_replicas else None, compile=backend)
    world.connect(stages, replicas, placement=placement)
    for stage in stages:
        stage.probes.every = settings.diagnose_every
        stage.takes_target = stage.is_last and settings.loss_fn is None  # the labels go into its module
    return (spec, stages, devices, prepared.split_points, EvalMode(model, prepared.traced, spec.partition, stages),
            placement)


class EvalMode:
    """The model in eval mode for an evaluation. A traced graph keeps the mode it was traced in
    (dropout, batch norm), so a traced model's stages run a second trace, made in eval mode on
    the same example and over the same parameters and buffers, for the duration."""

    def __init__(self, model: nn.Module, traced: Optional[TracedModel], sizes: Sequence[int],
                 stages: List[Stage]) -> None:
        self.model, self.traced, self.sizes, self.stages = model, traced, list(sizes), stages
        self._eval_parts: Optional[List[nn.Module]] = None

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        was_training = self.model.training
        self.model.eval()
        for stage in self.stages:  # a sharded stage's module is a copy of the model's layers
            stage.module.eval()
        swapped = []
        try:
            if self.traced is not None:
                parts = self._parts()
                for stage in self.stages:
                    if stage.shards is not None:  # the eval trace runs over the model's own parameters
                        parts[stage.index].load_state_dict(stage.shards.full_state_dict())
                    swapped.append((stage, stage.module))
                    stage.module = parts[stage.index]
            yield
        finally:
            for stage, module in swapped:
                stage.module = module
            for stage in self.stages:
                stage.module.train(was_training)
            self.model.train(was_training)

    def _parts(self) -> List[nn.Module]:
        if self._eval_parts is None:
            traced = trace(self.model, self.traced.example, self.traced.late)
            if traced.candidates != self.traced.candidates:
                raise ValueError(f"{type(self.model).__name__} calls other submodules in eval mode "
                                 f"({', '.join(traced.candidates)}) than in training "
                                 f"({', '.join(self.traced.candidates)}); evaluate it with evaluate_model(fn)")
            self._eval_parts = traced.stage_modules(self.sizes)
            for stage in self.stages:  # the parameters are already there: this places nothing else
                self._eval_parts[stage.index].to(stage.device)
        return self._eval_parts
