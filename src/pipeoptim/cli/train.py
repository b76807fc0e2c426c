"""`pipeoptim train`: train one method on one task and write a run folder."""
from __future__ import annotations

import argparse
import sys

from ..experiment import run_experiment
from ..methods import method_names
from .common import add_run_options, check_numbers, output_dir, print_json, run_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train one method on a task",
                       description="Train a model of a task with one pipeline method; writes "
                                   "metrics.jsonl, summary.json and curves.png to the run folder.")
    p.add_argument("--method", default="pipeoptim", choices=method_names(), help="default: pipeoptim")
    p.add_argument("--runtime", default="local", choices=["local", "distributed"],
                   help="local: all stages in this process; distributed: one process per stage "
                        "(started with torchrun for you, or run under torchrun)")
    add_run_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_numbers(args)
    cfg = run_config(args, args.method)
    if args.runtime == "distributed":
        from ..runtime.launch import run_distributed_train

        return run_distributed_train(args, cfg)
    out = output_dir(args, f"{args.method}-N{args.stages}")
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
    summary = run_experiment(cfg, out_dir=out, show_progress=not args.no_progress, log=log)
    if args.json:
        print_json(summary)
    else:
        print(f"final {summary['metric']}: {summary['final_metric']:.4f} (best {summary['best_metric']:.4f}), "
              f"final loss {summary['final_loss']:.4f}, {summary['samples_per_second']:.0f} samples/s, "
              f"weight copies per stage {summary['weight_copies']}")
        print(f"run folder: {out}")
    return 0
