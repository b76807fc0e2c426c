"""fp16's dynamic loss scaling across a pipeline: ``torch.amp.GradScaler``'s semantics with one
scale for every stage and every replica (docs/architecture.md, "fp16 and the loss scale").

The last stage multiplies each micro-batch's loss by the scale before its backward (the loss it
reports stays unscaled); the scale travels with nothing. At each update number the executor
agrees, over every stage (:class:`UpdateAgreement`, on the path global clipping takes: the
transport's ``agree``: one all-reduce of a row per stage under torchrun), on one *found-inf*
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
    the update is skipped. :meth:`table` gives this process's part: a float64 tensor of one row
    per stage of the pipeline, this process's stages' rows filled (its found-inf flag, then its
    squared gradient norm), the others zero; the transport sums the processes' tables (one
    all-reduce on the pipeline's group, on the device: each row has one writer, so the sum is
    exact and every rank reads the same rows); :meth:`decide` reads the rows (and moves the
    scale). The clipping coefficient stays on the device (no host wait); a skip is read on the
    host, as ``GradScaler`` reads its found-inf before the optimizer's step."""

    def __init__(self, clip_global: Optional[float], stages: Sequence[Any]) -> None:
        self.clip = clip_global
        #: the distinct scalers of this process's stages (one, unless stages were built by hand)
        self.scalers = list({id(s.loss_scaling): s.loss_scaling for s in stages if s.loss_scaling is not None}.values())
        self._dtype = torch.float32  #: the norms' dtype, which the coefficient is computed in

    @staticmethod
    def needed(clip_global: Optional[float], stages: Sequence[Any]) -> bool:
        return clip_global is not None or any(s.loss_scaling is not None for s in stages)

    def table(self, stages: Sequence[Any]) -> torch.Tensor:
        """This process's rows (its stages' gradients averaged over their replicas already): per
        stage, its found-inf flag (after unscaling its gradients) where it scales its loss, then
        its squared gradient norm where clipping is global; in float64 (a float32 norm squares
        exactly there), which NCCL reduces (float32 on MPS, which has no float64). On the first
        stage's device."""
        device = stages[0].device
        table = torch.zeros(stages[0].num_stages, 2, dtype=torch.float32 if device.type == "mps" else torch.float64,
                            device=device)
        for stage in stages:
            if stage.loss_scaling is not None:
                table[stage.index, 0] = stage.unscale_gradients().to(table.device, table.dtype)
            if self.clip is not None:
                norm = stage.grad_norm()
                self._dtype = norm.dtype
                table[stage.index, 1] = norm.to(table.device, table.dtype).square()
        return table

    def decide(self, table: torch.Tensor) -> Tuple[Optional[torch.Tensor], bool]:
        """(the clipping coefficient, a 0-dim tensor on the table's device, None without global
        clipping or where skipped; whether the update is skipped on every stage) from every
        stage's rows of :meth:`table`; the scale moves. The norm over the pipeline is the square
        root of the rows' squared norms summed (one reduction of one table: the same bits on every
        rank and in one process), in the norms' dtype (one stage: its own norm, bit for bit, as
        ``clip_grad_norm_`` clips it)."""
        skip = False
        if self.scalers:
            skip = bool(table[:, 0].any())
            for scaler in self.scalers:
                scaler.update(skip)
        if self.clip is None or skip:
            return None, skip
        return clip_coefficient(table[:, 1].sum().sqrt().to(self._dtype), self.clip), False


