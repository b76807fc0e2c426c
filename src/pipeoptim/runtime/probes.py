"""The prediction-error diagnostic of one stage (``diagnose_every``): how far the weights a
forward ran on were from those live at its backward, against the stale weights' distance.

Every K-th micro-batch (by its number in the run), the stage keeps, at its forward, the weights
the forward would have used unpredicted (W_stale), those it used (W_used), and with delay
corrections on, those it would have used with none of them and without each; at its backward it
measures each against the weights live then (W_b). The copies cost memory and time only on the
probed micro-batches.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch


class PredictionProbes:
    """The probes of one stage's weight policy; ``every`` = 0 is off."""

    def __init__(self) -> None:
        self.every = 0
        #: one row per probed micro-batch, at its backward
        self.rows: List[Dict[str, Any]] = []
        self._open: Dict[int, Tuple[List[torch.Tensor], Dict[str, List[torch.Tensor]]]] = {}
        self._used: Dict[int, Tuple[List[torch.Tensor], int, float]] = {}

    def before_forward(self, microbatch: int, number: int, policy: Any) -> bool:
        """Before ``microbatch``'s forward (``number``: its number in the run): whether it is
        probed; if so, W_stale and the variants are kept."""
        if not self.every or number % self.every:
            return False
        stale = [p.detach().clone() for _, p in policy.named]
        variants = getattr(policy, "prediction_variants", lambda _: {})(microbatch)
        self._open[microbatch] = (stale, variants)
        return True

    def forward_weights(self, microbatch: int, use: Any, policy: Any) -> None:
        """The weights the probed forward runs on (``use``, the policy's)."""
        used = [w.detach().clone() for w in ([p for _, p in policy.named] if use.direct else use.weights.values())]
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
        norm = torch.sqrt(sum((b.double() ** 2).sum() for b in now))
        dist = lambda xs: float(torch.sqrt(sum(((x.double() - b.double()) ** 2).sum()  # noqa: E731
                                               for x, b in zip(xs, now))) / norm)
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
