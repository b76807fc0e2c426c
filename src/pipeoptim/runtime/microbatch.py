"""Splitting mini-batches into micro-batches: inputs may be tuples of tensors, or a dict of the
forward's keyword tensors."""
from __future__ import annotations

from typing import Any, List, Tuple

import torch


def batch_size(inputs: Any) -> int:
    if isinstance(inputs, dict):
        first = next(iter(inputs.values()))
    else:
        first = inputs[0] if isinstance(inputs, tuple) else inputs
    return int(first.shape[0])


def _pieces(inputs: Any, parts: int) -> List[Any]:
    """``inputs`` cut into ``parts`` along dimension 0: every tensor of a tuple or a dict alike."""
    if isinstance(inputs, dict):
        cut = {key: torch.tensor_split(value, parts) for key, value in inputs.items()}
        return [{key: pieces[j] for key, pieces in cut.items()} for j in range(parts)]
    if isinstance(inputs, tuple):
        return list(zip(*(torch.tensor_split(t, parts) for t in inputs)))
    return list(torch.tensor_split(inputs, parts))


def split_batch(inputs: Any, target: torch.Tensor, parts: int) -> List[Tuple[Any, torch.Tensor, float]]:
    """``parts`` micro-batches along dimension 0, each with its share of the mini-batch loss.

    The share (micro size / mini-batch size) makes the accumulated gradient of a mean-reduced
    loss equal to the mini-batch's, whatever the split.
    """
    size = batch_size(inputs)
    if parts > size:
        raise ValueError(f"cannot split a mini-batch of {size} samples into {parts} micro-batches "
                         f"(use --micro-batches {size} or fewer, or a larger --batch-size)")
    if parts == 1:
        return [(inputs, target, 1.0)]
    pieces = _pieces(inputs, parts)
    targets = torch.tensor_split(target, parts)
    return [(piece, tgt, tgt.shape[0] / size) for piece, tgt in zip(pieces, targets)]
