"""Model preparation for a Pipeline: cut the model into the checked run's stages, find tied weights.

An ``nn.Sequential`` is split by layers; any other module is traced and cut at candidate points
(docs/architecture.md, "Splitting any module"). The ``time`` partitioner (opt-in: a profile
differs between runs and machines) prints the cut it chose, so that it can be given again. A
tied weight stays one parameter, owned by the first stage that reads it (docs/architecture.md,
"Tied weights")."""
from __future__ import annotations

import contextlib
import copy
import itertools
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence

import torch
from torch import nn

from .batches import LABELS, BatchForm, loader_item, model_loss
from .checks import (check_compile, check_tie_devices, check_toolchain,  # noqa: F401
                     check_units)  # (check_compile: tests/test_compile.py imports it from here)
from .config import PipelineConfig
from .graph_split import TracedModel, trace
from .methods import Method
from .partition import plan_partition, plan_time_partition
from .profile import profile_model
from .runtime.build import build_stages, split_for
from .runtime.spec import RunSpec
from .runtime.stage import Stage
from .tensor_plan import resolve_plan
from .world import World


@dataclass
class PreparedModel:
    """The model cut into stage modules (over the Pipeline's own copy), and the run with its cut."""

    spec: RunSpec
    parts: List[nn.Module]              #: one module per stage, sharing the copy's parameters
    #: tied parameters: id(parameter) -> the stages that read it (the first one owns it)
    ties: Dict[int, List[int]] = field(default_factory=dict)
    tied_names: Dict[int, List[str]] = field(default_factory=dict)  #: id -> its names in the stages
    #: where stages 2..N begin (a mirrored method's first pipeline's): a traced model's submodules, an
    #: nn.Sequential's children (its layer indices)
    split_points: Optional[List[str]] = None
    traced: Optional[TracedModel] = None       #: the trace (None for an nn.Sequential)


def needs_example(model: nn.Module, partitioner: Optional[str]) -> bool:
    """Whether preparing ``model`` needs an example input (a traced model, or the time profile)."""
    return not isinstance(model, nn.Sequential) or partitioner == "time"


def prepare(model: nn.Module, example: Any, config: PipelineConfig, method: Method, spec: RunSpec, *,
            agree: Callable[[Any, str], Any] = lambda value, what: value, late: Optional[str] = None) -> PreparedModel:
    """Cut ``model`` (the Pipeline's copy, whose parameters the stages will train) into the
    stages of ``spec``, the run the checks resolved from ``config`` (whose ``partition``,
    ``split_points`` and ``partitioner`` say how). ``example`` is an input mini-batch (needed for
    a traced model and for ``partitioner="time"``; None otherwise). ``agree(value, what)`` gives
    every process rank 0's value (a partition from a profile, which would differ between
    processes). ``late``: the keyword input of ``example`` the last stage takes (the labels of a
    model that computes its own loss). What only the trace shows is refused here, naming the fix."""
    timed = config.partitioner == "time" and config.partition is None and method.name != "sequential"
    per_rank = method.pieces_per_rank(spec.chunks)  # model pieces per rank (a chunked method's several)
    if isinstance(model, nn.Sequential):
        sizes = config.partition
        if timed:
            sizes = agree(_time_sizes(model, example, spec.ranks * per_rank), "agreeing on the partition")
        spec = spec.cut(_cut(model, method, spec.ranks * per_rank, config.partitioner, sizes))
        names = list(model._modules)  # its children, in order
        starts = itertools.accumulate(first_pipeline(method, spec.partition)[:-1])
        return PreparedModel(spec, split_for(method, model, spec.partition), split_points=[names[s] for s in starts])
    traced = trace(model, example, late)
    if late is not None:
        model_loss(traced.output_example())  # refused now, on every process, if it holds no loss
    units = traced.unit_modules()
    if config.split_points is not None:
        sizes: Optional[List[int]] = traced.sizes_for_points(list(config.split_points))
    else:
        sizes = list(config.partition) if config.partition is not None else None
        check_units(model, traced.units, traced.candidates, spec.ranks, method, per_rank)
        if sizes is None and timed:
            sizes = agree(_time_sizes(units, example, spec.ranks * per_rank), "agreeing on the partition")
    spec = spec.cut(_cut(units, method, spec.ranks * per_rank, config.partitioner, sizes))
    pieces = first_pipeline(method, spec.partition)
    parts = traced.stage_modules(pieces)
    if method.mirrored:  # the second pipeline's stages: copies of the pieces (one copy: tied as the originals)
        parts = parts + copy.deepcopy(parts)
    prepared = PreparedModel(spec, parts, split_points=traced.points_for_sizes(pieces), traced=traced)
    for param, holders in traced.shared_parameters(parts).items():
        prepared.ties[id(param)] = holders
        prepared.tied_names[id(param)] = [name for name, p in model.named_parameters(remove_duplicate=False)
                                          if p is param]
    return prepared


def first_pipeline(method: Method, partition: Sequence[int]) -> List[int]:
    """The pieces of ``partition`` a model is cut into: all of it, or a mirrored method's first
    pipeline's (its second pipeline's stages are replicas of them)."""
    return list(partition[:len(partition) // 2] if method.mirrored else partition)


def _cut(units: nn.Sequential, method: Method, pieces: int, partitioner: str,
         partition: Optional[Sequence[int]]) -> List[int]:
    """The layers of each stage: ``partition`` (given, or from a profile), else ``partitioner``'s
    cut of ``units`` into ``pieces``; one stage of every layer for sequential; a mirrored
    method's pieces listed twice (its second pipeline's stages are replicas of them)."""
    if method.name == "sequential":
        return [len(units)]
    sizes = plan_partition(units, pieces, "uniform" if partitioner == "time" else partitioner, partition)
    return list(sizes) * (2 if method.mirrored else 1)


def _time_sizes(units: nn.Sequential, example: Any, stages: int) -> List[int]:
    with torch.random.fork_rng(devices=[]):  # dropout while profiling draws from torch's generator
        profile = profile_model(units, example, warmup=1, repeats=3)
    return plan_time_partition(units, stages, profile.layer_costs(include_loss=False))


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


@dataclass
class BuiltStages:
    """What :func:`build_model_stages` made (``stages``: this process's; the rest per stage), and
    the run with its cut."""

    spec: RunSpec
    stages: List[Stage]
    devices: List[torch.device]
    placement: List[int]
    split_points: Optional[List[str]]
    eval_mode: "EvalMode"


def build_model_stages(world: World, model: nn.Module, example: Any, config: PipelineConfig, method: Method,
                       spec: RunSpec) -> BuiltStages:
    """Split ``model`` (the Pipeline's copy) into the stages of ``spec``, the run the checks
    resolved, build the stages this process holds on their devices, and connect them."""
    replicas = spec.layout.replicas
    prepared = prepare(model, example, config, method, spec, agree=world.agree,
                       late=LABELS if spec.own_loss else None)
    spec = prepared.spec
    chose = config.partition is None and config.split_points is None and method.name != "sequential"
    if config.partitioner == "time" and chose and world.rank == 0:
        # a cut the profile chose (another run may choose another): how to give it again
        given = (f"split_points={prepared.split_points}" if prepared.traced is not None
                 else f"partition={list(spec.partition)}")
        print(f"pipeoptim: partitioner='time' cut {type(model).__name__} into {spec.stages} stages: "
              f"give Pipeline({given}) to use this cut again", file=sys.stderr, flush=True)
    devices = world.place(config.devices, spec.stages)
    check_toolchain(spec.backend, devices)
    described = "; ".join(f"parameter {' = '.join(prepared.tied_names[key])} is read by stages "
                          f"{', '.join(map(str, holders))}" for key, holders in prepared.ties.items())
    check_tie_devices(prepared.ties, described, devices, local=world.processes == 1)
    placement = method.stage_ranks(spec.ranks, spec.chunks)  # the rank of each stage
    rank = world.own_rank(spec.ranks)
    only = None if rank is None else [k for k, r in enumerate(placement) if r == rank]
    stages = build_stages(model, spec.partition, method, spec.options, config.optimizer, config.loss_fn or model_loss,
                          lr_scheduler=config.lr_scheduler, run=spec,
                          devices=devices, only=only, parts=prepared.parts, ties=prepared.ties,
                          shards=world.stage_shards(spec.ranks, replicas, method.synchronous)
                          if config.shard_replicas else None,
                          replica_sync=world.replica_sync(spec.ranks, replicas, config.shard_replicas),
                          tensors=tensor_split(world, model, config, spec.ranks, replicas)
                          if spec.layout.tensor > 1 else None)
    world.connect(stages, replicas, placement=placement)
    return BuiltStages(spec, stages, devices, placement, prepared.split_points,
                       EvalMode(model, prepared.traced, spec.partition, stages))


def tensor_split(world: World, model: nn.Module, config: PipelineConfig, ranks: int, replicas: int):
    """What splits each stage over its tensor ranks: the plan resolved on the whole model (the
    user's ``tensor_plan`` or the model's own), each planned layer's kind and every parameter's
    names (a tied one's all)."""
    plan = resolve_plan(model, config.tensor_plan, config.tensor_parallel)
    modules = dict(model.named_modules())
    kinds = {name: "embedding" if isinstance(modules[name], nn.Embedding) else "linear" for name in plan}
    names: Dict[int, List[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return world.stage_tensors(ranks, replicas, plan, kinds, names)


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
        try:
            with contextlib.ExitStack() as filled:
                if self.traced is not None:
                    for stage in self.stages:  # the eval trace runs over the model's own parameters,
                        if stage.copied is not None:  # which a split stage released: filled (whole) meanwhile
                            filled.enter_context(stage.copied.filled())
                    parts = self._parts()
                    for stage in self.stages:
                        filled.enter_context(stage.running(parts[stage.index]))
                yield
        finally:
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
