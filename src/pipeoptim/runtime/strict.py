"""A strict transport for the tests: point-to-point messages on gloo under NCCL's rules.

Gloo is kinder than NCCL: a small send completes before its receive is posted, and a group
connects its members when it is made. Code that passes on gloo can therefore hang on its first
GPU run. With ``PIPEOPTIM_STRICT_TRANSPORT=1`` in a process's environment (or :func:`install`),
``torch.distributed.isend`` and ``irecv`` keep NCCL's rules where gloo would not:

* **a pair's operations run in the order they were issued**, as on the one stream of NCCL's
  communicator for the pair: a receive starts only once this rank's earlier operations with that
  peer on the group have completed, and a send completes only once the peer's matching receive
  (the n-th from this rank on the group: NCCL matches in order, tags ignored) has started. Gloo
  lets a receive complete behind an unmatched send of its own; NCCL hangs there, and so does this,
  until the strict timeout;
* **the first operation on a group waits for its peer**: NCCL makes a pair's communicator at its
  first point-to-point use and blocks until both ends join (gloo connects a group's members when it
  is made); here the first send or receive of a pair on a group waits until the other end has
  issued one too;
* **only NCCL's dtypes** (:data:`~pipeoptim.runtime.wire.NCCL_DTYPES`) and **one thread per
  group**: a complex or int16 tensor, or a group used from a second thread, is refused at once;
* **collectives meet in one order** (``all_reduce``, ``broadcast``, ``all_gather``,
  ``all_gather_into_tensor``, ``reduce_scatter_tensor``): NCCL queues a process's collectives on
  its GPU in the order issued, so two processes that issue collectives of two groups they share in
  opposite orders wait for each other forever, even where each is asynchronous (gloo runs each
  group apart, and passes). Each collective counts, per other member, the collectives the two
  share; the n-th must be on the same group on both ranks, or it is refused naming both groups
  (a blocking one waits for the others' marks, an asynchronous one checks at its ``wait``).

A wait past the strict timeout raises :class:`StrictTransportError` naming the send, the ranks and
the group: where NCCL would hang, the test fails. Groups made with ``backend="gloo"`` (the control
groups, gloo on a GPU too) keep gloo's rules. The marks travel through the job's store (the
default group's), so every process of the job must install it; the groups are numbered in the
order they are made, which every rank shares (``new_group`` is called by every rank).
"""
from __future__ import annotations

import inspect
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .wire import NCCL_DTYPES, PipelineCommError

ENV = "PIPEOPTIM_STRICT_TRANSPORT"
#: seconds a strict wait lasts before it fails (a test's deadlocks end within it)
TIMEOUT = float(os.environ.get("PIPEOPTIM_STRICT_TIMEOUT", "30"))
#: the longest pause between two looks at a wait's marks (the pauses double from 0.5 ms: a short wait
#: is met at once, a long one costs a look every 8 ms, not every 1)
PAUSE = 0.008


class StrictTransportError(PipelineCommError):
    """Under NCCL's rules this operation would hang or be refused."""


class _Strict:
    """The process's strict transport: the real functions, the groups' numbers, the counts."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.real: Dict[str, Callable[..., Any]] = {}
        self.numbers: Dict[int, Tuple[int, bool]] = {}   # id(group) -> (its number, gloo's rules)
        self.made = 0
        self.counts: Dict[Tuple[int, int, int], int] = {}  # (group, src, dst) -> messages so far
        self.joined: set = set()
        self.threads: Dict[int, int] = {}
        self.queues: Dict[Tuple[int, int], list] = {}     # (group, peer) -> this rank's unfinished operations
        self.shared: Dict[int, int] = {}  # other rank -> collectives issued so far on groups with it
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.progress: Optional[threading.Thread] = None

    # -- the job's store and the groups' numbers ----------------------------------------------
    @property
    def store(self) -> Any:
        return dist.distributed_c10d._get_default_store()

    def new_group(self, *args: Any, **kwargs: Any) -> Any:
        group = self.real["new_group"](*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        self.numbers[id(group)] = (self.made, str(backend).lower() == "gloo")
        self.made += 1
        return group

    def number(self, group: Any) -> Optional[int]:
        """The group's number (the default group: -1); None where gloo's rules stay."""
        if group is None or group is dist.group.WORLD:
            return -1
        found = self.numbers.get(id(group))
        if found is None:  # made before install, or by torch itself: not numbered, not checked
            return None
        return None if found[1] else found[0]

    # -- the rules -----------------------------------------------------------------------------
    def check(self, tensor: torch.Tensor, number: int, what: str) -> None:
        if tensor.dtype not in NCCL_DTYPES:
            raise StrictTransportError(f"{what} of a {tensor.dtype} tensor on group {number}: NCCL has no such "
                                       f"type (send its bytes: runtime/wire.on_the_wire)")
        me = threading.get_ident()
        if self.threads.setdefault(number, me) != me:
            raise StrictTransportError(f"{what} on group {number} from a second thread: an NCCL communicator "
                                       f"must not be used by two threads")

    def wait_keys(self, keys: list, what: str) -> None:
        """Until every key is in the store, polled: a blocking wait would hold the store's one
        connection, which the progress thread needs to start the sends queued before this."""
        end, pause = time.monotonic() + self.timeout, 0.0005
        while True:
            with self.lock:
                if self.store.check(keys):
                    return
            if time.monotonic() > end:
                raise StrictTransportError(f"{what}: not met within {self.timeout:g} s; under NCCL this would hang")
            time.sleep(pause)
            pause = min(PAUSE, 2 * pause)

    def join(self, number: int, me: int, peer: int) -> None:
        """The pair's first operation on the group waits until the other end has issued one."""
        key = (number, min(me, peer), max(me, peer))
        if key in self.joined:
            return
        self.store.set(f"strict/join/{number}/{me}-{peer}", "1")
        self.wait_keys([f"strict/join/{number}/{peer}-{me}"],
                       f"the first operation between ranks {me} and {peer} on group {number} waits for both ends "
                       f"(rank {peer} issued none)")
        self.joined.add(key)

    def start(self) -> None:
        """The pairs' progress, apart from this process's thread, as a GPU's streams progress
        apart from its CPU: every few milliseconds :meth:`advance` (under :attr:`lock`)."""
        def run() -> None:
            while not self.stopped.wait(0.002):
                with self.lock:
                    if not any(self.queues.values()):
                        continue
                    try:
                        self.advance()
                    except Exception:  # noqa: BLE001 (no job's store between two jobs: try again)
                        continue

        self.progress = threading.Thread(target=run, name="pipeoptim-strict-progress", daemon=True)
        self.progress.start()

    # -- the pairs' queues ---------------------------------------------------------------------
    def queue(self, number: int, peer: int) -> "list[StrictWork]":
        return self.queues.setdefault((number, peer), [])

    def advance(self) -> None:
        """Start and complete what can, pair by pair, in each pair's order: the operation at the
        head of its queue has started (its mark goes up for the peer); it completes once the
        peer's matching operation has started too."""
        for queue in self.queues.values():
            while queue:
                head = queue[0]
                if not head.started:
                    self.store.set(head.key, "1")
                    head.started = True
                if not head.done():
                    break
                queue.pop(0)

    def issue(self, kind: str, tensor: torch.Tensor, peer: int, group: Any, tag: int, kwargs: Dict[str, Any]) -> Any:
        number = self.number(group)
        if number is None:
            return self.real["i" + kind](tensor, peer, group=group, tag=tag, **kwargs)
        me = dist.get_rank()
        what = f"a send from rank {me} to rank {peer}" if kind == "send" else f"a receive on rank {me} from rank {peer}"
        self.check(tensor, number, what)
        self.join(number, me, peer)
        with self.lock:
            return self._issue(kind, tensor, peer, group, tag, kwargs, number, me)

    def _issue(self, kind: str, tensor: torch.Tensor, peer: int, group: Any, tag: int, kwargs: Dict[str, Any],
               number: int, me: int) -> Any:
        work = self.real["i" + kind](tensor, peer, group=group, tag=tag, **kwargs)
        src, dst = (me, peer) if kind == "send" else (peer, me)
        n = self.counts.get((number, src, dst), 0)
        self.counts[(number, src, dst)] = n + 1
        other = "recv" if kind == "send" else "send"
        key, match = (f"strict/started/{number}/{kind}/{src}-{dst}/{n}",
                      f"strict/started/{number}/{other}/{src}-{dst}/{n}")
        described = (f"send {n} from rank {me} to rank {peer} on group {number}" if kind == "send" else
                     f"receive {n} on rank {me} from rank {peer} on group {number}")
        described += ": it or its match never started"
        queue = self.queue(number, peer)
        strict_work = StrictWork(self, kind, work, key, match, described, queue)
        queue.append(strict_work)
        self.advance()
        return strict_work

    # -- collectives ---------------------------------------------------------------------------
    def collective(self, name: str) -> Callable[..., Any]:
        """``torch.distributed``'s collective ``name`` under the rules above."""
        real = self.real[name]
        signature = inspect.signature(real)

        def run(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            group = bound.arguments.get("group")
            number = self.number(group)
            if number is None:
                return real(*args, **kwargs)
            me = dist.get_rank()
            what = f"{name} on rank {me}"
            for value in bound.arguments.values():
                for tensor in (value if isinstance(value, (list, tuple)) else [value]):
                    if torch.is_tensor(tensor):
                        self.check(tensor, number, what)
            marks = self.mark(number, me, group)
            if not bound.arguments.get("async_op", False):
                self.meet(marks, number, what)
                return real(*args, **kwargs)
            return CollectiveWork(self, real(*args, **kwargs), marks, number, what)
        return run

    def mark(self, number: int, me: int, group: Any) -> List[Tuple[str, int]]:
        """This rank's mark of its next collective shared with each other member of ``group``:
        (the key the peer writes for the same collective, the peer)."""
        members = dist.get_process_group_ranks(group) if number != -1 else range(dist.get_world_size())
        marks = []
        for peer in members:
            if peer == me:
                continue
            n = self.shared.get(peer, 0)
            self.shared[peer] = n + 1
            self.store.set(f"strict/collective/{me}-{peer}/{n}", str(number))
            marks.append((f"strict/collective/{peer}-{me}/{n}", peer))
        return marks

    def meet(self, marks: List[Tuple[str, int]], number: int, what: str) -> None:
        """Each peer's collective of the same count is on this group too (waiting for its mark)."""
        if not marks:
            return
        self.wait_keys([key for key, _ in marks], f"{what} (group {number}) waits for every member")
        for key, peer in marks:
            theirs = self.store.get(key).decode()
            if theirs != str(number):
                raise StrictTransportError(
                    f"{what}: ranks {dist.get_rank()} and {peer} issue their collectives in another order "
                    f"(here on group {number}, there on group {theirs} at the same count): NCCL queues them "
                    f"in that order on each GPU and both would wait forever; issue them in one order")

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **kwargs: Any) -> Any:
        return self.issue("send", tensor, dst, group, tag, kwargs)

    def irecv(self, tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0, **kwargs: Any) -> Any:
        return self.issue("recv", tensor, src, group, tag, kwargs)


class StrictWork:
    """A send's or a receive's work under NCCL's rules (see the module's docstring)."""

    def __init__(self, strict: _Strict, kind: str, work: Any, key: str, match: str, what: str,
                 queue: list) -> None:
        self.strict, self.kind, self.work, self.key, self.match, self.what = strict, kind, work, key, match, what
        self.queue = queue
        self.started = False  #: at the head of its pair's queue once (its mark is up)
        self.met = False      #: started, and so has the peer's matching operation

    def done(self) -> bool:
        """Met (no wait): started at the head of its pair's queue, and so has its match."""
        if not self.met and self.started and self.queue and self.queue[0] is self:
            self.met = bool(self.strict.store.check([self.match]))
        return self.met

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        end, pause = time.monotonic() + self.strict.timeout, 0.0005
        while True:
            with self.strict.lock:
                self.strict.advance()
                met = self.done()
            if met:
                return self.work.wait(*args, **kwargs)
            if time.monotonic() > end:
                raise StrictTransportError(f"{self.what} within {self.strict.timeout:g} s: under NCCL this would "
                                           f"hang")
            time.sleep(pause)
            pause = min(PAUSE, 2 * pause)

    def is_completed(self) -> bool:
        with self.strict.lock:
            self.strict.advance()
            return self.done() and self.work.is_completed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


class CollectiveWork:
    """An asynchronous collective's work: its order checked at its wait."""

    def __init__(self, strict: _Strict, work: Any, marks: List[Tuple[str, int]], number: int, what: str) -> None:
        self.strict, self.work, self.marks, self.number, self.what = strict, work, marks, number, what

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self.strict.meet(self.marks, self.number, self.what)
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


#: the collectives the strict transport keeps in order (every one pipeoptim and FSDP2 issue)
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor")

_INSTALLED: Optional[_Strict] = None


def install(timeout: float = TIMEOUT) -> None:
    """Put the strict transport in this process (before its groups are made; again: nothing)."""
    global _INSTALLED
    if _INSTALLED is not None:
        return
    strict = _Strict(timeout)
    names = ("isend", "irecv", "new_group", *COLLECTIVES)
    strict.real.update({name: vars(dist)[name] for name in names})  # torch.distributed's own, kept
    ours = {"isend": strict.isend, "irecv": strict.irecv, "new_group": strict.new_group,
            **{name: strict.collective(name) for name in COLLECTIVES}}
    for name in names:  # each replaced by its checked one
        setattr(dist, name, ours[name])
    strict.start()
    _INSTALLED = strict


def uninstall() -> None:
    """Give ``torch.distributed`` its own functions back."""
    global _INSTALLED
    if _INSTALLED is None:
        return
    _INSTALLED.stopped.set()
    if _INSTALLED.progress is not None:
        _INSTALLED.progress.join()
    for name, fn in _INSTALLED.real.items():
        setattr(dist, name, fn)
    _INSTALLED = None


def installed() -> bool:
    """Whether the strict transport is in this process (its code paths then run as on a GPU)."""
    return _INSTALLED is not None


def install_if_asked() -> bool:
    """:func:`install` where the environment asks for it (``PIPEOPTIM_STRICT_TRANSPORT=1``)."""
    if os.environ.get(ENV, "") not in ("", "0"):
        install()
        return True
    return False
