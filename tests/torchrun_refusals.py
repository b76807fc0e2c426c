"""Run under torchrun (2 processes) by tests/test_torchrun.py and tests/test_bidirectional.py:
Pipelines that this job's processes cannot hold, one after the other; every rank prints, for each,
one JSON line with the refusal's message (``refused``; null when it was not refused), and goes on
to the next. A rank that was not refused, or refused differently, would leave its peer waiting
on it: the job ends only if every rank refused every one, the same way.

The cases, by name: ``stages``: 3 stages on 2 processes; ``replicas``: data_parallel=3 where 2
processes with 1 stage make 2 replicas; ``layers``: 2 stages of a model with 1 layer with
parameters; ``bidirectional``: one bidirectional pipeline with replicas of it on top (it holds two
already); ``fp16``: an asynchronous method in fp16 (one loss scale would stall it at every update)."""
import json
import os

import torch
from torch import nn

import pipeoptim

rank = int(os.environ["RANK"])
three_layers = lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))  # noqa: E731
CASES = {
    "stages": (three_layers, dict(stages=3)),
    "replicas": (three_layers, dict(stages=1, data_parallel=3)),
    "layers": (lambda: nn.Sequential(nn.Linear(4, 2)), dict(stages=2)),
    "bidirectional": (lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)),
                      dict(method="bidirectional", stages=1)),
    "fp16": (three_layers, dict(stages=2, precision="fp16")),
}
for name, (model, settings) in CASES.items():
    settings = {"method": "pipeoptim", **settings}
    try:
        pipeoptim.Pipeline(model(), loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                           **settings).fit([(torch.randn(4, 4), torch.randn(4, 2))])
        refused = None
    except ValueError as error:
        refused = str(error)
    print(json.dumps({"case": name, "rank": rank, "refused": refused}), flush=True)
