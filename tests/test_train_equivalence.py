"""Invariants 1 and 2 of docs/architecture.md, "Invariants and where they are tested", and the
transparency of the pipeline.

* with one stage every method equals sequential training, step for step;
* gpipe, 1f1b-flush and zb-h1 (its backward split in two halves) equal sequential training with
  gradient accumulation over the same micro-batches, and sequential equals a plain PyTorch loop;
* the caller's model is never modified.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipeoptim
from conftest import batches, mlp

LOSS = nn.functional.cross_entropy
SGDM = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
ADAM = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731


def plain_loop(model, data, make_opt, micro=1):
    """Ordinary training with gradient accumulation over ``micro`` equal micro-batches."""
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    losses = []
    for x, y in data:
        total = 0.0
        for xm, ym in zip(torch.tensor_split(x, micro), torch.tensor_split(y, micro)):
            loss = LOSS(model(xm), ym) * (ym.shape[0] / y.shape[0])
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model


def test_sequential_equals_a_plain_pytorch_loop():
    model, data = mlp(), batches()
    expected, trained = plain_loop(model, data, SGDM)
    result = pipeoptim.train(model, data, method="sequential", optimizer=SGDM, loss_fn=LOSS)
    assert result.losses == expected  # bit for bit
    for a, b in zip(result.model.parameters(), trained.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("method", pipeoptim.method_names())
@pytest.mark.parametrize("make_opt", [SGDM, ADAM], ids=["momentum", "adam"])
def test_one_stage_equals_sequential(method, make_opt):
    model, data = mlp(), batches()
    micro = 2 if method in ("gpipe", "1f1b-flush", "zb-h1", "dualpipev", "pipedream-2bw", "pipeoptim-2bw", "xpipe",
                            "bidirectional", "bitpipe") else 1
    reference = pipeoptim.train(model, data, method="sequential", optimizer=make_opt, loss_fn=LOSS,
                                micro_batches=micro)
    result = pipeoptim.train(model, data, method=method, stages=1, optimizer=make_opt, loss_fn=LOSS,
                             micro_batches=micro if micro > 1 else None, epochs=1)
    assert result.losses == reference.losses


def test_one_stage_pipeoptim_code_steps_do_differ():
    """The authors' s = N - k predicts one step even without staleness: not sequential."""
    model, data = mlp(), batches()
    reference = pipeoptim.train(model, data, method="sequential", optimizer=SGDM, loss_fn=LOSS)
    code = pipeoptim.train(model, data, method="pipeoptim", stages=1, optimizer=SGDM, loss_fn=LOSS, steps="code")
    assert code.losses[0] == reference.losses[0]  # nothing to predict from before the first step
    assert abs(code.losses[-1] - reference.losses[-1]) > 1e-6


@pytest.mark.parametrize("method", ["gpipe", "1f1b-flush", "zb-h1"])
@pytest.mark.parametrize("n,m", [(2, 2), (4, 4), (4, 8), (8, 4)])
def test_synchronous_pipelines_equal_gradient_accumulation(method, n, m):
    model, data = mlp(depth=8), batches(6)
    expected, trained = plain_loop(model, data, SGDM, micro=m)
    result = pipeoptim.train(model, data, method=method, stages=n, micro_batches=m, optimizer=SGDM, loss_fn=LOSS)
    assert result.losses == pytest.approx(expected, rel=1e-12)
    for a, b in zip(result.model.parameters(), trained.parameters()):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_callers_model_is_untouched_and_trained_copy_is_returned():
    model, data = mlp(), batches()
    before = copy.deepcopy(model.state_dict())
    result = pipeoptim.train(model, data, method="pipeoptim", stages=4, optimizer=SGDM, loss_fn=LOSS)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    assert any(not torch.equal(a, b) for a, b in zip(result.model.parameters(), model.parameters()))


def test_partition_and_params_partitioner():
    model, data = mlp(depth=8), batches(4)
    result = pipeoptim.train(model, data, method="gpipe", partition=[1, 3, 4], optimizer=SGDM, loss_fn=LOSS)
    assert result.metrics["partition"] == [1, 3, 4]
    result = pipeoptim.train(model, data, method="gpipe", stages=3, partitioner="params", optimizer=SGDM, loss_fn=LOSS)
    assert sum(result.metrics["partition"]) == 8


@pytest.mark.parametrize("kwargs,message", [
    (dict(method="nope", stages=2), "unknown method"),
    (dict(method="pipeoptim", stages=9), "9 stages need at least 9 layers with parameters; the model has 8"),
    (dict(method="pipeoptim", partition=[3, 3]), "covers 6 layers but the model has 8"),
    (dict(method="pipeoptim", stages=2, steps="sometimes"), "steps must be one of"),
    (dict(method="gpipe", stages=2, vertical_sync=True), "takes no option vertical_sync"),
    (dict(method="pipedream-2bw", stages=4, micro_batches=2), "micro-batches >= stages"),
    (dict(method="gpipe", stages=2, micro_batches=9), "cannot split a mini-batch of 8"),
    (dict(method="pipeoptim"), "give stages=N or partition"),
])
def test_bad_settings_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        pipeoptim.train(mlp(), batches(2), optimizer=SGDM, loss_fn=LOSS, **kwargs)


def test_non_finite_loss_stops_the_run():
    model, data = mlp(), batches()
    blow_up = lambda ps: torch.optim.SGD(ps, lr=1e6)  # noqa: E731
    with pytest.raises(pipeoptim.NonFiniteLoss, match="loss became"):
        pipeoptim.train(model, data, method="pipeoptim", stages=2, optimizer=blow_up,
                        loss_fn=lambda out, y: (out ** 2).mean() * 1e300)
