"""Split an ``nn.Sequential`` into contiguous stages: uniform by layers, balanced by parameters,
or balanced by profiled time (:func:`time_partition`, heterogeneous devices and link costs)."""
from __future__ import annotations

import itertools
from typing import List, Optional, Sequence, Tuple

from torch import nn

from .errors import option


def validate_partition(sizes: Sequence[int], num_layers: int) -> List[int]:
    """Check that ``sizes`` (layers per stage) covers the model; return it as a list."""
    sizes = list(sizes)
    if not sizes:
        raise ValueError("a partition needs at least one stage")
    if any((not isinstance(s, int)) or s < 1 for s in sizes):
        raise ValueError(f"every stage needs at least one layer, got partition {sizes}")
    if sum(sizes) != num_layers:
        raise ValueError(f"partition {sizes} covers {sum(sizes)} layers but the model has {num_layers}")
    return sizes


def uniform(num_layers: int, stages: int) -> List[int]:
    """As equal as possible; earlier stages take the remainder."""
    base, extra = divmod(num_layers, stages)
    return [base + (1 if k < extra else 0) for k in range(stages)]


def parameter_counts(model: nn.Sequential) -> List[int]:
    """Parameters per layer, each counted once, at the first layer that holds it: a weight tied
    to an earlier layer's (an LM head to its embedding) is that layer's to train, so a layer that
    holds nothing else counts as holding none (docs/architecture.md, "Tied weights")."""
    seen: set = set()
    counts = []
    for layer in model:
        own = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        counts.append(sum(p.numel() for p in own))
    return counts


def weighted_units(model: nn.Sequential) -> List[int]:
    """Layers grouped so that every group holds parameters: a parameter-free layer (an
    activation, a pooling, a reshape) stays with the layer before it (the first group takes
    any leading ones). Returns the number of layers in each group."""
    counts = parameter_counts(model)
    units: List[int] = []
    for c in counts:
        if c > 0 or not units:
            units.append(1)
        else:
            units[-1] += 1
    if len(units) > 1 and not any(counts[:units[0]]):
        leading = units.pop(0)  # a leading parameter-free group joins the next one
        units[0] += leading
    return units


def _group_sums(values: Sequence, sizes: Sequence[int]) -> list:
    """The sums of ``values`` over consecutive groups of ``sizes`` items."""
    return [sum(values[a:b]) for a, b in slices(sizes)]


def _units_for(model: nn.Sequential, stages: int) -> List[int]:
    """:func:`weighted_units` of ``model``, refused where they are fewer than ``stages``."""
    units = weighted_units(model)
    if stages > len(units):
        raise ValueError(f"{stages} stages need at least {stages} layers with parameters; the model has "
                         f"{len(units)} (of {len(model)} layers); use {option('stages', len(units))} or fewer")
    return units


def plan_partition(model: nn.Sequential, stages: int, how: str = "uniform",
                   sizes: Optional[Sequence[int]] = None) -> List[int]:
    """Layers per stage: ``sizes`` if given, else ``uniform`` (equal numbers of layers with
    parameters) or ``params`` (balanced parameter counts). Parameter-free layers go with the
    layer before them, so that every stage has weights to train."""
    num_layers = len(model)
    if sizes is not None:
        return validate_partition(sizes, num_layers)
    if stages < 1:
        raise ValueError(f"{option('stages')} must be at least 1, got {stages}")
    units = _units_for(model, stages)
    if how == "uniform":
        per_stage = uniform(len(units), stages)
    elif how == "params":
        per_stage = time_partition(_group_sums(parameter_counts(model), units), stages)  # equal devices, free links
    else:
        raise ValueError(f"unknown {option('partitioner')} {how!r}; choose uniform or params")
    return _group_sums(units, per_stage)


def slices(sizes: Sequence[int]) -> List[Tuple[int, int]]:
    """The (first, end) layers of each stage of the split ``sizes``."""
    ends = list(itertools.accumulate(sizes))
    return list(zip([0] + ends[:-1], ends))


def split(model: nn.Sequential, sizes: Sequence[int]) -> List[nn.Sequential]:
    """Stage modules sharing ``model``'s layers (no copy): training them trains ``model``."""
    validate_partition(sizes, len(model))
    # slicing an nn.Sequential keeps its layers' names, so stage k's parameters carry the
    # model's own names ("3.weight", not "0.weight"): checkpoints and state dicts by name
    return [model[a:b] for a, b in slices(sizes)]


# -- the `time` partitioner: balance profiled forward+backward time ------------------------------

def _speeds(speeds: Optional[Sequence[float]], stages: int) -> List[float]:
    """``speeds`` as floats (all 1 when None), refused unless one per stage."""
    speed = [1.0] * stages if speeds is None else [float(s) for s in speeds]
    if len(speed) != stages:
        raise ValueError(f"speeds has {len(speed)} values but there are {stages} stages (one per stage)")
    return speed


def _check_time_inputs(layer_costs: Sequence[float], stages: int, speeds: Optional[Sequence[float]],
                       boundary_bytes: Optional[Sequence[float]], bandwidth: Optional[float]):
    """Validate the time partitioner's inputs; return (costs, speeds, per-cut link seconds)."""
    costs = [float(c) for c in layer_costs]
    n = len(costs)
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be a positive integer, got {stages!r}")
    if n == 0:
        raise ValueError("no layers to partition")
    if stages > n:
        raise ValueError(f"{stages} stages need at least {stages} layers; the model has {n}")
    if any(not (c >= 0 and c < float("inf")) for c in costs):
        raise ValueError(f"layer costs must be finite and non-negative, got {costs}")
    speed = _speeds(speeds, stages)
    if any(not (s > 0 and s < float("inf")) for s in speed):
        raise ValueError(f"speeds must be positive and finite, got {speed}")
    if bandwidth is not None:
        if not (bandwidth > 0):
            raise ValueError(f"bandwidth must be positive (bytes per second), got {bandwidth}")
        if boundary_bytes is None:
            raise ValueError("a bandwidth needs boundary_bytes (the activation bytes after each layer)")
    link = [0.0] * max(0, n - 1)
    if boundary_bytes is not None:
        sizes = [float(b) for b in boundary_bytes]
        if len(sizes) not in (n - 1, n):
            raise ValueError(f"boundary_bytes needs one value per cut ({n - 1}) or per layer ({n}), "
                             f"got {len(sizes)}")
        if any(not (b >= 0 and b < float("inf")) for b in sizes):
            raise ValueError(f"boundary bytes must be finite and non-negative, got {sizes}")
        if bandwidth is not None:
            link = [2.0 * b / bandwidth for b in sizes[:n - 1]]
    return costs, speed, link


def time_partition(layer_costs: Sequence[float], stages: int, speeds: Optional[Sequence[float]] = None,
                   boundary_bytes: Optional[Sequence[float]] = None,
                   bandwidth: Optional[float] = None) -> List[int]:
    """The contiguous split of layers into ``stages`` stages that minimises the pipeline's cycle
    time, exactly (dynamic programming, O(stages * layers^2)). Returns layers per stage.

    The cycle time of a split is the largest of

    * each stage's compute: the sum of its layers' ``layer_costs`` (forward + backward seconds
      of one micro-batch) divided by ``speeds[k]``, the relative speed of the device that runs
      stage k (default 1 for all; 2 means twice as fast), as HetPipe models heterogeneous
      devices; stage k runs on device k, in the given order;
    * each cut's link: ``2 * boundary_bytes[i] / bandwidth`` for a cut after layer i, the
      activation sent forward plus its gradient sent back, per micro-batch (PipeDream's
      ``2 a / B`` term). A link is modelled as its own pipeline resource that overlaps with the
      stages' compute (asynchronous sends and receives posted ahead, as the distributed runtime
      does), so it is charged to no stage: a cut whose transfer is slower than every stage is
      the bottleneck itself.

    ``boundary_bytes`` has one value per cut (``len - 1``) or per layer (its last value, the
    model's output, is ignored). ``bandwidth`` is in bytes per second; None means an infinitely
    fast link (no transfer cost). Ties between optimal splits go to the one with the earliest
    cuts. Inputs that cannot work (more stages than layers, a wrong number of speeds, a
    bandwidth that is not positive) raise ValueError.
    """
    costs, speed, link = _check_time_inputs(layer_costs, stages, speeds, boundary_bytes, bandwidth)
    n = len(costs)
    prefix = [0.0, *itertools.accumulate(costs)]
    inf = float("inf")
    # best[j][i]: the smallest cycle time of j stages covering layers [0, i)
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for j in range(1, stages + 1):
        s = speed[j - 1]
        for i in range(j, n - (stages - j) + 1):
            row_best, row_cut = inf, 0
            for c in range(j - 1, i):
                value = best[j - 1][c]
                compute = (prefix[i] - prefix[c]) / s
                if compute > value:
                    value = compute
                if c > 0 and link[c - 1] > value:
                    value = link[c - 1]
                if value < row_best:
                    row_best, row_cut = value, c
            best[j][i], cut[j][i] = row_best, row_cut
    sizes, i = [], n
    for j in range(stages, 0, -1):
        sizes.append(i - cut[j][i])
        i = cut[j][i]
    return sizes[::-1]


def stage_times(layer_costs: Sequence[float], sizes: Sequence[int],
                speeds: Optional[Sequence[float]] = None) -> List[float]:
    """Per stage of the split ``sizes``: its layers' total cost divided by its device's speed."""
    sizes = validate_partition(sizes, len(layer_costs))
    speed = _speeds(speeds, len(sizes))
    return [total / v for total, v in zip(_group_sums([float(c) for c in layer_costs], sizes), speed)]


def cut_seconds(sizes: Sequence[int], boundary_bytes: Optional[Sequence[float]],
                bandwidth: Optional[float]) -> List[float]:
    """Per cut of the split ``sizes`` (stage k to k+1): ``2 * bytes / bandwidth`` (0 without a
    bandwidth), the link time :func:`time_partition` charges for one micro-batch."""
    if bandwidth is None or boundary_bytes is None:
        return [0.0] * (len(sizes) - 1)
    return [2.0 * float(boundary_bytes[end - 1]) / bandwidth for _, end in slices(sizes)[:-1]]


def partition_cycle(layer_costs: Sequence[float], sizes: Sequence[int], speeds: Optional[Sequence[float]] = None,
                    boundary_bytes: Optional[Sequence[float]] = None, bandwidth: Optional[float] = None) -> float:
    """The objective :func:`time_partition` minimises, for the split ``sizes``: the largest stage
    compute time and cut transfer time."""
    return max(stage_times(layer_costs, sizes, speeds) + cut_seconds(sizes, boundary_bytes, bandwidth))


def plan_time_partition(model: nn.Sequential, stages: int, layer_costs: Sequence[float],
                        speeds: Optional[Sequence[float]] = None,
                        boundary_bytes: Optional[Sequence[float]] = None,
                        bandwidth: Optional[float] = None) -> List[int]:
    """Layers per stage for ``model`` by :func:`time_partition`, over the same units as
    :func:`plan_partition` (a parameter-free layer stays with the layer before it, so every
    stage has weights to train). ``layer_costs`` and ``boundary_bytes`` are per layer of
    ``model`` (e.g. from :func:`pipeoptim.profile.profile_model`)."""
    num_layers = len(model)
    if len(layer_costs) != num_layers:
        raise ValueError(f"layer_costs has {len(layer_costs)} values but the model has {num_layers} layers")
    if boundary_bytes is not None and len(boundary_bytes) not in (num_layers - 1, num_layers):
        raise ValueError(f"boundary_bytes needs {num_layers - 1} or {num_layers} values, got {len(boundary_bytes)}")
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    units = _units_for(model, stages)
    unit_bytes = None  # the bytes after each unit's last layer, but the last unit's
    if boundary_bytes is not None:
        unit_bytes = [float(boundary_bytes[end - 1]) for _, end in slices(units)[:-1]]
    per_stage = time_partition(_group_sums([float(c) for c in layer_costs], units), stages, speeds, unit_bytes,
                               bandwidth)
    return _group_sums(units, per_stage)
