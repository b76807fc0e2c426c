"""CPU seconds per update of each variant of issue 41's translation cell on the local runtime
(the study's model, ``transformer-deep``, and mini-batches of 64 pairs, N = 8, one thread): a
Pipeline per variant fits 2 untimed mini-batches, then 10 timed on the thread's CPU clock, which
other jobs on the machine do not inflate. What ``study5_plan`` prices each run's minutes with
(the suite's ``cpu_seconds_per_update``).

    .venv/bin/python -m study.translation_cost [--optimizers adamw,muon] [--updates 10]

Prints one line per (optimizer, variant) and writes ``study/results/translation_cost.json``."""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Dict, Optional, Sequence

import torch

import pipeoptim
from study.common import RESULTS
from study.study3_suite import SUITES, variant_spec
from pipeoptim.lab.optimizers import make_optimizer
from pipeoptim.lab.tasks.translation import TranslationTask


def cpu_seconds_per_update(optimizer: str, variant: str, stages: int, updates: int, data) -> float:
    task, spec = TranslationTask(), SUITES["translation"]["tasks"]["translation"]
    method, options, micro = variant_spec(variant, stages)
    model = task.build_model(spec["model"], data, seed=0)
    placement = {} if method == "sequential" else {"stages": stages}
    pipe = pipeoptim.Pipeline(model, method=method, loss_fn=task.loss, micro_batches=micro,
                              optimizer=make_optimizer(optimizer, task.default_lr[optimizer]),
                              clip_grad_norm=spec["clip_grad"], **placement, **options)
    pipe.fit(data.train[:2])
    start = time.process_time()
    pipe.fit(data.train[2:2 + updates])
    return (time.process_time() - start) / updates


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizers", default="adamw,muon")
    parser.add_argument("--updates", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    suite = SUITES["translation"]
    spec = suite["tasks"]["translation"]
    data = TranslationTask().load(batch_size=spec["batch_size"], limit=spec["batch_size"] * (args.updates + 2),
                                  seed=0, holdout=spec["holdout"])
    out: Dict[str, Dict[str, float]] = {}
    for optimizer in args.optimizers.split(","):
        arm = next(a for a in suite["arms"] if a["optimizer"] == optimizer)
        for variant in arm["variants"]:
            stages = 1 if variant == "sequential" else arm["stages"]
            seconds = cpu_seconds_per_update(optimizer, variant, stages, args.updates, data)
            out.setdefault(optimizer, {})[variant] = round(seconds, 3)
            print(f"{optimizer} {variant}: {seconds:.3f} CPU s per update", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "translation_cost.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
