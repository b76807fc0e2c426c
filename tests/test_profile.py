"""The per-layer profiler: positive times, exact byte counts, tuple activations, JSON round trip."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from pipeoptim.profile import ModelProfile, nbytes, profile_model


class AddPair(nn.Module):
    """Takes a tuple (a, b), returns (a + b, 2 * b): activations that are tuples."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width, dtype=torch.float64))

    def forward(self, pair):
        a, b = pair
        return a * self.scale + b, 2 * b


class First(nn.Module):
    def forward(self, pair):
        return pair[0]


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 7), nn.ReLU(), nn.Linear(7, 16), nn.Tanh()).double()


def test_times_are_positive_and_bytes_exact():
    model = small_model()
    x = torch.randn(5, 3, dtype=torch.float64)
    prof = profile_model(model, x, warmup=1, repeats=3,
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), optimizer_name="momentum")
    assert [l.name for l in prof.layers] == ["Linear", "ReLU", "Linear", "Tanh"]
    for layer in prof.layers:
        assert layer.forward > 0 and layer.backward > 0
    # output bytes by hand: batch 5, float64 (8 bytes)
    assert [l.output_bytes for l in prof.layers] == [5 * 7 * 8, 5 * 7 * 8, 5 * 16 * 8, 5 * 16 * 8]
    # parameter bytes by hand: (in*out + out) * 8
    assert [l.parameter_bytes for l in prof.layers] == [(3 * 7 + 7) * 8, 0, (7 * 16 + 16) * 8, 0]
    assert [l.parameters for l in prof.layers] == [28, 0, 128, 0]
    assert prof.parameter_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    # momentum SGD keeps one buffer per parameter; the update is timed where there are parameters
    assert [l.optimizer_bytes for l in prof.layers] == [28 * 8, 0, 128 * 8, 0]
    assert prof.layers[0].update > 0 and prof.layers[1].update == 0
    # ReLU and Tanh save their output; Linear saves its input (the weight is a parameter)
    assert prof.layers[1].saved_bytes == prof.layers[1].saved_output_bytes == 5 * 7 * 8
    assert prof.layers[2].saved_bytes == prof.layers[2].saved_input_bytes == 5 * 7 * 8
    assert prof.layers[0].saved_bytes == 5 * 3 * 8
    # held per micro-batch on one stage of all four layers: x, relu(...), tanh(...), each once
    assert prof.held_bytes(0, 4) == (5 * 3 + 5 * 7 + 5 * 16) * 8
    # a stage starting at layer 2 keeps its received input (saved by its Linear anyway)
    assert prof.held_bytes(2, 4) == (5 * 7 + 5 * 16) * 8
    assert prof.boundary_bytes() == [280, 280, 640]
    assert prof.batch_size == 5 and prof.input_bytes == 5 * 3 * 8
    assert prof.totals()["forward"] == pytest.approx(sum(l.forward for l in prof.layers))


def test_the_callers_model_is_untouched():
    model = small_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile_model(model, torch.randn(4, 3, dtype=torch.float64), warmup=0, repeats=1,
                  optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_tuple_activations_and_conv_bytes():
    model = nn.Sequential(AddPair(6), First(), nn.Unflatten(1, (1, 6)),
                          nn.Conv1d(1, 4, kernel_size=3, padding=1).double())
    pair = (torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64))
    prof = profile_model(model, pair, warmup=0, repeats=2)
    assert prof.input_bytes == nbytes(pair) == 2 * 3 * 6 * 8
    assert prof.layers[0].output_bytes == 2 * 3 * 6 * 8          # a tuple of two (3, 6) tensors
    assert prof.layers[0].parameter_bytes == 6 * 8
    assert prof.layers[3].output_bytes == 3 * 4 * 6 * 8          # (3, 4, 6) float64
    assert prof.layers[3].parameter_bytes == (4 * 1 * 3 + 4) * 8
    assert prof.layers[0].backward > 0 and prof.layers[3].backward > 0
    assert prof.batch_size == 3


def test_the_loss_is_profiled_and_charged_to_the_last_layer():
    model = small_model()
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 16, (8,))
    prof = profile_model(model, x, warmup=0, repeats=2, loss_fn=nn.functional.cross_entropy, target=y)
    assert prof.loss_forward > 0 and prof.loss_backward > 0
    costs = prof.layer_costs()
    assert costs[-1] == pytest.approx(prof.layers[-1].compute + prof.loss_forward + prof.loss_backward)
    assert costs[:-1] == [l.compute for l in prof.layers[:-1]]


def test_profile_round_trips_through_json():
    prof = profile_model(small_model(), torch.randn(4, 3, dtype=torch.float64), warmup=0, repeats=1)
    again = ModelProfile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert again == prof
    assert json.loads(json.dumps(prof.to_dict()))["totals"]["parameter_bytes"] == prof.parameter_bytes


def test_bad_arguments():
    with pytest.raises(ValueError, match="non-empty nn.Sequential"):
        profile_model(nn.Sequential(), torch.zeros(1))
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        profile_model(small_model(), torch.zeros(2, 3, dtype=torch.float64), repeats=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            profile_model(small_model(), torch.zeros(2, 3, dtype=torch.float64), device="cuda")


def test_a_sample_that_is_a_slice_counts_only_its_own_bytes():
    model = nn.Sequential(nn.Linear(3, 4)).double()
    big = torch.randn(100, 5, 3, dtype=torch.float64)
    prof = profile_model(model, big[7], warmup=0, repeats=1)   # a view into 100 x 5 x 3
    assert prof.layers[0].saved_bytes == 5 * 3 * 8 and prof.input_bytes == 5 * 3 * 8


def test_min_statistic_is_never_above_the_median():
    model = small_model()
    x = torch.randn(16, 3, dtype=torch.float64)
    torch.manual_seed(0)
    prof = profile_model(model, x, warmup=0, repeats=3, statistic="min")
    assert prof.statistic == "min" and all(l.forward > 0 for l in prof.layers)
    with pytest.raises(ValueError, match="statistic must be one of median, min"):
        profile_model(model, x, statistic="mean")


def test_measured_stages_time_every_stage_as_the_runtime_runs_it():
    from pipeoptim.stage_timing import measure_stages

    model = small_model()
    x, y = torch.randn(16, 3, dtype=torch.float64), torch.randint(0, 16, (16,))
    opt = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    times = measure_stages(model, [1, 3], x, y, nn.functional.cross_entropy, optimizer=opt, warmup=1, repeats=3)
    assert set(times) == {"forward", "backward", "update"}
    for values in times.values():
        assert len(values) == 2 and all(v > 0 for v in values)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="no trainable parameters"):
        measure_stages(model, [3, 1], x, y, nn.functional.cross_entropy)
