"""The transport of one rank: :class:`PipeComm`, its links to the neighbouring stages and the
control group, over ``torch.distributed`` point to point (docs/architecture.md, "The executor").

Each direction of each boundary is a 2-rank process group of its own, so that activations and
gradients never queue behind each other: NCCL runs a communicator's messages in posting order on
one stream, and on gloo both directions on one group share one socket pair (per-direction groups
ran the flush and asynchronous schedules 1.12-1.19x faster under load than tags of one group,
``benchmarks/link_groups.py``, at the cost of a gloo socket thread per link). Where the job's
other ranks do not build this PipeComm (a gloo pipeline on a sub-group) no group can be made:
its links are then tags of the control group. The control group also carries losses, timings
and state dicts (:mod:`~pipeoptim.runtime.control`)."""
from __future__ import annotations

import datetime
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .defaults import DEFAULT_TIMEOUT  # seconds a rank waits for a peer before the run fails
from .link import Link
from .strict import installed as strict_installed
from .wire import PipelineCommError, Signature, reason



def warm_pair(group: Any, sender: int, receiver: int, rank: int, device: torch.device) -> None:
    """One message from ``sender`` to ``receiver`` on ``group``, now, where this rank is one of
    them and the device a GPU (or the tests' strict transport, runtime/strict.py, holds this process
    to NCCL's rules). NCCL creates a pair's communicator at its first point-to-point use and blocks
    until both ends join it: left to a first message sent inside a schedule, one end could wait there
    for a peer that waits for something else of it (a link's first receive posted while the peer is
    in its first use of the opposite link; a tie's owner publishing inside its forward while the
    holder waits for that forward's activation). Every rank warms its pairs in the order the groups
    were made, so each waits only for a peer on its way to the same pair. Gloo connects a group's
    members when it is made: nothing to do there."""
    if (device.type != "cuda" and not strict_installed()) or rank not in (sender, receiver):
        return
    probe = torch.zeros(1, device=device)
    if rank == sender:
        dist.isend(probe, dst=receiver, group=group).wait()
    else:
        dist.irecv(probe, src=sender, group=group).wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)

class PipeComm:
    """The communication of one rank of a pipeline over a process group.

    Pipeline rank k is rank k of ``group`` (default: the whole job). The control group is a gloo
    group of the pipeline's ranks made with ``dist.new_group`` by every rank of the job, in the
    same order, or ``group`` itself where the pipeline owns it (a replica's group given with
    ``pipelines``, or a gloo pipeline on a sub-group, whose members alone build their PipeComm).
    On NCCL ``group`` must therefore be the whole job or ``pipelines`` name every replica.
    ``timeout`` bounds every wait on a peer and every group made.

    ``placement`` (default: stage k on rank k): the rank of each stage of the chain (chunks,
    docs/architecture.md, "Chunks: several stages per process"). Each boundary between stages on
    two ranks has two links; one inside a rank has none (the executor hands the value over in
    memory), nor has the boundary before a stage of ``chain_starts`` (a second chain's first
    stage). ``pipelines``: with several replicas of the pipeline, the global ranks of every
    replica's stages; each rank passes its own replica's group as ``group``."""

    #: gloo, where every rank of the job builds the PipeComm: a process group per direction of each
    #: boundary (True), or every link a tag of the control group (False: one socket thread for all
    #: links; ``benchmarks/link_groups.py`` compares the two)
    gloo_link_groups = True

    def __init__(self, group=None, *, device: Optional[torch.device] = None,
                 timeout: float = DEFAULT_TIMEOUT, prefetch: int = 2,
                 pipelines: Optional[Sequence[Sequence[int]]] = None,
                 placement: Optional[Sequence[int]] = None, chain_starts: Sequence[int] = ()) -> None:
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)  #: this process's pipeline rank
        self.ranks = dist.get_world_size(self.group)  #: ranks of the pipeline
        self.global_ranks = [dist.get_global_rank(self.group, k) for k in range(self.ranks)]
        #: the pipeline rank of each stage of the chain (a straight pipeline: stage k on rank k)
        self.placement = list(placement) if placement is not None else list(range(self.ranks))
        if sorted(set(self.placement)) != list(range(self.ranks)):
            raise ValueError(f"placement {self.placement} must put stages on every one of the "
                             f"{self.ranks} ranks of the pipeline, and on no other")
        self.timeout = float(timeout)
        self.backend = dist.get_backend(self.group)
        gloo = "gloo" in str(self.backend)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(self.backend) else "cpu"
        self.device = torch.device(device)
        delta = datetime.timedelta(seconds=self.timeout)
        replicas = [list(p) for p in pipelines] if pipelines is not None else [self.global_ranks]
        if self.global_ranks not in replicas:
            raise ValueError(f"pipelines {replicas} do not include this pipeline's ranks {self.global_ranks}")
        if not gloo and pipelines is None and self.group is not dist.group.WORLD:
            raise ValueError(f"a {self.backend} pipeline on part of the job needs pipelines=[the ranks "
                             f"of every replica]: its links are process groups that every rank creates")
        whole_job = sorted(r for p in replicas for r in p) == list(range(dist.get_world_size()))
        self.control = self._control_group(replicas, delta, gloo and not (whole_job and self.group is dist.group.WORLD))
        #: whether the links have process groups of their own (every rank of the job builds this
        #: PipeComm), or are tags of the control group (a gloo pipeline on a sub-group)
        self.link_groups = not gloo or (whole_job and self.gloo_link_groups)
        self._links: Dict[Tuple[str, int], Link] = {}
        k, place = self.rank, self.placement
        boundaries = [j for j in range(len(place) - 1) if place[j] != place[j + 1] and j + 1 not in chain_starts]
        for pipeline in replicas:
            for j in boundaries:
                for tag, what in ((1 + 2 * j, "activation"), (2 + 2 * j, "gradient")):
                    # a group per direction per boundary, made by every rank for every replica in the
                    # same order (dist.new_group's rule), and used by this replica's ends only
                    group = self._link_group(pipeline, j, what, delta, gloo) if self.link_groups else self.control
                    a, b = place[j], place[j + 1]
                    if pipeline == self.global_ranks and k in (a, b):
                        self._links[(what, j)] = Link(what, pipeline[b if k == a else a], group,
                                                      0 if self.link_groups else tag, self.device,
                                                      self.timeout, prefetch)
        #: the links this rank receives on, with their boundaries: activations and gradients into its stages
        self._receiving = {what: [(j, link) for (w, j), link in self._links.items()
                                  if w == what and place[j + (what == "activation")] == k]
                           for what in ("activation", "gradient")}
        self._pending: Deque[Tuple[Any, torch.Tensor, Link, int]] = deque()
        self._closed = False

    def _control_group(self, replicas: List[List[int]], delta: datetime.timedelta, own: bool):
        """The control group (gloo, the pipeline's ranks), made by every rank for every replica;
        ``own``: the pipeline's own group carries it (a gloo pipeline over part of the job, whose
        members alone build the PipeComm, cannot create groups).

        Never the job's default group: torch modules imported after the default group exists
        keep it (as a default argument), so it may outlive every teardown and die in
        interpreter finalization, where a gloo worker still releasing a collective's tensor
        aborts the process (see :meth:`close`)."""
        if own:
            return self.group
        control = None
        for ranks in replicas:
            made = dist.new_group(ranks, timeout=delta, backend="gloo")
            if ranks == self.global_ranks:
                control = made
        return control

    def _link_group(self, pipeline: List[int], j: int, what: str, delta: datetime.timedelta, gloo: bool):
        """The group of one direction of boundary ``j`` of ``pipeline`` (every rank of the job
        calls this, members or not). On NCCL its members exchange one message now: NCCL creates
        a communicator at its first point-to-point use, blocking until both ends join, which
        must not happen at a first receive posted while the peer is blocked in its first use of
        the opposite link (a deadlock); gloo connects its members when the group is made."""
        a, b = self.placement[j], self.placement[j + 1]
        try:
            # (gloo where the job's default is not: a gloo pipeline on a sub-group of an NCCL job;
            # else the job's own backend, so that runtime/strict.py takes it for what NCCL would carry)
            explicit = "gloo" if gloo and dist.get_backend() != "gloo" else None
            group = dist.new_group([pipeline[a], pipeline[b]], timeout=delta, backend=explicit)
        except RuntimeError as error:
            raise PipelineCommError(
                f"creating the {what} link between ranks {pipeline[a]} and {pipeline[b]} failed: "
                f"{reason(error)}. A peer stage hung, died or is slower than the timeout "
                f"({self.timeout:g} s); see its own error") from error
        if (not gloo or strict_installed()) and pipeline == self.global_ranks and self.rank in (a, b):
            warm_pair(group, pipeline[a], pipeline[b], pipeline[self.rank], self.device)
        return group

    def stats(self) -> Dict[str, Dict[str, float]]:
        """Per link ("send activation", "recv gradient", ...): messages, bytes, and seconds this
        process spent blocked waiting on them (receives: the peer was late; sends: at the end of
        a schedule, for the peer to take them); receives also the buffers made and the messages
        received into a buffer made for an earlier one (``link.ReceiveBuffers``)."""
        out = {}
        straight = self.placement == list(range(self.ranks))
        for (what, pair), link in self._links.items():
            sending = (what == "activation") == (self.placement[pair] == self.rank)
            name = f"{'send' if sending else 'recv'} {what}"
            if not straight:  # several links per direction: name the stages
                name += f" {pair}->{pair + 1}" if what == "activation" else f" {pair + 1}->{pair}"
            out[name] = dict(link.stats)
            if not sending:
                out[name].update(buffers_made=link.buffers.made, buffers_reused=link.buffers.reused)
        return out

    def check_open(self) -> None:
        """Raise if :meth:`close` has run: a message or a collective now has no group to go on
        (a control collective would silently fall back to the job's default group)."""
        if self._closed:
            raise PipelineCommError("this pipeline's process groups were closed (Pipeline.close(), or "
                                    "the end of the script): build a new Pipeline to train again")

    def _link(self, what: str, stage: Optional[int], boundary_offset: int) -> Link:
        """The link of ``what`` at the boundary ``stage`` + ``boundary_offset`` (``stage``: this rank's by default)."""
        self.check_open()
        return self._links[(what, (self.rank if stage is None else stage) + boundary_offset)]

    def send(self, what: str, microbatch: int, key: Signature, value: Any, stage: Optional[int] = None) -> None:
        """Send ``stage``'s output (``what`` "activation") to the next stage, or the gradient of its
        input ("gradient") to the previous one (``stage``: this rank's by default)."""
        self._link(what, stage, 0 if what == "activation" else -1).send(microbatch, key, value, self._pending)

    def recv(self, what: str, microbatch: int, key: Signature, stage: Optional[int] = None) -> Any:
        """Receive ``stage``'s input (``what`` "activation") from the previous stage, or the gradient
        of its output ("gradient") from the next one."""
        return self._link(what, stage, -1 if what == "activation" else 0).recv(microbatch, key)

    def expect_more(self, activations: Sequence[Tuple[int, Signature]],
                    gradients: Sequence[Tuple[int, Signature]],
                    travels: Optional[Callable[[int, int], bool]] = None) -> None:
        """The receives of the running schedule (a streamed segment learns its micro-batches as
        they are fed), appended in order on each receiving link, and posted as far as the
        prefetch allows. Every such link carries every micro-batch once; with ``travels``
        (boundary, micro-batch) -> bool, those it says (two pipelines: each link its own's)."""
        for what, items in (("activation", activations), ("gradient", gradients)):
            for j, link in self._receiving[what] if items else ():
                link.expected.extend(items if travels is None else [it for it in items if travels(j, it[0])])
        for link in self._links.values():
            if link.expected:
                link.post()

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
                raise link.fail("sending", microbatch, error) from error
            self._pending.popleft()

    def groups(self) -> List[Any]:
        """The process groups this PipeComm created (its links' own groups, the control group
        unless it is ``group``), for a teardown that destroys them one by one."""
        made = [link.group for link in self._links.values() if self.link_groups]
        if self.control is not self.group:
            made.append(self.control)
        return [g for g in made if g is not None]

    def close(self) -> None:
        """Forget every message in flight and every process group this PipeComm holds (called
        by ``Torchrun.leave``, which says why that must happen while the interpreter is whole).
        Sends and receives still posted (a run cut off by an error) are dropped first, so that
        no work object keeps a group's connections alive."""
        self._pending.clear()
        for link in self._links.values():  # a traceback's frames may still hold a link
            link.posted.clear()
            link.expected.clear()
            link.buffers.clear()
            link.group = None
        self._links.clear()
        self.group = self.control = None
        self._closed = True
