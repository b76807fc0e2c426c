"""Joining the job's process group, and the collectives of a pipeline's control group.

The control group of a :class:`~pipeoptim.runtime.transport.PipeComm` (gloo, the pipeline's
ranks) carries what is not a stage-to-stage message: losses, timings, norms, state dicts; a
timeout or a dead peer there becomes a :class:`~pipeoptim.runtime.wire.PipelineCommError`
saying what the stages were doing.
"""
from __future__ import annotations

import datetime
import math
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ..errors import option
from .defaults import DEFAULT_TIMEOUT  # seconds a rank waits for a peer before the run fails
from .lifecycle import fresh_join, shares_agent_store
from .strict import install_if_asked
from .transport import PipeComm
from .wire import PipelineCommError, reason


def local_gpu(local_rank: int, visible: int) -> torch.device:
    """The GPU of the process with ``local_rank`` on its node that sees ``visible`` GPUs: its
    own where it sees one (however the launcher numbered it), ``cuda:LOCAL_RANK`` where it sees
    the node's; more processes on a node than GPUs is refused, naming the fix."""
    if visible < 1:
        raise ValueError(f"{option('devices', 'cuda')}: no CUDA device is visible to this process")
    if visible == 1:
        return torch.device("cuda", 0)
    if local_rank >= visible:
        raise ValueError(f"local rank {local_rank} has no GPU of its own ({visible} visible to every process of "
                         f"this node): start at most one process per GPU on each node (torchrun "
                         f"--nproc-per-node {visible}), or give each process one GPU (CUDA_VISIBLE_DEVICES)")
    return torch.device("cuda", local_rank)


class JobsOfThisProcess:
    """How many times a Pipeline of this process tore the job's process group down
    (``Torchrun.leave`` counts): a Pipeline made after that joins the job again under a
    rendezvous prefix of its own (:func:`init_process_group`'s ``generation``)."""

    def __init__(self) -> None:
        self.ended = 0


#: this process's record of the job's teardowns (:class:`JobsOfThisProcess`)
PROCESS_JOBS = JobsOfThisProcess()


def init_process_group(*, device: str = "cpu", timeout: float = DEFAULT_TIMEOUT,
                       init_method: Optional[str] = None, rank: Optional[int] = None,
                       world_size: Optional[int] = None, threads: Optional[int] = 1,
                       generation: int = 0) -> torch.device:
    """Join the job's default process group (gloo on CPU, NCCL on GPU) with a timeout; return
    this process's device. Without ``init_method`` the torchrun environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, LOCAL_RANK) is read.

    On GPU the device is :func:`local_gpu`'s: ``cuda:LOCAL_RANK`` where the process sees its
    node's GPUs, ``cuda:0`` where it sees one (a scheduler that gives each process its own GPU,
    ``CUDA_VISIBLE_DEVICES`` per task, whatever its LOCAL_RANK); NCCL is told the device
    (``device_id``), so its communicators bind to it rather than to whichever device is current.

    ``threads``: intra-op threads of this process (default 1: N stages on N cores do not
    oversubscribe them); None leaves torch's setting. ``generation``: how many times this
    process has joined and torn down the job before; a job joined again rendezvouses under a
    prefix of its own, or the new groups would read the addresses the torn-down ones left. In a
    worker of torchrun's agent, whose store outlives the worker (a restart finds every earlier
    start's keys there), every join takes a number fresh to that store instead
    (:func:`pipeoptim.runtime.lifecycle.fresh_join`)."""
    import os

    if threads is not None:
        torch.set_num_threads(threads)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{option('devices', 'cuda')}: no CUDA device is available")
        dev = local_gpu(int(os.environ.get("LOCAL_RANK", rank or 0)), torch.cuda.device_count())
        torch.cuda.set_device(dev)
        backend = "nccl"
    elif device == "cpu":
        dev, backend = torch.device("cpu"), "gloo"
    else:
        raise ValueError(f"{option('devices')} must be cpu or cuda, got {device!r}")
    kwargs: Dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout)}
    if dev.type == "cuda":
        kwargs["device_id"] = dev
    if init_method is not None:
        kwargs.update(init_method=init_method, rank=rank, world_size=world_size)
    if not dist.is_initialized():
        if init_method is None and (generation or shares_agent_store()):
            store, rank, world_size = next(dist.rendezvous("env://", timeout=kwargs["timeout"]))
            if shares_agent_store():  # torchrun's store, which holds every earlier start's keys
                generation = fresh_join(store, rank, world_size, timeout)
            kwargs.update(store=dist.PrefixStore(f"pipeoptim-job-{generation}", store), rank=rank,
                          world_size=world_size)
        dist.init_process_group(**kwargs)
    install_if_asked()  # the tests' strict transport (runtime/strict.py), where the environment asks
    return dev


def _control(comm: PipeComm, what: str, fn: Callable[[], Any]) -> Any:
    """Run a collective of the control group; a timeout or a dead peer becomes a
    PipelineCommError that says what the stages were doing."""
    comm.check_open()
    try:
        return fn()
    except RuntimeError as error:
        raise PipelineCommError(
            f"pipeline rank {comm.rank}: {what} failed: {reason(error)}. A peer stage hung, died or is slower than "
            f"the timeout ({comm.timeout:g} s); see its own error, or raise {option('timeout')}") from error


def broadcast(obj: Any, comm: PipeComm, src: int, what: str) -> Any:
    """Pipeline rank ``src``'s picklable ``obj`` on every rank (``what``: the step, for errors)."""
    box = [obj]
    _control(comm, what, lambda: dist.broadcast_object_list(box, src=comm.global_ranks[src], group=comm.control))
    return box[0]


def gather_all(value: Any, comm: PipeComm, what: str) -> List[Any]:
    """Every pipeline rank's picklable ``value``, in stage order, on every rank (over the control group)."""
    out: List[Any] = [None] * comm.ranks
    _control(comm, what, lambda: dist.all_gather_object(out, value, group=comm.control))
    return out


def in_stage_order(parts: List[List[Any]], placement: List[int]) -> List[Any]:
    """Each pipeline rank's values of its stages (``parts[r]``, in stage order) as one value per
    stage, in stage order (``placement``: the rank of each stage)."""
    held = [iter(part) for part in parts]
    return [next(held[r]) for r in placement]


def sum_over_pipeline(tensor: torch.Tensor, comm: PipeComm, what: str) -> torch.Tensor:
    """``tensor`` summed over the pipeline's ranks, in place, on its device: one all-reduce on the
    pipeline's own group (NCCL on a GPU: queued on its stream, no wait on the host; every rank
    calls it at the same point)."""
    _control(comm, what, lambda: dist.all_reduce(tensor, group=comm.group))
    return tensor


def gather_tensors(own: Dict[str, torch.Tensor], comm: PipeComm, what: str) -> Dict[str, torch.Tensor]:
    """Every pipeline rank's named tensors (``own``: this rank's; a name several ranks hold: the
    last rank's) on every rank, on the CPU, bit for bit. Only names, dtypes and shapes are
    pickled (pickling the values cost ~30 ms per ``fit`` on the benchmark model); the values
    travel as one flat byte tensor per rank and dtype, broadcast from the rank holding them."""
    own = {k: v.detach().to("cpu") for k, v in own.items()}
    layouts = gather_all([(k, v.dtype, tuple(v.shape)) for k, v in own.items()], comm, what)
    out: Dict[str, torch.Tensor] = {}
    for rank, layout in enumerate(layouts):
        for dtype in dict.fromkeys(d for _, d, _ in layout):  # in order of first appearance
            entries = [(k, shape) for k, d, shape in layout if d == dtype]
            if rank == comm.rank:
                flat = torch.cat([own[k].reshape(-1) for k, _ in entries])
            else:
                flat = torch.empty(sum(math.prod(shape) for _, shape in entries), dtype=dtype)
            if flat.numel():  # as bytes: gloo broadcasts them whatever the dtype (bool, complex)
                _control(comm, what, lambda: dist.broadcast(flat.view(torch.uint8), src=comm.global_ranks[rank],
                                                            group=comm.control))
            pos = 0
            for k, shape in entries:
                size = math.prod(shape)
                out[k] = flat[pos:pos + size].view(shape)
                pos += size
    return out
