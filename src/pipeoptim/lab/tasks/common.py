"""Small helpers shared by the tasks: batching, seeding, evaluation mode and the cache folder.

Nothing here knows about a particular data set; each function does one plain thing so that a
task module reads as "load arrays, batch them, build a model".
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterable, Iterator, List, Tuple, Union

import torch
from torch import nn

#: A model input: one tensor, or a tuple of tensors that share the batch dimension.
Inputs = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


def cache_dir(subdir: str | None = None) -> Path:
    """The cache folder: ``$PIPEOPTIM_CACHE`` or ``~/.cache/pipeoptim`` (created if missing).

    With ``subdir`` the named folder inside it is returned (and created).
    """
    path = Path(os.environ.get("PIPEOPTIM_CACHE") or Path.home() / ".cache" / "pipeoptim")
    if subdir:
        path = path / subdir
    path.mkdir(parents=True, exist_ok=True)
    return path


def seeded_permutation(n: int, seed: int) -> List[int]:
    """A permutation of ``range(n)`` that depends only on ``n`` and ``seed``.

    It is ``torch.randperm(n)`` drawn from a private generator seeded with ``seed``, so the global
    random state is neither read nor changed.
    """
    generator = torch.Generator().manual_seed(int(seed))
    return torch.randperm(n, generator=generator).tolist()


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with torch's global (CPU) generator seeded with ``seed``.

    The generator's previous state is restored on exit, so building a model inside
    ``with seeded(s):`` gives the same parameters every time and leaves other random draws of the
    program unaffected.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        yield


def batchify(x: Inputs, y: torch.Tensor, batch_size: int, drop_last: bool) -> List[Tuple[Inputs, torch.Tensor]]:
    """Cut ``(x, y)`` along dimension 0 into mini-batches of ``batch_size``, in order.

    ``x`` is a tensor or a tuple of tensors with the same first dimension as ``y``. With
    ``drop_last`` a final incomplete batch is dropped, so every batch has exactly ``batch_size``
    examples (micro-batch splitting then stays even); otherwise the last batch may be smaller.
    Each batch owns its memory (a copy, not a view of the whole data set), so pickling or
    sending one batch never carries the rest of the data along.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    n = y.shape[0]
    parts = x if isinstance(x, tuple) else (x,)
    for part in parts:
        if part.shape[0] != n:
            raise ValueError(f"inputs have {part.shape[0]} examples but targets have {n}")
    end = n - n % batch_size if drop_last else n
    batches: List[Tuple[Inputs, torch.Tensor]] = []
    for start in range(0, end, batch_size):
        stop = min(start + batch_size, end)
        xs = tuple(part[start:stop].clone() for part in parts)
        batches.append((xs if isinstance(x, tuple) else xs[0], y[start:stop].clone()))
    return batches


@contextlib.contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put ``model`` in eval mode under ``torch.no_grad()`` for the block.

    On exit every submodule gets back its own previous ``training`` flag (not merely the root's),
    so a model that was partly in eval mode stays exactly as it was.
    """
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        for module, flag in flags:
            module.training = flag


def classification_accuracy(model: nn.Module, batches: Iterable[Tuple[Inputs, torch.Tensor]]) -> float:
    """The fraction of examples in ``batches`` whose arg-max output (last dim) equals the target.

    Evaluated in eval mode without gradients; the model's training flags are restored afterwards.
    Returns 0.0 for no examples.
    """
    correct = 0
    total = 0
    with evaluation_mode(model):
        for x, y in batches:
            prediction = model(x).argmax(dim=-1)
            correct += int((prediction == y).sum())
            total += int(y.numel())
    return correct / total if total else 0.0


def batch_accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The fraction of one mini-batch's examples whose arg-max output (last dim) equals the
    target, in float64 (its mean over the mini-batches, weighted by their sizes, is
    :func:`classification_accuracy` to the last bits)."""
    return (output.argmax(dim=-1) == target).double().mean()


def count_parameters(model: nn.Module) -> int:
    """The number of scalar parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "Inputs",
    "batchify",
    "cache_dir",
    "classification_accuracy",
    "count_parameters",
    "evaluation_mode",
    "seeded",
    "seeded_permutation",
]
