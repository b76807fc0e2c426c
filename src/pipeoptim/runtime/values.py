"""What crosses a stage boundary: activations and gradients as tensors, tuples of tensors or (a
first stage's keyword inputs) dicts of them, moved to a device, cut from the sender's graph, and
made leaves that collect their gradient on the receiving stage."""
from __future__ import annotations

from typing import Any, Tuple

import torch

Activation = Any  # a tensor, a tuple of tensors, or a dict of keyword tensors


def to_device(value: Activation, device: torch.device) -> Activation:
    """``value`` (a tensor, a tuple of them, or anything else) with its tensors on ``device``;
    tensors already there are returned as they are (no copy). A copy to an accelerator is queued
    (the device's work after it waits for it); a copy to the host is made at once, since the host
    reads it next (a queued one could be read before the values arrive)."""
    if torch.is_tensor(value):
        return value if value.device == device else value.to(device, non_blocking=device.type != "cpu")
    if isinstance(value, tuple):
        return tuple(to_device(v, device) for v in value)
    if isinstance(value, dict):  # a first stage's keyword inputs
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def as_tuple(value: Activation) -> Tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def detach_for_send(value: Activation) -> Activation:
    """What crosses a stage boundary: the values, cut from this stage's autograd graph."""
    if isinstance(value, tuple):
        return tuple(v.detach() if torch.is_tensor(v) else v for v in value)
    return value.detach()


def leaf_inputs(value: Activation) -> Activation:
    """Received activations as leaves, floating and complex ones collecting their gradient."""
    def leaf(v):
        if torch.is_tensor(v) and (v.is_floating_point() or v.is_complex()):
            return v.detach().requires_grad_(True)
        return v
    return tuple(leaf(v) for v in value) if isinstance(value, tuple) else leaf(value)
