"""Split an ``nn.Sequential`` into contiguous stages: uniform by layers, or balanced by parameters."""
from __future__ import annotations

from typing import List, Optional, Sequence

from torch import nn


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


def balanced(weights: Sequence[float], stages: int) -> List[int]:
    """The contiguous split minimising the largest stage total (exact, dynamic programming)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[j][i]: the smallest possible maximum over j stages covering layers [0, i)
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for j in range(1, stages + 1):
        for i in range(j, n - (stages - j) + 1):
            for c in range(j - 1, i):
                value = max(best[j - 1][c], prefix[i] - prefix[c])
                if value < best[j][i]:
                    best[j][i], cut[j][i] = value, c
    sizes, i = [], n
    for j in range(stages, 0, -1):
        sizes.append(i - cut[j][i])
        i = cut[j][i]
    return sizes[::-1]


def parameter_counts(model: nn.Sequential) -> List[int]:
    return [sum(p.numel() for p in layer.parameters()) for layer in model]


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


def plan_partition(model: nn.Sequential, stages: int, how: str = "uniform",
                   sizes: Optional[Sequence[int]] = None) -> List[int]:
    """Layers per stage: ``sizes`` if given, else ``uniform`` (equal numbers of layers with
    parameters) or ``params`` (balanced parameter counts). Parameter-free layers go with the
    layer before them, so that every stage has weights to train."""
    num_layers = len(model)
    if sizes is not None:
        return validate_partition(sizes, num_layers)
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    units = weighted_units(model)
    if stages > len(units):
        raise ValueError(f"{stages} stages need at least {stages} layers with parameters; the model has "
                         f"{len(units)} (of {num_layers} layers); use --stages {len(units)} or fewer")
    if how == "uniform":
        per_stage = uniform(len(units), stages)
    elif how == "params":
        counts, start = parameter_counts(model), 0
        unit_params = []
        for size in units:
            unit_params.append(sum(counts[start:start + size]))
            start += size
        per_stage = balanced(unit_params, stages)
    else:
        raise ValueError(f"unknown partitioner {how!r}; choose uniform or params")
    result, start = [], 0
    for count in per_stage:
        result.append(sum(units[start:start + count]))
        start += count
    return result


def split(model: nn.Sequential, sizes: Sequence[int]) -> List[nn.Sequential]:
    """Stage modules sharing ``model``'s layers (no copy): training them trains ``model``."""
    validate_partition(sizes, len(model))
    layers = list(model)
    parts, start = [], 0
    for size in sizes:
        parts.append(nn.Sequential(*layers[start:start + size]))
        start += size
    return parts
