"""Run under torchrun by tests/test_dualpipev.py (tests/conftest.py's shared jobs, on 2 and on 4
processes): ``dualpipev``, and torch's own DualPipeV order read from its compute-only rows through
``Pipeline(schedule=...)`` (float64), and, run in one process (the tests' reference), ``sequential``
too; rank 0 prints one JSON line per run with its losses, its weights and the processes it ran on.
Argument: N, the processes."""
import json
import os
import sys

import torch
from torch import nn

import pipeoptim
from pipeoptim.schedules import csv_io
from torch_orders import torch_rows

n = int(sys.argv[1])
m = 2 * n
g = torch.Generator().manual_seed(1)
data = [(torch.randn(2 * m, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (2 * m,), generator=g))
        for _ in range(3)]
order = csv_io.from_csv_rows(torch_rows("dualpipev", n, m), name="torch-dualpipev", add_updates=True)
runs = {"dualpipev": dict(method="dualpipev", stages=n), "torch-dualpipev": dict(schedule=order)}
if "WORLD_SIZE" not in os.environ:
    runs["sequential"] = dict(method="sequential", micro_batches=m)
for run, options in runs.items():
    torch.manual_seed(0)
    layers = [nn.Linear(6, 8)] + [nn.Sequential(nn.Tanh(), nn.Linear(8, 8)) for _ in range(2 * n - 2)]
    model = nn.Sequential(*layers, nn.Sequential(nn.Tanh(), nn.Linear(8, 3))).double()
    pipe = pipeoptim.Pipeline(model, loss_fn=nn.functional.cross_entropy,
                              optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), **options)
    result = pipe.fit(data, epochs=2)
    weights = {k: v.tolist() for k, v in pipe.model().state_dict().items()}
    if pipe.rank == 0:
        print(json.dumps({"run": run, "losses": result.losses, "weights": weights,
                          "processes": result.metrics["processes"]}), flush=True)
