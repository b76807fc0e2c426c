"""Muon as it is meant to be used: ``torch.optim.Muon`` on the hidden weight matrices, AdamW on
everything else, as one optimizer per stage (``--optimizer muon``).

Muon takes the 2-D ``weight`` of every ``nn.Linear`` but the model's output layer (the last one,
in the stage that holds the model's last layer); AdamW the rest: embeddings (2-D but not a linear
map of hidden features), norms, biases, convolution kernels and the output layer. Given a plain
list of parameters instead of a :class:`pipeoptim.runtime.build.StageParameters` (which carries
the stage's module), every 2-D parameter goes to Muon. :class:`MuonWithAdamW`'s ``param_groups``
and ``state`` are its parts' (Muon's first), so that schedulers, state dicts and hooks act on it
as on any torch optimizer; its ``parts`` tell the Predictor each group's formula.
"""
from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn


def split_for_muon(params: Iterable[nn.Parameter]) -> Tuple[List[nn.Parameter], List[nn.Parameter]]:
    """(Muon's parameters, AdamW's) among ``params``, in their order (see the module docstring)."""
    module: Optional[nn.Module] = getattr(params, "module", None)
    holds_output = bool(getattr(params, "holds_output", False))
    params = list(params)
    if module is None:
        hidden = {id(p) for p in params if p.ndim == 2}
    else:
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        if holds_output and linears:
            linears = linears[:-1]  # the model's output layer
        hidden = {id(m.weight) for m in linears if m.weight.ndim == 2}
    return [p for p in params if id(p) in hidden], [p for p in params if id(p) not in hidden]


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on ``muon_params``, ``torch.optim.AdamW`` on ``adamw_params``, as one
    optimizer (either list may be empty, not both). ``lr``, ``weight_decay``, ``momentum``,
    ``nesterov``, ``ns_steps`` and ``adjust_lr_fn`` are Muon's (torch's defaults); ``adamw_lr``
    (default ``lr``), ``betas``, ``eps`` and ``adamw_weight_decay`` are AdamW's."""

    def __init__(self, muon_params: Iterable[Any], adamw_params: Iterable[Any], *, lr: float = 1e-3,
                 weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 adjust_lr_fn: Optional[str] = None, adamw_lr: Optional[float] = None,
                 betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                 adamw_weight_decay: float = 0.01) -> None:
        muon_params, adamw_params = list(muon_params), list(adamw_params)
        parts: List[torch.optim.Optimizer] = []
        if muon_params:
            parts.append(torch.optim.Muon(muon_params, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                          nesterov=nesterov, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn))
        if adamw_params:
            parts.append(torch.optim.AdamW(adamw_params, lr=lr if adamw_lr is None else adamw_lr,
                                           betas=tuple(betas), eps=eps, weight_decay=adamw_weight_decay))
        if not parts:
            raise ValueError("MuonWithAdamW got an empty parameter list")
        #: the optimizers this one is made of, Muon's first; their groups are this one's
        self.parts = parts
        self._sizes = [len(part.param_groups) for part in parts]
        # the parts' own group dicts become this optimizer's groups (no defaults added)
        super().__init__([g for part in parts for g in part.param_groups], {})
        self._share()

    def _share(self) -> None:
        """Point every part at this optimizer's groups and state (after a load, too)."""
        start = 0
        for part, size in zip(self.parts, self._sizes):
            part.param_groups = self.param_groups[start:start + size]
            part.state = self.state
            start += size

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # load_state_dict installs new groups and state through here
        if "parts" in self.__dict__:
            self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss
