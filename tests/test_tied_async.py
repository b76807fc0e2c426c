"""A weight tied across stages under the asynchronous methods (docs/architecture.md, "Tied
weights"): the owner's policy decides the tied values of each micro-batch, every other holder
runs its passes of that micro-batch on them, and its gradient joins the owner's update of that
micro-batch.

By hand: a toy LM whose head is its embedding, cut in two (stage 0: the embedding, the owner;
stage 1: a linear layer and the head), trained with pipeoptim and with pipedream, against a loop
of plain torch written from the rule, not from the library's policies. Then every asynchronous
method trains a tied GPT in one process and under torchrun to the same losses and weights."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import pipeoptim
from pipeoptim.methods import get_method
from traced_models import TinyGPT, lm_batches, lm_loss

LR, MU = 0.1, 0.9
SGDM = lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MU)  # noqa: E731


class TiedToy(nn.Module):
    """logits = tanh(mid(E[x])) @ E^T: the head's weight is the embedding's."""

    def __init__(self, vocab: int = 7, width: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(tokens))))


def toy_data(count: int = 8, size: int = 6, vocab: int = 7):
    """Tokens and the next token (x + 1 mod vocab): something to learn."""
    g = torch.Generator().manual_seed(4)
    tokens = [torch.randint(0, vocab, (size,), generator=g) for _ in range(count)]
    return [(x, (x + 1) % vocab) for x in tokens]


def by_hand(model: TiedToy, data, method: str):
    """The rule, for N = 2, M = 1 and SGD with momentum, in plain torch. Stage 0 (the owner)
    runs F(0), then F(t+1), B(t), U(t): its forward of t runs on E^(max(t-1, 0)), and pipeoptim
    predicts it one update ahead, E - lr * m (m the momentum buffer, the paper's Delta), once an
    update has given it a direction (t >= 2). Stage 1 runs F(t), B(t), U(t) on its own W^(t), b^(t)
    and on the owner's values of t for the head. The gradient of E from both stages joins the
    owner's update t, which runs after its forward of t+1."""
    w = {n: p.detach().clone() for n, p in model.named_parameters()}  # embed.weight, mid.weight, mid.bias
    momentum = {n: torch.zeros_like(v) for n, v in w.items()}

    def step(name: str, grad: torch.Tensor) -> None:
        momentum[name] = MU * momentum[name] + grad
        w[name] = w[name] - LR * momentum[name]

    losses, used, pending = [], [], None
    for t, (x, y) in enumerate(data):
        tied = w["embed.weight"].clone()
        if method == "pipeoptim" and t >= 2:
            tied = tied - LR * 1 * momentum["embed.weight"]
        used.append(tied)
        e, m, b = (v.clone().requires_grad_(True) for v in (tied, w["mid.weight"], w["mid.bias"]))
        loss = F.cross_entropy(torch.tanh(e[x] @ m.T + b) @ e.T, y)  # the owner's values in both places
        loss.backward()
        losses.append(float(loss.detach()))
        step("mid.weight", m.grad)   # stage 1's update t
        step("mid.bias", b.grad)
        if pending is not None:      # stage 0's update t-1, after its forward of t
            step("embed.weight", pending)
        pending = e.grad
    step("embed.weight", pending)    # the drain: stage 0's last update
    return losses, used, w


@pytest.mark.parametrize("method", ["pipeoptim", "pipedream"])
def test_a_tied_toy_equals_the_rule_computed_by_hand(method):
    torch.manual_seed(0)
    model, data = TiedToy(), toy_data()
    expected, used, weights = by_hand(model, data, method)
    pipe = pipeoptim.Pipeline(model, method=method, split_points=["mid"], loss_fn=F.cross_entropy, optimizer=SGDM)
    seen = []  # what stage 1's head ran on, per micro-batch
    pipe.prepare(data[0][0])
    exchange = pipe.stages[1].tied.ties[0].exchange
    take = exchange.take
    exchange.take = lambda holder, i: seen.append(take(holder, i).clone()) or seen[-1]
    losses = [loss for x, y in data for loss in pipe.step(x, y)] + pipe.flush()
    assert losses == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert len(seen) == len(used) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(seen, used))
    trained = pipe.model()
    assert trained.head.weight is trained.embed.weight
    for name, value in weights.items():
        assert torch.allclose(trained.get_parameter(name), value, atol=1e-6), name
    # the owner's forwards, as the method's rule says: versions 0, 0, 1, 2, ...; pipeoptim
    # predicts one step from t = 2 on
    forwards = [(e.version, e.steps) for e in pipe.stages[0].record.trace if e.kind == "F"]
    steps = [0, 0] + [1] * (len(data) - 2) if method == "pipeoptim" else [0] * len(data)
    assert forwards == [(max(t - 1, 0), s) for t, s in enumerate(steps)]
    assert pipe.stages[1].tied.ties[0].exchange.values == {}  # nothing held after the drain
    assert expected[-1] < expected[0]  # it learns: the comparison is not of constants


def test_pipeoptim_and_pipedream_differ_only_by_the_prediction():
    """The by-hand loops are not the same computation under two names: the prediction changes
    the losses from t = 2 on."""
    torch.manual_seed(0)
    model, data = TiedToy(), toy_data()
    optim, dream = by_hand(model, data, "pipeoptim")[0], by_hand(model, data, "pipedream")[0]
    assert optim[:2] == dream[:2] and all(abs(a - b) > 1e-6 for a, b in zip(optim[2:], dream[2:]))


#: every asynchronous method of one chunk per stage
ASYNC = [m for m in pipeoptim.method_names() if not get_method(m).synchronous and get_method(m).chunks == 1]
MICRO = {"pipedream-2bw": 2, "pipeoptim-2bw": 2, "1f1b-flush": 1}


def train_gpt(method: str, **settings):
    torch.manual_seed(0)
    pipe = pipeoptim.Pipeline(TinyGPT(layers=2), method=method, split_points=["layers.1"], loss_fn=lm_loss,
                              optimizer=SGDM, micro_batches=MICRO.get(method), **settings)
    losses = [loss for x, y in lm_batches(count=4) for loss in pipe.step(x, y)] + pipe.flush()
    return losses, pipe


@pytest.mark.parametrize("method", ASYNC)
def test_every_asynchronous_method_trains_a_tied_gpt(method):
    losses, pipe = train_gpt(method)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    trained = pipe.model()
    assert trained.head.weight is trained.embed.weight
    owners = [s.index for s in pipe.stages if any(p is trained.embed.weight for p in s.parameters())]
    assert owners == [0]
    # recomputation changes nothing (the holder's tied values are held per micro-batch)
    again, _ = train_gpt(method, recompute=True)
    assert again == losses


def test_a_synchronous_warm_up_over_the_whole_run_is_synchronous_training():
    """pipeoptim whose sync_warmup covers every mini-batch runs 1F1B with a flush: the tie's
    per-micro-batch rule then gives 1f1b-flush's numbers (the owner's forward values are W^(t)
    for every micro-batch, every gradient joins update t)."""
    expected, _ = train_gpt("1f1b-flush")
    losses, pipe = train_gpt("pipeoptim", sync_warmup=4)
    assert losses == pytest.approx(expected, rel=1e-6)
    assert pipe.stages[1].tied.synchronous is False  # the asynchronous path ran


def test_asynchronous_methods_under_torchrun_equal_one_process(traced_under_torchrun):
    """Two processes, the embedding on rank 0 and the tied head on rank 1: every asynchronous
    method gives the losses and the trained weights of one process, with one tied tensor (the
    "async-gpt" group of conftest's one torchrun job: every method of ASYNC, split at layers.1)."""
    rows = {r["method"]: r for r in traced_under_torchrun["async-gpt"] if "losses" in r}
    assert sorted(rows) == sorted(ASYNC)
    for method in ASYNC:
        losses, pipe = train_gpt(method)
        got = rows[method]
        assert got["losses"] == pytest.approx(losses, rel=1e-6), method
        assert got["tied"], method
        for name, value in pipe.model().state_dict().items():
            assert torch.allclose(torch.tensor(got["weights"][name]), value, atol=1e-6), (method, name)
