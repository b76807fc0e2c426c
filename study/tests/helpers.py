"""What the study's tests share: a small seeded MLP (one block per layer, so any split works)."""
from __future__ import annotations

import torch
from torch import nn


def mlp(depth: int = 8, width: int = 12, classes: int = 4, dtype=torch.float64, seed: int = 0) -> nn.Sequential:
    """An MLP of ``depth`` Linear+Tanh blocks on 6 inputs, one block per layer."""
    torch.manual_seed(seed)
    layers = [nn.Linear(6, width)] + [nn.Sequential(nn.Tanh(), nn.Linear(width, width)) for _ in range(depth - 2)]
    layers += [nn.Sequential(nn.Tanh(), nn.Linear(width, classes))]
    return nn.Sequential(*layers).to(dtype)

