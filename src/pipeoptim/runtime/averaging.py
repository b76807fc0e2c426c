"""Pipeline x data parallel: one stage's gradients averaged over the replicas of the pipeline."""
from __future__ import annotations

import datetime
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..compat import is_dtensor
from ..weights.fused import local
from .tensor_parallel import in_layout
from .wire import PipelineCommError, reason, wait_for


class GradientAverager:
    """Averages one stage's gradients over the replicas of the pipeline (``all_reduce`` on the
    group of that stage's ranks, sum then divide, before every update), so that weights,
    optimizer state, weight versions and predictions stay identical across replicas.

    During the last backward before an update (:meth:`overlap`), each parameter is announced
    (:meth:`ready`, or :meth:`ready_all` for a split backward's weight group) as soon as its
    gradient is final, and every ``bucket_bytes`` of them are reduced asynchronously while the
    rest of the backward runs; the update (:meth:`__call__`) reduces what is left and waits for
    all. Every replica runs the same graph, so the buckets go out in the same order."""

    #: gradient bytes per asynchronous reduction (the default of new averagers)
    bucket_bytes = 1 << 22

    def __init__(self, group, replicas: int, timeout: float, bucket_bytes: Optional[int] = None,
                 mean: bool = True) -> None:
        """``mean=False``: the sum over the group, not the mean (a bidirectional run's two
        replicas of a piece, runtime/replicas.py: each holds half the mini-batch's gradient)."""
        self.group, self.replicas, self.timeout, self.mean = group, replicas, timeout, mean
        if bucket_bytes is not None:
            self.bucket_bytes = bucket_bytes
        self.overlapping = False
        self._reset()

    def _reset(self) -> None:
        self._bucket: List[torch.Tensor] = []
        self._bucket_size = 0  # bytes of the gradients in _bucket
        self._in_flight: List[Tuple[Any, torch.Tensor, List[torch.Tensor]]] = []
        self._sent: Dict[int, torch.Tensor] = {}

    def close(self) -> None:
        """Forget the group and any reduction in flight (the process's part of the job ended;
        see :meth:`PipeComm.close`)."""
        self.group = None
        self._reset()

    def overlap(self) -> None:
        """The next backward is the last before an update: reduce gradients as they are final."""
        self.overlapping = True

    def ready(self, param: torch.Tensor) -> None:
        """``param``'s gradient is final for this update (called from autograd hooks)."""
        if not self.overlapping:
            return
        if id(param) in self._sent:
            raise RuntimeError("a parameter received a gradient twice in one backward (a weight used "
                               "twice in a stage) after its gradient was sent to the other replicas")
        self._bucket.append(param)
        self._bucket_size += param.numel() * param.element_size()
        if self._bucket_size >= self.bucket_bytes:
            self.launch_bucketed()

    def ready_all(self, params: Sequence[torch.Tensor]) -> None:
        """Each of ``params`` has its final gradient for this update, in the order every replica
        announces them."""
        for param in params:
            self.ready(param)

    def launch_bucketed(self) -> None:
        """Start reducing the gradients announced but not sent yet (a bucket smaller than
        ``bucket_bytes``: the caller knows no more will come before the update)."""
        if self._bucket:
            self._launch(self._bucket)
            self._bucket, self._bucket_size = [], 0

    def _launch(self, params: List[torch.Tensor]) -> None:
        flat = torch.cat([local(g).reshape(-1) for g in _grads(params)])  # one collective per bucket
        try:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        except RuntimeError as error:
            raise self._fail(error) from error
        self._in_flight.append((work, flat, params))
        for p in params:
            self._sent[id(p)] = p

    def _fail(self, error: BaseException) -> PipelineCommError:
        return PipelineCommError(
            f"{'averaging' if self.mean else 'summing'} gradients over the {self.replicas} replicas of this "
            f"stage failed: {reason(error)}. A replica hung, died or is slower than the timeout ({self.timeout:g} s)")

    def __call__(self, params: Sequence[torch.Tensor]) -> None:
        """Before the update: reduce what was not sent yet, wait for all, divide (``mean``)."""
        rest = [p for p in list(self._bucket) + [q for q in params if id(q) not in self._sent]
                if id(p) not in self._sent]
        if rest:
            self._launch(rest)
        try:
            for work, flat, group in self._in_flight:
                wait_for(work, datetime.timedelta(seconds=self.timeout), flat.device)
                if self.mean:
                    flat.div_(self.replicas)
                for p, g in zip(group, flat.split([local(q).numel() for q in group])):
                    p.grad = like(p, g)
        except RuntimeError as error:
            raise self._fail(error) from error
        finally:
            self._reset()
            self.overlapping = False


def like(param: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """``flat`` (this process's part of ``param``'s gradient) shaped as ``param``: a DTensor's
    (a stage split over tensor ranks) over its local shape, in its layout."""
    if not is_dtensor(param):
        return flat.view_as(param)
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(flat.view_as(param.to_local()), param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())


def _grads(params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Each parameter's gradient (zeros where it has none: every replica reduces the same tensors),
    in the parameter's layout where it is split over tensor ranks."""
    return [in_layout(p) if p.grad is not None else torch.zeros_like(p) for p in params]
