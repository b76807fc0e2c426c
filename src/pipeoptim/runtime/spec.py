"""A run resolved before any work starts, and where it drains.

The Pipeline's preparation, its ``fit`` loop and the lab's experiment use these: the method's
options with its defaults, the stage count and partition fixed, the micro-batch count chosen
(:func:`resolve`); the checkpoint interval and the facts a checkpoint must match
(:func:`checkpoint_settings`); and where a run drains, ending a segment (every checkpoint and
every evaluation interval, each epoch's end: :func:`next_drain`). The settings are checked
before they come here, once (``pipeoptim.checks``). Nothing here imports the API, the tasks or
the command line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from torch import nn

from ..methods import Method, get_method
from .layout import Layout, plan_layout
from ..partition import plan_partition


@dataclass
class RunSpec:
    """A resolved run: method, options, stage count, partition and micro-batches."""

    method: str
    options: Dict[str, Any]
    stages: int          #: stages (one Stage each): ranks x chunks (a mirrored method: 2 x its N pieces)
    partition: List[int]  #: layers per stage (a mirrored method: the N pieces', twice)
    microbatches: int
    chunks: int = 1      #: stages per rank (interleaved: rank r holds stages r, r + N, ...)

    @property
    def ranks(self) -> int:
        """Ranks of the pipeline (processes under torchrun): stages / chunks."""
        return self.stages // self.chunks


def resolve(model: nn.Sequential, *, method: Union[str, Method], stages: Optional[int],
            partition: Optional[Sequence[int]], partitioner: str, micro_batches: Optional[int],
            method_options: Dict[str, Any],
            chunks: Optional[int] = None, layout: Optional[Layout] = None) -> RunSpec:
    """The resolved run of settings that ``pipeoptim.checks`` has checked (the partitioner's
    own refusals aside, which say the fix: a partition that does not cover the model).

    ``stages`` counts ranks; with ``chunks=V`` (a chunked method: interleaved) the model is cut
    into ``stages x V`` stages, and ``partition`` lists the layers of each of them. ``layout``:
    the run's layout where the caller has it (else it is planned from these). ``method``: a
    registry name, or the Method itself (one running a user's schedule: ``methods.with_order``)."""
    m = method if isinstance(method, Method) else get_method(method)
    method = m.name
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"model must be an nn.Sequential of stage-able blocks, got {type(model).__name__}")
    layout = layout or plan_layout(m, stages=stages, partition=partition, chunks=chunks)
    v = layout.chunks
    if method == "sequential":
        n, sizes = 1, [len(model)]
    else:
        n = layout.stages
        sizes = plan_partition(model, n * m.pieces_per_rank(v), partitioner, partition)
        if m.mirrored:  # the second pipeline's stages: replicas of the first's pieces
            sizes = list(sizes) + list(sizes)
    return RunSpec(method, m.resolve_options(method_options), n * v, sizes, m.microbatches(n, micro_batches), v)


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
