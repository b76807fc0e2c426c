"""The distributed executor: one process per stage, the same Stage and the same action lists.

What it runs and what travels is (docs/architecture.md, "The distributed executor"). The
transport is :mod:`~pipeoptim.runtime.transport` (over :mod:`~pipeoptim.runtime.link` and
:mod:`~pipeoptim.runtime.wire`); joining the job and the control group's collectives are
:mod:`~pipeoptim.runtime.control`; the replicas' gradient averaging is
:mod:`~pipeoptim.runtime.averaging`. :class:`pipeoptim.Pipeline` under torchrun
(:class:`pipeoptim.torchrun.Torchrun`) drives it, for a user's script and the command line alike.
The loss never leaves the last stage until the segment's drain. Dropout differs from the local
runtime because the local executor interleaves all stages' draws on one generator."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..schedules.actions import Kind, Schedule
from ..schedules.lower import lower
from .averaging import GradientAverager
from .control import gather_all
from .forward_only import ForwardOnly
from .replicas import ReplicaUpdates
from .segment import MicroBatch, StreamedSegment, WindowLosses, check_runnable, clip_coefficient, stage_orders
from .stage import Stage
from .transport import PipeComm
from .wire import Signature, signature


class DistributedExecutor(StreamedSegment):
    """This process's stages of a pipeline whose other stages run in other processes: the
    streaming counterpart of :class:`~pipeoptim.runtime.local.LocalExecutor`, with the same
    ``feed`` / ``finish`` / ``take_completed``.

    A process holds one stage, or several (chunks: ``comm.placement`` says which rank holds
    each); the lowered orders of its rank name the stage of each action. Between two stages of
    this process a value is handed over in memory (lowering adds no message there); between
    processes it goes through ``comm``, on the link of that boundary.

    Every rank feeds the same mini-batches (stage 0 uses the inputs, the last stage the targets,
    every stage the input shapes as message keys). After a feed, this rank runs its lowered
    orders up to its first forward (or receive of an activation) of a micro-batch not fed yet:
    everything before that needs only data fed so far on every rank (tested on the local
    executor), so waiting on a peer there never waits for a feed that has not happened.
    ``clip_global`` clips by the norm over all stages, gathered before each update.
    ``forward_only``: the micro-batches of the schedule's ``E`` actions (an evaluation in the
    bubbles): their activations travel on the links as the drained evaluation's do (micro-batch
    ``-1 - j``), after the first mini-batch's, where every rank's plan puts them.
    """

    def __init__(self, stage: Union[Stage, Sequence[Stage]], comm: "PipeComm",
                 schedule_for: Callable[[int], Schedule], *, expected: Optional[int] = None,
                 trace_offset: int = 0, clip_global: Optional[float] = None,
                 replica_groups: Optional[Dict[int, Any]] = None,
                 forward_only: Optional[ForwardOnly] = None) -> None:
        """``replica_groups``: a bidirectional run's 2-process group of each piece whose two
        replicas are on two processes (piece -> group), for the sum of their gradients."""
        own = [stage] if isinstance(stage, Stage) else list(stage)
        n = own[0].num_stages
        held = [s.index for s in own]
        if len(comm.placement) != n or held != [k for k in range(n) if comm.placement[k] == comm.stage]:
            raise ValueError(f"stages {held} of {n} on pipeline rank {comm.stage} of {comm.num_stages} "
                             f"(placement {comm.placement}): they must agree")
        super().__init__(schedule_for, expected)
        self.stages: Dict[int, Stage] = {s.index: s for s in own}
        self.stage, self.comm = own[0], comm  # stage: the first this process holds
        self.num_stages = n
        self.trace_offset = trace_offset
        self.clip_global = clip_global
        self.order: List[Any] = []
        self.fed_micro = 0
        self._pointer = 0
        self._data: Dict[int, Tuple[Any, Any, float]] = {}
        self._keys: Dict[int, Signature] = {}
        # keyed by (stage, micro-batch): a stage's input received (or handed over), the gradient
        # of its output, and what it sends next
        self._received: Dict[Tuple[int, int], Any] = {}
        self._grads: Dict[Tuple[int, int], Any] = {}
        self._outgoing: Dict[Tuple[int, int], Any] = {}
        self._clip_scale: Optional[Tuple[int, Any]] = None  # (update, coefficient) under global clipping
        self.forward_only = forward_only
        #: per E micro-batch j: its message key (its inputs' shapes, as the drained evaluation's)
        self._e_keys = [signature((x, y, 1.0)) for x, y in forward_only.items] if forward_only else []
        self._e_values: Dict[Tuple[int, int], Any] = {}  # (stage, j): an E's input received, or output to send
        self._window_loss: Optional[WindowLosses] = None
        #: two pipelines of the same pieces (a bidirectional run): routing by the schedule's chains
        self.mirrored = any(s.replica_of is not None for s in own)
        self._chain_of: Dict[int, int] = {}
        # the sum of a piece's two replicas: in this process where both are here, else over the
        # piece's 2-process group (one summer per group: pieces j and N-1-j share theirs)
        self._local_replicas = ReplicaUpdates(self._stage_list()) if self.mirrored else None
        groups = replica_groups or {}
        self._replica_sums = {piece: GradientAverager(g, 2, comm.timeout, mean=False) for piece, g in groups.items()}

    def feed(self, microbatches: Sequence[MicroBatch]) -> None:
        self._add_batch(len(microbatches))
        first_held = any(s.is_first for s in self.stages.values())
        last_held = any(s.is_last for s in self.stages.values())
        first = self.fed_micro
        for inputs, target, share in microbatches:
            i = self.fed_micro
            self._keys[i] = signature((inputs, target, share))
            self._data[i] = (inputs if first_held else None, target if last_held else None, share)
            self.fed_micro += 1
        new = [(i, self._keys[i]) for i in range(first, self.fed_micro)]
        # on every link this rank receives on (none: nothing); two pipelines: each its half
        self.comm.expect_more(new, new, self._travels if self.mirrored else None)
        if self.fed_batches == 1 and self._e_keys:  # the E's follow mini-batch 0's forwards on every link
            self.comm.expect_more([(-1 - j, key) for j, key in enumerate(self._e_keys)], [])
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
                self._check_prefix(final.name, f"rank {self.comm.stage}", self.order, done)
            self._run()
        self.comm.flush()
        for stage in self.stages.values():  # asynchronous methods: the holders' copies of a tie
            if stage.tied is not None:
                stage.tied.drained()

    def take_completed(self, wait: bool = False) -> List[Tuple[int, float]]:
        """(window, loss) completed since the last call: on the last stage's rank; elsewhere none."""
        return self._window_loss.take_completed(wait) if self._window_loss is not None else []

    def _use(self, schedule: Schedule, open_ended: bool) -> None:
        check_runnable(schedule, self.num_stages, self.mirrored)
        self._chain_of = {k: c for c, chain in enumerate(schedule.pipelines) for k in chain}
        # per chain: this process's last and first stage of it (a micro-batch's last forward
        # here, and its last message here)
        own_by_chain: Dict[int, List[int]] = {}
        for k in self.stages:
            own_by_chain.setdefault(self._chain_of[k], []).append(k)
        self._last_own_in = {c: max(ks) for c, ks in own_by_chain.items()}
        self._first_own_in = {c: min(ks) for c, ks in own_by_chain.items()}
        if self._local_replicas is not None:
            self._local_replicas.use(schedule)
        if schedule.stage_to_rank != self.comm.placement:
            raise ValueError(f"schedule {schedule.name} places its stages on ranks {schedule.stage_to_rank}, "
                             f"the links were made for {self.comm.placement}")
        sync = schedule.options.get("synchronous_updates", 0)
        own = stage_orders(schedule)
        for k, stage in self.stages.items():
            if self.schedule is None:
                stage.policy.begin_epoch(own[k], schedule.orders, open_ended=open_ended,
                                         synchronous_updates=sync)
                stage.trace_offset = self.trace_offset
            else:
                stage.policy.extend_epoch(own[k], schedule.orders, open_ended=open_ended,
                                          synchronous_updates=sync)
        if self.schedule is None:
            m = schedule.microbatches_per_update
            lasts = sum(1 for s in self.stages.values() if s.is_last)  # a bidirectional rank: its half
            self._window_loss = WindowLosses(m, halves=m // 2 if self.mirrored else None,
                                             expected=m * lasts // 2 if self.mirrored else None)
        self.schedule, self.horizon = schedule, schedule.num_updates
        self.order = lower(schedule).orders[self.comm.stage]

    def _overlap_averaging(self, stage: Stage) -> None:
        """Before a backward (``B``) or weight half (``W``) that is the last before an update:
        the replicas' averaging may start as gradients become final (``averaging.GradientAverager``;
        an ``I`` leaves every weight gradient to its ``W``)."""
        if isinstance(stage.grad_sync, GradientAverager) and self._update_follows():
            stage.grad_sync.overlap()

    def _update_follows(self) -> bool:
        """Whether this rank's next compute action after the current backward is an update."""
        for action in self.order[self._pointer + 1:]:
            if action.kind.is_compute:
                return action.kind is Kind.U
        return False

    def _hand_over(self, store: Dict[Tuple[int, int], Any], k: int, to: int, i: int, value: Any) -> None:
        """Stage ``k``'s value for stage ``to``: in memory if this process holds ``to``, else
        kept for the send that the lowered order puts next."""
        if to in self.stages:
            store[(to, i)] = value
        else:
            self._outgoing[(k, i)] = value

    def _run(self) -> None:
        comm, order, keys, stages = self.comm, self.order, self._keys, self.stages
        while self._pointer < len(order):
            action = order[self._pointer]
            k, i, kind = action.stage, action.index, action.kind
            if kind in (Kind.F, Kind.RECV_F) and i >= self.fed_micro:
                break  # not fed yet: the schedule may still end before it
            stage = stages[k]
            if kind is Kind.RECV_F:
                self._received[(k, i)] = comm.recv_activation(i, keys[i], stage=k)
            elif kind is Kind.F:
                inputs = self._data[i][0] if stage.is_first else self._received.pop((k, i))
                _, target, share = self._data[i]
                if k == self._last_own_in[self._chain_of[k]]:  # this process's last forward of it
                    del self._data[i]
                out = stage.forward(i, inputs, target, share)
                if stage.is_last:
                    self._window_loss.add(i, out)
                else:
                    self._hand_over(self._received, k, self.schedule.next_stage(k), i, out)
            elif kind is Kind.SEND_F:
                comm.send_activation(i, keys[i], self._outgoing.pop((k, i)), stage=k)
            elif kind is Kind.RECV_B:
                self._grads[(k, i)] = comm.recv_gradient(i, keys[i], stage=k)
            elif kind is Kind.B or kind is Kind.I:
                if kind is Kind.B:
                    self._overlap_averaging(stage)
                backward = stage.backward if kind is Kind.B else stage.backward_input
                grad_in = backward(i, None if stage.is_last else self._grads.pop((k, i)))
                if not stage.is_first:
                    self._hand_over(self._grads, k, self.schedule.prev_stage(k), i, grad_in)
                if self._local_replicas is not None and kind is Kind.B:
                    self._replica_backward_done(k, i)
            elif kind is Kind.W:
                self._overlap_averaging(stage)
                stage.backward_weight(i)
                if self._local_replicas is not None:
                    self._replica_backward_done(k, i)
            elif kind is Kind.SEND_B:
                comm.send_gradient(i, keys[i], self._outgoing.pop((k, i)), stage=k)
            elif kind is Kind.RECV_E:
                self._e_values[(k, i)] = comm.recv_activation(-1 - i, self._e_keys[i], stage=k)
            elif kind is Kind.E:
                work = self.forward_only
                out = work.forward(stage, i, work.inputs(i) if stage.is_first else self._e_values.pop((k, i)))
                if out is not None:
                    self._e_values[(k, i)] = out
            elif kind is Kind.SEND_E:
                comm.send_activation(-1 - i, self._e_keys[i], self._e_values.pop((k, i)), stage=k)
            elif kind is Kind.U:
                if self.mirrored:
                    self._sum_replicas(k, i)
                if self.clip_global is not None:  # one stage too: its norm is the model's
                    stage.update(grad_scale=self._global_scale(i))
                else:
                    stage.update()
            else:
                raise ValueError(f"the distributed executor cannot run {action}")
            if k == self._first_own_in[self._chain_of[k]] and (
                    kind is Kind.SEND_B or (stage.is_first and kind in (Kind.B, Kind.I))):
                keys.pop(i, None)  # this process's last message of the micro-batch
            self._pointer += 1
            comm.poll()  # forget the sends that have completed

    def _travels(self, boundary: int, microbatch: int) -> bool:
        """Whether ``microbatch`` crosses ``boundary`` (stages boundary -> boundary + 1): a
        bidirectional window's first half takes the first pipeline, the rest the second."""
        m = self.schedule.microbatches_per_update
        return self._chain_of[boundary] == (0 if microbatch % m < m // 2 else 1)

    def _stage_list(self) -> List[Stage]:
        """This process's stages, indexable by stage number (None where another process holds it)."""
        return [self.stages.get(k) for k in range(self.num_stages)]

    def _replica_backward_done(self, k: int, i: int) -> None:
        """Stage ``k`` finished its backward of ``i``. A replicated piece whose other replica is
        on another process starts summing its gradients asynchronously after its last backward
        of the window, overlapped with the rest of the schedule until its update waits for it."""
        self._local_replicas.backward_done(k, i)
        summer = self._replica_sums.get(k % (self.num_stages // 2))
        if summer is not None and self._local_replicas.window_done(k, i):
            summer.overlap()
            summer.ready_all(list(self.stages[k].parameters()))
            summer.launch_bucketed()

    def _sum_replicas(self, k: int, update: int) -> None:
        """Before update ``update`` of a replicated piece: both replicas' gradients summed, in
        this process (both replicas here: the first of the two updates sums for both) or over
        the piece's 2-process group, where the sum started after the piece's last backward of the
        window (:meth:`_replica_backward_done`) and the update waits for it. A parameter with no
        gradient in the window on either
        replica takes a zero one there (one process: none), which only an optimizer that skips
        parameters without a gradient tells apart."""
        summer = self._replica_sums.get(k % (self.num_stages // 2))
        if summer is None:  # both replicas here
            ready = self._local_replicas.ready(k, update)
            assert ready, "a replica's update comes after both replicas' backwards in this process's order"
            return
        summer(self.stages[k].parameters())

    def _global_scale(self, update: int) -> Any:
        """The clipping coefficient of update ``update`` over every stage of every rank: at this
        rank's first update of that number (every backward before it done), its stages' norms
        are gathered from all ranks and put in stage order (the local executor's sum, to the
        bit); its other stages' updates reuse the coefficient."""
        if self._clip_scale is None or self._clip_scale[0] != update:
            for stage in self.stages.values():
                stage.sync_gradients()  # replicas first: the norm is of the averaged gradient
            own = [s.grad_norm().cpu() for s in self.stages.values()]
            parts = gather_all(own, self.comm, "agreeing on the gradient norm")
            place = self.comm.placement
            held = {r: [k for k in range(self.num_stages) if place[k] == r] for r in range(len(parts))}
            by_stage = {k: norm for r, part in enumerate(parts) for k, norm in zip(held[r], part)}
            norms = [by_stage[k] for k in range(self.num_stages)]
            self._clip_scale = (update, clip_coefficient(norms, self.clip_global))
        return self._clip_scale[1]
