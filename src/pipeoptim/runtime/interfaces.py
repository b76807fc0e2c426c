"""What a stage calls on its collaborators, as ``typing.Protocol`` classes: each is given to the
stage at construction and tested by what it declares, never by its class name or ``getattr``; and
the executor's one collaborator, its :class:`Transport` (a base class: its defaults are one
process's)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Protocol, Sequence, Tuple, runtime_checkable

import torch

from ..compat import MUON
from ..weights.formulas import ComposedOptimizer  # (declared where each part's formula is read)

if TYPE_CHECKING:
    from ..schedules.actions import Schedule
    from .segment import MicroBatch

Key = Tuple[int, int]  # (stage, micro-batch): whose value an executor's store holds


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


class Transport:
    """How a value crosses from a stage of one rank to a stage of another: the SEND_*/RECV_*
    actions of a lowered order. ``attach`` gives it the executor's stores, keyed by (stage,
    micro-batch): the inputs of stages (activations), the gradients of their outputs, and the
    inputs of forward-only passes (E micro-batch j). ``recv(kind, k, i)`` (RECV_F, RECV_B or
    RECV_E) puts stage ``k``'s value into its store and says True, or says False where it has
    not come yet (a walker then stops there); ``send(kind, k, i, value)`` gets stage ``k``'s
    value for the stage on the other side."""

    def attach(self, inputs: Dict[Key, Any], grads: Dict[Key, Any], evals: Dict[Key, Any]) -> None:
        self.inputs, self.grads, self.evals = inputs, grads, evals

    def use(self, schedule: Schedule) -> None:
        """The segment's schedule (or the same one known further)."""

    def fed(self, first: int, microbatches: Sequence[MicroBatch], batch: int) -> None:
        """Micro-batches ``first``, ``first + 1``, ... came (mini-batch number ``batch``, from 1)."""

    def agree(self, table: torch.Tensor) -> torch.Tensor:
        """Every stage's row of an update's agreement (fp16's found-inf flag, the squared gradient
        norm: ``loss_scaling.UpdateAgreement.table``) from this process's table, which holds its
        stages' rows (the others zero): here every stage's."""
        return table

    def fed_forward_only(self, j: int, key: Any) -> None:
        """Micro-batch ``j`` of forward-only work run alone came (its messages keyed ``key``)."""

    def drained(self) -> None:
        """The segment has run to its end."""
