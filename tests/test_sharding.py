"""Each stage sharded over its replicas with FSDP2 (``shard_replicas``), 2 stages x 2 replicas on
4 processes: the same losses and weights as the replicated pipeline x data parallel run to 1e-6
relative for each weight policy and each setting that changes what a pass runs on, the synchronous
ones also as ``sequential`` training on the whole mini-batches; the combinations it refuses,
refused; each rank's state bytes halved, against the closed form, the layers it sharded a copy of
freed; a sharded checkpoint resumed in other layouts."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

import pipeoptim
from pipeoptim.methods import get_method
from conftest import has_image_data
from test_torchrun import HERE

SCRIPT = HERE / "torchrun_sharded.py"
#: one entry per weight policy (bidirectional: refused with sharded replicas,
#: tests/test_bidirectional.py), the synchronous schedules whose passes meet FSDP differently (one
#: chunk per process, a split backward, two chunks per process), the plain ones the state-bytes test
#: reads. Left out as guarding no path of their own: gpipe, interleaved, zb-h1, pipeoptim-2bw,
#: spectrain and pipeoptim+backward=predicted (the same policy and passes as an entry below, which
#: adds a setting), 1f1b-flush+clip=0.05 (global clipping: zb-h1+clip=0.05, gpt:1f1b-flush+clip=0.5),
#: drop:1f1b-flush (dropout's draws, the same in every schedule: drop:pipeoptim).
PLAIN = ["1f1b-flush", "zb-v", "async-naive", "pipedream", "pipedream-2bw", "xpipe", "pipeoptim"]
#: beyond them: dropout, a tied GPT, global and per-stage clipping, recomputation (for the
#: asynchronous methods a stage recomputes on a copy of the weights FSDP gathered for the forward),
#: the method options that change which version a pass runs on, the delay corrections
CASES = ["drop:pipeoptim", "gpt:1f1b-flush+clip=0.5", "gpt:pipeoptim", "gpt:pipedream", "zb-h1+clip=0.05",
         "pipeoptim+stageclip=0.05", "gpipe+recompute", "pipedream+recompute", "pipeoptim-2bw+recompute",
         "pipeoptim+backward=predicted+recompute",
         "pipedream+vertical_sync=1", "pipeoptim+delta=ema+ema_decay=0.9",
         "pipeoptim+lr_correction=delay+lr_correction_steps=4", "spectrain+sync_warmup=1"]
REFUSED = ["pipeoptim+muon"]
#: what else the job's 4 processes run (tests/torchrun_sharded.py): the resharded checkpoint
#: (below), the GPT-2 example sharded 2 x 2 (tests/test_examples.py) and the command line's
#: sharded run without --data-parallel (below)
SHARED = ["reshard", "gpt2-example", "padded", "cli"]  # cli last: it tears the job's process group down
TIED = ["gpt:1f1b-flush+clip=0.5", "gpt:pipeoptim", "gpt:pipedream"]
#: the command line's run, here and in the job (tests/torchrun_sharded.py's CLI_TRAIN: held equal)
CLI_TRAIN = ["train", "--task", "image", "--model", "mlp", "--method", "pipeoptim", "--stages", "2",
             "--limit", "256", "--epochs", "1", "--no-progress"]

def job_args(scratch) -> list:
    """tests/torchrun_sharded.py's arguments: every entry, 2 stages, 2 micro-batches, the folder of
    its files and the GPT-2 example's flags (tests/test_examples.py's TINY, sharded)."""
    from test_examples import TINY

    return [",".join(PLAIN + CASES + REFUSED + SHARED), 2, 2, scratch, *TINY, "--shard-replicas"]


def sharded_job(torchrun_4) -> dict:
    """{entry: rank 0's line} of tests/torchrun_sharded.py, run as ``sharded`` in the session's
    4-process job (tests/conftest.py's ``torchrun_4``: no start of 4 processes of its own; this
    module's tests and the example's sharded run read it), and ``"scratch"``: the folder of its files."""
    job = {row["entry"]: row for row in torchrun_4.rows("sharded")}
    job["scratch"] = torchrun_4.folder / "sharded"
    return job


@pytest.fixture(scope="module")
def job(torchrun_4):
    return sharded_job(torchrun_4)


def relative(a: dict, b: dict) -> float:
    """The largest difference of losses and of each weight tensor, relative to the tensor's size."""
    losses = max(abs(x - y) / abs(x) for x, y in zip(a["losses"], b["losses"]))
    weights = max(float(np.abs(np.subtract(a["weights"][k], b["weights"][k])).max()
                        / np.abs(a["weights"][k]).max()) for k in a["weights"])
    return max(losses, weights)


def test_padded_tokens_are_weighed_once_across_replicas(job):
    """GPT-2 as it comes on padded mini-batches, 2 stages x 2 replicas whose halves hold 13 and 2
    real tokens (tests/torchrun_sharded.py's ``padded``): replicated and sharded, the losses and
    weights of the step on each whole mini-batch in one process, and the evaluation the
    token-weighted mean of the trained model's loss."""
    from first_day import model, padded_batches, whole_batch_loop

    row = job["padded"]
    assert "error" not in row, row.get("error")
    data = padded_batches("gpt2")
    expected, trained = whole_batch_loop(model("gpt2"), data)
    want = {k: v.numpy() for k, v in trained.state_dict().items()}
    trained.eval()
    with torch.no_grad():
        items = [int(b["labels"][:, 1:].ne(-100).sum()) for b in data[:2]]
        evaluation = sum(float(trained(**b).loss) * n for b, n in zip(data[:2], items)) / sum(items)
    for kind in ("replicated", "sharded"):
        got = row[kind]
        assert got["losses"] == pytest.approx(expected, rel=1e-5), kind
        assert all(np.allclose(got["weights"][k], want[k], rtol=1e-5, atol=1e-4) for k in want), kind
        assert got["evaluation"] == pytest.approx(evaluation, rel=1e-5), kind


@pytest.mark.parametrize("entry", PLAIN + CASES)
def test_sharded_equals_replicated(job, entry):
    row = job[entry]
    assert "error" not in row, row.get("error")
    assert len(row["sharded"]["losses"]) == len(row["replicated"]["losses"]) == 8
    assert relative(row["replicated"], row["sharded"]) < 1e-6
    # each epoch's evaluation, run through the sharded stages; a function of the model (evaluate_model) too
    assert row["sharded"]["metrics"] == pytest.approx(row["replicated"]["metrics"], rel=1e-6)
    assert row["sharded"]["evaluated"] == pytest.approx(row["replicated"]["evaluated"], rel=1e-6)


@pytest.mark.parametrize("entry", [e for e in PLAIN + CASES  # (dropout draws per process: apart)
                                   if get_method(e.rpartition(":")[2].split("+")[0]).synchronous
                                   and not e.startswith("drop:")])
def test_a_sharded_synchronous_method_equals_sequential_training(job, entry):
    row = job[entry]
    assert relative(row["sequential"], row["sharded"]) < 1e-5  # a whole mini-batch's sums in another order


@pytest.mark.parametrize("entry", TIED)
def test_the_tied_gpt_keeps_its_tie_sharded(job, entry):
    weights = job[entry]["sharded"]["weights"]
    assert weights["head.weight"] == weights["embed.weight"]


@pytest.mark.parametrize("entry", ["gpt:pipeoptim", "gpt:pipedream"])
def test_a_weight_tied_across_stages_trains_with_replicas_as_with_one(job, entry):
    """An asynchronous method: the owner's values and the holders' gradients of each micro-batch
    travel within each replica; 2 replicas on half mini-batches train as 1 on the whole."""
    assert relative(job[entry]["local"], job[entry]["replicated"]) < 1e-5


@pytest.mark.parametrize("entry, says", [
    ("pipeoptim+muon", "torch.optim.Muon orthogonalizes each whole matrix"),
])
def test_what_cannot_be_exact_is_refused_with_the_reason(job, entry, says):
    assert says in job[entry]["error"]


def shard_bytes(shapes, replicas: int = 2, rank: int = 0) -> int:
    """fp32 bytes of rank ``rank``'s dim-0 chunk of each tensor (FSDP2's even split, the last
    chunks shorter)."""
    total = 0
    for shape in shapes:
        chunks = torch.empty(shape[0]).chunk(replicas)
        rows = len(chunks[rank]) if rank < len(chunks) else 0
        total += 4 * rows * math.prod(shape[1:])
    return total


@pytest.mark.parametrize("method", ["1f1b-flush", "pipedream", "pipeoptim"])
def test_each_rank_holds_its_shard_of_every_version(job, method):
    replicated, sharded = job[method]["replicated"]["state_memory"], job[method]["sharded"]["state_memory"]
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    pipe = pipeoptim.Pipeline(model, method=method, stages=2, loss_fn=nn.functional.cross_entropy,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    for k, stage in enumerate(pipe.stages):
        shapes = [tuple(p.shape) for p in stage.parameters()]
        assert replicated[k]["parameters"] == 4 * sum(math.prod(s) for s in shapes)
        assert sharded[k]["parameters"] == shard_bytes(shapes)
        for row in (replicated[k], sharded[k]):  # measured against parameters x design versions
            assert row["weights"] == row["weights_closed_form"]
        versions = replicated[k]["weights"] / replicated[k]["parameters"]
        assert sharded[k]["weights"] == versions * sharded[k]["parameters"]
        assert sharded[k]["optimizer"] < replicated[k]["optimizer"]  # AdamW's two moments, sharded
    # issue 62: the stage's own layers, which it shards a copy of, are released (storage freed),
    # so rank 0's copy of the model holds stage 1's weights only, where the replicated run's holds both
    # (its stage 0 trains on them); model() and the evaluations read the shards (the tests above)
    beside = {kind: job[method][kind]["model_bytes"] for kind in ("replicated", "sharded")}
    assert beside["sharded"] == beside["replicated"] - replicated[0]["parameters"]


def test_a_sharded_checkpoint_resumes_in_other_layouts(job, tmp_path):
    """Written at 2 stages x 2 replicas, sharded (the run stopped on every rank after 5 mini-batches,
    its newest checkpoint at 4), resumed at 4 stages x 1 replica (writing its own checkpoints in the
    background; both in the job of tests/torchrun_sharded.py) and in one process (here, from a copy
    of the stopped run): both continue the uninterrupted run's losses and reach its weights
    (1f1b-flush: the same sums, in other orders)."""
    from torchrun_reshard import train

    row = job["reshard"]
    assert "error" not in row, row.get("error")
    assert row["stopped"] == "stopped after 5 mini-batches"  # the 2 x 2 run did not finish
    assert row["latest_after_stop"].endswith("batch000004")
    with torch.random.fork_rng():  # (the runs seed torch: this process's generator is left as it was)
        whole = train(tmp_path / "whole", 2, shard=False)
        alone = train(job["scratch"] / "reshard" / "alone", 2, shard=False)
    for resumed in (row["resumed"], alone):
        assert len(resumed["losses"]) == 16
        assert relative(whole, resumed) < 1e-6
    assert row["latest_after_resume"] == "epoch0002-batch000000"


@pytest.mark.skipif(not has_image_data(), reason="needs Fashion-MNIST (make setup installs it)")
def test_the_command_line_runs_sharded_replicas_to_the_losses_of_one_process(job, tmp_path, capfd):
    """`pipeoptim train --runtime distributed --data-parallel 2 --shard-replicas` starts 2 x 2
    processes, each replica on its half of every mini-batch: the losses of the one-process run
    (both commands run here, as `pipeoptim` would run them: the launcher in this process); and
    under the user's own torchrun without --data-parallel, the replicas follow the world size."""
    from pipeoptim.cli import main

    losses = []
    for extra, out in ((["--runtime", "local"], "one"),
                       (["--runtime", "distributed", "--data-parallel", "2", "--shard-replicas"], "sharded")):
        assert main([*CLI_TRAIN, *extra, "--out", str(tmp_path / out)]) == 0, capfd.readouterr().err[-3000:]
        rows = [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        losses.append([r["loss"] for r in rows if r["type"] == "batch"])
    assert "starting 4 processes (one per stage of each of 2 replicas)" in capfd.readouterr().out
    assert len(losses[0]) == 4 and losses[1] == pytest.approx(losses[0], rel=1e-6)
    # in the user's own torchrun (the sharded job's 4 processes), without --data-parallel: the
    # replicas follow the world size (2 here), the same losses, and the run records no D of its
    # own, so that a job re-formed on other processes goes on with the replicas those hold
    row = job["cli"]
    assert "error" not in row, row.get("error")
    assert row["code"] == 0 and row["argv"][:len(CLI_TRAIN)] == CLI_TRAIN
    assert row["losses"] == pytest.approx(losses[0], rel=1e-6)
    assert row["config"]["data_parallel"] is None and row["config"]["shard_replicas"] is True


@pytest.mark.parametrize("kwargs, says", [
    ({"shard_replicas": True}, "shards each stage over its data-parallel replicas, which run as processes: "
                               "start N x D processes with torchrun"),
    ({"shard_replicas": True, "data_parallel": 2}, "data_parallel=2 needs torchrun with N x 2 processes"),
    ({"shard_replicas": "yes", "world": None}, "shard_replicas must be True or False"),
])
def test_sharding_without_replicas_to_shard_over_is_refused_when_the_pipeline_is_built(kwargs, says):
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    with pytest.raises(ValueError, match=says):
        pipeoptim.Pipeline(model, method="pipeoptim", stages=2, loss_fn=nn.functional.cross_entropy,
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.1), **kwargs)
