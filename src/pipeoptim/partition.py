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


def plan_partition(model: nn.Sequential, stages: int, how: str = "uniform",
                   sizes: Optional[Sequence[int]] = None) -> List[int]:
    """Layers per stage: ``sizes`` if given, else ``uniform`` or ``params`` (balanced by count)."""
    num_layers = len(model)
    if sizes is not None:
        return validate_partition(sizes, num_layers)
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    if stages > num_layers:
        raise ValueError(f"{stages} stages need at least {stages} layers; the model has {num_layers} "
                         f"(use --stages {num_layers} or fewer)")
    if how == "uniform":
        return uniform(num_layers, stages)
    if how == "params":
        # +1 per layer so that parameter-free layers still count for something
        return balanced([c + 1 for c in parameter_counts(model)], stages)
    raise ValueError(f"unknown partitioner {how!r}; choose uniform or params")


def split(model: nn.Sequential, sizes: Sequence[int]) -> List[nn.Sequential]:
    """Stage modules sharing ``model``'s layers (no copy): training them trains ``model``."""
    validate_partition(sizes, len(model))
    layers = list(model)
    parts, start = [], 0
    for size in sizes:
        parts.append(nn.Sequential(*layers[start:start + size]))
        start += size
    return parts
