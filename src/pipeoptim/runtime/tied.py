"""Weights tied across stages (docs/architecture.md, "Tied weights").

With the asynchronous methods (docs/architecture.md, "Tied weights with the asynchronous
methods") a holder's passes of micro-batch i run on the owner's values of i, and its gradient of
i joins the owner's update that consumes i, handed over in memory (:class:`LocalExchange`) or
between processes (:class:`MessageExchange`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..compat import is_dtensor
from ..weights.base import local
from .transport import warm_pair


class LocalExchange:
    """One tie, every holder in this process: the owner's forward values and the holders'
    gradients, by micro-batch, in memory."""

    def __init__(self, holders: List[int]) -> None:
        self.holders = holders
        self.values: Dict[int, List[Any]] = {}               # i -> [values, readers left]
        self.grads: Dict[int, Dict[int, torch.Tensor]] = {}  # i -> holder -> its gradient

    def publish(self, microbatch: int, value: torch.Tensor) -> None:
        self.values[microbatch] = [value, len(self.holders) - 1]

    def take(self, holder: int, microbatch: int) -> torch.Tensor:
        return self.values[microbatch][0]

    def give(self, holder: int, microbatch: int, grad: Optional[torch.Tensor]) -> None:
        entry = self.values[microbatch]
        entry[1] -= 1
        if entry[1] == 0:  # every reader's backward is over: the values go
            del self.values[microbatch]
        if grad is not None:
            self.grads.setdefault(microbatch, {})[holder] = grad

    def collect(self, microbatch: int) -> Optional[torch.Tensor]:
        """The holders' gradients of ``microbatch``, summed in holder order (as between processes)."""
        given = self.grads.pop(microbatch, {})
        total = None
        for holder in sorted(given):
            total = given[holder].clone() if total is None else total.add_(given[holder])
        return total

    def finish(self) -> None:
        pass


class MessageExchange:
    """One tie across processes, as seen from this rank: the owner sends its forward values of
    each micro-batch to every other holder, each holder sends back its gradient of it (two 2-rank
    groups per pair, one per direction). Sends are asynchronous and kept until complete; a
    receive waits only for a message the schedule has already made its sender send."""

    def __init__(self, owner_rank: int, like: torch.Tensor,
                 peers: Dict[int, Tuple[int, Any, Any]]) -> None:
        self.owner_rank = owner_rank
        self.like = like  #: shape, dtype and device of the messages
        #: holder stage -> (its rank, the group values travel on, the group gradients travel on);
        #: the owner knows every other holder, another holder only itself
        self.peers = peers
        self._sent: List[Tuple[Any, torch.Tensor]] = []

    def publish(self, microbatch: int, value: torch.Tensor) -> None:
        for rank, values, _ in self.peers.values():
            self._send(value, rank, values)

    def take(self, holder: int, microbatch: int) -> torch.Tensor:
        _, values, _ = self.peers[holder]
        return self._recv(self.owner_rank, values)

    def give(self, holder: int, microbatch: int, grad: Optional[torch.Tensor]) -> None:
        _, _, grads = self.peers[holder]
        self._send(grad.contiguous() if grad is not None else torch.zeros_like(self.like), self.owner_rank, grads)

    def collect(self, microbatch: int) -> Optional[torch.Tensor]:
        total = None
        for holder in sorted(self.peers):
            rank, _, grads = self.peers[holder]
            grad = self._recv(rank, grads)
            total = grad if total is None else total.add_(grad)
        return total

    def finish(self) -> None:
        """Wait for every send (at a drain, where every message has a receiver)."""
        for work, _ in self._sent:
            work.wait()
        self._sent = []

    def _send(self, tensor: torch.Tensor, rank: int, group: Any) -> None:
        self._sent = [(w, t) for w, t in self._sent if not w.is_completed()]
        self._sent.append((dist.isend(tensor, dst=rank, group=group), tensor))

    def _recv(self, rank: int, group: Any) -> torch.Tensor:
        buffer = torch.empty_like(self.like)
        dist.irecv(buffer, src=rank, group=group).wait()
        return buffer


@dataclass
class Tie:
    """One parameter read by several stages: which stages (the first owns it), this stage's copy
    (None where this stage does not read it), and the holders' group once the world made it."""

    holders: List[int]
    param: Optional[nn.Parameter]
    name: str
    group: Any = None
    owner_rank: int = 0   #: the owner's rank in the job (``broadcast`` takes a job rank)
    #: asynchronous methods: how the forward values and gradients travel between the holders
    exchange: Any = field(default=None, repr=False)


class TiedWeights:
    """Every tie of the model as seen from stage ``stage`` (in the same order on every rank, so
    that each rank makes the same groups)."""

    def __init__(self, stage: int, ties: List[Tie], synchronous: bool = True) -> None:
        self.stage = stage
        self.ties = ties
        self.synchronous = synchronous
        #: several stages of one process (chunks) under torchrun: their ties summed and sent together
        self.round: Optional["TieRound"] = None

    def held(self) -> List[Tie]:
        """Synchronous methods: the ties this stage holds a copy of in a run of one stage per process."""
        return [t for t in self.ties if t.param is not None and t.group is not None] if self.synchronous else []

    def read_not_owned(self) -> List[nn.Parameter]:
        """Synchronous methods: the tied weights this stage reads and another owns (the owner's
        tensor, or under torchrun this rank's copy), whose gradient a split backward computes too."""
        if not self.synchronous:
            return []
        return [t.param for t in self.ties if t.param is not None and t.holders[0] != self.stage]

    def before_update(self) -> None:
        """Synchronous methods: the holders' gradients summed into the owner's (a holder's dropped;
        with a :class:`TieRound`, ``Stage.sync_gradients`` asks the round instead)."""
        for tie in self.held():
            _sum_to_owner(tie, self.stage)

    @torch.no_grad()
    def after_update(self) -> None:
        """Synchronous methods: every holder's copy takes the owner's value after its update."""
        if self.round is not None:
            self.round.updated()
            return
        for tie in self.held():
            _from_owner(tie)

    # -- asynchronous methods: per micro-batch ---------------------------------------------------
    def _exchanged(self) -> List[Tie]:
        return [] if self.synchronous else [t for t in self.ties if t.param is not None and t.exchange is not None]

    def forward_values(self, microbatch: int, weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """In a forward on ``weights`` (its policy's): the owner hands a copy of its tied values
        on; another holder gets them as leaves of its own to run its passes of ``microbatch`` on
        (name -> tensor, for functional_call)."""
        extra = {}
        for tie in self._exchanged():
            if tie.holders[0] == self.stage:
                value = weights[tie.name] if tie.name in weights else tie.param
                tie.exchange.publish(microbatch, local(value.detach()).clone())
            else:
                extra[tie.name] = tie.exchange.take(self.stage, microbatch).detach().requires_grad_(True)
        return extra

    def backward_done(self, microbatch: int, extra: Dict[str, torch.Tensor]) -> None:
        """After a backward's weight gradients: a holder gives its gradient of the tied weight
        (``extra``, from :meth:`forward_values`) to the owner, who adds the holders' to its own."""
        for tie in self._exchanged():
            if tie.holders[0] == self.stage:
                grad = tie.exchange.collect(microbatch)
                if grad is not None:
                    p = tie.param
                    if p.grad is None:
                        p.grad = grad if not is_dtensor(p) else torch.zeros_like(p)
                    if p.grad is not grad:
                        local(p.grad).add_(grad)  # (sharded: the holders' shards of it)
            else:
                leaf = extra[tie.name]
                tie.exchange.give(self.stage, microbatch, leaf.grad)
                leaf.grad = None

    @torch.no_grad()
    def drained(self) -> None:
        """At a drain (asynchronous methods): every send completes; the holders take the owner's value."""
        for tie in self._exchanged():
            tie.exchange.finish()
            if tie.group is not None:
                _from_owner(tie)


def _sum_to_owner(tie: Tie, stage: int) -> None:
    """The holders' gradients of ``tie`` summed into the owner's (``stage``'s, where it owns it)."""
    p = tie.param
    grad = p.grad if p.grad is not None else torch.zeros_like(p)
    dist.all_reduce(local(grad), group=tie.group)  # sharded: the holders' shards align
    p.grad = grad if tie.holders[0] == stage else None


def _from_owner(tie: Tie) -> None:
    """Every holder's copy of ``tie`` takes the owner's value."""
    dist.broadcast(local(tie.param.data), src=tie.owner_rank, group=tie.group)


class TieRound:
    """The ties of a process that holds several stages (chunks) under torchrun, with a
    synchronous method. Holders in one process read one tensor (or, sharded, each stage its own
    copy, summed here into the first), so a tie crosses processes once: its group joins the
    holders' processes, and the first holder here sums for them all (its :class:`Tie` has the
    group). When the first stage of the process syncs its gradients (every backward of the
    update is done by then: a rank's updates close its schedule), every stage's gradients are
    averaged over its replicas, then every tie summed, in tie order; when the last has updated,
    the owner's values are sent on. The groups so meet in one order on every process, where a
    stage-by-stage order could differ between two processes and wait forever (as NCCL would)."""

    def __init__(self, stages: List[Any]) -> None:
        self.stages = stages  #: every stage of this process (``Stage``: its ``tied`` and ``sync_replicas``)
        self.summed = False
        self.updates = 0
        for stage in stages:
            stage.tied.round = self

    def _ties(self) -> List[Tuple[Tie, int, List[nn.Parameter]]]:
        """Per tie held here, in tie order: the first holder's :class:`Tie` and stage, and the
        other holders' copies of it here (none where they read the first one's tensor)."""
        out = []
        for ties in zip(*(stage.tied.ties for stage in self.stages)):
            here = [(tie, stage.index) for tie, stage in zip(ties, self.stages) if tie.param is not None]
            if here:
                first = here[0][0]
                copies = {id(t.param): t.param for t, _ in here[1:] if t.param is not first.param}
                out.append((first, here[0][1], list(copies.values())))
        return out

    def reduce(self) -> None:
        if self.summed:
            return
        for stage in self.stages:
            stage.sync_replicas()
        for tie, stage, copies in self._ties():
            p = tie.param
            for q in copies:  # a sharded stage's own copy: its gradient joins the first holder's here
                if q.grad is not None:
                    if p.grad is None:
                        p.grad = q.grad
                    else:
                        local(p.grad).add_(local(q.grad))
                    q.grad = None
            if tie.group is not None:
                _sum_to_owner(tie, stage)
        self.summed = True

    @torch.no_grad()
    def updated(self) -> None:
        self.updates += 1
        if self.updates < len(self.stages):
            return
        for tie, _, copies in self._ties():
            if tie.group is not None:
                _from_owner(tie)
            for q in copies:
                local(q.data).copy_(local(tie.param.data))
        self.summed, self.updates = False, 0


def connect_exchanges(ties: List[Tie], rank: int, rank_of: Callable[[int], int],
                      new_group: Callable[[List[int]], Any], device: torch.device = torch.device("cpu")) -> None:
    """The processes' exchanges of the asynchronous methods: for every tie, every other holder
    and each direction, a 2-rank group with the owner (every rank makes every group, in order);
    the ties this rank holds get a :class:`MessageExchange`. ``rank_of(stage)``: its job rank.
    On a GPU (``device``: this process's) each group is warmed once now, in the direction its
    messages go (:func:`warm_pair`)."""
    for tie in ties:
        owner = rank_of(tie.holders[0])
        peers = {}
        for holder in tie.holders[1:]:
            ranks = [owner, rank_of(holder)]
            values, grads = new_group(ranks), new_group(ranks)
            if rank == owner or rank == ranks[1]:
                peers[holder] = (ranks[1], values, grads)
                warm_pair(values, owner, ranks[1], rank, device)   # the owner's values go out
                warm_pair(grads, ranks[1], owner, rank, device)    # the holder's gradients come back
        if tie.param is not None and peers:  # the owner knows every other holder, a holder itself
            tie.exchange = MessageExchange(owner, local(tie.param.detach()), peers)  # (sharded: shards travel)
