"""The transport of one stage: :class:`PipeComm`, its links to the neighbouring stages and the
control group, over ``torch.distributed`` point to point (nothing home-made).

Links, sends, receives and timeouts are as (docs/architecture.md, "The distributed executor")
says. Each direction of a pair has a group of its own so that a send and an opposite receive
never queue on one communicator stream or gloo connection (a large send being written could
delay the receive behind it). The control group carries losses, timings and state dicts at the
end of an epoch (:mod:`~pipeoptim.runtime.control`). Each send's handle is kept with its
tensors until waited on (polled after every action, all waited at the end of the schedule); a
tensor whose shape differs from its signature's agreed one is an error that says so. The
timeout is ``PipeComm(timeout=...)``, ``--timeout``."""
from __future__ import annotations

import datetime
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .defaults import DEFAULT_TIMEOUT  # seconds a rank waits for a peer before the run fails
from .link import Link
from .wire import PipelineCommError, Signature, reason


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

    ``placement`` (default: stage k on rank k): the rank of each stage of the chain, where a rank
    holds several (chunks, docs/architecture.md, "Chunks: several stages per process"). Each
    boundary between stages on two ranks is then its own pair of links (boundary j: activations
    of stage j, gradients of stage j + 1); a boundary inside one rank has none (the executor
    hands the value over in memory). The send and receive methods take the stage they act for.
    """

    def __init__(self, group=None, *, device: Optional[torch.device] = None,
                 timeout: float = DEFAULT_TIMEOUT, prefetch: int = 2,
                 pipelines: Optional[Sequence[Sequence[int]]] = None,
                 placement: Optional[Sequence[int]] = None) -> None:
        """``pipelines``: with several replicas of the pipeline (pipeline x data parallel), the
        global ranks of every replica's stages; each rank passes its own replica's group as
        ``group``. Every rank creates every replica's link groups, in the same order (on gloo,
        only when ``pipelines`` names every rank of the job; otherwise the links are tags)."""
        self.group = group or dist.group.WORLD
        self.stage = dist.get_rank(self.group)
        self.num_stages = dist.get_world_size(self.group)
        self.ranks = [dist.get_global_rank(self.group, k) for k in range(self.num_stages)]
        #: the pipeline rank of each stage of the chain (a straight pipeline: stage k on rank k)
        self.placement = list(placement) if placement is not None else list(range(self.num_stages))
        if sorted(set(self.placement)) != list(range(self.num_stages)):
            raise ValueError(f"placement {self.placement} must put stages on every one of the "
                             f"{self.num_stages} ranks of the pipeline, and on no other")
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
        self._links: Dict[Tuple[str, int], Link] = {}
        k = self.stage
        place = self.placement
        for pipeline in replicas:
            mine = pipeline == self.ranks
            for j in range(len(place) - 1):
                a, b = place[j], place[j + 1]  # the pipeline ranks of boundary j's two ends
                if a == b:
                    continue  # both stages in one process: no message
                for tag, what in ((1 + 2 * j, "activation"), (2 + 2 * j, "gradient")):
                    # a group per direction (one stream / one gloo connection each, so that a send
                    # and an opposite receive of the pair never queue behind each other), created
                    # by every rank for every replica, in the same order
                    if not own_groups and not mine:
                        continue
                    if own_groups:
                        g = self._link_group(pipeline[a], pipeline[b], what, delta, link_backend)
                    else:
                        g = self.group
                    if not mine:
                        continue
                    if not gloo and k in (a, b):
                        # NCCL creates a communicator at its first point-to-point use, blocking until
                        # both ends join: do that here, one message per link in pipeline order on
                        # every rank, not at a first receive posted while the peer is blocked in its
                        # first use of the opposite link (a deadlock). (gloo connects both ends
                        # when the group is created.)
                        probe = torch.zeros(1, device=self.device)
                        if k == a:
                            dist.isend(probe, dst=self.ranks[b], group=g).wait()
                        else:
                            dist.irecv(probe, src=self.ranks[a], group=g).wait()
                        torch.cuda.synchronize(self.device)
                    if k in (a, b):
                        peer = self.ranks[b] if k == a else self.ranks[a]
                        self._links[(what, j)] = Link(what, peer, g, 0 if own_groups else tag, self.device,
                                                      self.timeout, prefetch)
        #: the links this rank receives on: activations into its stages, gradients into them
        self._receiving = {what: [link for (w, j), link in self._links.items()
                                  if w == what and place[j + (what == "activation")] == k]
                           for what in ("activation", "gradient")}
        self._pending: Deque[Tuple[Any, torch.Tensor, Link, int]] = deque()
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
        straight = self.placement == list(range(self.num_stages))
        for (what, pair), link in self._links.items():
            sending = (what == "activation") == (self.placement[pair] == self.stage)
            name = f"{'send' if sending else 'recv'} {what}"
            if not straight:  # several links per direction: name the stages
                name += f" {pair}->{pair + 1}" if what == "activation" else f" {pair + 1}->{pair}"
            out[name] = dict(link.stats)
        return out

    def check_open(self) -> None:
        """Raise if :meth:`close` has run: a message or a collective now has no group to go on
        (a control collective would silently fall back to the job's default group)."""
        if self._closed:
            raise PipelineCommError("this pipeline's process groups were closed (Pipeline.close(), or "
                                    "the end of the script): build a new Pipeline to train again")

    def _link(self, what: str, pair: int) -> Link:
        self.check_open()
        return self._links[(what, pair)]

    # activations flow k -> k+1 on pair k; gradients k+1 -> k on pair k. ``stage``: the stage
    # of the chain acting (default: this rank's, in a straight pipeline)
    def send_activation(self, microbatch: int, key: Signature, value: Any, stage: Optional[int] = None) -> None:
        """Send ``stage``'s output for ``microbatch`` to the next stage."""
        self._send(self._link("activation", self._own(stage)), microbatch, key, value)

    def recv_activation(self, microbatch: int, key: Signature, stage: Optional[int] = None) -> Any:
        """Receive ``stage``'s input for ``microbatch`` from the previous stage."""
        return self._link("activation", self._own(stage) - 1).recv(microbatch, key)

    def send_gradient(self, microbatch: int, key: Signature, value: Any, stage: Optional[int] = None) -> None:
        """Send the gradient of ``stage``'s input to the previous stage."""
        self._send(self._link("gradient", self._own(stage) - 1), microbatch, key, value)

    def recv_gradient(self, microbatch: int, key: Signature, stage: Optional[int] = None) -> Any:
        """Receive the gradient of ``stage``'s output from the next stage."""
        return self._link("gradient", self._own(stage)).recv(microbatch, key)

    def _own(self, stage: Optional[int]) -> int:
        return self.stage if stage is None else stage

    def _send(self, link: Link, microbatch: int, key: Signature, value: Any) -> None:
        try:
            link.send(microbatch, key, value, self._pending)
        except PipelineCommError:
            raise
        except RuntimeError as error:
            raise link.fail("sending", microbatch, error) from error

    def expect(self, activations: Sequence[Tuple[int, Signature]],
               gradients: Sequence[Tuple[int, Signature]]) -> None:
        """The receives the next schedule will make on each link into this rank's stages
        (activations) and out of them (gradients), in order, and post the first ones."""
        for what, items in (("activation", activations), ("gradient", gradients)):
            for link in self._receiving[what] if items else ():
                self.check_open()
                link.expect(items)
        self._post_all()

    def expect_more(self, activations: Sequence[Tuple[int, Signature]],
                    gradients: Sequence[Tuple[int, Signature]]) -> None:
        """More receives of the running schedule (a streamed segment learns its micro-batches as
        they are fed), appended in order on each receiving link, and posted as far as the
        prefetch allows. Every such link carries every micro-batch once."""
        for what, items in (("activation", activations), ("gradient", gradients)):
            for link in self._receiving[what] if items else ():
                link.expected.extend(items)
        self._post_all()

    def _post_all(self) -> None:
        for link in self._links.values():
            if link.expected:
                try:
                    link.post()
                except RuntimeError as error:
                    raise link.fail("receiving", link.expected[0][0], error) from error

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
        on NCCL), for a teardown that destroys them one by one."""
        made = [link.group for link in self._links.values() if self.link_groups]
        if self.control is not self.group:
            made.append(self.control)
        return [g for g in made if g is not None]

    def close(self) -> None:
        """Forget every message in flight and every process group this PipeComm holds.

        Called when the process's part of the job ends (``Torchrun.leave``, which says why that
        must happen while the interpreter is whole). Sends and receives still posted (a run cut
        off by an error) are dropped first, so that no work object keeps a group's connections
        alive."""
        self._pending.clear()
        for link in self._links.values():  # a traceback's frames may still hold a link
            link.posted.clear()
            link.expected.clear()
            link.group = None
        self._links.clear()
        self.group = self.control = None
        self._closed = True
