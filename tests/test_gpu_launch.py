"""Issue 62, the CUDA path checked on the CPU. The launch rule: a process that sees one GPU takes it
whatever its LOCAL_RANK (how one-GPU-per-process schedulers launch: CUDA_VISIBLE_DEVICES per task),
one that sees the node's takes cuda:LOCAL_RANK, more processes than GPUs is refused naming the fix,
and NCCL is told the device (``device_id``); waits without a busy-poll; a tie's pairs warmed; the
trained model whole on one device; a backward's FSDP gather ordered after the shards' writes; global
clipping on the device. No GPU here: torch.cuda, the process group, FSDP's streams and the GPU
(the meta device) are stood in for."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pipeoptim

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


class TiedNet(nn.Module):
    """An embedding, a layer, and a head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.embed, self.mid, self.head = nn.Embedding(5, 3), nn.Linear(3, 3), nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.mid(self.embed(x)))


def test_the_trained_model_comes_whole_on_one_device_whatever_the_stages_placement(monkeypatch):
    """Issue 62: under torchrun on GPUs a process's copy of the model holds its own stage's layers on
    cuda:LOCAL_RANK (moved there to train, without a copy) and the others where the model was given:
    model() loaded the gathered weights into that copy and returned it split over two devices. It is
    now whole on the device asked for (default: where the model was given), a copy where the stages
    lie elsewhere, names and tie kept, the stage's layers left where they train. Here the meta
    device stands for the GPU, the gathered weights for the other rank's."""
    from pipeoptim import torchrun as torchrun_module
    from pipeoptim.torchrun import Torchrun

    torch.manual_seed(0)
    model, trained = TiedNet(), TiedNet()
    gathered = {k: v.clone() for k, v in trained.state_dict().items()}
    monkeypatch.setattr(torchrun_module, "gather_tensors", lambda own, comm, what: dict(gathered))
    model.mid.to("meta")  # this process's stage, on "its GPU"
    stage = SimpleNamespace(module=model.mid, copied=None)  # its own layers, not a split copy
    world = Torchrun(rank=1, world=2, device=torch.device("meta"), timeout=1.0)
    whole = world.gather_model(model, [stage], torch.device("cpu"))
    assert type(whole) is TiedNet and whole is not model
    assert [p.device.type for p in whole.parameters()] == ["cpu"] * 3
    assert whole.head.weight is whole.embed.weight  # one tensor under both names
    assert all(torch.equal(value, gathered[name]) for name, value in whole.state_dict().items())
    assert model.mid.weight.is_meta  # the stage trains on where it was
    # one process: the Pipeline's own copy where its stages train on the device asked for, else a copy
    pipe = pipeoptim.Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), method="1f1b-flush",
                              stages=2, loss_fn=nn.functional.cross_entropy,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert pipe.model() is pipe.model() and pipe.model().state_dict().keys() == pipe.model("meta").state_dict().keys()
    assert all(p.is_meta for p in pipe.model(device="meta").parameters())
    with pytest.raises(ValueError, match="device: .*give a device such as 'cpu' or 'cuda:0'"):
        pipe.model(device="nowhere")


def test_a_backward_s_gather_waits_for_the_version_written_into_the_shards(monkeypatch):
    """Issue 62: with shard_replicas an asynchronous method writes each pass's weight version into
    the live shards on the current stream (StageShards.hold), and FSDP2 gathers a backward's weights
    on its own copy-in and all-gather streams without waiting for the current stream (only a forward
    waits): the gather could read the shards before the write, or before the live values an earlier
    pass put back or the optimizer's step. Now, at every pass, an event recorded on the current
    stream after the writes is waited on by both of FSDP's streams (a torch that hides them: the
    host waits). No GPU here: the streams are stand-ins, which record the order; that the numbers
    then hold on CUDA only a GPU run confirms."""
    from pipeoptim.runtime import sharding

    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, event):
            log.append((self.name, "waits for", event))

    class Current:
        def record_event(self):
            log.append(("current", "records", live.tolist()))
            return "written"

        def synchronize(self):
            log.append(("current", "synchronized"))

    shards = sharding.StageShards(None, synchronous=False)
    live = torch.zeros(2)
    shards.module, shards._named, shards.device_type = nn.Linear(2, 1), {"w": nn.Parameter(live)}, "cuda"
    monkeypatch.setattr(sharding, "fsdp_gather_streams", lambda module: [Stream("copy-in"), Stream("all-gather")],
                        raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Current())
    restore = shards.hold({"w": torch.ones(2)})  # the pass's version, then the event, then the waits
    assert log == [("current", "records", [1.0, 1.0]), ("copy-in", "waits for", "written"),
                   ("all-gather", "waits for", "written")]
    restore()
    log.clear()
    shards.hold({})  # a backward on the live weights: ordered after the restore all the same
    assert log == [("current", "records", [0.0, 0.0]), ("copy-in", "waits for", "written"),
                   ("all-gather", "waits for", "written")]
    monkeypatch.setattr(sharding, "fsdp_gather_streams", lambda module: None)  # streams hidden by torch
    log.clear()
    shards.hold({})
    assert log == [("current", "synchronized")]
    shards.device_type = "cpu"  # the host runs every operation in order: nothing to wait for
    log.clear()
    shards.hold({"w": torch.ones(2)})()
    assert log == []


def test_global_clipping_is_one_all_reduce_on_the_device_and_reads_nothing_back(monkeypatch):
    """Issue 62: global clipping moved each stage's norm to the CPU and gathered Python objects over
    gloo at every update. Now each process fills its stages' rows of a float64 table of squared norms
    on its device, one all-reduce on the pipeline's own group sums the tables (each row has one
    writer: the sum is exact, so the ranks and one process read the same bits) and the coefficient
    stays on the device. The meta device stands for the GPU: a read to the host raises there."""
    from pipeoptim.runtime.distributed import PipeTransport
    from pipeoptim.runtime.local import Mailbox
    from pipeoptim.runtime.loss_scaling import UpdateAgreement

    def stage(index, norm, device):
        return SimpleNamespace(index=index, num_stages=2, device=torch.device(device), loss_scaling=None,
                               replica_of=None, grad_norm=lambda: torch.tensor(norm).to(device))

    reduced = []

    def all_reduce(tensor, group):  # the other rank's row: stage 1's norm 4.0
        reduced.append((tensor.dtype, tensor.device.type, group))
        tensor[1, 1] += 16.0

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    comm = SimpleNamespace(group="the pipeline's group", rank=0, timeout=1.0, check_open=lambda: None)
    own = [stage(0, 3.0, "meta")]
    agreement = UpdateAgreement(0.5, own)
    scale, skip = agreement.decide(PipeTransport(comm, own, None).agree(agreement.table(own)))
    assert reduced == [(torch.float64, "meta", "the pipeline's group")]
    assert scale.device.type == "meta" and not skip
    # the numbers, on the CPU: the processes' sum is one process's table, bit for bit
    own = [stage(0, 3.0, "cpu")]
    agreement = UpdateAgreement(0.5, own)
    spread, _ = agreement.decide(PipeTransport(comm, own, None).agree(agreement.table(own)))
    every = [stage(0, 3.0, "cpu"), stage(1, 4.0, "cpu")]
    alone = UpdateAgreement(0.5, every)
    local, _ = alone.decide(Mailbox().agree(alone.table(every)))
    assert spread.item() == local.item() == torch.tensor(0.5 / (5.0 + 1e-6), dtype=torch.float32).item()
