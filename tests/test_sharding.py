"""Each stage sharded over its replicas with FSDP2 (``shard_replicas``), 2 stages x 2 replicas on
4 processes: the same losses and weights as the replicated pipeline x data parallel run to 1e-6
relative for every method, the synchronous ones also as ``sequential`` training on the whole
mini-batches; the combinations it refuses, refused; each rank's state bytes halved, against the
closed form."""
from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch
from torch import nn

import pipeoptim
from pipeoptim.methods import get_method, method_names
from conftest import has_image_data
from test_torchrun import HERE, run

SCRIPT = HERE / "torchrun_sharded.py"
# (bidirectional: refused with sharded replicas, tests/test_bidirectional.py)
PIPELINED = [m for m in method_names() if m != "sequential" and not get_method(m).mirrored]
#: beyond each method's plain run: a tied GPT, global and per-stage clipping, recomputation (for
#: the asynchronous methods a stage recomputes on a copy of the weights FSDP gathered for the
#: forward), the method options that change which version a pass runs on, the delay corrections
CASES = ["drop:pipeoptim", "drop:1f1b-flush", "gpt:1f1b-flush", "gpt:pipeoptim", "gpt:pipedream", "gpt:gpipe+clip=0.5", "1f1b-flush+clip=0.05", "zb-h1+clip=0.05",
         "pipeoptim+stageclip=0.05", "gpipe+recompute", "pipedream+recompute", "pipeoptim-2bw+recompute",
         "pipeoptim+backward=predicted+recompute",
         "pipedream+vertical_sync=1", "pipeoptim+backward=predicted", "pipeoptim+delta=ema+ema_decay=0.9",
         "pipeoptim+lr_correction=delay+lr_correction_steps=4", "spectrain+sync_warmup=1"]
REFUSED = ["pipeoptim+muon"]


@pytest.fixture(scope="module")
def job():
    entries = ",".join(PIPELINED + CASES + REFUSED)
    out = run([SCRIPT, entries, 2, 2], nproc=4, timeout=420)
    return {r["entry"]: r for r in map(json.loads, out.strip().splitlines())}


def relative(a: dict, b: dict) -> float:
    """The largest difference of losses and of each weight tensor, relative to the tensor's size."""
    losses = max(abs(x - y) / abs(x) for x, y in zip(a["losses"], b["losses"]))
    weights = max(float(np.abs(np.subtract(a["weights"][k], b["weights"][k])).max()
                        / np.abs(a["weights"][k]).max()) for k in a["weights"])
    return max(losses, weights)


@pytest.mark.parametrize("entry", PIPELINED + CASES)
def test_sharded_equals_replicated(job, entry):
    row = job[entry]
    assert "error" not in row, row.get("error")
    assert len(row["sharded"]["losses"]) == len(row["replicated"]["losses"]) == 8
    assert relative(row["replicated"], row["sharded"]) < 1e-6
    # each epoch's evaluation, run through the sharded stages
    assert row["sharded"]["metrics"] == pytest.approx(row["replicated"]["metrics"], rel=1e-6)


@pytest.mark.parametrize("entry", [e for e in PIPELINED + CASES  # (dropout draws per process: apart)
                                   if get_method(e.rpartition(":")[2].split("+")[0]).synchronous
                                   and not e.startswith("drop:")])
def test_a_sharded_synchronous_method_equals_sequential_training(job, entry):
    row = job[entry]
    assert relative(row["sequential"], row["sharded"]) < 1e-5  # a whole mini-batch's sums in another order


@pytest.mark.parametrize("entry", ["gpt:1f1b-flush", "gpt:pipeoptim", "gpt:pipedream"])
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


RESHARD = HERE / "torchrun_reshard.py"


def test_a_sharded_checkpoint_resumes_in_other_layouts(tmp_path):
    """Written at 2 stages x 2 replicas, sharded (the run killed after 5 mini-batches, its newest
    checkpoint at 4), resumed at 4 stages x 1 replica (writing its own checkpoints in the
    background) and in one process: both continue the uninterrupted run's losses and reach its
    weights (1f1b-flush: the same sums, in other orders)."""
    import shutil
    import subprocess

    from test_torchrun import _env

    run([RESHARD, tmp_path / "whole", 2, 0, 0])
    whole = json.loads((tmp_path / "whole" / "result.json").read_text())
    cut = tmp_path / "cut"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(RESHARD), str(cut), "2", "1", "5"], capture_output=True, text=True, env=_env(),
                          timeout=240)
    assert done.returncode != 0 and not (cut / "result.json").exists()
    assert json.loads((cut / "checkpoints" / "latest.json").read_text())["checkpoint"].endswith("batch000004")
    shutil.copytree(cut, tmp_path / "alone")
    run([RESHARD, cut, 4, 0, 0, 1], nproc=4)            # 4 stages x 1 replica, checkpoints in the background
    run([RESHARD, tmp_path / "alone", 2, 0, 0])          # one process
    for folder in (cut, tmp_path / "alone"):
        resumed = json.loads((folder / "result.json").read_text())
        assert len(resumed["losses"]) == 16
        assert relative(whole, resumed) < 1e-6
    assert json.loads((cut / "checkpoints" / "latest.json").read_text())["checkpoint"] == "epoch0002-batch000000"


@pytest.mark.skipif(not has_image_data(), reason="needs Fashion-MNIST (make setup installs it)")
def test_the_command_line_runs_sharded_replicas_to_the_losses_of_one_process(tmp_path):
    """`pipeoptim train --runtime distributed --data-parallel 2 --shard-replicas` starts 2 x 2
    processes, each replica on its half of every mini-batch: the losses of the one-process run."""
    import subprocess

    from test_torchrun import _env

    common = ["-m", "pipeoptim", "train", "--task", "image", "--model", "mlp", "--method", "pipeoptim",
              "--stages", "2", "--limit", "512", "--epochs", "1", "--no-progress"]
    losses = []
    for extra, out in ((["--runtime", "local"], "one"),
                       (["--runtime", "distributed", "--data-parallel", "2", "--shard-replicas"], "sharded")):
        done = subprocess.run([sys.executable, *common, *extra, "--out", str(tmp_path / out)], env=_env(),
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        rows = [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        losses.append([r["loss"] for r in rows if r["type"] == "batch"])
    assert "starting 4 processes (one per stage of each of 2 replicas)" in done.stdout
    assert len(losses[0]) == 8 and losses[1] == pytest.approx(losses[0], rel=1e-6)


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
