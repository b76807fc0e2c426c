"""The refusals of a run's settings: what the configuration, the model and the world decide, each a
ValueError that names the fix (fit's own: ``fit_checks.py``).

A Pipeline runs them once, when it is built: the options alone (:func:`check_options`, before
a torchrun job is joined), then what the model and the world decide (:func:`check_pipeline`) in
the world's layout, computed there once; :func:`check_run` (sharding, compilation, the cut, the
method's options, the chunks, the micro-batches) resolves the run into the one record everything
after reads (``runtime/spec.RunSpec``). What needs the trace or the placed devices is checked
where they are made, by the functions here (:func:`check_units`, :func:`check_toolchain`,
:func:`check_tie_devices`, :func:`recompute_per_stage`). The lab's launcher asks
:func:`check_run` before it starts any process, and the command line asks the same checks. Each
names an option in the words of the interface in use (:func:`pipeoptim.errors.option`,
:func:`in_words`): ``--clip-scope global`` while the command line runs, where the API says
``clip_scope='global'``. An unknown keyword is refused as Python refuses one, naming the nearest
(:func:`check_method_options`, by ``config.check_keywords``).
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from .batches import item_counter
from .config import check_keywords
from .errors import Shown, flag, on_command_line
from .errors import option as spelled
from .methods import METHODS, Method, clip_scope_for, get_method, with_order
from .options import BY_NAME, OPTIONS
from .partition import weighted_units
from .plan_defaults import PARTITIONERS
from .runtime.compiled import backend_of, missing_toolchain
from .runtime.defaults import CLIP_SCOPES, PRECISIONS
from .runtime.layout import FIXED_CHUNKS, Layout
from .runtime.sharding import fsdp_available
from .runtime.spec import RunSpec
from .schedules.custom import load_order


def in_words(message: str) -> str:
    """A message written in the API's words, in the interface's in use: while the command line
    runs, each option's name as its flag and an option's ``name=`` as ``--name `` (an option the
    command line lacks keeps its name)."""
    if not on_command_line():
        return message
    return re.sub(rf"(?<![\w-])({_NAMES})\b(=)?",
                  lambda m: m.group(0) if flag(m.group(1)) is None else
                  flag(m.group(1)) + (" " if m.group(2) else ""), message)


#: the names in_words turns into flags: the methods' options and every name with an underscore
#: (a plain word such as "method" or "continuous" is left as it is)
_NAMES = "|".join(sorted((re.escape(o.name) for o in OPTIONS if o.scope == "method" or "_" in o.name),
                         key=len, reverse=True))


# -- a Pipeline, when it is built ---------------------------------------------------------------
def method_of(config: Any) -> Method:
    """The run's method: ``config.method``, running ``config.schedule`` where one is given
    (``schedules/custom.py`` checks it before any work: the refusal names the action), whose
    stages, chunks and micro-batches the other options must then agree with."""
    method = get_method(config.method)
    if config.schedule is None:
        return method
    if not method.synchronous:
        raise ValueError(f"schedule= runs with a synchronous method's weights; {method.name} is asynchronous: "
                         f"drop method= (zb-h1's) or give method='1f1b-flush'")
    order = load_order(config.schedule)
    ranks, chunks, micro = order.num_ranks, order.num_stages // order.num_ranks, order.microbatches_per_update
    for name, given, own in (("stages", config.stages, ranks), ("chunks", config.chunks, chunks),
                             ("micro_batches", config.micro_batches, micro)):
        if given is not None and given != own:
            raise ValueError(f"{name}={given}, but schedule {order.name} has {own}: drop {name}=")
    if config.partition is not None and len(config.partition) != order.num_stages:
        raise ValueError(f"schedule {order.name} runs {order.num_stages} stages; the partition "
                         f"{list(config.partition)} lists {len(config.partition)}")
    return with_order(method, order)


def check_model(model: Any) -> None:
    """The model: any ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module (an nn.Sequential, or any module whose "
                         f"forward torch.export can trace), got {type(model).__name__}")


def check_loss_fn(loss_fn: Any, model: Optional[nn.Module] = None) -> None:
    """``loss_fn``: a function, or None where ``model`` computes its own loss (no nn.Sequential does)."""
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError("loss_fn must be a function (output, target) -> scalar loss, or None for a model "
                         "that computes its own loss from batch['labels']")
    if loss_fn is None and isinstance(model, nn.Sequential):
        raise ValueError("an nn.Sequential returns no loss of its own: give loss_fn=fn(output, target)")


def check_pipeline(config: Any, model: nn.Module, world: Any, method: Method) -> RunSpec:
    """Everything the model and the world decide beside the options (:func:`check_options`, run
    before the world is joined), once, when a Pipeline is built, before the loader and the
    processes start: the resolved run, in ``world``'s layout."""
    if world.processes == 1:
        check_one_process(config)
    layout = world.layout(method, config.stages, config.partition, config.chunks, config.data_parallel,
                          config.tensor_parallel)
    if config.shard_replicas:
        check_sharding(world, layout, config)
    check_tensor_parallel(layout, config)
    check_precision(method, config.precision, world.processes)
    check_loss_fn(config.loss_fn, model)
    return check_run(config, model, method, layout)


def check_one_process(config: Any) -> None:
    """What only a torchrun job holds, refused in one process."""
    t, d = config.tensor_parallel, config.data_parallel
    if t != 1:
        raise ValueError(f"{spelled('tensor_parallel', t)} splits each stage over {t} processes: launch with "
                         f"torchrun, N x D x {t} processes (e.g. torchrun --nproc-per-node {2 * t} for 2 stages), "
                         f"or drop {spelled('tensor_parallel')}")
    if d not in (None, 1):
        raise ValueError(f"{spelled('data_parallel', d)} needs torchrun with N x {d} processes (one per stage of "
                         f"each replica)")


def check_options(method: Method, config: Any) -> None:
    """The options alone: what each must be, and the ones that contradict each other."""
    check_loss_fn(config.loss_fn)
    if not config.timeout > 0:
        raise ValueError(f"{spelled('timeout')} must be positive, got {config.timeout}")
    item_counter(config.loss_normalization)  # a name it knows, or a function
    optimizer = config.optimizer
    if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError("optimizer must be a factory called with each stage's parameters, "
                         "e.g. lambda params: torch.optim.SGD(params, lr=0.1), not an optimizer")
    scheduler = config.lr_scheduler
    if scheduler is not None and (not callable(scheduler) or hasattr(scheduler, "step")):
        raise ValueError("lr_scheduler must be a factory called with each stage's optimizer, "
                         "e.g. lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, f), not a scheduler")
    if config.precision not in PRECISIONS:
        raise ValueError(f"{spelled('precision')} must be one of {', '.join(PRECISIONS)}, got {config.precision!r}")
    check_clipping(method, config.clip_grad_norm, config.clip_scope)
    check_diagnose_every(config.diagnose_every)
    if config.partitioner not in PARTITIONERS:
        raise ValueError(f"unknown {spelled('partitioner')} {config.partitioner!r}; "
                         f"choose {', '.join(PARTITIONERS)}")


def check_precision(method: Method, precision: str, processes: int) -> None:
    """fp16 over ``processes`` processes: its loss scale agrees on one found-inf flag per update
    number over every stage (runtime/loss_scaling.py), which an asynchronous method, whose stages
    update at their own times, could only do under torchrun by stalling at every update."""
    if precision == "fp16" and not method.synchronous and processes > 1:
        raise ValueError(
            f"{spelled('precision', 'fp16')} with {method.name} under torchrun is not supported: fp16's loss "
            f"scale skips an update on every stage at once where any stage's gradients overflow, and "
            f"{method.name} updates each stage at its own time, so each stage would wait at every update for the "
            f"first stage's backward of the same mini-batch (the pipeline stalled as by a flush). Use "
            f"{spelled('precision', 'bf16')} (no loss scale needed), a synchronous method (zb-h1), or run "
            f"{method.name} in one process")


def check_diagnose_every(every: int) -> None:
    """``diagnose_every``: 0 (off) or an interval."""
    if every < 0:
        raise ValueError(f"{spelled('diagnose_every')} must be 0 (off) or more, got {every}")


def check_clipping(method: Method, clip_grad_norm: Optional[float], clip_scope: str) -> None:
    """The clipping options: a positive max norm; a global scope only where every stage holds
    the same mini-batch's gradients when it updates, over one copy of each piece."""
    if clip_scope not in CLIP_SCOPES:
        raise ValueError(f"{spelled('clip_scope')} must be one of {', '.join(map(repr, CLIP_SCOPES))}, "
                         f"got {clip_scope!r}")
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ValueError(f"{spelled('clip_grad_norm')} must be a positive max norm, got {clip_grad_norm}")
    if clip_scope != "global" or clip_grad_norm is None:
        return
    stage = spelled("clip_scope", "stage")
    if method.mirrored:
        raise ValueError(f"{spelled('clip_scope', 'global')} over {method.name}'s two replicas of each piece is "
                         f"not supported yet (the norm would count each piece twice): use {stage}")
    if not method.synchronous:
        raise ValueError(f"{spelled('clip_scope', 'global')} needs every stage to update the same mini-batch "
                         f"at once, which only synchronous methods do; {method.name} updates each stage at its "
                         f"own time: use {stage}")


def check_method_options(method: Method, given: Dict[str, Any]) -> Dict[str, Any]:
    """The method's options: ``given`` over each one's default (its ``Option``'s), each value
    one its ``Option`` allows; a keyword that is no option (:func:`check_keywords`), an option the
    method does not take and a bad value are refused."""
    check_keywords(method, given)
    unknown = sorted(set(given) - set(method.options))
    if unknown:
        allowed = ", ".join(method.options) or "none"
        takers = [m.name for m in METHODS.values() if set(unknown) <= set(m.options)]
        hint = f"; {', '.join(unknown)} applies to {', '.join(takers)}" if takers else ""
        raise ValueError(in_words(f"method {method.name!r} takes no option {', '.join(unknown)} "
                                   f"(its options: {allowed}){hint}"))
    merged = {**{name: BY_NAME[name].default for name in method.options}, **given}
    try:
        for key in method.options:
            allowed = BY_NAME[key].choices
            if allowed is not None and merged[key] not in allowed:
                raise ValueError(f"{method.name}: {key} must be one of {', '.join(map(str, allowed))}, "
                                 f"got {merged[key]!r}")
        _check_corrections(method.name, merged, given)
    except ValueError as error:
        raise ValueError(in_words(str(error))) from None
    return merged


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_corrections(method: str, merged: Dict[str, Any], given: Dict[str, Any]) -> None:
    """The numeric correction options and the ones that only mean something together."""
    if "lr_correction_steps" in merged:
        steps = merged["lr_correction_steps"]
        if steps is not None and (not _is_int(steps) or steps < 1):
            raise ValueError(f"{method}: lr_correction_steps must be a number of updates >= 1, got {steps!r}")
        if merged["lr_correction"] == "delay" and steps is None:
            raise ValueError(f"{method}: lr_correction='delay' needs lr_correction_steps=T, the updates "
                             f"over which each stage's lr anneals from lr/delay to lr")
        if "lr_correction_steps" in given and merged["lr_correction"] != "delay":
            raise ValueError(f"{method}: lr_correction_steps applies with lr_correction='delay'")
    for key in ("sync_warmup", "prediction_warmup"):
        if key in merged and (not _is_int(merged[key]) or merged[key] < 0):
            raise ValueError(f"{method}: {key} must be 0 (off) or a number of "
                             f"{'mini-batches' if key == 'sync_warmup' else 'updates'}, got {merged[key]!r}")
    if merged.get("predict_feedback") and not merged.get("error_feedback"):
        raise ValueError(f"{method}: predict_feedback extrapolates error feedback's term: it needs "
                         f"error_feedback on as well (turn both on, or leave predict_feedback off)")
    if "ema_decay" in merged and merged["ema_decay"] is not None:
        decay = merged["ema_decay"]
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
            raise ValueError(f"{method}: ema_decay must lie strictly between 0 and 1, got {decay!r}")
        if merged["delta"] != "ema":
            raise ValueError(f"{method}: ema_decay applies with delta='ema'")


def check_sharding(world: Any, layout: Layout, config: Any) -> None:
    """``shard_replicas``: what the job must be for it."""
    if not isinstance(config.shard_replicas, bool):
        raise ValueError(f"shard_replicas must be True or False, got {config.shard_replicas!r}")
    sharded, drop = spelled("shard_replicas", True), spelled("shard_replicas")
    if world.processes == 1:
        raise ValueError(f"{sharded} shards each stage over its data-parallel replicas, which "
                         f"run as processes: start N x D processes with torchrun (D >= 2), e.g. "
                         f"torchrun --nproc-per-node 4 for 2 stages x 2 replicas, or drop {drop}")
    if layout.replicas < 2:
        raise ValueError(f"{sharded} needs D >= 2 replicas to shard over, but WORLD_SIZE "
                         f"{world.processes} holds {layout.ranks} rank(s) x 1 replica: start "
                         f"{2 * (layout.ranks or 1)} processes or give fewer stages")
    if not fsdp_available():
        raise ValueError(f"{sharded} needs torch's FSDP2 (fully_shard, torch >= 2.6); this "
                         f"is torch {torch.__version__}: upgrade torch or drop {drop}")


def check_tensor_parallel(layout: Layout, config: Any) -> None:
    """``tensor_parallel`` and ``tensor_plan`` beside the other options."""
    if config.tensor_plan is not None and layout.tensor == 1:
        raise ValueError("tensor_plan splits layers over tensor_parallel=T processes: give tensor_parallel=T "
                         "(T >= 2) or drop tensor_plan")
    if layout.tensor == 1:
        return
    if config.compile:
        raise ValueError(f"{spelled('tensor_parallel')} and {spelled('compile')} do not run together yet: "
                         f"drop one of them")


def check_compile(config: Any) -> None:
    """``compile`` beside the other options (its toolchain: :func:`check_toolchain`)."""
    if config.shard_replicas:
        raise ValueError(f"{spelled('compile')} and {spelled('shard_replicas')} do not run together yet (FSDP's "
                         f"hooks around a compiled stage): drop one of them")


# -- a run in a layout: the Pipeline's, or the launcher's before it starts the processes ----------
def check_run(config: Any, model: nn.Module, method: Method, layout: Layout) -> RunSpec:
    """What the configuration and the model decide in ``layout``: compilation beside sharding,
    the cut (:func:`check_split`), a mirrored method's replicas, the method's options, the
    stages the model must have and the micro-batches; the run they resolve, once (the cut
    itself is added when the model is split: ``RunSpec.cut``)."""
    backend = backend_of(config.compile)
    if backend is not None:
        check_compile(config)
    check_split(model, method, config.stages, config.partition, config.split_points, layout.chunks)
    if method.mirrored and (layout.replicas > 1 or config.shard_replicas):
        raise ValueError(f"{method.name} already holds two replicas of each piece; with "
                         f"{spelled('data_parallel')} > 1 or {spelled('shard_replicas')} it is not supported yet: "
                         f"run one pipeline (WORLD_SIZE = stages)")
    options = check_method_options(method, config.method_options)
    ranks = ranks_of(method, layout, config.split_points)
    if ranks is None:
        raise ValueError(f"give {spelled('stages', Shown('N'))} or "
                         f"{spelled('partition', Shown('[layers per stage]'))}")
    if isinstance(model, nn.Sequential):
        check_chunk_layers(model, method, ranks, layout.chunks, config.partition)
    micro = method.microbatches(ranks, config.micro_batches)
    check_microbatches(method, ranks, layout.chunks, micro)
    return RunSpec(method.name, options, dataclasses.replace(layout, ranks=ranks), micro,
                   clip_scope_for(method, config.clip_scope), config.clip_grad_norm, backend, config.precision,
                   recompute_per_stage(config.recompute, ranks * layout.chunks), config.diagnose_every,
                   own_loss=config.loss_fn is None)


def ranks_of(method: Method, layout: Layout, split_points: Optional[Sequence[str]]) -> Optional[int]:
    """The pipeline's ranks N: one for sequential, the layout's, or one more than the split points
    (None: not given)."""
    if method.name == "sequential":
        return 1
    if layout.ranks is not None:
        return layout.ranks
    return (len(split_points) + 1) // method.pieces_per_rank(layout.chunks) if split_points is not None else None


def check_split(model: nn.Module, method: Method, stages: Optional[int], partition: Optional[Sequence[int]],
                points: Optional[Sequence[str]], chunks: int) -> None:
    """A cut that is wrong before any trace: split points for an ``nn.Sequential``, beside a
    partition, naming no submodule, or against ``stages`` (x a chunked method's pieces per stage)."""
    if isinstance(model, nn.Sequential):
        if points is not None:
            raise ValueError("split_points names submodules of a traced model; for an nn.Sequential "
                             "give partition=[layers per stage]")
        return
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
    per_rank = method.pieces_per_rank(chunks)
    if per_rank > 1 and (len(points) + 1) % per_rank:
        fewer = per_rank * max(1, (len(points) + 1) // per_rank) - 1
        raise ValueError(f"{method.name} cuts stages x {per_rank} chunks pieces; {len(points)} split points "
                         f"make {len(points) + 1} pieces, not a multiple of {per_rank}: give {fewer} or "
                         f"{fewer + per_rank} split points")
    if stages is not None and stages * per_rank != len(points) + 1:
        if per_rank == 1:
            raise ValueError(f"stages={stages} but {len(points)} split points make {len(points) + 1} "
                             f"stages; give {stages - 1} split points or stages={len(points) + 1}")
        raise ValueError(f"stages={stages} x {per_rank} chunks are {stages * per_rank} pieces, but {len(points)} "
                         f"split points make {len(points) + 1}; give {stages * per_rank - 1} split points "
                         f"or stages={(len(points) + 1) // per_rank}")


def check_chunk_layers(model: nn.Sequential, method: Method, ranks: int, chunks: int,
                       partition: Optional[Sequence[int]]) -> None:
    """Every piece of a chunked run needs a layer with parameters (a partition says its own)."""
    pieces = method.pieces_per_rank(chunks)
    weighted = len(weighted_units(model))
    if pieces > 1 and partition is None and weighted < ranks * pieces:
        fix = (f"use fewer stages (at most {weighted // pieces}) or a one-chunk method (1f1b-flush, zb-h1)"
               if method.placement in FIXED_CHUNKS else
               f"use {spelled('chunks', max(1, weighted // ranks))} or fewer stages")
        raise ValueError(f"{method.name} with {ranks} stages x {pieces} pieces needs {ranks * pieces} layers with "
                         f"parameters, the model has {weighted}: {fix}")


def check_microbatches(method: Method, ranks: int, chunks: int, micro: int) -> None:
    """The micro-batches per mini-batch the method's schedule can run on ``ranks`` ranks."""
    if chunks > 1 and method.placement == "interleaved" and micro % ranks:
        raise ValueError(f"{method.name} needs micro-batches to be a multiple of the {ranks} stages (got {micro}); "
                         f"use {spelled('micro_batches', ranks * max(1, micro // ranks))}")
    if micro < 1:
        raise ValueError(f"{spelled('micro_batches')} must be at least 1, got {micro}")
    if method.schedule == "2bw" and micro < ranks:
        raise ValueError(f"{method.name} needs micro-batches >= stages ({micro} < {ranks}); "
                         f"use {spelled('micro_batches', ranks)}")


# -- where the model is cut and placed ----------------------------------------------------------
def check_units(model: nn.Module, units: int, candidates: Sequence[str], stages: Optional[int], method: Method,
                per_rank: int = 1) -> None:
    """A traced model has as many pieces as candidate points at most (``per_rank``: a chunked
    method's pieces per stage)."""
    if stages is None or method.name == "sequential" or stages * per_rank <= units:
        return
    if per_rank > 1:
        raise ValueError(f"{method.name} cuts {stages} stages x {per_rank} chunks = {stages * per_rank} pieces, "
                         f"each at a candidate point; {type(model).__name__} has {units} "
                         f"({', '.join(candidates)}): use {spelled('stages', max(1, units // per_rank))} or fewer"
                         + (", or a one-chunk method (1f1b-flush, zb-h1)" if units < 2 * per_rank else ""))
    raise ValueError(f"{stages} stages need {stages} candidate points; "
                     f"{type(model).__name__} has {units} ({', '.join(candidates)}): "
                     f"use {spelled('stages', units)} or fewer")


def check_toolchain(backend: Optional[str], devices: Sequence[torch.device]) -> None:
    """What ``compile`` needs on the stages' devices, once they are placed."""
    problem = missing_toolchain(backend, tuple(sorted({d.type for d in devices})))
    if problem:
        raise ValueError(problem)


def check_tie_devices(ties: Dict[int, List[int]], described: str, devices: Sequence[torch.device],
                      local: bool) -> None:
    """In one process a tied parameter is one tensor, so its holders must share a device."""
    for key, holders in ties.items():
        places = {str(devices[k]) for k in holders}
        if local and len(places) > 1:
            raise ValueError(f"{described} on devices {', '.join(sorted(places))}; in one "
                             f"process a tied weight is one tensor: put those stages on one device")


def recompute_per_stage(recompute: Any, stages: int) -> List[bool]:
    """``recompute`` per stage: one bool for every stage, or a list of one per stage."""
    if isinstance(recompute, bool):
        return [recompute] * stages
    if isinstance(recompute, (list, tuple)) and all(isinstance(r, bool) for r in recompute):
        if len(recompute) != stages:
            raise ValueError(f"recompute lists {len(recompute)} stages but the pipeline has {stages}; "
                             f"give one bool per stage, or recompute=True for all")
        return list(recompute)
    raise ValueError(f"recompute must be True, False or a list of one bool per stage (e.g. "
                     f"[True] * {stages}), got {recompute!r}")
