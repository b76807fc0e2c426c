"""Our synchronous schedules against PyTorch's own ``torch.distributed.pipelining`` (issue 14,
item 3): same model, data, split and optimizer, 2 processes (gloo, one compute thread each).

* model: the ``blocks`` model of ``pipeoptim bench`` (:func:`pipeoptim.lab.bench_worker.blocks_model`),
  split [4, 5], batch 512, synthetic images, momentum SGD (lr 0.01);
* ours: ``pipeoptim.Pipeline`` under the process group (one stage per process), ``gpipe`` and
  ``1f1b-flush`` at M = 2 and 4, and ``pipeoptim`` (its own M);
* the peer: ``PipelineStage`` with ``ScheduleGPipe`` and ``Schedule1F1B`` at M = 2 and 4, built as
  in ``tests/test_pipelining_peer.py`` (the manual stage API; the loss term of a micro-batch is
  weighted by its share of the mini-batch and ``scale_grads=False``, so both sides compute the
  same gradients), the optimizer stepping after each ``step()``.

Each of our runs is a Pipeline closed when it has been timed (its process groups, whose gloo
threads wake even when idle, would otherwise pile up in both sides' processes round after
round). Every run gets fresh weights, trains ``--warmup`` mini-batches untimed (shape agreement, first
allocations), then is timed on ``--batches`` mini-batches from a barrier to a barrier. The runs
take turns within each round (the order rotates from round to round), and each round also times
a plain one-thread PyTorch loop of the whole model on rank 0 (the other rank waits), so that
every run's throughput is read as a multiple of its own round's plain loop: the host's drift
between rounds cancels. A pair's ratio is taken within each round (ours / torch, the same
round's two runs), and reported as the median over rounds with its spread (min, max and the
interquartile range).

Rank 0 writes ``benchmarks/results/peer_throughput.json`` and prints the table.

    PYTHONPATH=src .venv/bin/python -m benchmarks.peer_throughput [--rounds 5] [--batches 16]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from pipeoptim.lab.bench_worker import quartiles  # the same quartiles as `pipeoptim bench`

RESULTS = Path(__file__).resolve().parent / "results" / "peer_throughput.json"
PARTITION = [4, 5]
BATCH = 512
LR = 0.01
PLAIN = "plain (1 process)"
# (label, side, schedule, micro-batches); side "ours" runs pipeoptim.Pipeline, "torch" the peer
RUNS = [
    ("ours gpipe M=2", "ours", "gpipe", 2),
    ("torch ScheduleGPipe M=2", "torch", "ScheduleGPipe", 2),
    ("ours gpipe M=4", "ours", "gpipe", 4),
    ("torch ScheduleGPipe M=4", "torch", "ScheduleGPipe", 4),
    ("ours 1f1b-flush M=2", "ours", "1f1b-flush", 2),
    ("torch Schedule1F1B M=2", "torch", "Schedule1F1B", 2),
    ("ours 1f1b-flush M=4", "ours", "1f1b-flush", 4),
    ("torch Schedule1F1B M=4", "torch", "Schedule1F1B", 4),
    ("ours pipeoptim", "ours", "pipeoptim", None),
]
#: the schedules with several chunks per process or a split backward (issue 26), at M = 4: the
#: model in 4 pieces (uniform: CHUNK_PARTITION), two per process, placed as each schedule says
#: (interleaved: pieces r and r + 2 on process r; V: pieces r and 3 - r); zb-h1 (one piece per
#: process, PARTITION) against torch's ScheduleInterleavedZeroBubble with one stage per process,
#: the zero-bubble schedule torch runs on that placement
CHUNK_RUNS = [
    ("ours interleaved M=4", "ours", "interleaved", 4),
    ("torch ScheduleInterleaved1F1B M=4", "torch", "ScheduleInterleaved1F1B", 4),
    ("ours zb-v M=4", "ours", "zb-v", 4),
    ("torch ScheduleZBVZeroBubble M=4", "torch", "ScheduleZBVZeroBubble", 4),
    ("ours zb-h1 M=4", "ours", "zb-h1", 4),
    ("torch ScheduleInterleavedZeroBubble (1 stage/process) M=4", "torch", "ScheduleInterleavedZeroBubble", 4),
]
CHUNK_PARTITION = [2, 2, 2, 3]
SETS = {"sync": RUNS, "chunks": CHUNK_RUNS, "all": RUNS + CHUNK_RUNS}  #: --runs
TORCH_RUNS = [label for label, side, _, _ in RUNS if side == "torch"]
CHUNK_PAIRS = [
    ("ours interleaved / torch ScheduleInterleaved1F1B, V=2 M=4", "ours interleaved M=4",
     "torch ScheduleInterleaved1F1B M=4"),
    ("ours zb-v / torch ScheduleZBVZeroBubble, M=4", "ours zb-v M=4", "torch ScheduleZBVZeroBubble M=4"),
    ("ours zb-h1 / torch ScheduleInterleavedZeroBubble (1 stage/process), M=4", "ours zb-h1 M=4",
     "torch ScheduleInterleavedZeroBubble (1 stage/process) M=4"),
]
PAIRS = [  # (ratio name, numerator run, denominator run or the torch runs' best)
    ("ours gpipe / torch ScheduleGPipe, M=2", "ours gpipe M=2", "torch ScheduleGPipe M=2"),
    ("ours gpipe / torch ScheduleGPipe, M=4", "ours gpipe M=4", "torch ScheduleGPipe M=4"),
    ("ours 1f1b-flush / torch Schedule1F1B, M=2", "ours 1f1b-flush M=2", "torch Schedule1F1B M=2"),
    ("ours 1f1b-flush / torch Schedule1F1B, M=4", "ours 1f1b-flush M=4", "torch Schedule1F1B M=4"),
    ("pipeoptim / torch's best synchronous schedule", "ours pipeoptim", "best torch"),
]


# ---- arithmetic (tested in tests/test_peer_throughput.py) -----------------------------------

def spread(values: Sequence[float]) -> Dict[str, Any]:
    """The median of ``values`` with their spread: min, max, quartiles and interquartile range."""
    q1, med, q3 = quartiles(values)
    return {"median": med, "min": min(values), "max": max(values), "q1": q1, "q3": q3,
            "iqr": q3 - q1, "values": list(values)}


def normalise(rounds: List[Dict[str, float]], plain: str = PLAIN) -> List[Dict[str, float]]:
    """Each round's throughputs (samples/s, by run) as multiples of that round's plain loop."""
    return [{k: v / r[plain] for k, v in r.items() if k != plain} for r in rounds]


def best_of(round_: Dict[str, float], names: Sequence[str]) -> float:
    return max(round_[n] for n in names)


def pair_ratios(rounds: List[Dict[str, float]], pairs=PAIRS, torch_runs=TORCH_RUNS) -> Dict[str, Dict[str, Any]]:
    """Per pair, the ratio numerator / denominator within each round (``best torch``: the
    fastest of the torch runs of that round), and its median and spread over the rounds."""
    out = {}
    present = set(rounds[0]) if rounds else set()
    torch_runs = [n for n in torch_runs if n in present]
    for name, num, den in pairs:
        if num not in present or (den not in present and not (den == "best torch" and torch_runs)):
            continue  # a pair of runs this invocation did not time (--runs)
        values = [r[num] / (best_of(r, torch_runs) if den == "best torch" else r[den]) for r in rounds]
        out[name] = spread(values)
    return out


def summarise(samples_per_second: List[Dict[str, float]]) -> Dict[str, Any]:
    """From each round's samples/s by run (the plain loop included): per run the median and
    spread of its normalised throughput and of its samples/s, and the pairs' ratios."""
    norm = normalise(samples_per_second)
    runs = {}
    for name in samples_per_second[0]:
        entry = {"samples_per_second": spread([r[name] for r in samples_per_second])}
        if name != PLAIN:
            entry["x_plain"] = spread([r[name] for r in norm])
        runs[name] = entry
    return {"runs": runs, "ratios": pair_ratios(norm, pairs=PAIRS + CHUNK_PAIRS)}


def format_table(summary: Dict[str, Any]) -> str:
    def row(cells, widths):
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths))

    lines = []
    head = ["ratio (per round)", "median", "min", "max", "IQR"]
    rows = [[name, f"{s['median']:.3f}", f"{s['min']:.3f}", f"{s['max']:.3f}", f"{s['iqr']:.3f}"]
            for name, s in summary["ratios"].items()]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    lines += [row(head, widths), row(["-" * w for w in widths], widths)] + [row(r, widths) for r in rows]
    lines.append("")
    head = ["run", "samples/s (median)", "x plain (median)", "x plain min", "x plain max", "x plain IQR"]
    rows = []
    for name, e in summary["runs"].items():
        x = e.get("x_plain")
        rows.append([name, f"{e['samples_per_second']['median']:.0f}"] +
                    ([f"{x['median']:.3f}", f"{x['min']:.3f}", f"{x['max']:.3f}", f"{x['iqr']:.3f}"]
                     if x else ["1", "-", "-", "-"]))
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    lines += [row(head, widths), row(["-" * w for w in widths], widths)] + [row(r, widths) for r in rows]
    return "\n".join(lines)


# ---- the worker (one per rank, under torch.distributed.run) ----------------------------------

def _worker(args: argparse.Namespace) -> int:

    import torch
    import torch.distributed as dist
    from torch import nn

    from pipeoptim.lab.bench_worker import blocks_model
    from pipeoptim.lab.optimizers import make_optimizer
    from pipeoptim.partition import split
    from pipeoptim.pipeline import Pipeline
    from pipeoptim.runtime.control import init_process_group

    init_process_group(device="cpu", timeout=args.timeout, threads=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "two processes"
    from torch.distributed import pipelining

    loss_fn = nn.functional.cross_entropy
    optimizer = make_optimizer("momentum", LR)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(BATCH, 1, 28, 28, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(args.warmup + args.batches)]
    warm, timed = data[:args.warmup], data[args.warmup:]
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if rank == 0 else (lambda *a: None)

    cpu_log: Dict[str, float] = {}  # the last timed region's CPU seconds, summed over the processes

    def timed_region(fn) -> float:
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        spent = time.process_time() - cpu
        dist.barrier()
        wall = time.perf_counter() - start
        total = torch.tensor([spent], dtype=torch.float64)
        dist.all_reduce(total)
        cpu_log["last"] = float(total)
        return wall

    def plain() -> float:
        """The whole model on rank 0, one thread, a plain loop; rank 1 waits at the barrier."""
        model = blocks_model(2)
        opt = optimizer(model.parameters())

        def loop(chunk):
            for x, y in chunk:
                opt.zero_grad(set_to_none=True)
                loss_fn(model(x), y).backward()
                opt.step()

        if rank == 0:
            loop(warm)
        return timed_region(lambda: loop(timed) if rank == 0 else None)

    def ours(method: str, micro: Optional[int]) -> float:
        pipeline = Pipeline(blocks_model(2), method=method, loss_fn=loss_fn, optimizer=optimizer,
                            stages=2, partition=PARTITION, micro_batches=micro, devices="cpu",
                            timeout=args.timeout, threads=1)
        with pipeline:  # its process groups go after the run (their gloo threads wake even idle)
            if warm:
                pipeline.fit(warm)
            return timed_region(lambda: pipeline.fit(timed))

    def peer(schedule_name: str, micro: int) -> float:
        part = split(blocks_model(2), PARTITION)[rank]
        stage = pipelining.PipelineStage(part, rank, world, torch.device("cpu"))
        schedule = getattr(pipelining, schedule_name)(
            stage, n_microbatches=micro, scale_grads=False,
            loss_fn=lambda output, target: loss_fn(output, target) * (target.shape[0] / BATCH))
        opt = optimizer(part.parameters())

        def loop(chunk):
            for x, y in chunk:
                opt.zero_grad(set_to_none=True)
                if rank == 0:
                    schedule.step(x)
                else:
                    losses: list = []
                    schedule.step(target=y, losses=losses)
                opt.step()

        loop(warm)
        return timed_region(lambda: loop(timed))

    def pieces_of(schedule: str) -> Tuple[List[int], List[int]]:
        """The split and this process's pieces (in chain order) of a schedule."""
        if schedule in ("interleaved", "ScheduleInterleaved1F1B"):
            return CHUNK_PARTITION, [rank, rank + world]
        if schedule in ("zb-v", "ScheduleZBVZeroBubble"):
            return CHUNK_PARTITION, [rank, 2 * world - 1 - rank]
        return PARTITION, [rank]

    def ours_chunked(method: str, micro: int) -> float:
        pipeline = Pipeline(blocks_model(2), method=method, loss_fn=loss_fn, optimizer=optimizer,
                            stages=2, partition=pieces_of(method)[0], micro_batches=micro, devices="cpu",
                            timeout=args.timeout, threads=1)
        with pipeline:
            if warm:
                pipeline.fit(warm)
            return timed_region(lambda: pipeline.fit(timed))

    def peer_chunked(schedule_name: str, micro: int) -> float:
        sizes, mine = pieces_of(schedule_name)
        parts = split(blocks_model(2), sizes)
        stages = [pipelining.PipelineStage(parts[s], s, len(sizes), torch.device("cpu")) for s in mine]
        schedule = getattr(pipelining, schedule_name)(
            stages, n_microbatches=micro, scale_grads=False,
            loss_fn=lambda output, target: loss_fn(output, target) * (target.shape[0] / BATCH))
        opt = optimizer([p for s in mine for p in parts[s].parameters()])
        first, last = 0 in mine, len(sizes) - 1 in mine

        def loop(chunk):
            for x, y in chunk:
                opt.zero_grad(set_to_none=True)
                kwargs = {"target": y, "losses": []} if last else {}
                schedule.step(*((x,) if first else ()), **kwargs)
                opt.step()

        loop(warm)
        return timed_region(lambda: loop(timed))

    def one(label: str, side: str, schedule: str, micro: Optional[int]) -> float:
        if (label, side, schedule, micro) in CHUNK_RUNS:
            return ours_chunked(schedule, micro) if side == "ours" else peer_chunked(schedule, micro)
        return ours(schedule, micro) if side == "ours" else peer(schedule, micro)

    rounds: List[Dict[str, float]] = []
    cpu_rounds: List[Dict[str, float]] = []  # per round and run: CPU ms per mini-batch, all processes
    chosen = SETS[args.runs]
    for r in range(args.rounds):
        shift = r % len(chosen)  # rotate the order so that no run always follows the same one
        order = chosen[shift:] + chosen[:shift]
        seconds = {PLAIN: plain()}
        cpu_round: Dict[str, float] = {}
        for label, side, schedule, micro in order:
            seconds[label] = one(label, side, schedule, micro)
            cpu_round[label] = cpu_log["last"] * 1e3 / args.batches
        sps = {k: BATCH * args.batches / v for k, v in seconds.items()}
        rounds.append(sps)
        cpu_rounds.append(dict(cpu_round))
        say(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v:.0f}" for k, v in sps.items()) + " samples/s")
    dist.barrier()
    if rank == 0:
        summary = summarise(rounds)
        result = {
            "benchmark": "peer_throughput",
            "settings": {"model": "blocks", "partition": PARTITION, "chunk_partition": CHUNK_PARTITION,
                         "runs": args.runs, "batch_size": BATCH,
                         "batches": args.batches, "warmup": args.warmup, "rounds": args.rounds,
                         "optimizer": "momentum", "lr": LR, "processes": world, "threads_per_process": 1,
                         "backend": "gloo", "synthetic": True, "torch": torch.__version__,
                         "cores": os.cpu_count()},
            "rounds_samples_per_second": rounds,
            # CPU time is what the processes computed and spent on the runtime, whatever else ran on
            # the machine (preemption does not inflate it): on a loaded host, the fairer comparison
            "cpu_ms_per_batch": {name: spread([r[name] for r in cpu_rounds]) for name in cpu_rounds[0]},
            "cpu_ratios": {name: spread([r[num] / r[den] for r in cpu_rounds])
                           for name, num, den in PAIRS + CHUNK_PAIRS
                           if num in cpu_rounds[0] and den in cpu_rounds[0]},
            **summary,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default: 5)")
    parser.add_argument("--batches", type=int, default=16, help="timed mini-batches per run (default: 16)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed mini-batches per run first (default: 1)")
    parser.add_argument("--runs", choices=sorted(SETS), default="all",
                        help="sync: gpipe, 1f1b-flush and pipeoptim against ScheduleGPipe and Schedule1F1B; "
                             "chunks: interleaved, zb-v and zb-h1 against ScheduleInterleaved1F1B, "
                             "ScheduleZBVZeroBubble and ScheduleInterleavedZeroBubble; all (default): both")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a process waits for its peer")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results file (default: %(default)s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("rounds", "batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    if args.worker:
        return _worker(args)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="peer-throughput-") as tmp:
        out = Path(tmp) / "result.json"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        src = str(Path(__file__).resolve().parents[1] / "src")
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(Path(__file__).resolve()), "--worker", "--rounds", str(args.rounds),
               "--batches", str(args.batches), "--warmup", str(args.warmup), "--runs", args.runs,
               "--timeout", str(args.timeout), "--out", str(out)]
        start = time.monotonic()
        code = subprocess.call(cmd, env=env)
        if code != 0 or not out.exists():
            print(f"peer_throughput: the workers failed (exit status {code})", file=sys.stderr)
            return 1
        result = json.loads(out.read_text())
    result["load_average"] = {"before": list(load_before), "after": list(os.getloadavg())}
    result["wall_seconds"] = round(time.monotonic() - start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    s = result["settings"]
    print(f"blocks {s['partition']}, batch {s['batch_size']}, {s['batches']} timed mini-batches per run "
          f"(after {s['warmup']} warm-up), {s['rounds']} rounds, momentum SGD, 2 processes (gloo, 1 thread), "
          f"torch {s['torch']}")
    print(format_table(result))
    print("\nCPU ms per mini-batch, all processes (ours / torch, per round; > 1: ours computes more):")
    for name, c in result["cpu_ratios"].items():
        print(f"  {name}: {c['median']:.3f} (min {c['min']:.3f}, max {c['max']:.3f}, IQR {c['iqr']:.3f})")
    la = result["load_average"]
    print("\nratios taken within each round; x plain: samples/s over the same round's plain one-thread loop")
    print(f"load average before {', '.join(f'{x:.2f}' for x in la['before'])}; after "
          f"{', '.join(f'{x:.2f}' for x in la['after'])}; {result['wall_seconds']} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
