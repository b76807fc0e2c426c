"""Assemble the stages of a run: split the model, one optimizer and one weight policy per stage."""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch
from torch import nn

from ..methods import Method
from ..partition import split
from ..weights.policies import make_policy
from .stage import Stage

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def build_stages(model: nn.Sequential, sizes: Sequence[int], method: Method, options: Dict[str, Any],
                 optimizer: OptimizerFactory, loss_fn: Callable, *,
                 only: Optional[int] = None) -> List[Stage]:
    """Stages over ``model``'s own layers (no copy). ``only`` builds just that stage (one
    process of a distributed run); the others are left out of the list."""
    parts = split(model, sizes)
    n = len(parts)
    stages = []
    for k, part in enumerate(parts):
        if only is not None and k != only:
            continue
        params = [p for p in part.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"stage {k} (layers {sum(sizes[:k])}..{sum(sizes[:k + 1]) - 1}) has no "
                             f"trainable parameters; choose another partition")
        opt = optimizer(params)
        policy = make_policy(method.policy, part, opt, stage=k, num_stages=n, **options)
        stages.append(Stage(k, n, part, opt, policy, loss_fn=loss_fn if k == n - 1 else None))
    return stages
