"""The activations a stage holds, measured from the tensors it keeps.

Per micro-batch in flight: what autograd saved in its forward (a ``saved_tensors_hooks`` pack
hook; under recomputation only the stage's input), the received input and its output, until its
backward frees them; the weights and buffers the forward ran on are left out. A tensor counts
the bytes its view spans in its storage, and the tensors of one micro-batch that share a storage
count the span of their union once. :class:`HeldActivations` keeps the sum over the micro-batches
in flight and its peak, what the planner's prediction (:meth:`ModelProfile.held_bytes`) is read
against. The hooks cost a Python call per saved tensor (8 % of a pipelined LM step), so a
micro-batch whose input shape was measured twice with the same bytes is counted without them.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Hashable, Iterable, Iterator, List, Optional, Set, Tuple

import torch

from ..compat import tree_flatten
from ..weights.base import local
from .tensor_parallel import storage_of

Span = Tuple[int, int]  #: first and one-past-last byte of a view, in its storage


def _span(t: torch.Tensor) -> Span:
    """The bytes of its storage that the view ``t`` spans (its offset to its last element)."""
    size = t.element_size()
    if t.numel() == 0:
        return (0, 0)
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    start = t.storage_offset() * size
    return start, start + extent * size


def signature(*values: Any) -> Optional[Tuple[Any, ...]]:
    """The structure of a micro-batch's values (``compat.tree_flatten``'s) and the shape, dtype and
    device of each tensor (None, numbers and strings as they are), what the bytes it holds depend
    on; None where a leaf is anything else."""
    leaves, structure = tree_flatten(values)
    if not all(torch.is_tensor(v) or v is None or isinstance(v, (bool, int, float, str)) for v in leaves):
        return None
    return structure, tuple((tuple(v.shape), v.dtype, v.device) if torch.is_tensor(v) else v for v in leaves)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class HeldActivations:
    """Bytes of activations held per micro-batch in flight, their sum now, and the peaks."""

    def __init__(self) -> None:
        self._spans: Dict[int, Dict[int, Span]] = {}   #: micro-batch -> storage -> span
        self._bytes: Dict[int, int] = {}               #: micro-batch -> bytes it holds
        self._skip: Dict[int, Set[int]] = {}           #: micro-batch -> its weights' storages
        self.now = 0                 #: bytes held by the micro-batches in flight
        self.peak_bytes = 0          #: the largest ``now`` so far
        self.peak_microbatches = 0   #: the most micro-batches in flight at once
        self.microbatch_bytes = 0    #: the most bytes one micro-batch held
        self._measured: Dict[Hashable, List[int]] = {}  #: input signature -> bytes of its measurements
        self._signature: Dict[int, Hashable] = {}      #: micro-batch being measured -> its signature
        self._known: Dict[int, int] = {}               #: micro-batch not measured -> its bytes

    def _add(self, microbatch: int, tensors: Iterable[Any], skip: Set[int]) -> None:
        spans = self._spans.setdefault(microbatch, {})
        for t in tensors:
            if not torch.is_tensor(t) or t.device.type == "meta":
                continue
            t = storage_of(t)  # a stage split over tensor ranks: this process's part
            key = t.untyped_storage().data_ptr()
            if key in skip or key == 0:
                continue
            lo, hi = _span(t)
            old = spans.get(key)
            spans[key] = (lo, hi) if old is None else (min(lo, old[0]), max(hi, old[1]))

    def known_bytes(self, signature: Optional[Hashable]) -> Optional[int]:
        """The bytes a micro-batch of ``signature`` holds, where two measurements agreed."""
        seen = self._measured.get(signature) if signature is not None else None
        return seen[0] if seen is not None and len(seen) >= 2 and seen[0] == seen[1] else None

    @contextlib.contextmanager
    def forward(self, microbatch: int, weights: Callable[[], Iterable[torch.Tensor]] | Iterable[torch.Tensor],
                signature: Optional[Hashable] = None, refresh: bool = False) -> Iterator[None]:
        """Record what autograd saves within the block for ``microbatch``, less ``weights`` (or a
        function that gives them, asked again for an unknown tensor with ``refresh``); a known
        ``signature`` skips the hooks."""
        known = self.known_bytes(signature)
        if known is not None:
            self._known[microbatch] = known
            yield
            return
        if signature is not None:
            self._signature[microbatch] = signature
        skip: Set[int] = set()
        saved: List[torch.Tensor] = []

        def is_weight(t: torch.Tensor) -> bool:
            ptr = storage_of(t).untyped_storage().data_ptr()
            if ptr not in skip and (refresh or not skip):  # read inside the forward: a sharded
                # stage's weights are those FSDP gathers for it, after the forward's first saves
                skip.update(local(w).untyped_storage().data_ptr() for w in (weights() if callable(weights) else weights))
            return ptr in skip

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not is_weight(t):
                saved.append(t)
            # A detached alias, not ``t``: a saved output points to the node that saves it, so
            # keeping ``t`` makes a cycle of C++ references Python's collector cannot see, which
            # a split backward (retain_graph) never breaks: every micro-batch's graph leaked.
            return t.detach()

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                yield
            self._skip[microbatch] = skip
            self._add(microbatch, saved, skip)
        finally:
            # every saved value keeps the hooks, and ``pack`` this list: emptied, it holds no
            # tensor (the same cycle, through the forward's original tensors)
            saved.clear()

    def keep(self, microbatch: int, tensors: Iterable[Any]) -> None:
        """Also count ``tensors`` (the received input, the output) for ``microbatch``, then close its count."""
        if microbatch in self._known:
            held = self._known.pop(microbatch)
        else:
            self._add(microbatch, tensors, self._skip.pop(microbatch, set()))
            held = sum(hi - lo for lo, hi in self._spans.pop(microbatch, {}).values())
            signature = self._signature.pop(microbatch, None)
            if signature is not None and len(seen := self._measured.setdefault(signature, [])) < 2:
                seen.append(held)
        self._bytes[microbatch] = held
        self.now += held
        self.peak_bytes = max(self.peak_bytes, self.now)
        self.peak_microbatches = max(self.peak_microbatches, len(self._bytes))
        self.microbatch_bytes = max(self.microbatch_bytes, held)

    def release(self, microbatch: int) -> None:
        """``microbatch``'s backward is over: what it held is freed."""
        self.now -= self._bytes.pop(microbatch, 0)

    def report(self) -> Dict[str, int]:
        return {"peak_bytes": self.peak_bytes, "peak_microbatches": self.peak_microbatches,
                "microbatch_bytes": self.microbatch_bytes}
