"""What `pipeoptim bench` runs inside its worker processes (one per stage, started by
:func:`pipeoptim.lab.launcher.run_workers`): the ``blocks`` model, the data, and every method timed in
turn through :class:`pipeoptim.Pipeline` (one pipeline rank per process, as a user's script under
torchrun) beside the single-process ``sequential`` baselines (a Pipeline of rank 0's own,
``LocalWorld``); rank 0 writes the results file that the command (:mod:`pipeoptim.cli.bench`)
reads and prints.

The default model, ``blocks``, gives every stage the same work (:mod:`pipeoptim.cli.bench` says
how).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence

BLOCK_WIDTH = 512
RECOMPUTE_SUFFIX = "+recompute"  #: appended to a run's name when it recomputes its activations
#: appended to a run's name (before RECOMPUTE_SUFFIX) when each stage is sharded over its replicas
SHARDED_SUFFIX = " sharded"
#: appended to a run's name (after SHARDED_SUFFIX) when each stage's forward is compiled
COMPILED_SUFFIX = " compiled"
#: appended to a run's name (after the replicas') when each stage is split over T processes
TENSOR_SUFFIX = " tp{}"
BLOCKS_PER_STAGE = 4


def blocks_model(stages: int, seed: int = 0, width: int = BLOCK_WIDTH, per_stage: int = BLOCKS_PER_STAGE):
    """Fully connected blocks on the flattened 28x28 image, ``per_stage`` per stage, and a
    linear head of 10 classes (see :mod:`pipeoptim.cli.bench` for why the stages are balanced).
    Its tensor-parallel plan (``_tp_plan``): each pair of blocks column-wise then row-wise (one
    all-reduce per pair and pass; an even ``per_stage`` keeps every pair on one stage), the head
    whole."""
    from torch import nn

    from .tasks.common import seeded

    with seeded(seed):
        blocks = [nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, width), nn.ReLU())]
        blocks += [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(per_stage * stages - 1)]
        blocks.append(nn.Linear(width, 10))
        model = nn.Sequential(*blocks)
    pairs = per_stage * stages // 2 * 2
    model._tp_plan = {("0.1" if i == 0 else f"{i}.0"): ("colwise" if i % 2 == 0 else "rowwise") for i in range(pairs)}
    return model


def quartiles(values: Sequence[float]) -> List[float]:
    """First quartile, median and third quartile of ``values`` (numpy's ``percentile``: linear
    interpolation between order statistics); one value gives it three times."""
    if not values:
        raise ValueError("quartiles of no values")
    import numpy as np

    return [float(q) for q in np.percentile(values, [25, 50, 75])]


def iqr(values: Sequence[float]) -> float:
    """The interquartile range of ``values`` (0 for one value)."""
    q1, _, q3 = quartiles(values)
    return q3 - q1


def bench_data(spec: Dict[str, Any], count: int):
    """(the task, the batch size, ``count`` mini-batches, the task's data or a stand-in) of a bench."""
    import torch

    from .tasks import get_task

    task = get_task(spec["task"])
    batch = spec["batch_size"] or task.default_batch_size
    if spec["synthetic"] and task.name == "lm":  # random token ids of the task's vocabulary and block
        from .tasks.base import TaskData

        g, shape, vocab = torch.Generator().manual_seed(0), (batch, task.seq_len), task.vocab_size
        batches = [(torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g))
                   for _ in range(count)]
        return task, batch, batches, TaskData(train=batches, test=[], info={"vocab_size": vocab,
                                                                            "seq_len": task.seq_len})
    if spec["synthetic"]:
        g = torch.Generator().manual_seed(0)
        batches = [(torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g))
                   for _ in range(count)]
        return task, batch, batches, None
    data = task.load(batch_size=batch, limit=batch * count, seed=0)
    batches = list(data.train)
    while len(batches) < count:  # fewer examples than asked: cycle
        batches += data.train[: count - len(batches)]
    return task, batch, batches[:count], data


class PipelineRun:
    """One timed run through pipeoptim.Pipeline: its throughput, wall time, the CPU share of
    each process, and the Pipeline's result."""

    def __init__(self, samples_per_second: float, seconds: float, cpu_share: List[float], result: Any,
                 microbatches: int, predicted: Any = None) -> None:
        self.samples_per_second, self.seconds, self.cpu_share = samples_per_second, seconds, cpu_share
        self.result, self.microbatches = result, microbatches
        #: per model stage, the predicted activations (:func:`pipeoptim.throughput.predicted_activations`)
        self.predicted = predicted


def activations(measured: List[Dict[str, int]], predicted: Any) -> List[Dict[str, Any]]:
    """Per model stage: the peak bytes of activations held, measured (``runtime/held.py``) and
    predicted (the simulator's micro-batches in flight x the profiled bytes per micro-batch), the
    in-flight counts of both and the measured bytes of the largest micro-batch."""
    out = []
    for k, m in enumerate(measured):
        row = {"measured_bytes": m["peak_bytes"], "measured_in_flight": m["peak_microbatches"],
               "measured_bytes_per_microbatch": m["microbatch_bytes"]}
        if predicted is not None:
            p = predicted[k]
            row.update(predicted_bytes=p["bytes"], predicted_in_flight=p["in_flight_microbatches"],
                       predicted_bytes_per_microbatch=p["bytes_per_microbatch"])
        out.append(row)
    return out


def bubble(metrics: Dict[str, Any], seconds: float, batches: int) -> Dict[str, float]:
    """The run's bubble, measured and simulated: ``measured`` is 1 - the stages' busy seconds
    (forwards, backwards, updates) over the pipeline's ranks x the wall time of its ``batches``
    mini-batches; ``simulated`` the schedule simulator's bubble of the method's schedule for
    those mini-batches, priced with each stage's measured seconds per micro-batch (a split
    backward's W at half the backward, as the planner prices it). The wall time also holds the
    waits on messages and a mirrored method's replica sums, which the simulator does not charge."""
    from ..methods import get_method
    from ..schedules import Costs, simulate

    busy, passes = metrics["stage_busy_seconds"], metrics["stage_passes"]
    ranks = 1 if metrics["method"] == "sequential" else metrics["stages"] // metrics["chunks"]
    measured = 1.0 - sum(sum(b.values()) for b in busy) / (ranks * seconds) if seconds > 0 else 0.0
    forward = [b["F"] / max(1, p["F"]) for b, p in zip(busy, passes)]
    backward = [b["B"] / max(1, p["F"]) for b, p in zip(busy, passes)]  # both halves of one micro-batch
    update = max(b["U"] / max(1, p["U"]) for b, p in zip(busy, passes))
    method = get_method(metrics["method"])
    schedule = method.build_schedule(ranks, metrics["microbatches"], batches,
                                     options=metrics.get("options"), chunks=metrics["chunks"])
    simulated = simulate(schedule, Costs(forward, backward, [b / 2 for b in backward], update=update))
    return {"measured": measured, "simulated": simulated.bubble_fraction}


def process_bytes(metrics: Dict[str, Any]) -> Dict[str, List[int]]:
    """Per pipeline rank, the bytes its stages hold: ``weights`` (every copy, both replicas of a
    mirrored method's piece) and ``activations`` (the sum of its stages' measured peaks: an upper
    bound of the peak of their sum)."""
    from ..methods import get_method

    ranks = 1 if metrics["method"] == "sequential" else metrics["stages"] // metrics["chunks"]
    method = get_method(metrics["method"])
    placement = method.stage_ranks(ranks, metrics["chunks"]) if metrics["chunks"] > 1 else list(range(ranks))
    out = {"weights": [0] * ranks, "activations": [0] * ranks}
    for rank, state, held in zip(placement, metrics["state_memory"], metrics["activations"]):
        out["weights"][rank] += state["weights"]
        out["activations"][rank] += held["peak_bytes"]
    return out


def summary(rounds: List[PipelineRun], threads: int, timed: int, processes: int, replicas: int) -> Dict[str, Any]:
    """The median round's figures (and every round's throughput, and its interquartile range):
    per stage, ms per pass (``stage_ms``) and per mini-batch computing, waiting on each link and
    the bytes it carried (``profile_ms_per_batch``), the peak of activations held, measured and
    predicted (``activations``, per model stage), the training state's bytes (``state_memory``);
    each round's CPU share per process."""
    sps = [r.samples_per_second for r in rounds]
    res = sorted(rounds, key=lambda r: r.samples_per_second)[(len(rounds) - 1) // 2]
    metrics, m = res.result.metrics, res.microbatches
    profile = []  # per stage, ms per mini-batch: computing, and blocked on a peer
    for st, links in zip(metrics["stage_seconds"], metrics["comm"]):
        profile.append({
            "compute": round(1e3 * (m * (st["F"] + st["B"]) + st["U"]), 3),
            "waiting": {k: round(1e3 * v["wait_seconds"] / timed, 3) for k, v in links.items()},
            "bytes_per_batch": {k: v["bytes"] // timed for k, v in links.items()},
        })
    return {"samples_per_second": statistics.median(sps), "iqr_samples_per_second": iqr(sps),
            "rounds_samples_per_second": sps, "threads": threads, "cpu_share": [r.cpu_share for r in rounds],
            "microbatches": m, "partition": metrics["partition"], "processes": processes, "replicas": replicas,
            "stage_ms": [{k: round(v * 1e3, 3) for k, v in st.items()} for st in metrics["stage_seconds"]],
            "ms_per_batch": round(1e3 * res.seconds / timed, 3), "profile_ms_per_batch": profile,
            "activations": activations(metrics["activations"], res.predicted),
            "state_memory": metrics["state_memory"], "bubble": bubble(metrics, res.seconds, timed),
            "process_bytes": process_bytes(metrics),
            "final_loss": res.result.losses[-1]}


def bench_worker(spec: Dict[str, Any]) -> int:
    """One process of `pipeoptim bench`: time each method; rank 0 writes the results file."""
    import time

    import torch
    import torch.distributed as dist

    from ..methods import get_method
    from .optimizers import make_optimizer
    from ..partition import plan_partition
    from ..pipeline import Pipeline
    from ..throughput import predicted_activations
    from ..profile import profile_model
    from ..runtime.control import init_process_group
    from ..world import LocalWorld

    init_process_group(device="cpu", timeout=spec["timeout"], threads=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    replicas, tensor = spec.get("data_parallel", 1), spec.get("tensor_parallel", 1)
    stages = world // (replicas * tensor)  # the pipeline's stages; world = stages x replicas x tensor ranks
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if rank == 0 and spec["verbose"] else (lambda *a: None)
    try:
        warm, timed = spec["warmup"], spec["batches"]
        task, batch, batches, data = bench_data(spec, warm + timed)
        if spec["model"] == "blocks":
            model = blocks_model(stages)
            partition = [BLOCKS_PER_STAGE] * (stages - 1) + [BLOCKS_PER_STAGE + 1]  # the head: last
        else:
            if spec["model"] not in task.model_names():
                raise ValueError(f"task {task.name} has no model {spec['model']!r}; choose blocks or one "
                                 f"of: {', '.join(task.model_names())}")
            model = task.build_model(spec["model"], data, seed=0)
            partition = plan_partition(model, stages, spec["partitioner"])
        from .experiment import check_tensor_split

        check_tensor_split(model, tensor, f"{task.name}'s model {spec['model']}")
        optimizer = make_optimizer(spec["optimizer"], spec["lr"])
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

        def run_baseline(threads: int, chunk: List[Any]) -> PipelineRun:
            """``sequential`` in this process alone (a world of its own), on ``threads`` threads."""
            torch.set_num_threads(threads)
            try:
                pipeline = Pipeline(model, method="sequential", loss_fn=task.loss, optimizer=optimizer,
                                    devices="cpu", world=LocalWorld())
                start, cpu = time.perf_counter(), time.process_time()
                result = pipeline.fit(chunk)
                wall = time.perf_counter() - start
                return PipelineRun(batch * len(chunk) / wall, wall, [round((time.process_time() - cpu) / wall, 3)],
                                   result, pipeline.microbatches)
            finally:
                torch.set_num_threads(1)

        predictions: Dict[Any, Any] = {}  # the predicted activations per run's shape (run_pipeline)

        def run_pipeline(method: str, chunk: List[Any], recompute: bool = False, sharded: bool = False,
                         compiled: bool = False) -> PipelineRun:
            """One run through pipeoptim.Pipeline on all processes: stages x replicas, each
            replica on its shard of every mini-batch (``sharded``: each stage's state too, FSDP2;
            ``compiled``: each stage's forward through torch.compile, compiled on one untimed
            mini-batch first); timed from a barrier to the last process's end."""
            # interleaved, zb-v: the model in stages x chunks pieces; bidirectional, bitpipe: in
            # stages x their pieces per process (each also holding replicas of others')
            meth = get_method(method)
            pieces = meth.pieces_per_rank(meth.chunks)
            sizes = ([len(model)] if method == "sequential" else partition if meth.chunks == 1 else
                     plan_partition(model, stages * pieces, "uniform"))
            pipeline = Pipeline(model, method=method, loss_fn=task.loss, optimizer=optimizer,
                                stages=None if method == "sequential" else stages,
                                partition=None if method == "sequential" else sizes,
                                micro_batches=spec["micro_batches"] if method != "sequential" else None,
                                data_parallel=replicas, timeout=spec["timeout"], threads=1, recompute=recompute,
                                shard_replicas=sharded, tensor_parallel=tensor,
                                compile=spec["compile"] if compiled else False)
            try:
                d = pipeline.data_parallel_rank
                shard = [(x.chunk(replicas)[d], y.chunk(replicas)[d]) for x, y in chunk]
                if compiled:  # the compilation (a fresh Pipeline's stages trace again) is not timed
                    pipeline.fit(shard[:1])
                dist.barrier()
                start, cpu = time.perf_counter(), time.process_time()
                result = pipeline.fit(shard)
                dist.barrier()
                wall = time.perf_counter() - start
                share = [None] * world
                dist.all_gather_object(share, round((time.process_time() - cpu) / wall, 3))
                m = pipeline.microbatches
                rows = -(-shard[0][0].shape[0] // m)  # the largest micro-batch
                key = (method, m, rows, len(chunk), recompute)
                if key not in predictions:  # the same every round: profiled once, not after every run
                    profile = profile_model(model, shard[0][0][:rows], warmup=0, repeats=1)
                    predictions[key] = predicted_activations(profile, sizes, method,
                                                             1 if method == "sequential" else stages,
                                                             m, batches=len(chunk), recompute=recompute)
                predicted = predictions[key]
                return PipelineRun(batch * len(chunk) / wall, wall, share, result, m, predicted)
            finally:
                pipeline.close()  # its process groups, before the next run makes its own

        # Warm up every run once, then time the runs round-robin (--repeats rounds), so that a
        # burst of other work on the machine hits all of them alike rather than one.
        baselines = [("sequential-1dev", 1), ("sequential-all", cores)] if spec["baselines"] else []
        label = lambda m: (m + (f" x{replicas}" if replicas > 1 else "")  # noqa: E731
                           + (TENSOR_SUFFIX.format(tensor) if tensor > 1 else ""))
        # each setting on or off as its flag says, or both where --ablate names it
        modes = {key: [False, True] if key in spec["ablate"] else [bool(spec[key])]
                 for key in ("recompute", "shard_replicas", "compile")}
        variants = [(m, r, s, c) for m in spec["methods"] for s in modes["shard_replicas"]
                    for r in modes["recompute"] for c in modes["compile"]]  # (method, recompute, sharded, compiled)

        def name_of(method: str, recompute: bool, sharded: bool, compiled: bool) -> str:
            return (label(method) + (SHARDED_SUFFIX if sharded else "") + (COMPILED_SUFFIX if compiled else "")
                    + (RECOMPUTE_SUFFIX if recompute else ""))
        runs = [(name, threads) for name, threads in baselines] + [(name_of(*v), 1) for v in variants]
        rounds: Dict[str, List[PipelineRun]] = {name: [] for name, _ in runs}

        def record(r: int, name: str, res: PipelineRun) -> None:
            if r >= 0:
                rounds[name].append(res)
                say(f"  round {r + 1}: {name:>24}: {res.samples_per_second:.0f} samples/s")

        for r in range(-1 if warm else 0, spec["repeats"]):  # round -1: the warm-up
            chunk = batches[:warm] if r < 0 else batches[warm:]
            if baselines:  # one process; the others wait at the barrier
                if rank == 0:
                    for name, threads in baselines:
                        record(r, name, run_baseline(threads, chunk))
                dist.barrier()
            # the order rotates round by round (alike on every rank): no run always follows the same one
            shift = max(r, 0) % len(variants) if variants else 0
            for variant in variants[shift:] + variants[:shift]:
                record(r, name_of(*variant), run_pipeline(variant[0], chunk, *variant[1:]))
        detail = {name: summary(rounds[name], threads, timed, 1 if name in dict(baselines) else world,
                                1 if name in dict(baselines) else replicas)
                  for name, threads in runs if rounds[name]}
        if rank == 0:
            result = {
                "benchmark": "distributed_throughput",
                "samples_per_second": {k: v["samples_per_second"] for k, v in detail.items()},
                "settings": {"task": spec["task"], "model": spec["model"], "stages": stages,
                             "data_parallel": replicas, "tensor_parallel": tensor, "processes": world,
                             "partition": partition, "batch_size": batch, "batches": timed,
                             "warmup": warm, "repeats": spec["repeats"], "optimizer": spec["optimizer"],
                             "lr": spec["lr"], "micro_batches": spec["micro_batches"],
                             "recompute": spec["recompute"], "shard_replicas": spec["shard_replicas"],
                             "compile": spec["compile"], "ablate": spec["ablate"],
                             "synthetic": spec["synthetic"], "threads_per_stage": 1, "cores": cores,
                             "parameters": sum(p.numel() for p in model.parameters()),
                             "backend": "gloo", "torch": torch.__version__},
                "detail": detail,
            }
            Path(spec["result"]).write_text(json.dumps(result))
        dist.barrier()
        return 0
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
