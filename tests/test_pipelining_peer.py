"""`gpipe` and `1f1b-flush` against the peer: torch.distributed.pipelining's ScheduleGPipe and
Schedule1F1B (docs/architecture.md, "Invariants and where they are tested", invariant 2).

Both run in the same two processes (gloo, one thread each, a file store in tmp_path) on the
same seeded MLP halves and data: the one 2-process spawn of this file and
tests/test_leaner_messages.py (its ``two_process_job``; this file's runs come after that file's,
before tests/test_distributed.py's hung peer). The peer uses its manual ``PipelineStage`` API: stage 0 passes
the mini-batch, the last stage the target, and the optimizer steps after each ``step()``. Its
loss reduction is matched to ours: our mini-batch loss is the sum over micro-batches of
``micro_loss * micro_size / batch_size``, so the peer's ``loss_fn`` returns that term and
``scale_grads=False`` keeps it from dividing the gradients by the number of micro-batches
again. The per-mini-batch loss is the sum of the peer's per-micro-batch losses.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeoptim
from conftest import batches, mlp
from pipeoptim.partition import split

pipelining = pytest.importorskip("torch.distributed.pipelining")

LOSS = nn.functional.cross_entropy
CASES = [("gpipe", "ScheduleGPipe", 2), ("gpipe", "ScheduleGPipe", 4),
         ("1f1b-flush", "Schedule1F1B", 2), ("1f1b-flush", "Schedule1F1B", 4)]
PARTITION = [4, 4]


def sgdm(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _peer(rank: int, schedule_name: str, micro: int):
    """One run of the peer on this rank; the per-mini-batch losses on the last stage."""
    from torch.distributed.pipelining import PipelineStage

    model, data = mlp(), batches(5)
    part = split(model, PARTITION)[rank]
    batch = data[0][1].shape[0]
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    schedule = getattr(pipelining, schedule_name)(
        stage, n_microbatches=micro, scale_grads=False,
        loss_fn=lambda output, target: LOSS(output, target) * (target.shape[0] / batch))
    optimizer = sgdm(part.parameters())
    losses = []
    for x, y in data:
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x)
        else:
            micro_losses: list = []
            schedule.step(target=y, losses=micro_losses)
            losses.append(sum(float(v.detach()) for v in micro_losses))
        optimizer.step()
    return losses, {k: v.clone() for k, v in part.state_dict().items()}


def peer_runs(rank: int) -> dict:
    """This process's runs of every case, the peer's and ours (in a 2-process job)."""
    results = {}
    for method, schedule_name, micro in CASES:
        peer_losses, peer_state = _peer(rank, schedule_name, micro)
        with pipeoptim.Pipeline(mlp(), method=method, partition=PARTITION, micro_batches=micro, optimizer=sgdm,
                                loss_fn=LOSS, timeout=60) as pipe:
            ours = pipe.fit(batches(5))
            model = pipe.model()
        mine = {k: v.clone() for k, v in split(model, PARTITION)[rank].state_dict().items()}
        results[(method, micro)] = {"peer": peer_losses, "ours": ours.losses,
                                    "peer_state": peer_state, "our_state": mine}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from test_leaner_messages import two_process_job

    return {"ranks": [rank["peer"] for rank in two_process_job(tmp_path_factory)["ranks"]]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method,schedule_name,micro", CASES)
def test_same_losses_and_weights_as_torch_pipelining(runs, method, schedule_name, micro):
    last = runs["ranks"][1][(method, micro)]
    assert len(last["peer"]) == 5
    assert last["ours"] == pytest.approx(last["peer"], rel=1e-12)
    # and both equal the local runtime
    local = pipeoptim.train(mlp(), batches(5), method=method, partition=PARTITION, micro_batches=micro,
                            optimizer=sgdm, loss_fn=LOSS)
    assert last["ours"] == pytest.approx(local.losses, rel=1e-12)
    for rank in (0, 1):  # each stage's trained weights
        r = runs["ranks"][rank][(method, micro)]
        for name, value in r["peer_state"].items():
            torch.testing.assert_close(r["our_state"][name], value, rtol=1e-10, atol=1e-12)
