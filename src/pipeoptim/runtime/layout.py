"""Where a run's pieces go: the one function that turns (method, stages or partition, chunks,
processes, replicas) into the layout every part of the package uses.

A run of N pipeline ranks, each holding V stages (model chunks), replicated D times, needs N x D
processes under torchrun (or one process holding all N x V stages). Who asks
:func:`plan_layout`, so that all agree and refuse alike: (docs/architecture.md, "Layers"); the
lab's launcher asks how many processes to start, its worker under a user's own torchrun whether
the job fits the run."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..errors import Shown, option


#: placements whose chunks per stage are fixed by their shape (the method's own ``chunks``)
FIXED_CHUNKS = {"v": "a V", "bidirectional": "one of each pipeline", "bitpipe": "two of each pipeline's V"}


def chunks_of(method: Any, chunks: Optional[int], partition: Optional[Sequence[int]] = None) -> int:
    """Stages per rank: ``chunks`` if given, else the method's own; refused where the method
    places one stage per rank, or the partition does not divide into that many chunks."""
    # refused here, not in pipeoptim.checks: the launcher asks the layout for its process count first
    if chunks is None:
        v = method.chunks
    elif isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"{option('chunks')} must be a positive number of model chunks per stage, got {chunks!r}")
    elif chunks > 1 and method.chunks == 1:
        raise ValueError(f"{method.name} runs one chunk per stage; {option('chunks', chunks)} needs a method that "
                         f"places several: {option('method', 'interleaved')}")
    elif method.placement in FIXED_CHUNKS and chunks != method.chunks:
        raise ValueError(f"{method.name} places exactly {method.chunks} chunks per stage "
                         f"({FIXED_CHUNKS[method.placement]}); drop {option('chunks', chunks)} "
                         f"or use {option('method', 'interleaved')} for {chunks}")
    else:
        v = chunks
    pieces = method.pieces_per_rank(v)
    if partition is not None and len(partition) % pieces:
        raise ValueError(f"a partition for {pieces} chunks per stage lists stages x {pieces} entries; "
                         f"{option('partition', list(partition))} has {len(partition)}")
    return v


@dataclass(frozen=True)
class Layout:
    """The shape of a run: ``ranks`` pipeline ranks N (None: not known yet, the partitioner's
    default decides; the ``stages`` option gives it), each holding ``chunks`` stages (model
    pieces), in ``replicas`` copies, each rank's work split over ``tensor`` processes (tensor
    parallelism)."""

    ranks: Optional[int]
    chunks: int = 1
    replicas: int = 1
    tensor: int = 1

    @property
    def processes(self) -> int:
        """Processes the run needs under torchrun: T per stage of each replica."""
        if self.ranks is None:
            raise ValueError(f"the pipeline's ranks are not known yet: give {option('stages', Shown('N'))} or "
                             f"{option('partition')}")
        return self.ranks * self.replicas * self.tensor


def plan_layout(method: Any, *, stages: Optional[int] = None, partition: Optional[Sequence[int]] = None,
                chunks: Optional[int] = None, processes: Optional[int] = None,
                data_parallel: Optional[int] = None, tensor_parallel: int = 1) -> Layout:
    """The layout of a run of ``method`` (a registry entry).

    ``stages`` (the option's name) counts pipeline ranks N; a ``partition`` lists the layers (or
    traced units) of each of the N x chunks stages, and wins when ``stages`` is None.
    ``processes``: the size of the torchrun job the run must fill (None: not under torchrun; then
    ``data_parallel`` gives the replicas to start, default 1). Without ``stages`` or a partition, a
    torchrun job runs one rank per process of each replica. ``tensor_parallel``: T processes hold
    each rank's stages (WORLD_SIZE = N x D x T). Refuses, with the fix, a layout the processes cannot hold."""
    # refused here, not in pipeoptim.checks: they need the job's size, and the launcher asks first
    t = tensor_parallel
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        raise ValueError(f"{option('tensor_parallel')} must be a positive number of processes per stage, got {t!r}")
    if processes is not None and processes % t:
        raise ValueError(f"WORLD_SIZE {processes} is not a multiple of {option('tensor_parallel', t)}: start N x D x "
                         f"{t} processes (T per stage of each replica) or give another {option('tensor_parallel')}")
    if processes is not None:
        processes //= t
    if data_parallel is not None and (isinstance(data_parallel, bool) or data_parallel < 1):
        raise ValueError(f"{option('data_parallel')} must be at least 1, got {data_parallel}")
    v = chunks_of(method, chunks, partition)
    if method.name == "sequential":
        n: Optional[int] = 1
    elif partition is not None:
        n = len(partition) // method.pieces_per_rank(v)
        if stages is not None and stages != n:
            raise ValueError(f"{option('stages', stages)} but {option('partition', list(partition))} makes {n} "
                             f"stages" + (f" of {v} chunks" if v > 1 else "") + ": drop one of them")
    elif stages is not None:
        n = stages
    elif method.order is not None:  # a user's schedule: its ranks
        n = method.order.num_ranks
    elif processes is not None:
        n = processes // data_parallel if data_parallel else processes
    else:
        n = None
    if n is not None and n < 1:
        raise ValueError(f"{option('stages')} must be at least 1, got {n}")
    if processes is None:
        return Layout(n, v, data_parallel or 1, t)
    if n is None or processes % n:
        per = f" x {t}" if t > 1 else ""
        raise ValueError(f"WORLD_SIZE {processes * t} is not a multiple of the {n} stages{per}: start N x D{per} "
                         f"processes (e.g. torchrun --nproc-per-node {n * max(1, processes // max(n, 1)) * t}), "
                         f"{'T' if t > 1 else 'one'} per stage of each replica")
    replicas = processes // n
    if data_parallel is not None and data_parallel != replicas:
        raise ValueError(f"{option('data_parallel', data_parallel)}, but WORLD_SIZE {processes * t} with {n} stages"
                         f"{f' x {t} tensor ranks' if t > 1 else ''} makes {replicas} replicas; start "
                         f"{n * data_parallel * t} processes or drop {option('data_parallel')}")
    return Layout(n, v, replicas, t)
