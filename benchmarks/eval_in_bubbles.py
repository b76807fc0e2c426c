"""What evaluating every K mini-batches costs, filled into the bubbles against drained (issue 39
item 2): simulated at N = 2 and 4 stages, and measured at N = 2 in one process and under torchrun
with 2 processes.

Simulated (``schedules/fill.py``, F = 1, B = 2, W = 1 per stage, an evaluation mini-batch the
size of a training micro-batch): K mini-batches of M = N micro-batches, then E evaluation
mini-batches; drained, the evaluation runs pipelined before the next K (``drain_first``); filled,
its forwards go into the idle time of the next mini-batch (``plan_fill``). The cost of one
evaluation is the makespan with it less the makespan without it, in units of a forward and as a
share of the K mini-batches' time.

Measured: ``fit`` of an MLP on random data (mini-batches of 64, evaluation mini-batches of
``--eval-batch``), 2 stages in one process, with ``eval_every=K``
drained and with ``eval_in_bubbles=True``, and once without evaluation; the cost of one
evaluation is (time with - time without) / evaluations, the median of several rounds. One
process runs every stage in turn, so it has no idle time to fill: the filled evaluation saves
nothing there, and this measures what running it that way costs. Under torchrun (gloo on the
CPU, one thread per process) each stage has its own process and its own idle time.

    .venv/bin/python -m benchmarks.eval_in_bubbles [--k 10] [--evals 4] [--rounds 5] [--no-torchrun]
    .venv/bin/python -m benchmarks.eval_in_bubbles --k 2 --measured-evals 3 --eval-batch 32
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch
from torch import nn

from pipeoptim import Pipeline
from pipeoptim.schedules.fill import drain_first, plan_fill
from pipeoptim.schedules.registry import build_schedule
from pipeoptim.schedules.simulate import Costs, simulate

METHODS = ("gpipe", "1f1b-flush", "zb-h1")


def simulated(stages: int, k: int, evals: int) -> List[Dict[str, float]]:
    """Per method: the makespan of K mini-batches, and what one evaluation of ``evals``
    mini-batches adds to it, drained and filled (``filled``: the evaluation mini-batches that
    ran entirely in idle time)."""
    costs = Costs.uniform(stages, forward=1, backward=2, weight=1)
    rows = []
    for name in METHODS:
        base = build_schedule(name, stages, stages, k)
        plan = plan_fill(base, evals, costs)
        plain = simulate(base, costs).makespan
        rows.append({"method": name, "stages": stages, "k": k, "evals": evals, "plain": plain,
                     "drained": simulate(drain_first(base, evals), costs).makespan - plain,
                     "filled_cost": simulate(plan.apply(base), costs).makespan - plain,
                     "filled": plan.filled})
    return rows


def model(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: List[nn.Module] = [nn.Linear(32, width), nn.ReLU(), nn.Dropout(0.1)]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def data(count: int, size: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 32, generator=g), torch.randint(0, 10, (size,), generator=g)) for _ in range(count)]


def measured(method: str, k: int, evals: int, batches: int, rounds: int, width: int, depth: int,
             batch: int, eval_batch: int) -> Dict[str, float]:
    """Seconds of one ``fit`` without evaluation, drained and filled (medians over ``rounds``,
    run in turn), and the metrics of both (equal)."""
    train, held_out = data(batches, batch, 1), data(evals, eval_batch, 2)
    times: Dict[str, List[float]] = {"none": [], "drained": [], "filled": []}
    metrics: Dict[str, List[float]] = {}
    arms = list(times)
    for round_ in range(rounds):
        for arm in arms[round_ % 3:] + arms[:round_ % 3]:  # each arm first in turn (a warm cache favours none)
            pipe = Pipeline(model(width, depth), method=method, stages=2, micro_batches=2,
                            loss_fn=nn.functional.cross_entropy, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
            options = {} if arm == "none" else {"eval_loader": held_out, "eval_every": k,
                                                "eval_in_bubbles": arm == "filled"}
            began = time.perf_counter()
            result = pipe.fit(train, **options)
            times[arm].append(time.perf_counter() - began)
            if arm != "none":
                metrics[arm] = [e["metric"] for e in result.metrics["evaluations"]]
    assert metrics["drained"] == metrics["filled"], "the filled evaluation must equal the drained one"
    evaluations = (batches - 1) // k  # mid-epoch ones (the epoch-end one is drained either way)
    median = {arm: statistics.median(values) for arm, values in times.items()}
    return {"method": method, **median, "evaluations": evaluations,
            "drained_per_eval": (median["drained"] - median["none"]) / evaluations,
            "filled_per_eval": (median["filled"] - median["none"]) / evaluations}


def under_torchrun(args: argparse.Namespace) -> List[Dict[str, float]]:
    """:func:`measured` for every method in a job of 2 processes (one stage each): rank 0's rows."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    flags = [f"--{name.replace('_', '-')}={getattr(args, name)}"
             for name in ("k", "measured_evals", "batches", "rounds", "width", "depth", "batch", "eval_batch")]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "benchmarks.eval_in_bubbles", "--worker", *flags], capture_output=True, text=True,
                          env=env, cwd=Path(__file__).resolve().parents[1], timeout=3600)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def print_measured(title: str, rows: List[Dict[str, float]]) -> None:
    print(title)
    print(f"{'method':<11} {'no eval s':>10} {'drained s':>10} {'filled s':>10} {'drained/eval ms':>16} "
          f"{'filled/eval ms':>15}")
    for row in rows:
        print(f"{row['method']:<11} {row['none']:>10.3f} {row['drained']:>10.3f} {row['filled']:>10.3f} "
              f"{1e3 * row['drained_per_eval']:>16.2f} {1e3 * row['filled_per_eval']:>15.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=10, help="mini-batches between evaluations")
    parser.add_argument("--evals", type=int, default=4, help="simulated: evaluation mini-batches")
    parser.add_argument("--batches", type=int, default=81, help="measured: mini-batches of the epoch")
    parser.add_argument("--measured-evals", type=int, default=16,
                        help="measured: evaluation mini-batches (of --batch samples: a cost above the noise)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--eval-batch", type=int, default=64, help="measured: samples per evaluation mini-batch")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-torchrun", action="store_true", help="skip the measurement under torchrun")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a process of that job
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        for method in METHODS:
            row = measured(method, args.k, args.measured_evals, args.batches, args.rounds, args.width,
                           args.depth, args.batch, args.eval_batch)
            if int(os.environ.get("RANK", "0")) == 0:
                print(json.dumps(row), flush=True)
        return
    print(f"simulated: one evaluation of {args.evals} mini-batches every K = {args.k} mini-batches of M = N "
          f"micro-batches (F = 1, B = 2 per stage; cost in forwards, and as a share of the K mini-batches)")
    print(f"{'method':<11} {'N':>2} {'K mini-batches':>15} {'drained':>16} {'filled':>16} {'free':>5}")
    for stages in (2, 4):
        for row in simulated(stages, args.k, args.evals):
            share = lambda cost: f"{cost:g} ({100 * cost / row['plain']:.1f}%)"  # noqa: E731
            print(f"{row['method']:<11} {stages:>2} {row['plain']:>15g} {share(row['drained']):>16} "
                  f"{share(row['filled_cost']):>16} {row['filled']:>2}/{args.evals}")
    setting = (f"N = 2, M = 2: {args.batches} mini-batches of {args.batch}, evaluation of {args.measured_evals} "
               f"x {args.eval_batch} samples every {args.k}; median of {args.rounds}")
    print_measured(f"\nmeasured, one process, {setting}",
                   [measured(method, args.k, args.measured_evals, args.batches, args.rounds, args.width,
                             args.depth, args.batch, args.eval_batch) for method in METHODS])
    if not args.no_torchrun:
        print_measured(f"\nmeasured, torchrun with 2 processes (gloo, 1 thread each), {setting}", under_torchrun(args))


if __name__ == "__main__":
    main()
