"""Where the user's code failed in the executor's walk: the stage, its layers, the pass and the
micro-batch.

An error the model, the loss or the optimizer raises in a stage's pass or update: the executor
keeps the rows of each micro-batch fed, and knows which calls of the walk run the user's code,
for :func:`pipeoptim.errors.placed` to raise the error again naming the rank under torchrun,
the stage and its layers, the pass and the micro-batch (its number and rows in its mini-batch)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch.distributed as dist

from ..errors import layers_of, placed
from ..schedules.actions import Action, Kind
from .microbatch import leading_rows
from .stage import Stage

#: the calls of the walk that run the user's code: a stage's passes and update
STAGE_PASSES = (Stage.forward, Stage.backward, Stage.backward_input, Stage.backward_weight, Stage.update)
PASS_NAMES = {Kind.F: "forward", Kind.B: "backward", Kind.I: "backward (its input half)",
              Kind.W: "backward (its weight half)"}
#: the mini-batches whose micro-batches' rows an error can name (more than are ever in flight)
ROWS_KEPT = 64


class PassErrors:
    """An executor's record of the rows of each micro-batch of the last mini-batches fed, and the
    rule that tells the user's error from another: one raised in a call of :data:`STAGE_PASSES`
    or of ``more`` (the executor's own calls that run the user's code: its forward-only pass)
    made by the walk itself."""

    def __init__(self, *more: Callable[..., Any]) -> None:
        self._passes = frozenset(f.__code__ for f in (*STAGE_PASSES, *more))
        self._rows: Dict[int, List[Optional[int]]] = {}

    def fed(self, batch: int, microbatches: Sequence[Any]) -> None:
        """Mini-batch ``batch`` (its number in the segment, from 0) came as ``microbatches``
        ((inputs, target, share) each): their rows, kept for the last :data:`ROWS_KEPT`."""
        self._rows[batch] = [leading_rows(x if x is not None else y) for x, y, _ in microbatches]
        self._rows.pop(batch - ROWS_KEPT, None)

    def placed(self, error: Exception, action: Action, stages: Sequence[Any], microbatches_per_update: int,
               trace_offset: int) -> Optional[Exception]:
        """``error``, raised by the user's code in ``action`` (stage ``k``'s pass or update, of
        ``stages`` by number), again saying where; None for an error of anything else (a
        transfer, an agreement, a callback) or of the pipeline's own. ``trace_offset``: the
        segment's first micro-batch in the run (the mini-batch named is the run's)."""
        tb = error.__traceback__
        if tb is None or tb.tb_next is None or tb.tb_next.tb_frame.f_code not in self._passes:
            return None
        k, kind, i = action
        where = f"stage {k} ({layers_of(stages[k].module)})"
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            where = f"rank {dist.get_rank()}, {where}"
        if kind is Kind.U:
            return placed(error, f"{where}, update {i}")
        if kind is Kind.E:
            return placed(error, f"{where}, forward-only pass of batch {i}")
        m = microbatches_per_update
        t, j = divmod(i, m)
        sizes = self._rows.get(t)
        rows = f" (rows {sum(sizes[:j])}-{sum(sizes[:j + 1]) - 1})" if sizes and None not in sizes else ""
        return placed(error, f"{where}, {PASS_NAMES[kind]} of micro-batch {j}{rows} of mini-batch "
                             f"{(trace_offset + i) // m}")
