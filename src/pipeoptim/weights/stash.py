"""Weight policies that keep older versions: weight stashing (PipeDream, vertical sync) and
2BW's double buffer.

How a stash keeps a version (docs/architecture.md, "Weight versions per method"): later forwards
can alias the old storage too, and a stash costs one copy per *update that in-flight work still
needs*, never one per micro-batch."""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Dict, Iterator, List

import torch

from ..schedules.actions import Kind
from .base import WeightPolicy, WeightUse, alias, local, nbytes
from .fused import clone_all


class VersionStore(WeightPolicy):
    """Base of the stashing policies: keeps outgoing versions that in-flight or future forwards still need (stash, 2BW).

    Before an update, if the live version is still needed, the parameters move to fresh storage
    (a copy, one multi-tensor copy for the stage) and the old storage stays with the
    micro-batches that use it: their saved aliases keep reading the old values, and later
    forwards can alias it too.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kept: Dict[int, List[torch.Tensor]] = {}
        self.users: Counter = Counter()

    def extend_epoch(self, stage_actions, full_orders=(), *, open_ended: bool = False,
                     synchronous_updates: int = 0) -> None:
        super().extend_epoch(stage_actions, full_orders, open_ended=open_ended,
                             synchronous_updates=synchronous_updates)
        self._drop_unneeded()  # versions kept for forwards the final orders no longer hold

    def target_version(self, microbatch: int) -> int:
        """The version micro-batch's forward must use."""
        return self.version

    def future_needs(self, version: int) -> bool:
        """Whether a forward that has not run yet will need ``version``."""
        return False

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
        self._stage0_version: Dict[int, int] = {}

    def learn_orders(self, stage_actions, full_orders, synchronous_updates: int = 0) -> None:
        super().learn_orders(stage_actions, full_orders, synchronous_updates)
        if self.vertical_sync:
            if not full_orders:
                raise ValueError("vertical sync needs stage 0's order")
            count = 0
            self._stage0_version = {}
            for a in full_orders[0]:
                if a.stage != 0:
                    continue
                if a.kind is Kind.U:
                    count += 1
                elif a.kind is Kind.F:
                    self._stage0_version[a.index] = self.epoch_start_version + count
            self._pending = [i for i in sorted(self._stage0_version) if not self._consumed[i]]

    def target_version(self, microbatch: int) -> int:
        if not self.vertical_sync:
            return self.version
        self._pending.remove(microbatch)
        self._consumed[microbatch] += 1
        return self._stage0_version[microbatch]

    def future_needs(self, version: int) -> bool:
        if not self.vertical_sync:
            return False
        # beyond open-ended orders, stage 0's forwards use its last listed version or later
        if self.open_ended and self._stage0_version and version >= max(self._stage0_version.values()):
            return True
        return any(self._stage0_version[i] == version for i in self._pending)


class DoubleBufferPolicy(VersionStore):
    """PipeDream-2BW: every micro-batch of update window t runs on the version stage 0 held when
    the window started (t-1 once the pipeline is full), so at most two versions are alive."""

    description = "older of two buffers for a whole update window"

    def learn_orders(self, stage_actions, full_orders, synchronous_updates: int = 0) -> None:
        super().learn_orders(stage_actions, full_orders, synchronous_updates)
        m = max(1, sum(1 for a in stage_actions if a.kind is Kind.F) //
                max(1, sum(1 for a in stage_actions if a.kind is Kind.U)))
        self.window = m
        count, self._window_version = 0, {}
        for a in (full_orders[0] if full_orders else stage_actions):
            if a.kind is Kind.U:
                count += 1
            elif a.kind is Kind.F and a.index % m == 0:
                self._window_version[a.index // m] = self.epoch_start_version + count
        self._pending_windows = Counter({w: m - self._consumed[w] for w in self._window_version})

    def target_version(self, microbatch: int) -> int:
        window = microbatch // self.window
        self._pending_windows[window] -= 1
        self._consumed[window] += 1
        return self._window_version[window]

    def future_needs(self, version: int) -> bool:
        # beyond open-ended orders, later windows use the last listed window's version or later
        if self.open_ended and self._window_version and version >= max(self._window_version.values()):
            return True
        return any(self._window_version[w] == version for w, left in self._pending_windows.items() if left > 0)
