"""What the local runtime costs: an epoch of `pipeoptim` with 4 stages in one process against
the same epoch of plain `sequential` training (target: at most 1.15x).

The two run alternately, several rounds, on the same data and initial weights, with the same
thread count; the ratio of their median epoch times is the overhead of the stages, the weight
policy and the prediction. Writes benchmarks/results/local_overhead.json.

    .venv/bin/python -m benchmarks.local_overhead [--task image] [--model vgg] [--limit 6000]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import pipeoptim
from pipeoptim.lab.optimizers import make_optimizer
from pipeoptim.lab.tasks import get_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="image")
    parser.add_argument("--model", default=None)
    parser.add_argument("--limit", type=int, default=6000)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default="sequential,pipeoptim,async-naive,pipedream")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "local_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    task = get_task(args.task)
    model_name = args.model or task.default_model
    data = task.load(batch_size=task.default_batch_size, limit=args.limit, seed=0)
    model = task.build_model(model_name, data, seed=0)
    optimizer = make_optimizer("momentum", task.default_lr["momentum"])
    methods = args.methods.split(",")
    seconds = {m: [] for m in methods}
    for _ in range(args.rounds):
        for method in methods:
            start = time.perf_counter()
            pipeoptim.train(model, data.train, method=method, stages=args.stages, optimizer=optimizer,
                            loss_fn=task.loss)
            seconds[method].append(time.perf_counter() - start)
    median = {m: statistics.median(s) for m, s in seconds.items()}
    base = median["sequential"]
    report = {"task": args.task, "model": model_name, "stages": args.stages, "threads": args.threads,
              "examples": len(data.train) * task.default_batch_size, "rounds": args.rounds,
              "epoch_seconds": seconds, "median_seconds": median,
              "ratio_to_sequential": {m: median[m] / base for m in methods}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for m in methods:
        print(f"{m:>12}: median epoch {median[m]:.2f} s  ratio {median[m] / base:.3f}")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
