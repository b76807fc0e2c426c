"""Throughput and memory predicted from a profile, for the planner. Not the prediction of
weights, which is ``weights/predict*.py``.

* **throughput**: the schedule simulator runs the method's schedule for ``batches`` mini-batches
  with per-stage costs from the profile (:func:`stage_costs`: seconds of one micro-batch, divided
  by the stage's device speed; each message costs ``bytes / bandwidth`` of the largest activation
  that crosses a cut). A **chunked** method (interleaved, zb-v) is priced on a split into N x V
  pieces, each a model stage on the rank the method places it on; a **mirrored** one
  (bidirectional, bitpipe) on a split into its pieces, each replica a stage costing what its
  piece does on its rank, plus the replicas' gradient sum (:func:`replica_sum_seconds`). More
  than :data:`EXACT_BATCHES` mini-batches are extrapolated linearly from two simulations, exact
  once the pipeline has reached its periodic steady state.
* **memory per stage** (bytes, per process): parameters x the weight versions the method holds,
  one gradient buffer, the optimizer state, and the simulator's peak count of micro-batches in
  flight x the bytes one holds there (:meth:`ModelProfile.held_bytes`, what ``runtime/held.py``
  measures), with and without activation recomputation.
* **error feedback** (a ``+ef`` candidate, ``options={"error_feedback": True}``): its two passes
  over the weights per update cost :data:`FEEDBACK_TIME_RATIO` times the method's time, and its
  two weight-sized buffers per stage show in the weight versions (``Method.versions``).
* **tensor parallelism** (:class:`TensorLayers`, from ``planning.tensor_layers``): each stage on
  T processes. Per process the planned layers' parameters (every version), gradients and
  optimizer state are 1/T (a row-wise bias whole), activations as at T = 1 (an upper bound). The
  planned modules' share of each layer's forward time (and of its backward and W) runs 1/T, of
  the update the planned parameters' share on the stage that keeps the most (an upper bound);
  each row-wise layer all-reduces its output per forward, each column-wise layer its input's
  gradient per backward (a gathered output or a row-wise layer's whole input: an all-gather),
  each process sending 2(T-1)/T (all-reduce) or (T-1)/T (all-gather) of the bytes at
  ``bandwidth`` (free without one), on the critical path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from .methods import get_method, variant_name
from .partition import cut_seconds, plan_partition, plan_time_partition, slices, stage_times
from .plan_defaults import PARTITIONERS
from .profile import ModelProfile, profile_model
from .schedules import Costs, Schedule, build_schedule, peak_activations, simulate

EXACT_BATCHES = 64  #: above this many mini-batches the makespan is extrapolated
#: what error feedback costs in time: a run with it over the same run without it, as
#: study/error_feedback_cost.py measured it (pipedream-2bw at N = 8 on the study's LM model, CPU
#: time of whole fits; study/results/error_feedback_cost.json, "ratio", which a test holds it to)
FEEDBACK_TIME_RATIO = 1.0194


def microbatch_size(batch_size: int, microbatches: int) -> int:
    """The largest micro-batch of a mini-batch split ``microbatches`` ways (as ``split_batch``)."""
    return -(-batch_size // microbatches)


def head_rows(value: Any, rows: int) -> Any:
    """The first ``rows`` samples of a batch: a tensor, or each tensor of a tuple or a dict."""
    if torch.is_tensor(value):
        return value[:rows]
    if isinstance(value, tuple):
        return tuple(head_rows(v, rows) for v in value)
    if isinstance(value, dict):
        return {k: head_rows(v, rows) for k, v in value.items()}
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
                by_size[rows] = profile_model(model, head_rows(sample, rows), loss_fn=loss_fn,
                                              target=None if target is None else target[:rows],
                                              **profile_kwargs)
        out[m] = by_size[rows]
    return out


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


@dataclass
class TensorLayers:
    """What splitting a model's planned layers over ``tensor`` processes does, per layer of an
    ``nn.Sequential``: ``split_bytes``, its parameter bytes the plan splits; ``share``, the
    planned modules' share of its forward time; ``forward_wire``, ``backward_wire``: the bytes one
    process sends in the tensor collectives of a pass, per sample; ``planned``: {module: style};
    ``whole_grads``: of ``split_bytes``, those whose gradient each process holds whole (torch's
    row-wise Embedding leaves its weight's gradient replicated)."""

    tensor: int
    split_bytes: List[int]
    share: List[float]
    forward_wire: List[float]
    backward_wire: List[float]
    planned: Dict[str, str]
    whole_grads: Optional[List[int]] = None

    def to_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


def style_name(style: Any) -> str:
    """A resolved style by transformers' name (its layouts decide)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(style, ColwiseParallel):
        return "colwise_gather_output" if style.output_layouts[0].is_replicate() else "colwise"
    if isinstance(style, RowwiseParallel):
        return "rowwise_split_input" if style.input_layouts[0].is_replicate() else "rowwise"
    raise ValueError(f"the plan prices column-wise and row-wise styles, not {type(style).__name__}: leave its "
                     f"layer out of the plan")


def tensor_costs(costs: Costs, profile: ModelProfile, slices: Sequence[tuple], split: TensorLayers,
                 bandwidth: Optional[float]) -> Costs:
    """``costs`` (one micro-batch of ``profile``'s rows per stage, stages ``slices`` of its layers)
    with every stage on ``split.tensor`` processes (the module docstring's model)."""
    cut, rows, last = 1 - 1 / split.tensor, profile.batch_size, len(profile.layers)
    fwd, bwd, wgt, kept = [], [], [], []
    for k, (a, b) in enumerate(slices):
        layers = range(a, b)
        f = [profile.layers[i].forward for i in layers]
        g = [profile.layers[i].backward for i in layers]
        f_all = sum(f) + (profile.loss_forward if b == last else 0.0)
        g_all = sum(g) + (profile.loss_backward if b == last else 0.0)
        share_f = sum(split.share[i] * t for i, t in zip(layers, f)) / f_all if f_all > 0 else 0.0
        share_g = sum(split.share[i] * t for i, t in zip(layers, g)) / g_all if g_all > 0 else 0.0
        wire = [rows * sum(w[i] for i in layers) / bandwidth if bandwidth else 0.0
                for w in (split.forward_wire, split.backward_wire)]
        fwd.append(costs.forward[k] * (1 - cut * share_f) + wire[0])
        bwd.append(costs.backward[k] * (1 - cut * share_g) + wire[1])
        wgt.append(costs.weight[k] * (1 - cut * share_g))
        params = sum(profile.layers[i].parameter_bytes for i in layers)
        kept.append(1 - cut * sum(split.split_bytes[i] for i in layers) / params if params else 1.0)
    return Costs(fwd, bwd, wgt, update=costs.update * max(kept), comm=costs.comm)


def stage_costs(profile: ModelProfile, sizes: Sequence[int], speeds: Optional[Sequence[float]] = None,
                bandwidth: Optional[float] = None, measured: Optional[Dict[str, List[float]]] = None) -> Costs:
    """Simulator costs of one micro-batch on each stage of the split ``sizes``: the stage times
    ``measured`` (:func:`pipeoptim.stage_timing.measure_stages`) if given, else the sums of the
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
        comm = max(profile.layers[end - 1].output_bytes for _, end in slices(list(sizes))[:-1]) / bandwidth
    # The W half of a split backward (zb-h1) is not profiled apart: take half the backward, as
    # for matmul layers, whose input and weight gradients are two products of the same size;
    # where the split was timed as the method runs it, its measured W.
    weight = [g / 2 for g in bwd] if measured is None or "weight" not in measured else \
        [w / speed[k] for k, w in enumerate(measured["weight"][:n])]
    return Costs(fwd, bwd, weight, update=max(upd), comm=comm)


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


def stage_placement(method: str, sizes: Sequence[int]) -> List[int]:
    """The rank of each stage of ``method`` on the split ``sizes`` (one entry per model piece: a
    chunked method's processes x chunks; a mirrored method's processes x its pieces per process,
    whose stages are those pieces twice, the second pipeline's replicas after the first's)."""
    meth = get_method(method)
    per_rank = meth.pieces_per_rank(meth.chunks)
    if len(sizes) % per_rank:
        raise ValueError(f"{method} holds {per_rank} model pieces per process: give a split into a multiple of "
                         f"{per_rank} pieces, got {len(sizes)}")
    ranks = len(sizes) // per_rank
    return meth.stage_ranks(ranks, meth.chunks) if meth.chunks > 1 else list(range(ranks))


def stage_slices(profile: ModelProfile, method: str, sizes: Sequence[int]) -> List[tuple]:
    """The (first, end) layers of each stage of ``method`` on the split ``sizes`` (a mirrored
    method's replicas: their pieces' layers again)."""
    pieces = profile.stage_slices(list(sizes))
    return pieces + pieces if get_method(method).mirrored else pieces


def mirrored_costs(piece_costs: Costs, placement: Sequence[int], speeds: Optional[Sequence[float]],
                   measured: Optional[Dict[str, List[float]]] = None) -> Costs:
    """A mirrored method's costs per stage, each at the speed of the rank that holds it: each
    replica costs what its piece does (``piece_costs``, at speed 1), or, with ``measured``, every
    stage what it took timed as the method runs it (:class:`pipeoptim.stage_timing.StageTimer`:
    two replicas per process, their gradients summed)."""
    speed = [1.0 if speeds is None else float(speeds[r]) for r in placement]
    if measured is not None:
        f, b = measured["forward"], measured["backward"]
        w = measured.get("weight") or [g / 2 for g in b]
        update = max(u / v for u, v in zip(measured["update"], speed))
    else:
        half = len(placement) // 2
        f, b, w = ([c[k % half] for k in range(2 * half)]
                   for c in (piece_costs.forward, piece_costs.backward, piece_costs.weight))
        update = piece_costs.update / min(speed)
    return Costs([x / v for x, v in zip(f, speed)], [x / v for x, v in zip(b, speed)],
                 [x / v for x, v in zip(w, speed)], update=update, comm=piece_costs.comm)


def replica_sum_seconds(profile: ModelProfile, method: str, sizes: Sequence[int],
                        bandwidth: Optional[float]) -> List[float]:
    """Per rank, the seconds a mirrored method's replica pairs take to sum their gradients before
    each update: each piece whose other replica is on another rank sends and receives its
    gradient once (a 2-process all-reduce, full duplex), at ``bandwidth`` bytes/s. Added to every
    mini-batch whole: the runtime starts it after the piece's last backward of the window, and
    what the rest of the window hides is not credited (an upper bound). Empty for a method
    without replicas; zeros without a bandwidth (in one process the sum is in memory)."""
    if not get_method(method).mirrored:
        return []
    placement = stage_placement(method, sizes)
    half = len(placement) // 2
    seconds = [0.0] * (1 + max(placement))
    for piece, (a, b) in enumerate(profile.stage_slices(list(sizes))):
        if bandwidth is None or placement[piece] == placement[half + piece]:
            continue
        size = sum(layer.parameter_bytes for layer in profile.layers[a:b])
        for rank in (placement[piece], placement[half + piece]):
            seconds[rank] += size / bandwidth
    return seconds


def stage_memory(method: str, profile: ModelProfile, sizes: Sequence[int], peak_activations: Sequence[int],
                 options: Optional[Dict[str, Any]] = None, tensor: Optional[TensorLayers] = None) -> List[Dict[str, int]]:
    """Bytes per model stage (``sizes``: one entry per piece; a chunked method's stages carry the
    ``rank`` that holds them, a mirrored method's replicas hold their pieces' weights again):
    weights (versions x parameters), gradients, optimizer state, in-flight activations (the
    simulator's peak micro-batches x bytes held per micro-batch; also with recomputation,
    ``*_recompute``, which keeps each micro-batch's input and output only) and their total
    (without recomputation). ``tensor``: each stage on T processes, the bytes one of them holds
    (``split_parameter_bytes``: the stage's planned parameters, all T parts)."""
    meth = get_method(method)
    placement = stage_placement(method, sizes)
    versions = meth.weight_versions(len(placement), **(options or {}))
    out = []
    for k, (a, b) in enumerate(stage_slices(profile, method, sizes)):
        layers = profile.layers[a:b]
        whole = sum(l.parameter_bytes for l in layers)
        split = sum(tensor.split_bytes[a:b]) if tensor is not None else 0
        params = whole - split + -(-split // tensor.tensor) if tensor is not None else whole
        held, light = profile.held_bytes(a, b), profile.held_bytes(a, b, recompute=True)
        flight = int(peak_activations[k])
        grads = params + (sum((tensor.whole_grads or [0] * len(profile.layers))[a:b]) * (tensor.tensor - 1)
                          // tensor.tensor if tensor is not None else 0)
        row = {"rank": placement[k], "parameter_bytes": params, "weight_versions": versions[k],
               "weights": versions[k] * params, "gradients": grads,
               "optimizer": round(sum(l.optimizer_bytes for l in layers) * (params / whole if whole else 1)),
               "activation_bytes_per_microbatch": held, "in_flight_microbatches": flight,
               "activations": flight * held, "activation_bytes_per_microbatch_recompute": light,
               "activations_recompute": flight * light}
        row["total"] = row["weights"] + row["gradients"] + row["optimizer"] + row["activations"]
        if tensor is not None:
            row.update(tensor_parallel=tensor.tensor, split_parameter_bytes=split)
        out.append(row)
    return out


def process_memory(memory: Sequence[Dict[str, int]]) -> List[int]:
    """Total bytes per process (rank): the totals of the model stages it holds."""
    totals = [0] * (1 + max(row["rank"] for row in memory))
    for row in memory:
        totals[row["rank"]] += row["total"]
    return totals


def predict(method: str, profile: ModelProfile, sizes: Sequence[int], *, microbatches: int, batches: int,
            batch_size: int, speeds: Optional[Sequence[float]] = None, bandwidth: Optional[float] = None,
            options: Optional[Dict[str, Any]] = None, measured: Optional[Dict[str, List[float]]] = None,
            tensor: Optional[TensorLayers] = None) -> Dict[str, Any]:
    """Predicted throughput and memory of ``method`` on the split ``sizes``, with ``profile``
    the profile of one micro-batch (of ``ceil(batch_size / microbatches)`` samples) and
    ``measured`` that micro-batch's measured stage times, if any (see :func:`stage_costs`).
    ``options``: the method's options (error feedback: the time x :data:`FEEDBACK_TIME_RATIO`
    and its buffers in the memory). For a chunked method ``sizes`` has one entry per piece (processes x chunks) and ``speeds``
    one per process. ``tensor``: every stage on T processes (the module docstring's model)."""
    meth = get_method(method)
    placement = stage_placement(method, sizes)
    ranks = 1 + max(placement)
    if meth.mirrored and measured is not None and len(measured["forward"]) == len(placement):
        costs = mirrored_costs(stage_costs(profile, sizes, None, bandwidth), placement, speeds, measured)
    elif meth.mirrored:
        costs = mirrored_costs(stage_costs(profile, sizes, None, bandwidth, measured), placement, speeds)
    else:
        costs = stage_costs(profile, sizes, None if speeds is None else [speeds[r] for r in placement], bandwidth,
                            measured)
    if tensor is not None:
        costs = tensor_costs(costs, profile, stage_slices(profile, method, sizes), tensor, bandwidth)
    makespan, result, simulated = simulated_makespan(method, ranks, microbatches, batches, costs)
    replica_sum = replica_sum_seconds(profile, method, sizes, bandwidth)
    makespan += batches * max(replica_sum, default=0.0)
    links = cut_seconds(list(sizes), profile.boundary_bytes(), bandwidth)
    link_bound = batches * microbatches * max(links, default=0.0)
    limited_by_link = link_bound > makespan
    makespan = max(makespan, link_bound)
    feedback = FEEDBACK_TIME_RATIO if (options or {}).get("error_feedback") else 1.0
    makespan *= feedback
    throughput = batches * batch_size / makespan if makespan > 0 else float("inf")
    memory = stage_memory(method, profile, sizes, result.peak_activations, options, tensor)
    return {
        "method": method, "options": dict(options or {}), "variant": variant_name(method, options or {}),
        "synchronous": meth.synchronous, "microbatches": microbatches,
        "microbatch_size": microbatch_size(batch_size, microbatches), "partition": list(sizes),
        "chunks": meth.chunks, "tensor_parallel": tensor.tensor if tensor is not None else 1,
        "samples_per_second": throughput, "makespan_seconds": makespan, "batches": batches,
        "stage_costs": "measured" if measured is not None else "profile",
        "simulated_batches": simulated, "bubble_fraction": result.bubble_fraction,
        "replica_sum_seconds": replica_sum, "feedback_time_ratio": feedback,
        "limited_by_link": limited_by_link,
        "stage_forward_seconds": costs.forward, "stage_backward_seconds": costs.backward,
        "update_seconds": costs.update, "comm_seconds": costs.comm, "cut_seconds": links,
        "memory": memory, "process_memory": process_memory(memory),
        "max_stage_memory": max(process_memory(memory)),
    }


def candidate_problem(method: str, stages: int, microbatches: int, batch_size: int,
                      layers: Optional[int] = None) -> Optional[str]:
    """Why (method, M) cannot run on ``stages`` processes (a model of ``layers`` layers with
    parameters, the pieces a chunked method needs), or None."""
    if microbatches > batch_size:
        return f"{microbatches} micro-batches need a batch of at least {microbatches} (batch size {batch_size})"
    meth = get_method(method)
    if meth.schedule == "2bw" and microbatches < stages:
        return f"{method} needs micro-batches >= stages ({microbatches} < {stages})"
    if meth.schedule == "interleaved-1f1b" and microbatches % stages:
        return f"{method} needs micro-batches that are a multiple of the stages ({microbatches}, {stages} stages)"
    if meth.mirrored and microbatches % 2:
        return f"{method} needs an even number of micro-batches, half for each direction (got {microbatches})"
    pieces = meth.pieces_per_rank(meth.chunks)
    if layers is not None and pieces * stages > layers:
        return (f"{method} splits the model into {stages} x {pieces} pieces but it has {layers} layers "
                f"with parameters; use fewer stages")
    return None


def predicted_activations(profile: ModelProfile, sizes: Sequence[int], method: str, ranks: int, microbatches: int,
                          batches: int = 2, recompute: bool = False) -> List[Dict[str, int]]:
    """Per model stage of the split ``sizes``: the simulator's peak count of micro-batches in
    flight under ``method`` (``ranks`` processes, ``batches`` mini-batches of ``microbatches``),
    the bytes one micro-batch holds there (``profile``: one micro-batch's) and their product, the
    prediction :mod:`pipeoptim.runtime.held`'s measured peak is read against."""
    peaks = peak_activations(get_method(method).build_schedule(ranks, microbatches, batches))
    out = []
    for peak, (a, b) in zip(peaks, stage_slices(profile, method, sizes)):
        held = profile.held_bytes(a, b, recompute=recompute)
        out.append({"in_flight_microbatches": int(peak), "bytes_per_microbatch": held, "bytes": int(peak) * held})
    return out
