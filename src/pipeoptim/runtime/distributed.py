"""The distributed executor: one process per stage, the same Stage and the same action lists.

Every process of a pipeline group runs a :class:`DistributedExecutor` with its own
:class:`~pipeoptim.runtime.stage.Stage` and the *same* schedule. The schedule is lowered with
:func:`~pipeoptim.schedules.lower.lower`, which puts ``RECV_F``/``SEND_F`` around forwards and
``RECV_B``/``SEND_B`` around backwards whose neighbour lives on another rank; the executor walks
its rank's lowered list in order. Nothing else is sent: targets are read by the last stage from
the same seeded data that every rank holds, and the loss never leaves it until the end of an
epoch.

Transport (``torch.distributed`` point to point, nothing home-made):

* gloo on CPU, NCCL on GPU (one device per stage). Each direction of each neighbour pair is
  its own link (activations ``k -> k+1``, gradients ``k+1 -> k``) carrying one ordered stream
  of messages in a process group of its own, so that a send and an opposite receive of the same
  pair never queue on one communicator stream or one gloo connection (where a large send being
  written could delay the receive behind it). On gloo, a pipeline on part of the job (no
  ``pipelines=`` naming every rank) cannot create groups safely and its links are instead tags
  of the pipeline's group (see :class:`PipeComm`). A gloo group of all stages (the pipeline's
  own group on CPU) carries the control messages (losses, timings, state dicts at the end of an
  epoch).
* Sends are ``dist.isend``; each handle is kept, with its tensors, until it is waited on (polled
  after every action, all waited at the end of the schedule). gloo's send is a rendezvous, so a
  blocking send in a 1F1B loop deadlocks; with ``isend`` it cannot.
* Receives are ``dist.irecv`` posted ahead (two per link by default, into buffers allocated for
  them) and waited on when the action comes, so a message lands while the stage computes.
* Shapes and dtypes are agreed once per *micro-batch signature* (the shapes of its inputs) and
  link: the first message of a signature is preceded by a small metadata message (tuple
  structure, dtype and shape of each entry; for gradients also which entries carry none). Later
  messages of that signature are raw tensors into pre-allocated buffers. Every rank computes
  the signature of every micro-batch from its copy of the data, so uneven splits (a last
  micro-batch smaller than the others) and batches of different sequence lengths just add
  signatures. A tensor whose shape differs from its signature's agreed one is an error that
  says so.
* Every wait on a peer has a timeout (``PipeComm(timeout=...)``, ``--timeout``), and so has
  every process group: a peer that hangs or dies makes the waiting rank raise
  :class:`PipelineCommError` (naming the message it waited for) instead of hanging.

What drives the executor is :class:`pipeoptim.Pipeline` under torchrun (its world,
:class:`pipeoptim.torchrun.Torchrun`), for a user's script and for the command line alike; this
module also holds the control group's collectives it uses (:func:`broadcast`, :func:`gather_all`,
:func:`barrier`) and :func:`init_process_group`.

Randomness inside the model (dropout) is drawn from each process's own generator, so a model
with dropout does not give the local runtime's numbers step for step (the local executor
interleaves all stages' draws on one generator); models without randomness give the same
losses as the local runtime.
"""
from __future__ import annotations

import datetime
import re
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..schedules.actions import Kind, Schedule
from ..schedules.lower import lower
from .defaults import DEFAULT_TIMEOUT  # seconds a rank waits for a peer before the run fails
from .segment import MicroBatch, StreamedSegment, WindowLosses, check_runnable, clip_coefficient
from .stage import Stage, as_tuple


# dtype <-> code for the metadata messages
_DTYPES: List[torch.dtype] = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]
_CODE = {d: i for i, d in enumerate(_DTYPES)}

Signature = Tuple[Tuple[int, ...], ...]
#: Agreed layout of one kind of message: is it a tuple, and per entry (dtype, shape) or None.
Layout = Tuple[bool, Tuple[Optional[Tuple[torch.dtype, Tuple[int, ...]]], ...]]


class PipelineCommError(RuntimeError):
    """A message between stages did not arrive or could not be sent (peer hung, died, or
    disagreed on what to send)."""


def signature(microbatch: MicroBatch) -> Signature:
    """The key under which a micro-batch's message layouts are agreed: its input shapes."""
    inputs = microbatch[0]
    if inputs is None:
        raise ValueError("every rank needs the micro-batches' inputs (at least their shapes): load "
                         "the same data on every rank")
    return tuple(tuple(t.shape) for t in as_tuple(inputs))


def _layout_of(value: Any, what: str) -> Layout:
    entries = []
    for v in as_tuple(value):
        if v is None:
            entries.append(None)
        elif torch.is_tensor(v):
            if v.dtype not in _CODE:
                raise TypeError(f"cannot send a {v.dtype} {what} between stages")
            entries.append((v.dtype, tuple(v.shape)))
        else:
            raise TypeError(f"a {what} crossing a stage boundary must be a tensor or a tuple of "
                            f"tensors, got {type(v).__name__}")
    return isinstance(value, tuple), tuple(entries)


def _encode(layout: Layout) -> torch.Tensor:
    is_tuple, entries = layout
    codes = [int(is_tuple), len(entries)]
    for e in entries:
        if e is None:
            codes.append(-1)
        else:
            dtype, shape = e
            codes += [_CODE[dtype], len(shape), *shape]
    return torch.tensor(codes, dtype=torch.int64)


def _decode(codes: List[int]) -> Layout:
    is_tuple, count = bool(codes[0]), codes[1]
    pos, entries = 2, []
    for _ in range(count):
        if codes[pos] == -1:
            entries.append(None)
            pos += 1
        else:
            dtype, ndim = _DTYPES[codes[pos]], codes[pos + 1]
            entries.append((dtype, tuple(codes[pos + 2: pos + 2 + ndim])))
            pos += 2 + ndim
    return is_tuple, tuple(entries)


def reason(error: BaseException) -> str:
    """The gist of a communication error: its last line, without gloo's source location
    ("[.../pair.cc:537] ") and boilerplate advice."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    last = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text.splitlines()[-1])
    return re.split(r"\.?\s+This is typically caused by", last)[0].rstrip(". ")


class _Link:
    """One direction of traffic between two neighbouring stages (a process group and a tag)."""

    def __init__(self, what: str, peer: int, group, tag: int, device: torch.device, timeout: float,
                 prefetch: int) -> None:
        self.what = what          # "activation" or "gradient"
        self.peer = peer          # global rank of the other end
        self.group = group
        self.tag = tag
        self.wait_timeout = datetime.timedelta(seconds=timeout)
        self.device = device
        self.timeout = timeout
        self.prefetch = prefetch
        self.layouts: Dict[Signature, Layout] = {}
        self._nbytes: Dict[Signature, int] = {}  # payload bytes per agreed layout (stats)
        self.stats = {"wait_seconds": 0.0, "messages": 0, "bytes": 0}
        self.expected: Deque[Tuple[int, Signature]] = deque()
        self.posted: Deque[Tuple[int, Signature, List[Optional[torch.Tensor]], List[Any]]] = deque()

    # -- errors ------------------------------------------------------------------------------
    def _fail(self, doing: str, microbatch: int, error: BaseException) -> PipelineCommError:
        return PipelineCommError(
            f"{doing} the {self.what} of micro-batch {microbatch} (peer: rank {self.peer}) failed: "
            f"{reason(error)}. "
            f"A peer stage hung, died or is slower than the timeout ({self.timeout:g} s); see its "
            f"own error, or raise --timeout if stages are merely slow")

    # -- sending -----------------------------------------------------------------------------
    def send(self, microbatch: int, key: Signature, value: Any, pending: List) -> None:
        layout = self.layouts.get(key)
        if layout is None:
            layout = _layout_of(value, self.what)
            self.layouts[key] = layout
            meta = _encode(layout).to(self.device)
            size = torch.tensor([meta.numel()], dtype=torch.int64, device=self.device)
            for t in (size, meta):
                pending.append((self._isend(t), t, self, microbatch))
        is_tuple, entries = layout
        values = as_tuple(value)
        if len(values) != len(entries) or isinstance(value, tuple) != is_tuple:
            raise PipelineCommError(f"{self.what} of micro-batch {microbatch} has {len(values)} "
                                    f"entries, but {len(entries)} were agreed for its input shapes")
        for v, e in zip(values, entries):
            if e is None:
                if v is not None:
                    raise PipelineCommError(
                        f"{self.what} of micro-batch {microbatch} carries a tensor where the first "
                        f"micro-batch of its shape had none")
                continue
            dtype, shape = e
            if v is None:  # a gradient that did not reach this input this time: it is zero
                v = torch.zeros(shape, dtype=dtype, device=self.device)
            elif tuple(v.shape) != shape or v.dtype != dtype:
                raise PipelineCommError(
                    f"{self.what} of micro-batch {microbatch} is {v.dtype} {tuple(v.shape)}, but "
                    f"{dtype} {shape} was agreed for micro-batches of input shapes {key}: the "
                    f"stage's output shape must depend only on its input shapes")
            t = v.detach().contiguous()
            pending.append((self._isend(t), t, self, microbatch))
            self.stats["bytes"] += t.numel() * t.element_size()
        self.stats["messages"] += 1

    def _isend(self, tensor: torch.Tensor):
        return dist.isend(tensor, dst=self.peer, group=self.group, tag=self.tag)

    def _irecv(self, tensor: torch.Tensor):
        return dist.irecv(tensor, src=self.peer, group=self.group, tag=self.tag)

    def wait(self, work) -> None:
        start = time.perf_counter()
        try:
            work.wait(timeout=self.wait_timeout)
        finally:
            self.stats["wait_seconds"] += time.perf_counter() - start

    # -- receiving ---------------------------------------------------------------------------
    def expect(self, items: Sequence[Tuple[int, Signature]]) -> None:
        if self.expected or self.posted:
            raise RuntimeError(f"{self.what} link: messages of the last schedule were never received")
        self.expected.extend(items)

    def _post(self) -> None:
        """Post receives for the next expected messages whose layout is known."""
        while self.expected and len(self.posted) < self.prefetch:
            i, key = self.expected[0]
            layout = self.layouts.get(key)
            if layout is None:  # its metadata comes first on the wire: receive it when due
                return
            self.expected.popleft()
            buffers: List[Optional[torch.Tensor]] = []
            works = []
            for e in layout[1]:
                if e is None:
                    buffers.append(None)
                    continue
                buf = torch.empty(e[1], dtype=e[0], device=self.device)
                buffers.append(buf)
                works.append(self._irecv(buf))
            self.posted.append((i, key, buffers, works))

    def recv(self, microbatch: int, key: Signature) -> Any:
        try:
            if not self.posted:
                self._post()
            if not self.posted:
                if not self.expected or self.expected[0] != (microbatch, key):
                    raise PipelineCommError(f"{self.what} link: micro-batch {microbatch} was not expected now")
                # first message of a new signature: its metadata precedes it
                size = torch.empty(1, dtype=torch.int64, device=self.device)
                self.wait(self._irecv(size))
                meta = torch.empty(int(size.item()), dtype=torch.int64, device=self.device)
                self.wait(self._irecv(meta))
                self.layouts[key] = _decode(meta.tolist())
                self._post()
            i, got_key, buffers, works = self.posted.popleft()
            if (i, got_key) != (microbatch, key):
                raise PipelineCommError(f"{self.what} link: expected micro-batch {i} next, the "
                                        f"schedule asks for {microbatch}")
            for w in works:
                self.wait(w)
            stats = self.stats
            stats["messages"] += 1
            nbytes = self._nbytes.get(key)
            if nbytes is None:
                nbytes = self._nbytes[key] = sum(b.numel() * b.element_size() for b in buffers if b is not None)
            stats["bytes"] += nbytes
            self._post()
        except PipelineCommError:
            raise
        except RuntimeError as error:
            raise self._fail("receiving", microbatch, error) from error
        is_tuple, _ = self.layouts[key]
        return tuple(buffers) if is_tuple else buffers[0]


class PipeComm:
    """The communication of one stage of a straight pipeline over a process group.

    Stage k is rank k of ``group`` (default: the whole job). Each direction of each pair gets
    its own process group (2 ranks), created with ``dist.new_group`` over the whole job: every
    rank of the job creates the PipeComm, at the same point and in the same order as any other
    groups. That holds when ``group`` is the whole job, or when ``pipelines`` names every rank of
    the job (a data-parallel layout: every rank creates every replica's link groups). On NCCL it
    is required. On gloo, a pipeline over part of the job without such ``pipelines`` (e.g. two
    pipelines on two sub-groups, each PipeComm made by its own members only) falls back to tags
    of ``group`` for its links: nothing is created, any sub-group works, but both directions of
    a pair share one gloo connection.
    ``timeout`` bounds every wait on a peer and every created group (the group's own timeout
    bounds the control collectives).
    """

    def __init__(self, group=None, *, device: Optional[torch.device] = None,
                 timeout: float = DEFAULT_TIMEOUT, prefetch: int = 2,
                 pipelines: Optional[Sequence[Sequence[int]]] = None) -> None:
        """``pipelines``: with several replicas of the pipeline (pipeline x data parallel), the
        global ranks of every replica's stages; each rank passes its own replica's group as
        ``group``. Every rank creates every replica's link groups, in the same order (on gloo,
        only when ``pipelines`` names every rank of the job; otherwise the links are tags)."""
        self.group = group or dist.group.WORLD
        self.stage = dist.get_rank(self.group)
        self.num_stages = dist.get_world_size(self.group)
        self.ranks = [dist.get_global_rank(self.group, k) for k in range(self.num_stages)]
        self.timeout = float(timeout)
        self.backend = dist.get_backend(self.group)
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(self.backend)
                      else torch.device("cpu"))
        self.device = torch.device(device)
        delta = datetime.timedelta(seconds=self.timeout)
        gloo = "gloo" in str(self.backend)
        replicas = [list(p) for p in pipelines] if pipelines is not None else [self.ranks]
        if self.ranks not in replicas:
            raise ValueError(f"pipelines {replicas} do not include this pipeline's ranks {self.ranks}")
        if not gloo and pipelines is None and self.group is not dist.group.WORLD:
            raise ValueError(f"a {self.backend} pipeline on part of the job needs pipelines=[the ranks "
                             f"of every replica]: its links are process groups that every rank creates")
        whole_job = sorted(r for p in replicas for r in p) == list(range(dist.get_world_size()))
        # Control messages (losses, timings, weights): gloo over the pipeline's ranks, on a group
        # of the pipeline's own, never the job's default group: torch modules imported after the
        # default group exists keep it (as a default argument), so it may outlive every teardown
        # and die in interpreter finalization, where a gloo worker still releasing a collective's
        # tensor aborts the process (see close()). A gloo pipeline over part of the job, whose
        # members alone build the PipeComm, cannot create groups: its own group carries them.
        if gloo and not (whole_job and self.group is dist.group.WORLD):
            self.control = self.group
        else:
            for ranks in replicas:
                made = dist.new_group(ranks, timeout=delta, backend="gloo")
                if ranks == self.ranks:
                    self.control = made
        # Links: a process group per direction per pair where every rank of the job builds this
        # PipeComm at the same point (dist.new_group must be called by every rank of the job, in
        # the same order). The pipeline(s) covering the whole job is how we know that: then every
        # rank creates every replica's link groups, in pipeline order. use_local_synchronization
        # (only the members call new_group) is not safe here: torch names such a group by hashing
        # its ranks with the number of groups this process already holds, which differs between
        # ranks (a rank in more sub-groups than its peer), and two members with different names
        # never meet. So on gloo, a pipeline over part of the job (sub-groups whose members alone
        # build their PipeComm) keeps today's links: tags 1 and 2 of the pipeline's group, one
        # connection for both directions of a pair. NCCL requires the whole job (checked above).
        own_groups = whole_job or not gloo
        link_backend = "gloo" if gloo else None  # NCCL: the job's default backend
        self.link_groups = own_groups  # whether the links have process groups of their own
        self._links: Dict[Tuple[str, int], _Link] = {}
        k = self.stage
        for pipeline in replicas:
            mine = pipeline == self.ranks
            for j in range(self.num_stages - 1):
                for tag, what in ((1, "activation"), (2, "gradient")):
                    # a group per direction (one stream / one gloo connection each, so that a send
                    # and an opposite receive of the pair never queue behind each other), created
                    # by every rank for every replica, in the same order
                    if not own_groups and not mine:
                        continue
                    if own_groups:
                        g = self._link_group(pipeline[j], pipeline[j + 1], what, delta, link_backend)
                    else:
                        g = self.group
                    if not mine:
                        continue
                    if not gloo and k in (j, j + 1):
                        # NCCL creates a communicator at its first point-to-point use, blocking until
                        # both ends join: do that here, one message per link in pipeline order on
                        # every rank, not at a first receive posted while the peer is blocked in its
                        # first use of the opposite link (a deadlock). (gloo connects both ends
                        # when the group is created.)
                        probe = torch.zeros(1, device=self.device)
                        if k == j:
                            dist.isend(probe, dst=self.ranks[j + 1], group=g).wait()
                        else:
                            dist.irecv(probe, src=self.ranks[j], group=g).wait()
                        torch.cuda.synchronize(self.device)
                    if k in (j, j + 1):
                        peer = self.ranks[j + 1] if k == j else self.ranks[j]
                        self._links[(what, j)] = _Link(what, peer, g, 0 if own_groups else tag, self.device,
                                                       self.timeout, prefetch)
        self._pending: Deque[Tuple[Any, torch.Tensor, _Link, int]] = deque()
        self._closed = False

    def _link_group(self, a: int, b: int, what: str, timeout: datetime.timedelta, backend: Optional[str]):
        """The process group of one link between global ranks ``a`` and ``b`` (every rank of the
        job calls this, members or not; a gloo member blocks until the other end joins, bounded
        by ``timeout``)."""
        try:
            return dist.new_group([a, b], timeout=timeout, backend=backend)
        except RuntimeError as error:
            raise PipelineCommError(
                f"creating the {what} link between ranks {a} and {b} failed: {reason(error)}. A peer "
                f"stage hung, died or is slower than the timeout ({self.timeout:g} s); see its own "
                f"error") from error

    def stats(self) -> Dict[str, Dict[str, float]]:
        """Per link ("send activation", "recv gradient", ...): messages, bytes, and seconds this
        process spent blocked waiting on them (receives: the peer was late; sends: at the end of
        a schedule, for the peer to take them)."""
        out = {}
        for (what, pair), link in self._links.items():
            sending = (what == "activation") == (pair == self.stage)
            out[f"{'send' if sending else 'recv'} {what}"] = dict(link.stats)
        return out

    def check_open(self) -> None:
        """Raise if :meth:`close` has run: a message or a collective now has no group to go on
        (a control collective would silently fall back to the job's default group)."""
        if self._closed:
            raise PipelineCommError("this pipeline's process groups were closed (Pipeline.close(), or "
                                    "the end of the script): build a new Pipeline to train again")

    def _link(self, what: str, pair: int) -> _Link:
        self.check_open()
        return self._links[(what, pair)]

    # activations flow k -> k+1 on pair k; gradients k+1 -> k on pair k
    def send_activation(self, microbatch: int, key: Signature, value: Any) -> None:
        self._send(self._link("activation", self.stage), microbatch, key, value)

    def recv_activation(self, microbatch: int, key: Signature) -> Any:
        return self._link("activation", self.stage - 1).recv(microbatch, key)

    def send_gradient(self, microbatch: int, key: Signature, value: Any) -> None:
        self._send(self._link("gradient", self.stage - 1), microbatch, key, value)

    def recv_gradient(self, microbatch: int, key: Signature) -> Any:
        return self._link("gradient", self.stage).recv(microbatch, key)

    def _send(self, link: _Link, microbatch: int, key: Signature, value: Any) -> None:
        try:
            link.send(microbatch, key, value, self._pending)
        except PipelineCommError:
            raise
        except RuntimeError as error:
            raise link._fail("sending", microbatch, error) from error

    def expect(self, activations: Sequence[Tuple[int, Signature]],
               gradients: Sequence[Tuple[int, Signature]]) -> None:
        """The receives the next schedule will make, in order, and post the first ones."""
        if activations:
            self._link("activation", self.stage - 1).expect(activations)
        if gradients:
            self._link("gradient", self.stage).expect(gradients)
        for link in self._links.values():
            if link.expected:
                try:
                    link._post()
                except RuntimeError as error:
                    raise link._fail("receiving", link.expected[0][0], error) from error

    def expect_more(self, activations: Sequence[Tuple[int, Signature]],
                    gradients: Sequence[Tuple[int, Signature]]) -> None:
        """More receives of the running schedule (a streamed segment learns its micro-batches as
        they are fed), appended in order, and posted as far as the prefetch allows."""
        for what, pair, items in (("activation", self.stage - 1, activations),
                                  ("gradient", self.stage, gradients)):
            if items and (what, pair) in self._links:
                link = self._links[(what, pair)]
                link.expected.extend(items)
                try:
                    link._post()
                except RuntimeError as error:
                    raise link._fail("receiving", link.expected[0][0], error) from error

    def poll(self) -> None:
        """Forget the sends that have completed (their tensors may then be freed)."""
        while self._pending and self._pending[0][0].is_completed():
            self._pending.popleft()

    def flush(self) -> None:
        """Wait for every send still in flight."""
        while self._pending:
            work, _, link, microbatch = self._pending[0]
            try:
                link.wait(work)
            except RuntimeError as error:
                raise link._fail("sending", microbatch, error) from error
            self._pending.popleft()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has released this pipeline's process groups."""
        return self._closed

    def groups(self) -> List[Any]:
        """The process groups this PipeComm created (its links' own groups, the control group
        on NCCL), for a teardown that destroys them one by one."""
        made = [link.group for link in self._links.values() if self.link_groups]
        if self.control is not self.group:
            made.append(self.control)
        return [g for g in made if g is not None]

    def close(self) -> None:
        """Forget every message in flight and every process group this PipeComm holds.

        Called when the process's part of the job ends (``Torchrun.leave``). The groups' C++
        objects then die when torch's own references go (``destroy_process_group``), while the
        interpreter is whole: each joins its gloo worker threads, which may still be releasing the
        tensors of a collective that Python has finished with. Left to interpreter finalization,
        such a release must take the GIL from a finalizing interpreter, which ends the thread by
        unwinding it through a destructor: ``std::terminate`` ("terminate called without an active
        exception", SIGABRT) after a clean run. Sends and receives still posted (a run cut off by
        an error) are dropped first, so that no work object keeps a group's connections alive."""
        self._pending.clear()
        for link in self._links.values():  # a traceback's frames may still hold a link
            link.posted.clear()
            link.expected.clear()
            link.group = None
        self._links.clear()
        self.group = self.control = None
        self._closed = True


class GradientAverager:
    """Averages one stage's gradients over the replicas of the pipeline (pipeline x data
    parallel), so that weights, optimizer state, weight versions and predictions stay identical
    across replicas: ``all_reduce`` (sum, then divided by the number of replicas) on the group of
    that stage's ranks, before every update.

    Overlapped with the backward: during the backward of the last micro-batch before an update
    (:meth:`overlap`), each parameter is announced (:meth:`ready`) as soon as autograd has its final
    gradient, and every ``bucket_bytes`` of them are reduced asynchronously while the rest of the
    backward runs; the update (:meth:`__call__`) reduces what is left and waits for all. Every
    replica runs the same graph, so the buckets go out in the same order on every rank."""

    #: gradient bytes per asynchronous reduction (the default of new averagers)
    bucket_bytes = 1 << 22

    def __init__(self, group, replicas: int, timeout: float, bucket_bytes: Optional[int] = None) -> None:
        self.group, self.replicas, self.timeout = group, replicas, timeout
        if bucket_bytes is not None:
            self.bucket_bytes = bucket_bytes
        self._bucket: List[torch.Tensor] = []
        self._in_flight: List[Tuple[Any, torch.Tensor, List[torch.Tensor]]] = []
        self._sent: Dict[int, torch.Tensor] = {}
        self.overlapping = False

    def close(self) -> None:
        """Forget the group and any reduction in flight (the process's part of the job ended;
        see :meth:`PipeComm.close`)."""
        self.group, self._bucket, self._in_flight, self._sent = None, [], [], {}

    def overlap(self) -> None:
        """The next backward is the last before an update: reduce gradients as they are final."""
        self.overlapping = True

    def ready(self, param: torch.Tensor) -> None:
        """``param``'s gradient is final for this update (called from autograd hooks)."""
        if not self.overlapping:
            return
        if id(param) in self._sent:
            raise RuntimeError("a parameter received a gradient twice in one backward (a weight used "
                               "twice in a stage) after its gradient was sent to the other replicas")
        self._bucket.append(param)
        if sum(p.numel() * p.element_size() for p in self._bucket) >= self.bucket_bytes:
            self._launch(self._bucket)
            self._bucket = []

    def _launch(self, params: List[torch.Tensor]) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch._utils._flatten_dense_tensors(grads)
        try:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        except RuntimeError as error:
            raise self._fail(error) from error
        self._in_flight.append((work, flat, params))
        for p in params:
            self._sent[id(p)] = p

    def _fail(self, error: BaseException) -> PipelineCommError:
        return PipelineCommError(
            f"averaging gradients over the {self.replicas} replicas of this stage failed: "
            f"{reason(error)}. A replica hung, died or is slower than the timeout ({self.timeout:g} s)")

    def __call__(self, params: Sequence[torch.Tensor]) -> None:
        """Before the update: reduce what was not sent yet, wait for all, divide."""
        rest = [p for p in list(self._bucket) + [q for q in params if id(q) not in self._sent]
                if id(p) not in self._sent]
        if rest:
            self._launch(rest)
        try:
            for work, flat, group in self._in_flight:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout))
                flat.div_(self.replicas)
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group]
                for p, g in zip(group, torch._utils._unflatten_dense_tensors(flat, grads)):
                    p.grad = g
        except RuntimeError as error:
            raise self._fail(error) from error
        finally:
            self._bucket, self._in_flight, self._sent, self.overlapping = [], [], {}, False


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
        pending = comm._pending
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
            if pending:  # forget the sends that have completed (nothing to do without any)
                comm.poll()


def init_process_group(*, device: str = "cpu", timeout: float = DEFAULT_TIMEOUT,
                       init_method: Optional[str] = None, rank: Optional[int] = None,
                       world_size: Optional[int] = None, threads: Optional[int] = 1) -> torch.device:
    """Join the job's default process group (gloo on CPU, NCCL on GPU) with a timeout; return
    this process's device (``cuda:LOCAL_RANK`` on GPU). Without ``init_method`` the torchrun
    environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) is read.

    ``threads``: intra-op threads of this process (default 1: one compute thread per stage,
    so that N stages on N cores do not oversubscribe them); None leaves torch's setting."""
    import os

    if threads is not None:
        torch.set_num_threads(threads)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
        local_rank = int(os.environ.get("LOCAL_RANK", rank or 0))
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); "
                             f"start at most one process per GPU on each node")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        backend = "nccl"
    elif device == "cpu":
        dev, backend = torch.device("cpu"), "gloo"
    else:
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    kwargs: Dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout)}
    if init_method is not None:
        kwargs.update(init_method=init_method, rank=rank, world_size=world_size)
    if not dist.is_initialized():
        dist.init_process_group(**kwargs)
    return dev


def _control(comm: PipeComm, what: str, fn: Callable[[], Any]) -> Any:
    """Run a collective of the control group; a timeout or a dead peer becomes a
    PipelineCommError that says what the stages were doing."""
    comm.check_open()
    try:
        return fn()
    except RuntimeError as error:
        raise PipelineCommError(
            f"stage {comm.stage}: {what} failed: {reason(error)}. A peer stage hung, died or is slower than "
            f"the timeout ({comm.timeout:g} s); see its own error, or raise --timeout") from error


def broadcast(obj: Any, comm: PipeComm, src: int, what: str) -> Any:
    """Pipeline rank ``src``'s picklable ``obj`` on every rank (``what``: the step, for errors)."""
    box = [obj]
    _control(comm, what, lambda: dist.broadcast_object_list(box, src=comm.ranks[src], group=comm.control))
    return box[0]


def gather_all(value: Any, comm: PipeComm, what: str) -> List[Any]:
    """Every pipeline rank's picklable ``value``, in stage order, on every rank (over the control group)."""
    out: List[Any] = [None] * comm.num_stages
    _control(comm, what, lambda: dist.all_gather_object(out, value, group=comm.control))
    return out


def barrier(comm: PipeComm, what: str) -> None:
    """Wait until every stage of the pipeline is here (over the control group)."""
    _control(comm, what, lambda: dist.barrier(group=comm.control))
