"""One link of the transport: one direction of traffic between two neighbouring stages.

Sends are ``dist.isend``, their handles kept by the caller until waited on (gloo's send is a
rendezvous: a blocking send in a 1F1B loop deadlocks). Receives are ``dist.irecv`` posted ahead
(``prefetch`` per link) into buffers of the agreed layout (:mod:`~pipeoptim.runtime.wire`),
so that a message lands while the stage computes. Every wait has a timeout and fails with a
:class:`~pipeoptim.runtime.wire.PipelineCommError` naming the message.
"""
from __future__ import annotations

import datetime
import time
from collections import OrderedDict, deque
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..compat import HAS_STORAGE_USE_COUNT, storage_use_count
from ..errors import option
from .values import as_tuple
from .wire import (Layout, PipelineCommError, Signature, decode_layout, encode_layout, layout_of, on_the_wire, reason,
                   wait_for)

#: a kept receive buffer: the tensor, its storage, and the storage's references when only the pool holds it
Kept = Tuple[torch.Tensor, Any, int]


class ReceiveBuffers:
    """One link's receive buffers, reused across messages of the same dtype and shape.

    A received tensor may be held long after its message (by the autograd graph, a ``.grad``
    made of it, a send that aliases it), so a buffer is reused only when nothing but this pool
    holds its memory: its storage's reference count is back to what the pool alone holds. Its
    next message then overwrites all of it, so reuse changes no number (on a GPU too: NCCL's
    receive waits for the work queued before it on the current stream). Up to :attr:`per_shape`
    buffers are kept for each of the :attr:`shapes` most recently received shapes."""

    #: buffers kept per (dtype, shape); 0: none (every message gets a new one)
    per_shape = 16
    #: (dtype, shape)s kept, the least recently used forgotten beyond
    shapes = 4

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._kept: "OrderedDict[Tuple[torch.dtype, Tuple[int, ...]], List[Kept]]" = OrderedDict()
        self.made = 0    #: buffers made
        self.reused = 0  #: messages received into a buffer made for an earlier one

    def take(self, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
        """A tensor of ``dtype`` and ``shape`` to receive into: a kept buffer's alias if one is
        free, else a new tensor."""
        key = (dtype, shape)
        kept = self._kept.get(key)
        if kept is not None:
            self._kept.move_to_end(key)
            for buffer, storage, alone in kept:
                if storage_use_count(storage) == alone:
                    self.reused += 1
                    return buffer.detach()
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        self.made += 1
        if not HAS_STORAGE_USE_COUNT or self.per_shape <= 0:
            return buffer
        if kept is None:
            kept = self._kept[key] = []
            while len(self._kept) > self.shapes:
                self._kept.popitem(last=False)  # still in use elsewhere: it lives on there
        if len(kept) >= self.per_shape:
            return buffer
        storage = buffer.untyped_storage()
        kept.append((buffer, storage, storage_use_count(storage)))
        return buffer.detach()

    def clear(self) -> None:
        """Forget every kept buffer (those in use live on with their users)."""
        self._kept.clear()


class Link:
    """One direction of traffic between two neighbouring stages (a process group and a tag;
    ``peer``: the global rank of the other end)."""

    def __init__(self, what: str, peer: int, group, tag: int, device: torch.device, timeout: float,
                 prefetch: int) -> None:
        self.what = what  # "activation" or "gradient"
        self.peer = peer
        self.group = group
        self.tag = tag
        self.wait_timeout = datetime.timedelta(seconds=timeout)
        self.device = device
        self.timeout = timeout
        self.prefetch = prefetch
        self.layouts: Dict[Signature, Layout] = {}
        self._nbytes: Dict[Signature, int] = {}  # payload bytes per agreed layout (stats)
        self.stats = {"wait_seconds": 0.0, "messages": 0, "bytes": 0}
        self.buffers = ReceiveBuffers(device)
        self.expected: Deque[Tuple[int, Signature]] = deque()
        self.posted: Deque[Tuple[int, Signature, List[Optional[torch.Tensor]], List[Any]]] = deque()

    def fail(self, doing: str, microbatch: int, error: BaseException) -> PipelineCommError:
        return PipelineCommError(
            f"{doing} the {self.what} of micro-batch {microbatch} (peer: rank {self.peer}) failed: "
            f"{reason(error)}. A peer stage hung, died or is slower than the timeout ({self.timeout:g} s); "
            f"see its own error, or raise {option('timeout')} if stages are merely slow")

    def send(self, microbatch: int, key: Signature, value: Any, pending: Deque) -> None:
        """Send ``value`` (its layout first, the first time ``key`` is sent), each tensor's work
        appended to ``pending`` with the tensor, until waited on."""
        try:
            layout = self.layouts.get(key)
            if layout is None:
                layout = self.layouts[key] = layout_of(value, self.what)
                meta = encode_layout(layout).to(self.device)
                size = torch.tensor([meta.numel()], dtype=torch.int64, device=self.device)
                for t in (size, meta):
                    pending.append((self._isend(t), t, self, microbatch))
            is_tuple, entries = layout
            values = as_tuple(value)
            if len(values) != len(entries) or isinstance(value, tuple) != is_tuple:
                raise PipelineCommError(f"{self.what} of micro-batch {microbatch} has {len(values)} "
                                        f"entries, but {len(entries)} were agreed for its input shapes")
            for v, e in zip(values, entries):
                if e is None:
                    if v is not None:
                        raise PipelineCommError(
                            f"{self.what} of micro-batch {microbatch} carries a tensor where the first "
                            f"micro-batch of its shape had none")
                    continue
                dtype, shape = e
                if v is None:  # a gradient that did not reach this input this time: it is zero
                    v = torch.zeros(shape, dtype=dtype, device=self.device)
                elif tuple(v.shape) != shape or v.dtype != dtype:
                    raise PipelineCommError(
                        f"{self.what} of micro-batch {microbatch} is {v.dtype} {tuple(v.shape)}, but "
                        f"{dtype} {shape} was agreed for micro-batches of input shapes {key}: the "
                        f"stage's output shape must depend only on its input shapes")
                t = v.detach().contiguous()
                pending.append((self._isend(on_the_wire(t)), t, self, microbatch))
                self.stats["bytes"] += t.numel() * t.element_size()
            self.stats["messages"] += 1
        except PipelineCommError:
            raise
        except RuntimeError as error:
            raise self.fail("sending", microbatch, error) from error

    def _isend(self, tensor: torch.Tensor):
        return dist.isend(tensor, dst=self.peer, group=self.group, tag=self.tag)

    def _irecv(self, tensor: torch.Tensor):
        return dist.irecv(tensor, src=self.peer, group=self.group, tag=self.tag)

    def wait(self, work) -> None:
        start = time.perf_counter()
        try:
            wait_for(work, self.wait_timeout, self.device)
        finally:
            self.stats["wait_seconds"] += time.perf_counter() - start

    def post(self) -> None:
        """Post receives for the next expected messages whose layout is known."""
        i = -1
        try:
            while self.expected and len(self.posted) < self.prefetch:
                i, key = self.expected[0]
                layout = self.layouts.get(key)
                if layout is None:  # its metadata comes first on the wire: receive it when due
                    return
                self.expected.popleft()
                buffers = [None if e is None else self.buffers.take(e[0], e[1]) for e in layout[1]]
                self.posted.append((i, key, buffers, [self._irecv(on_the_wire(b)) for b in buffers if b is not None]))
        except RuntimeError as error:
            raise self.fail("receiving", i, error) from error

    def recv(self, microbatch: int, key: Signature) -> Any:
        try:
            if not self.posted:
                self.post()
            if not self.posted:
                if not self.expected or self.expected[0] != (microbatch, key):
                    raise PipelineCommError(f"{self.what} link: micro-batch {microbatch} was not expected now")
                # first message of a new signature: its metadata precedes it
                size = torch.empty(1, dtype=torch.int64, device=self.device)
                self.wait(self._irecv(size))
                meta = torch.empty(int(size.item()), dtype=torch.int64, device=self.device)
                self.wait(self._irecv(meta))
                self.layouts[key] = decode_layout(meta.tolist())
                self.post()
            i, got_key, buffers, works = self.posted.popleft()
            if (i, got_key) != (microbatch, key):
                raise PipelineCommError(f"{self.what} link: expected micro-batch {i} next, the "
                                        f"schedule asks for {microbatch}")
            for w in works:
                self.wait(w)
            stats = self.stats
            stats["messages"] += 1
            nbytes = self._nbytes.get(key)
            if nbytes is None:
                nbytes = self._nbytes[key] = sum(b.numel() * b.element_size() for b in buffers if b is not None)
            stats["bytes"] += nbytes
            self.post()
        except PipelineCommError:
            raise
        except RuntimeError as error:
            raise self.fail("receiving", microbatch, error) from error
        is_tuple, _ = self.layouts[key]
        return tuple(buffers) if is_tuple else buffers[0]
