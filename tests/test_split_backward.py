"""The split backward (runtime/split_backward.py) and the zero-bubble method that runs it.

The two halves together give the full backward's gradients (input and every weight) on graphs
that stress the grouping: a weight used twice, an output that does not depend on the stage's
input, a stage whose input needs no gradient (the first), an unused weight, attention; and the
weight half computes no input gradient again (counted matrix products); no micro-batch's graph
outlives its weight half. zb-h1 through the
Pipeline equals sequential training on a model of (float, int) tuples with embeddings.
"""
from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import pipeoptim
from pipeoptim.runtime.split_backward import backward_input, backward_weight

D = torch.float64


def full_and_split(fn, weights, x, grads, input_grad=True):
    """(input grad, weight grads) of a plain backward and of the two halves."""
    results = []
    for split in (False, True):
        for w in weights:
            w.grad = None
        xi = x.detach().requires_grad_(input_grad)
        outputs = list(fn(xi))
        if split:
            found, pending = backward_input(outputs, grads, [xi] if input_grad else [], weights)
            assert all(w.grad is None for w in weights)  # the input half leaves the weights alone
            backward_weight(pending)
            dx = found[0] if input_grad else None
        else:
            torch.autograd.backward(outputs, [torch.ones_like(o) if g is None else g
                                              for o, g in zip(outputs, grads)])
            dx = xi.grad if input_grad else None
        results.append((dx, [None if w.grad is None else w.grad.clone() for w in weights]))
    return results


def assert_same(full, split):
    (dx, dw), (sx, sw) = full, split
    assert (dx is None) == (sx is None) and (dx is None or torch.allclose(dx, sx, rtol=1e-12, atol=1e-14))
    for a, b in zip(dw, sw):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


def mlp(depth=3, width=5):
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())]
    return nn.Sequential(*layers).to(D)


@pytest.mark.parametrize("input_grad", [True, False], ids=["middle-stage", "first-stage"])
def test_halves_equal_the_full_backward_of_a_chain(input_grad):
    model = mlp()
    x, g = torch.randn(6, 5, dtype=D), torch.randn(6, 5, dtype=D)
    full, split = full_and_split(lambda x: (model(x),), list(model.parameters()), x, [g], input_grad)
    assert_same(full, split)
    assert all(w is not None for w in split[1])


def test_halves_equal_the_full_backward_of_a_loss():
    model = mlp()
    x = torch.randn(6, 5, dtype=D)
    full, split = full_and_split(lambda x: (model(x).pow(2).mean(),), list(model.parameters()), x, [None])
    assert_same(full, split)


def test_a_weight_used_twice_is_counted_once_per_use():
    torch.manual_seed(1)
    lin = nn.Linear(4, 4).to(D)
    x, g = torch.randn(6, 4, dtype=D), torch.randn(6, 4, dtype=D)
    full, split = full_and_split(lambda x: (lin(torch.tanh(lin(x))),), list(lin.parameters()), x, [g])
    assert_same(full, split)


def test_outputs_off_the_input_path_keep_their_weights_gradients():
    """One output adds a weight-only term, two more depend on the weight alone, one on another."""
    torch.manual_seed(2)
    w = nn.Parameter(torch.randn(3, dtype=D))
    lin = nn.Linear(4, 3).to(D)
    unused = nn.Parameter(torch.randn(2, dtype=D))

    def stage(x):
        c = w * 2
        return lin(x) + c, c.sin(), c * 3

    grads = [torch.randn(6, 3, dtype=D), torch.randn(3, dtype=D), torch.randn(3, dtype=D)]
    full, split = full_and_split(stage, [w, *lin.parameters(), unused], torch.randn(6, 4, dtype=D), grads)
    assert_same(full, split)
    assert split[1][-1] is None  # the unused weight gets none, as from autograd


def test_attention_and_layer_norm():
    torch.manual_seed(3)
    norm, attention = nn.LayerNorm(4).to(D), nn.MultiheadAttention(4, 2, batch_first=True).to(D)

    def stage(x):
        y = norm(x).unsqueeze(0)
        return (attention(y, y, y)[0].squeeze(0) + x,)

    weights = [*norm.parameters(), *attention.parameters()]
    full, split = full_and_split(stage, weights, torch.randn(6, 4, dtype=D), [torch.randn(6, 4, dtype=D)])
    assert_same(full, split)


class MatrixProducts(TorchDispatchMode):
    """Counts the matrix products run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


def test_the_weight_half_computes_no_input_gradient_again():
    """Six linear layers: a full backward runs 12 products (6 for inputs, 6 for weights); the
    input half runs the 6 of the input path, the weight half the 6 of the weights."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)])
    x = torch.randn(4, 8, requires_grad=True)
    g = torch.randn(4, 8)
    with MatrixProducts() as full:
        model(x).backward(g)
    out = model(x)
    with MatrixProducts() as first:
        _, pending = backward_input([out], [g], [x], list(model.parameters()))
    with MatrixProducts() as second:
        backward_weight(pending)
    assert (full.count, first.count, second.count) == (12, 6, 6)


class TupleIn(nn.Module):
    """(x, bucket) -> (h, bucket): a linear layer plus an embedding of an integer input."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.embed = nn.Embedding(3, width)

    def forward(self, inputs):
        x, bucket = inputs
        return torch.tanh(self.linear(x) + self.embed(bucket)), bucket


class TupleHead(nn.Module):
    def forward(self, inputs):
        return inputs[0][:, :3]


def tuple_model() -> nn.Sequential:
    torch.manual_seed(4)
    return nn.Sequential(TupleIn(), TupleIn(), TupleIn(), TupleHead()).to(D)


def tuple_batches(count: int = 4, size: int = 8):
    g = torch.Generator().manual_seed(5)
    return [((torch.randn(size, 6, generator=g, dtype=D), torch.randint(0, 3, (size,), generator=g)),
             torch.randint(0, 3, (size,), generator=g)) for _ in range(count)]


@pytest.mark.parametrize("stages,micro", [(2, 2), (3, 4)])
def test_zb_h1_on_tuples_equals_sequential(stages, micro):
    opt = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
    common = dict(optimizer=opt, loss_fn=nn.functional.cross_entropy, micro_batches=micro)
    reference = pipeoptim.train(tuple_model(), tuple_batches(), method="sequential", **common)
    result = pipeoptim.train(tuple_model(), tuple_batches(), method="zb-h1", stages=stages, **common)
    assert result.losses == pytest.approx(reference.losses, rel=1e-12)
    for a, b in zip(result.model.parameters(), reference.model.parameters()):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if torch.is_tensor(o))


@pytest.mark.filterwarnings("ignore::FutureWarning")  # is_tensor on every object touches deprecated names
def test_a_split_backward_leaves_no_graph_behind():
    """Every micro-batch's graph goes once its weight half has run: the activation count's saved
    values must not make a cycle through the nodes that the input half ran with retain_graph
    (it did: the graph of every micro-batch stayed, 9 MB per mini-batch in the throughput run)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.ReLU())], nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 16, generator=g), torch.randint(0, 3, (32,), generator=g)) for _ in range(8)]
    pipe = pipeoptim.Pipeline(model, method="zb-h1", stages=2, micro_batches=4,
                              loss_fn=nn.functional.cross_entropy,
                              optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert_second_fit_keeps_nothing(pipe, data)


def assert_second_fit_keeps_nothing(pipe, data) -> None:
    """After ``pipe`` fitted ``data[:2]``, fitting ``data[2:]`` leaves as many tensors alive."""
    gc.disable()  # what autograd's C++ references keep, Python's collector would not free anyway
    try:
        pipe.fit(data[:2])
        before = _live_tensors()
        pipe.fit(data[2:])
        assert _live_tensors() == before
    finally:
        gc.enable()


class _Announcements:
    """A stage's gradient averager as the stage sees it, recording what it is handed (one
    replica: nothing to average)."""

    overlapping = True

    def __init__(self) -> None:
        self.seen: list = []

    def overlap(self) -> None:
        pass

    def ready(self, param) -> None:
        self.seen.append(id(param))

    def ready_all(self, params) -> None:
        for param in params:
            self.ready(param)

    def __call__(self, params) -> None:
        pass


def test_a_weight_half_hands_each_groups_final_gradients_to_the_replicas_reduction():
    """zb-h1, 2 stages, M = 2: in every weight half (the first stage's a full backward, seen by
    autograd's hooks) each of the stage's parameters is announced once, with the losses unchanged;
    so a data-parallel stage reduces them while the weight half goes on (tests/test_torchrun.py:
    the replicas equal one replica)."""
    import pipeoptim
    from torch import nn

    from pipeoptim.world import LocalWorld

    class Recording(LocalWorld):  # the stages' replica sync: the recording one
        def __init__(self) -> None:
            super().__init__()
            self.sync = _Announcements()

        def replica_sync(self, stages: int, replicas: int, sharded: bool) -> _Announcements:
            return self.sync

    def run(world):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        pipe = pipeoptim.Pipeline(model, method="zb-h1", stages=2, micro_batches=2, loss_fn=nn.functional.mse_loss,
                                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1), world=world)
        g = torch.Generator().manual_seed(1)
        return pipe.fit([(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g))]).losses, pipe

    plain, _ = run(None)
    world = Recording()
    losses, pipe = run(world)
    assert losses == plain
    params = [id(p) for stage in pipe.stages for p in stage.parameters()]
    assert sorted(world.sync.seen) == sorted(params * 2)  # once per weight half, 2 micro-batches
