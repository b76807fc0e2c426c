"""The runs that ``benchmarks/peer_throughput.py``, ``benchmarks/link_threads.py`` and
``benchmarks/profile_stage.py`` time, count or profile, built alike for each of them: the
``blocks`` model of ``pipeoptim bench`` (:func:`pipeoptim.lab.bench_worker.blocks_model`), batch
512, synthetic images, momentum SGD (lr 0.01), 2 processes (gloo, one compute thread each).

* ``plain``: the whole model on rank 0, a one-thread loop (the other rank does nothing);
* ``ours``: ``pipeoptim.Pipeline`` under the process group (a stage, or two chunks, per process);
* ``torch``: ``torch.distributed.pipelining``'s ``PipelineStage`` with one of its schedules,
  built as in ``tests/test_pipelining_peer.py`` (the manual stage API; the loss term of a
  micro-batch is weighted by its share of the mini-batch and ``scale_grads=False``, so both
  sides compute the same gradients), the optimizer stepping after each ``step()``.

A :class:`Run` is built (untimed), trained on warm-up mini-batches (untimed: shape agreement,
first allocations), then on the measured ones, and closed: ours is a Pipeline whose process
groups go with it (their gloo threads would otherwise pile up in the processes run after run).
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

PARTITION = [4, 5]
#: the schedules with two chunks per process: the model in 4 pieces, placed as each schedule
#: says (interleaved: pieces r and r + 2 on process r; V: pieces r and 3 - r)
CHUNK_PARTITION = [2, 2, 2, 3]
BATCH = 512
LR = 0.01

Batches = Sequence[Tuple[Any, Any]]


def make_data(count: int, seed: int = 0) -> List[Tuple[Any, Any]]:
    """``count`` synthetic mini-batches of the blocks model (images and labels), the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 1, 28, 28, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(count)]


def pieces_of(schedule: str, rank: int, world: int) -> Tuple[List[int], List[int]]:
    """The split of a method or torch schedule and this process's pieces of it, in chain order."""
    if schedule in ("interleaved", "ScheduleInterleaved1F1B"):
        return CHUNK_PARTITION, [rank, rank + world]
    if schedule in ("zb-v", "ScheduleZBVZeroBubble"):
        return CHUNK_PARTITION, [rank, 2 * world - 1 - rank]
    return PARTITION, [rank]


class Run:
    """One run on this process: ``train`` runs mini-batches, ``close`` lets its resources go."""

    def __init__(self, train: Callable[[Batches], None], close: Callable[[], None] = lambda: None) -> None:
        self.train = train
        self.close = close


def _loss():
    from torch import nn

    return nn.functional.cross_entropy


def _optimizer():
    from pipeoptim.lab.optimizers import make_optimizer

    return make_optimizer("momentum", LR)


def plain(rank: int) -> Run:
    """The whole model on rank 0, one thread, a plain loop; the other ranks train nothing."""
    from pipeoptim.lab.bench_worker import blocks_model

    model = blocks_model(2)
    opt, loss_fn = _optimizer()(model.parameters()), _loss()

    def train(batches: Batches) -> None:
        if rank != 0:
            return
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()

    return Run(train)


def ours(method: str, micro: Optional[int], timeout: float, rank: int = 0, world: int = 2,
         compile: bool = False, by_step: bool = False) -> Run:
    """``pipeoptim.Pipeline`` with ``method`` at ``micro`` micro-batches (None: the method's own),
    its stages placed as :func:`pieces_of` says (``compile``: each stage's forward through
    torch.compile, inductor). Trained with ``fit``, or with ``by_step``, as torch's loop drives
    its schedule: ``step`` per mini-batch and a ``flush`` at the end (no result: nothing
    gathered, no reports)."""
    from pipeoptim.lab.bench_worker import blocks_model
    from pipeoptim.pipeline import Pipeline

    pipeline = Pipeline(blocks_model(2), method=method, loss_fn=_loss(), optimizer=_optimizer(),
                        stages=world, partition=pieces_of(method, rank, world)[0], micro_batches=micro,
                        devices="cpu", timeout=timeout, threads=1, compile=compile)
    def by_steps(batches: Batches) -> None:
        segment = len(batches)
        for x, y in batches:
            pipeline.step(x, y, segment_length=segment)
        pipeline.flush()

    return Run(by_steps if by_step else (lambda batches: pipeline.fit(list(batches))), pipeline.close)


def torch_schedule(name: str, micro: int, rank: int, world: int, compile: bool = False) -> Run:
    """torch.distributed.pipelining's schedule ``name`` with its stages on this process
    (``compile``: each stage's module through torch.compile, inductor, as torchtitan compiles
    its blocks; dynamo's caches are reset first, so that runs built round after round never
    reach its recompilation limit and fall back to eager)."""
    import torch
    from torch.distributed import pipelining

    from pipeoptim.lab.bench_worker import blocks_model
    from pipeoptim.partition import split

    sizes, mine = pieces_of(name, rank, world)
    parts = split(blocks_model(2), sizes)
    modules = dict(enumerate(parts))
    if compile:
        torch._dynamo.reset()
        modules = {s: torch.compile(parts[s]) for s in mine}
    stages = [pipelining.PipelineStage(modules[s], s, len(sizes), torch.device("cpu")) for s in mine]
    loss_fn = _loss()
    kind = getattr(pipelining, name)
    multi = issubclass(kind, pipelining.schedules.PipelineScheduleMulti)  # takes a list of stages
    schedule = kind(
        stages if multi else stages[0], n_microbatches=micro, scale_grads=False,
        loss_fn=lambda output, target: loss_fn(output, target) * (target.shape[0] / BATCH))
    opt = _optimizer()([p for s in mine for p in parts[s].parameters()])
    first, last = 0 in mine, len(sizes) - 1 in mine

    def train(batches: Batches) -> None:
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            kwargs = {"target": y, "losses": []} if last else {}
            schedule.step(*((x,) if first else ()), **kwargs)
            opt.step()

    return Run(train)


def build(side: str, schedule: str, micro: Optional[int], rank: int, world: int, timeout: float) -> Run:
    """The run of ``side`` ("plain", "ours" or "torch"; "+compile": their stages compiled;
    "ours+step": ours driven by ``step`` and ``flush`` instead of ``fit``) with ``schedule`` (a
    method or a torch schedule's class name) at ``micro`` micro-batches."""
    side, *extras = side.split("+")
    compile = "compile" in extras
    if side == "plain":
        return plain(rank)
    if side == "ours":
        return ours(schedule, micro, timeout, rank, world, compile, by_step="step" in extras)
    if side == "torch":
        return torch_schedule(schedule, micro, rank, world, compile)
    raise ValueError(f"side must be plain, ours or torch, got {side!r}")


def launch(module: str, worker_args: Sequence[str]) -> int:
    """Run ``python -m module --worker ARGS`` in 2 processes under ``torch.distributed.run``
    (one compute thread each), from the repository root; its exit status."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    path = os.pathsep.join([str(root / "src"), str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONPATH"] = path
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", module, "--worker", *worker_args]
    return subprocess.call(cmd, env=env, cwd=root)
