"""The local executor: every stage in one process. The one interpreter
(:class:`~pipeoptim.runtime.executor.Executor`), with a walker per rank over an in-memory
:class:`Mailbox`."""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

from ..schedules.actions import Kind, Schedule
from .executor import Executor
from .interfaces import Transport
from .segment import MicroBatch
from .stage import Stage


class Mailbox(Transport):
    """Every rank in this process: a send puts the value where the receiving stage reads it,
    and a receive finds it there, or not yet."""

    def use(self, schedule: Schedule) -> None:
        nxt = [schedule.next_stage(k) for k in range(schedule.num_stages)]
        prv = [schedule.prev_stage(k) for k in range(schedule.num_stages)]
        self._at = {Kind.RECV_F: self.inputs, Kind.RECV_B: self.grads, Kind.RECV_E: self.evals}
        self._to = {Kind.SEND_F: (self.inputs, nxt), Kind.SEND_B: (self.grads, prv), Kind.SEND_E: (self.evals, nxt)}

    def recv(self, kind: Kind, k: int, i: int) -> bool:
        return (k, i) in self._at[kind]

    def send(self, kind: Kind, k: int, i: int, value: Any) -> None:
        store, to = self._to[kind]
        store[(to[k], i)] = value


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
