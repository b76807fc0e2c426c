"""A Pipeline run with checkpoints, for the kill-and-resume tests and benchmarks/chaos.py:
run under torchrun (one stage per process) or python. Always resumes from the newest checkpoint
in RUN (starting fresh when there is none); rank 0 writes RUN/result.json at the end.

    script RUN [BATCHES] [EPOCHS] [DELAY_S] [METHOD] [STOP_AFTER] [LAYOUT] [BACKGROUND]

METHOD (default pipeoptim; ``interleaved``, ``zb-v``, ``dualpipev``: 2 chunks per process; ``bitpipe``: 4 pieces); STOP_AFTER: every process
ends at once (``os._exit(3)``) after that many mini-batches, as a crash would, for a resume that
starts mid-epoch from the last checkpoint ("-": never). LAYOUT ``NxD``, ``s`` appended for
sharded (default ``2x1``): N stages x D replicas (N x D processes), each replica training on its
shard of every mini-batch, ``2x2s`` each stage sharded over its 2 replicas (``shard_replicas``).
BACKGROUND ``1``: the checkpoints are written in the background (``async_checkpoint``).
"""
import json
import os
import re
import sys
import time
from pathlib import Path

import torch
from torch import nn

import pipeoptim

run = Path(sys.argv[1])
batches, epochs = int(sys.argv[2]) if len(sys.argv) > 2 else 40, int(sys.argv[3]) if len(sys.argv) > 3 else 2
delay = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
method = sys.argv[5] if len(sys.argv) > 5 else "pipeoptim"
stop_after = int(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[6] != "-" else None
layout = re.fullmatch(r"(\d+)x(\d+)(s?)", sys.argv[7] if len(sys.argv) > 7 else "2x1")
if layout is None:
    raise SystemExit(f"LAYOUT is NxD or NxDs (N stages x D replicas, s: sharded), got {sys.argv[7]!r}")
stages, replicas, sharded = int(layout[1]), int(layout[2]), layout[3] == "s"
seen = [0]


def on_batch(i, loss):
    seen[0] += 1
    if stop_after is not None and seen[0] >= stop_after:
        os._exit(3)
    time.sleep(delay)


g = torch.Generator().manual_seed(1)
data = [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(batches)]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))
if method in ("interleaved", "zb-v", "dualpipev", "bitpipe"):  # 4 pieces need 4 layers with parameters
    model = nn.Sequential(*model[:5], nn.Linear(32, 32), nn.Tanh(), model[5])
pipe = pipeoptim.Pipeline(model, method=method, stages=stages, loss_fn=nn.functional.cross_entropy, timeout=60,
                          optimizer=lambda p: torch.optim.Adam(p, lr=3e-3),
                          lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=15, gamma=0.5),
                          **({"data_parallel": replicas, "shard_replicas": sharded} if replicas > 1 else {}))
d, size = pipe.data_parallel_rank, pipe.data_parallel_size
own = [(x.chunk(size)[d], y.chunk(size)[d]) for x, y in data]
result = pipe.fit(own, epochs=epochs, checkpoint_dir=run / "checkpoints", checkpoint_every=5, resume=True,
                  on_batch=on_batch, async_checkpoint=len(sys.argv) > 8 and sys.argv[8] == "1")
weights = {k: v.tolist() for k, v in pipe.model().state_dict().items()}
if pipe.rank == 0:
    (run / "result.json").write_text(json.dumps({"losses": result.losses, "weights": weights}))
