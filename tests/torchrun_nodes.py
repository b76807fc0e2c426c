"""Run under torchrun by tests/test_multinode.py: where each rank of a Pipeline of STAGES stages
sits. Every rank prints one JSON line: its rank, its node (torchrun's GROUP_RANK), its replica and
the stages it runs.

    script STAGES
"""
import json
import os
import sys

import torch
from torch import nn

import pipeoptim

stages = int(sys.argv[1])
model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(stages)])
with pipeoptim.Pipeline(model, stages=stages, loss_fn=nn.functional.mse_loss,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1)) as pipe:
    print(json.dumps({"rank": pipe.rank, "node": int(os.environ["GROUP_RANK"]), "replica": pipe.data_parallel_rank,
                      "stages": [stage.index for stage in pipe.stages]}), flush=True)
