"""Multi-tensor arithmetic over a stage's parameters (docs/architecture.md, "Weight versions per
method"): the prediction, the copies, Delta's formulas, the delay corrections and the diagnostic
run as ``torch._foreach_*`` operations over lists of tensors, not a Python loop per parameter.

Each helper gives the bits of the per-tensor operation it replaces (a foreach op applies the same
kernel per element). A sharded stage's tensors are DTensors: the elementwise helpers run on the
local shards (:func:`local_all`), each element computed as without sharding.

torch has no multi-tensor ``out=`` (its ``_foreach_*.out`` allocate and copy), so :class:`Into`
writes a copy then the in-place multi-tensor op: one extra pass over memory. On the CPU that pass
costs more than the Python call it saves for a large tensor, which keeps an ``out=`` pass of its
own (:data:`ONE_PASS_NUMEL`), and a formula of several operations runs them on such a tensor one
after the other while it is in cache (:func:`batches`)."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

from ..compat import FOREACH_NORM_TAKES_DTYPE

#: Per device type: from how many elements on a tensor takes one ``out=`` pass of its own
#: instead of the copy and the multi-tensor op (the CPU's break-even, measured with
#: ``torch.add``: about 8k elements at one thread). Devices not listed always fuse: there a
#: launch saved is worth more than a pass over memory.
ONE_PASS_NUMEL: Dict[str, int] = {"cpu": 8192}

#: torch >= 2.1 has a multi-tensor copy; before it, a loop of ``copy_``
_HAS_FOREACH_COPY = hasattr(torch, "_foreach_copy_")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of ``tensor``: a DTensor's local shard (a stage sharded over its
    replicas, ``runtime/sharding.py``), else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def local_all(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """This process's part of each tensor (:func:`local`)."""
    return [local(t) for t in tensors]


def nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes this process holds of ``tensors`` (of a sharded one, its shard)."""
    return sum(local(t).numel() * t.element_size() for t in tensors)


def copy_all(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i, as one multi-tensor copy of the local shards."""
    if not dst:
        return
    if _HAS_FOREACH_COPY:
        torch._foreach_copy_(local_all(dst), local_all(src))
    else:  # pragma: no cover - torch 2.0
        for d, s in zip(local_all(dst), local_all(src)):
            d.copy_(s)


def applied_update(before: Sequence[torch.Tensor], params: Sequence[torch.Tensor], lr: float) -> List[torch.Tensor]:
    """In place, the update just applied per unit lr: ``before <- (before - W) / lr`` (``W`` the
    ``params`` now; no division for lr 0); the local shards of ``before``."""
    d = local_all(before)
    torch._foreach_sub_(d, local_all([p.detach() for p in params]))
    if lr != 0.0:
        torch._foreach_div_(d, lr)
    return d


def clone_all(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """``[t.detach().clone() for t in tensors]``: the same values in new memory (DTensors stay
    DTensors), allocated per tensor as ``clone`` does and filled by one multi-tensor copy."""
    out = [torch.empty_like(t.detach()) for t in tensors]
    copy_all(out, [t.detach() for t in tensors])
    return out


def norms64(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Each tensor's 2-norm, accumulated in float64 (one multi-tensor norm; DTensors: torch's
    own sharded one, each the whole tensor's)."""
    if FOREACH_NORM_TAKES_DTYPE:
        return list(torch._foreach_norm(list(tensors), dtype=torch.float64))
    return [torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors]  # pragma: no cover


def one_pass(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is cheaper with an ``out=`` pass of its own than in a fused pair."""
    # (is_cpu first: reading .device makes an object, a cost per tensor per update)
    limit = ONE_PASS_NUMEL.get("cpu" if tensor.is_cpu else tensor.device.type)
    return limit is not None and tensor.numel() >= limit


def batches(tensors: Sequence[torch.Tensor], positions: Optional[Sequence[int]] = None) -> List[List[int]]:
    """The lists (of positions in ``tensors``, default all) a formula of several multi-tensor
    operations runs over, in order: those fused, then each tensor of :func:`one_pass` size alone
    (measured on the CPU: Adam's Delta of 4 MB in 8 tensors 20 % slower with each operation over
    all of them, the tensors dropping out of cache between operations)."""
    positions = range(len(tensors)) if positions is None else positions
    large = [one_pass(tensors[i]) for i in positions]
    if not any(large):
        return [list(positions)] if len(positions) else []
    small = [i for i, big in zip(positions, large) if not big]
    return ([small] if small else []) + [[i] for i, big in zip(positions, large) if big]


class Into:
    """``outs[i] <- torch.<op>(first[i], *others[i], **kwargs)`` for fixed lists of tensors
    (local shards), bit for bit the per-tensor ``out=`` call: split once into the tensors that
    take one pass of their own (:func:`one_pass`) and the rest, written by one multi-tensor copy
    of ``first`` into ``outs`` and one in-place multi-tensor ``op``. ``outs[i]`` is none of
    ``first[i]`` and ``others[i]`` (the copy would overwrite an input). An entry of ``others``
    that is a number, not a list, is the same operand for every tensor."""

    def __init__(self, outs: Sequence[torch.Tensor], first: Sequence[torch.Tensor],
                 *others: Union[Sequence[torch.Tensor], float]) -> None:
        large = [one_pass(t) for t in outs]
        single = [i for i, big in enumerate(large) if big]
        fused = [i for i, big in enumerate(large) if not big] if single else range(len(outs))
        pick = lambda o, i: o[i] if isinstance(o, (list, tuple)) else o  # noqa: E731
        self.single = [(outs[i], first[i], tuple(pick(o, i) for o in others)) for i in single]
        self.outs = [outs[i] for i in fused]
        self.first = [first[i] for i in fused]
        self.others = [[o[i] for i in fused] if isinstance(o, (list, tuple)) else o for o in others]

    def __call__(self, op: str, **kwargs) -> None:
        function: Callable = getattr(torch, op)
        for out, first, others in self.single:
            function(first, *others, out=out, **kwargs)
        if self.outs:
            copy_all(self.outs, self.first)
            getattr(torch, f"_foreach_{op}_")(self.outs, *self.others, **kwargs)
