"""Activation recomputation: a stage keeps only its input per micro-batch in flight and runs its
forward again when the backward needs what the forward saved (docs/architecture.md, "Activation
recomputation").

Where the weights' storage may hold other values at the backward than at the forward (an update,
a prediction swapped in and out since), the stage keeps a copy from the forward
(:func:`copy_forward_values`), which :func:`forward_values` writes into that storage for the
recomputation only: the recomputed graph saves the same aliases as without recomputation, so the
backward reads the same weights as it would have."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch.utils.checkpoint import checkpoint

#: the weight tensors a forward ran on, each with a copy of the values it had then
KeptValues = List[Tuple[torch.Tensor, torch.Tensor]]


def copy_forward_values(weights: List[torch.Tensor]) -> KeptValues:
    """The weights' values now (during the forward), for the recomputation to run on."""
    with torch.no_grad():
        return [(w, w.detach().clone()) for w in weights]


class forward_values:  # noqa: N801 (used as a context manager, like contextlib's)
    """Within the block the weights' storage holds the forward's values (``kept``; None: it
    already does), after it what it held before; written through ``.data`` so that the saved
    tensors' version counters do not move. Reusable: torch enters it for every recomputation."""

    def __init__(self, kept: Optional[KeptValues], before: Optional[Callable[[], None]] = None) -> None:
        self.kept, self.before = kept, before
        self.now: List[torch.Tensor] = []

    def __enter__(self) -> None:
        if self.kept:
            if self.before is not None:  # a sharded stage: the gathered weights must exist first
                self.before()
            with torch.no_grad():
                self.now = [w.data.clone() for w, _ in self.kept]
                for w, value in self.kept:
                    w.data.copy_(value)

    def __exit__(self, *exc: Any) -> None:
        if self.kept:
            with torch.no_grad():
                for (w, _), value in zip(self.kept, self.now):
                    w.data.copy_(value)
            self.now = []


def checkpointed(fn: Callable[[Any], Any], inputs: Any, kept: Optional[KeptValues],
                 before: Optional[Callable[[], None]] = None) -> Any:
    """``fn(inputs)`` (a tensor or a tuple of them, passed to torch separately, so that it keeps
    their devices' random state) under non-reentrant checkpointing, recomputed on ``kept``
    (:func:`forward_values`; ``before``: called first where ``kept`` is not empty)."""
    is_tuple = isinstance(inputs, tuple)

    def run(*values: Any) -> Any:
        return fn(tuple(values) if is_tuple else values[0])

    def contexts():
        return contextlib.nullcontext(), forward_values(kept, before)

    values = inputs if is_tuple else (inputs,)
    return checkpoint(run, *values, use_reentrant=False, context_fn=contexts)
