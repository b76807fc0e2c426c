"""Issue 16's study: which pipeline reaches the target first, trained with the recipe people use.

Every run of every method, ``sequential`` included, uses the same recipe: linear warm-up over 5%
of the updates, cosine decay to 10% of the peak lr (``pipeoptim.lr_schedules``' warmup-cosine),
gradient clipping where the task has it, a validation split held out of the training data
(tuning reads only it; the test metric is measured once, on the final model), and an evaluation
every ``eval_every`` mini-batches: the curves that ``pipeoptim.time_to_target`` reads. The
budget and its cuts are docs/study_plan.md's; ``SUITES`` below holds their numbers.

Phases, per cell (task, optimizer):

* ``sweep`` (N = 8, seed 0): 4 log-spaced peak lrs per method, with successive halving. All 4
  train the first third of the updates (to the evaluation nearest a third, where they
  checkpoint and stop: rows with ``until: "third"``); the 2 best on the validation metric
  resume from that checkpoint to the end (``until: "end"``), exactly as uninterrupted runs. A
  method's best lr is the better of the two at the end, on validation.
* ``seeds``: seeds 1 and 2 at each method's best lr at N = 8 (seed 0 is its sweep run), seeds
  0-2 at N = 4 with the N = 8 best lr, ``sequential`` once per cell (it has no N); and the
  confirmations (rows with phase ``confirm``): ``gpipe`` and ``1f1b-flush`` once per task, at
  N = 8 with AdamW, sequential's best lr and seed 0.
* ``correction`` (added after the study ran, placed last so that no earlier run moved): which
  correction ``pipeoptim+lr_correction`` should carry, chosen on the validation split. At N = 8,
  seed 0 and its best lr, its own sweep run (the delay-scaled lr alone) against the same lr with
  the scheduled horizon, and with the prediction warmed up over the lr's warm-up (whole runs);
  ``--choice`` prints each cell's scores and pick.

Each finished run (and each first third) appends one line to ``runs.jsonl`` in the study
folder, with a single O_APPEND write; a second call skips what is in the file. Runs train in
folders under the study folder's ``runs/``, checkpointing at every evaluation, so a run that was
interrupted restarts from its last checkpoint; a run's checkpoints are deleted once its line is
written (and those of the lrs the halving drops, once it has chosen). A phase whose inputs are
not all in yet (the sweep's winners, sequential's best lr) is skipped with a line saying what it
waits for: call again later (or pass ``--wait``) and it continues.

    .venv/bin/python benchmarks/study2.py --plan          # the runs, minutes each, the core-minutes
    .venv/bin/python benchmarks/study2.py --shard 0/2 --wait 60 &
    .venv/bin/python benchmarks/study2.py --shard 1/2 --wait 60
    .venv/bin/python benchmarks/study2.py --suite smoke --out /tmp/study2-smoke   # seconds a run

``--shard i/n`` takes the runs whose place in the whole plan is i modulo n, so processes that
share the study folder never run the same run; each trains on one thread. ``--phase``,
``--tasks`` and ``--methods`` narrow what a call runs, ``--max-runs`` how many. The text tasks
read their data from ``PIPEOPTIM_CACHE`` (the Bible dump and tokenizer for the LM).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

BENCHMARKS = Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:  # study.py sits beside this file, also when a test imports it by path
    sys.path.insert(0, str(BENCHMARKS))
from study import append_line  # noqa: E402,F401  (one O_APPEND write per row, shared by the studies)

# The plan and the training live beside this file; their names are this module's too, as the
# other scripts and the tests read them (study2.SUITES, study2.plan_runs, study2.train_until, ...).
from study2_plan import *  # noqa: E402,F401,F403
from study2_plan import (CORRECTED, LR_SCHEDULE, LR_WARMUP, RESULTS, SUITES, SYNCHRONOUS, Run,  # noqa: E402,F401
                         batches_per_epoch, best_lr, correction_choice, plan_runs, shard_runs)
from study2_train import *  # noqa: E402,F401,F403
from study2_train import (ReachedStop, UntilCheckpoint, curve, drop_checkpoints, drop_halved,  # noqa: E402,F401
                          execute, has_checkpoint, missing_models, train_until)

from pipeoptim.tasks import get_task  # noqa: E402,F401

# --------------------------------------------------------------------------------------------
# the command line


def selected(run: Run, args: argparse.Namespace) -> bool:
    phases = {"sweep": ("sweep",), "seeds": ("seeds", "confirm"), "correction": ("correction",),
              "all": ("sweep", "seeds", "confirm", "correction")}
    return (run.phase in phases[args.phase] and (not args.tasks or run.task in args.tasks.split(","))
            and (not args.methods or run.variant in args.methods.split(",")))


def describe_suite(suite: Dict[str, Any]) -> List[str]:
    sweep_stages = max(suite["stages"])
    lines = [f"cells: {', '.join(f'{t} x {o}' for t, o in suite['cells'])}; N = {sweep_stages} (the sweep), "
             f"then {', '.join(str(n) for n in suite['stages'] if n != sweep_stages)}; "
             f"seeds {suite['seeds']}; {suite['lrs']} lrs, the best {suite['halving']['keep']} of each first "
             f"{suite['halving']['share']:.2g} continue"]
    for task, spec in suite["tasks"].items():
        n = batches_per_epoch(spec)
        total = n * spec["epochs"]
        stop = stop_point(n, spec["epochs"], spec["eval_every"], suite["halving"]["share"])
        lrs = "; ".join(f"{o} {', '.join(f'{lr:g}' for lr in sweep_lrs(suite, task, o))}"
                        for t, o in suite["cells"] if t == task)
        lines.append(f"{task}: {spec['model']}, {n} mini-batches of {spec['batch_size']} x {spec['epochs']} epochs = "
                     f"{total} updates, evaluated every {spec['eval_every']} on {spec['holdout']} held out, "
                     f"clip {spec['clip_grad']}; first part to update {stop}; lrs {lrs}")
    return lines


def print_plan(suite_name: str, suite: Dict[str, Any], runs: Sequence[Run]) -> None:
    print(f"suite {suite_name}")
    for line in describe_suite(suite):
        print("  " + line)
    for task, why in missing_models(suite).items():
        print(f"  note: {why}: its runs cannot start until the model exists")
    print()
    print(f"{'#':>4} {'phase':<10} {'until':<5} {'task':<10} {'optimizer':<9} {'method':<24} {'N':>2} "
          f"{'lr':>8} {'seed':>4} {'min':>6}  status")
    for run in runs:
        lr = f"{run.lr:g}" if run.lr is not None else "best" if run.until != "end" else "winner"
        print(f"{run.index:>4} {run.phase:<10} {run.until or '':<5} {run.task:<10} {run.optimizer:<9} "
              f"{run.variant:<24} {run.stages:>2} {lr:>8} {run.seed:>4} {run.minutes:>6.2f}  "
              f"{run.status}{': ' + run.why if run.why else ''}")
    print()
    groups: Dict[str, List[Run]] = {}
    for run in runs:
        name = "confirm" if run.phase == "confirm" else f"{run.task} x {run.optimizer}"
        groups.setdefault(name, []).append(run)
    print(f"{'cell':<20} {'rows':>5} {'runs':>5} {'core-min':>9}")
    for name, group in [*groups.items(), ("total", list(runs))]:
        counted = [r for r in group if r.status != "dropped"]
        trainings = [r for r in counted if r.until != "end"]  # an end continues its third's run
        print(f"{name:<20} {len(counted):>5} {len(trainings):>5} {sum(r.minutes for r in counted):>9.1f}")
    counted = [r for r in runs if r.status != "dropped"]
    total = sum(r.minutes for r in counted)
    left = sum(r.minutes for r in counted if r.status != "done")
    phases: Dict[str, int] = {}
    for run in counted:
        name = run.phase + (f" {run.until}" if run.until else "")
        phases[name] = phases.get(name, 0) + 1
    print(f"\nrows per phase: {', '.join(f'{k} {v}' for k, v in phases.items())}")
    print(f"total: {len([r for r in counted if r.until != 'end'])} runs in {len(counted)} rows, "
          f"{total:.0f} core-minutes ({total / 120:.1f} h on 2 cores); "
          f"{sum(r.status == 'done' for r in counted)} rows done, {left:.0f} core-minutes left")


def parse_shard(text: str) -> Tuple[int, int]:
    index, count = (int(x) for x in text.split("/"))
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard i/n needs 0 <= i < n, got {text}")
    return index, count


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="default", choices=list(SUITES))
    parser.add_argument("--out", type=Path, help="the study folder (default benchmarks/results/study2, "
                                                 "or study2-SUITE for another suite)")
    parser.add_argument("--plan", action="store_true",
                        help="print the planned runs, minutes each and the core-minutes, and run nothing")
    parser.add_argument("--shard", type=parse_shard, default=(0, 1),
                        help="i/n: run the runs whose place in the plan is i modulo n")
    parser.add_argument("--phase", default="all", choices=["sweep", "seeds", "correction", "all"],
                        help="sweep: the lr sweeps with halving; seeds: the seeds and the confirmations; "
                             "correction: the correction choice of pipeoptim+lr_correction on validation")
    parser.add_argument("--choice", action="store_true",
                        help="print the correction choice of every cell whose runs are in, and run nothing")
    parser.add_argument("--tasks", help="comma-separated subset of the suite's tasks")
    parser.add_argument("--methods", help="comma-separated subset of the study's methods (sequential, "
                                          "gpipe, ..., pipeoptim+lr_correction)")
    parser.add_argument("--max-runs", type=int, help="stop after this many runs")
    parser.add_argument("--wait", type=float, default=0.0,
                        help="seconds between looks for the other shards' rows when this shard's next runs "
                             "wait for them (default 0: stop, and continue on the next call)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    suite = SUITES[args.suite]
    study = args.out or RESULTS / ("study2" if args.suite == "default" else f"study2-{args.suite}")
    runs_file = study / "runs.jsonl"
    if args.plan:
        print_plan(args.suite, suite, plan_runs(suite, load_rows(runs_file)))
        return 0
    if args.choice:
        rows = load_rows(runs_file)
        for task, optimizer in suite["cells"]:
            choice = correction_choice(suite, rows, task, optimizer)
            scores = ("runs not in yet" if choice is None else f"lr {choice['lr']:g}, validation {choice['metric']}: "
                      + ", ".join(f"{v} {'diverged' if s is None else f'{s:.4f}'}" for v, s in choice["scores"].items())
                      + f"; chosen: {choice['chosen']}")
            print(f"{task} x {optimizer}: {scores}")
        return 0

    torch.set_num_threads(args.threads)
    study.mkdir(parents=True, exist_ok=True)
    (study / "suite.json").write_text(json.dumps({"suite": args.suite, **suite}, indent=2))
    blocked = missing_models(suite)
    for why in blocked.values():
        print(f"skipping its runs: {why}", flush=True)
    data_cache: Dict[Any, Any] = {}
    started, done_here = time.time(), 0
    said: List[str] = []
    while True:
        rows = load_rows(runs_file)  # other shards append to the same file
        drop_halved(suite, rows, study)
        mine = [run for run in shard_runs(plan_runs(suite, rows), args.shard)
                if selected(run, args) and run.task not in blocked]
        ready = [run for run in mine if run.status == "ready"]
        waiting = [run for run in mine if run.status == "waiting"]
        if args.max_runs is not None and done_here >= args.max_runs:
            print(f"stopped after {done_here} runs (--max-runs); {len(ready) + len(waiting)} left in this shard")
            break
        if not ready:
            reasons = sorted({f"{run.phase} {run.task} {run.optimizer}: waits for {run.why}" for run in waiting})
            if reasons != said:  # (said once, not at every look while waiting)
                for reason in reasons:
                    print(f"skipped, {reason}", flush=True)
                said = reasons
            if waiting and args.wait > 0:
                time.sleep(args.wait)
                continue
            print(f"shard {args.shard[0]}/{args.shard[1]}: "
                  f"{'nothing left to run' if not waiting else 'call again once those are in'}; "
                  f"{done_here} runs in {time.time() - started:.0f} s; rows in {runs_file}", flush=True)
            break
        run = ready[0]
        row = execute(run, suite, study, data_cache)
        append_line(runs_file, row)
        if finished(row):
            drop_checkpoints(study / row["folder"])
        done_here += 1
        result = (f"diverged ({row['diverged']})" if row["diverged"] else
                  f"validation {row['metric']} {row['validation_metric']:.4f}"
                  + (f", test {row['final_metric']:.4f}" if row["final_metric"] is not None else ""))
        print(f"[{time.time() - started:7.0f}s] {run.label()}: {result} in {row['seconds'] / 60:.1f} min "
              f"(planned {run.minutes:.1f}); {len(ready) - 1} ready, {len(waiting)} waiting", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
