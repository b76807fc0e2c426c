"""Muon's update direction, as ``torch.optim.Muon`` computes its step (docs/architecture.md,
"The prediction per optimizer").

torch's Muon step on a 2-D parameter W with gradient g and momentum buffer m::

    m <- m.lerp(g, 1 - mu)                       (m = mu * m + (1 - mu) * g)
    u  = g.lerp(m, mu) under Nesterov, else m
    O  = NS(u)                                   (Newton-Schulz, in bfloat16)
    W <- (1 - lr * wd) * W - lr * r * O          (r from adjust_lr_fn and W's shape)

so Delta relative to the group lr is ``r * O + wd * W_before``. This module computes ``r * O``
from the gradient and the buffer after the step with torch's own (private, through
:mod:`pipeoptim.compat`) Newton-Schulz and ratio functions, so the same bits; the Predictor adds
the decoupled decay as for AdamW.
"""
from __future__ import annotations

from typing import Any, Dict

import torch

from ..compat import muon_lr_ratio, muon_orthogonalize


def muon_direction(group: Dict[str, Any], param: torch.Tensor, buf: torch.Tensor, g: torch.Tensor) -> None:
    """In place: ``g`` (the step's gradient) becomes ``r * NS(u)`` for ``param`` of ``group``,
    ``buf`` being the momentum buffer after the step."""
    update = g.lerp(buf, group["momentum"]) if group["nesterov"] else buf
    ortho = muon_orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
    ratio = muon_lr_ratio(group["adjust_lr_fn"], param.shape)
    g.copy_(ortho).mul_(ratio)
