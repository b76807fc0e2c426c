"""Plan a pipeline run from a profile: partition, method and micro-batch count (BaPipe-style).

:func:`make_plan` profiles a task's model (:mod:`pipeoptim.profile`), splits it three ways
(``uniform`` layers, balanced ``params``, balanced profiled ``time``; see
:func:`pipeoptim.partition.time_partition`), and for every method and micro-batch count
predicts

* **throughput**: the schedule simulator (:func:`pipeoptim.schedules.simulate`) runs the
  method's schedule for ``batches`` mini-batches with per-stage costs from the profile: stage
  k's forward (backward) cost is the sum of its layers' profiled forward (backward) seconds for
  one micro-batch, divided by the stage's device speed; the loss is charged to the last stage;
  the update cost is the slowest stage's optimizer step; each cross-stage message costs
  ``bytes / bandwidth`` of the largest activation that crosses a cut. Per-micro-batch costs are
  **measured** by profiling again at the micro-batch size ``ceil(B / M)`` (default), or, with
  ``scaling="linear"``, the mini-batch profile divided by M (cheaper, optimistic for small
  micro-batches whose fixed per-call costs do not shrink). With ``stage_timing="measured"``
  (default) the stages of each split that is predicted are then timed as whole stages, as the
  runtime runs them (:func:`pipeoptim.profile.measure_stages`), and these times replace the sums
  of the layers' times: layers timed alone add up to less than their stage (caches, the
  runtime's work per pass); the partitioners still use the per-layer profile. Each link is also a resource: the
  makespan is at least (micro-batches x the slowest cut's ``2 * bytes / bandwidth``). More than
  64 mini-batches are predicted from two simulations (32 and 64) extrapolated linearly, exact
  once the pipeline has reached its periodic steady state.
* **memory per stage** (bytes): parameters x the weight versions the method holds at that stage
  (:meth:`Method.weight_versions`, live weights included), plus one gradient buffer and the
  optimizer state (measured), plus in-flight activations: the simulator's peak number of
  micro-batches whose activations the stage holds x the bytes one micro-batch holds there
  (what autograd saves for its layers, see :meth:`ModelProfile.held_bytes`).

With the ``time`` partitioner the split is recomputed on each micro-batch count's profile (the
stage a candidate runs is balanced for its own micro-batch size); ``partitions`` in the plan
reports the three splits of the whole mini-batch.

Then it recommends one (method, M) by the rule of :func:`recommend`: the highest predicted
throughput among the candidates whose largest stage memory fits ``memory_limit``; candidates
within ``tie`` (relative, default 2%) of the best count as tied, and among tied ones a
synchronous method (same result as non-pipelined training) wins, then the smaller largest-stage
memory, then fewer micro-batches, then the earlier method in the list.

The plan (JSON) holds the task, model, batch size, stages, partition, method and micro-batches
that ``pipeoptim train --plan FILE`` uses (:func:`load_plan`), the predictions and the profile.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from .methods import get_method, method_names
from .partition import cut_seconds, plan_partition, plan_time_partition, stage_times
from .plan_defaults import DEFAULT_METHODS, DEFAULT_MICROBATCHES, PARTITIONERS
from .profile import ModelProfile, measure_stages, profile_model
from .schedules import Costs, Schedule, build_schedule, simulate

PLAN_FORMAT = "pipeoptim-plan"
PLAN_VERSION = 1
EXACT_BATCHES = 64  #: above this many mini-batches the makespan is extrapolated
RECOMMENDATION_RULE = ("highest predicted throughput among candidates whose largest stage memory fits "
                       "the memory limit; within {tie:.0%} of the best counts as a tie, and ties go to a "
                       "synchronous method, then less memory, then fewer micro-batches, then the "
                       "earlier method")

#: plan field -> the `pipeoptim train` option (argparse destination) it sets
TRAIN_FIELDS = {"task": "task", "model": "model", "batch_size": "batch_size", "stages": "stages",
                "partition": "partition", "method": "method", "microbatches": "micro_batches"}


# -- parsing ---------------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12,
          "tb": 1e12, "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4}


def parse_bytes(text: Any, what: str = "value") -> float:
    """``"2GiB"``, ``"500MB"``, ``"1e9"`` or a number -> bytes (float). Must be positive."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{what} must be a number of bytes such as 1e9, 500MB or 2GiB, got {text!r}")
        try:
            value = float(match.group(1)) * _UNITS[unit]
        except ValueError:
            raise ValueError(f"{what} must be a number of bytes such as 1e9, 500MB or 2GiB, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{what} must be positive, got {text}")
    return value


def parse_speeds(text: Optional[str], stages: int) -> Optional[List[float]]:
    """``"1,2"`` -> [1.0, 2.0], one positive factor per stage (None stays None)."""
    if text is None:
        return None
    try:
        speeds = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--speeds must be comma-separated numbers, got {text!r}") from None
    if len(speeds) != stages:
        raise ValueError(f"--speeds has {len(speeds)} values but --stages is {stages} (give one per stage)")
    if any(not (s > 0 and math.isfinite(s)) for s in speeds):
        raise ValueError(f"--speeds must all be positive, got {text!r}")
    return speeds


def parse_int_list(text: Any, what: str) -> List[int]:
    if isinstance(text, (list, tuple)):
        values = list(text)
    else:
        try:
            values = [int(x) for x in str(text).split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or any(not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"{what} must be positive integers, got {text!r}")
    return values


# -- profiles at micro-batch sizes -----------------------------------------------------------------

def microbatch_size(batch_size: int, microbatches: int) -> int:
    """The largest micro-batch of a mini-batch split ``microbatches`` ways (as ``split_batch``)."""
    return -(-batch_size // microbatches)


def _head(value: Any, rows: int) -> Any:
    if torch.is_tensor(value):
        return value[:rows]
    if isinstance(value, tuple):
        return tuple(_head(v, rows) for v in value)
    return value


def scaled_profile(profile: ModelProfile, factor: float) -> ModelProfile:
    """``profile`` with every per-sample quantity (times, activation bytes) times ``factor``;
    parameter, optimizer-state and update costs unchanged."""
    data = profile.to_dict()
    for layer in data["layers"]:
        for key in ("forward", "backward"):
            layer[key] *= factor
        for key in ("output_bytes", "saved_bytes", "saved_input_bytes", "saved_output_bytes"):
            layer[key] = int(round(layer[key] * factor))
    data["loss_forward"] *= factor
    data["loss_backward"] *= factor
    data["batch_size"] = max(1, int(round(data["batch_size"] * factor)))
    data["input_bytes"] = int(round(data["input_bytes"] * factor))
    data["extra"] = dict(data.get("extra") or {}, scaled_from=profile.batch_size)
    return ModelProfile.from_dict(data)


def profile_sizes(model: nn.Sequential, sample: Any, target: Optional[torch.Tensor], loss_fn, *,
                  batch_size: int, microbatches: Sequence[int], scaling: str = "measure",
                  **profile_kwargs: Any) -> Dict[int, ModelProfile]:
    """A profile per micro-batch count: ``{M: profile of one micro-batch}`` (``M = 1``: the
    mini-batch). ``scaling`` is ``measure`` (profile each size) or ``linear``."""
    if scaling not in ("measure", "linear"):
        raise ValueError(f"scaling must be measure or linear, got {scaling!r}")
    by_size: Dict[int, ModelProfile] = {}
    out: Dict[int, ModelProfile] = {}
    for m in sorted(set([1, *microbatches])):
        rows = microbatch_size(batch_size, m)
        if rows not in by_size:
            if scaling == "linear" and rows != batch_size:
                by_size[rows] = scaled_profile(by_size[batch_size], rows / batch_size)
            else:
                by_size[rows] = profile_model(model, _head(sample, rows), loss_fn=loss_fn,
                                              target=None if target is None else target[:rows],
                                              **profile_kwargs)
        out[m] = by_size[rows]
    return out


# -- partitions ------------------------------------------------------------------------------------

def partition_for(how: str, model: nn.Sequential, profile: ModelProfile, stages: int,
                  speeds: Optional[Sequence[float]] = None, bandwidth: Optional[float] = None) -> List[int]:
    """Layers per stage by partitioner ``how`` (uniform, params or time)."""
    if how in ("uniform", "params"):
        return plan_partition(model, stages, how)
    if how == "time":
        return plan_time_partition(model, stages, profile.layer_costs(), speeds, profile.boundary_bytes(),
                                   bandwidth)
    raise ValueError(f"unknown partitioner {how!r}; choose one of: {', '.join(PARTITIONERS)}")


def describe_partition(profile: ModelProfile, sizes: Sequence[int], speeds: Optional[Sequence[float]] = None,
                       bandwidth: Optional[float] = None) -> Dict[str, Any]:
    """Per-stage forward+backward seconds (with speeds), per-cut link seconds, the slowest
    stage and the cycle time (the largest of both), and the balance (slowest / mean stage)."""
    sizes = list(sizes)
    times = stage_times(profile.layer_costs(), sizes, speeds)
    links = cut_seconds(sizes, profile.boundary_bytes(), bandwidth)
    slowest = max(times)
    mean = sum(times) / len(times)
    return {"sizes": sizes, "stage_seconds": times, "cut_seconds": links, "slowest_stage_seconds": slowest,
            "cycle_seconds": max([slowest] + links), "imbalance": slowest / mean if mean > 0 else 1.0}


# -- prediction ------------------------------------------------------------------------------------

def stage_costs(profile: ModelProfile, sizes: Sequence[int], speeds: Optional[Sequence[float]] = None,
                bandwidth: Optional[float] = None, measured: Optional[Dict[str, List[float]]] = None) -> Costs:
    """Simulator costs of one micro-batch on each stage of the split ``sizes``: the stage times
    ``measured`` (:func:`pipeoptim.profile.measure_stages`) if given, else the sums of the
    profiled layers' times; divided by each stage's device speed."""
    n = len(sizes)
    speed = [1.0] * n if speeds is None else list(speeds)
    fwd, bwd, upd = [], [], []
    for k, (a, b) in enumerate(profile.stage_slices(list(sizes))):
        layers = profile.layers[a:b]
        if measured is not None:
            f, g, u = measured["forward"][k], measured["backward"][k], measured["update"][k]
        else:
            f = sum(l.forward for l in layers)
            g = sum(l.backward for l in layers)
            u = sum(l.update for l in layers)
            if k == n - 1:
                f += profile.loss_forward
                g += profile.loss_backward
        fwd.append(f / speed[k])
        bwd.append(g / speed[k])
        upd.append(u / speed[k])
    comm = 0.0
    if bandwidth is not None and n > 1:
        ends = [sum(sizes[:k + 1]) for k in range(n - 1)]
        comm = max(profile.layers[e - 1].output_bytes for e in ends) / bandwidth
    # The W half of a split backward (zb-h1) is not profiled apart: take half the backward, as
    # for matmul layers, whose input and weight gradients are two products of the same size.
    return Costs(fwd, bwd, [g / 2 for g in bwd], update=max(upd), comm=comm)


def extrapolated_makespan(build: Callable[[int], Schedule], batches: int, costs: Costs):
    """(makespan of ``batches`` mini-batches, SimResult of the longest run simulated, batches
    simulated) of the schedule ``build(mini-batches)``. More than :data:`EXACT_BATCHES` are
    extrapolated linearly from two runs (exact once the pipeline is in its periodic steady state)."""
    if batches <= EXACT_BATCHES:
        result = simulate(build(batches), costs)
        return result.makespan, result, batches
    half = EXACT_BATCHES // 2
    short = simulate(build(half), costs)
    long = simulate(build(EXACT_BATCHES), costs)
    slope = (long.makespan - short.makespan) / (EXACT_BATCHES - half)
    return long.makespan + slope * (batches - EXACT_BATCHES), long, EXACT_BATCHES


def simulated_makespan(method: str, stages: int, microbatches: int, batches: int, costs: Costs):
    """:func:`extrapolated_makespan` of ``method``'s schedule on ``stages`` stages."""
    meth = get_method(method)
    return extrapolated_makespan(lambda count: meth.build_schedule(stages, microbatches, count), batches, costs)


def schedule_makespan(schedule: str, ranks: int, microbatches: int, batches: int, costs: Costs,
                      chunks: int = 2):
    """:func:`extrapolated_makespan` of the schedule named ``schedule`` (any of
    :func:`pipeoptim.schedules.schedule_names`, also those no method runs, as ``zb-h1`` and
    ``interleaved-1f1b`` with ``chunks`` model chunks per rank: ``costs`` then has one entry per
    model stage, ``ranks * chunks``)."""
    return extrapolated_makespan(lambda count: build_schedule(schedule, ranks, microbatches, count, chunks=chunks),
                                 batches, costs)


def stage_memory(method: str, profile: ModelProfile, sizes: Sequence[int], peak_activations: Sequence[int],
                 options: Optional[Dict[str, Any]] = None) -> List[Dict[str, int]]:
    """Bytes per stage: weights (versions x parameters), gradients, optimizer state, in-flight
    activations (peak micro-batches x bytes held per micro-batch) and their total."""
    versions = get_method(method).weight_versions(len(sizes), **(options or {}))
    out = []
    for k, (a, b) in enumerate(profile.stage_slices(list(sizes))):
        layers = profile.layers[a:b]
        params = sum(l.parameter_bytes for l in layers)
        held = profile.held_bytes(a, b)
        row = {"parameter_bytes": params, "weight_versions": versions[k], "weights": versions[k] * params,
               "gradients": params, "optimizer": sum(l.optimizer_bytes for l in layers),
               "activation_bytes_per_microbatch": held, "in_flight_microbatches": int(peak_activations[k]),
               "activations": int(peak_activations[k]) * held}
        row["total"] = row["weights"] + row["gradients"] + row["optimizer"] + row["activations"]
        out.append(row)
    return out


def predict(method: str, profile: ModelProfile, sizes: Sequence[int], *, microbatches: int, batches: int,
            batch_size: int, speeds: Optional[Sequence[float]] = None, bandwidth: Optional[float] = None,
            options: Optional[Dict[str, Any]] = None,
            measured: Optional[Dict[str, List[float]]] = None) -> Dict[str, Any]:
    """Predicted throughput and memory of ``method`` on the split ``sizes``, with ``profile``
    the profile of one micro-batch (of ``ceil(batch_size / microbatches)`` samples) and
    ``measured`` that micro-batch's measured stage times, if any (see :func:`stage_costs`)."""
    n = len(sizes)
    costs = stage_costs(profile, sizes, speeds, bandwidth, measured)
    makespan, result, simulated = simulated_makespan(method, n, microbatches, batches, costs)
    links = cut_seconds(list(sizes), profile.boundary_bytes(), bandwidth)
    link_bound = batches * microbatches * max(links, default=0.0)
    limited_by_link = link_bound > makespan
    makespan = max(makespan, link_bound)
    throughput = batches * batch_size / makespan if makespan > 0 else float("inf")
    memory = stage_memory(method, profile, sizes, result.peak_activations, options)
    return {
        "method": method, "synchronous": get_method(method).synchronous, "microbatches": microbatches,
        "microbatch_size": microbatch_size(batch_size, microbatches), "partition": list(sizes),
        "samples_per_second": throughput, "makespan_seconds": makespan, "batches": batches,
        "stage_costs": "measured" if measured is not None else "profile",
        "simulated_batches": simulated, "bubble_fraction": result.bubble_fraction,
        "limited_by_link": limited_by_link,
        "stage_forward_seconds": costs.forward, "stage_backward_seconds": costs.backward,
        "update_seconds": costs.update, "comm_seconds": costs.comm, "cut_seconds": links,
        "memory": memory, "max_stage_memory": max(m["total"] for m in memory),
    }


def candidate_problem(method: str, stages: int, microbatches: int, batch_size: int) -> Optional[str]:
    """Why (method, M) cannot run, or None."""
    if microbatches > batch_size:
        return f"{microbatches} micro-batches need a batch of at least {microbatches} (batch size {batch_size})"
    if get_method(method).schedule == "2bw" and microbatches < stages:
        return f"{method} needs micro-batches >= stages ({microbatches} < {stages})"
    return None


def recommend(candidates: Sequence[Dict[str, Any]], memory_limit: Optional[float] = None,
              tie: float = 0.02, order: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """The recommended candidate: the highest ``samples_per_second`` among those whose
    ``max_stage_memory`` fits ``memory_limit`` (all, without a limit); candidates within ``tie``
    (relative) of the best are tied, and among them a synchronous method wins, then the smaller
    largest-stage memory, then fewer micro-batches, then the earlier method in ``order``.
    Raises ValueError when no candidate fits."""
    if not candidates:
        raise ValueError("no candidate (method, micro-batches) can run; see the reasons in the plan")
    fits = [c for c in candidates if memory_limit is None or c["max_stage_memory"] <= memory_limit]
    if not fits:
        least = min(candidates, key=lambda c: c["max_stage_memory"])
        raise ValueError(f"no method fits --memory-limit {memory_limit:.0f} bytes per stage; the smallest, "
                         f"{least['method']} with {least['microbatches']} micro-batches, needs "
                         f"{least['max_stage_memory']} bytes")
    best = max(c["samples_per_second"] for c in fits)
    tied = [c for c in fits if c["samples_per_second"] >= (1.0 - tie) * best]
    rank = {m: i for i, m in enumerate(order or [])}
    return min(tied, key=lambda c: (not c["synchronous"], c["max_stage_memory"], c["microbatches"],
                                    rank.get(c["method"], len(rank))))


# -- the whole plan --------------------------------------------------------------------------------

def make_plan(*, task: str, model: Optional[str] = None, stages: int, device: str = "cpu",
              speeds: Optional[Sequence[float]] = None, bandwidth: Optional[float] = None,
              batch_size: Optional[int] = None, methods: Sequence[str] = DEFAULT_METHODS,
              microbatches: Sequence[int] = DEFAULT_MICROBATCHES, memory_limit: Optional[float] = None,
              partitioner: str = "time", scaling: str = "measure", batches: Optional[int] = None,
              limit: Optional[int] = None, seed: int = 0, optimizer: str = "momentum",
              warmup: int = 2, repeats: int = 5, statistic: str = "median", stage_timing: str = "measured",
              tie: float = 0.02, log=None) -> Dict[str, Any]:
    """Profile ``task``'s ``model``, partition it, predict every (method, micro-batches) and
    recommend one (see the module docstring). Returns the plan as a JSON-ready dict.

    ``batches``: mini-batches per predicted run (default: one epoch of the loaded data).
    ``speeds``: one relative speed per stage (device k runs stage k). ``bandwidth``: bytes per
    second of each link (None: free transfers). ``memory_limit``: bytes per stage."""
    from .optimizers import make_optimizer
    from .tasks import get_task

    log = log or (lambda *a, **k: None)
    methods = list(methods)
    for m in methods:
        get_method(m)
    microbatches = parse_int_list(microbatches, "--microbatches")
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"--stages must be at least 1, got {stages}")
    if speeds is not None:
        speeds = [float(s) for s in speeds]
        if len(speeds) != stages:
            raise ValueError(f"--speeds has {len(speeds)} values but --stages is {stages} (give one per stage)")
        if any(not (s > 0 and math.isfinite(s)) for s in speeds):
            raise ValueError(f"--speeds must all be positive, got {speeds}")
    if bandwidth is not None and not (bandwidth > 0 and math.isfinite(bandwidth)):
        raise ValueError(f"--bandwidth must be positive (bytes per second), got {bandwidth}")
    if memory_limit is not None and not memory_limit > 0:
        raise ValueError(f"--memory-limit must be positive, got {memory_limit}")
    if partitioner not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {partitioner!r}; choose one of: {', '.join(PARTITIONERS)}")
    for name, value in (("batch-size", batch_size), ("batches", batches), ("limit", limit)):
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be at least 1, got {value}")
    if not 0 <= tie < 1:
        raise ValueError(f"--tie must be in [0, 1), got {tie}")
    if stage_timing not in ("measured", "profile"):
        raise ValueError(f"stage timing must be measured or profile, got {stage_timing!r}")

    the_task = get_task(task)
    model_name = model or the_task.default_model
    if model_name not in the_task.model_names():
        raise ValueError(f"task {task} has no model {model_name!r}; choose one of: "
                         f"{', '.join(the_task.model_names())}")
    batch_size = batch_size or the_task.default_batch_size
    data = the_task.load(batch_size=batch_size, limit=limit, seed=seed)
    if not data.train:
        raise ValueError("the task gave no training mini-batch")
    net = the_task.build_model(model_name, data, seed=seed)
    layers = len(net)
    if stages > layers:
        raise ValueError(f"--stages {stages} is more than the {layers} layers of {model_name}")
    batches = batches or len(data.train)
    sample, target = data.train[0]
    opt_factory = make_optimizer(optimizer, the_task.default_lr.get(optimizer, 1e-3))
    log(f"profiling {task}/{model_name} ({layers} layers) on {device}, batch {batch_size}, "
        f"micro-batch counts {microbatches} ({scaling})")
    profiles = profile_sizes(net, sample, target, the_task.loss, batch_size=batch_size, microbatches=microbatches,
                             scaling=scaling, device=device, warmup=warmup, repeats=repeats,
                             statistic=statistic, optimizer=opt_factory, optimizer_name=optimizer, seed=seed)
    full = profiles[1]
    timings: Dict[Any, Dict[str, List[float]]] = {}

    def timing(sizes: List[int], m: int) -> Optional[Dict[str, List[float]]]:
        """Measured stage times of one micro-batch of ``M = m`` on the split ``sizes``."""
        if stage_timing != "measured":
            return None
        rows = microbatch_size(batch_size, m) if scaling == "measure" else batch_size
        key = (tuple(sizes), rows)
        if key not in timings:
            timings[key] = measure_stages(net, list(sizes), _head(sample, rows), target[:rows], the_task.loss,
                                          device=device, optimizer=opt_factory, warmup=warmup, repeats=repeats,
                                          statistic=statistic)
        times = timings[key]
        if rows != microbatch_size(batch_size, m):  # linear scaling of the mini-batch's times
            factor = microbatch_size(batch_size, m) / rows
            times = {"forward": [t * factor for t in times["forward"]],
                     "backward": [t * factor for t in times["backward"]], "update": list(times["update"])}
        return times

    if stage_timing == "measured":
        log("timing the stages of each split as the runtime runs them")
    partitions = {}
    for how in PARTITIONERS:
        sizes = partition_for(how, net, full, stages, speeds, bandwidth)
        partitions[how] = describe_partition(full, sizes, speeds, bandwidth)
        measured = timing(sizes, 1)
        if measured is not None:
            speed = speeds or [1.0] * stages
            per_stage = [(f + b) / v for f, b, v in zip(measured["forward"], measured["backward"], speed)]
            partitions[how]["measured_stage_seconds"] = per_stage
            partitions[how]["measured_slowest_stage_seconds"] = max(per_stage)
    reference = predict("sequential", full, [layers], microbatches=1, batches=batches, batch_size=batch_size,
                        measured=timing([layers], 1))

    candidates, skipped = [], []
    for m in microbatches:
        prof = profiles[m]
        sizes = partition_for(partitioner, net, prof, stages, speeds, bandwidth)
        for method in methods:
            n = 1 if method == "sequential" else stages
            if method == "sequential" and m != 1:
                continue
            problem = candidate_problem(method, n, m, batch_size)
            if problem:
                skipped.append({"method": method, "microbatches": m, "reason": problem})
                continue
            split_sizes = sizes if n == stages else [layers]
            row = predict(method, prof, split_sizes, microbatches=m, batches=batches, batch_size=batch_size,
                          speeds=speeds if n == stages else None, bandwidth=bandwidth,
                          measured=timing(split_sizes, m))
            row["speedup"] = row["samples_per_second"] / reference["samples_per_second"]
            row["fits"] = memory_limit is None or row["max_stage_memory"] <= memory_limit
            candidates.append(row)
    best = recommend(candidates, memory_limit, tie, order=methods)
    rule = RECOMMENDATION_RULE.format(tie=tie)
    n_best = 1 if best["method"] == "sequential" else stages
    return {
        "format": PLAN_FORMAT, "version": PLAN_VERSION,
        "task": task, "model": model_name, "batch_size": batch_size, "stages": n_best,
        "partition": best["partition"], "partitioner": partitioner if n_best == stages else "uniform",
        "method": best["method"], "microbatches": best["microbatches"],
        "predicted": {k: best[k] for k in ("samples_per_second", "makespan_seconds", "batches", "bubble_fraction",
                                            "speedup", "stage_forward_seconds", "stage_backward_seconds",
                                            "update_seconds", "comm_seconds", "limited_by_link")},
        "memory": {"per_stage": best["memory"], "max_stage": best["max_stage_memory"], "limit": memory_limit},
        "recommendation": {"method": best["method"], "microbatches": best["microbatches"], "rule": rule},
        "settings": {"device": device, "speeds": speeds, "bandwidth": bandwidth, "methods": methods,
                     "microbatch_counts": microbatches, "scaling": scaling, "batches": batches, "limit": limit,
                     "seed": seed, "optimizer": optimizer, "warmup": warmup, "repeats": repeats,
                     "statistic": statistic, "stage_timing": stage_timing, "threads": torch.get_num_threads(),
                     "tie": tie},
        "partitions": partitions,
        "reference": {"method": "sequential", "samples_per_second": reference["samples_per_second"]},
        "candidates": candidates, "skipped": skipped,
        "profile": full.to_dict(),
        "microbatch_profiles": {str(m): profiles[m].to_dict() for m in microbatches if m != 1},
    }


def write_plan(plan: Dict[str, Any], path: Path) -> Path:
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=2))
    return path


def load_plan(path: Any) -> Dict[str, Any]:
    """Read a plan file and return the fields ``pipeoptim train --plan FILE`` sets, validated,
    keyed by the train command's option names (argparse destinations):

    ``task`` (--task), ``model`` (--model), ``batch_size`` (--batch-size), ``stages``
    (--stages), ``partition`` (--partition, layers per stage), ``method`` (--method),
    ``micro_batches`` (--micro-batches). Every problem is a one-line ValueError."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"cannot read plan {path}: {error.strerror or error}") from None
    try:
        plan = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"plan {path} is not valid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT:
        raise ValueError(f"{path} is not a pipeoptim plan (no \"format\": \"{PLAN_FORMAT}\"); "
                         f"write one with `pipeoptim plan --out FILE`")
    if plan.get("version") != PLAN_VERSION:
        raise ValueError(f"plan {path} has version {plan.get('version')!r}; "
                         f"this pipeoptim reads version {PLAN_VERSION}")
    missing = [k for k in TRAIN_FIELDS if k not in plan]
    if missing:
        raise ValueError(f"plan {path} lacks {', '.join(missing)}")

    def bad(field: str, why: str) -> ValueError:
        return ValueError(f"plan {path}: {field} {why}, got {plan.get(field)!r}")

    from .tasks import task_names

    if plan["task"] not in task_names():
        raise bad("task", f"must be one of {', '.join(task_names())}")
    if not isinstance(plan["model"], str) or not plan["model"]:
        raise bad("model", "must be a model name")
    for key in ("batch_size", "stages", "microbatches"):
        if not isinstance(plan[key], int) or isinstance(plan[key], bool) or plan[key] < 1:
            raise bad(key, "must be a positive integer")
    if plan["method"] not in method_names():
        raise bad("method", f"must be one of {', '.join(method_names())}")
    sizes = plan["partition"]
    if (not isinstance(sizes, list) or not sizes
            or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes)):
        raise bad("partition", "must be a list of positive layer counts")
    if len(sizes) != plan["stages"]:
        raise ValueError(f"plan {path}: partition {sizes} has {len(sizes)} stages but stages is {plan['stages']}")
    problem = candidate_problem(plan["method"], plan["stages"], plan["microbatches"], plan["batch_size"])
    if problem:
        raise ValueError(f"plan {path}: {problem}")
    return {dest: plan[key] for key, dest in TRAIN_FIELDS.items()}


def format_plan(plan: Dict[str, Any]) -> str:
    """The plan as text: partitions, candidates, recommendation."""
    lines = [f"{plan['task']} / {plan['model']}: {plan['stages']} stages, batch {plan['batch_size']}, "
             f"{plan['settings']['device']}, {plan['settings']['threads']} thread(s)"]
    lines.append("")
    lines.append("partition   layers per stage        slowest stage ms   cycle ms   slowest/mean   "
                 "measured slowest stage ms")
    for how, p in plan["partitions"].items():
        measured = p.get("measured_slowest_stage_seconds")
        lines.append(f"{how:<11} {str(p['sizes']):<23} {p['slowest_stage_seconds'] * 1e3:>16.2f}   "
                     f"{p['cycle_seconds'] * 1e3:>8.2f}   {p['imbalance']:>12.2f}   "
                     f"{(f'{measured * 1e3:.2f}' if measured is not None else '-'):>25}")
    lines.append("")
    ref = plan["reference"]["samples_per_second"]
    lines.append(f"predicted ({plan['partitioner']} partition; sequential reference {ref:.0f} samples/s):")
    lines.append("method          M  partition             samples/s  speedup  bubble  max stage MB  fits")
    for c in plan["candidates"]:
        lines.append(f"{c['method']:<14} {c['microbatches']:>2}  {str(c['partition']):<20} "
                     f"{c['samples_per_second']:>10.0f}  {c['speedup']:>7.2f}  {c['bubble_fraction']:>6.2f}  "
                     f"{c['max_stage_memory'] / 2 ** 20:>12.2f}  {'yes' if c['fits'] else 'no'}")
    for s in plan["skipped"]:
        lines.append(f"{s['method']:<14} {s['microbatches']:>2}  skipped: {s['reason']}")
    lines.append("")
    lines.append(f"recommended: {plan['method']} with {plan['microbatches']} micro-batch(es), partition "
                 f"{plan['partition']}: {plan['predicted']['samples_per_second']:.0f} samples/s predicted")
    lines.append(f"rule: {plan['recommendation']['rule']}")
    return "\n".join(lines)
