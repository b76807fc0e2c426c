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

from pipeoptim.checks import check_method_options
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


def one_stage(method: str, sync=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    meth = get_method(method)
    stage = build_stages(model, [5], meth, check_method_options(meth, {}), lambda p: torch.optim.SGD(p, lr=0.1),
                         nn.functional.cross_entropy, replica_sync=sync)[0]
    stage.policy.begin_epoch([], [])
    return stage


@pytest.mark.parametrize("method", ["gpipe", "pipeoptim"])  # the module's own parameters; aliases
def test_buckets_leave_during_the_backward_and_the_gradients_are_the_plain_ones(group, method):
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    plain = one_stage(method)
    plain.forward(0, x, y)
    plain.backward(0)
    expected = [p.grad.clone() for p in plain.parameters()]

    averager = GradientAverager(group, replicas=1, timeout=30, bucket_bytes=1)  # a bucket per parameter
    stage = one_stage(method, averager)
    stage.forward(0, x, y)
    averager.overlap()
    stage.backward(0)
    assert len(averager._in_flight) == len(expected)   # every parameter sent during the backward
    stage.sync_gradients()
    assert averager._in_flight == [] and not averager.overlapping
    for p, g in zip(stage.parameters(), expected):
        assert torch.equal(p.grad, g)


def test_without_overlap_everything_is_reduced_at_the_update(group):
    averager = GradientAverager(group, replicas=1, timeout=30, bucket_bytes=1)
    stage = one_stage("pipeoptim", averager)
    stage.forward(0, torch.randn(4, 8), torch.randint(0, 3, (4,)))
    stage.backward(0)                                  # not the last before an update
    assert averager._in_flight == []
    stage.update()
    assert stage.policy.version == 1


def test_a_weight_group_announced_at_once_goes_out_in_buckets_of_the_given_size(group):
    """``ready_all``: what a split backward's weight half announces per weight group (issue 37,
    item 3); buckets of at least ``bucket_bytes`` leave as they fill, the rest at the update."""
    params = [torch.ones(n, requires_grad=True) for n in (4, 4, 8, 2)]  # float32: 16, 16, 32, 8 bytes
    for p, value in zip(params, (1.0, 2.0, 3.0, 4.0)):
        p.grad = torch.full_like(p, value)
    averager = GradientAverager(group, replicas=1, timeout=30, bucket_bytes=30)
    averager.ready_all(params[:2])                      # not overlapping: nothing leaves
    assert averager._in_flight == [] and averager._bucket == []
    averager.overlap()
    averager.ready_all(params)                          # 16 + 16 >= 30, then 32 >= 30, then 8 left
    assert [len(bucket) for _, _, bucket in averager._in_flight] == [2, 1]
    assert averager._bucket == [params[3]] and averager._bucket_size == 8
    averager(params)
    assert averager._in_flight == [] and averager._bucket == [] and averager._bucket_size == 0
    for p, value in zip(params, (1.0, 2.0, 3.0, 4.0)):
        assert torch.equal(p.grad, torch.full_like(p, value))


def test_a_split_backward_overlapped_before_its_weight_half_gives_the_plain_gradients(group):
    """The executor calls overlap() before the last W before an update; what the weight half
    does not announce is reduced at the update, and the gradients are the plain ones."""
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    plain = one_stage("zb-h1")
    plain.forward(0, x, y)
    plain.backward(0)
    expected = [p.grad.clone() for p in plain.parameters()]
    averager = GradientAverager(group, replicas=1, timeout=30, bucket_bytes=1)
    stage = one_stage("zb-h1", averager)
    stage.forward(0, x, y)
    stage.backward_input(0)
    averager.overlap()
    stage.backward_weight(0)
    stage.sync_gradients()
    assert averager._in_flight == [] and not averager.overlapping and averager._sent == {}
    for p, g in zip(stage.parameters(), expected):
        assert torch.equal(p.grad, g)


def test_a_replica_sum_launched_when_its_gradient_is_final_is_not_sent_again(group):
    """A bidirectional run's replica sum (``mean=False``) starts after the piece's last backward
    of the window: every gradient announced at once, the bucket smaller than ``bucket_bytes``
    sent by ``launch_bucketed``; the update waits for it and sends nothing more."""
    stage = one_stage("gpipe")
    stage.forward(0, torch.randn(4, 8), torch.randint(0, 3, (4,)))
    stage.backward(0)
    expected = [p.grad.clone() for p in stage.parameters()]
    summer = GradientAverager(group, replicas=2, timeout=30, mean=False)  # the default 4 MiB buckets
    summer.overlap()
    summer.ready_all(list(stage.parameters()))
    assert summer._in_flight == []                      # 0.6 KiB: still bucketed
    summer.launch_bucketed()
    assert len(summer._in_flight) == 1                  # one all-reduce, in flight before the update
    summer(stage.parameters())
    assert summer._in_flight == [] and not summer.overlapping
    for p, g in zip(stage.parameters(), expected):     # a group of one: the sum is the gradient, not halved
        assert torch.equal(p.grad, g)


def test_the_replicas_of_a_piece_count_its_window_done_once():
    from pipeoptim.runtime.replicas import ReplicaUpdates
    from pipeoptim.schedules import build_schedule

    updates = ReplicaUpdates([None] * 4)
    updates.use(build_schedule("bidirectional", 2, 4, 2))  # stage 0: micro-batches 0, 1 of window 0; 4, 5 of 1
    updates.backward_done(0, 0)
    assert not updates.window_done(0, 0)
    updates.backward_done(0, 1)
    assert updates.window_done(0, 1) and not updates.window_done(0, 1)  # forgotten once said
    updates.backward_done(0, 4)
    assert not updates.window_done(0, 4)
