"""Weight policies that keep older versions: weight stashing (PipeDream, vertical sync) and
2BW's double buffer.

A stash costs one copy per *update that in-flight work still needs*, never one per micro-batch
(docs/architecture.md, "Weight versions per method")."""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence

import torch

from ..schedules.actions import Action, Kind
from .base import WeightPolicy, WeightUse, alias, local, nbytes
from .fused import clone_all


def window_of(stage_actions: Sequence[Action]) -> int:
    """Micro-batches per update in ``stage_actions`` (2BW's window), at least 1."""
    forwards = sum(1 for a in stage_actions if a.kind is Kind.F)
    return max(1, forwards // max(1, sum(1 for a in stage_actions if a.kind is Kind.U)))


class VersionStore(WeightPolicy):
    """Base of the stashing policies: keeps outgoing versions that in-flight or future forwards still need (stash, 2BW).

    Before an update, if the live version is still needed, the parameters move to fresh storage
    (one multi-tensor copy) and the old storage stays with the micro-batches that use it: their
    saved aliases keep reading the old values, and later forwards can alias it too.

    A forward uses the live version, or, once :meth:`schedule_versions` has read them, the
    version the schedule gives its window of ``window`` forwards (vertical sync: stage 0's; 2BW:
    the window's first forward's), kept alive for the forwards not run yet.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kept: Dict[int, List[torch.Tensor]] = {}
        self.users: Counter = Counter()
        self.window = 1
        self._scheduled: Dict[int, int] = {}   # window -> the version its forwards use
        self._left: Counter = Counter()        # window -> its forwards not run yet

    def schedule_versions(self, order: Sequence[Action], stage: Optional[int] = None) -> None:
        """The version of each window of ``order`` (of ``stage``'s actions only, if given): the
        updates before the window's first forward."""
        count, self._scheduled = 0, {}
        for a in order:
            if stage is not None and a.stage != stage:
                continue
            if a.kind is Kind.U:
                count += 1
            elif a.kind is Kind.F and a.index % self.window == 0:
                self._scheduled[a.index // self.window] = self.applied(count)
        self._left = Counter({w: self.window - self._consumed[w] for w in self._scheduled})

    def target_version(self, microbatch: int) -> int:
        """The version micro-batch's forward must use."""
        if not self._scheduled:
            return self.version
        window = microbatch // self.window
        self._left[window] -= 1
        self._consumed[window] += 1
        return self._scheduled[window]

    def future_needs(self, version: int) -> bool:
        """Whether a forward that has not run yet will need ``version``."""
        # beyond open-ended orders, later forwards use the last listed version or a later one
        if self.open_ended and self._scheduled and version >= max(self._scheduled.values()):
            return True
        return any(self._scheduled[w] == version for w, left in self._left.items() if left > 0)

    def extend_epoch(self, stage_actions, full_orders=(), *, open_ended: bool = False,
                     synchronous_updates: int = 0) -> None:
        super().extend_epoch(stage_actions, full_orders, open_ended=open_ended,
                             synchronous_updates=synchronous_updates)
        self._drop_unneeded()  # versions kept for forwards the final orders no longer hold

    def weights_of(self, version: int) -> Dict[str, torch.Tensor]:
        if version == self.version:
            return self.live_weights()
        if version not in self.kept:
            raise RuntimeError(f"stage {self.stage}: weight version {version} is needed but was not "
                               f"kept (live is {self.version}, kept: {sorted(self.kept)})")
        return {n: alias(t) for (n, _), t in zip(self.named, self.kept[version])}

    def forward_weights(self, microbatch: int) -> WeightUse:
        version = self.target_version(microbatch)
        self._forward_version[microbatch] = version
        self.users[version] += 1
        return WeightUse(self.weights_of(version), version)

    def forward_weights_kept(self, microbatch: int, use: WeightUse) -> bool:
        return True  # the version's storage is moved aside, never written, while it is used

    def backward_values(self, use: WeightUse, used: WeightUse) -> Dict[str, torch.Tensor]:
        # sharded, the live storage stays (an update writes it in place, its old values copied
        # to ``kept``): a forward that aliased it reads that copy in its backward
        if self.sharded and used.version != self.version and used.version in self.kept:
            name, first = next(iter(use.weights.items()), (None, None))
            if first is not None and local(first).data_ptr() == local(dict(self.named)[name].data).data_ptr():
                return {n: t for (n, _), t in zip(self.named, self.kept[used.version])}
        return used.weights

    @contextmanager
    def backward_pass(self, microbatch: int, use: WeightUse) -> Iterator[WeightUse]:
        yield WeightUse(use.weights, use.version)  # the aliases saved at forward hold that version
        version = self._forward_version.pop(microbatch)
        self.users[version] -= 1
        self._drop_unneeded()

    def before_update(self) -> None:
        live = self.version
        if self.users[live] > 0 or self.future_needs(live):
            if self.sharded:  # FSDP gathers from the live storage: copy, do not move it
                self.kept[live] = clone_all([p for _, p in self.named])
            else:  # the old storage stays with its users; the parameters move to a copy
                self.kept[live] = [p.data for _, p in self.named]
                for (_, p), fresh in zip(self.named, clone_all(self.kept[live])):
                    p.data = fresh
        self.note_memory()

    def after_update(self) -> None:
        super().after_update()
        self._drop_unneeded()

    def skipped_update(self) -> None:
        super().skipped_update()  # the windows scheduled after this update: one version sooner
        self._scheduled = {w: v - 1 if v > self.version else v for w, v in self._scheduled.items()}
        self._drop_unneeded()

    def _drop_unneeded(self) -> None:
        for version in [v for v in self.kept if self.users[v] <= 0 and not self.future_needs(v)]:
            del self.kept[version]

    def copy_bytes(self) -> int:
        return sum(nbytes(ts) for ts in self.kept.values())


class StashingPolicy(VersionStore):
    """PipeDream: the backward runs on the version its forward used (weight stashing).

    With ``vertical_sync`` every stage uses the version stage 0 used for that micro-batch, which
    every stage computes from the schedule (no version travels with the activations).
    """

    description = "forward on the latest weights, stashed for its backward"

    def __init__(self, *args, vertical_sync: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.vertical_sync = vertical_sync

    def learn_orders(self, stage_actions, full_orders, synchronous_updates: int = 0) -> None:
        super().learn_orders(stage_actions, full_orders, synchronous_updates)
        if self.vertical_sync:
            if not full_orders:
                raise ValueError("vertical sync needs stage 0's order")
            self.schedule_versions(full_orders[0], stage=0)


class DoubleBufferPolicy(VersionStore):
    """PipeDream-2BW: every micro-batch of update window t runs on the version stage 0 held when
    the window started (t-1 once the pipeline is full), so at most two versions are alive."""

    description = "older of two buffers for a whole update window"

    def learn_orders(self, stage_actions, full_orders, synchronous_updates: int = 0) -> None:
        super().learn_orders(stage_actions, full_orders, synchronous_updates)
        self.window = window_of(stage_actions)
        self.schedule_versions(full_orders[0] if full_orders else stage_actions)

