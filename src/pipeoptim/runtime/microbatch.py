"""Splitting mini-batches into micro-batches: inputs may be tuples of tensors, or a dict of the
forward's keyword tensors; each micro-batch's share of its mini-batch's loss (:class:`Weighing`).
A mini-batch whose tensors disagree on their rows (a target of 6 rows for 8 inputs) is refused
at the split, naming the user's sizes rather than the micro-batches'."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..batches import Normalization, item_counter
from ..compat import tensor_leaves, tree_flatten, tree_unflatten
from ..errors import on_command_line, option


def batch_size(inputs: Any) -> int:
    """A mini-batch's samples: the first dimension of its inputs' first tensor (``compat.tensor_leaves``)."""
    return int(tensor_leaves(inputs)[0].shape[0])


def leading_rows(value: Any) -> Optional[int]:
    """A micro-batch's rows read off its first tensor (a dict's first value, a tuple's first item)
    without a walk of its structure, for an error to name them (None: no tensor there)."""
    if isinstance(value, dict):
        value = next(iter(value.values()), None)
    elif isinstance(value, (tuple, list)):
        value = value[0] if value else None
    return int(value.shape[0]) if isinstance(value, torch.Tensor) and value.dim() else None


def samples(inputs: Any, target: Any) -> int:
    """A mini-batch's weight in a mean over the samples: its samples."""
    return batch_size(inputs)


def _pieces(inputs: Any, parts: int) -> List[Any]:
    """``inputs`` cut into ``parts`` along dimension 0: every tensor of a tuple or a dict alike,
    each piece of its inputs' own structure (``compat.tree_flatten``)."""
    leaves, structure = tree_flatten(inputs)
    cut = [torch.tensor_split(leaf, parts) for leaf in leaves]
    return [tree_unflatten([pieces[j] for pieces in cut], structure) for j in range(parts)]


def split_batch(inputs: Any, target: torch.Tensor, parts: int,
                count: Optional[Callable[[Any], int]] = None) -> List[Tuple[Any, torch.Tensor, float]]:
    """``parts`` micro-batches along dimension 0, each with its share of the mini-batch loss.

    The share (the micro-batch's items / the mini-batch's, ``count`` counting a target's items;
    None: its samples) makes the accumulated gradient of a loss that is a mean over its items
    equal to the mini-batch's, whatever the split (:func:`shares`).
    """
    _check_parts(inputs, parts, target)
    if parts == 1:
        return [(inputs, target, 1.0)]
    pieces, targets = _cut(inputs, target, parts)
    return list(zip(pieces, targets, shares(item_counts(targets, count))))


def _check_parts(inputs: Any, parts: int, target: Any = None) -> None:
    """A mini-batch that splits into ``parts`` micro-batches: as many samples at least, and (where
    it is split) the same rows in every tensor cut, the target's too (:func:`_check_rows`)."""
    leaves = tensor_leaves(inputs)
    size = int(leaves[0].shape[0])
    if parts > 1:
        _check_rows(inputs, leaves, target, size, parts)
    if parts > size:
        larger = f"a larger {option('batch_size')}" if on_command_line() else "larger mini-batches"
        raise ValueError(f"cannot split a mini-batch of {size} samples into {parts} micro-batches "
                         f"(use {option('micro_batches', size)} or fewer, or {larger})")


def _check_rows(inputs: Any, leaves: List[torch.Tensor], target: Any, size: int, parts: int) -> None:
    """Every tensor of the mini-batch that the split cuts along dimension 0 (each of at least one
    dimension) holds ``size`` rows, the first input's; else a ValueError in the user's sizes (a
    0-dim tensor or another value is no row of anything, and left as the split takes it)."""
    if all(leaf.shape[0] == size for leaf in leaves if leaf.dim()) and \
            (not torch.is_tensor(target) or not target.dim() or target.shape[0] == size):
        return
    rows = _rows_by_name(inputs, target)
    first = next(name for name, n in rows if n == size)
    name, n = next((name, n) for name, n in rows if n != size)
    raise ValueError(f"{name} has {n} rows but {first} has {size}: every tensor of a mini-batch holds one "
                     f"row per sample along dimension 0, where it is split into {parts} micro-batches; "
                     f"give {name} {size} rows, one per sample of {first}")


def _rows_by_name(inputs: Any, target: Any) -> List[Tuple[str, int]]:
    """(how a refusal names it, its rows) of each tensor of the mini-batch of at least one
    dimension: the inputs (a dict's by key, a tuple's by position), then the target."""
    if isinstance(inputs, dict):
        named = [(f"batch[{key!r}]", value) for key, value in inputs.items()]
    elif isinstance(inputs, (tuple, list)):
        named = [(f"inputs[{j}]", value) for j, value in enumerate(inputs)]
    else:
        named = [("the input tensor", inputs)]
    named.append(("the target", target))
    return [(name, int(t.shape[0])) for name, value in named for t in tensor_leaves(value) if t.dim()]


def _cut(inputs: Any, target: Any, parts: int) -> Tuple[List[Any], List[Any]]:
    """The micro-batches' inputs and targets, ``parts`` of each along dimension 0."""
    return _pieces(inputs, parts), list(torch.tensor_split(target, parts))


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
    return [c * replicas / total for c in counts]  # (c * 1 is c: one replica's shares are c / total)


class Weighing:
    """A Pipeline's ``loss_normalization`` at work: each micro-batch's share of its mini-batch's
    loss, over the items of every replica's mini-batch, and what an evaluation's batch weighs
    (docs/architecture.md, "Every real item weighed once")."""

    def __init__(self, normalization: Normalization, model: Optional[nn.Module] = None,
                 own_loss: bool = False) -> None:
        #: a target's real items (None: its rows)
        self.count = item_counter(normalization, model, own_loss)

    def split(self, inputs: Any, target: Any, parts: int, world: Any) -> List[Tuple[Any, Any, float]]:
        """The mini-batch as ``parts`` micro-batches ``(inputs, target, share)``; with replicas
        (whose gradients are averaged and whose mini-batches may hold different numbers of items)
        the shares are over the items of all of them (``world.replica_total``)."""
        if world.replicas == 1:
            return split_batch(inputs, target, parts, self.count)
        _check_parts(inputs, parts, target)
        pieces, targets = _cut(inputs, target, parts)
        counts = item_counts(targets, self.count)  # counted once: the share needs every replica's total
        total = world.replica_total(sum(counts), "counting the items of the replicas' mini-batches")
        return list(zip(pieces, targets, shares(counts, total, world.replicas)))

    def evaluation(self, metric: Optional[Callable]) -> Callable[[Any, Any], int]:
        """What an evaluation's mini-batch weighs in its mean: the loss's real items as training
        counts them (without a metric), else its samples."""
        count = self.count
        if metric is not None or count is None:
            return samples
        return lambda inputs, target: count(target)
