"""The one interpreter of schedules: each rank's lowered order, walked action by action, in one
process or in one process per rank (docs/architecture.md, "The executor").

A rank's lowered order (``schedules/lower.py``) holds its compute actions (F, B, I, W, E, U) and
the transfers between its stages and another rank's (SEND_*/RECV_*). :class:`Executor` walks it
with a :class:`Walker` per rank this process plays: every rank in one process (the walkers take
turns until none moves), one under torchrun. Only how a transfer travels differs, behind a
:class:`~pipeoptim.runtime.interfaces.Transport`: a hand-off in memory (``runtime/local.Mailbox``) or a message
(``runtime/distributed.PipeTransport``); between two stages of one rank the walker hands the
value over itself. A walker stops (and is resumed later) at a forward, or a receive of an
activation, of a micro-batch not fed yet, at a receive whose message has not come, at an update
whose other replica has not finished its window (mirrored methods), and, with global clipping
or fp16's loss scale (``runtime/loss_scaling.py``), at its first update of a number until every
walker of the process has reached its own. Any interleaving that runs each action once its inputs
exist gives the same numbers (docs/architecture.md, "Schedules as data").

A forward paired with another micro-batch's backward (``Schedule.pairs``, torch's
``OVERLAP_F_B``; ``schedules/v_shape.py``; lowered with both receives before it): a receive of
the pair waits, as the forward's own would, until the forward's micro-batch is fed. Here the
forward runs, then the backward. A GPU build would overlap them at that point of
:meth:`Executor._walk` (the ``F`` branch meeting a paired forward: both inputs are in the
stores), the two passes on two CUDA streams so that one's compute hides the other's transfers
(DualPipe's all-to-all); the numbers stay the same, the two being independent."""
from __future__ import annotations

from dataclasses import replace
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

from ..schedules.actions import COMPUTE_KINDS, Action, Kind, Schedule
from ..schedules.lower import lower
from .loss_scaling import UpdateAgreement
from .pass_errors import PassErrors
from .replicas import ReplicaUpdates
from .interfaces import Key, Transport
from .segment import MicroBatch, ScheduleFor, WindowLosses, check_runnable, next_horizon, stage_orders
from .stage import Stage

if TYPE_CHECKING:  # (forward_only.py builds on this module)
    from .forward_only import ForwardOnly



class ScheduleStuck(RuntimeError):
    """No rank can make progress: the schedule and the data disagree."""


class Walker:
    """One rank's place in its lowered order, and the agreement of its update in progress (the
    global clipping coefficient, fp16's skip: taken at its first update of that number, reused by
    the others)."""

    __slots__ = ("rank", "order", "pos", "overlap_at", "clip_update", "clip_scale", "skip", "gates")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.order: List[Action] = []
        self.pos = 0
        #: positions of the backwards (or weight halves) after which the next compute action is an
        #: update: the replicas' gradient averaging starts there (torchrun's data parallel)
        self.overlap_at: FrozenSet[int] = frozenset()
        #: positions of the receives of a pair (forward and backward): the forward's micro-batch,
        #: which must be fed before the pair starts
        self.gates: Dict[int, int] = {}
        self.clip_update = -1
        self.clip_scale: Optional[torch.Tensor] = None
        self.skip = False


class Executor:
    """One segment (the mini-batches between two drains) of this process's ``stages``, walked
    rank by rank over ``transport``, on orders built past the mini-batches fed
    (:func:`~.segment.next_horizon`), then for exactly those fed when the data ends.

    ``ranks``: the ranks this process plays (None: every rank of the schedule, one process).
    ``schedule_for(T)`` builds the segment's schedule for T mini-batches; ``expected``: the
    segment's length when known (built once), else the horizon doubles as data comes.
    ``clip_global``: clip each update's gradients by the norm over every stage (synchronous
    methods); it and fp16's loss scale, which the stages carry (``runtime/loss_scaling.py``), are
    agreed on at each update over every stage. ``on_loss(window, loss)`` is called as each
    mini-batch's loss completes (windows from 0 in this segment), on the process holding the last
    stage; :meth:`take_completed` returns them too. ``forward_only``: the work of the schedule's
    ``E`` actions, beside training or alone (:meth:`feed_forward_only`).
    ``replica_sums``: piece -> the summer of its two replicas' gradients where they are on two
    processes (``averaging.GradientAverager`` over their 2-process group)."""

    def __init__(self, stages: Sequence[Stage], transport: Transport, schedule_for: ScheduleFor, *,
                 ranks: Optional[Sequence[int]] = None, expected: Optional[int] = None,
                 trace_offset: int = 0, clip_global: Optional[float] = None,
                 on_loss: Optional[Callable[[int, float], None]] = None,
                 forward_only: Optional[ForwardOnly] = None,
                 replica_sums: Optional[Dict[int, Any]] = None) -> None:
        self.schedule_for = schedule_for
        self.expected = expected
        self.schedule: Optional[Schedule] = None
        self.horizon = 0  #: mini-batches the current orders are built for
        self.fed_batches = 0
        self.finished = False
        self._alone = False  #: forward-only work alone (:meth:`feed_forward_only`), no training
        own = sorted(stages, key=lambda s: s.index)
        self.num_stages = own[0].num_stages
        self.own = own  #: this process's stages, in stage order
        #: indexable by stage number; None where another process holds the stage
        self.stage_list: List[Optional[Stage]] = [None] * self.num_stages
        for stage in own:
            self.stage_list[stage.index] = stage
        self.transport = transport
        self.trace_offset = trace_offset
        self.clip_global = clip_global
        self.on_loss = on_loss
        self.forward_only = forward_only
        self.fed_micro = 0
        self._ranks = list(ranks) if ranks is not None else None
        self.walkers: List[Walker] = []
        self._data: Dict[int, MicroBatch] = {}
        #: the rows of the micro-batches fed, for an error of the user's code to say where it happened
        self._errors = PassErrors(Executor._forward_only)
        self._holds_first = any(s.is_first for s in own)
        self._holds_last = any(s.is_last for s in own)
        self._inputs: Dict[Key, Any] = {}
        self._grads: Dict[Key, Any] = {}
        self._evals: Dict[Key, Any] = {}
        self._outgoing: Dict[Key, Any] = {}  # a value whose SEND comes next in its rank's order
        transport.attach(self._inputs, self._grads, self._evals)
        self._window_loss: Optional[WindowLosses] = None
        self._arrived: set = set()  # global clipping, fp16: the ranks at their first update of its number
        self._agreement = UpdateAgreement(clip_global, own) if UpdateAgreement.needed(clip_global, own) else None
        #: two pipelines of the same pieces (a mirrored method): the second's stages are replicas
        self.mirrored = any(s.replica_of is not None for s in own)
        self._replicas = ReplicaUpdates(self.stage_list, replica_sums) if self.mirrored else None

    # -- the segment ------------------------------------------------------------------------
    def feed(self, microbatches: Sequence[MicroBatch]) -> None:
        """Add one mini-batch (its micro-batches, in order) and run everything now runnable."""
        self._grow(alone=False)
        if len(microbatches) != self.schedule.microbatches_per_update:
            raise ValueError(f"a mini-batch must come as {self.schedule.microbatches_per_update} "
                             f"micro-batches, got {len(microbatches)}")
        first = self.fed_micro
        for inputs, target, share in microbatches:
            self._data[self.fed_micro] = (inputs if self._holds_first else None,
                                          target if self._holds_last else None, share)
            self.fed_micro += 1
        self._errors.fed(self.fed_batches - 1, microbatches)
        self.transport.fed(first, microbatches, self.fed_batches)
        self._run()

    def feed_forward_only(self, inputs: Any, target: Any) -> None:
        """Forward-only work alone, on a drained pipeline (a drained evaluation, a call of the
        pipelined model): one more of its micro-batches (``target``: the last stage's), run now
        through every stage here. ``schedule_for(n)`` builds the E actions alone of n of them
        (``schedules/fill.forward_alone``: each rank's, micro-batch after micro-batch), the
        horizon growing as they come, as a segment's; each is dropped once run, so that a loader
        is never held whole."""
        work = self.forward_only
        j = work.add(inputs, target)
        self._grow(alone=True)
        self.transport.fed_forward_only(j, work.key(j))
        self._run()
        work.spent(j)

    def _grow(self, alone: bool) -> None:
        """One more mini-batch (or forward-only micro-batch, ``alone``): the orders are built
        further where they do not reach past it."""
        if self.finished:
            raise RuntimeError("this segment has finished; start a new one")
        self._alone = alone
        self.fed_batches += 1
        rebuild = next_horizon(self.fed_batches, self.horizon, self.expected, self.schedule is not None)
        if rebuild is not None:
            self._use(self.schedule_for(rebuild[0]), *rebuild)

    def finish(self) -> None:
        """The data has ended: run the rest of the orders for exactly the mini-batches fed."""
        if self.finished:
            return
        self.finished = True
        if self.fed_batches:
            if self.horizon != self.fed_batches:
                final = self.schedule_for(self.fed_batches)
                for w in self.walkers:  # the streaming property every schedule must have
                    done = [a for a in w.order[:w.pos] if a.kind in _COMPUTE]
                    if final.orders[w.rank][:len(done)] != done:
                        raise RuntimeError(f"schedule {final.name}: rank {w.rank} ran {len(done)} actions "
                                           f"that its final orders do not start with")
                self._use(final, self.fed_batches, open_ended=False)
            self._run()
            left = [str(w.order[w.pos]) for w in self.walkers if w.pos < len(w.order)]
            if left:
                raise ScheduleStuck(f"no rank can proceed; waiting: {', '.join(left)}")
        self.transport.drained()

    def take_completed(self, wait: bool = False) -> List[Tuple[int, float]]:
        """(window, loss) of the mini-batches completed since the last call, in order (on an
        accelerator, those whose loss has reached the host; ``wait`` waits for all); none on a
        process without a last stage."""
        return self._window_loss.take_completed(wait) if self._window_loss is not None else []

    def _use(self, schedule: Schedule, batches: int, open_ended: bool) -> None:
        """Walk ``schedule`` (built for ``batches`` mini-batches, or forward-only micro-batches
        alone) on from where each walker stands; in training, the stages' policies learn it."""
        first = self.schedule is None
        self.transport.use(schedule)
        if not self._alone:
            check_runnable(schedule, self.num_stages, self.mirrored)
            if self._replicas is not None:
                self._replicas.use(schedule)
            sync = schedule.options.get("synchronous_updates", 0)
            by_stage = stage_orders(schedule)
            for stage in self.own:
                (stage.policy.begin_epoch if first else stage.policy.extend_epoch)(
                    by_stage[stage.index], schedule.orders, open_ended=open_ended, synchronous_updates=sync)
                if first:
                    stage.start_segment(self.trace_offset)
        if first:
            m = schedule.microbatches_per_update
            lasts = sum(1 for s in self.own if s.is_last)  # a mirrored process: its pipelines' halves
            self._window_loss = WindowLosses(m, self.on_loss, halves=m // 2 if self.mirrored else None,
                                             expected=m * lasts // 2 if self.mirrored else None)
            self.walkers = [Walker(r) for r in (self._ranks if self._ranks is not None
                                                else range(schedule.num_ranks))]
        self.schedule, self.horizon = schedule, batches if self._alone else schedule.num_updates
        n, rank_of = self.num_stages, schedule.stage_to_rank
        self._next = [schedule.next_stage(k) for k in range(n)]
        self._prev = [schedule.prev_stage(k) for k in range(n)]
        #: per stage: whether the next (previous) stage is on the same rank: a hand-over, not a send
        self._next_here = [nxt is not None and rank_of[nxt] == rank_of[k] for k, nxt in enumerate(self._next)]
        self._prev_here = [prv is not None and rank_of[prv] == rank_of[k] for k, prv in enumerate(self._prev)]
        # per stage: whether it is this process's last of its chain (a micro-batch's data is then spent)
        self._drops_data = [False] * n
        for chain in schedule.pipelines:
            held = [k for k in chain if self.stage_list[k] is not None]
            if held:
                self._drops_data[held[-1]] = True
        self._lower_rest(schedule)
        for w in self.walkers:
            w.overlap_at = self._overlap_points(w.order)

    def _lower_rest(self, schedule: Schedule) -> None:
        """Each walker's order from ``schedule``: what it ran of its previous orders (their start,
        by the streaming property; checked at the drain), then the rest of its new compute order
        lowered. A walker never stops between an action and the transfers lowering put after it,
        and lowering expands each action alone, so only the rest needs lowering (and only the
        ranks this process plays)."""
        ran = {w.rank: _computed(w) for w in self.walkers}
        rest = replace(schedule, orders=[order[ran[r]:] if r in ran else []
                                         for r, order in enumerate(schedule.orders)])
        lowered = lower(rest).orders
        for w in self.walkers:
            w.order = w.order[:w.pos] + lowered[w.rank]
            w.gates = _pair_gates(w.order, schedule) if schedule.pairs else {}

    def _overlap_points(self, order: List[Action]) -> FrozenSet[int]:
        """Where in ``order`` a replica's gradient averaging starts (none in one process)."""
        return frozenset()

    # -- the walk ---------------------------------------------------------------------------
    def _run(self) -> None:
        """Let the walkers take turns until none can move."""
        walkers, walk = self.walkers, self._walk
        if len(walkers) == 1:
            walk(walkers[0])
            return
        progressed = True
        while progressed:
            progressed = False
            for w in walkers:
                if walk(w):
                    progressed = True

    def _walk(self, w: Walker) -> bool:
        """Run rank ``w``'s order from where it stands as far as it can go now; whether it moved."""
        F, B, I, W, U, E = Kind.F, Kind.B, Kind.I, Kind.W, Kind.U, Kind.E
        RECV_F, RECV_B, RECV_E = Kind.RECV_F, Kind.RECV_B, Kind.RECV_E
        order, start = w.order, w.pos
        end, fed, stages, data = len(order), self.fed_micro, self.stage_list, self._data
        inputs, grads, outgoing, t = self._inputs, self._grads, self._outgoing, self.transport
        nxt, prv, next_here, prev_here = self._next, self._prev, self._next_here, self._prev_here
        replicas, overlap_at, drops, losses = self._replicas, w.overlap_at, self._drops_data, self._window_loss
        p = start
        try:
            while p < end:
                k, kind, i = order[p]
                if kind is F:
                    if i >= fed:
                        break  # not fed yet: the segment may still end before it
                    stage = stages[k]
                    x, target, share = data[i]
                    if not stage.is_first:
                        x = inputs.pop((k, i))
                    if drops[k]:
                        del data[i]
                    y = stage.forward(i, x, target, share)
                    if stage.is_last:
                        losses.add(i, y)
                    elif next_here[k]:
                        inputs[(nxt[k], i)] = y
                    else:
                        outgoing[(k, i)] = y
                elif kind in _SENDS:
                    t.send(kind, k, i, outgoing.pop((k, i)))
                elif kind is RECV_F:
                    if i >= fed or not t.recv(kind, k, i):
                        break
                elif kind is RECV_B:
                    if w.gates and w.gates.get(p, -1) >= fed:
                        break  # a pair's: its forward's micro-batch is not fed yet
                    if not t.recv(kind, k, i):
                        break
                elif kind is B or kind is I:
                    stage = stages[k]
                    if p in overlap_at:
                        stage.overlapped.overlap()
                    g = None if stage.is_last else grads.pop((k, i))
                    g = (stage.backward if kind is B else stage.backward_input)(i, g)
                    if not stage.is_first:
                        if prev_here[k]:
                            grads[(prv[k], i)] = g
                        else:
                            outgoing[(k, i)] = g
                    if replicas is not None and kind is B:
                        replicas.backward_done(k, i)
                elif kind is W:
                    stage = stages[k]
                    if p in overlap_at:
                        stage.overlapped.overlap()
                    stage.backward_weight(i)
                    if replicas is not None:
                        replicas.backward_done(k, i)
                elif kind is U:
                    agreeing = self._agreement is not None  # (one stage too: its norm is the model's)
                    if agreeing and w.clip_update != i and not self._agree(w, i):
                        break  # every stage's gradients of this update first
                    if replicas is not None and not replicas.ready(k, i):
                        break  # the other replica's backwards of this window are still to come
                    if agreeing:
                        stages[k].update(grad_scale=w.clip_scale, skip=w.skip)
                    else:
                        stages[k].update()
                elif kind is E:
                    if not self._forward_only(k, i):
                        break  # forward-only work alone: not given yet
                elif kind is RECV_E:
                    if i >= len(self.forward_only) or not t.recv(kind, k, i):
                        break
                else:
                    raise ValueError(f"the executor cannot run {order[p]}")
                p += 1
        except Exception as error:  # the user's code failed in a pass: said where (runtime/pass_errors.py)
            again = self._errors.placed(error, order[p], stages, self.schedule.microbatches_per_update,
                                        self.trace_offset)
            if again is None:
                raise
            raise again from error
        finally:
            w.pos = p
        return p != start

    def _forward_only(self, k: int, j: int) -> bool:
        """Stage ``k``'s forward-only pass of E micro-batch ``j`` (its input is here), unless the
        work has not given it yet (False)."""
        work, stage = self.forward_only, self.stage_list[k]
        if work is None:
            raise ValueError(f"{self.schedule.name} holds forward-only actions (E) but this executor "
                             f"was given no forward-only work (Pipeline.evaluate_in_bubbles)")
        if j >= len(work):
            return False
        out = work.forward(stage, j, work.inputs(j) if stage.is_first else self._evals.pop((k, j)))
        if not stage.is_last:
            if self._next_here[k]:
                self._evals[(self._next[k], j)] = out
            else:
                self._outgoing[(k, j)] = out
        return True

    def _agree(self, w: Walker, update: int) -> bool:
        """The agreement of update ``update`` over every stage, once every walker of this process
        stands at its first update of that number (every backward before it done; False: wait):
        the clipping coefficient, from the norms summed as ``clip_grad_norm_`` does, and fp16's
        skip. What each stage gives is taken after the replicas' averaging and put in stage
        order (across processes by the transport, the same collectives in the same order on
        every rank); each walker keeps the outcome for its other updates of that number. A
        mirrored method's replicas sum their gradients after it (their flags are both here)."""
        self._arrived.add(w.rank)
        if len(self._arrived) < len(self.walkers):
            return False
        self._arrived.clear()
        for stage in self.own:
            stage.sync_gradients()  # replicas first: the norm is of the averaged gradient
        scale, skip = self._agreement.decide(self.transport.agree(self._agreement.table(self.own)))
        for v in self.walkers:
            v.clip_update, v.clip_scale, v.skip = update, scale, skip
        return True

    @property
    def _pointer(self) -> List[int]:
        """Per rank this process plays: the position of its next action in the schedule's
        (compute-only) order."""
        return [_computed(w) for w in self.walkers]


_COMPUTE = frozenset(COMPUTE_KINDS)
_SENDS = frozenset((Kind.SEND_F, Kind.SEND_B, Kind.SEND_E))


def _computed(w: Walker) -> int:
    """How many compute actions walker ``w`` has run (counted without a Python call per action)."""
    return sum(map(_COMPUTE.__contains__, map(attrgetter("kind"), w.order[:w.pos])))


def _pair_gates(order: List[Action], schedule: Schedule) -> Dict[int, int]:
    """Position of each receive that lowering put before a paired forward -> that forward's
    micro-batch (``schedules/lower.py``: a pair's receives come right before it)."""
    gates: Dict[int, int] = {}
    for p, a in enumerate(order):
        if a.kind is Kind.F and schedule.pair_of(a) is not None:
            q = p - 1
            while q >= 0 and order[q].kind in _ALL_RECEIVES:
                gates[q] = a.index
                q -= 1
    return gates


_ALL_RECEIVES = frozenset((Kind.RECV_F, Kind.RECV_B))