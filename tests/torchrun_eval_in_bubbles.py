"""Run under torchrun by tests/test_eval_in_bubbles_torchrun.py (and in one process, as the
reference): fit with eval_every=2, drained and in the bubbles, for gpipe, 1f1b-flush and zb-h1;
rank 0 prints one JSON line per (method, bubbles) with the losses and the evaluations.
Argument: stages. The model has batch norm (running statistics that training forwards move) and
no dropout (each process draws its own, so only a model without randomness matches one
process step for step)."""
import json
import sys

import torch
from torch import nn

import pipeoptim

torch.set_num_threads(1)
stages = int(sys.argv[1])
g = torch.Generator().manual_seed(1)
data = [(torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g))
        for _ in range(5)]
held_out = [(torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,), generator=g))
            for _ in range(3)]
for method in ("gpipe", "1f1b-flush", "zb-h1"):
    for bubbles in (False, True):
        torch.manual_seed(0)
        layers = [nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)]
        pipe = pipeoptim.Pipeline(nn.Sequential(*layers).double(), method=method, stages=stages,
                                  loss_fn=nn.functional.cross_entropy,
                                  optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
        result = pipe.fit(data, epochs=2, eval_loader=held_out, eval_every=2, eval_in_bubbles=bubbles)
        if pipe.rank == 0:
            print(json.dumps({"method": method, "bubbles": bubbles, "losses": result.losses,
                              "evaluations": [[e["batch"], e["updates"], e["metric"]]
                                              for e in result.metrics["evaluations"]]}), flush=True)
