"""Where a pass's weight gradients go: into the parameters' ``.grad`` (from the tensors a weight
policy handed the pass, unless it ran on the parameters themselves), and, as each becomes final
for an update, to the reduction over the stage's replicas (``averaging.GradientAverager``)."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..compat import HAS_POST_ACCUMULATE_HOOK
from ..weights.base import WeightUse


Named = Sequence[Tuple[str, nn.Parameter]]  #: a policy's (name, parameter) pairs


def collect(use: WeightUse, named: Named) -> None:
    """Hand the pass's weight tensors' gradients to the parameters (accumulating)."""
    if use.direct:
        return  # autograd accumulated into the parameters' own .grad
    by_name = dict(named)
    for name, tensor in use.weights.items():
        if tensor.grad is not None:
            param = by_name[name]
            param.grad = tensor.grad if param.grad is None else param.grad.add_(tensor.grad)
            tensor.grad = None


def announce_on_accumulate(ready: Callable[[torch.Tensor], None], use: WeightUse,
                           params: Sequence[nn.Parameter], named: Named) -> List[Any]:
    """Hooks that hand each parameter to ``ready`` as soon as autograd has its final gradient in
    this backward (a tensor of ``use.weights`` first gives it to its parameter); remove them after."""
    if not HAS_POST_ACCUMULATE_HOOK:
        return []
    if use.direct:
        return [p.register_post_accumulate_grad_hook(ready) for p in params]
    by_name = dict(named)

    def collect_one(name: str):
        def hook(alias: torch.Tensor) -> None:
            param = by_name[name]
            param.grad = alias.grad if param.grad is None else param.grad.add_(alias.grad)
            alias.grad = None
            ready(param)
        return hook
    return [t.register_post_accumulate_grad_hook(collect_one(n)) for n, t in use.weights.items()
            if t.requires_grad]


def announce_groups(ready_all: Callable[[List[torch.Tensor]], None], use: WeightUse,
                    params: Sequence[nn.Parameter]) -> Optional[Callable[[List[torch.Tensor]], None]]:
    """For a split backward's weight half: what hands each weight group's own parameters to
    ``ready_all`` once accumulated (a tied value stays for its owner); None where the passes run
    on other tensors than the parameters (reduced at the update)."""
    if not use.direct:
        return None
    own = {id(p) for p in params}
    return lambda weights: ready_all([w for w in weights if id(w) in own])
