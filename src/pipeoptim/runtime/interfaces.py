"""What a stage calls on its collaborators, as ``typing.Protocol`` classes: each is given to the
stage at construction and tested by what it declares, never by its class name or ``getattr``."""
from __future__ import annotations

from typing import Dict, List, Protocol, Sequence, runtime_checkable

import torch

from ..compat import MUON
from ..weights.formulas import ComposedOptimizer  # (declared where each part's formula is read)


class GradientSync(Protocol):
    """Before each update, the stage's gradients reduced over its replicas
    (``averaging.GradientAverager``, ``sharding.StageShards``)."""

    def __call__(self, params: List[torch.Tensor]) -> None: ...


@runtime_checkable
class OverlappedSync(GradientSync, Protocol):
    """A sync that reduces the gradients of the last backward before an update as each becomes
    final, while the rest of the backward runs (``overlap``: the executor's word that the next
    backward is that one; ``overlapping``: it is running)."""

    overlapping: bool

    def overlap(self) -> None: ...

    def ready(self, param: torch.Tensor) -> None: ...

    def ready_all(self, params: Sequence[torch.Tensor]) -> None: ...


@runtime_checkable
class DelayAware(Protocol):
    """An optimizer told the delay of each update's gradients (``delay_nadamw.DelayNAdamW``)."""

    def set_pipeline_delay(self, delay: int) -> None: ...


@runtime_checkable
class PredictsVariants(Protocol):
    """A weight policy that also predicts with none of its delay corrections and without each
    (what the prediction probes measure beside its own prediction)."""

    def prediction_variants(self, microbatch: int) -> Dict[str, List[torch.Tensor]]: ...


def orthogonalizes(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is torch's Muon, or made of parts (Muon with AdamW), which needs each
    matrix whole. A composed one counts whatever its parts on this stage (a stage without
    matrices has no Muon part): every rank must refuse a sharded run alike."""
    return isinstance(optimizer, (MUON, ComposedOptimizer))
