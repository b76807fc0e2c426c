"""The local executor: every stage in one process, interpreting the schedule's action lists.

Each rank follows its own list (one stage, or several: chunks); the executor moves activations
and gradients between stages and runs whichever rank's next action is ready. Why any valid
interleaving gives the same numbers and why streaming over a horizon is exact:
(docs/architecture.md, "Schedules as data"); a forward of a micro-batch not fed yet waits, and
:meth:`LocalExecutor.finish` drains. That bookkeeping, shared with the distributed executor, is
:class:`~pipeoptim.runtime.segment.StreamedSegment`; this module's own part is how a message
travels: a mailbox between stages of one process."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..schedules.actions import Kind, Schedule
from .forward_only import ForwardOnly
from .replicas import ReplicaUpdates
from .segment import (MicroBatch, ScheduleFor, StreamedSegment, WindowLosses, check_runnable, clip_coefficient,
                      stage_orders)
from .stage import Stage


class ScheduleStuck(RuntimeError):
    """No stage can make progress: the schedule and the data disagree."""


class LocalExecutor(StreamedSegment):
    """Runs one schedule (a segment: the mini-batches between two drains) over all stages.

    ``schedule_for(T)`` builds the segment's schedule for T mini-batches. ``expected`` is the
    segment's length when known (then the schedule is built once, for exactly that many);
    otherwise the horizon doubles as data comes. ``clip_global`` clips the gradient norm over
    all stages before each update (synchronous schedules only: every stage's update waits for
    the others'). ``on_loss(window, loss)`` is called as each mini-batch's loss completes
    (windows counted from 0 in this segment); :meth:`take_completed` returns them too.
    ``forward_only``: the micro-batches the schedule's ``E`` actions forward (an evaluation in
    the bubbles, ``runtime/forward_only.py``); a schedule with E actions needs it.
    """

    def __init__(self, stages: Sequence[Stage], schedule_for: ScheduleFor, *,
                 expected: Optional[int] = None, trace_offset: int = 0,
                 clip_global: Optional[float] = None,
                 on_loss: Optional[Callable[[int, float], None]] = None,
                 forward_only: Optional[ForwardOnly] = None) -> None:
        super().__init__(schedule_for, expected)
        self.forward_only = forward_only
        self._passing: Dict[Tuple[int, int], Any] = {}  # (stage, E micro-batch) -> its input
        self.stages = list(stages)
        self.trace_offset = trace_offset
        self.clip_global = clip_global
        self.on_loss = on_loss
        self.fed_micro = 0
        self._data: Dict[int, MicroBatch] = {}
        self._activations: Dict[Tuple[int, int], Any] = {}
        self._gradients: Dict[Tuple[int, int], Any] = {}
        self._pointer: List[int] = []  # per rank: the next action of its order
        self._window_loss: Optional[WindowLosses] = None
        #: two pipelines of the same pieces (a mirrored method): the second's stages are replicas
        self.mirrored = any(stage.replica_of is not None for stage in self.stages)
        self._replicas = ReplicaUpdates(self.stages) if self.mirrored else None

    # -- feeding ------------------------------------------------------------------------------
    def feed(self, microbatches: Sequence[MicroBatch]) -> None:
        """Add one mini-batch (its micro-batches, in order) and run everything now runnable."""
        self._add_batch(len(microbatches))
        for mb in microbatches:
            self._data[self.fed_micro] = mb
            self.fed_micro += 1
        self._run()

    def finish(self) -> None:
        """The data has ended: run the rest of the schedule for exactly the mini-batches fed."""
        if self.finished:
            return
        final = self._final_orders()
        if self.fed_batches == 0:
            return
        if final is not None:
            for r, order in enumerate(final.orders):
                self._check_prefix(final.name, f"rank {r}", order, self.schedule.orders[r][:self._pointer[r]])
            self._use(final, open_ended=False)
        self._run()
        left = [str(self.schedule.orders[k][p]) for k, p in enumerate(self._pointer)
                if p < len(self.schedule.orders[k])]
        if left:
            raise ScheduleStuck(f"no stage can proceed; waiting: {', '.join(left)}")

    def take_completed(self, wait: bool = False) -> List[Tuple[int, float]]:
        """(window, loss) of the mini-batches completed since the last call, in order (on an
        accelerator, those whose loss has reached the host; ``wait`` waits for all)."""
        return self._window_loss.take_completed(wait) if self._window_loss is not None else []

    # -- internals ----------------------------------------------------------------------------
    def _use(self, schedule: Schedule, open_ended: bool) -> None:
        check_runnable(schedule, len(self.stages), self.mirrored)
        first = self.schedule is None
        if self._replicas is not None:
            self._replicas.use(schedule)
        self.schedule, self.horizon = schedule, schedule.num_updates
        if first:
            self._pointer = [0] * schedule.num_ranks
        own = stage_orders(schedule)
        sync = schedule.options.get("synchronous_updates", 0)
        for stage in self.stages:
            if first:
                stage.policy.begin_epoch(own[stage.index], schedule.orders,
                                         open_ended=open_ended, synchronous_updates=sync)
                stage.trace_offset = self.trace_offset
            else:
                stage.policy.extend_epoch(own[stage.index], schedule.orders,
                                          open_ended=open_ended, synchronous_updates=sync)
        if first:
            m = schedule.microbatches_per_update
            self._window_loss = WindowLosses(m, self.on_loss, halves=m // 2 if self.mirrored else None)

    def _run(self) -> None:
        """Run every rank's order as far as its inputs exist. A rank holds one stage or several
        (chunks); an action names its stage, and the mailboxes are keyed by (stage, micro-batch)."""
        stages, orders, pointer = self.stages, self.schedule.orders, self._pointer
        data, activations, gradients = self._data, self._activations, self._gradients
        progressed = True
        while progressed:
            progressed = False
            for r, order in enumerate(orders):
                while pointer[r] < len(order):
                    action = order[pointer[r]]
                    k, i = action.stage, action.index
                    stage = stages[k]
                    if action.kind is Kind.F:
                        if i >= self.fed_micro:
                            break  # not fed yet: the schedule may still end before it
                        if stage.is_first:
                            inputs = data[i][0]
                        elif (k, i) in activations:
                            inputs = activations.pop((k, i))
                        else:
                            break
                        _, target, share = data[i]
                        out = stage.forward(i, inputs, target if stage.is_last else None, share)
                        if stage.is_last:
                            del data[i]  # every stage of its pipeline has run this micro-batch's forward
                            self._window_loss.add(i, out)
                        else:
                            activations[(self.schedule.next_stage(k), i)] = out
                    elif action.kind is Kind.B or action.kind is Kind.I:
                        if stage.is_last:
                            grad = None
                        elif (k, i) in gradients:
                            grad = gradients.pop((k, i))
                        else:
                            break
                        backward = stage.backward if action.kind is Kind.B else stage.backward_input
                        grad_in = backward(i, grad)
                        if not stage.is_first:
                            gradients[(self.schedule.prev_stage(k), i)] = grad_in
                        if self._replicas is not None and action.kind is Kind.B:
                            self._replicas.backward_done(k, i)
                    elif action.kind is Kind.W:
                        stage.backward_weight(i)
                        if self._replicas is not None:
                            self._replicas.backward_done(k, i)
                    elif action.kind is Kind.E:
                        if not self._forward_only(k, i):
                            break
                    elif action.kind is Kind.U:
                        if self._replicas is not None and not self._replicas.ready(k, i):
                            break  # the other replica's backwards of this window are still to come
                        if self.clip_global is not None:  # one stage too: its norm is the model's
                            if not self._update_all(i):
                                break
                            progressed = True
                            continue  # every rank's pointer has moved past its updates
                        stage.update()
                    else:
                        raise ValueError(f"the local executor runs compute actions, not {action}")
                    pointer[r] += 1
                    progressed = True

    def _forward_only(self, k: int, i: int) -> bool:
        """Stage ``k``'s forward-only pass of E micro-batch ``i``, if its input is here."""
        work, stage = self.forward_only, self.stages[k]
        if work is None:
            raise ValueError(f"{self.schedule.name} holds forward-only actions (E) but this executor "
                             f"was given no forward-only work (Pipeline.evaluate_in_bubbles)")
        if stage.is_first:
            inputs = work.inputs(i)
        elif (k, i) in self._passing:
            inputs = self._passing.pop((k, i))
        else:
            return False
        out = work.forward(stage, i, inputs)
        if not stage.is_last:
            self._passing[(self.schedule.next_stage(k), i)] = out
        return True

    def _update_all(self, update: int) -> bool:
        """Global clipping: when every stage's next action is update ``update`` (on each rank,
        the updates of its stages next in a row), clip their gradients by the norm over all of
        them and run all the updates, moving every rank past them; else wait."""
        orders, pointer = self.schedule.orders, self._pointer
        ready: Dict[int, int] = {}  # rank -> its updates next in a row
        for r, order in enumerate(orders):
            p = pointer[r]
            while p < len(order) and order[p].kind is Kind.U and order[p].index == update:
                p += 1
            ready[r] = p - pointer[r]
        held = {a.stage for r, order in enumerate(orders) for a in order[pointer[r]:pointer[r] + ready[r]]}
        if len(held) != len(self.stages):
            return False
        scale = clip_coefficient([s.grad_norm() for s in self.stages], self.clip_global)
        for stage in self.stages:
            stage.update(grad_scale=scale)
        for r in ready:
            pointer[r] += ready[r]
        return True


def run_schedule(stages: Sequence[Stage], schedule: Schedule, microbatches: Sequence[MicroBatch],
                 on_loss: Optional[Callable[[int, float], None]] = None,
                 trace_offset: int = 0) -> Dict[int, float]:
    """Run one whole schedule over ``microbatches`` (indexed as the schedule's micro-batches).

    Returns the loss of each update window (mini-batch): the sum of its micro-batches' scaled
    losses. ``on_loss(window, loss)`` is called as soon as a window's loss is complete.
    ``trace_offset`` numbers this schedule's micro-batches after earlier epochs' in the traces.
    """
    m = schedule.microbatches_per_update
    windows = schedule.num_updates
    executor = LocalExecutor(stages, lambda batches: schedule, expected=windows,
                             trace_offset=trace_offset, on_loss=on_loss)
    for w in range(windows):
        executor.feed(microbatches[w * m:(w + 1) * m])
    executor.finish()
    executor.take_completed(wait=True)
    return dict(executor._window_loss)
