"""The bytes a stage's training state takes: measured, and the closed form. Per stage (one rank's
share under torchrun); the weights' closed form is the parameter bytes times the method's
``weight_versions``.
"""
from __future__ import annotations

from typing import Any, Dict

import torch

from ..weights.base import nbytes


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor the optimizer keeps per parameter (after its first step)."""
    return nbytes([v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)])


def state_memory(stage: Any, design_versions: int) -> Dict[str, int]:
    """A stage's state in bytes: ``parameters``, ``gradients`` (the peak, at an update),
    ``optimizer``, ``weight_copies`` (the policy's peak), ``weights`` (parameters + copies),
    ``weights_closed_form`` (parameters x ``design_versions``) and ``total``."""
    parameters = stage.policy.param_bytes  # the trained parameters' bytes, as the policy counts them
    copies = int(stage.policy.copy_bytes_peak)
    report = {"parameters": parameters, "gradients": int(stage.record.grad_bytes_peak),
              "optimizer": optimizer_state_bytes(stage.optimizer), "weight_copies": copies,
              "weights": parameters + copies, "weights_closed_form": parameters * design_versions}
    report["total"] = report["weights"] + report["gradients"] + report["optimizer"]
    return report
