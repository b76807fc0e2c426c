"""What crosses a stage boundary, as bytes: the layout of a message and its metadata encoding.

A message is a tensor or a tuple of tensors (entries may be None: a gradient that reached no
input). Its *layout* (tuple or not; per entry dtype and shape) is agreed once per link and
micro-batch *signature* (the shapes of its inputs, which every rank computes from its copy of
the data): the first message of a signature is preceded by its layout, a small int64 tensor.
Also :class:`PipelineCommError`, the error of every failed message or collective.
"""
from __future__ import annotations

import re
from typing import Any, List, Optional, Tuple

import torch

from ..compat import tree_leaves
from .segment import MicroBatch
from .values import as_tuple


# dtype <-> code for the metadata messages
_DTYPES: List[torch.dtype] = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]
_CODE = {d: i for i, d in enumerate(_DTYPES)}
#: the dtypes NCCL carries (torch sends a bool as NCCL's uint8); a tensor of any other crosses as
#: its bytes (:func:`on_the_wire`), so that a link sends only what NCCL can, in either backend
NCCL_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                         torch.int8, torch.uint8, torch.bool})


def on_the_wire(tensor: torch.Tensor) -> torch.Tensor:
    """What a link sends or receives into for ``tensor`` (contiguous): itself, or, for a dtype
    NCCL lacks (complex64 and complex128: a traced model's complex rotary table; int16), a
    uint8 view of its bytes, which the receiver reads into a buffer of the agreed dtype."""
    if tensor.dtype in NCCL_DTYPES:
        return tensor
    return tensor.reshape(-1).view(torch.uint8)

Signature = Tuple[Tuple[int, ...], ...]
#: Agreed layout of one kind of message: is it a tuple, and per entry (dtype, shape) or None.
Layout = Tuple[bool, Tuple[Optional[Tuple[torch.dtype, Tuple[int, ...]]], ...]]


class PipelineCommError(RuntimeError):
    """A message between stages did not arrive or could not be sent (peer hung, died, or
    disagreed on what to send)."""


def wait_for(work: Any, timeout: Any, device: torch.device) -> None:
    """Wait for a point-to-point or collective ``work``. On a GPU (NCCL) without a timeout: the
    wait is then a dependency of the current stream, where one with a timeout makes the CPU
    busy-poll the operation; a hung operation still ends at the group's own timeout (NCCL's
    watchdog). On the CPU (gloo) with ``timeout`` (a ``timedelta``), which gloo's wait honours."""
    if device.type == "cuda":
        work.wait()
    else:
        work.wait(timeout=timeout)


def signature(microbatch: MicroBatch) -> Signature:
    """The key under which a micro-batch's message layouts are agreed: its input shapes, in
    ``compat.tree_leaves``' order (a dict of keyword inputs: its values', in its order), which
    every rank builds alike; a leaf that is no tensor fails here."""
    inputs = microbatch[0]
    if inputs is None:
        raise ValueError("every rank needs the micro-batches' inputs (at least their shapes): load "
                         "the same data on every rank")
    return tuple(tuple(t.shape) for t in tree_leaves(inputs))


def layout_of(value: Any, what: str) -> Layout:
    """The layout of a message (``what``: "activation" or "gradient", for errors): tuple or
    not, and per entry its dtype and shape, or None for an entry without a tensor. Not pytree's
    walk: the receiver rebuilds a tensor or a flat tuple only, so anything else is refused here."""
    entries = []
    for v in as_tuple(value):
        if v is None:
            entries.append(None)
        elif torch.is_tensor(v):
            if v.dtype not in _CODE:
                raise TypeError(f"cannot send a {v.dtype} {what} between stages")
            entries.append((v.dtype, tuple(v.shape)))
        else:
            raise TypeError(f"a {what} crossing a stage boundary must be a tensor or a tuple of "
                            f"tensors, got {type(v).__name__}")
    return isinstance(value, tuple), tuple(entries)


def encode_layout(layout: Layout) -> torch.Tensor:
    """A layout as the int64 tensor of the metadata message that precedes its first message."""
    is_tuple, entries = layout
    codes = [int(is_tuple), len(entries)]
    for e in entries:
        if e is None:
            codes.append(-1)
        else:
            dtype, shape = e
            codes += [_CODE[dtype], len(shape), *shape]
    return torch.tensor(codes, dtype=torch.int64)


def decode_layout(codes: List[int]) -> Layout:
    """The layout a metadata message carries (the inverse of :func:`encode_layout`)."""
    is_tuple, count = bool(codes[0]), codes[1]
    pos, entries = 2, []
    for _ in range(count):
        if codes[pos] == -1:
            entries.append(None)
            pos += 1
        else:
            dtype, ndim = _DTYPES[codes[pos]], codes[pos + 1]
            entries.append((dtype, tuple(codes[pos + 2: pos + 2 + ndim])))
            pos += 2 + ndim
    return is_tuple, tuple(entries)


def reason(error: BaseException) -> str:
    """The gist of a communication error: its last line, without gloo's source location
    ("[.../pair.cc:537] ") and boilerplate advice."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    last = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text.splitlines()[-1])
    return re.split(r"\.?\s+This is typically caused by", last)[0].rstrip(". ")
