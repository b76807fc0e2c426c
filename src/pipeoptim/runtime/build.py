"""Assemble the stages of a run: split the model, one optimizer, scheduler and weight policy per stage."""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch
from torch import nn

from ..methods import Method
from ..partition import split
from ..weights.policies import make_policy
from .interfaces import GradientSync, orthogonalizes
from .layout import Layout
from .loss_scaling import LossScaler
from .probes import PredictionProbes
from .spec import RunSpec
from .stage import Stage
from .tied import LocalExchange, Tie, TiedWeights

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class StageParameters(list):
    """What the optimizer factory is called with: a list of the stage's trainable parameters (any
    ``torch.optim`` class takes it), which also tells factories that treat parameters by their
    layer (``--optimizer muon``) where they come from: ``module``, the stage's slice of the model,
    and ``holds_output``, whether it holds the model's last layer."""

    def __init__(self, params: Iterable[nn.Parameter], module: nn.Module, holds_output: bool) -> None:
        super().__init__(params)
        self.module = module
        self.holds_output = holds_output


def make_optimizer(factory: OptimizerFactory, params: List[nn.Parameter], stage: int) -> torch.optim.Optimizer:
    """Call the user's optimizer factory for one stage's parameters and check what it returns (here,
    not in ``checks.py``: only the built stage has the parameters to call it with)."""
    optimizer = factory(params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a factory params -> torch.optim.Optimizer, e.g. "
                         f"lambda params: torch.optim.AdamW(params, lr=1e-3); it returned "
                         f"{type(optimizer).__name__} for stage {stage}")
    return optimizer


def make_scheduler(factory: SchedulerFactory, optimizer: torch.optim.Optimizer, stage: int) -> Any:
    """Call the user's scheduler factory for one stage's optimizer and check what it returns."""
    scheduler = factory(optimizer)
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError("ReduceLROnPlateau steps on a metric, not after every update; step it "
                         "yourself from on_epoch, or use a schedule such as LambdaLR or CosineAnnealingLR")
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise ValueError(f"lr_scheduler must be a factory optimizer -> torch.optim.lr_scheduler."
                         f"LRScheduler, e.g. lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, f); "
                         f"it returned {type(scheduler).__name__} for stage {stage}")
    if scheduler.optimizer is not optimizer:
        raise ValueError(f"lr_scheduler's factory must build the scheduler on the optimizer it is "
                         f"given; for stage {stage} it used another one")
    return scheduler


def split_for(method: Method, model: nn.Sequential, sizes: Sequence[int]) -> List[nn.Module]:
    """The stage modules of ``model`` cut by ``sizes``: its own layers; a mirrored method's second
    half of the stages copies of the first half's pieces (``sizes`` lists them twice)."""
    if not method.mirrored:
        return split(model, sizes)
    pieces = split(model, sizes[:len(sizes) // 2])
    return pieces + [copy.deepcopy(piece) for piece in pieces]


class OwnedParameters:
    """What a stage's weight policy is made from: the stage module's parameters less the tied ones
    another stage owns (the policy keeps, predicts and clips only what this stage updates)."""

    def __init__(self, module: nn.Module, owned: Callable[[nn.Parameter], bool]) -> None:
        self.module = module
        self.owned = owned

    def named_parameters(self):
        return [(n, p) for n, p in self.module.named_parameters() if self.owned(p)]


def build_stages(model: Optional[nn.Sequential], sizes: Sequence[int], method: Method, options: Dict[str, Any],
                 optimizer: OptimizerFactory, loss_fn: Callable, *,
                 only: Optional[Union[int, Sequence[int]]] = None, lr_scheduler: Optional[SchedulerFactory] = None,
                 run: Optional[RunSpec] = None,
                 devices: Optional[Sequence[torch.device]] = None,
                 parts: Optional[Sequence[nn.Module]] = None,
                 ties: Optional[Dict[int, List[int]]] = None,
                 shards: Optional[Callable[[], Any]] = None, tensors: Optional[Callable[[], Any]] = None,
                 replica_sync: Optional[GradientSync] = None, clock: Optional[Callable[[], float]] = None) -> List[Stage]:
    """Stages over ``model``'s own layers (no copy), or over ``parts`` (a traced model's stage
    modules). ``only`` builds just that stage, or those stages (one process of a distributed run).
    Stage k's layers are moved to ``devices[k]`` before its optimizer is made. ``ties``:
    parameters read by several stages, ``id(p)`` -> those stages; the first owns it. ``shards``:
    makes the :class:`~pipeoptim.runtime.sharding.StageShards` of each stage, which trains a
    sharded copy of its layers (theirs are released once every stage is built); ``tensors``: the
    :class:`~pipeoptim.runtime.tensor_parallel.StageTensors` of each stage, which trains a copy
    split over its tensor ranks (released likewise). ``replica_sync``: what averages the stages'
    gradients over their replicas (a sharded stage's: its shards). ``run``: the resolved run, whose per-stage
    settings every stage takes (clipping, precision, recompute, compilation, the diagnostic's
    interval, a model's own loss); None: stages built by hand, with none of them. ``clock``: the
    seconds the stages' records read (None: ``time.perf_counter``)."""
    run = run if run is not None else RunSpec(method.name, options, Layout(None), 1)
    parts = list(parts) if parts is not None else split_for(method, model, sizes)
    ties = ties or {}
    # one in-memory exchange per tie, shared by its holders' stages (torchrun's world replaces them)
    exchanges = {key: LocalExchange(holders) for key, holders in ties.items()}
    n = len(parts)
    # where each pipeline starts and ends: one chain 0..n-1, or a mirrored method's two of n/2
    chains = [range(n // 2), range(n // 2, n)] if method.mirrored else [range(n)]
    firsts, lasts = {c[0] for c in chains}, {c[-1] for c in chains}
    scaler = LossScaler() if run.precision == "fp16" else None  # one loss scale for this process's stages
    stages = []
    for k, part in enumerate(parts):
        if only is not None and k not in ((only,) if isinstance(only, int) else only):
            continue
        device = torch.device(devices[k]) if devices is not None else None
        if device is not None:
            part.to(device)
        # each parameter's name under its model key (id of the original: how ``ties`` names it), and
        # the names of those this stage trains (a tied one: its owner only)
        own = {id(p): name for name, p in part.named_parameters()}
        trains = {name for name, p in part.named_parameters() if p.requires_grad and ties.get(id(p), [k])[0] == k}
        sharded = shards() if shards is not None else None
        divided = tensors() if tensors is not None else None
        if divided is not None:  # a copy: each planned layer's part of this tensor rank
            original, part = part, divided.parallelize(part)
            if sharded is not None:  # then sharded over the replicas (the shards release the original)
                part = sharded.shard(part, original=original)
        elif sharded is not None:  # the copy's parameters, owned and tied as the originals were
            part = sharded.shard(part)
        named = dict(part.named_parameters())
        owned_ids = frozenset(id(named[name]) for name in trains)

        def owned(p: nn.Parameter, ids: frozenset = owned_ids) -> bool:
            return id(p) in ids
        params = StageParameters([p for p in part.parameters() if owned(p)], part, k in lasts)
        if not params:
            what = "units" if isinstance(part, torch.fx.GraphModule) else "layers"
            raise ValueError(f"stage {k} ({what} {sum(sizes[:k])}..{sum(sizes[:k + 1]) - 1}) has no "
                             f"trainable parameters of its own; choose another partition (or split points)")
        opt = make_optimizer(optimizer, params, k)
        if sharded is not None and orthogonalizes(opt):
            raise ValueError("torch.optim.Muon orthogonalizes each whole matrix, which a stage sharded over its "
                             "replicas holds in pieces: drop shard_replicas (replicas hold whole matrices) or "
                             "use an elementwise optimizer (AdamW, SGD)")
        if divided is not None and orthogonalizes(opt):
            raise ValueError("torch.optim.Muon orthogonalizes each whole matrix, which a stage split over its "
                             "tensor ranks holds in pieces (gathering each for every step would undo the split): "
                             "drop tensor_parallel or use an elementwise optimizer (AdamW, SGD)")
        policy = make_policy(method.policy, OwnedParameters(part, owned), opt, stage=k, num_stages=n,
                             sharded=sharded is not None or divided is not None, **options)
        policy.use_lr_schedule(lr_scheduler)  # before the scheduler changes the groups' lrs
        scheduler = make_scheduler(lr_scheduler, opt, k) if lr_scheduler is not None else None
        # every tie of the model, held here or not: each rank makes the same groups
        tied = TiedWeights(k, [Tie(holders, named[own[key]] if key in own else None, own.get(key, ""),
                                   exchange=exchanges[key]) for key, holders in ties.items()],
                           synchronous=method.synchronous) if ties else None
        stage = Stage(k, n, part, opt, policy, loss_fn=loss_fn if k in lasts else None, scheduler=scheduler,
                      clip_grad_norm=run.stage_clip, precision=run.precision, device=device,
                      recompute=bool(run.recompute[k]) if run.recompute else False, compile=run.backend,
                      first=k in firsts, last=k in lasts, shards=sharded, tensor=divided, tied=tied,
                      grad_sync=sharded if sharded is not None else replica_sync,
                      # a mirrored method's second pipeline: copies of pieces 0 .. n/2 - 1
                      replica_of=k - n // 2 if method.mirrored and k >= n // 2 else None,
                      # a model without loss_fn computes its own loss: the labels go into its last module
                      takes_target=k in lasts and run.own_loss,
                      probes=PredictionProbes(run.diagnose_every),
                      loss_scaling=scaler, clock=clock)
        stages.append(stage)
    for stage in stages:  # every stage built: a split one's original layers freed (it holds its part)
        if stage.copied is not None:
            stage.copied.release_original()
    return stages
