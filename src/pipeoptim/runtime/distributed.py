"""The distributed executor: one process per rank, the same Stage and the same interpreter
(docs/architecture.md, "The executor"); here, how a transfer travels between processes
(:class:`PipeTransport`). Dropout differs from the local runtime, whose stages draw from one
generator."""
from __future__ import annotations

from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence

import torch

from ..schedules.actions import Action, Kind, Schedule
from .averaging import GradientAverager
from .control import sum_over_pipeline
from .executor import Executor
from .interfaces import Transport
from .forward_only import ForwardOnly
from .segment import MicroBatch
from .stage import Stage
from .transport import PipeComm
from .wire import Signature, signature


class PipeTransport(Transport):
    """The transfers of this process's rank as messages over ``comm``, keyed by their
    micro-batch's input shapes (every rank is fed the same mini-batches); a key goes after this
    rank's last message of its micro-batch. Forward-only (E) micro-batch j travels as micro-batch
    ``-1 - j``, keyed as the drained evaluation's, expected after the first mini-batch's."""

    def __init__(self, comm: PipeComm, own: Sequence[Stage], forward_only: Optional[ForwardOnly]) -> None:
        self.comm = comm
        self.own = list(own)
        self.keys: Dict[int, Signature] = {}
        self._e_keys = [signature((x, y, 1.0)) for x, y in forward_only.items] if forward_only else []
        self.mirrored = any(s.replica_of is not None for s in own)
        self._chain_of: Dict[int, int] = {}
        self._m = 1
        # the stages after whose gradient send (receive) a micro-batch's key goes
        self._drop_on_send: FrozenSet[int] = frozenset()
        self._drop_on_recv: FrozenSet[int] = frozenset()
        self._keyed = True  # whether this rank sends or receives anything of a micro-batch

    def use(self, schedule: Schedule) -> None:
        comm = self.comm
        if schedule.stage_to_rank != comm.placement:
            raise ValueError(f"schedule {schedule.name} places its stages on ranks {schedule.stage_to_rank}, "
                             f"the links were made for {comm.placement}")
        self._chain_of = {k: c for c, chain in enumerate(schedule.pipelines) for k in chain}
        self._m = schedule.microbatches_per_update
        # a micro-batch's last message here: its backward's, at this rank's first stage of the
        # chain that has one (its send on, else its receive)
        rank, place = comm.rank, comm.placement
        on_send, on_recv = set(), set()
        for chain in schedule.pipelines:
            for k in chain:
                prv, nxt = schedule.prev_stage(k), schedule.next_stage(k)
                if place[k] != rank:
                    continue
                if prv is not None and place[prv] != rank:
                    on_send.add(k)
                    break
                if nxt is not None and place[nxt] != rank:
                    on_recv.add(k)
                    break
        self._drop_on_send, self._drop_on_recv = frozenset(on_send), frozenset(on_recv)
        self._keyed = bool(on_send or on_recv)

    def fed(self, first: int, microbatches: Sequence[MicroBatch], batch: int) -> None:
        new = [(first + n, signature((x, y, share))) for n, (x, y, share) in enumerate(microbatches)]
        if self._keyed:
            self.keys.update(new)
        # on every link this rank receives on (none: nothing); two pipelines: each its half
        self.comm.expect_more(new, new, self._travels if self.mirrored else None)
        if batch == 1 and self._e_keys:  # the E's follow mini-batch 0's forwards on every link
            self.comm.expect_more([(-1 - j, key) for j, key in enumerate(self._e_keys)], [])

    def _travels(self, boundary: int, microbatch: int) -> bool:
        """Whether ``microbatch`` crosses ``boundary`` (stages boundary -> boundary + 1): a
        bidirectional window's first half takes the first pipeline, the rest the second."""
        m = self._m
        return self._chain_of[boundary] == (0 if microbatch % m < m // 2 else 1)

    def recv(self, kind: Kind, k: int, i: int) -> bool:
        if kind is Kind.RECV_E:
            self.evals[(k, i)] = self.comm.recv("activation", -1 - i, self._e_keys[i], stage=k)
        elif kind is Kind.RECV_F:
            self.inputs[(k, i)] = self.comm.recv("activation", i, self.keys[i], stage=k)
        else:
            self.grads[(k, i)] = self.comm.recv("gradient", i, self.keys[i], stage=k)
            if k in self._drop_on_recv:
                del self.keys[i]
        self.comm.poll()
        return True

    def send(self, kind: Kind, k: int, i: int, value: Any) -> None:
        if kind is Kind.SEND_E:
            self.comm.send("activation", -1 - i, self._e_keys[i], value, stage=k)
        else:
            self.comm.send("activation" if kind is Kind.SEND_F else "gradient", i, self.keys[i], value, stage=k)
            if kind is Kind.SEND_B and k in self._drop_on_send:
                del self.keys[i]
        self.comm.poll()

    def agree(self, table: torch.Tensor) -> torch.Tensor:
        """Every stage's row: the processes' tables summed by one all-reduce on the pipeline's own
        group, on the stages' device (NCCL on a GPU; float64 rows, each with one writer: the sum
        is exact, so every rank and the local executor read the same bits), queued without a wait
        on the host."""
        return sum_over_pipeline(table, self.comm, "agreeing on the update (gradient norm, fp16's found-inf)")

    def drained(self) -> None:
        """Wait for every send; the holders of a tie take the owner's value (asynchronous methods)."""
        self.comm.flush()
        for stage in self.own:
            if stage.tied is not None:
                stage.tied.drained()


class ForwardTransport(Transport):
    """The links of forward-only work alone under torchrun (``Executor.feed_forward_only``,
    ``Torchrun.forward_executor``): E micro-batch j travels as message ``-1 - j`` (training's are
    numbered from 0) on the links into this process's stages where ``travels(boundary, j)``
    (None: every link), each run through the pipeline before the next is given (this process's
    receives wait for theirs)."""

    def __init__(self, comm: PipeComm, travels: Optional[Callable[[int, int], bool]]) -> None:
        self.comm, self.travels = comm, travels
        self.key: Optional[Signature] = None  #: the running micro-batch's

    def fed_forward_only(self, j: int, key: Any) -> None:
        self.key = key
        self.comm.expect_more([(-1 - j, key)], [], self.travels)

    def recv(self, kind: Any, k: int, i: int) -> bool:
        self.evals[(k, i)] = self.comm.recv("activation", -1 - i, self.key, stage=k)
        return True

    def send(self, kind: Any, k: int, i: int, value: Any) -> None:
        self.comm.send("activation", -1 - i, self.key, value, stage=k)
        self.comm.poll()

    def drained(self) -> None:
        self.comm.flush()


class DistributedExecutor(Executor):
    """This process's stages (one, or several: ``comm.placement`` says which rank holds each) of a
    pipeline whose other stages run in other processes; the other arguments are
    :class:`~pipeoptim.runtime.executor.Executor`'s. Every rank feeds the same mini-batches (every
    stage uses their input shapes as message keys)."""

    def __init__(self, stages: Sequence[Stage], comm: PipeComm,
                 schedule_for: Callable[[int], Schedule], *, expected: Optional[int] = None,
                 trace_offset: int = 0, clip_global: Optional[float] = None,
                 replica_groups: Optional[Dict[int, Any]] = None,
                 forward_only: Optional[ForwardOnly] = None) -> None:
        """``replica_groups``: a bidirectional run's 2-process group of each piece whose two
        replicas are on two processes (piece -> group), for the sum of their gradients (one
        summer per group: pieces j and N-1-j share theirs)."""
        own = list(stages)
        n = own[0].num_stages
        held = [s.index for s in own]
        if len(comm.placement) != n or held != [k for k in range(n) if comm.placement[k] == comm.rank]:
            raise ValueError(f"stages {held} of {n} on pipeline rank {comm.rank} of {comm.ranks} "
                             f"(placement {comm.placement}): they must agree")
        sums = {piece: GradientAverager(g, 2, comm.timeout, mean=False) for piece, g in (replica_groups or {}).items()}
        super().__init__(own, PipeTransport(comm, own, forward_only), schedule_for, ranks=[comm.rank],
                         expected=expected, trace_offset=trace_offset, clip_global=clip_global,
                         forward_only=forward_only, replica_sums=sums)
        self.comm = comm

    def _overlap_points(self, order: List[Action]) -> FrozenSet[int]:
        """Before a backward (``B``) or weight half (``W``) whose rank's next compute action is
        an update, the replicas' averaging starts as gradients become final
        (a stage's ``overlapped`` sync, ``averaging.GradientAverager``; an ``I`` leaves every
        weight gradient to its ``W``)."""
        averages = [s is not None and s.overlapped is not None for s in self.stage_list]
        if not any(averages):
            return frozenset()
        points, update_next = [], False
        for p in range(len(order) - 1, -1, -1):
            a = order[p]
            if (a.kind is Kind.B or a.kind is Kind.W) and update_next and averages[a.stage]:
                points.append(p)
            if a.kind.is_compute:
                update_next = a.kind is Kind.U
        return frozenset(points)
