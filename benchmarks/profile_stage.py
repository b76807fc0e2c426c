"""cProfile of the stage processes (issue 14, item 2; issue 37, item 0): ours against
``torch.distributed.pipelining`` on the same model, split and data, 2 processes (gloo, one thread
each), the runs of :mod:`benchmarks.peer_runs` (the ``blocks`` model, batch 512, split [4, 5],
momentum SGD, as in ``benchmarks/peer_throughput.py``).

For each run (default: ours ``1f1b-flush`` and torch's ``Schedule1F1B``, at ``--micro`` 2), every
rank trains one warm-up mini-batch, then profiles ``--fits`` fits of ``--batches`` mini-batches
(torch: as many ``step()`` calls) and writes ``OUT/<run>-r<rank>.prof`` with the top entries by
tottime and by cumtime beside it (``.txt``). Rank 0 then writes ``OUT/summary.txt`` (and
``summary.json``): per mini-batch and rank, the profile's time in each *part* (:func:`part_of`:
our runtime's Python, torch's pipelining Python, the communication's Python and calls, the
waits on messages, compute, the rest), and the functions whose calls per mini-batch differ
most between the two sides, so that one can say what one side does per mini-batch that the
other does not. cProfile adds a cost to every Python call, so Python-heavy parts read larger
than they run; call counts and per-call costs compare the sides fairly even on a loaded host.

    .venv/bin/python -m benchmarks.profile_stage [--out /tmp/pipeoptim-profile] [--runs 1f1b-flush Schedule1F1B]
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from benchmarks.peer_runs import BATCH, build, launch, make_data

#: run name -> (side, method or torch schedule, micro-batches: None for --micro or the method's own)
RUNS = {"gpipe": ("ours", "gpipe", None), "1f1b-flush": ("ours", "1f1b-flush", None),
        "pipeoptim": ("ours", "pipeoptim", "own"), "zb-v": ("ours", "zb-v", None),
        "ScheduleGPipe": ("torch", "ScheduleGPipe", None), "Schedule1F1B": ("torch", "Schedule1F1B", None),
        "ScheduleZBVZeroBubble": ("torch", "ScheduleZBVZeroBubble", None)}
PARTS = ["our runtime (Python)", "torch pipelining (Python)", "communication (Python, posting)",
         "communication waits", "compute", "other"]
Key = Tuple[str, int, str]  # pstats' (file, line, function)


def part_of(key: Key) -> str:
    """Which part of a stage's work a profiled function's own time (tottime) belongs to."""
    path, _, name = key
    path = path.replace(os.sep, "/")
    if "/pipeoptim/" in path:
        return "our runtime (Python)"
    if "/torch/distributed/pipelining/" in path:
        return "torch pipelining (Python)"
    if path == "~":  # a built-in: named by its method and type
        if "wait" in name and ("c10d" in name or "Work" in name) or "is_completed" in name:
            return "communication waits"  # a Work's wait (torch 2.x names it either way)
        if "_distributed_c10d" in name or "isend" in name or "irecv" in name:
            return "communication (Python, posting)"
        if "torch" in name or "_EngineBase" in name:
            return "compute"
        return "other"
    if "/torch/distributed/" in path:
        return "communication (Python, posting)"
    if "/torch/" in path:
        return "compute"  # torch's own Python around its kernels: nn, optim, autograd
    return "other"


def parts(stats: pstats.Stats, per: int) -> Dict[str, float]:
    """Milliseconds per mini-batch in each part (``per``: the mini-batches profiled)."""
    out = dict.fromkeys(PARTS, 0.0)
    for key, (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        out[part_of(key)] += 1e3 * tottime / per
    out["total"] = sum(out.values())
    return out


def calls(stats: pstats.Stats, per: int) -> Dict[str, Tuple[float, float, str]]:
    """Per function: calls per mini-batch, its own microseconds per call, and its part."""
    out = {}
    for key, (_, ncalls, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        path, line, name = key
        label = name if path == "~" else f"{Path(path).parent.name}/{Path(path).name}:{line}({name})"
        out[label] = (ncalls / per, 1e6 * tottime / max(1, ncalls), part_of(key))
    return out


class CollectorClock:
    """Python's cyclic garbage collector while it is on: collections per generation and the
    seconds they took (cProfile charges that time to whichever function was running)."""

    def __init__(self) -> None:
        self.counts, self.seconds, self._start = [0, 0, 0], 0.0, 0.0

    def __call__(self, phase: str, info: Dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._start

    def __enter__(self) -> "CollectorClock":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self)


def profile_run(name: str, micro: int, rank: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Profile one run on this process; write its .prof and .txt; its parts and calls."""
    import torch.distributed as dist

    side, schedule, m = RUNS[name]
    data = make_data(1 + args.batches)
    run = build(side, schedule, None if m == "own" else micro, rank, 2, 120.0)
    try:
        run.train(data[:1])
        dist.barrier()
        profile = cProfile.Profile()
        with CollectorClock() as collector:
            start = time.perf_counter()
            profile.enable()
            for _ in range(args.fits):
                run.train(data[1:])
            profile.disable()
            seconds = time.perf_counter() - start
        dist.barrier()
    finally:
        run.close()
    per = args.fits * args.batches
    path = Path(args.out) / f"{name}-r{rank}"
    profile.dump_stats(str(path) + ".prof")
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    share = parts(stats, per)
    collected = {"collections_per_batch": [c / per for c in collector.counts],
                 "ms_per_batch": 1e3 * collector.seconds / per}
    text.write(f"{name}, rank {rank}: {seconds:.3f} s, {per * BATCH / seconds:.0f} samples/s (profiled); "
               f"ms per mini-batch: " + ", ".join(f"{k} {v:.2f}" for k, v in share.items())
               + f"; garbage collector {collected['ms_per_batch']:.2f} ms per mini-batch, collections per "
               f"mini-batch by generation {', '.join(f'{c:.2f}' for c in collected['collections_per_batch'])}\n")
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumtime").print_stats(30)
    path.with_suffix(".txt").write_text(text.getvalue())
    print(text.getvalue().splitlines()[0], flush=True)
    return {"parts": share, "calls": calls(stats, per), "ms_per_batch": 1e3 * seconds / per, "gc": collected}


def side_by_side(ours: Dict[str, Any], theirs: Dict[str, Any], names: Tuple[str, str], top: int = 25) -> str:
    """Two runs' parts per mini-batch and rank, then the functions whose calls per mini-batch
    differ most (by the own time that difference costs)."""
    lines = [f"{names[0]} against {names[1]}: ms per mini-batch (profiled)", ""]
    head = f"{'part':<34}" + "".join(f"{n + ' r' + str(r):>22}" for n in names for r in range(2))
    lines += [head, "-" * len(head)]
    for part in PARTS + ["total"]:
        lines.append(f"{part:<34}" + "".join(f"{side[r]['parts'][part]:>22.2f}" for side in (ours, theirs)
                                             for r in range(2)))
    lines.append(f"{'(of which garbage collection)':<34}" + "".join(
        f"{side[r]['gc']['ms_per_batch']:>22.2f}" for side in (ours, theirs) for r in range(2)))
    lines.append(f"{'(collections per mini-batch)':<34}" + "".join(
        f"{'/'.join(f'{c:.2f}' for c in side[r]['gc']['collections_per_batch']):>22}"
        for side in (ours, theirs) for r in range(2)))
    lines += ["", f"calls per mini-batch, both ranks (own us per call): the {top} functions whose difference "
                  f"costs the most own time", ""]
    rows = []
    for label in set(ours[0]["calls"]) | set(ours[1]["calls"]) | set(theirs[0]["calls"]) | set(theirs[1]["calls"]):
        a = [ours[r]["calls"].get(label, (0.0, 0.0, "")) for r in range(2)]
        b = [theirs[r]["calls"].get(label, (0.0, 0.0, "")) for r in range(2)]
        cost = sum(n * us for n, us, _ in a) - sum(n * us for n, us, _ in b)
        part = next(p for _, _, p in a + b if p)
        rows.append((abs(cost), cost, label, part, a, b))
    rows.sort(reverse=True)
    lines.append(f"{'function':<64} {'part':<30} {names[0]:>18} {names[1]:>18} {'own ms diff':>12}")
    for _, cost, label, part, a, b in rows[:top]:
        fmt = lambda s: f"{sum(n for n, _, _ in s):.1f} ({max(us for _, us, _ in s):.0f} us)"  # noqa: E731
        lines.append(f"{label[:64]:<64} {part[:30]:<30} {fmt(a):>18} {fmt(b):>18} {cost / 1e3:>12.2f}")
    return "\n".join(lines)


def _worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from pipeoptim.runtime.control import init_process_group

    init_process_group(device="cpu", timeout=120.0, threads=1)
    rank = dist.get_rank()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results: Dict[str, List[Any]] = {}
    for name in args.runs:
        mine = profile_run(name, args.micro, rank, args)
        both: List[Any] = [None, None]
        dist.all_gather_object(both, mine)
        results[name] = both
    if rank == 0:
        ours = [n for n in args.runs if RUNS[n][0] == "ours"]
        theirs = [n for n in args.runs if RUNS[n][0] == "torch"]
        text = [side_by_side(results[a], results[b], (a, b)) for a, b in zip(ours, theirs)]
        summary = Path(args.out) / "summary.txt"
        summary.write_text(f"{args.fits} x {args.batches} mini-batches profiled per run, micro-batches {args.micro}\n\n"
                           + "\n\n".join(text) + "\n")
        (Path(args.out) / "summary.json").write_text(json.dumps(
            {name: [{"parts": r["parts"], "ms_per_batch": r["ms_per_batch"], "gc": r["gc"]} for r in ranks]
             for name, ranks in results.items()}, indent=2))
        print(summary.read_text())
    dist.destroy_process_group()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/pipeoptim-profile",
                        help="folder of the .prof/.txt files and the summary (default: %(default)s)")
    parser.add_argument("--runs", nargs="+", default=["1f1b-flush", "Schedule1F1B"], choices=list(RUNS),
                        help="runs to profile; ours and torch's are paired in the order given (default: %(default)s)")
    parser.add_argument("--micro", type=int, default=2, help="micro-batches per mini-batch (default: 2)")
    parser.add_argument("--batches", type=int, default=16, help="mini-batches per profiled fit")
    parser.add_argument("--fits", type=int, default=2, help="profiled fits per run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    args.out = str(Path(args.out).resolve())
    return launch("benchmarks.profile_stage", ["--out", args.out, "--runs", *args.runs, "--micro", str(args.micro),
                                               "--batches", str(args.batches), "--fits", str(args.fits)])


if __name__ == "__main__":
    sys.exit(main())
