"""The distributed executor: one process per stage, the same Stage and the same action lists.

Every process of a pipeline group runs a :class:`DistributedExecutor` with its own
:class:`~pipeoptim.runtime.stage.Stage` and the *same* schedule. The schedule is lowered with
:func:`~pipeoptim.schedules.lower.lower`, which puts ``RECV_F``/``SEND_F`` around forwards and
``RECV_B``/``SEND_B`` around backwards whose neighbour lives on another rank; the executor walks
its rank's lowered list in order. Nothing else is sent: targets are read by the last stage from
the same seeded data that every rank holds, and the loss never leaves it until the end of an
epoch.

The transport (one stage's links and control group, :class:`PipeComm`) is
:mod:`~pipeoptim.runtime.transport`, over :mod:`~pipeoptim.runtime.link` (one direction of one
pair) and :mod:`~pipeoptim.runtime.wire` (message layouts, :class:`PipelineCommError`); joining
the job and the control group's collectives are :mod:`~pipeoptim.runtime.control`; the
replicas' gradient averaging is :mod:`~pipeoptim.runtime.averaging`. Their public names are
importable from here too, as they were before the split.

What drives the executor is :class:`pipeoptim.Pipeline` under torchrun (its world,
:class:`pipeoptim.torchrun.Torchrun`), for a user's script and for the command line alike.

Randomness inside the model (dropout) is drawn from each process's own generator, so a model
with dropout does not give the local runtime's numbers step for step (the local executor
interleaves all stages' draws on one generator); models without randomness give the same
losses as the local runtime.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..schedules.actions import Kind, Schedule
from ..schedules.lower import lower
from .averaging import GradientAverager
from .control import barrier, broadcast, gather_all, init_process_group
from .defaults import DEFAULT_TIMEOUT
from .segment import MicroBatch, StreamedSegment, WindowLosses, check_runnable, clip_coefficient
from .stage import Stage
from .transport import PipeComm
from .wire import PipelineCommError, Signature, reason, signature

#: importable from here as before the split into transport, link, wire, control and averaging
__all__ = ["DistributedExecutor", "PipeComm", "PipelineCommError", "GradientAverager", "DEFAULT_TIMEOUT",
           "barrier", "broadcast", "gather_all", "init_process_group", "reason", "signature"]


class DistributedExecutor(StreamedSegment):
    """This process's stage of a pipeline whose other stages run in other processes: the
    streaming counterpart of :class:`~pipeoptim.runtime.local.LocalExecutor`, with the same
    ``feed`` / ``finish`` / ``take_completed``.

    Every rank feeds the same mini-batches (stage 0 uses the inputs, the last stage the targets,
    every stage the input shapes as message keys). After a feed, this rank runs its lowered
    orders up to its first forward (or receive of an activation) of a micro-batch not fed yet:
    everything before that needs only data fed so far on every rank (tested on the local
    executor), so waiting on a peer there never waits for a feed that has not happened.
    ``clip_global`` clips by the norm over all stages, gathered before each update.
    """

    def __init__(self, stage: Stage, comm: "PipeComm", schedule_for: Callable[[int], Schedule], *,
                 expected: Optional[int] = None, trace_offset: int = 0,
                 clip_global: Optional[float] = None) -> None:
        n = stage.num_stages
        if comm.num_stages != n or comm.stage != stage.index:
            raise ValueError(f"stage {stage.index} of {n} on pipeline rank {comm.stage} of "
                             f"{comm.num_stages}: they must agree")
        super().__init__(schedule_for, expected)
        self.stage, self.comm = stage, comm
        self.trace_offset = trace_offset
        self.clip_global = clip_global
        self.order: List[Any] = []
        self.fed_micro = 0
        self._pointer = 0
        self._data: Dict[int, Tuple[Any, Any, float]] = {}
        self._keys: Dict[int, Signature] = {}
        self._received: Dict[int, Any] = {}
        self._grads: Dict[int, Any] = {}
        self._outgoing: Dict[int, Any] = {}
        self._window_loss: Optional[WindowLosses] = None

    def feed(self, microbatches: Sequence[MicroBatch]) -> None:
        self._add_batch(len(microbatches))
        stage, first = self.stage, self.fed_micro
        for inputs, target, share in microbatches:
            i = self.fed_micro
            self._keys[i] = signature((inputs, target, share))
            self._data[i] = (inputs if stage.is_first else None, target if stage.is_last else None, share)
            self.fed_micro += 1
        new = [(i, self._keys[i]) for i in range(first, self.fed_micro)]
        self.comm.expect_more(new if not stage.is_first else [], new if not stage.is_last else [])
        self._run()

    def finish(self) -> None:
        """The data has ended: run the rest of this rank's orders for the mini-batches fed, and
        wait for every send."""
        if self.finished:
            return
        final = self._final_orders()
        if self.fed_batches:
            if final is not None:
                done = self.order[:self._pointer]
                self._use(final, open_ended=False)
                self._check_prefix(final.name, f"stage {self.stage.index}", self.order, done)
            self._run()
        self.comm.flush()

    def take_completed(self, wait: bool = False) -> List[Tuple[int, float]]:
        """(window, loss) completed since the last call: on the last stage; elsewhere none."""
        return self._window_loss.take_completed(wait) if self._window_loss is not None else []

    def _use(self, schedule: Schedule, open_ended: bool) -> None:
        check_runnable(schedule, self.stage.num_stages)
        k = self.stage.index
        sync = schedule.options.get("synchronous_updates", 0)
        if self.schedule is None:
            self.stage.policy.begin_epoch(schedule.orders[k], schedule.orders, open_ended=open_ended,
                                          synchronous_updates=sync)
            self.stage.trace_offset = self.trace_offset
            self._window_loss = WindowLosses(schedule.microbatches_per_update)
        else:
            self.stage.policy.extend_epoch(schedule.orders[k], schedule.orders, open_ended=open_ended,
                                           synchronous_updates=sync)
        self.schedule, self.horizon = schedule, schedule.num_updates
        self.order = lower(schedule).orders[k]

    def _update_follows(self) -> bool:
        """Whether this stage's next compute action after the current backward is an update."""
        for action in self.order[self._pointer + 1:]:
            if action.kind.is_compute:
                return action.kind is Kind.U
        return False

    def _run(self) -> None:
        stage, comm, order, keys = self.stage, self.comm, self.order, self._keys
        while self._pointer < len(order):
            action = order[self._pointer]
            i, kind = action.index, action.kind
            if kind in (Kind.F, Kind.RECV_F) and i >= self.fed_micro:
                break  # not fed yet: the schedule may still end before it
            if kind is Kind.RECV_F:
                self._received[i] = comm.recv_activation(i, keys[i])
            elif kind is Kind.F:
                inputs = self._data[i][0] if stage.is_first else self._received.pop(i)
                _, target, share = self._data.pop(i)
                out = stage.forward(i, inputs, target, share)
                if stage.is_last:
                    self._window_loss.add(i, out)
                else:
                    self._outgoing[i] = out
            elif kind is Kind.SEND_F:
                comm.send_activation(i, keys[i], self._outgoing.pop(i))
            elif kind is Kind.RECV_B:
                self._grads[i] = comm.recv_gradient(i, keys[i])
            elif kind is Kind.B:
                if isinstance(stage.grad_sync, GradientAverager) and self._update_follows():
                    stage.grad_sync.overlap()
                grad_in = stage.backward(i, None if stage.is_last else self._grads.pop(i))
                if not stage.is_first:
                    self._outgoing[i] = grad_in
            elif kind is Kind.I:  # the replicas' reduction then waits for the update
                grad_in = stage.backward_input(i, None if stage.is_last else self._grads.pop(i))
                if not stage.is_first:
                    self._outgoing[i] = grad_in
            elif kind is Kind.W:
                stage.backward_weight(i)
            elif kind is Kind.SEND_B:
                comm.send_gradient(i, keys.pop(i), self._outgoing.pop(i))
            elif kind is Kind.U:
                if self.clip_global is not None:  # one stage too: its norm is the model's
                    stage.sync_gradients()  # replicas first: the norm is of the averaged gradient
                    norms = gather_all(stage.grad_norm().cpu(), comm, "agreeing on the gradient norm")
                    stage.update(grad_scale=clip_coefficient(norms, self.clip_global))
                else:
                    stage.update()
            else:
                raise ValueError(f"the distributed executor cannot run {action}")
            if kind in (Kind.B, Kind.I) and stage.is_first:
                keys.pop(i, None)
            self._pointer += 1
            comm.poll()  # forget the sends that have completed
