"""Run under torchrun by tests/test_library_models.py (the ``chunked-replicas`` script of tests/conftest.py's
4-process job): a traced GPT (tests/traced_models.py's TinyGPT, its head tied to its embedding, as
GPT-2's; not GPT-2 itself, whose import would cost each of the 4 processes more than this training)
under a chunked method
on 2 stages x 2 replicas, each replica on its shard of every mini-batch; or, in one process, on the
concatenated shards (each micro-batch the replicas' micro-batches of that position side by side).
zb-v keeps the tie inside a process (its first and last pieces), interleaved between processes.
Rank 0 prints one JSON line per entry with the losses, what step() and flush() returned (zb-v's rank 0
holds the last stage: the replicas' mean, not its own replica's) and the trained weights.

    script ENTRIES    (ENTRIES: METHOD[:sharded],...; sharded: shard_replicas=True)
"""
import json
import sys

import torch

import pipeoptim
from traced_models import TinyGPT, lm_batches, lm_loss

MICRO = 2
for entry in sys.argv[1].split(","):
    method, _, sharded = entry.partition(":")
    torch.manual_seed(0)
    model, batches = TinyGPT(layers=2), lm_batches(count=3)
    pipe = pipeoptim.Pipeline(model, method=method, stages=2, loss_fn=lm_loss, partitioner="uniform",
                              micro_batches=MICRO, shard_replicas=bool(sharded),
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    d, replicas = pipe.data_parallel_rank, pipe.data_parallel_size
    if replicas > 1:
        shards = [(x.chunk(replicas)[d], y.chunk(replicas)[d]) for x, y in batches]
    else:  # what two replicas run side by side
        shards = [tuple(torch.cat([t.chunk(2)[r].chunk(MICRO)[j] for j in range(MICRO) for r in range(2)])
                        for t in batch) for batch in batches]
    stepped = [loss for x, y in shards for loss in pipe.step(x, y)] + pipe.flush()
    trained = pipe.model()
    if pipe.rank == 0:
        print(json.dumps({"entry": entry, "replicas": replicas, "losses": pipe.losses, "stepped": stepped,
                          "tied": trained.head.weight is trained.embed.weight,
                          "weights": {k: v.tolist() for k, v in trained.state_dict().items()}}), flush=True)
