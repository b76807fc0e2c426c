"""Plan a pipeline run of any model from a profile: which method, how many micro-batches, which
split (``pipeoptim.plan``; the command line's ``pipeoptim plan`` adds the lab's study to it).

**Any model.** An ``nn.Sequential`` is planned layer by layer; any other module is traced as the
Pipeline traces it (:func:`pipeoptim.graph_split.trace`) and planned unit by unit: a partition
then counts units, as the Pipeline's ``partition=`` does for that model. Chunked and mirrored
methods (interleaved, zb-v, bidirectional, bitpipe) need an ``nn.Sequential``, as the Pipeline does.

**Measured on a busy machine.** The per-unit profile (:mod:`pipeoptim.profile`) feeds the
partitioners and the memory; the predictions' stage costs are the splits and the sequential
reference timed as the runtime runs them, in turns (:func:`time_splits`), so that other work on
the machine slows all of them alike. A candidate predicted faster than its process count times
the sequential reference is flagged and not recommended (:mod:`pipeoptim.recommendation`, also
the rule for a model no study measured)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .batches import LABELS, BatchForm, loader_item, model_loss
from .checks import check_loss_fn, check_model
from .graph_split import TracedModel, trace
from .methods import get_method, split_variant
from .plan_defaults import DEFAULT_METHODS, DEFAULT_MICROBATCHES, PARTITIONERS
from .throughput import (TensorLayers, candidate_problem, describe_partition, head_rows, microbatch_size,
                         partition_for, predict, profile_sizes, style_name)
from .compat import tensor_leaves
from .errors import option
from .profile import check_statistic
from .stage_timing import StageTimer
from .recommendation import RULE, pieces_note, reach, recommend, time_in_code, try_in_code, unstudied_notes

#: (layers or units per stage, rows timed, the method that runs them, its micro-batches): gpipe and
#: 1 for a split timed stage by stage; a chunked or mirrored method's pieces run as it runs them
Split = Tuple[Tuple[int, ...], int, str, int]


@dataclass
class Units:
    """A model as the planner cuts it: ``net`` chains its layers (an ``nn.Sequential``) or units
    (a traced model's), ``sample`` is what the first takes, ``loss(output, target)`` the loss
    (the model's own where ``target`` is None), ``traced`` the trace (None: an nn.Sequential)."""

    net: nn.Sequential
    sample: Any
    target: Any
    loss: Callable[[Any, Any], torch.Tensor]
    traced: Optional[TracedModel]
    batch_size: int
    name: str

    def split_points(self, sizes: Sequence[int]) -> Optional[List[str]]:
        """Where stages 2.. begin in a traced model (the Pipeline's ``split_points=``)."""
        return None if self.traced is None else self.traced.points_for_sizes(list(sizes))


def _own_loss(output: Any, target: Any = None) -> torch.Tensor:
    return model_loss(output)


def model_units(model: nn.Module, batch: Any, loss_fn: Optional[Callable] = None) -> Units:
    """``model`` with one mini-batch ``batch`` of its data, as the planner cuts it (:class:`Units`).
    ``batch``: ``(inputs, target)`` with a ``loss_fn``, or a dict of the forward's keyword tensors
    with ``"labels"`` (the target with a ``loss_fn``; without one the model computes its loss).
    Bad combinations raise ValueError naming the fix."""
    check_model(model)
    check_loss_fn(loss_fn, model)
    form = BatchForm(model_loss=loss_fn is None)
    inputs, target = form.pair(*loader_item(batch))
    sample = form.example(inputs, target)
    first = tensor_leaves(sample)
    if not first or first[0].dim() == 0:
        raise ValueError("the example batch holds no tensor with a batch dimension (dimension 0)")
    rows = int(first[0].shape[0])
    if isinstance(model, nn.Sequential):
        if len(model) == 0:
            raise ValueError("the nn.Sequential has no layers to plan")
        return Units(model, sample, target, loss_fn, None, rows, type(model).__name__)
    with torch.random.fork_rng(devices=[]):
        traced = trace(model, sample, LABELS if loss_fn is None else None)
    if loss_fn is None:
        model_loss(traced.output_example())  # refused here if the model returns no loss
    return Units(traced.unit_modules(), sample, None if loss_fn is None else target,
                 loss_fn or _own_loss, traced, rows, type(model).__name__)


def check_options(stages: int, methods: Sequence[str], microbatches: Sequence[int],
                  speeds: Optional[Sequence[float]], bandwidth: Optional[float], memory_limit: Optional[float],
                  partitioner: str, tie: float, stage_timing: str) -> Any:
    """(methods, micro-batch counts, speeds) as lists, checked; a one-line ValueError naming the
    option in the words of the interface in use (:func:`pipeoptim.errors.option`) otherwise."""
    methods = list(methods)
    for m in methods:
        split_variant(m)  # a method, or one with error feedback (pipeoptim-2bw+ef)
    counts = list(microbatches)
    if not counts or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in counts):
        raise ValueError(f"{option('micro_batches')} must be positive integers, got {microbatches!r}")
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"{option('stages')} must be at least 1, got {stages}")
    if speeds is not None:
        speeds = [float(s) for s in speeds]
        if len(speeds) != stages:
            raise ValueError(f"{option('speeds')} has {len(speeds)} values but {option('stages')} is {stages} "
                             f"(give one per stage)")
        if any(not (s > 0 and s < float("inf")) for s in speeds):
            raise ValueError(f"{option('speeds')} must all be positive, got {speeds}")
    if bandwidth is not None and not (0 < bandwidth < float("inf")):
        raise ValueError(f"{option('bandwidth')} must be positive (bytes per second), got {bandwidth}")
    if memory_limit is not None and not memory_limit > 0:
        raise ValueError(f"{option('memory_limit')} must be positive, got {memory_limit}")
    if partitioner not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {partitioner!r}; choose one of: {', '.join(PARTITIONERS)}")
    if not 0 <= tie < 1:
        raise ValueError(f"{option('tie')} must be in [0, 1), got {tie}")
    if stage_timing not in ("measured", "profile"):
        raise ValueError(f"{option('stage_timing')} must be measured or profile, got {stage_timing!r}")
    return methods, counts, speeds


# -- tensor parallelism -------------------------------------------------------------------------------

def tensor_layers(units: Units, plan: Dict[str, Any], tensor: int, repeats: int = 3) -> TensorLayers:
    """:class:`~pipeoptim.throughput.TensorLayers` of ``units`` (an ``nn.Sequential``) for
    ``plan`` ({module name: torch's style}, ``tensor_plan.resolve_plan``'s), measured
    on its sample: forwards with every planned module and every layer timed (the fastest of
    ``repeats``), each planned module's output bytes noted, and its input's where it has a gradient."""
    if units.traced is not None:
        raise ValueError(f"tensor parallelism is priced on an nn.Sequential's layers, and {units.name} is traced "
                         f"(not yet priced): drop {option('tensor_parallel')}, or plan an nn.Sequential model")
    net, reduce, gather = units.net, 2 * (tensor - 1) / tensor, (tensor - 1) / tensor
    modules, n = dict(net.named_modules()), len(net)
    kinds = {name: "embedding_rowwise" if isinstance(modules[name], nn.Embedding) and style_name(style).startswith(
        "rowwise") else style_name(style) for name, style in plan.items()}
    layer_of = {name: int(name.split(".")[0]) for name in plan}
    split, whole, fwd, bwd, seconds, started = [0] * n, [0] * n, [0.0] * n, [0.0] * n, {}, {}
    for name, kind in kinds.items():
        part = sum(p.numel() * p.element_size() for a, p in modules[name].named_parameters(recurse=False)
                   if not (a == "bias" and "rowwise" in kind))
        split[layer_of[name]] += part
        whole[layer_of[name]] += part if kind == "embedding_rowwise" else 0  # its gradient: replicated
    size = lambda t: t.numel() * t.element_size() if torch.is_tensor(t) else 0  # noqa: E731

    def hook(name: str, first: List[bool]) -> Callable:
        def after(module: nn.Module, args: Any, output: Any) -> None:
            took = time.perf_counter() - started[name]
            seconds[name] = min(seconds.get(name, took), took)
            if name in kinds and first[0]:
                kind, k, x = kinds[name], layer_of[name], args[0] if args else None
                fwd[k] += (reduce if "rowwise" in kind else gather if kind.endswith("output") else 0) * size(output)
                if torch.is_tensor(x) and x.requires_grad:
                    bwd[k] += (reduce if kind.startswith("colwise") else gather if kind.endswith("input") else 0) * size(x)
        return after

    first, timed = [True], {**{str(k): layer for k, layer in enumerate(net)}, **{name: modules[name] for name in kinds}}
    handles = [h for name, m in timed.items() for h in (
        m.register_forward_pre_hook(lambda *_, name=name: started.__setitem__(name, time.perf_counter())),
        m.register_forward_hook(hook(name, first)))]
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            for _ in range(max(1, repeats)):
                net(units.sample)
                first[0] = False
    finally:
        for handle in handles:
            handle.remove()
    inside = [sum(seconds[m] for m in kinds if layer_of[m] == k) for k in range(n)]
    share = [min(1.0, inside[k] / seconds[str(k)]) if seconds[str(k)] > 0 else 0.0 for k in range(n)]
    per_sample = [[b / units.batch_size for b in wire] for wire in (fwd, bwd)]
    return TensorLayers(tensor, split, share, *per_sample, kinds, whole)


# -- timing the splits -----------------------------------------------------------------------------

def time_splits(net: nn.Sequential, splits: Sequence[Split], sample: Any, target: Any, loss_fn: Callable, *,
                device: str = "cpu", optimizer: Optional[Callable] = None, warmup: int = 2, repeats: int = 5,
                max_rounds: Optional[int] = None, tolerance: float = 0.05, statistic: str = "median",
                ) -> Tuple[Dict[Split, Dict[str, List[float]]], Dict[str, Any]]:
    """Each split's stage seconds as the runtime runs them, all measured in turns.

    ``splits``: (layers per stage, rows, method, micro-batches): the split of ``net`` timed on
    the first ``rows`` samples of ``sample`` under the method (:class:`~pipeoptim.profile.
    StageTimer`; gpipe with one micro-batch: each stage alone). Every round trains one mini-batch on each split in
    turn, after ``warmup`` untimed rounds; from ``repeats`` rounds on, it stops once, for every
    split, the ``statistic`` of its first half of rounds and of its second half (forward +
    backward + update, all stages) differ by at most ``tolerance`` (relative), or at
    ``max_rounds`` (default 3 x ``repeats``). Returns ({split: {"forward", "backward", "update":
    seconds per stage}}, the measurement: rounds, whether stable, the largest disagreement of
    halves, and per split its spread, the interquartile range of its rounds over their median)."""
    check_statistic(statistic)
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    limit = max(repeats, max_rounds if max_rounds is not None else 3 * repeats)
    timers = {split: StageTimer(net, list(split[0]), head_rows(sample, split[1]),
                                None if target is None else target[:split[1]], loss_fn, device=device,
                                optimizer=optimizer, method=split[2], microbatches=split[3])
              for split in dict.fromkeys(splits)}
    summary = statistics.median if statistic == "median" else min
    rounds, worst = 0, float("inf")
    for _ in range(warmup):
        for timer in timers.values():
            timer.run()
    while rounds < limit:
        for timer in timers.values():
            timer.run()
        rounds += 1
        if rounds >= max(repeats, 2):
            half = rounds // 2
            worst = max(abs(summary(t[half:]) / summary(t[:half]) - 1.0)
                        for t in (timer.totals(warmup) for timer in timers.values()))
            if rounds >= repeats and worst <= tolerance:
                break

    def spread(totals: List[float]) -> float:
        if len(totals) < 4:
            return (max(totals) - min(totals)) / statistics.median(totals)
        q = statistics.quantiles(totals, n=4)
        return (q[2] - q[0]) / statistics.median(totals)

    times = {split: timer.summary(warmup, statistic) for split, timer in timers.items()}
    return times, {"rounds": rounds, "stable": worst <= tolerance, "halves_disagree": worst, "tolerance": tolerance,
                   "spread": {f"{list(s[0])} x {s[1]} rows" + (f" ({s[2]}, M = {s[3]})" if s[2] != "gpipe" else ""):
                              spread(t.totals(warmup)) for s, t in timers.items()}}


# -- the candidates --------------------------------------------------------------------------------

def survey(units: Units, *, stages: int, batches: int = 100, device: str = "cpu",
           speeds: Optional[Sequence[float]] = None, bandwidth: Optional[float] = None,
           methods: Sequence[str] = DEFAULT_METHODS, microbatches: Sequence[int] = DEFAULT_MICROBATCHES,
           memory_limit: Optional[float] = None, partitioner: str = "uniform", scaling: str = "measure",
           seed: int = 0, optimizer: Optional[Callable] = None, optimizer_name: Optional[str] = None,
           warmup: int = 2, repeats: int = 5, max_rounds: Optional[int] = None, tolerance: float = 0.05,
           statistic: str = "median", stage_timing: str = "measured", log: Optional[Callable] = None,
           tensor: Optional[TensorLayers] = None) -> Dict[str, Any]:
    """Profile ``units``, split them three ways and predict every (method, micro-batch count)
    (``tensor``: each stage on T processes, :mod:`pipeoptim.throughput`'s model):
    ``{"profiles": {M: profile of one micro-batch}, "partitions", "reference", "candidates",
    "skipped", "measurement"}`` (the arguments: :func:`plan`'s). Each candidate carries its
    ``speedup`` over the sequential reference, its ``processes`` and whether that speedup is
    ``reachable`` (at most the process count, T per stage)."""
    log = log or (lambda *a, **k: None)
    net, layers, batch_size = units.net, len(units.net), units.batch_size
    what = "units" if units.traced is not None else "layers"
    if stages > layers:
        raise ValueError(f"{stages} stages are more than the {layers} {what} of {units.name}: plan {layers} "
                         f"stages or fewer" + (f" (it can be cut before {', '.join(units.traced.candidates[1:])})"
                                               if units.traced is not None else ""))
    log(f"profiling {units.name} ({layers} {what}) on {device}, batch {batch_size}, micro-batch counts "
        f"{list(microbatches)} ({scaling})")
    profiles = profile_sizes(net, units.sample, units.target, units.loss if units.target is not None else None,
                             batch_size=batch_size, microbatches=microbatches, scaling=scaling, device=device,
                             warmup=warmup, repeats=repeats, statistic=statistic, optimizer=optimizer,
                             optimizer_name=optimizer_name, seed=seed)
    full = profiles[1]
    weighted = sum(1 for layer in net if any(True for _ in layer.parameters()))  # what chunks split
    splits = {how: partition_for(how, net, full, stages, speeds, bandwidth) for how in PARTITIONERS}
    plans, skipped = [], []  # (method, M, split) to predict
    for m in microbatches:
        sizes = partition_for(partitioner, net, profiles[m], stages, speeds, bandwidth)
        pieces: Dict[Any, List[int]] = {}  # the split of a chunked method, by its placement
        for name in methods:
            method, options = split_variant(name)
            n, meth = (1 if method == "sequential" else stages), get_method(method)
            if method == "sequential" and m != 1:
                continue
            problem = candidate_problem(method, n, m, batch_size, weighted)
            if problem:
                skipped.append({"method": name, "microbatches": m, "reason": problem})
                continue
            split = sizes if n == stages else [layers]
            if n == stages and meth.chunks > 1:  # stages x pieces per rank, each on its rank's device
                # (a mirrored method's stages past its pieces are their replicas: not split again)
                placement = tuple(meth.stage_ranks(stages, meth.chunks)[:stages * meth.pieces_per_rank(meth.chunks)])
                if placement not in pieces:
                    pieces[placement] = partition_for(partitioner, net, profiles[m], len(placement),
                                                      None if speeds is None else [speeds[r] for r in placement],
                                                      bandwidth)
                split = pieces[placement]
            plans.append((name, m, list(split)))
    rows = (lambda m: microbatch_size(batch_size, m)) if scaling == "measure" else (lambda m: batch_size)

    def key(split: Sequence[int], m: int, method: str = "gpipe") -> Split:
        """What times ``split`` for ``method`` at ``M = m``: a chunked or mirrored method's pieces
        as it runs them (in turns on a process), any other split stage by stage."""
        if get_method(method).chunks > 1:
            return tuple(split), batch_size, method, m
        return tuple(split), rows(m), "gpipe", 1

    keys = [key([layers], m) for m in dict.fromkeys([1, *microbatches])] + [key(s, 1) for s in splits.values()] + [
        key(split, m, split_variant(name)[0]) for name, m, split in plans]
    times, measurement = {}, None
    if stage_timing == "measured":
        log(f"timing {len(dict.fromkeys(keys))} splits as the runtime runs them, in turns, until stable")
        times, measurement = time_splits(net, keys, units.sample, units.target, units.loss, device=device,
                                         optimizer=optimizer, warmup=warmup, repeats=repeats, max_rounds=max_rounds,
                                         tolerance=tolerance, statistic=statistic)
        measurement["raised"] = {}

    def measured(split: Sequence[int], m: int, method: str = "gpipe") -> Optional[Dict[str, List[float]]]:
        """Measured stage times of one micro-batch of ``M = m`` on ``split`` (None: from the profile).
        The stages of a split do at least the whole model's work: where their forward and backward
        add up to less than the whole model's, timed the same way at the same rows, they are
        raised to it (what they lack is other work's noise; ``measurement["raised"]``)."""
        if stage_timing != "measured":
            return None
        timed = key(split, m, method)
        found, whole = times[timed], times[key([layers], m)]
        pieces = len(split)  # a mirrored method's stages past its pieces are their replicas
        done = sum(found["forward"][:pieces]) + sum(found["backward"][:pieces])
        floor = (whole["forward"][0] + whole["backward"][0]) / done if done > 0 else 1.0
        factor = microbatch_size(batch_size, m) / timed[1] if timed[3] == 1 else 1
        if floor > 1:
            measurement["raised"][f"{list(split)}, {method}, M = {m}"] = floor
        raise_by = max(floor, 1.0) * factor
        if raise_by == 1:
            return found
        out = {name: [t * raise_by for t in found[name]] for name in ("forward", "backward", "weight") if name in found}
        return dict(out, update=list(found["update"]))

    partitions = {}
    for how, sizes in splits.items():
        partitions[how] = describe_partition(full, sizes, speeds, bandwidth)
        found = measured(sizes, 1)
        if found is not None:
            speed = speeds or [1.0] * stages
            per_stage = [(f + b) / v for f, b, v in zip(found["forward"], found["backward"], speed)]
            partitions[how]["measured_stage_seconds"] = per_stage
            partitions[how]["measured_slowest_stage_seconds"] = max(per_stage)
        if units.traced is not None:
            partitions[how]["split_points"] = units.split_points(sizes)
    reference = predict("sequential", full, [layers], microbatches=1, batches=batches, batch_size=batch_size,
                        measured=measured([layers], 1))
    candidates = []
    for name, m, split in plans:
        method, options = split_variant(name)
        n = 1 if method == "sequential" else stages
        row = predict(method, profiles[m], split, microbatches=m, batches=batches, batch_size=batch_size,
                      speeds=speeds if n == stages else None, bandwidth=bandwidth, options=options,
                      measured=measured(split, m, method), tensor=tensor)
        row["memory_fits"] = memory_limit is None or row["max_stage_memory"] <= memory_limit
        reach(row, reference["samples_per_second"], n, speeds, tensor.tensor if tensor is not None else 1)
        if units.traced is not None:  # (a chunked method's: where each of its pieces begins)
            row["split_points"] = units.split_points(split)
        candidates.append(row)
    return {"profiles": profiles, "partitions": partitions, "candidates": candidates, "skipped": skipped,
            "reference": {"method": "sequential", "samples_per_second": reference["samples_per_second"],
                          "stage_seconds": reference["stage_forward_seconds"][0]
                          + reference["stage_backward_seconds"][0]},
            "measurement": measurement}


# -- the plan --------------------------------------------------------------------------------------

def assemble(units: Units, found: Dict[str, Any], best: Dict[str, Any], *, stages: int, partitioner: str,
             memory_limit: Optional[float], rule: str, notes: List[str], settings: Dict[str, Any]) -> Dict[str, Any]:
    """The plan as a JSON-ready dict: the recommendation ``best`` of ``found`` (:func:`survey`'s),
    how the Pipeline runs it (``pipeline``: its keyword arguments), and everything predicted."""
    n_best = 1 if best["method"] == "sequential" else stages
    keys = ("samples_per_second", "makespan_seconds", "batches", "bubble_fraction", "speedup", "reachable",
            "stage_forward_seconds", "stage_backward_seconds", "update_seconds", "comm_seconds", "limited_by_link",
            "seconds_per_batch", "updates_ratio", "time_to_target_seconds")
    options = dict(best.get("options") or {})  # error_feedback=True for a +ef candidate
    tensor = best.get("tensor_parallel", 1)
    run = {"method": best["method"], "stages": n_best, "partition": best["partition"],
           "micro_batches": best["microbatches"], **options, **({"tensor_parallel": tensor} if tensor > 1 else {})}
    profiles = found["profiles"]
    return {
        "batch_size": units.batch_size, "stages": n_best, "partition": best["partition"],
        "split_points": units.split_points(best["partition"]),  # (a chunked method's: where its pieces begin)
        "partitioner": partitioner if n_best == stages else "uniform", "method": best["method"],
        "tensor_parallel": tensor,
        "options": options, "variant": best.get("variant", best["method"]),
        "microbatches": best["microbatches"], "pipeline": run,
        "predicted": {k: best.get(k) for k in keys},
        "memory": {"per_stage": best["memory"], "max_stage": best["max_stage_memory"], "limit": memory_limit},
        "recommendation": {"method": best["method"], "options": options, "variant": best.get("variant", best["method"]),
                           "microbatches": best["microbatches"],
                           "synchronous": best["synchronous"], "rule": rule, "notes": notes},
        "settings": dict(settings, threads=torch.get_num_threads(), stages=stages),
        "units": {"traced": units.traced is not None, "count": len(units.net), "own_loss": units.loss is _own_loss,
                  "cut_points": None if units.traced is None else list(units.traced.candidates)},
        "partitions": found["partitions"], "reference": found["reference"], "measurement": found["measurement"],
        "candidates": found["candidates"], "skipped": found["skipped"], "profile": profiles[1].to_dict(),
        "microbatch_profiles": {str(m): p.to_dict() for m, p in profiles.items() if m != 1},
    }


def plan(model: nn.Module, batch: Any, loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None, *,
         stages: int, optimizer: Optional[Callable] = None, batches: int = 100, device: str = "cpu",
         speeds: Optional[Sequence[float]] = None, bandwidth: Optional[float] = None,
         methods: Sequence[str] = DEFAULT_METHODS, micro_batches: Sequence[int] = DEFAULT_MICROBATCHES,
         memory_limit: Optional[float] = None, partitioner: str = "uniform", scaling: str = "measure",
         warmup: int = 2, repeats: int = 5, max_rounds: Optional[int] = None, tolerance: float = 0.05,
         statistic: str = "min", stage_timing: str = "measured", tie: float = 0.02, seed: int = 0,
         log: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Which method, how many micro-batches and which split for ``model`` on ``stages`` processes,
    predicted from a profile of one mini-batch ``batch`` of its data (see the module docstring).

    ``model``: an ``nn.Sequential`` or any module the Pipeline traces (a ``transformers`` model).
    ``batch``: ``(inputs, target)`` with ``loss_fn(output, target)``, or a dict of the forward's
    keyword tensors with ``"labels"`` (with no ``loss_fn`` the model computes its own loss).
    ``optimizer``: the Pipeline's factory ``params -> torch.optim.Optimizer`` whose update time and
    state are profiled (default: AdamW). ``batches``: mini-batches per predicted run. ``device``:
    where to profile (cpu, cuda, cuda:1 ...). ``speeds``: one relative speed per stage's device
    (default: all equal). ``bandwidth``: bytes per second of each link (None: free transfers).
    ``methods``, ``micro_batches``: what to predict. ``memory_limit``: bytes per process; larger
    candidates are not recommended. ``partitioner``: the split the predictions use (uniform,
    the Pipeline's default; params; or time, balanced profiled time).
    ``scaling``: profile every micro-batch size (measure) or scale the mini-batch's (linear).
    ``warmup``, ``repeats``, ``statistic`` (min, the default: the fastest run, what the machine
    does without other work; or median): the profile's and the timed splits' untimed runs, timed
    runs and summary; ``max_rounds`` (default 3 x ``repeats``) and
    ``tolerance``: the timed splits take turns until stable (:func:`time_splits`).
    ``stage_timing``: measured (the splits timed as the runtime runs them) or profile (the sums
    of the profiled layers: faster, optimistic). ``tie``: the relative difference in samples/s
    counted as a tie. ``seed``: of the profile's random gradients. ``log``: called with progress.

    Returns the plan as a JSON-ready dict: ``pipeline`` (the Pipeline's ``method``, ``stages``,
    ``partition``, ``micro_batches``: ``Pipeline(model, **plan["pipeline"], ...)``),
    ``split_points`` (a traced model's), ``predicted``, ``memory``, ``recommendation`` (the rule,
    :data:`RULE`, and notes), ``candidates`` (each: samples/s, speedup, reachable, memory per
    stage), ``skipped`` (with the reason), ``partitions``, ``reference``, ``measurement``,
    ``profile``. Bad arguments raise ValueError naming the fix."""
    methods, counts, speeds = check_options(stages, methods, micro_batches, speeds, bandwidth, memory_limit,
                                            partitioner, tie, stage_timing)
    if not isinstance(batches, int) or batches < 1:
        raise ValueError(f"batches must be at least 1, got {batches}")
    if optimizer is not None and (not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer)):
        raise ValueError("optimizer must be a factory called with each stage's parameters, e.g. "
                         "lambda params: torch.optim.AdamW(params, lr=1e-3), not an optimizer")
    units = model_units(model, batch, loss_fn)
    found = survey(units, stages=stages, batches=batches, device=device, speeds=speeds, bandwidth=bandwidth,
                   methods=methods, microbatches=counts, memory_limit=memory_limit, partitioner=partitioner,
                   scaling=scaling, seed=seed, optimizer=optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
                   optimizer_name="adamw" if optimizer is None else "yours", warmup=warmup, repeats=repeats,
                   max_rounds=max_rounds, tolerance=tolerance, statistic=statistic, stage_timing=stage_timing,
                   log=log)
    for c in found["candidates"]:
        c["eligible"] = c["synchronous"]
    best = recommend(found["candidates"], memory_limit, tie, order=methods)
    notes = (["a model of your own: no study measured the updates the asynchronous methods need on it."]
             + unstudied_notes(found["candidates"], best, try_in_code)
             + pieces_note(found["candidates"], best, time_in_code))
    settings = {"device": device, "speeds": speeds, "bandwidth": bandwidth, "methods": methods,
                "microbatch_counts": counts, "scaling": scaling, "batches": batches, "seed": seed,
                "optimizer": "adamw" if optimizer is None else "yours", "warmup": warmup, "repeats": repeats,
                "max_rounds": max_rounds, "tolerance": tolerance, "statistic": statistic,
                "stage_timing": stage_timing, "tie": tie}
    out = assemble(units, found, best, stages=stages, partitioner=partitioner, memory_limit=memory_limit,
                   rule=RULE.format(tie=tie), notes=notes, settings=settings)
    return {"model": units.name, **out}
