"""A 1f1b-flush run with a checkpoint every 2 mini-batches that resumes from the newest one in RUN,
in whatever layout it is started: one process (python), or under torchrun N stages x D replicas,
sharded over the replicas or not. Each replica trains on its shard of every mini-batch, so every
layout trains on the same whole mini-batches; rank 0 writes RUN/result.json at the end.

    script RUN STAGES SHARD STOP_AFTER [ASYNC]

SHARD: 1 shards each stage over its replicas; STOP_AFTER: every process ends at once
(``os._exit(3)``) after that many mini-batches, as a crash would (0: never); ASYNC: 1 writes the
checkpoints in the background (``async_checkpoint``).
"""
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

import pipeoptim

run, stages, shard, stop_after = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
background = len(sys.argv) > 5 and sys.argv[5] == "1"
seen = [0]


def on_batch(i, loss):
    seen[0] += 1
    if stop_after and seen[0] >= stop_after:
        os._exit(3)


g = torch.Generator().manual_seed(1)
data = [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(8)]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                      nn.Linear(16, 3))
pipe = pipeoptim.Pipeline(model, method="1f1b-flush", stages=stages, loss_fn=nn.functional.cross_entropy,
                          micro_batches=2, shard_replicas=shard, timeout=60,
                          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
                          lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5))
d, replicas = pipe.data_parallel_rank, pipe.data_parallel_size
own = [(x.chunk(replicas)[d], y.chunk(replicas)[d]) for x, y in data]
result = pipe.fit(own, epochs=2, checkpoint_dir=run / "checkpoints", checkpoint_every=2, resume=True,
                  on_batch=on_batch, async_checkpoint=background)
weights = {k: v.tolist() for k, v in pipe.model().state_dict().items()}
if pipe.rank == 0:
    (run / "result.json").write_text(json.dumps({"losses": result.losses, "weights": weights}))
