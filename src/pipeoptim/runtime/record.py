"""What a stage reports of its passes: the observer it calls after each. The version trace, the
learning rates of each update, busy seconds and counts, the peak gradient bytes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from ..weights.base import WeightUse


@dataclass(frozen=True)
class TraceEntry:
    """Which weights one pass of one micro-batch used at one stage."""

    stage: int
    microbatch: int
    kind: str        #: "F", "B", or "I" / "W" (the two halves of a split backward)
    version: int     #: weight version the pass ran on (or predicted from)
    steps: float     #: prediction steps applied on top of ``version`` (0: none)


@dataclass(frozen=True)
class UpdateEntry:
    """The learning rates one update of one stage applied (one per parameter group)."""

    stage: int
    update: int      #: the update's number at this stage (version before it)
    lrs: Tuple[float, ...]


class StageRecord:
    """The record of stage ``stage``. ``time``: busy seconds per F, B and U (a split backward's
    halves count as B); ``count``: passes per F, B and U (a split backward counts once, at W)."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.trace: List[TraceEntry] = []
        self.updates: List[UpdateEntry] = []
        #: fp16: the version at each update skipped (an inf or nan in some stage's gradients)
        self.skips: List[int] = []
        self.time = {"F": 0.0, "B": 0.0, "U": 0.0}
        self.count = {"F": 0, "B": 0, "U": 0}
        #: busy seconds of the weight halves (``W``) of split backwards alone (counted in ``time["B"]`` too)
        self.weight_seconds = 0.0
        self.grad_bytes_peak = 0

    def passed(self, kind: str, microbatch: int, used: WeightUse, seconds: float) -> None:
        """A pass ``kind`` of ``microbatch`` (its number in the run) ran on ``used``."""
        self.trace.append(TraceEntry(self.stage, microbatch, kind, used.version, used.steps))
        if kind == "W":
            self.weight_seconds += seconds
        self.took("F" if kind == "F" else "B", seconds, counted=kind != "I")

    def updating(self, update: int, lrs: Tuple[float, ...], grad_bytes: int) -> None:
        """Update ``update`` applies ``lrs`` to gradients of ``grad_bytes``."""
        self.updates.append(UpdateEntry(self.stage, update, lrs))
        self.grad_bytes_peak = max(self.grad_bytes_peak, grad_bytes)

    def skipped(self, version: int, seconds: float) -> None:
        """An update of ``version`` skipped: the version stays, no entry in ``updates``."""
        self.skips.append(version)
        self.took("U", seconds)

    def took(self, kind: str, seconds: float, counted: bool = True) -> None:
        self.time[kind] += seconds
        if counted:
            self.count[kind] += 1
