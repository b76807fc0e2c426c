"""Seconds per training step (forward, backward, Adam update; one thread) of each task's models at
their default batch size, and seconds per evaluated example: the numbers the study's budget
(docs/study_plan.md) is planned from. Each model trains for about ``--seconds`` after two
warm-up steps, on the first mini-batches of a small ``--limit``; prints one JSON line per model.

    .venv/bin/python -m study.step_times [--seconds 20] [--models image:vgg,lm:gpt]

On the local runtime every method computes the same forwards and backwards in one process, so a
run's compute time is about its updates times these step times (plus the evaluations); the
machine's load at the time is printed with them, since it inflates every number.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from pipeoptim.lab.tasks import get_task

DEFAULT_MODELS = "image:vgg,lm:gpt,sentiment:lstm,sentiment:lstm-deep"


def step_time(task_name: str, model_name: str, seconds: float, limit: int) -> dict:
    task = get_task(task_name)
    batch = task.default_batch_size
    data = task.load(batch_size=batch, limit=limit, seed=0)
    model = task.build_model(model_name, data, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    steps, start = 0, None
    while True:
        x, y = data.train[steps % len(data.train)]
        optimizer.zero_grad()
        task.loss(model(x), y).backward()
        optimizer.step()
        steps += 1
        if steps == 2:
            start = time.perf_counter()  # two warm-up steps
        if start is not None and time.perf_counter() - start > seconds:
            break
    per_step = (time.perf_counter() - start) / (steps - 2)
    evaluated = data.test[:20]
    began = time.perf_counter()
    task.evaluate(model, type(data)(train=[], test=evaluated, info=data.info, extra=data.extra))
    examples = sum(y.shape[0] for _, y in evaluated)
    return {"task": task_name, "model": model_name, "batch_size": batch, "steps": steps - 2,
            "seconds_per_step": round(per_step, 4),
            "eval_seconds_per_example": round((time.perf_counter() - began) / examples, 6),
            "blocks": len(model), "load_average": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="timed seconds per model (default 20)")
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"task:model,... (default {DEFAULT_MODELS})")
    parser.add_argument("--limit", type=int, default=1024, help="training examples loaded (default 1024)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for item in args.models.split(","):
        task_name, model_name = item.split(":")
        print(json.dumps(step_time(task_name, model_name, args.seconds, args.limit)), flush=True)


if __name__ == "__main__":
    main()
