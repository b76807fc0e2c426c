"""Issue 37, item 3: leaner messages. A gloo pipeline's links are groups of their own, one per
direction (one gloo socket thread each, issue 50 item 9), and a link's receive buffers are
reused across messages of one shape once nothing else holds them (``link.ReceiveBuffers``),
without changing a number: the losses and weights of a 2-process run equal, to the bit, those
with every message in a new buffer and those of one process.

The two processes are the one 2-process spawn of this file, tests/test_pipelining_peer.py and
tests/test_distributed.py's hung peer (:func:`two_process_job`: a spawn's start, two processes
importing torch, costs more CPU than their runs): this file's runs first, with the pool's setting
put back after them, then the peer's, then the hung run (rank 1 asleep until killed)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pipeoptim
from conftest import batches, mlp
from pipeoptim.compat import HAS_STORAGE_USE_COUNT
from pipeoptim.runtime.link import ReceiveBuffers
from pipeoptim.runtime.control import init_process_group
from test_distributed import hung_peer, settle, spawn

LOSS = nn.functional.cross_entropy
#: (method, micro-batches): one stage per process, a split backward, and two chunks per process
CASES = [("gpipe", 4), ("1f1b-flush", 4), ("zb-h1", 4), ("interleaved", 4), ("zb-v", 4), ("pipeoptim", None)]

needs_use_count = pytest.mark.skipif(not HAS_STORAGE_USE_COUNT, reason="this torch has no storage use count")


def sgdm(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


# ---- the pool on its own --------------------------------------------------------------------

@needs_use_count
def test_a_buffer_is_reused_only_once_nothing_else_holds_it():
    pool = ReceiveBuffers(torch.device("cpu"))
    first = pool.take(torch.float32, (4, 3))
    address = first.data_ptr()
    second = pool.take(torch.float32, (4, 3))           # the first is still held: a new one
    assert second.data_ptr() != address and (pool.made, pool.reused) == (2, 0)
    del first
    again = pool.take(torch.float32, (4, 3))
    assert again.data_ptr() == address and (pool.made, pool.reused) == (2, 1)
    view = again[1:]                                     # a view holds the memory too
    del again
    assert pool.take(torch.float32, (4, 3)).data_ptr() not in (address, second.data_ptr())
    del view
    assert pool.take(torch.float32, (4, 3)).data_ptr() == address


@needs_use_count
def test_what_autograd_saved_for_a_backward_is_not_overwritten():
    pool = ReceiveBuffers(torch.device("cpu"))
    weight = torch.randn(3, 2, requires_grad=True)
    received = pool.take(torch.float32, (4, 3)).copy_(torch.randn(4, 3))
    address = received.data_ptr()
    leaf = received.detach().requires_grad_(True)        # what a stage makes of its input
    loss = (leaf @ weight).sum()                         # the matmul saves the input for the weight's grad
    del received, leaf
    assert pool.take(torch.float32, (4, 3)).data_ptr() != address
    loss.backward()                                      # the graph goes with its backward
    del loss
    assert pool.take(torch.float32, (4, 3)).data_ptr() == address
    # an integer input crosses as it is (no leaf made): an embedding saves that very tensor
    pool, embed = ReceiveBuffers(torch.device("cpu")), nn.Embedding(3, 2)
    indices = pool.take(torch.int64, (5,)).zero_()
    address = indices.data_ptr()
    out = embed(indices).sum()
    del indices
    assert pool.take(torch.int64, (5,)).data_ptr() != address
    del out
    assert pool.take(torch.int64, (5,)).data_ptr() == address


@needs_use_count
def test_the_pool_keeps_few_shapes_and_few_buffers_per_shape(monkeypatch):
    monkeypatch.setattr(ReceiveBuffers, "shapes", 2)
    monkeypatch.setattr(ReceiveBuffers, "per_shape", 1)
    pool = ReceiveBuffers(torch.device("cpu"))
    for n in (1, 2, 3):
        pool.take(torch.float32, (n,))
    assert [shape for _, shape in pool._kept] == [(2,), (3,)]  # the least recently used went
    held = pool.take(torch.float32, (3,))                # kept, free: reused
    extra = pool.take(torch.float32, (3,))               # the one kept is held: a new one, not kept
    assert pool.reused == 1 and len(pool._kept[(torch.float32, (3,))]) == 1 and extra is not held


# ---- two processes --------------------------------------------------------------------------

def gloo_socket_threads() -> int:
    """This process's gloo socket threads (one per gloo process group)."""
    names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    return names.count("gloo_tcp_loop")


def lean_runs() -> dict:
    """This process's runs of every case with the pool on (``ReceiveBuffers.per_shape`` 16) and off
    (0, every message in a new buffer); the pool's setting is put back afterwards."""
    results: dict = {"threads_before": gloo_socket_threads()}
    kept = ReceiveBuffers.per_shape
    for reuse in (True, False):
        ReceiveBuffers.per_shape = 16 if reuse else 0
        for method, micro in CASES:
            with pipeoptim.Pipeline(mlp(), method=method, stages=2, micro_batches=micro, optimizer=sgdm,
                                    loss_fn=LOSS, timeout=60) as pipe:
                fit = pipe.fit(batches(6))
                threads = gloo_socket_threads()
                stats = pipe.world.comm_stats()
                weights = {k: v.clone() for k, v in pipe.model().state_dict().items()}
            results[(method, reuse)] = {"losses": fit.losses, "weights": weights, "threads": threads,
                                        "made": sum(s.get("buffers_made", 0) for s in stats.values()),
                                        "reused": sum(s.get("buffers_reused", 0) for s in stats.values()),
                                        "links": len(stats)}
    ReceiveBuffers.per_shape = kept
    return results


def _worker(rank: int, world: int, init: str, out: str) -> None:
    try:
        from test_pipelining_peer import peer_runs
    except pytest.skip.Exception:  # no torch.distributed.pipelining: that file is skipped
        peer_runs = None
    init_process_group(init_method=init, rank=rank, world_size=world, timeout=60)
    settle()  # each Pipeline's close() collects garbage: only what was made since
    results = {"lean": lean_runs(), "peer": peer_runs(rank) if peer_runs is not None else None}
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    hung_peer(rank, out)  # ends the process (rank 0) or sleeps until killed (rank 1)


_JOB: Dict[str, Any] = {}


def two_process_job(tmp_path_factory) -> Dict[str, Any]:
    """The one 2-process spawn (gloo, a file store), run once for the session: ``ranks``: per rank,
    {"lean": this file's runs, "peer": tests/test_pipelining_peer.py's}; ``hang``: the hung run's
    stage 0 outcome and whether stage 1 was still asleep when stage 0 had ended."""
    if not _JOB:
        tmp = tmp_path_factory.mktemp("two-processes")
        asleep = spawn(_worker, 2, tmp, deadline=300.0, asleep=[1])
        _JOB["ranks"] = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]
        _JOB["hang"] = {"stage 0": json.loads((tmp / "hang0.json").read_text()), "stage 1 asleep": asleep[1]}
    return _JOB


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return [rank["lean"] for rank in two_process_job(tmp_path_factory)["ranks"]]


@pytest.mark.timeout(360)
@needs_use_count
@pytest.mark.parametrize("method,micro", CASES)
def test_reused_buffers_change_no_bit(runs, method, micro):
    local = pipeoptim.train(mlp(), batches(6), method=method, stages=2, micro_batches=micro, optimizer=sgdm,
                            loss_fn=LOSS)
    for r, ranks in enumerate(runs):
        reused, fresh = ranks[(method, True)], ranks[(method, False)]
        assert reused["losses"] == fresh["losses"] == local.losses, (method, r)
        for name, value in local.model.state_dict().items():
            assert torch.equal(reused["weights"][name], value) and torch.equal(fresh["weights"][name], value)
        assert fresh["reused"] == 0 and fresh["made"] > 0
        # 6 mini-batches, at most a few buffers per link in flight, the rest received into old ones
        assert reused["reused"] > 0 and reused["made"] < fresh["made"] / 2, (method, r, reused, fresh)


@pytest.mark.timeout(360)
def test_a_gloo_pipeline_runs_a_socket_thread_per_link_and_one_for_its_control(runs):
    """Two chunks per process (4 links each way under zb-v and interleaved): the Pipeline adds
    one gloo socket thread per link (each direction its own group) and one for its control group."""
    for r, ranks in enumerate(runs):
        for method, _ in CASES:
            run = ranks[(method, True)]
            assert run["threads"] == ranks["threads_before"] + 1 + run["links"], (method, r)
        assert ranks[("zb-v", True)]["links"] == ranks[("interleaved", True)]["links"] - 2 == 4
