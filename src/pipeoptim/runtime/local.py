"""The local executor: every stage in one process. The one interpreter, with a walker per rank
over an in-memory :class:`~pipeoptim.runtime.executor.Mailbox`."""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

from ..schedules.actions import Schedule
from .executor import Executor, Mailbox, ScheduleStuck
from .forward_only import ForwardOnly
from .segment import MicroBatch, ScheduleFor
from .stage import Stage

__all__ = ["LocalExecutor", "ScheduleStuck", "run_schedule"]


class LocalExecutor(Executor):
    """Runs one segment (the mini-batches between two drains) over all stages; the arguments
    are :class:`~pipeoptim.runtime.executor.Executor`'s."""

    def __init__(self, stages: Sequence[Stage], schedule_for: ScheduleFor, *,
                 expected: Optional[int] = None, trace_offset: int = 0,
                 clip_global: Optional[float] = None,
                 on_loss: Optional[Callable[[int, float], None]] = None,
                 forward_only: Optional[ForwardOnly] = None) -> None:
        super().__init__(stages, Mailbox(), schedule_for, expected=expected, trace_offset=trace_offset,
                         clip_global=clip_global, on_loss=on_loss, forward_only=forward_only)


def run_schedule(stages: Sequence[Stage], schedule: Schedule, microbatches: Sequence[MicroBatch],
                 on_loss: Optional[Callable[[int, float], None]] = None,
                 trace_offset: int = 0) -> Dict[int, float]:
    """Run one whole schedule over ``microbatches``; the loss of each update window (the sum of
    its micro-batches' scaled losses), each also given to ``on_loss(window, loss)`` as soon as
    it is complete. ``trace_offset`` numbers the micro-batches after earlier epochs' in the traces."""
    m = schedule.microbatches_per_update
    windows = schedule.num_updates
    executor = LocalExecutor(stages, lambda batches: schedule, expected=windows,
                             trace_offset=trace_offset, on_loss=on_loss)
    for w in range(windows):
        executor.feed(microbatches[w * m:(w + 1) * m])
    executor.finish()
    return dict(executor.take_completed(wait=True))
