"""Our synchronous schedules against PyTorch's own ``torch.distributed.pipelining`` (issue 14,
item 3; issue 37, item 0): same model, data, split and optimizer, 2 processes (gloo, one compute
thread each), the runs of :mod:`benchmarks.peer_runs` (the ``blocks`` model, split [4, 5], batch
512, momentum SGD; ours ``gpipe``, ``1f1b-flush`` and ``pipeoptim``, torch's ``ScheduleGPipe`` and
``Schedule1F1B``; with ``--runs chunks`` the schedules of two chunks per process; with ``--runs
1f1b-compiled`` our 1F1B-flush and torch's Schedule1F1B at M = 2, eager and with both sides'
stages through torch.compile; with ``--runs 1f1b-step`` ours also driven by ``step`` and ``flush``
as torch's loop drives its schedule, without ``fit``'s gathering of the trained model at its end).

Every run gets fresh weights, trains ``--warmup`` mini-batches untimed, then is timed on
``--batches`` mini-batches from a barrier to a barrier: wall time, and each process's CPU time
(``time.process_time``: what it computed and spent in the runtimes, however loaded the host).
Both sides' runs take turns within each round, in one job of two processes (the order rotates
from round to round, so that no run always follows the same one), and each round also times a
plain one-thread PyTorch loop of the whole model on rank 0 (the other rank waits), so that every
run's throughput is read as a multiple of its own round's plain loop: the host's drift between
rounds cancels. A pair's ratio is taken within each round (ours / torch, the same round's two
runs), and reported as the median over rounds with its spread: min, max, the interquartile
range, and the *spread of the median*, the half-width of its distribution-free 95 % confidence
interval over the median (:func:`median_spread`). ``--until-spread 0.02`` keeps adding rounds
until every pair's spread of the median is under 2 % (or ``--max-rounds`` is reached).

Rank 0 writes ``benchmarks/results/peer_throughput.json`` and prints the table.

    .venv/bin/python -m benchmarks.peer_throughput [--rounds 5] [--batches 16] [--runs 1f1b]
    .venv/bin/python -m benchmarks.peer_throughput --runs 1f1b --until-spread 0.02 --max-rounds 60
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from benchmarks.peer_runs import BATCH, CHUNK_PARTITION, LR, PARTITION, build, launch, make_data
from pipeoptim.lab.bench_worker import quartiles  # the same quartiles as `pipeoptim bench`

RESULTS = Path(__file__).resolve().parent / "results" / "peer_throughput.json"
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
#: our 1F1B with a flush and torch's Schedule1F1B alone (issue 37's comparison; short rounds)
ONE_F_ONE_B = [run for run in RUNS if run[2] in ("1f1b-flush", "Schedule1F1B")]
#: the same two with both sides' stages compiled (torch.compile, inductor), beside the eager pair
COMPILED_RUNS = [("ours 1f1b-flush M=2 compiled", "ours+compile", "1f1b-flush", 2),
                 ("torch Schedule1F1B M=2 compiled", "torch+compile", "Schedule1F1B", 2)]
#: ours driven as torch's loop drives its schedule: step per mini-batch, a flush at the end
BY_STEP = ("ours 1f1b-flush M=2 (step)", "ours+step", "1f1b-flush", 2)
SETS = {"sync": RUNS, "chunks": CHUNK_RUNS, "all": RUNS + CHUNK_RUNS, "1f1b": ONE_F_ONE_B,
        "1f1b-compiled": [r for r in ONE_F_ONE_B if r[3] == 2] + COMPILED_RUNS,
        "1f1b-step": [r for r in ONE_F_ONE_B if r[3] == 2] + [BY_STEP]}  #: --runs
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
COMPILED_PAIRS = [  # --runs 1f1b-compiled and 1f1b-step
    ("ours 1f1b-flush by step / torch Schedule1F1B, M=2", "ours 1f1b-flush M=2 (step)", "torch Schedule1F1B M=2"),
    ("ours 1f1b-flush by step / by fit, M=2", "ours 1f1b-flush M=2 (step)", "ours 1f1b-flush M=2"),
    ("ours 1f1b-flush / torch Schedule1F1B, M=2, both compiled", "ours 1f1b-flush M=2 compiled",
     "torch Schedule1F1B M=2 compiled"),
    ("ours 1f1b-flush compiled / eager, M=2", "ours 1f1b-flush M=2 compiled", "ours 1f1b-flush M=2"),
    ("torch Schedule1F1B compiled / eager, M=2", "torch Schedule1F1B M=2 compiled", "torch Schedule1F1B M=2"),
]


# ---- arithmetic (tested in tests/test_peer_throughput.py) -----------------------------------

def median_interval(values: Sequence[float], level: float = 0.95) -> Optional[List[float]]:
    """The distribution-free confidence interval of the median of ``values`` at ``level``:
    order statistics x_(k) and x_(n+1-k) with the largest k whose coverage, 1 - 2 P(B < k) for
    B ~ Binomial(n, 1/2), is at least ``level`` (no assumption on the rounds' distribution);
    None where even the extremes do not cover that much (n < 6 at 95 %)."""
    n, ordered = len(values), sorted(values)
    below, found = 0.0, None  # below: P(B < k)
    for k in range(1, n // 2 + 1):
        below += math.comb(n, k - 1) / 2 ** n
        if 1 - 2 * below < level:
            break
        found = [ordered[k - 1], ordered[n - k]]
    return found


def median_spread(values: Sequence[float], level: float = 0.95) -> float:
    """The spread of the median of ``values``: half the width of its confidence interval
    (:func:`median_interval`) over the median; infinite while there are too few values. Unlike
    the interquartile range (the rounds' own scatter), it shrinks as rounds are added."""
    interval = median_interval(values, level)
    if interval is None:
        return math.inf
    return (interval[1] - interval[0]) / 2 / abs(quartiles(values)[1])


def spread(values: Sequence[float]) -> Dict[str, Any]:
    """The median of ``values`` with their spread: min, max, quartiles, interquartile range, and
    the spread of the median (:func:`median_spread`, None while undefined)."""
    q1, med, q3 = quartiles(values)
    of_median = median_spread(values)
    return {"median": med, "min": min(values), "max": max(values), "q1": q1, "q3": q3,
            "iqr": q3 - q1, "median_spread": of_median if math.isfinite(of_median) else None,
            "values": list(values)}


def converged(ratios: Dict[str, Dict[str, Any]], target: float) -> bool:
    """Whether every pair's spread of the median (``pair_ratios``' entries) is under ``target``."""
    return bool(ratios) and all(r["median_spread"] is not None and r["median_spread"] < target
                                for r in ratios.values())


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
    return {"runs": runs, "ratios": pair_ratios(norm, pairs=PAIRS + CHUNK_PAIRS + COMPILED_PAIRS)}


def format_table(summary: Dict[str, Any]) -> str:
    def row(cells, widths):
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths))

    lines = []
    head = ["ratio (per round)", "median", "min", "max", "IQR", "spread of median"]
    rows = [[name, f"{s['median']:.3f}", f"{s['min']:.3f}", f"{s['max']:.3f}", f"{s['iqr']:.3f}",
             "-" if s.get("median_spread") is None else f"{100 * s['median_spread']:.1f} %"]
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

def _timed(run, warm, timed) -> Dict[str, Any]:
    """Warm ``run`` up, time it on ``timed`` from a barrier to a barrier, close it: its wall
    seconds and every process's CPU seconds (rank order)."""
    import torch
    import torch.distributed as dist

    try:
        run.train(warm)
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        run.train(timed)
        spent = time.process_time() - cpu
        dist.barrier()
        wall = time.perf_counter() - start
    finally:
        run.close()
    every = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, torch.tensor([spent], dtype=torch.float64))
    return {"wall": wall, "cpu": [float(t) for t in every]}


def _round(chosen, r: int, rank: int, data, args: argparse.Namespace) -> Dict[str, Dict[str, Any]]:
    """One round: the plain loop, then every run of ``chosen`` in an order rotated by ``r``."""
    warm, timed = data[:args.warmup], data[args.warmup:]
    shift = r % len(chosen)  # rotate the order so that no run always follows the same one
    out = {PLAIN: _timed(build("plain", "", None, rank, 2, args.timeout), warm, timed)}
    for label, side, schedule, micro in chosen[shift:] + chosen[:shift]:
        out[label] = _timed(build(side, schedule, micro, rank, 2, args.timeout), warm, timed)
    return out


def _cpu_summary(cpu_rounds: List[Dict[str, List[float]]], walls: List[Dict[str, float]]) -> Dict[str, Any]:
    """CPU ms per mini-batch per run: all processes together and per rank, the pairs' ratios of
    the totals, and the cores busy (CPU over wall time)."""
    names = list(cpu_rounds[0])
    total = [{n: sum(r[n]) for n in names} for r in cpu_rounds]
    return {
        # what the processes computed and spent in the runtimes, whatever else ran on the host
        # (preemption does not inflate it): on a loaded host, the fairer comparison
        "cpu_ms_per_batch": {n: spread([r[n] for r in total]) for n in names},
        "cpu_ms_per_batch_by_rank": {n: [spread([r[n][k] for r in cpu_rounds]) for k in range(len(cpu_rounds[0][n]))]
                                     for n in names},
        "cpu_ratios": {name: spread([r[num] / r[den] for r in total]) for name, num, den in PAIRS + CHUNK_PAIRS + COMPILED_PAIRS
                       if num in names and den in names},
        "cores_busy": {n: spread([t[n] / w[n] for t, w in zip(total, walls)]) for n in names},
    }


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from pipeoptim.runtime.control import init_process_group

    init_process_group(device="cpu", timeout=args.timeout, threads=1)
    rank = dist.get_rank()
    assert dist.get_world_size() == 2, "two processes"
    data = make_data(args.warmup + args.batches)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if rank == 0 else (lambda *a: None)
    chosen = SETS[args.runs]
    rounds: List[Dict[str, float]] = []
    cpu_rounds: List[Dict[str, List[float]]] = []  # per round and run: CPU ms per mini-batch, per rank
    walls: List[Dict[str, float]] = []             # per round and run: wall ms per mini-batch
    limit = args.rounds if args.until_spread is None else args.max_rounds
    done = False
    while not done:
        measured = _round(chosen, len(rounds), rank, data, args)
        rounds.append({k: BATCH * args.batches / v["wall"] for k, v in measured.items()})
        cpu_rounds.append({k: [c * 1e3 / args.batches for c in v["cpu"]] for k, v in measured.items() if k != PLAIN})
        walls.append({k: v["wall"] * 1e3 / args.batches for k, v in measured.items() if k != PLAIN})
        ratios = pair_ratios(normalise(rounds), pairs=PAIRS + CHUNK_PAIRS + COMPILED_PAIRS)
        spreads = ", ".join(f"{r['median']:.3f} +- {100 * r['median_spread']:.1f} %" if r["median_spread"] else
                            f"{r['median']:.3f}" for r in ratios.values())
        say(f"round {len(rounds)}: " + ", ".join(f"{k} {v:.0f}" for k, v in rounds[-1].items())
            + f" samples/s; ratios {spreads}")
        done = len(rounds) >= limit or (args.until_spread is not None and len(rounds) >= args.rounds
                                        and converged(ratios, args.until_spread))
        box = [done]
        dist.broadcast_object_list(box, src=0)  # rank 0's timings decide, for both
        done = box[0]
    if rank == 0:
        summary = summarise(rounds)
        result = {
            "benchmark": "peer_throughput",
            "settings": {"model": "blocks", "partition": PARTITION, "chunk_partition": CHUNK_PARTITION,
                         "runs": args.runs, "batch_size": BATCH,
                         "batches": args.batches, "warmup": args.warmup, "rounds": len(rounds),
                         "until_spread": args.until_spread,
                         "converged": args.until_spread is not None and converged(summary["ratios"], args.until_spread),
                         "optimizer": "momentum", "lr": LR, "processes": 2, "threads_per_process": 1,
                         "backend": "gloo", "synthetic": True, "torch": torch.__version__,
                         "cores": os.cpu_count()},
            "rounds_samples_per_second": rounds,
            "rounds_cpu_ms_per_batch": cpu_rounds,
            **_cpu_summary(cpu_rounds, walls),
            **summary,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()
    return 0


def _print_result(result: Dict[str, Any], out: Path) -> None:
    s = result["settings"]
    print(f"blocks {s['partition']}, batch {s['batch_size']}, {s['batches']} timed mini-batches per run "
          f"(after {s['warmup']} warm-up), {s['rounds']} rounds, momentum SGD, 2 processes (gloo, 1 thread), "
          f"torch {s['torch']}")
    if s["until_spread"] is not None:
        print(f"spread of every median under {100 * s['until_spread']:g} %: "
              f"{'yes' if s['converged'] else 'no (the most rounds were reached)'}")
    print(format_table(result))
    print("\nCPU ms per mini-batch, all processes (ours / torch, per round; > 1: ours computes more):")
    for name, c in result["cpu_ratios"].items():
        print(f"  {name}: {c['median']:.3f} (min {c['min']:.3f}, max {c['max']:.3f}, IQR {c['iqr']:.3f})")
    print("\nCPU ms per mini-batch by rank, and cores busy (CPU over wall time), medians:")
    for name, ranks in result["cpu_ms_per_batch_by_rank"].items():
        print(f"  {name}: " + ", ".join(f"rank {k} {r['median']:.1f}" for k, r in enumerate(ranks))
              + f"; {result['cores_busy'][name]['median']:.2f} cores")
    la = result["load_average"]
    print("\nratios taken within each round; x plain: samples/s over the same round's plain one-thread loop; "
          "spread of median: half its 95 % confidence interval over it")
    print(f"load average before {', '.join(f'{x:.2f}' for x in la['before'])}; after "
          f"{', '.join(f'{x:.2f}' for x in la['after'])}; {result['wall_seconds']} s; wrote {out}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5,
                        help="timed rounds (default: 5); with --until-spread, the fewest")
    parser.add_argument("--until-spread", type=float, default=None, metavar="FRACTION",
                        help="add rounds until every pair's spread of the median (half its 95 %% confidence "
                             "interval over it) is under FRACTION, e.g. 0.02, or --max-rounds are run")
    parser.add_argument("--max-rounds", type=int, default=60, help="the most rounds with --until-spread (default: 60)")
    parser.add_argument("--batches", type=int, default=16, help="timed mini-batches per run (default: 16)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed mini-batches per run first (default: 1)")
    parser.add_argument("--runs", choices=sorted(SETS), default="all",
                        help="sync: gpipe, 1f1b-flush and pipeoptim against ScheduleGPipe and Schedule1F1B; "
                             "1f1b: 1f1b-flush against Schedule1F1B alone (M = 2 and 4); "
                             "chunks: interleaved, zb-v and zb-h1 against ScheduleInterleaved1F1B, "
                             "ScheduleZBVZeroBubble and ScheduleInterleavedZeroBubble; all (default): sync and chunks")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a process waits for its peer")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results file (default: %(default)s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("rounds", "batches", "max_rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    if args.until_spread is not None and not args.until_spread > 0:
        parser.error("--until-spread must be above 0")
    if args.worker:
        return _worker(args)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="peer-throughput-") as tmp:
        out = Path(tmp) / "result.json"
        worker_args = ["--rounds", str(args.rounds), "--max-rounds", str(args.max_rounds),
                       "--batches", str(args.batches), "--warmup", str(args.warmup), "--runs", args.runs,
                       "--timeout", str(args.timeout), "--out", str(out)]
        if args.until_spread is not None:
            worker_args += ["--until-spread", str(args.until_spread)]
        start = time.monotonic()
        code = launch("benchmarks.peer_throughput", worker_args)
        if code != 0 or not out.exists():
            print(f"peer_throughput: the workers failed (exit status {code})", file=sys.stderr)
            return 1
        result = json.loads(out.read_text())
    result["load_average"] = {"before": list(load_before), "after": list(os.getloadavg())}
    result["wall_seconds"] = round(time.monotonic() - start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    _print_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
