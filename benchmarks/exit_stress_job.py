"""The smallest Pipeline run under torchrun that ends with a pipelined evaluation; run by
benchmarks/exit_stress.py (``torchrun --nproc-per-node 2 benchmarks/exit_stress_job.py``)."""
import torch
from torch import nn

import pipeoptim

torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(4)]
model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
pipe = pipeoptim.Pipeline(model, method="pipeoptim", stages=2, loss_fn=nn.functional.cross_entropy,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
result = pipe.fit(batches, epochs=1, eval_loader=batches[:2],
                  metric=lambda out, y: (out.argmax(-1) == y).float().mean())
if pipe.rank == 0:
    print(f"loss {result.losses[-1]:.4f}")
