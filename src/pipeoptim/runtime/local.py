"""The local executor: every stage in one process. The one interpreter
(:class:`~pipeoptim.runtime.executor.Executor`), with a walker per rank over an in-memory
:class:`~pipeoptim.runtime.executor.Mailbox`."""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

from ..schedules.actions import Schedule
from .executor import Executor, Mailbox
from .segment import MicroBatch
from .stage import Stage


def run_schedule(stages: Sequence[Stage], schedule: Schedule, microbatches: Sequence[MicroBatch],
                 on_loss: Optional[Callable[[int, float], None]] = None,
                 trace_offset: int = 0) -> Dict[int, float]:
    """Run one whole schedule over ``microbatches``; the loss of each update window (the sum of
    its micro-batches' scaled losses), each also given to ``on_loss(window, loss)`` as soon as
    it is complete. ``trace_offset`` numbers the micro-batches after earlier epochs' in the traces."""
    m = schedule.microbatches_per_update
    windows = schedule.num_updates
    executor = Executor(stages, Mailbox(), lambda batches: schedule, expected=windows,
                        trace_offset=trace_offset, on_loss=on_loss)
    for w in range(windows):
        executor.feed(microbatches[w * m:(w + 1) * m])
    executor.finish()
    return dict(executor.take_completed(wait=True))
