"""Partitioning: uniform and parameter-balanced splits, grouping of parameter-free layers."""
from __future__ import annotations

import itertools
import random

import pytest
from torch import nn

from pipeoptim.partition import plan_partition, split, time_partition, uniform, validate_partition, weighted_units


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
    sizes = time_partition(weights, stages)
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


def test_a_layer_that_only_reads_an_earlier_layers_weight_holds_no_parameters():
    """A tied head (its weight is the embedding's) is trained by the embedding's stage: the
    partitioners count it as parameter-free, so no stage gets it alone."""
    embed, tied = nn.Linear(2, 4), nn.Linear(2, 4, bias=False)
    tied.weight = embed.weight
    model = nn.Sequential(embed, nn.Linear(4, 4), nn.Linear(4, 4), tied)
    assert weighted_units(model) == [1, 1, 2]
    assert plan_partition(model, 3) == [1, 1, 2]
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


# -- the `time` partitioner ----------------------------------------------------------------------

from pipeoptim.partition import (  # noqa: E402
    partition_cycle, plan_time_partition, stage_times, time_partition)


def brute_force_cycle(costs, stages, speeds=None, boundary_bytes=None, bandwidth=None):
    """Every contiguous split, scored independently: max(stage sum / speed, 2 * cut bytes / bw)."""
    n = len(costs)
    speeds = speeds or [1.0] * stages
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0,) + cuts + (n,)
        parts = [sum(costs[a:b]) / speeds[k] for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        links = [2.0 * boundary_bytes[c - 1] / bandwidth for c in cuts] if bandwidth else []
        worst = max(parts + links)
        best = worst if best is None else min(best, worst)
    return best


def _instance(seed):
    rng = random.Random(1000 + seed)
    n = 12 if seed % 5 == 0 else rng.randint(1, 12)
    stages = 5 if seed % 10 == 0 else rng.randint(1, min(5, n))
    costs = [rng.uniform(0.1, 10.0) for _ in range(n)]
    speeds = [rng.choice([0.5, 1.0, 1.5, 2.0, 4.0]) for _ in range(stages)] if seed % 3 != 0 else None
    if seed % 2:
        boundary = [rng.choice([1, 10, 100, 5000]) * rng.uniform(0.5, 2.0) for _ in range(n - 1)]
        bandwidth = rng.choice([100.0, 1000.0, 10000.0])
    else:
        boundary, bandwidth = None, None
    return costs, stages, speeds, boundary, bandwidth


@pytest.mark.parametrize("seed", range(30))
def test_time_partition_is_optimal_against_brute_force(seed):
    costs, stages, speeds, boundary, bandwidth = _instance(seed)
    sizes = time_partition(costs, stages, speeds, boundary, bandwidth)
    assert len(sizes) == stages and sum(sizes) == len(costs) and min(sizes) >= 1
    got = partition_cycle(costs, sizes, speeds, boundary, bandwidth)
    assert got == pytest.approx(brute_force_cycle(costs, stages, speeds, boundary, bandwidth), rel=1e-12)


def test_time_partition_instances_cover_speeds_and_links():
    kinds = [_instance(s) for s in range(30)]
    assert sum(1 for k in kinds if k[2] is not None and k[4] is not None and k[1] > 1) >= 5
    assert max(len(k[0]) for k in kinds) == 12 and max(k[1] for k in kinds) == 5


def test_time_partition_balances_time_not_layers():
    # one expensive layer: uniform would give [2, 2] = 11 | 2; time gives [1, 3] = 10 | 3
    assert time_partition([10, 1, 1, 1], 2) == [1, 3]
    assert stage_times([10, 1, 1, 1], [1, 3]) == [10.0, 3.0]
    assert time_partition([1.0] * 8, 4) == [2, 2, 2, 2]


def test_a_faster_device_gets_more_layers():
    costs = [1.0] * 12
    assert time_partition(costs, 2) == [6, 6]
    assert time_partition(costs, 2, speeds=[1, 2]) == [4, 8]      # 4/1 = 8/2
    assert time_partition(costs, 2, speeds=[3, 1]) == [9, 3]      # 9/3 = 3/1
    assert time_partition(costs, 3, speeds=[1, 2, 1]) == [3, 6, 3]


def test_a_huge_activation_moves_the_cut_away():
    costs = [1.0] * 6
    small = [10.0] * 5
    assert time_partition(costs, 2, boundary_bytes=small, bandwidth=1000.0) == [3, 3]
    huge = list(small)
    huge[2] = 1e6                                   # the output of layer 2 (the balanced cut) is huge
    sizes = time_partition(costs, 2, boundary_bytes=huge, bandwidth=1000.0)
    assert sizes in ([2, 4], [4, 2]) and sizes == [2, 4]   # next best, earliest cut
    assert partition_cycle(costs, sizes, None, huge, 1000.0) == 4.0
    # without a bandwidth the bytes cost nothing
    assert time_partition(costs, 2, boundary_bytes=huge) == [3, 3]
    # per-layer bytes (the last, the model's output, ignored) work as per-cut bytes
    assert time_partition(costs, 2, boundary_bytes=huge + [1e9], bandwidth=1000.0) == [2, 4]


def test_time_partition_rejects_impossible_input_in_one_line():
    cases = [
        (dict(layer_costs=[1, 1], stages=3), "3 stages need at least 3 layers"),
        (dict(layer_costs=[1, 1, 1], stages=2, speeds=[1, 2, 3]), "speeds has 3 values but there are 2 stages"),
        (dict(layer_costs=[1, 1, 1], stages=2, speeds=[1, 0]), "speeds must be positive"),
        (dict(layer_costs=[1, 1, 1], stages=2, boundary_bytes=[1, 1], bandwidth=-5.0), "bandwidth must be positive"),
        (dict(layer_costs=[1, 1, 1], stages=2, bandwidth=10.0), "needs boundary_bytes"),
        (dict(layer_costs=[1, 1, 1], stages=2, boundary_bytes=[1], bandwidth=10.0), "one value per cut"),
        (dict(layer_costs=[1, -1, 1], stages=2), "non-negative"),
        (dict(layer_costs=[1, 1], stages=0), "positive integer"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            time_partition(**kwargs)
        assert "\n" not in str(info.value)


def test_plan_time_partition_keeps_parameter_free_layers_with_the_layer_before():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.ReLU())
    # units: [0,1] [2,3] [4,5]; unit costs 9, 2, 2 -> [1 unit | 2 units] = [2, 4] layers
    costs = [8, 1, 1, 1, 1, 1]
    assert plan_time_partition(model, 2, costs) == [2, 4]
    # a huge activation after unit 0 (layer 1's output) moves the cut to after unit 1
    assert plan_time_partition(model, 2, costs, boundary_bytes=[0, 1e9, 0, 1, 0], bandwidth=1.0) == [4, 2]
    with pytest.raises(ValueError, match="4 stages need at least 4 layers with parameters"):
        plan_time_partition(model, 4, costs)
    with pytest.raises(ValueError, match="layer_costs has 3 values"):
        plan_time_partition(model, 2, [1, 1, 1])
