"""The bytes of a stage's training state as a measured figure (runtime/state_memory.py) against
the closed form: parameters, gradients at the update, optimizer state, and the weights (the live
ones and the copies a method keeps) equal to the stage's parameter bytes times the weight
versions of the design table, for a synchronous method, PipeDream (N-k versions at stage k) and
PipeOptim (the live weights and one cache where it predicts, the last stage's live weights alone);
Adam's state is two moments per parameter and a step count per tensor."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeoptim
from conftest import batches, mlp

SGDM = lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)  # noqa: E731
ADAM = lambda ps: torch.optim.Adam(ps, lr=1e-3)  # noqa: E731


def stage_parameter_bytes(model: nn.Module, partition) -> list:
    """Bytes of each stage's parameters, counted by hand from the layers (float64: 8 bytes)."""
    layers, sizes, start = list(model), [], 0
    for count in partition:
        sizes.append(sum(p.numel() * 8 for layer in layers[start:start + count] for p in layer.parameters()))
        start += count
    return sizes


@pytest.mark.parametrize("method,versions", [("1f1b-flush", [1, 1, 1]), ("pipedream", [3, 2, 1]),
                                             ("pipeoptim", [2, 2, 1])])
def test_the_state_of_every_stage_is_the_closed_form(method, versions):
    model = mlp()
    result = pipeoptim.train(model, batches(6), method=method, stages=3, partition=[3, 3, 2], optimizer=SGDM,
                             loss_fn=nn.functional.cross_entropy)
    params = stage_parameter_bytes(model, [3, 3, 2])
    assert result.metrics["weight_versions_design"] == versions
    for k, memory in enumerate(result.metrics["state_memory"]):
        assert memory["parameters"] == params[k]
        assert memory["gradients"] == params[k]                  # one gradient per parameter, at the update
        assert memory["optimizer"] == params[k]                  # SGD's momentum buffer
        assert memory["weights_closed_form"] == params[k] * versions[k]
        assert memory["weights"] == memory["weights_closed_form"]  # measured: the live weights and the copies
        assert memory["total"] == memory["weights"] + 2 * params[k]


def test_adams_state_is_two_moments_per_parameter_and_a_step_count_per_tensor():
    model = mlp()
    result = pipeoptim.train(model, batches(2), method="gpipe", stages=2, optimizer=ADAM,
                             loss_fn=nn.functional.cross_entropy)
    tensors = [[p for layer in list(model)[s:e] for p in layer.parameters()] for s, e in ((0, 4), (4, 8))]
    for memory, params in zip(result.metrics["state_memory"], tensors):
        steps = len(params) * 4  # torch keeps each parameter's step as a float32 scalar tensor
        assert memory["optimizer"] == 2 * memory["parameters"] + steps
