"""Splitting mini-batches into micro-batches: inputs may be tuples of tensors, or a dict of the
forward's keyword tensors."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

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


def split_batch(inputs: Any, target: torch.Tensor, parts: int,
                count: Optional[Callable[[Any], int]] = None) -> List[Tuple[Any, torch.Tensor, float]]:
    """``parts`` micro-batches along dimension 0, each with its share of the mini-batch loss.

    The share (the micro-batch's items / the mini-batch's, ``count`` counting a target's items;
    None: its samples) makes the accumulated gradient of a loss that is a mean over its items
    equal to the mini-batch's, whatever the split (:func:`shares`).
    """
    size = batch_size(inputs)
    if parts > size:
        raise ValueError(f"cannot split a mini-batch of {size} samples into {parts} micro-batches "
                         f"(use --micro-batches {size} or fewer, or a larger --batch-size)")
    if parts == 1:
        return [(inputs, target, 1.0)]
    pieces = _pieces(inputs, parts)
    targets = torch.tensor_split(target, parts)
    return [(piece, tgt, share) for piece, tgt, share in zip(pieces, targets, shares(item_counts(targets, count)))]


def item_counts(targets: Sequence[Any], count: Optional[Callable[[Any], int]] = None) -> List[int]:
    """The items of each target (``count``'s; None: its samples)."""
    return [count(t) if count is not None else int(t.shape[0]) for t in targets]


def shares(counts: Sequence[int], total: Optional[int] = None, replicas: int = 1) -> List[float]:
    """Each micro-batch's weight in its mini-batch's loss: its items ``counts[m]`` over the items
    of the mini-batches of every replica (``total``; default: this one's), times the replicas
    (whose gradients are averaged): a mean-reduced loss then sums to the mean over every real item
    of the step, as the whole mini-batch's loss is. No items at all: every share 0."""
    total = sum(counts) if total is None else total
    if total == 0:
        return [0.0] * len(counts)
    return [c * replicas / total if replicas != 1 else c / total for c in counts]
