"""Issue 62, the launch rule: a process that sees one GPU takes it whatever its LOCAL_RANK (how
one-GPU-per-process schedulers launch: CUDA_VISIBLE_DEVICES per task), one that sees the node's
takes cuda:LOCAL_RANK, more processes than GPUs is refused naming the fix, and NCCL is told the
device (``device_id``). No GPU here: torch.cuda and the process group are stood in for."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeoptim.runtime.control import init_process_group, local_gpu


def test_a_process_that_sees_one_gpu_takes_it_whatever_its_local_rank():
    assert local_gpu(3, 1) == torch.device("cuda", 0)
    assert local_gpu(0, 1) == torch.device("cuda", 0)
    assert local_gpu(1, 4) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"local rank 4 has no GPU of its own \(4 visible.*--nproc-per-node 4"):
        local_gpu(4, 4)
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        local_gpu(0, 0)


@pytest.mark.parametrize("visible, local_rank, expected", [(1, 5, 0), (8, 5, 5)])
def test_nccl_is_told_the_processs_device(monkeypatch, visible, local_rank, expected):
    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen.setdefault("current", device))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    device = init_process_group(device="cuda", init_method="tcp://127.0.0.1:29999", rank=local_rank, world_size=8,
                                threads=None)
    assert device == torch.device("cuda", expected)
    assert (seen["backend"], seen["device_id"], seen["current"]) == ("nccl", device, device)


def test_the_cpu_group_is_told_no_device(monkeypatch):
    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    assert init_process_group(device="cpu", init_method="tcp://127.0.0.1:29999", rank=0, world_size=1,
                              threads=None) == torch.device("cpu")
    assert seen["backend"] == "gloo" and "device_id" not in seen


class Work:
    """A stand-in for a process group's work handle: records how it was waited on."""

    def __init__(self):
        self.waits = []

    def wait(self, **kwargs):
        self.waits.append(kwargs)
        return True


def test_a_gpu_wait_is_a_stream_dependency_not_a_timed_busy_poll():
    """Issue 62: NCCL turns a wait with a timeout into a CPU busy-poll; the links and the replicas'
    gradient reduction wait on a GPU without one (the group's timeout still ends a hung operation),
    on the CPU with the timeout gloo honours."""
    import datetime

    from pipeoptim.runtime.link import Link
    from pipeoptim.runtime.wire import wait_for

    timeout = datetime.timedelta(seconds=7)
    gpu, cpu = Work(), Work()
    wait_for(gpu, timeout, torch.device("cuda", 0))
    wait_for(cpu, timeout, torch.device("cpu"))
    assert gpu.waits == [{}] and cpu.waits == [{"timeout": timeout}]
    # a link waits through it, on its own device
    for device, expected in ((torch.device("cuda", 1), {}), (torch.device("cpu"), {"timeout": timeout})):
        link, work = Link("activation", 1, None, 0, device, 7.0, 1), Work()
        link.wait(work)
        assert work.waits == [expected]


def test_a_tie_s_pair_groups_are_warmed_on_a_gpu_before_the_first_step(monkeypatch):
    """Issue 62: under NCCL the first point-to-point use of a group creates its communicator and
    waits for both ends; the asynchronous methods' per-tie pairs (owner <-> each other holder, a
    group for the values out and one for the gradients back) were first used inside the owner's
    forward of micro-batch 0, while a holder waited for that micro-batch's activation: a hang.
    They are now warmed when made, each in its messages' direction, every rank in the groups'
    order; on the CPU (gloo connects at creation) nothing is sent. Three ranks are simulated: the
    tie's holders are stages 0 (owner), 2 and 3."""
    from pipeoptim.runtime import tied as tied_module
    from pipeoptim.runtime.tied import Tie, connect_exchanges

    made = []
    sent = []

    def new_group(ranks):
        made.append(tuple(ranks))
        return f"group{len(made) - 1}"

    class Done:
        def wait(self):
            return True

    monkeypatch.setattr(dist, "isend", lambda t, dst, group: sent.append(("send", dst, group)) or Done())
    monkeypatch.setattr(dist, "irecv", lambda t, src, group: sent.append(("recv", src, group)) or Done())
    real_zeros = torch.zeros
    monkeypatch.setattr(tied_module.torch, "zeros", lambda *shape, device=None, **kw: real_zeros(*shape, **kw))
    monkeypatch.setattr(tied_module.torch.cuda, "synchronize", lambda device=None: None)
    gpu = torch.device("cuda", 0)
    by_rank = {}
    for rank in (0, 2, 3, 1):
        made.clear(), sent.clear()
        ties = [Tie(holders=[0, 2, 3], param=torch.nn.Parameter(torch.zeros(4)) if rank != 1 else None, name="wte")]
        connect_exchanges(ties, rank, lambda k: k, new_group, gpu)
        assert made == [(0, 2), (0, 2), (0, 3), (0, 3)]  # every rank makes every group, in order
        by_rank[rank] = list(sent)
    # values out on the first group of a pair, gradients back on the second; the owner in order
    assert by_rank[0] == [("send", 2, "group0"), ("recv", 2, "group1"), ("send", 3, "group2"), ("recv", 3, "group3")]
    assert by_rank[2] == [("recv", 0, "group0"), ("send", 0, "group1")]
    assert by_rank[3] == [("recv", 0, "group2"), ("send", 0, "group3")]
    assert by_rank[1] == []  # not a holder
    # the CPU: nothing sent
    sent.clear()
    connect_exchanges([Tie(holders=[0, 2], param=torch.nn.Parameter(torch.zeros(4)), name="wte")], 0, lambda k: k,
                      new_group)
    assert sent == []
