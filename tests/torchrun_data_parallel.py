"""Run under torchrun by tests/test_torchrun.py: each method through Pipeline with N stages and
D replicas, every replica on its shard of each mini-batch (a contiguous chunk); or, under python
(one process), on the concatenated shards: each micro-batch the concatenation of the replicas'
micro-batches of the same position (what they run side by side). Rank 0 prints one JSON line
per method.

    script METHODS STAGES MICRO_BATCHES REPLICAS [BUCKET_BYTES]

BUCKET_BYTES holds for this script's Pipelines only: the scripts after it in a shared job
(tests/torchrun_jobs.py) get the default back.
"""
import json
import sys

import torch
from torch import nn

import pipeoptim
from pipeoptim.runtime.averaging import GradientAverager

methods, stages, micro, reference = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
default_buckets = GradientAverager.bucket_bytes
if len(sys.argv) > 5:  # small buckets: the reduction overlaps the backward, a bucket per few parameters
    GradientAverager.bucket_bytes = int(sys.argv[5])
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(6)]
for method in methods:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    pipe = pipeoptim.Pipeline(model, method=method, stages=stages, loss_fn=nn.functional.cross_entropy,
                              optimizer=lambda p: torch.optim.Adam(p, lr=0.01), micro_batches=micro)
    d, replicas = pipe.data_parallel_rank, pipe.data_parallel_size
    if replicas > 1:
        shard = [(x.chunk(replicas)[d], y.chunk(replicas)[d]) for x, y in batches]
    else:
        shard = [tuple(torch.cat([t.chunk(reference)[r].chunk(micro)[j] for j in range(micro)
                                  for r in range(reference)]) for t in batch) for batch in batches]
    result = pipe.fit(shard, epochs=2, eval_loader=shard[:2],
                      metric=lambda out, y: nn.functional.cross_entropy(out, y))
    weights = {k: v.tolist() for k, v in pipe.model().state_dict().items()}
    if pipe.rank == 0:
        print(json.dumps({"method": method, "replicas": replicas, "losses": result.losses,
                          "metric": result.metrics["epochs"][-1]["metric"], "weights": weights}), flush=True)
GradientAverager.bucket_bytes = default_buckets
