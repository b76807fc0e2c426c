"""A run resolved before any work starts, and where it drains.

The Pipeline's preparation, its ``fit`` loop and the lab's experiment use these: the method's
options checked, the stage count and partition fixed, the micro-batch count chosen
(:func:`resolve`); the checkpoint interval and the facts a checkpoint must match
(:func:`checkpoint_settings`); and where a run drains, ending a segment (every checkpoint and
every evaluation interval, each epoch's end: :func:`next_drain`). Nothing here imports the API,
the tasks or the command line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn

from ..methods import get_method
from .layout import plan_layout
from ..partition import plan_partition, weighted_units


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


def resolve(model: nn.Sequential, *, method: str, stages: Optional[int], partition: Optional[Sequence[int]],
            partitioner: str, micro_batches: Optional[int], method_options: Dict[str, Any],
            chunks: Optional[int] = None) -> RunSpec:
    """Check a run's settings before any work starts; errors are ValueErrors that say the fix.

    ``stages`` counts ranks; with ``chunks=V`` (a chunked method: interleaved) the model is cut
    into ``stages x V`` stages, and ``partition`` lists the layers of each of them."""
    m = get_method(method)
    options = m.resolve_options(method_options)
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"model must be an nn.Sequential of stage-able blocks, got {type(model).__name__}")
    layout = plan_layout(m, stages=stages, partition=partition, chunks=chunks)
    v = layout.chunks
    if method == "sequential":
        n, sizes = 1, [len(model)]
    else:
        if layout.stages is None:
            raise ValueError("give stages=N or partition=[layers per stage]")
        n = layout.stages
        weighted = len(weighted_units(model))  # every piece needs a layer with parameters
        pieces = m.pieces_per_rank(v)
        if pieces > 1 and partition is None and weighted < n * pieces:
            raise ValueError(f"{method} with {n} stages x {v} chunks needs {n * v} layers with parameters, "
                             f"the model has {weighted}: use chunks={max(1, weighted // n)} or fewer stages")
        sizes = plan_partition(model, n * pieces, partitioner, partition)
        if m.mirrored:  # the second pipeline's stages: replicas of the first's pieces
            sizes = list(sizes) + list(sizes)
    micro = m.microbatches(n, micro_batches)
    if v > 1 and m.placement == "interleaved" and micro % n:
        raise ValueError(f"{method} needs micro-batches to be a multiple of the {n} stages (got {micro}); "
                         f"use micro_batches={n * max(1, micro // n)}")
    if micro < 1:
        raise ValueError(f"micro-batches must be at least 1, got {micro}")
    if m.schedule == "2bw" and micro < n:
        raise ValueError(f"{method} needs micro-batches >= stages ({micro} < {n}); "
                         f"use micro_batches={n}")
    return RunSpec(method, options, n * v, sizes, micro, v)


#: what a resumed run must share with the run that wrote the checkpoint
RESUME_MATCHES = ("method", "options", "batches_per_epoch", "segment", "eval_every")


def checkpoint_settings(spec: RunSpec, num_batches: int, checkpoint_every: Optional[int],
                        continuous: bool, eval_every: Optional[int] = None) -> Tuple[int, Dict[str, Any]]:
    """The checkpoint interval in mini-batches and the facts a checkpoint's manifest records of
    the run: method, stages, partition, micro-batches, options, batches per epoch, interval,
    evaluation interval. A resumed run must match those of :data:`RESUME_MATCHES` (it must cut
    its segments where the first one did); the layout may change (a checkpoint loads into any).

    The pipeline also drains every ``eval_every`` mini-batches (to evaluate one set of weights);
    :func:`segments` and :func:`next_drain` cut at both kinds of points."""
    if checkpoint_every is not None and checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be at least 1, got {checkpoint_every}")
    if eval_every is not None and eval_every < 1:
        raise ValueError(f"eval_every must be at least 1, got {eval_every}")
    if continuous and checkpoint_every:
        raise ValueError("a continuous run never drains, so it cannot checkpoint every K batches; "
                         "drop continuous or checkpoint_every")
    if continuous and eval_every:
        raise ValueError("a continuous run never drains, so it cannot evaluate every K batches; "
                         "drop continuous or eval_every")
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
