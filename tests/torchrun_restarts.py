"""Runs that torchrun's agent restarts by itself, for tests/test_restarts.py: under ``torchrun
--max-restarts K`` a worker SIGKILLs itself mid-epoch, the agent stops the others and starts every
worker again with the same command line, and each run, started with ``resume=True``, continues from
its newest whole checkpoint (or starts from the beginning where it has none).

    script RUN ENTRY [ENTRY ...]

Each ENTRY ``NAME:METHOD:FLAGS:KILL`` is one run of 2 stages (the replicas: whatever the job's size
makes, each training on its share of every whole mini-batch), in RUN/NAME, one after the other
(a run already finished resumes at its end and does nothing). FLAGS, any of ``s`` (each stage
sharded over its replicas, ``shard_replicas``), ``b`` (checkpoints written in the background,
``async_checkpoint``), ``d`` (dropout), ``w`` (each rank sleeps 0.25 s per loss: a run slow enough
for benchmarks/chaos.py to kill at a random moment), ``h`` (the first epoch only: a job that ends
there, its run continued by a later job without ``h``); ``-`` for none. KILL ``R/RANK/AFTER``: in the job's start
R (``TORCHELASTIC_RESTART_COUNT``), rank RANK kills itself with SIGKILL once it has seen AFTER
losses; ``-``: never. Rank 0 writes RUN/NAME/result.json (losses, weights) at each run's end.

What the imports leave (torch's, and dynamo's, checkpoints' and FSDP2's, which the first optimizer,
checkpoint and sharded stage would import) is collected and frozen before the first run: each run's
close() collects garbage, which then walks only what was made since (as tests/torchrun_sharded.py).
"""
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401 (see the docstring)
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
from torch import nn

import pipeoptim

#: 2 epochs of 8 mini-batches of 16, a checkpoint every 2 mini-batches
BATCHES, EPOCHS, EVERY = 8, 2, 2


def train(folder: Path, method: str, flags: str, kill: str) -> dict:
    """One entry's run (see the module docstring): its losses and the whole model's weights."""
    restart, victim, after = (int(x) for x in kill.split("/")) if kill != "-" else (-1, -1, 0)
    seen = [0]

    def on_batch(index, loss):
        seen[0] += 1
        if (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == restart and pipe.rank == victim
                and seen[0] == after):
            os.kill(os.getpid(), signal.SIGKILL)
        if "w" in flags:
            time.sleep(0.25)

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(BATCHES)]
    torch.manual_seed(0)
    drop = [nn.Dropout(0.1)] if "d" in flags else []
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), *drop, nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16),
                          nn.Tanh(), nn.Linear(16, 3))
    pipe = pipeoptim.Pipeline(model, method=method, stages=2, loss_fn=nn.functional.cross_entropy, micro_batches=2,
                              shard_replicas="s" in flags, timeout=60,
                              optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
                              lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5))
    try:
        d, replicas = pipe.data_parallel_rank, pipe.data_parallel_size
        own = [(x.chunk(replicas)[d], y.chunk(replicas)[d]) for x, y in data]
        result = pipe.fit(own, epochs=1 if "h" in flags else EPOCHS, checkpoint_dir=folder / "checkpoints", checkpoint_every=EVERY,
                          resume=True, on_batch=on_batch, async_checkpoint="b" in flags)
        return {"losses": result.losses, "weights": {k: v.tolist() for k, v in pipe.model().state_dict().items()},
                "replicas": replicas, "rank": pipe.rank}
    finally:
        pipe.close()


if __name__ == "__main__":
    gc.collect()
    gc.freeze()
    run = Path(sys.argv[1])
    for entry in sys.argv[2:]:
        name, method, flags, kill = entry.split(":")
        done = train(run / name, method, flags, kill)
        if done["rank"] == 0:
            (run / name / "result.json").write_text(json.dumps(done))
