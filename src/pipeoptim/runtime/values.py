"""What crosses a stage boundary: activations and gradients as tensors, tuples of tensors or (a
first stage's keyword inputs) dicts of them, moved to a device, cut from the sender's graph, and
made leaves that collect their gradient on the receiving stage."""
from __future__ import annotations

from typing import Any, Tuple

import torch

from ..compat import tree_map_tensors

Activation = Any  # a tensor, a tuple of tensors, or a dict of keyword tensors


def to_device(value: Activation, device: torch.device) -> Activation:
    """``value`` (nested: ``compat.tensor_leaves``' walk) with its tensors on ``device``;
    tensors already there are returned as they are (no copy). A copy to an accelerator is queued
    (the device's work after it waits for it); a copy to the host is made at once, since the host
    reads it next (a queued one could be read before the values arrive)."""
    return tree_map_tensors(lambda t: t if t.device == device else t.to(device, non_blocking=device.type != "cpu"),
                            value)


def as_tuple(value: Activation) -> Tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def detach_for_send(value: Activation) -> Activation:
    """What crosses a stage boundary: the values, cut from this stage's autograd graph. Not
    pytree's walk: a message is a tensor or a flat tuple (``wire.py``), and another output fails
    here in one process as at the link (passed on, its tensors would get no gradient back)."""
    if isinstance(value, tuple):
        return tuple(v.detach() if torch.is_tensor(v) else v for v in value)
    return value.detach()


def leaf_inputs(value: Activation) -> Activation:
    """Received activations as leaves, floating and complex ones collecting their gradient."""
    return tree_map_tensors(lambda t: t.detach().requires_grad_(True) if t.is_floating_point() or t.is_complex()
                            else t, value)
