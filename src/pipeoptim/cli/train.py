"""`pipeoptim train`: train one method on one task and write a run folder."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

from ..errors import Interrupted, interrupt_on_signals
from .flags import add_distributed_options, add_run_options
from .common import check_numbers, log_for, output_dir, print_json, run_config, say_default_task

if TYPE_CHECKING:
    from ..lab.config import RunConfig


def register(sub: argparse._SubParsersAction) -> None:
    from ..lab.tasks.recipes import RECIPES

    p = sub.add_parser("train", help="train one method on a task",
                       description="Train a model of a task with one pipeline method; writes "
                                   "metrics.jsonl, summary.json and curves.png to the run folder. "
                                   "Every setting not given comes from the task's recipe; the peak "
                                   "lr from the study's tuning for the method where there is one.",
                       epilog="recipes (--recipe prints one with its tuned lrs):\n" + "\n".join(
                           f"  {t}: {r.model}, {r.optimizer} {r.lr:g}, {r.lr_schedule}, clip "
                           f"{r.clip_grad if r.clip_grad is not None else 'none'}, batch {r.batch_size}, "
                           f"{r.epochs} epochs" for t, r in RECIPES.items()),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(p, "train")
    add_distributed_options(p)
    p.set_defaults(func=run)


def resume_config(run_dir: Path) -> RunConfig:
    from ..lab.config import RunConfig

    config = run_dir / "config.json"
    if not config.exists():
        raise ValueError(f"{run_dir} is not a run folder of `pipeoptim train` (no config.json)")
    try:
        return RunConfig(**json.loads(config.read_text()))
    except (ValueError, TypeError) as error:
        raise ValueError(f"{config}: unreadable ({error})") from None


def resume_here(out: Optional[Path]) -> Optional[Path]:
    """``--resume`` without RUN_DIR: ``out`` (--out) to resume where it holds a run with a
    checkpoint, else None (the run starts there, and rank 0 says so as ``fit`` would). Every
    rank of a job decides alike: no rank writes a checkpoint before every rank has started."""
    if out is None:
        raise ValueError("--resume without RUN_DIR continues the run in --out: give --out RUN_DIR (the same "
                         "on the first start and every restart)")
    store = out / "checkpoints"
    held = store.is_dir() and any(p.is_dir() and not p.name.startswith(".") for p in store.iterdir())
    if held and (out / "config.json").exists():
        return out
    if os.environ.get("RANK", "0") == "0":
        print(f"pipeoptim: no checkpoint in {store} yet: training from the beginning", file=sys.stderr, flush=True)
    return None


def run(args: argparse.Namespace) -> int:
    if args.recipe:
        from ..lab.tasks.recipes import describe, recipe, tuned_lrs

        if args.json:
            print_json({"task": args.task, "recipe": recipe(args.task).as_dict(), "tuned_lrs": tuned_lrs(args.task)})
        else:
            print(describe(args.task))
        return 0
    from ..lab.experiment import run_experiment

    if args.plan is not None:
        if args.resume is not None:
            raise ValueError("--plan and --resume cannot be combined")
        from ..lab.planner import load_plan

        for key, value in load_plan(args.plan).items():
            setattr(args, key, value)
    check_numbers(args)
    if args.runtime != "distributed" and (args.data_parallel is not None or args.shard_replicas):
        raise ValueError("--data-parallel and --shard-replicas run the replicas as processes: add "
                         "--runtime distributed")
    check_tensor_flags(args)
    # under the user's own torchrun the replicas follow the world size (so a run re-formed on
    # other processes keeps following it); a launch of our own needs D to start N x D processes
    from ..runtime.lifecycle import under_torchrun

    follows_world = args.data_parallel is None and under_torchrun()
    if args.shard_replicas and not follows_world and (args.data_parallel or 1) < 2:
        raise ValueError("--shard-replicas shards each stage over its replicas: give --data-parallel D "
                         "with D >= 2 (under your own torchrun, leave it out: the replicas follow the world size)")
    from ..checks import check_diagnose_every
    from ..fit_checks import check_drains

    check_drains(args.checkpoint_every, None, False)
    check_diagnose_every(args.diagnose_every)
    from ..run_log import check_run_log

    check_run_log(args.tensorboard, args.wandb)  # the packages, before anything starts
    if args.resume is True:  # --resume without RUN_DIR: --out's run if it has a checkpoint, else a new one there
        args.resume = resume_here(args.out)
    if args.resume is not None:
        cfg = resume_config(args.resume)
        check_run_log(cfg.fit.log_dir, cfg.fit.wandb)  # the run's own --tensorboard, --wandb
        if args.runtime == "distributed":
            from ..lab.launcher import run_distributed_train

            return run_distributed_train(args, cfg, lambda label: output_dir(args, label))
        with _interrupts_name_the_checkpoint(args.resume):
            summary = run_experiment(cfg, out_dir=args.resume, show_progress=not args.no_progress,
                                     log=log_for(args), resume=True, diagnose_every=args.diagnose_every)
        return report(args, summary, args.resume)
    say_default_task(args, log_for(args))
    cfg = run_config(args, args.method)
    if args.runtime == "distributed":
        from ..lab.launcher import run_distributed_train

        return run_distributed_train(args, cfg, lambda label: output_dir(args, label))
    out = output_dir(args, f"{args.method}-N{cfg.pipeline.stages}")
    with _interrupts_name_the_checkpoint(out):
        summary = run_experiment(cfg, out_dir=out, show_progress=not args.no_progress, log=log_for(args),
                                 diagnose_every=args.diagnose_every)
    return report(args, summary, out)


def check_tensor_flags(args: argparse.Namespace) -> None:
    """--tensor-parallel T beside the other flags: T processes per stage need the distributed
    runtime, and neither --shard-replicas nor --compile runs with it yet."""
    tensor = getattr(args, "tensor_parallel", 1)
    if tensor == 1:
        return
    if args.runtime != "distributed":
        raise ValueError(f"--tensor-parallel {tensor} runs {tensor} processes per stage: add --runtime distributed")
    for flag, given in (("--shard-replicas", args.shard_replicas), ("--compile", args.compile)):
        if given:
            raise ValueError(f"--tensor-parallel and {flag} do not run together yet: drop one of them")


@contextlib.contextmanager
def _interrupts_name_the_checkpoint(out: Path) -> Iterator[None]:
    """Ctrl-C, SIGTERM or SIGHUP during a local run: one line with the signal, the last
    checkpoint and the command that resumes (exit status 128 + the signal, from main)."""
    from ..lab.run_folder import resume_hint

    with interrupt_on_signals():
        try:
            yield
        except KeyboardInterrupt as error:
            signum = error.signum if isinstance(error, Interrupted) else signal.SIGINT
            hint = resume_hint(out, f"pipeoptim train --resume {out}")
            raise Interrupted(signum, f"interrupted by {signal.Signals(signum).name}"
                                      + (f". {hint}" if hint else "")) from None


def report(args: argparse.Namespace, summary: dict, out: Path) -> int:
    if args.json:
        print_json(summary)
    else:
        from ..lab.experiment import final_line

        print(final_line(summary))
        print(f"run folder: {out}")
    return 0
