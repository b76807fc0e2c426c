"""A run resolved before any work starts, and where it drains.

:class:`RunSpec` is the one resolved record of a run: ``pipeoptim.checks.check_run`` builds it
once, when the settings are checked (a Pipeline's, or the lab's launcher's before it starts any
process), and the preparation, the stage builders, the Pipeline's schedules, its ``fit`` loop
and the lab's experiment read it; only the model's cut, which the trace or a profile decides,
is added later (:meth:`RunSpec.cut`). Here too: the checkpoint interval and the facts a
checkpoint must match (:func:`checkpoint_settings`), and where a run drains, ending a segment
(every checkpoint and every evaluation interval, each epoch's end: :func:`next_drain`). Nothing
here imports the API, the tasks or the command line.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .layout import Layout


@dataclass(frozen=True)
class RunSpec:
    """A resolved run: the method's name and its options (each one's default filled), the
    layout (``layout.ranks``: the pipeline's ranks N, known), the micro-batches per mini-batch,
    clipping (``clip_scope``'s ``auto`` resolved), the compile backend (None: eager), the
    precision, recompute per stage, the diagnostic's interval, whether the model computes its
    own loss (no ``loss_fn``), and the cut: the layers (or traced units) of each stage, once
    the model is split (None before; a mirrored method lists the N pieces' twice)."""

    method: str
    options: Dict[str, Any]
    layout: Layout
    microbatches: int
    clip_scope: str = "stage"
    clip_grad_norm: Optional[float] = None
    backend: Optional[str] = None
    precision: str = "fp32"
    recompute: Tuple[bool, ...] = ()
    diagnose_every: int = 0
    own_loss: bool = False
    partition: Optional[List[int]] = None

    @property
    def ranks(self) -> int:
        """Ranks of the pipeline (processes of a replica under torchrun)."""
        return self.layout.ranks

    @property
    def chunks(self) -> int:
        """Stages per rank (interleaved: rank r holds stages r, r + N, ...)."""
        return self.layout.chunks

    @property
    def stages(self) -> int:
        """Stages (one Stage each): ranks x chunks (a mirrored method: 2 x its N pieces)."""
        return self.ranks * self.chunks

    @property
    def stage_clip(self) -> Optional[float]:
        """The max norm each stage clips its own gradient to (None: none, or clipped globally)."""
        return self.clip_grad_norm if self.clip_scope == "stage" else None

    @property
    def global_clip(self) -> Optional[float]:
        """The max norm of the gradient over all stages (None: none, or clipped per stage)."""
        return self.clip_grad_norm if self.clip_scope == "global" else None

    def cut(self, partition: Sequence[int]) -> "RunSpec":
        """This run with the model cut into ``partition``'s stages."""
        return dataclasses.replace(self, partition=list(partition))


#: what a resumed run must share with the run that wrote the checkpoint
RESUME_MATCHES = ("method", "options", "batches_per_epoch", "segment", "eval_every",
                  "schedule")  # (a user's own schedule's digest, checkpoint.schedule_digest: added by fit)


def checkpoint_settings(spec: RunSpec, num_batches: int, checkpoint_every: Optional[int],
                        eval_every: Optional[int] = None) -> Tuple[int, Dict[str, Any]]:
    """The checkpoint interval in mini-batches and the facts a checkpoint's manifest records of
    the run. A resumed run must match those of :data:`RESUME_MATCHES` (it must cut its segments
    where the first one did; the pipeline also drains every ``eval_every`` mini-batches, to
    evaluate one set of weights); the layout may change (a checkpoint loads into any)."""
    segment = checkpoint_every or num_batches
    return segment, {"method": spec.method, "stages": spec.stages, "partition": spec.partition,
                     "microbatches": spec.microbatches, "options": spec.options,
                     "batches_per_epoch": num_batches, "segment": segment, "eval_every": eval_every}


def next_drain(batch: int, num_batches: Optional[int], intervals: Sequence[Optional[int]]) -> Optional[int]:
    """Where the segment that starts at mini-batch ``batch`` of an epoch ends: the first multiple
    of any of ``intervals`` (None: no such interval) after ``batch``, or the epoch's end
    (``num_batches``; None: unknown, when no interval comes first)."""
    ends = [(batch // k + 1) * k for k in intervals if k]
    if num_batches is not None:
        ends.append(num_batches)
    return min(ends) if ends else None
