"""PipeOptim on PipeDream-2BW's schedule: each update window shares one *predicted* version
(docs/architecture.md, "Weight versions per method", row pipeoptim-2bw).

2BW runs every micro-batch of window t, forward and backward, on one version; the window's
gradient joins update t, applied to W^(t). This policy runs the window on W_hat from the version
v the stage holds at the window's first forward, s being the updates this stage applies between
that forward and update t (Delta and lr read at that forward): in the steady state the table's v
and s, where 2BW would use W^(t-1) at the last stage too. Window 0, and every window before the
stage's first update, runs unpredicted on W^(v), kept (as a stash keeps it) through any update
that comes while the window is in flight. With one stage s is always 0: sequential training."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import torch

from ..schedules.actions import Kind
from .base import WeightUse, alias, nbytes
from .predicting import PredictingPolicy
from .stash import VersionStore, window_of


@dataclass
class _Window:
    """One update window in flight at this stage."""

    version: int                                #: the version it runs on (or predicts from)
    steps: float                                #: the prediction steps
    tensors: Optional[List[torch.Tensor]]       #: the predicted tensors; None: the version itself
    left: int                                   #: its backwards not run yet


class PipeOptim2BWPolicy(VersionStore, PredictingPolicy):
    """pipeoptim-2bw: 2BW's windows, each on ``W - lr*s*Delta`` over the updates its gradient
    misses (see the module docstring)."""

    description = "2BW windows, forward and backward on W - lr*s*Delta(optimizer), s = updates the window misses"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._windows: Dict[int, _Window] = {}
        self._window_steps: Dict[int, int] = {}

    def learn_orders(self, stage_actions, full_orders, synchronous_updates: int = 0) -> None:
        super().learn_orders(stage_actions, full_orders, synchronous_updates)
        m = self.window = window_of(stage_actions)
        # per window: the updates between its first forward and its last backward, after which
        # the update its gradient joins comes
        self._window_steps = {
            a.index // m: self._updates_before[(Kind.B, a.index + m - 1)] - self._updates_before[(Kind.F, a.index)]
            for a in stage_actions if a.kind is Kind.F and a.index % m == 0
            and (Kind.B, a.index + m - 1) in self._updates_before}

    def ever_predicts(self) -> bool:
        return self.stage < self.num_stages - 1

    def base_forward_steps(self, microbatch: int) -> float:
        return self._window_steps[microbatch // self.window]

    def begin_epoch(self, *args, **kwargs) -> None:
        if self._windows:
            raise RuntimeError(f"stage {self.stage}: a schedule starts with windows in flight")
        super().begin_epoch(*args, **kwargs)

    def _open(self, microbatch: int) -> _Window:
        """The window of ``microbatch``, made at its first forward."""
        window = microbatch // self.window
        entry = self._windows.get(window)
        if entry is None:
            steps = self.forward_steps(microbatch) if self.source.has_direction else 0
            tensors = self.predicted(self.base_forward_steps(microbatch)) if steps else None
            entry = self._windows[window] = _Window(self.version, steps, tensors, self.window)
        return entry

    def forward_weights(self, microbatch: int) -> WeightUse:
        entry = self._open(microbatch)
        self._forward_version[microbatch] = entry.version
        if entry.tensors is not None:
            weights = {n: alias(t) for (n, _), t in zip(self.named, entry.tensors)}
        else:
            self.users[entry.version] += 1  # kept through an update while this window needs it
            weights = self.weights_of(entry.version)
        return WeightUse(weights, entry.version, entry.steps)

    @contextmanager
    def backward_pass(self, microbatch: int, use: WeightUse) -> Iterator[WeightUse]:
        # the aliases saved at the forward hold the window's values
        yield WeightUse(use.weights, use.version, use.steps)
        window = microbatch // self.window
        entry = self._windows[window]
        self._forward_version.pop(microbatch)
        if entry.tensors is None:
            self.users[entry.version] -= 1
        entry.left -= 1
        if entry.left == 0:
            del self._windows[window]
        self._drop_unneeded()

    def before_update(self) -> None:
        VersionStore.before_update(self)       # keep the live version if a window runs on it
        PredictingPolicy.before_update(self)   # delta="ema": W before the update

    def copy_bytes(self) -> int:
        held = sum(nbytes(w.tensors) for w in self._windows.values() if w.tensors is not None)
        return VersionStore.copy_bytes(self) + PredictingPolicy.copy_bytes(self) + held
