"""Threads and context switches per mini-batch of each process (issue 37, item 3): ours against
torch.distributed.pipelining on the runs of :mod:`benchmarks.peer_runs` (2 processes, gloo).

For each run, every process trains ``--warmup`` mini-batches, then ``--batches`` measured ones
between two barriers, and reads its threads from ``/proc/self/task`` at the end of them (before
the run is closed): how many in all and by name (``gloo_tcp_loop``: one per gloo process group,
the thread that reads and writes its sockets; ``pt_gloo_runloop``: its collective workers).
Context switches (voluntary and not) per mini-batch are the process's (``getrusage``, every
thread, ended ones too), and by thread name from each thread's ``/proc`` status; beside them
each thread name's CPU milliseconds per mini-batch (``/proc`` schedstat: time on a core).

    python -m benchmarks.link_threads [--runs zb-v ScheduleZBVZeroBubble] [--batches 16]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from benchmarks.peer_runs import build, launch, make_data

RESULTS = Path(__file__).resolve().parent / "results" / "link_threads.json"
#: run name -> (side, schedule, micro-batches)
RUNS = {
    "zb-v": ("ours", "zb-v", 4), "ScheduleZBVZeroBubble": ("torch", "ScheduleZBVZeroBubble", 4),
    "interleaved": ("ours", "interleaved", 4),
    "ScheduleInterleaved1F1B": ("torch", "ScheduleInterleaved1F1B", 4),
    "1f1b-flush": ("ours", "1f1b-flush", 4), "Schedule1F1B": ("torch", "Schedule1F1B", 4),
}


def thread_switches() -> Dict[int, Tuple[str, int, float]]:
    """Per thread of this process: its name, its context switches so far (voluntary and not)
    and its CPU seconds so far."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        task = Path(f"/proc/self/task/{tid}")
        try:
            name = (task / "comm").read_text().strip()
            fields = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines())
            on_cpu = int((task / "schedstat").read_text().split()[0]) / 1e9
        except OSError:  # the thread ended meanwhile
            continue
        switches = int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])
        out[int(tid)] = (name, switches, on_cpu)
    return out


def process_switches() -> int:
    """Context switches of every thread of this process so far, ended threads included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def by_name(before: Dict[int, Tuple[str, int, float]], after: Dict[int, Tuple[str, int, float]],
            per: int, field: int) -> Dict[str, float]:
    """A field of :func:`thread_switches` (1: context switches, 2: CPU seconds) per mini-batch,
    summed by thread name, of the threads alive at the end."""
    out: Dict[str, float] = {}
    for tid, now in after.items():
        start = before.get(tid, (now[0], 0, 0.0))[field]
        out[now[0]] = out.get(now[0], 0.0) + (now[field] - start) / per
    return dict(sorted(out.items()))


def measure(name: str, rank: int, args: argparse.Namespace) -> Dict[str, object]:
    """Threads and context switches per mini-batch of this process over one run's measured mini-batches."""
    import torch.distributed as dist

    side, schedule, micro = RUNS[name]
    data = make_data(args.warmup + args.batches)
    run = build(side, schedule, micro, rank, 2, args.timeout)
    try:
        run.train(data[:args.warmup])
        dist.barrier()
        threads_before, total_before = thread_switches(), process_switches()
        run.train(data[args.warmup:])
        threads_after, total_after = thread_switches(), process_switches()
        dist.barrier()
    finally:
        run.close()
    names: Dict[str, int] = {}
    for thread_name, _, _ in threads_after.values():
        names[thread_name] = names.get(thread_name, 0) + 1
    return {"threads": len(threads_after), "threads_by_name": dict(sorted(names.items())),
            "switches_per_batch": (total_after - total_before) / args.batches,
            "switches_per_batch_by_thread": by_name(threads_before, threads_after, args.batches, 1),
            "cpu_ms_per_batch_by_thread": {k: 1e3 * v for k, v in
                                           by_name(threads_before, threads_after, args.batches, 2).items()}}


def _worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from pipeoptim.runtime.control import init_process_group

    init_process_group(device="cpu", timeout=args.timeout, threads=1)
    rank = dist.get_rank()
    result: Dict[str, List[object]] = {}
    for name in args.runs:
        mine = measure(name, rank, args)
        both: List[object] = [None, None]
        dist.all_gather_object(both, mine)
        result[name] = both
    if rank == 0:
        Path(args.out).write_text(json.dumps({"benchmark": "link_threads", "batches": args.batches,
                                              "warmup": args.warmup, "runs": result}, indent=2))
    dist.destroy_process_group()
    return 0


def format_table(runs: Dict[str, List[dict]]) -> str:
    head = (f"{'run':<24} {'rank':>4}  {'threads':>7}  {'gloo_tcp_loop':>13}  {'switches/mini-batch':>19}"
            f"  {'(main thread)':>13}  {'CPU ms/mini-batch: main':>23}  {'gloo threads':>12}")
    lines = [head]
    for name, ranks in runs.items():
        for rank, r in enumerate(ranks):
            cpu, switches = r["cpu_ms_per_batch_by_thread"], r["switches_per_batch_by_thread"]
            main, gloo = cpu.get("python", 0.0), sum(v for k, v in cpu.items() if "gloo" in k)
            lines.append(f"{name:<24} {rank:>4}  {r['threads']:>7}  {r['threads_by_name'].get('gloo_tcp_loop', 0):>13}"
                         f"  {r['switches_per_batch']:>19.1f}  {switches.get('python', 0.0):>13.1f}"
                         f"  {main:>23.1f}  {gloo:>12.1f}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--batches", type=int, default=16, help="measured mini-batches per run")
    parser.add_argument("--warmup", type=int, default=2, help="mini-batches per run first, not measured")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a process waits for its peer")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results file (default: %(default)s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.batches < 1 or args.warmup < 0:
        parser.error("--batches must be at least 1, --warmup at least 0")
    if args.worker:
        return _worker(args)
    args.out = args.out.resolve()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    code = launch("benchmarks.link_threads", ["--runs", *args.runs, "--batches", str(args.batches),
                                              "--warmup", str(args.warmup), "--timeout", str(args.timeout),
                                              "--out", str(args.out)])
    if code != 0 or not args.out.exists():
        print(f"link_threads: the workers failed (exit status {code})", file=sys.stderr)
        return 1
    result = json.loads(args.out.read_text())
    # context switches grow with the host's load (a thread preempted, a wait that blocks): read them with it
    result["load_average"] = {"before": list(load_before), "after": list(os.getloadavg())}
    args.out.write_text(json.dumps(result, indent=2))
    print(format_table(result["runs"]))
    print(f"load average before {', '.join(f'{x:.2f}' for x in load_before)}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
