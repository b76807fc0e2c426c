"""Issue 23's study: equal time, not equal updates. Which pipeline gives the better model in the
time a synchronous one takes?

Per (task, optimizer, N), the budget B is the synchronous pipeline's predicted time for
sequential's U updates at its fastest schedule and micro-batch count, and each variant m trains
U_m = floor(B / s_m) updates (study/study3_times.py writes B, s_m and U_m into
``study/results/study3/times.json``), with the second study's recipe scaled to U_m: linear
warm-up over 5 % of U_m, cosine to 10 % of the peak at U_m, clipping where the task has it, the
validation split for tuning, an evaluation every ``eval_every`` mini-batches (the curve of the
metric against predicted time = updates x s_m), the test metric once at the end. The runs, their
lrs and their order are study3_plan.py's; the budget and its cuts docs/study_plan.md's.

A run of U_m updates is one pass over the epoch's mini-batches repeated as often as U_m needs,
the last pass cut short (a fractional last epoch): one "epoch" of U_m mini-batches in the same
order as whole epochs would give, so that the lr schedule spans exactly U_m. The asynchronous
methods drain at the evaluations only (the second study also drained at each epoch's end).

Each finished run (and each first third of a swept lr) appends one line to ``runs.jsonl`` in the
study folder (one O_APPEND write); a second call skips what is in it; a run checkpoints at its
evaluations and resumes from the last after an interruption.

Two workers share the runs (one per core): each takes the first ready run that no other worker
holds, holding an exclusive lock on the run's folder (``claim``) while it trains, so that the
work is balanced whatever the runs cost and a run never trains twice at once, however the plan
changes while they run (a place in the plan shifts when a choice adds or drops runs). The kernel
lets go of a dead worker's lock. ``--shard i/n`` still restricts a worker to the runs whose place
in the plan is i modulo n.

    .venv/bin/python -m study.study3 --plan       # every run, U_m, minutes; the core-minutes
    .venv/bin/python -m study.study3 --wait 60 &  # one worker per core
    .venv/bin/python -m study.study3 --wait 60
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import IO, Any, Dict, Iterator, List, Optional, Sequence

import torch

from study.common import RESULTS, ROOT, append_line, parse_shard
from study import study4_plan, study5_plan, study6_plan, study7_plan
from study.study2_plan import LR_SCHEDULE, stop_point
from study.study2_train import cached_data, curve, drop_checkpoints, has_checkpoint, quiet_options, train_until
from study.study3_plan import Run, load_rows, plan_runs, print_plan, row_key, shard_runs
from study.study3_suite import SUITES, study2_rows, variant_spec
from study.study3_times import TIMES, read_times, seconds_per_batch
from pipeoptim.checkpoint import checkpoint_name
from pipeoptim.errors import NonFiniteLoss
from pipeoptim.lab.config import RunConfig
from pipeoptim.lab.experiment import run_experiment
from pipeoptim.methods import get_method
from pipeoptim.lab.tasks import get_task


def passes(batches: Sequence[Any], updates: int) -> List[Any]:
    """``updates`` mini-batches: ``batches`` in order, repeated, the last pass cut short."""
    if not batches:
        raise ValueError("no training mini-batches")
    whole, rest = divmod(updates, len(batches))
    return list(batches) * whole + list(batches[:rest])


def run_config(run: Run, spec: Dict[str, Any], suite: Dict[str, Any]) -> RunConfig:
    """The run's settings: the recipe over one pass of U_m mini-batches (checkpoints at the
    evaluations, so that they add no drain of their own)."""
    method, options, micro = variant_spec(run.variant, run.stages)
    synchronous = get_method(method).synchronous
    return RunConfig(task=run.task, model=spec["model"], method=method, stages=run.stages, micro_batches=micro,
                     optimizer=run.optimizer, lr=run.lr, beta1=suite["optimizer_arms"]["beta1"].get(run.optimizer),
                     epochs=1, batch_size=spec["batch_size"], limit=spec["limit"], seed=run.seed,
                     holdout=spec["holdout"], eval_every=spec["eval_every"], checkpoint_every=spec["eval_every"],
                     lr_schedule=LR_SCHEDULE, clip_grad=spec["clip_grad"],
                     clip_scope="global" if synchronous and spec["clip_grad"] else "stage", method_options=options)


def execute(run: Run, suite: Dict[str, Any], times: Dict[str, Any], study: Path,
            data_cache: Dict[Any, Any]) -> Dict[str, Any]:
    """Train ``run`` (a whole run, a first third, or the rest of one) and return its row."""
    spec = suite["tasks"][run.task]
    task = get_task(run.task)
    cfg = run_config(run, spec, suite)
    resolved = cfg.resolved(task)
    whole = cached_data(data_cache, run.task, run.seed, task, resolved)
    data = dataclasses.replace(whole, train=passes(whole.train, run.updates))
    folder = study / "runs" / run.folder_name()
    seconds = seconds_per_batch(times, run.task, run.optimizer, run.stages, run.variant)
    row: Dict[str, Any] = {**run.key_fields(), "method": cfg.method, "options": cfg.method_options,
                           "microbatches_asked": cfg.micro_batches, "beta1": cfg.beta1, "model": spec["model"],
                           "batch_size": resolved.batch_size, "updates": run.updates,
                           "epochs": run.updates / len(whole.train), "eval_every": spec["eval_every"],
                           "clip_grad": spec["clip_grad"], "lr_schedule": LR_SCHEDULE, "lr_source": run.lr_source,
                           "seconds_per_batch": seconds, "metric": task.metric,
                           "higher_is_better": task.higher_is_better, "folder": str(folder.relative_to(study))}
    quiet = quiet_options(task, cfg.method, suite["diagnose_every"])
    started, cpu_started = time.time(), time.process_time()
    try:
        if run.until == "third":
            stop = stop_point(run.updates, 1, spec["eval_every"], suite["halving"]["share"])
            manifest = folder / "checkpoints" / checkpoint_name(0, stop) / "manifest.json"
            row["resumed"], state = train_until(cfg, folder, data, manifest, run.label(), quiet)
            evaluations = state["evaluations"]
            row.update(diverged=None, stopped_at=stop, final_metric=None,
                       validation_metric=evaluations[-1]["metric"], evaluations=curve(evaluations),
                       train_seconds=round(state["train_seconds"], 1))
        else:
            row["resumed"] = has_checkpoint(folder)
            summary = run_experiment(cfg, out_dir=folder, resume=row["resumed"], data=data, **quiet)
            evaluations = summary["evaluations"]
            row.update(diverged=None, final_metric=summary["final_metric"],
                       validation_metric=summary["validation_metric"], best_validation=summary["best_metric"],
                       evaluations=curve(evaluations), final_loss=summary["final_loss"],
                       prediction_error=[e.get("prediction_error") for e in summary["epochs_detail"]],
                       weight_copies=summary["weight_copies"], microbatches=summary["microbatches"],
                       resolved_options=summary["options"])
    except NonFiniteLoss as error:  # a diverged run is a result, not a failure
        row.update(diverged=str(error), final_metric=None, validation_metric=None)
    row["seconds"] = round(time.time() - started, 1)
    # (what the run cost the machine: a run sharing the cores takes longer on the wall clock, not
    # in CPU time; one thread, so CPU seconds are core-seconds)
    row["cpu_seconds"] = round(time.process_time() - cpu_started, 1)
    return row


CLAIM = ".claim"


@contextlib.contextmanager
def claim(folder: Path) -> Iterator[Optional[IO[str]]]:
    """Hold ``folder``'s run for this process: yields the lock file, or None when another worker
    holds it. An ``flock`` rather than a file's existence: the kernel releases it when its holder
    dies, so an interrupted worker leaves nothing stale to clean up."""
    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / CLAIM, "a")  # (not "w": a look must not empty the holder's file)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield None
            return
        handle.truncate(0)
        handle.write(f"{os.getpid()}\n")  # (for a person looking: who holds the run)
        handle.flush()
        yield handle
    finally:
        handle.close()  # (closing releases the lock)


def held_elsewhere(folder: Path) -> bool:
    """Whether another worker holds ``folder``'s run now."""
    if not (folder / CLAIM).exists():
        return False
    with claim(folder) as mine:
        return mine is None


def drop_halved(runs: Sequence[Run], study: Path) -> None:
    """Delete the checkpoints of the first thirds the halving did not keep (once it has chosen)."""
    undecided = {(r.task, r.optimizer, r.variant, r.stages) for r in runs if r.until == "end" and r.lr is None}
    kept = {(r.task, r.optimizer, r.variant, r.stages, r.lr) for r in runs if r.until == "end"}
    for r in runs:
        if (r.until == "third" and r.status == "done" and (r.task, r.optimizer, r.variant, r.stages) not in undecided
                and (r.task, r.optimizer, r.variant, r.stages, r.lr) not in kept):
            drop_checkpoints(study / "runs" / r.folder_name())


def selected(run: Run, args: argparse.Namespace) -> bool:
    return ((not args.tasks or run.task in args.tasks.split(","))
            and (not args.methods or run.variant in args.methods.split(","))
            and (not args.stages or run.stages in (1, *map(int, args.stages.split(",")))))


def json_keys(value: Any) -> Any:
    """``value`` with every tuple key of its dicts written as "a/b" (the suite keys its lr grids by
    (task, optimizer)), so that it can be written as JSON."""
    if isinstance(value, dict):
        return {"/".join(map(str, k)) if isinstance(k, tuple) else k: json_keys(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_keys(v) for v in value]
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="default", choices=list(SUITES))
    parser.add_argument("--out", type=Path, help="the study folder (default study/results/study3)")
    parser.add_argument("--times", type=Path, help=f"B, s_m and U_m (default {TIMES.relative_to(ROOT)})")
    parser.add_argument("--plan", "--dry-run", dest="plan", action="store_true",
                        help="print every run, its U_m and minutes, and the core-minutes; run nothing")
    parser.add_argument("--budget-minutes", type=float, default=1200.0, help="core-minutes the plan must fit")
    parser.add_argument("--shard", type=parse_shard, default=(0, 1), help="i/n: the runs whose place is i mod n")
    parser.add_argument("--tasks", help="comma-separated subset of the tasks")
    parser.add_argument("--methods", help="comma-separated subset of the variants")
    parser.add_argument("--stages", help="comma-separated subset of N (sequential always)")
    parser.add_argument("--first", help="comma-separated task/optimizer cells or variants whose ready runs go first "
                                        "(in the plan's order within), e.g. lm/muon: what a short day should finish")
    parser.add_argument("--max-runs", type=int, help="stop after this many runs")
    parser.add_argument("--wait", type=float, default=0.0,
                        help="seconds between looks for the other shard's rows a run waits for (0: stop)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    suite = SUITES[args.suite]
    study = args.out or RESULTS / ("study3" if args.suite == "default" else f"study3-{args.suite}")
    times = read_times(args.times or Path(suite.get("times") or TIMES))
    rows2 = study2_rows(suite)
    runs_file = study / "runs.jsonl"
    planner = plan_runs
    if suite.get("planner") == "delay_fixes":  # issue 38's arm: planned over issue 23's rows
        rows2 = load_rows(Path(suite["study3"]) / "runs.jsonl")
        times = study4_plan.alias_times(times)
        planner = study4_plan.plan_runs
    elif suite.get("planner") == "translation":  # issue 41's cell: tuned afresh
        times = study4_plan.alias_times(times)
        planner = study5_plan.plan_runs
    elif suite.get("planner") == "feedback":  # issue 51's arms: over the earlier arms' rows
        times, rows2 = study6_plan.inputs(suite, times)
        planner = study6_plan.plan_runs
    elif suite.get("planner") == "confirm":  # issue 61's confirmation: over every earlier arm's rows
        times, rows2 = study7_plan.inputs(suite, times)
        planner = study7_plan.plan_runs
    if args.plan:
        budget = suite.get("budget_minutes", args.budget_minutes)
        runs = planner(suite, load_rows(runs_file), times, rows2)
        print_plan(runs, budget)
        if planner is study6_plan.plan_runs:
            study6_plan.print_cuts(runs)
        return 0
    torch.set_num_threads(args.threads)
    study.mkdir(parents=True, exist_ok=True)
    (study / "suite.json").write_text(json.dumps(json_keys({"suite": args.suite, **suite}), indent=2, default=str))
    data_cache: Dict[Any, Any] = {}
    started, done_here, said = time.time(), 0, ""
    while True:
        rows = load_rows(runs_file)
        everything = planner(suite, rows, times, rows2)
        drop_halved(everything, study)
        mine = [r for r in shard_runs(everything, args.shard) if selected(r, args)]
        ready = [r for r in mine if r.status == "ready"]
        busy = [r for r in ready if held_elsewhere(study / "runs" / r.folder_name())]
        ready = [r for r in ready if r not in busy]
        if args.first:  # (a stable sort: the plan's order within each group)
            first = set(args.first.split(","))
            ready.sort(key=lambda r: not {f"{r.task}/{r.optimizer}", r.variant} & first)
        waiting = [r for r in mine if r.status == "waiting"] + busy
        if args.max_runs is not None and done_here >= args.max_runs:
            print(f"stopped after {done_here} runs (--max-runs)")
            break
        if not ready:
            reasons = "; ".join(sorted({f"{r.task} {r.optimizer} waits for {r.why or 'another worker'}"
                                        for r in waiting}))
            if reasons and reasons != said:
                print(f"skipped: {reasons}", flush=True)
                said = reasons
            if waiting and args.wait > 0:
                time.sleep(args.wait)
                continue
            print(f"shard {args.shard[0]}/{args.shard[1]}: {'nothing left to run' if not waiting else 'call again'}"
                  f"; {done_here} runs in {time.time() - started:.0f} s; rows in {runs_file}", flush=True)
            break
        run = ready[0]
        with claim(study / "runs" / run.folder_name()) as mine:
            if mine is None:  # another worker took it since the look above
                continue
            if row_key(run.key_fields()) in load_rows(runs_file):  # and finished it
                continue
            row = execute(run, suite, times, study, data_cache)
            append_line(runs_file, row)
            if row["diverged"] or run.until != "third":
                drop_checkpoints(study / row["folder"])
        done_here += 1
        result = row["diverged"] or f"validation {row['validation_metric']:.4f}"
        print(f"[{time.time() - started:7.0f}s] {run.label()}: {result} in {row['seconds'] / 60:.1f} min "
              f"(planned {run.minutes:.1f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
