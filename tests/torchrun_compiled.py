"""Run under torchrun by tests/test_compile.py: each method through Pipeline eagerly and with
``compile`` (one stage per process), on the same model and mini-batches; rank 0 prints one JSON
line per method with both runs' losses and every stage's compilation count (the compiled run's
``metrics['compilations']``, gathered from the ranks).

    script METHODS BACKEND
"""
import json
import sys

import torch
from torch import nn

import pipeoptim

methods, backend = sys.argv[1].split(","), sys.argv[2]
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(8)]


def model(method: str) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)]
    if pipeoptim.get_method(method).chunks > 1:  # 2 stages x 2 chunks: a layer with weights for each
        layers[2:2] = [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers)


for method in methods:
    runs = []
    for compile in (False, backend):
        pipe = pipeoptim.Pipeline(model(method), method=method, stages=None if method == "sequential" else 2,
                                  loss_fn=nn.functional.cross_entropy, compile=compile,
                                  optimizer=lambda p: torch.optim.Adam(p, lr=0.01))
        runs.append(pipe.fit(batches))

    eager, compiled = runs
    if pipe.rank == 0:
        print(json.dumps({"method": method, "eager": eager.losses, "compiled": compiled.losses,
                          "compilations": compiled.metrics["compilations"],
                          "eager_compilations": eager.metrics["compilations"]}), flush=True)
