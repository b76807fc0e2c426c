"""Partitioning: uniform and parameter-balanced splits, grouping of parameter-free layers."""
from __future__ import annotations

import itertools
import random

import pytest
from torch import nn

from pipeoptim.partition import balanced, plan_partition, split, uniform, validate_partition, weighted_units


def brute_force(weights, stages):
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0,) + cuts + (n,)
        worst = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_balanced_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    stages = rng.randint(1, min(5, n))
    weights = [rng.randint(1, 100) for _ in range(n)]
    sizes = balanced(weights, stages)
    assert len(sizes) == stages and sum(sizes) == n and min(sizes) >= 1
    bounds = [0] + list(itertools.accumulate(sizes))
    assert max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])) == brute_force(weights, stages)


def test_uniform_gives_the_remainder_to_early_stages():
    assert uniform(10, 4) == [3, 3, 2, 2]
    assert uniform(4, 4) == [1, 1, 1, 1]


def test_parameter_free_layers_stay_with_the_layer_before():
    model = nn.Sequential(nn.Flatten(), nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.ReLU(),
                          nn.Dropout(), nn.Linear(2, 8))
    assert weighted_units(model) == [3, 3, 1]
    assert plan_partition(model, 3) == [3, 3, 1]
    assert plan_partition(model, 2, "params") == [6, 1]   # 6+6 | 24: the big layer alone
    with pytest.raises(ValueError, match="4 stages need at least 4 layers with parameters"):
        plan_partition(model, 4)


def test_explicit_partition_is_validated_and_split_shares_layers():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)])
    with pytest.raises(ValueError, match="covers 4 layers but the model has 5"):
        validate_partition([2, 2], 5)
    with pytest.raises(ValueError, match="at least one layer"):
        validate_partition([5, 0], 5)
    parts = split(model, [2, 3])
    assert [len(p) for p in parts] == [2, 3]
    assert parts[1][0] is model[2]
