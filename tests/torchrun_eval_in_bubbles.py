"""Run under torchrun by tests/test_eval_in_bubbles_torchrun.py (and in one process, as the
reference): fit with eval_every=2, drained and in the bubbles, for gpipe, 1f1b-flush and zb-h1;
rank 0 prints one JSON line per (method, bubbles) with the losses and the evaluations; then a
user's forward_in_bubbles, whose outputs the last stage's process prints.
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


def pipeline(method: str) -> pipeoptim.Pipeline:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)]
    return pipeoptim.Pipeline(nn.Sequential(*layers).double(), method=method, stages=stages,
                              loss_fn=nn.functional.cross_entropy,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))


for method in ("gpipe", "1f1b-flush", "zb-h1"):
    for bubbles in (False, True):
        pipe = pipeline(method)
        result = pipe.fit(data, epochs=2, eval_loader=held_out, eval_every=2, eval_in_bubbles=bubbles)
        if pipe.rank == 0:
            print(json.dumps({"method": method, "bubbles": bubbles, "losses": result.losses,
                              "evaluations": [[e["batch"], e["updates"], e["metric"]]
                                              for e in result.metrics["evaluations"]]}), flush=True)

pipe = pipeline("1f1b-flush")
for x, y in data[:2]:
    pipe.step(x, y)
pipe.flush()
outputs = {}
pipe.forward_in_bubbles([x for x, _ in held_out], lambda j, out: outputs.__setitem__(j, out.tolist()))
pipe.step(*data[2])
pipe.flush()
if outputs:  # the last stage's process
    print(json.dumps({"method": "forward_in_bubbles", "bubbles": True,
                      "outputs": [outputs[j] for j in sorted(outputs)]}), flush=True)
