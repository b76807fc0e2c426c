"""How fast a large asynchronous schedule is generated and simulated.

Builds async-1f1b for N=64 stages and T=1024 mini-batches (196,608 actions), simulates it with
unit costs, and reports the best of 3 runs of generate + simulate (the target: under 0.5 s). Writes
``benchmarks/results/schedule_speed.json``.

    python -m benchmarks.schedule_speed [--stages 64] [--batches 1024] [--repeat 3]
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

from pipeoptim.schedules import Costs, build_schedule, simulate

TARGET_S = 0.5
RESULTS = Path(__file__).resolve().parent / "results" / "schedule_speed.json"


def measure(stages: int, batches: int, repeat: int) -> dict:
    runs = []
    for _ in range(repeat):
        schedule = result = None  # each run starts from a heap without the last run's objects
        gc.collect()
        t0 = time.perf_counter()
        schedule = build_schedule("async-1f1b", stages, 1, batches)
        t1 = time.perf_counter()
        result = simulate(schedule, Costs.uniform(stages))
        t2 = time.perf_counter()
        runs.append({"generate_s": t1 - t0, "simulate_s": t2 - t1, "total_s": t2 - t0})
    best = min(runs, key=lambda r: r["total_s"])
    expected_bubble = (stages - 1) / (batches + stages - 1)
    if abs(result.bubble_fraction - expected_bubble) > 1e-9:
        raise AssertionError(f"bubble {result.bubble_fraction} != (N-1)/(T+N-1) = {expected_bubble}")
    return {
        "benchmark": "schedule_speed",
        "schedule": "async-1f1b",
        "stages": stages,
        "batches": batches,
        "actions": sum(len(order) for order in schedule.orders),
        "repeat": repeat,
        "best_total_s": best["total_s"],
        "best_generate_s": best["generate_s"],
        "best_simulate_s": best["simulate_s"],
        "runs": runs,
        "makespan": result.makespan,
        "bubble_fraction": result.bubble_fraction,
        "target_s": TARGET_S,
        "under_target": best["total_s"] < TARGET_S,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=64)
    parser.add_argument("--batches", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    report = measure(args.stages, args.batches, args.repeat)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"async-1f1b N={args.stages} T={args.batches}: {report['actions']} actions, "
          f"generate + simulate best of {args.repeat}: {report['best_total_s']:.3f} s "
          f"(generate {report['best_generate_s']:.3f} s, simulate {report['best_simulate_s']:.3f} s); "
          f"target < {TARGET_S:g} s: {'ok' if report['under_target'] else 'MISSED'}; wrote {args.out}")
    return 0 if report["under_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
