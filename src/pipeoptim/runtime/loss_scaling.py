"""fp16's dynamic loss scaling across a pipeline: ``torch.amp.GradScaler``'s semantics with one
scale for every stage and every replica (docs/architecture.md, "fp16 and the loss scale").

The last stage multiplies each micro-batch's loss by the scale before its backward (the loss it
reports stays unscaled); the scale travels with nothing. At each update number the executor
agrees, over every stage (:class:`UpdateAgreement`, on the path global clipping takes: the
transport's ``all_norms``, in stage order, across processes under torchrun), on one *found-inf*
flag: each stage first averages its gradients over its replicas (an inf or nan in one replica's
makes the average non-finite; a sharded stage's flag is taken over its shards with one
all-reduce over "dp"), then unscales them (``grad * (1/scale)``, as ``GradScaler.unscale_``)
and flags any non-finite element. Every process then applies the same rule to the same flag
(:meth:`LossScaler.update`, torch's ``_amp_update_scale_``), so every rank keeps the same scale.
A flagged update is skipped on every stage: no optimizer step, no scheduler step (as
Hugging Face Accelerate's ``AcceleratedScheduler`` does where ``GradScaler`` skipped the step;
torch leaves the scheduler to the caller), the weight version and every count read from it
stay (``Stage.update``, ``WeightPolicy.skipped_update``). Clipping, per stage or global, reads
the unscaled gradients; the optimizer steps on them.

The scale a micro-batch's loss is multiplied by must be the one its gradients are unscaled by:
in every method's schedule the last stage runs the forwards of window u after its own update
u - 1 (``tests/test_fp16.py`` checks the registry), and the scale changes only at an agreement.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..weights.base import local
from .segment import clip_coefficient

#: torch.amp.GradScaler's defaults: the first scale, its growth after ``GROWTH_INTERVAL`` updates
#: in a row without an inf or nan, and its backoff at one
INIT_SCALE, GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL = 2.0 ** 16, 2.0, 0.5, 2000


class LossScaler:
    """The loss scale of one process, shared by its stages: ``scale`` and ``growth_tracker`` (the
    updates in a row without an inf or nan), as ``torch.amp.GradScaler`` keeps them (its
    ``_scale`` and ``_growth_tracker``), on the host: every update already waits for the
    agreement."""

    def __init__(self, init_scale: float = INIT_SCALE, growth_factor: float = GROWTH_FACTOR,
                 backoff_factor: float = BACKOFF_FACTOR, growth_interval: int = GROWTH_INTERVAL) -> None:
        self.scale = _f32(init_scale)
        self.growth_tracker = 0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._tensors: Dict[Tuple[str, float], torch.Tensor] = {}

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the scale, a 0-dim fp32 tensor on its device (``GradScaler.scale``)."""
        key = (str(loss.device), self.scale)
        factor = self._tensors.get(key)
        if factor is None:
            self._tensors.clear()
            factor = self._tensors[key] = torch.full((), self.scale, dtype=torch.float32, device=loss.device)
        return loss * factor

    @torch.no_grad()
    def unscale(self, grads: List[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Multiply ``grads`` by 1/scale in place (torch's inverse: the fp64 reciprocal rounded to
        fp32); return 1.0 where one held an inf or nan before, else 0.0 (a 0-dim fp32 tensor on
        ``device``), as ``torch._amp_foreach_non_finite_check_and_unscale_`` does."""
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        found = torch.stack([torch.isfinite(g).all() for g in grads]).logical_not().any()
        torch._foreach_mul_(grads, _f32(1.0 / self.scale))
        return found.to(device=device, dtype=torch.float32)

    def update(self, found_inf: bool) -> None:
        """torch's ``_amp_update_scale_``: back off at an inf or nan; after ``growth_interval``
        updates in a row without one, grow (where the grown scale is finite in fp32)."""
        if found_inf:
            self.scale, self.growth_tracker = _f32(self.scale * self.backoff_factor), 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = _f32(self.scale * self.growth_factor)
            if grown != float("inf"):
                self.scale = grown
            self.growth_tracker = 0

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scale, self.growth_tracker = _f32(state["scale"]), int(state["growth_tracker"])


def _f32(value: float) -> float:
    """``value`` rounded to fp32, the dtype GradScaler's scale is kept in."""
    return float(torch.tensor(value, dtype=torch.float32))


class UpdateAgreement:
    """What every stage agrees on before update number u: the global clipping coefficient
    (``clip_global``: the max norm; None: none) and, where the stages scale their loss, whether
    the update is skipped. :meth:`values` gives this process's part (per stage, in stage order),
    the transport gathers every stage's, :meth:`decide` reads them (and moves the scale)."""

    def __init__(self, clip_global: Optional[float], stages: Sequence[Any]) -> None:
        self.clip = clip_global
        #: the distinct scalers of this process's stages (one, unless stages were built by hand)
        self.scalers = list({id(s.loss_scaling): s.loss_scaling for s in stages if s.loss_scaling is not None}.values())

    @staticmethod
    def needed(clip_global: Optional[float], stages: Sequence[Any]) -> bool:
        return clip_global is not None or any(s.loss_scaling is not None for s in stages)

    def values(self, stages: Sequence[Any]) -> List[torch.Tensor]:
        """Per stage (its gradients averaged over its replicas already): a 1-D tensor of its
        found-inf flag (after unscaling its gradients) where it scales its loss, then its
        gradient norm where clipping is global."""
        out = []
        for stage in stages:
            parts = []
            if stage.loss_scaling is not None:
                parts.append(unscale(stage))
            if self.clip is not None:
                parts.append(stage.grad_norm())
            last = parts[-1]  # (a flag is 0 or 1 in the norm's dtype)
            out.append(torch.stack([p.to(device=last.device, dtype=last.dtype) for p in parts]))
        return out

    def decide(self, gathered: Sequence[torch.Tensor]) -> Tuple[Optional[torch.Tensor], bool]:
        """(the clipping coefficient, None without global clipping or where skipped; whether the
        update is skipped on every stage) from every stage's :meth:`values`; the scale moves."""
        skip = False
        if self.scalers:
            skip = bool(torch.stack([v[0].cpu() for v in gathered]).any())
            for scaler in self.scalers:
                scaler.update(skip)
        if self.clip is None or skip:
            return None, skip
        return clip_coefficient([v[-1] for v in gathered], self.clip), False


def unscale(stage: Any) -> torch.Tensor:
    """Unscale ``stage``'s gradients by its scaler; its found-inf flag (0-dim, on its device),
    over the shards of every replica where the stage is sharded."""
    found = stage.loss_scaling.unscale([local(g) for g in stage.grads()], stage.device)
    if stage.shards is not None:
        found = stage.shards.any_replica(found)
    stage.unscaled = True
    return found
