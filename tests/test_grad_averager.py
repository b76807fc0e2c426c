"""GradientAverager: the replicas' gradient reduction overlaps the backward of the last
micro-batch before an update (buckets go out as autograd finishes them), with the same result as
one reduction at the update. One gloo process (a group of one) is enough to see when each bucket
leaves and what comes back."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeoptim.methods import get_method
from pipeoptim.runtime.build import build_stages
from pipeoptim.runtime.averaging import GradientAverager


@pytest.fixture(scope="module")
def group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def one_stage(method: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    meth = get_method(method)
    stage = build_stages(model, [5], meth, meth.resolve_options({}), lambda p: torch.optim.SGD(p, lr=0.1),
                         nn.functional.cross_entropy)[0]
    stage.policy.begin_epoch([], [])
    return stage


@pytest.mark.parametrize("method", ["gpipe", "pipeoptim"])  # the module's own parameters; aliases
def test_buckets_leave_during_the_backward_and_the_gradients_are_the_plain_ones(group, method):
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    plain = one_stage(method)
    plain.forward(0, x, y)
    plain.backward(0)
    expected = [p.grad.clone() for p in plain.parameters()]

    stage = one_stage(method)
    averager = GradientAverager(group, replicas=1, timeout=30, bucket_bytes=1)  # a bucket per parameter
    stage.grad_sync = averager
    stage.forward(0, x, y)
    averager.overlap()
    stage.backward(0)
    assert len(averager._in_flight) == len(expected)   # every parameter sent during the backward
    stage.sync_gradients()
    assert averager._in_flight == [] and not averager.overlapping
    for p, g in zip(stage.parameters(), expected):
        assert torch.equal(p.grad, g)


def test_without_overlap_everything_is_reduced_at_the_update(group):
    stage = one_stage("pipeoptim")
    averager = GradientAverager(group, replicas=1, timeout=30, bucket_bytes=1)
    stage.grad_sync = averager
    stage.forward(0, torch.randn(4, 8), torch.randint(0, 3, (4,)))
    stage.backward(0)                                  # not the last before an update
    assert averager._in_flight == []
    stage.update()
    assert stage.policy.version == 1
