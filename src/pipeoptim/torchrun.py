"""The Pipeline under torchrun: one pipeline rank per process, holding its stage (or its chunks' stages).

Ranks, replicas and what every rank reads: (docs/architecture.md, "The Pipeline under
torchrun"). This world is chosen also where a process group is already initialised: gloo on the
CPU (one compute thread per process unless the user says otherwise), NCCL on
``cuda:LOCAL_RANK``, a timeout on every group and every wait; the same script runs unchanged
with ``python script.py``. :class:`Torchrun` derives from :class:`~pipeoptim.world.World`, the
one-process case, and overrides what differs, so the Pipeline never asks which world it has. A
Pipeline that starts the process group also installs :mod:`pipeoptim.runtime.lifecycle`'s guards
(a signal ends the process at once with one line, also while it waits on a peer, and so does the
agent's death)."""
from __future__ import annotations

import atexit
import datetime
import gc
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .state_names import StateNames
from .methods import Method
from .runtime.averaging import GradientAverager
from .runtime.control import PROCESS_JOBS, broadcast, gather_all, gather_tensors, in_stage_order, init_process_group
from .runtime.defaults import DEFAULT_TIMEOUT
from .runtime.distributed import DistributedExecutor, ForwardTransport
from .runtime.executor import Executor
from .runtime.forward_only import ForwardOnly, PipelinedModel
from .runtime.layout import Layout, plan_layout
from .runtime.lifecycle import guard
from .runtime.replicas import replica_pair_groups
from .runtime.segment import ScheduleFor, float_sum
from .runtime.sharding import StageShards, forget_meshes, pipeline_mesh
from .runtime.stage import Stage
from .runtime.tensor_parallel import StageTensors
from .runtime.tied import TieRound, connect_exchanges
from .runtime.transport import PipeComm
from .runtime.wire import PipelineCommError, reason
from .schedules.fill import forward_alone
from .world import World, whole_model


def world_size() -> int:
    """Processes of the job this process belongs to (1 outside torchrun)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def after_stop() -> str:
    """What follows a stopped stage's line: torchrun's agent restarts the job while it has restarts
    left (``--max-restarts``), and fit(..., resume=True) continues it; else how to continue."""
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    limit = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if count < limit:
        return (f"torchrun restarts the job (restart {count + 1} of at most {limit}), and fit(..., resume=True) "
                f"continues it from the last checkpoint")
    return "resume from the last checkpoint with fit(..., resume=True)"


def process_device(devices: Any) -> str:
    """``devices`` of a Pipeline under torchrun, as the kind of device of this process (refused
    here, not in ``checks.py``: the job is joined on that device before the run is checked)."""
    if isinstance(devices, (list, tuple)):
        raise ValueError("under torchrun each process runs its rank's stages on its own device: give "
                         "devices='auto', 'cpu' or 'cuda' (stage k takes cuda:LOCAL_RANK), not a list")
    name = str(devices)
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu" or name.startswith("cuda"):
        return "cpu" if name == "cpu" else "cuda"
    raise ValueError(f"devices={name!r} under torchrun: give 'auto', 'cpu' or 'cuda'")


@dataclass
class Torchrun(World):
    """This process's place in a torchrun job running one Pipeline: its rank in the pipeline
    (the stages placed there), its replica and the links.

    With N stages, D replicas and T tensor ranks (pipeline x data x tensor parallel, WORLD_SIZE =
    N x D x T), rank ``r = (d*N + k)*T + t`` runs tensor rank t of stage k of replica d
    (:meth:`global_rank`): the T ranks of a stage are neighbours (one node's fast links carry
    their collectives), each (d, t) is a pipeline of its own (its group), stage k's replicas
    with the same t average its gradients. With T = 1, rank r runs stage ``r % N`` of replica
    ``r // N``.
    """

    rank: int = field()  # (no default: the field() keeps World's rank, 0, from being taken for one)
    world: int
    device: torch.device
    timeout: float
    ranks: int = 0  #: ranks of one pipeline, N (the model has N x chunks stages)
    replicas: int = 1
    tensor: int = 1  #: T, the processes each stage is split over (set by layout)
    tensor_group: Any = None  #: this stage's T processes (made by stage_tensors)
    _stage_mesh: Any = None  #: a split stage sharded too: its ("dp", "tp") mesh
    #: stages (model chunks) per process, and the rank of each stage (set by connect)
    chunks: int = 1
    placement: List[int] = field(default_factory=list)
    #: a bidirectional run (two pipelines of the same pieces) and the 2-process groups of the
    #: replica pairs this rank takes part in (piece -> group)
    mirrored: bool = False
    replica_groups: Dict[int, Any] = field(default_factory=dict)
    comm: Optional[PipeComm] = None
    stage_group: Any = None
    #: whether this Pipeline started the job's process group (then it also tears it down)
    owns_job: bool = False
    _made: List[Any] = field(default_factory=list)  #: process groups made by connect()
    _averager: Optional[GradientAverager] = None
    _pipeline_group: Any = None
    _sharded: bool = False  #: a device mesh was made over this Pipeline's groups (sharded replicas)
    _job_groups: List[Any] = field(default_factory=list)

    @classmethod
    def join(cls, devices: Any, timeout: float = DEFAULT_TIMEOUT, threads: Optional[int] = 1) -> Optional["Torchrun"]:
        """Join the job's process group (initialising it if needed); None outside torchrun."""
        world = world_size()
        if world <= 1:
            return None
        kind = process_device(devices)
        if not dist.is_initialized():
            # before the process group starts its threads, so that they inherit the blocked
            # signals: Ctrl-C / SIGTERM (forwarded by torchrun) and the launcher's death end this
            # stage at once, even inside a wait on a peer, with one line and no traceback
            rank = os.environ.get("RANK", "?")
            # one write() of the whole line: the stages share torchrun's stderr, and a short
            # write to a pipe is never interleaved with another process's
            guard(lambda stop: os.write(2, (f"pipeoptim: rank {rank} stopped by {stop.signal_name} "
                                            f"({stop.cause}); {after_stop()}\n").encode()))
        ours = not dist.is_initialized()
        if ours:
            # This module's functions take the default group as a default argument, evaluated at
            # import: imported after the group exists (the first optimizer imports it, through
            # torch._dynamo), they would keep the group alive past leave(), into interpreter
            # finalization. Imported now, they hold None.
            import torch.distributed.nn.functional  # noqa: F401
        device = init_process_group(device=kind, timeout=timeout, threads=threads if kind == "cpu" else None,
                                    generation=PROCESS_JOBS.ended if ours else 0)
        joined = cls(dist.get_rank(), world, device, float(timeout), owns_job=ours)
        # at the script's exit, while the interpreter is whole: see leave()
        atexit.register(joined.leave)
        return joined

    def leave(self) -> None:
        """This process's part of the job ends: wait for the sends still in flight (unless an
        exception is ending the script), then destroy every process group this Pipeline made
        (the whole job's when it started it) and drop every reference to them, so that their C++
        objects die here and join gloo's worker threads. Runs at the script's exit (``atexit``)
        or from ``Pipeline.close()``; a second call does nothing. Not left to interpreter
        finalization: a gloo worker may still hold the last reference to a collective's tensor,
        and releasing it there takes the GIL from a finalizing interpreter, which ends in
        ``std::terminate`` (SIGABRT after a clean run, at random)."""
        comm, self.comm = self.comm, None
        averager, self._averager = self._averager, None
        made, self._made = self._made, []
        self._pipeline_group, self._job_groups, sharded, self._sharded = None, [], self._sharded, False
        self.tensor_group = self._stage_mesh = None
        if comm is None and not self.owns_job and not made:
            return
        try:
            if comm is not None:
                made += comm.groups()
                if getattr(sys, "last_value", None) is None:  # a clean end: deliver what was sent
                    try:
                        comm.flush()
                    except PipelineCommError:
                        pass  # the peer is gone; nothing is left to deliver it to
                comm.close()
            if averager is not None:
                averager.close()
            self.stage_group = None
            if sharded:
                forget_meshes()
            if dist.is_initialized():
                if self.owns_job:
                    dist.destroy_process_group()  # every group of the job
                    PROCESS_JOBS.ended += 1  # a Pipeline made later joins it again (init_process_group)
                else:  # the user's job goes on: only the groups made for this pipeline
                    for group in made:
                        dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - a broken group cannot always be torn down cleanly
            pass
        finally:
            self.owns_job = False
            del made, comm, averager
            gc.collect()  # groups held in reference cycles die now too, not at finalization

    # -- what differs from World's one process ----------------------------------------------------
    losses_at_drain = True  #: the losses are checked and reported at each drain, on every rank at once

    @property
    def processes(self) -> int:
        return self.world

    def layout(self, method: Method, stages: Optional[int], partition: Optional[Sequence[int]],
               chunks: Optional[int], data_parallel: Optional[int], tensor_parallel: int = 1) -> Layout:
        """The run's layout in this job: N x D x T = WORLD_SIZE (refused the same way on every rank)."""
        layout = plan_layout(method, stages=stages, partition=partition, chunks=chunks, processes=self.world,
                             data_parallel=data_parallel, tensor_parallel=tensor_parallel)
        self.tensor = layout.tensor
        return layout

    def place(self, devices: Any, stages: int) -> List[torch.device]:
        """This process's stage on this process's device (the others are elsewhere)."""
        return [self.device] * stages

    def own_rank(self, ranks: int) -> Optional[int]:
        return (self.rank // self.tensor) % ranks

    def global_rank(self, k: int, d: int, t: Optional[int] = None) -> int:
        """The rank of pipeline rank ``k`` of replica ``d``, tensor rank ``t`` (default: this process's)."""
        return (d * self.ranks + k) * self.tensor + (self.tensor_rank if t is None else t)

    @property
    def tensor_rank(self) -> int:
        """This process's place among its stage's T processes."""
        return self.rank % self.tensor

    def connect(self, stages: List[Stage], replicas: int, placement: Optional[List[int]] = None) -> None:
        """Create the groups and the links between neighbouring stages (every rank, at the same
        point, in the same order), and this stage's gradient averaging over its replicas. With
        several stages per process (chunks), stage s lives on pipeline rank ``placement[s]``."""
        self.chunks = len(stages)
        count = stages[0].num_stages // self.chunks
        self.ranks, self.replicas = count, replicas
        placement = list(placement) if placement is not None else list(range(count))
        self.placement = placement
        # two pipelines of the same pieces (every rank holds stages of both): no link between them
        self.mirrored = any(stage.replica_of is not None for stage in stages)
        starts = (len(placement) // 2,) if self.mirrored else ()
        if replicas == 1 and self.tensor == 1:
            self.comm = PipeComm(device=self.device, timeout=self.timeout, placement=placement, chain_starts=starts)
        else:
            own, pipelines = self._replica_groups(count, replicas)
            self.comm = PipeComm(own, device=self.device, timeout=self.timeout, pipelines=pipelines,
                                 placement=placement, chain_starts=starts)
        if stages[0].tied is not None:
            self._connect_ties(stages, count, replicas)
        if self.mirrored:
            made, self.replica_groups = replica_pair_groups(
                placement, self.rank, self.timeout,
                [lambda k, t=t: self.global_rank(k, 0, t) for t in range(self.tensor)])
            self._made += made

    def _new_group(self, ranks: Sequence[int], backend: Optional[str] = None) -> Any:
        """A process group of ``ranks`` with the pipeline's timeout (every rank of the job calls
        this, in the same order), kept for :meth:`leave` where this rank is a member."""
        made = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=self.timeout), backend=backend)
        if self.rank in ranks:
            self._made.append(made)
        return made

    def agree(self, value: Any, what: str) -> Any:
        """Rank 0's ``value`` on every rank of the job, before the pipeline's groups exist: over a
        gloo group of every rank made for it (destroyed with the others by :meth:`leave`)."""
        box = [value]
        try:
            dist.broadcast_object_list(box, src=0, group=self._new_group(range(self.world), "gloo"))
        except RuntimeError as error:
            raise PipelineCommError(f"{what}: rank 0 did not answer within {self.timeout:g} s ({error})") from error
        return box[0]

    def _connect_ties(self, own: List[Stage], stages: int, replicas: int) -> None:
        """A group of the holders' ranks for each tied weight, in each replica (every rank makes
        every group, in the same order); ``own``: this process's stages. Holders in one process
        read one tensor: the group joins each holder's process once, and there the first holder
        sums and receives for all (with several stages here,
        all ties together: runtime/tied.py's ``TieRound``); a tie whose holders are all in one
        process needs none. With an asynchronous method (one stage per rank), the 2-rank
        groups its values and gradients travel on per micro-batch, in each replica
        (``runtime/tied.connect_exchanges``)."""
        views = [stage.tied for stage in own]
        ranks_of = [[list(dict.fromkeys(self.global_rank(self.placement[k], d, t) for k in tie.holders))
                     for d in range(replicas) for t in range(self.tensor)] for tie in views[0].ties]
        for i, per_replica in enumerate(ranks_of):
            for ranks in per_replica:
                if len(ranks) == 1:
                    continue
                made = self._new_group(ranks)
                if self.rank in ranks:  # the first holder here (the owner, in the owner's process)
                    view = next(v for v in views if v.stage in v.ties[i].holders)  # (stages in index order)
                    view.ties[i].group, view.ties[i].owner_rank = made, ranks[0]
        if len(own) > 1:
            TieRound(own)
        if not views[0].synchronous:
            for d in range(replicas):  # (a rank's own replica's exchanges are the ones it keeps)
                for t in range(self.tensor):
                    connect_exchanges(views[0].ties, self.rank,
                                      lambda k, d=d, t=t: self.global_rank(self.placement[k], d, t),
                                      self._new_group, self.device)

    def _replica_groups(self, stages: int, replicas: int) -> Tuple[Any, List[List[int]]]:
        """This rank's pipeline group (its replica's stages at its tensor rank) and every
        pipeline's ranks; with them :attr:`stage_group` (its stage's replicas at its tensor rank).
        Made once, every rank at the same point."""
        self.ranks = stages
        pipelines = [[self.global_rank(k, d, t) for k in range(stages)]
                     for d in range(replicas) for t in range(self.tensor)]
        if self._pipeline_group is None:
            for ranks in pipelines:
                made = self._new_group(ranks)
                if self.rank in ranks:
                    self._pipeline_group = made
            if replicas > 1:
                for k in range(stages):
                    for t in range(self.tensor):
                        ranks = [self.global_rank(k, d, t) for d in range(replicas)]
                        made = self._new_group(ranks)
                        if self.rank in ranks:
                            self.stage_group = made
        return self._pipeline_group, pipelines

    def replica_sync(self, stages: int, replicas: int, sharded: bool) -> Optional[GradientAverager]:
        """What averages the gradients of this rank's stages over their replicas, made with the
        groups now, before the stages are built (None: one replica, or sharded: FSDP reduces)."""
        if replicas == 1 or sharded:
            return None
        self._replica_groups(stages, replicas)
        self._averager = GradientAverager(self.stage_group, replicas, self.timeout)
        return self._averager

    def stage_shards(self, stages: int, replicas: int, synchronous: bool) -> Callable[[], StageShards]:
        """What shards each stage this rank builds over its replicas (``shard_replicas``): the
        groups and the job's 2-D mesh ("pp", "dp") now, before the stages are built; with T
        tensor ranks, this stage's ("dp", "tp") mesh, whose "tp" dimension the split uses."""
        own, _ = self._replica_groups(stages, replicas)
        if self.tensor > 1:
            self._tensor_groups(stages, replicas)
            ranks = torch.tensor([[self.global_rank(self.pipeline_rank, d, t) for t in range(self.tensor)]
                                  for d in range(replicas)])
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group([self.stage_group, self.tensor_group], self.device.type, mesh=ranks,
                                         mesh_dim_names=("dp", "tp"))
            self._stage_mesh = mesh
        else:
            mesh = pipeline_mesh(own, self.stage_group, stages, replicas, self.device.type)
        self._sharded = True
        return lambda: StageShards(mesh, synchronous)

    def _tensor_groups(self, stages: int, replicas: int) -> None:
        """The groups of every stage's T processes (every rank makes them, in the same order, once)."""
        self.ranks = stages
        if self.tensor_group is not None:
            return
        for d in range(replicas):
            for k in range(stages):
                ranks = [self.global_rank(k, d, t) for t in range(self.tensor)]
                made = self._new_group(ranks)
                if self.rank in ranks:
                    self.tensor_group = made

    def stage_tensors(self, stages: int, replicas: int, plan: Dict[str, Any], kinds: Dict[str, str],
                      names: Dict[int, List[str]]) -> Callable[[], StageTensors]:
        """What splits each stage this rank builds over its T tensor ranks (``tensor_parallel``):
        the groups of every stage's T processes, and this one's "tp" ``DeviceMesh`` (of the
        stage's ("dp", "tp") mesh where it is sharded too), now, before the stages are built."""
        from torch.distributed.device_mesh import DeviceMesh

        self._tensor_groups(stages, replicas)
        if self._stage_mesh is not None:
            mesh = self._stage_mesh["tp"]
        else:
            mesh = DeviceMesh.from_group(self.tensor_group, self.device.type, mesh_dim_names=("tp",))
        self._sharded = True  # torch's cached sharding decisions name these groups: dropped at leave()
        return lambda: StageTensors(mesh, plan, kinds, names)

    @property
    def fills_bubbles(self) -> bool:
        """Whether an evaluation can run in a segment's bubbles (one replica of the pipeline)."""
        return self.replicas == 1

    def executor(self, stages: List[Stage], schedule_for: ScheduleFor, *, expected: Optional[int],
                 trace_offset: int, clip_global: Optional[float],
                 forward_only: Optional[ForwardOnly] = None) -> DistributedExecutor:
        return DistributedExecutor(stages, self.comm, schedule_for, expected=expected,
                                   trace_offset=trace_offset, clip_global=clip_global,
                                   replica_groups=self.replica_groups if self.mirrored else None,
                                   forward_only=forward_only)

    def forward_executor(self, stages: List[Stage], work: ForwardOnly) -> Executor:
        """Forward-only work alone over this process's ``stages`` (the model's), the others' over
        the links (:class:`ForwardTransport`): a bidirectional run's first pipeline."""
        last = self.last_model_stage
        transport = ForwardTransport(self.comm, (lambda boundary, j: boundary < last) if self.mirrored else None)
        return Executor(stages, transport, lambda n: forward_alone(self.placement, last, n),
                        ranks=[self.comm.rank], forward_only=work)

    def forward(self, stages: List[Stage], inputs: Any) -> Any:
        raise RuntimeError("forward() runs the stages of one process; under torchrun use "
                           "evaluate(loader, metric) or model()")

    def gather_model(self, model: nn.Module, stages: List[Stage], device: torch.device) -> nn.Module:
        """Every stage's weights (a sharded one's gathered over its replicas), on every rank, in
        the model whole on ``device`` (:func:`~pipeoptim.world.whole_model`: this process's copy
        where it lies there whole, else a copy: its own stage's layers are on this process's
        device, or released where sharded, the others where the model was given)."""
        # a stage split over processes: gathered (a collective over them)
        own = {k: v for stage in stages for k, v in
               (stage.module.state_dict() if stage.copied is None else stage.copied.full_state_dict()).items()}
        merged = gather_tensors(own, self.comm, "gathering the model's weights")
        return whole_model(model, device, StateNames(model).complete(merged))

    def evaluate_model(self, model: nn.Module, stages: List[Stage], evaluate: Callable[[nn.Module], float],
                       evaluating: Callable[[], Any]) -> float:
        """``evaluate`` runs on the process of each replica's last stage, on a module whose calls
        run through the pipeline's stages on their devices, as training does (the other processes
        serve them: ``runtime/forward_only.PipelinedModel``); its value reaches every rank of the
        replica. Nothing of the model is gathered or copied."""
        with torch.no_grad(), evaluating():
            pipelined = PipelinedModel(self.comm, stages, self.last_rank,
                                       lambda work: self.forward_executor(stages, work))
            return pipelined.run(evaluate) if self.is_last else pipelined.serve()

    def comm_stats(self) -> Dict[str, Dict[str, float]]:
        return self.comm.stats() if self.comm is not None else {}

    def close(self) -> None:
        self.leave()

    @property
    def pipeline_rank(self) -> int:
        """This process's rank in its pipeline (its replica's group): the stages placed there are its."""
        return (self.rank // self.tensor) % self.ranks

    @property
    def replica(self) -> int:
        return self.rank // (self.ranks * self.tensor)

    @property
    def last_model_stage(self) -> int:
        """The model's last stage (a bidirectional run: its first pipeline's; the second's are replicas)."""
        return (len(self.placement) // 2 if self.mirrored else len(self.placement)) - 1

    @property
    def last_rank(self) -> int:
        """The rank of the model's last stage."""
        return self.placement[self.last_model_stage]

    @property
    def is_last(self) -> bool:
        return self.pipeline_rank == self.last_rank

    @property
    def halves(self) -> bool:
        """A bidirectional run whose two pipelines end on two ranks: each of those holds halves."""
        return self.mirrored and self.placement[-1] != self.last_rank

    @property
    def partial_losses(self) -> bool:
        """The losses completed here are a part of each window's: a pipeline's halves, or one
        replica's (the mean over the replicas comes at the drain)."""
        return self.halves or self.replicas > 1

    def _replica_sum(self, values: List[float], what: str) -> torch.Tensor:
        """The sum over this stage's replicas of each value (in float64, exact for counts)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu")
        try:
            dist.all_reduce(t, group=self.stage_group)
        except RuntimeError as error:
            raise PipelineCommError(f"pipeline rank {self.pipeline_rank}: {what} failed: {reason(error)}. A replica "
                                    f"hung, died or is slower than the timeout ({self.timeout:g} s)") from error
        return t

    def _replica_mean(self, values: List[float], what: str) -> List[float]:
        """The mean over this stage's replicas of each value (floats, in float64)."""
        if self.replicas == 1 or not values:
            return values
        return (self._replica_sum(values, what) / self.replicas).tolist()

    def replica_total(self, value: int, what: str) -> int:
        """``value`` summed over this stage's replicas (every rank of a replica reads the same
        mini-batch, so each stage's group of replicas sums the same counts)."""
        if self.replicas == 1:
            return value
        return int(self._replica_sum([float(value)], what)[0].item())

    # -- what every rank must see -------------------------------------------------------------
    def share_losses(self, losses: List[float]) -> List[float]:
        """The last stage's ``losses`` of a segment (the mean over the replicas), on every rank."""
        if self.halves:  # each pipeline's last rank holds its halves of the windows
            parts = gather_all(losses, self.comm, "sharing the losses of the segment")
            first, second = parts[self.last_rank], parts[self.placement[-1]]
            return [float_sum([a, b]) for a, b in zip(first, second)]
        if self.is_last:
            losses = self._replica_mean(losses, "averaging the losses over the replicas")
        return broadcast(losses if self.is_last else None, self.comm, self.last_rank,
                         "sharing the losses of the segment")

    def share(self, value: Any, src: int, what: str) -> Any:
        return broadcast(value, self.comm, src, what)

    def all_stages(self, own: List[Any], what: str) -> List[Any]:
        """One value per stage, in stage order, on every rank (``own``: this process's stages',
        in order: with chunks, stages k, k + N, ...)."""
        return in_stage_order(gather_all(own, self.comm, what), self.placement)

    def checkpoint_group(self, background: bool = False) -> Any:
        """A gloo group of every rank of the job (made once, with the pipeline's timeout);
        ``background``: a second one, which a checkpoint written beside training uses from its
        own thread (a group serves one thread at a time)."""
        index = 1 if background else 0
        while len(self._job_groups) <= index:  # made in order, on every rank alike
            self._job_groups.append(self._new_group(range(self.world), "gloo"))
        return self._job_groups[index]

    def everyone(self, value: Any, what: str) -> List[Any]:
        """Every rank's ``value`` (rank order) on every rank, over :meth:`checkpoint_group`."""
        values: List[Any] = [None] * self.world
        try:
            dist.all_gather_object(values, value, group=self.checkpoint_group())
        except RuntimeError as error:
            raise PipelineCommError(f"{what}: a rank hung, died or is slower than the timeout "
                                    f"({self.timeout:g} s): {reason(error)}") from error
        return values

    # -- an evaluation's value -----------------------------------------------------------------
    def shared_mean(self, summed: float, count: int) -> float:
        """The last stage's process's evaluation (the mean over the replicas), on every rank."""
        total = 0.0
        if self.is_last:
            summed, count = self._replica_mean([summed, float(count)], "averaging the evaluation over the replicas")
            total = summed / count
        return float(self.share(total, self.last_rank, "sharing the evaluation"))
