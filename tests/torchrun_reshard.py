"""A 1f1b-flush run with a checkpoint every 2 mini-batches that resumes from the newest one in RUN,
in whatever layout it is started: one process, or under torchrun N stages x D replicas, sharded
over the replicas or not. Each replica trains on its shard of every mini-batch, so every layout
trains on the same whole mini-batches.

:func:`train` is called by tests/test_sharding.py in its own process (one process) and by
tests/torchrun_sharded.py's ``reshard`` entry inside its 4-process job (2 x 2 sharded, then 4 x 1).
As a script it writes RUN/result.json (rank 0) at the end:

    script RUN STAGES SHARD STOP_AFTER [ASYNC]

SHARD: 1 shards each stage over its replicas; STOP_AFTER: every process ends at once
(``os._exit(3)``) after that many mini-batches, as a crash would (0: never); ASYNC: 1 writes the
checkpoints in the background (``async_checkpoint``).
"""
import json
import os
import sys
from pathlib import Path
from typing import Optional

import torch
from torch import nn

import pipeoptim


class Stopped(Exception):
    """Raised by the run's ``on_batch`` on every rank at once after ``stop_after`` mini-batches
    (every rank reports each loss at the same drain): the run ends there, its newest
    checkpoint the last one written before."""


def train(run: Path, stages: int, shard: bool, stop_after: int = 0, background: bool = False,
          world: Optional[object] = None) -> dict:
    """The run's losses and weights (every rank gathers the whole model); raises :class:`Stopped`
    after ``stop_after`` mini-batches (0: never)."""
    seen = [0]

    def on_batch(i, loss):
        seen[0] += 1
        if stop_after and seen[0] >= stop_after:
            raise Stopped(f"stopped after {seen[0]} mini-batches")

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(8)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 3))
    pipe = pipeoptim.Pipeline(model, method="1f1b-flush", stages=stages, loss_fn=nn.functional.cross_entropy,
                              micro_batches=2, shard_replicas=shard, timeout=60, world=world,
                              optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
                              lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5))
    try:
        d, replicas = pipe.data_parallel_rank, pipe.data_parallel_size
        own = [(x.chunk(replicas)[d], y.chunk(replicas)[d]) for x, y in data]
        result = pipe.fit(own, epochs=2, checkpoint_dir=run / "checkpoints", checkpoint_every=2, resume=True,
                          on_batch=on_batch, async_checkpoint=background)
        weights = {k: v.tolist() for k, v in pipe.model().state_dict().items()}
        return {"losses": result.losses, "weights": weights}
    finally:
        pipe.close()


def latest(run: Path) -> str:
    """The checkpoint RUN's ``latest.json`` names."""
    return json.loads((run / "checkpoints" / "latest.json").read_text())["checkpoint"]


if __name__ == "__main__":
    folder, n, sharded, stop = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
    try:
        done = train(folder, n, sharded, stop, background=len(sys.argv) > 5 and sys.argv[5] == "1")
    except Stopped:
        os._exit(3)
    if int(os.environ.get("RANK", "0")) == 0:
        (folder / "result.json").write_text(json.dumps(done))
