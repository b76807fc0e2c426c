"""The prediction-error diagnostic of one stage (``diagnose_every``): how far the weights a
forward ran on were from those live at its backward, against the stale weights' distance.

Every K-th micro-batch (by its number in the run), the stage keeps at its forward the weights it
would have used unpredicted (W_stale), those it used (W_used), and with delay corrections on,
those with none of them and without each; at its backward it measures each against the weights
live then (W_b), the norms accumulated in float64.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

from ..compat import is_dtensor
from ..weights.fused import clone_all, norms64
from .interfaces import PredictsVariants


def norm_of(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of ``tensors`` taken as one vector, accumulated in float64: one multi-tensor
    norm per tensor, then the norm of those (a DTensor's over all its shards); 0 for none."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    return torch.linalg.vector_norm(torch.stack(norms64(tensors)))


def relative_distance(copies: List[torch.Tensor], live: Sequence[torch.Tensor], live_norm: torch.Tensor) -> float:
    """||copies - live|| / ||live||, the difference taken in ``copies`` (the probe's own, spent)."""
    if copies:
        torch._foreach_sub_(copies, list(live))
    value = norm_of(copies) / live_norm
    return float(value.full_tensor() if is_dtensor(value) else value)  # a DTensor's: whole


class PredictionProbes:
    """The probes of one stage's weight policy; ``every`` = 0 is off."""

    def __init__(self, every: int = 0) -> None:
        self.every = every  #: every how many micro-batches (by their number in the run) a probe runs
        #: one row per probed micro-batch, at its backward
        self.rows: List[Dict[str, Any]] = []
        self._open: Dict[int, Tuple[List[torch.Tensor], Dict[str, List[torch.Tensor]]]] = {}
        self._used: Dict[int, Tuple[List[torch.Tensor], int, float]] = {}

    def before_forward(self, microbatch: int, number: int, policy: Any) -> bool:
        """Before ``microbatch``'s forward (``number``: its number in the run): whether it is
        probed; if so, W_stale and the variants are kept."""
        if not self.every or number % self.every:
            return False
        stale = clone_all([p for _, p in policy.named])
        variants = policy.prediction_variants(microbatch) if isinstance(policy, PredictsVariants) else {}
        self._open[microbatch] = (stale, variants)
        return True

    def forward_weights(self, microbatch: int, use: Any, policy: Any) -> None:
        """The weights the probed forward runs on (``use``, the policy's)."""
        used = clone_all([p for _, p in policy.named] if use.direct else list(use.weights.values()))
        self._used[microbatch] = (used, use.version, use.steps)

    @torch.no_grad()
    def at_backward(self, microbatch: int, number: int, policy: Any) -> None:
        """At ``microbatch``'s backward: the prediction error ||W_used - W_b|| and the staleness
        error ||W_stale - W_b||, both relative to ||W_b||, and each variant's."""
        if microbatch not in self._used:
            return
        stale, variants = self._open.pop(microbatch)
        used, version, steps = self._used.pop(microbatch)
        now = [p.detach() for _, p in policy.named]
        norm = norm_of(now)
        dist = lambda xs: relative_distance(xs, now, norm)  # noqa: E731
        row = {"microbatch": number, "steps": float(steps), "updates": policy.version - version,
               "prediction_error": dist(used), "staleness_error": dist(stale)}
        if variants:
            row["variants"] = {name: dist(weights) for name, weights in variants.items()}
        self.rows.append(row)

    def summary(self, start: int = 0) -> Dict[str, Any]:
        """Means over the probed micro-batches (from the ``start``-th probe on) that saw at least
        one update before their backward."""
        rows = [d for d in self.rows[start:] if d["updates"] > 0]
        if not rows:
            return {"probes": 0}
        mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
        summary = {"probes": len(rows), "prediction_error": mean("prediction_error"),
                   "staleness_error": mean("staleness_error")}
        names = [name for name in rows[-1].get("variants", {}) if all(name in r.get("variants", {}) for r in rows)]
        if names:  # the same probes, predicted with none of the corrections / without one
            summary["variants"] = {name: sum(r["variants"][name] for r in rows) / len(rows) for name in names}
        return summary
