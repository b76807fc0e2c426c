"""The reproduction study: every method on each task, N = 4 and 8, momentum SGD and Adam, 3 seeds.

Learning rates are chosen for the sequential baseline (a small sweep, best final metric) and then
held fixed for every method. Each finished run is appended to ``runs.jsonl`` in the study folder;
a second call skips what is done, so the study resumes where it stopped. ``make_results.py``
turns the JSON into ``docs/results.md``.

    .venv/bin/python benchmarks/study.py [--suite default|smoke] [--tasks image,sentiment]
        [--optimizers adam] [--threads 1]

On two cores, two processes of one thread each (e.g. ``--tasks translation`` beside ``--tasks
image,sentiment``) finish about twice as fast as one; they may share the study folder.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

from pipeoptim.experiment import RunConfig, run_experiment
from pipeoptim.methods import method_names
from pipeoptim.tasks import get_task
from pipeoptim.train import NonFiniteLoss

SUITES: Dict[str, Dict[str, Any]] = {
    # per task: model, training examples, epochs; lr candidates per optimizer for the sweep
    "default": {
        "tasks": {
            # sized so that the whole suite (324 runs) finishes in about 80 minutes on two cores
            # (two or three study processes of one thread each); the models have at least 8 blocks
            "image": {"model": "vgg", "limit": 4000, "epochs": 3,
                      "lr": {"momentum": [0.005, 0.01, 0.02], "adam": [5e-4, 1e-3, 2e-3]}},
            # batch 16 (text tasks): four times the updates of the default 64 on these few examples
            "sentiment": {"model": "lstm-deep", "limit": 2000, "epochs": 3, "batch_size": 16,
                          "lr": {"momentum": [0.01, 0.02, 0.05], "adam": [1e-3, 2e-3, 4e-3]}},
            "translation": {"model": "transformer-deep", "limit": 2000, "epochs": 3, "batch_size": 16,
                            "eval_limit": 100,
                            "lr": {"momentum": [0.05, 0.1, 0.2], "adam": [1e-3, 2e-3, 4e-3]}},
        },
        "stages": [4, 8], "optimizers": ["momentum", "adam"], "seeds": [0, 1, 2],
    },
    "smoke": {
        "tasks": {"image": {"model": "mlp", "limit": 1280, "epochs": 2,
                            "lr": {"momentum": [0.01, 0.02], "adam": [1e-3]}}},
        "stages": [4], "optimizers": ["momentum", "adam"], "seeds": [0, 1],
    },
}


def key(row: Dict[str, Any]) -> str:
    return "|".join(str(row[k]) for k in ("task", "optimizer", "stages", "method", "seed", "lr", "sweep"))


def append_line(path: Path, row: Dict[str, Any]) -> None:
    """Append ``row`` as one JSON line with a single write() on an O_APPEND file, so that study
    processes sharing the file (split with --tasks, --optimizers, --seeds) never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(row) + "\n").encode())
    finally:
        os.close(fd)


def load_done(path: Path) -> Dict[str, Dict[str, Any]]:
    if not path.exists():
        return {}
    done = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            done[key(row)] = row
    return done


def run_one(task_name: str, spec: Dict[str, Any], optimizer: str, lr: float, stages: int, method: str,
            seed: int, data_cache: Dict) -> Dict[str, Any]:
    task = get_task(task_name)
    cfg = RunConfig(task=task_name, model=spec["model"], method=method, stages=stages, optimizer=optimizer,
                    lr=lr, epochs=spec["epochs"], limit=spec["limit"], seed=seed,
                    batch_size=spec.get("batch_size"))
    cfg = cfg.resolved(task)
    data_key = (task_name, seed, cfg.batch_size, cfg.limit)
    if data_key not in data_cache:
        data_cache.clear()
        data_cache[data_key] = task.load(batch_size=cfg.batch_size, limit=cfg.limit, seed=seed)
        if "eval_limit" in spec:  # translation: decode fewer test sentences per evaluation
            data_cache[data_key].info["eval_limit"] = spec["eval_limit"]
    summary = run_experiment(cfg, out_dir=None, show_progress=False, log=lambda *a, **k: None, task=task,
                             data=data_cache[data_key], diagnose_every=7)
    return summary


def write_plans(suite: Dict[str, Any], tasks: List[str], optimizers: List[str], methods: List[str],
                path: Path) -> None:
    """One plan per task, optimizer and N, on the study's uniform split, with the micro-batch
    counts the study's runs use; a plan already in ``path`` is kept. The plans predict every
    method's throughput from the same profile, so they compare schedules, not noisy runs."""
    from pipeoptim.methods import get_method
    from pipeoptim.planner import make_plan

    have = set()
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            have.add((row["task"], row["optimizer"], row["stages"]))
    for task in tasks:
        spec = suite["tasks"][task]
        for optimizer in optimizers:
            for stages in suite["stages"]:
                if (task, optimizer, stages) in have:
                    continue
                t0 = time.time()
                pipelined = [m for m in methods if m != "sequential"]
                counts = sorted({get_method(m).microbatches(stages, None) for m in pipelined})
                # one profile at the full micro-batch size, scaled linearly to the others, and
                # stages costed from the layer profile: the same costs for every method
                plan = make_plan(task=task, model=spec["model"], stages=stages, optimizer=optimizer,
                                 limit=spec["limit"], partitioner="uniform", methods=pipelined,
                                 microbatches=counts, scaling="linear", stage_timing="profile")
                row = {"task": task, "optimizer": optimizer, "stages": stages, "plan": plan,
                       "seconds": time.time() - t0}
                append_line(path, row)
                print(f"plan {task} {optimizer} N={stages}: {time.time() - t0:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="default", choices=list(SUITES))
    parser.add_argument("--tasks", help="comma-separated subset of the suite's tasks")
    parser.add_argument("--methods", default=",".join(method_names()))
    parser.add_argument("--optimizers", help="comma-separated subset of the suite's optimizers (to split "
                                             "the study over processes, one per optimizer or task)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "study")
    parser.add_argument("--seeds", help="comma-separated subset of the suite's seeds (another way to split)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--plans", action="store_true",
                        help="instead of training: profile each task's model once per optimizer and N and "
                             "predict every method's throughput and memory with the same costs "
                             "(`pipeoptim plan`), into plans.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    suite = SUITES[args.suite]
    tasks = args.tasks.split(",") if args.tasks else list(suite["tasks"])
    methods = args.methods.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    runs_file = args.out / "runs.jsonl"
    done = load_done(runs_file)
    (args.out / "suite.json").write_text(json.dumps({"suite": args.suite, **suite}, indent=2))
    started = time.time()
    data_cache: Dict = {}
    if args.plans:
        write_plans(suite, tasks, args.optimizers.split(",") if args.optimizers else suite["optimizers"],
                    methods, args.out / "plans.jsonl")
        return

    def record(row: Dict[str, Any]) -> Dict[str, Any]:
        k = key(row)
        if k not in done:  # another study process on the same file may have run it meanwhile
            done.update(load_done(runs_file))
        if k in done:
            return done[k]
        t0 = time.time()
        try:
            summary = run_one(row["task"], suite["tasks"][row["task"]], row["optimizer"], row["lr"],
                              row["stages"], row["method"], row["seed"], data_cache)
        except NonFiniteLoss as error:  # a diverged run is a result, not a failure of the study
            summary = {"diverged": str(error), "metric": get_task(row["task"]).metric,
                       "final_metric": None}
        keep = ("diverged", "metric", "final_metric", "best_metric", "final_loss", "losses", "epochs_detail",
                "samples_per_second", "predicted_samples_per_second", "weight_copies", "prediction_error",
                "microbatches")
        full = {**row, **{k2: summary.get(k2) for k2 in keep}, "seconds": time.time() - t0}
        append_line(runs_file, full)
        done[k] = full
        print(f"[{time.time() - started:7.0f}s] {row['task']:>11} {row['optimizer']:>8} N={row['stages']} "
              f"{row['method']:>14} seed {row['seed']} lr {row['lr']:g}{' (sweep)' if row['sweep'] else ''}: "
              f"{summary['metric']} " + (f"{summary['final_metric']:.4f}" if summary["final_metric"] is not None
                                    else f"diverged ({summary['diverged']})"), flush=True)
        return full

    for task in tasks:
        spec = suite["tasks"][task]
        higher = get_task(task).higher_is_better
        for optimizer in (args.optimizers.split(",") if args.optimizers else suite["optimizers"]):
            # the sweep: sequential, seed 0, each candidate lr; the best is then fixed
            scores = {}
            for lr in spec["lr"][optimizer]:
                r = record({"task": task, "optimizer": optimizer, "stages": 1, "method": "sequential",
                            "seed": 0, "lr": lr, "sweep": True})
                # the final metric; ties (e.g. BLEU 0 everywhere) go to the lower final loss
                sign = 1 if higher else -1
                scores[lr] = ((0, 0.0, 0.0) if r.get("diverged") else (1, sign * r["final_metric"], -r["final_loss"]))
            best_lr = max(scores, key=scores.get)
            for stages in suite["stages"]:
                for seed in ([int(x) for x in args.seeds.split(",")] if args.seeds else suite["seeds"]):
                    for method in methods:
                        n = 1 if method == "sequential" else stages
                        record({"task": task, "optimizer": optimizer, "stages": n, "method": method,
                                "seed": seed, "lr": best_lr, "sweep": False, "study_stages": stages})
    print(f"study complete in {time.time() - started:.0f} s; results in {runs_file}")


if __name__ == "__main__":
    main()
