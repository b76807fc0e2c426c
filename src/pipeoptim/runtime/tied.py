"""Weights tied across stages in a run of one process per stage (docs/architecture.md, "Tied
weights").

In one process a tied parameter is one object that every holder reads, so autograd already sums
the holders' gradients into it and the owner's update is seen by all: nothing to do here. When
each stage runs in its own process, every holder has its own copy; at each update of a
synchronous method the holders (the owner, the first stage that reads it, and the others) first
sum their gradients of it into the owner's (``all_reduce`` over a group of the holders' ranks),
the owner applies its update, and then sends the new value to the others (``broadcast``), so that
every copy stays equal to the one parameter of the model trained in one piece. A holder that is
not the owner waits there for the owner's update: in a synchronous schedule that update comes
after every backward of the mini-batch and before the next mini-batch's first forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class Tie:
    """One parameter read by several stages: which stages (the first owns it), this stage's copy
    (None where this stage does not read it), and the holders' group once the world made it."""

    holders: List[int]
    param: Optional[nn.Parameter]
    name: str
    group: Any = None
    owner_rank: int = 0   #: the owner's rank in the job (``broadcast`` takes a job rank)


class TiedWeights:
    """Every tie of the model as seen from stage ``stage`` (all of them, in the same order on
    every rank, so that each rank makes the same groups); :meth:`before_update` and
    :meth:`after_update` run around the stage's optimizer step."""

    def __init__(self, stage: int, ties: List[Tie]) -> None:
        self.stage = stage
        self.ties = ties

    def held(self) -> List[Tie]:
        return [t for t in self.ties if t.param is not None and t.group is not None]

    def before_update(self) -> None:
        """Sum the holders' gradients into the owner's (a holder's own is then dropped)."""
        for tie in self.held():
            p = tie.param
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad, group=tie.group)
            p.grad = grad if tie.holders[0] == self.stage else None

    @torch.no_grad()
    def after_update(self) -> None:
        """Every holder's copy takes the owner's value after its update."""
        for tie in self.held():
            dist.broadcast(tie.param.data, src=tie.owner_rank, group=tie.group)
