"""benchmarks/alternate.py's worker: one per rank under ``torch.distributed.run``, run as a file
(so that only the measured commit's ``pipeoptim`` enters, through ``PYTHONPATH``; no
``benchmarks`` package of the commit's), the same code for every commit. It times the peer
job's runs (:data:`PEER_RUNS` and a plain one-process loop, their order rotated by
``--round``) and writes rank 0's result to ``--out``; with ``--profile-dir`` it profiles
``--profile-method``'s fit instead (alternate.py's docstring says what each measures).
Where the commits keep things in different modules the worker maps them (:data:`COMPAT`)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

BATCH = 512
PARTITION = [4, 5]
LR = 0.01
PLAIN = "plain (1 process)"
#: the peer job's runs: (label, side, schedule, micro-batches, drive); side "ours": the commit's
#: pipeoptim.Pipeline, "torch": torch.distributed.pipelining on the same split; drive "fit" or "step"
PEER_RUNS = [
    ("ours gpipe M=2", "ours", "gpipe", 2, "fit"),
    ("torch ScheduleGPipe M=2", "torch", "ScheduleGPipe", 2, ""),
    ("ours 1f1b-flush M=2", "ours", "1f1b-flush", 2, "fit"),
    ("ours 1f1b-flush M=2 (step)", "ours", "1f1b-flush", 2, "step"),
    ("torch Schedule1F1B M=2", "torch", "Schedule1F1B", 2, ""),
]
#: where each commit keeps what the worker uses: (what, [module candidates, newest first])
COMPAT = {
    "blocks_model": ["pipeoptim.lab.bench_worker", "pipeoptim.bench_worker"],
    "make_optimizer": ["pipeoptim.lab.optimizers", "pipeoptim.optimizers"],
    "init_process_group": ["pipeoptim.runtime.control", "pipeoptim.runtime.distributed"],
    "split": ["pipeoptim.partition"],
    "Pipeline": ["pipeoptim.pipeline"],
}



def _compat() -> Dict[str, Any]:
    """What the worker uses from the commit's pipeoptim, wherever that commit keeps it."""
    import importlib

    found = {}
    for name, modules in COMPAT.items():
        for module in modules:
            try:
                found[name] = getattr(importlib.import_module(module), name)
                break
            except (ImportError, AttributeError):
                continue
        else:
            raise ImportError(f"no {name} in {', '.join(modules)}")
    return found


def _data(count: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, 1, 28, 28, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(count)]


def _build(api: Dict[str, Any], side: str, schedule: str, micro: int, drive: str, rank: int, timeout: float,
           partition: Optional[List[int]] = PARTITION, optimizer_name: str = "momentum"):
    """(train(batches), close()) of one run on this process (``partition=None``: ours split
    uniformly, as a method with several pieces per process needs)."""
    import torch
    from torch import nn

    loss_fn = nn.functional.cross_entropy
    optimizer = api["make_optimizer"](optimizer_name, LR)
    if side == "plain":
        model = api["blocks_model"](2)
        opt = optimizer(model.parameters())

        def plain(batches):
            if rank != 0:
                return
            for x, y in batches:
                opt.zero_grad(set_to_none=True)
                loss_fn(model(x), y).backward()
                opt.step()
        return plain, (lambda: None)
    if side == "ours":
        pipeline = api["Pipeline"](api["blocks_model"](2), method=schedule, loss_fn=loss_fn, optimizer=optimizer,
                                   stages=2, partition=partition, micro_batches=micro, devices="cpu",
                                   timeout=timeout, threads=1)

        def by_step(batches):
            for x, y in batches:
                pipeline.step(x, y, segment_length=len(batches))
            pipeline.flush()
        return (by_step if drive == "step" else (lambda batches: pipeline.fit(list(batches)))), pipeline.close
    from torch.distributed import pipelining

    part = api["split"](api["blocks_model"](2), PARTITION)[rank]
    stage = pipelining.PipelineStage(part, rank, 2, torch.device("cpu"))
    sched = getattr(pipelining, schedule)(
        stage, n_microbatches=micro, scale_grads=False,
        loss_fn=lambda output, target: loss_fn(output, target) * (target.shape[0] / BATCH))
    opt = optimizer(part.parameters())

    def peer(batches):
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            if rank == 0:
                sched.step(x)
            else:
                sched.step(target=y, losses=[])
            opt.step()
    return peer, (lambda: None)


def _pieces(method: str) -> int:
    """Model pieces per process of ``method`` in the commit's pipeoptim (1 where it does not say):
    a method of several is profiled on a uniform split, the peer runs' [4, 5] being one per process."""
    import importlib

    return getattr(importlib.import_module("pipeoptim.methods").get_method(method), "chunks", 1)


def _timed(train, close, warm, timed) -> Dict[str, Any]:
    """Warm up, time from a barrier to a barrier, close: wall seconds, every rank's process and
    main-thread CPU seconds."""
    import resource

    import torch
    import torch.distributed as dist

    def switches() -> List[float]:  # voluntary context switches: the process's, its main thread's
        return [float(resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw),
                float(resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw)]

    try:
        train(warm)
        dist.barrier()
        before = switches()
        start, cpu, thread = time.perf_counter(), time.process_time(), time.thread_time()
        train(timed)
        spent = [time.process_time() - cpu, time.thread_time() - thread] + [b - a for a, b in zip(before, switches())]
        dist.barrier()
        wall = time.perf_counter() - start
    finally:
        close()
    every = [torch.zeros(4, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, torch.tensor(spent, dtype=torch.float64))
    return {"wall": wall, "cpu": [float(t[0]) for t in every], "thread": [float(t[1]) for t in every],
            "switches": [float(t[2]) for t in every], "main_switches": [float(t[3]) for t in every]}


def worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    api = _compat()
    api["init_process_group"](device="cpu", timeout=args.timeout, threads=1)
    rank = dist.get_rank()
    data = _data(args.warmup + args.batches)
    warm, timed = data[:args.warmup], data[args.warmup:]
    try:
        if args.profile_dir:
            return _profile_worker(api, rank, warm, timed, args)
        runs = [(PLAIN, "plain", "", 0, "")] + PEER_RUNS
        shift = args.round % len(runs)
        result = {"batches": args.batches, "batch_size": BATCH, "runs": {}}
        for label, side, schedule, micro, drive in runs[shift:] + runs[:shift]:
            result["runs"][label] = _timed(*_build(api, side, schedule, micro, drive, rank, args.timeout), warm, timed)
        if rank == 0:
            Path(args.out).write_text(json.dumps(result))
        return 0
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _profile_worker(api, rank: int, warm, timed, args: argparse.Namespace) -> int:
    """``--profile-method`` at ``--profile-micro`` micro-batches by fit: CPU per mini-batch
    unprofiled, then a cProfile on the main thread's CPU clock, each on a Pipeline of its own
    (``--fresh``: its first fit, setup included, as ``pipeoptim bench`` times it; else after
    ``warm``); ``<profile-dir>/r<rank>.prof`` and ``r<rank>.json``."""
    import cProfile

    import torch.distributed as dist

    micro = args.profile_micro or None
    info: Dict[str, Any] = {"batches": len(timed)}
    for profiled in (False, True):
        train, close = _build(api, "ours", args.profile_method, micro, "fit", rank, args.timeout,
                              partition=None if _pieces(args.profile_method) > 1 else PARTITION,
                              optimizer_name=args.optimizer)
        try:
            if not args.fresh:
                train(warm)
            dist.barrier()
            profile = cProfile.Profile(time.thread_time) if profiled else None
            cpu, thread = time.process_time(), time.thread_time()
            if profile is not None:
                profile.enable()
            train(timed)
            if profile is not None:
                profile.disable()
            key = "profiled_" if profiled else ""
            info[key + "cpu_ms"] = 1e3 * (time.process_time() - cpu) / len(timed)
            info[key + "thread_ms"] = 1e3 * (time.thread_time() - thread) / len(timed)
        finally:
            close()
    folder = Path(args.profile_dir)
    profile.dump_stats(str(folder / f"r{rank}.prof"))
    (folder / f"r{rank}.json").write_text(json.dumps(info))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round", type=int, default=0, help="the round (rotates the runs' order)")
    parser.add_argument("--batches", type=int, default=16, help="timed mini-batches per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed mini-batches per run first")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a process waits for its peer")
    parser.add_argument("--out", default=None, help="where rank 0 writes the peer job's result (JSON)")
    parser.add_argument("--profile-dir", default=None, help="profile instead; the .prof and .json files go here")
    parser.add_argument("--profile-method", default="1f1b-flush", help="the method profiled")
    parser.add_argument("--profile-micro", type=int, default=2, help="its micro-batches (0: the method's own)")
    parser.add_argument("--fresh", action="store_true", help="profile a new Pipeline's first fit")
    parser.add_argument("--optimizer", default="momentum", help="the profiled fit's optimizer")
    return worker(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
