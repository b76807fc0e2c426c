"""`pipeoptim plan`: profile a task's model, partition it, predict every method and
micro-batch count, recommend one and write a plan file for `pipeoptim train --plan FILE`."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..lab.optimizers import optimizer_names
from ..plan_defaults import DEFAULT_METHODS, DEFAULT_MICROBATCHES, PARTITIONERS
from .common import check_positive, known_methods, log_for, print_json, refuse_traced_model
from .flags import add_table_flags

DESCRIPTION = """\
Profile every layer of a task's model (forward, backward and update time, activation and
parameter bytes; median of --repeats after --warmup, on --device), split it into --stages
three ways (uniform layers, balanced parameters, balanced profiled time) and report each
split's slowest stage. Then, on the --partitioner split (default: time), predict for every
method and micro-batch count the throughput (the schedule simulator with the profiled
per-stage costs of one micro-batch, measured at the micro-batch size, or scaled linearly with
--scaling linear; with --stage-timing measured, the default, each split's stages are then
timed as whole stages the way the runtime runs them; transfers cost bytes / --bandwidth) and the memory of every stage (weights x
the method's weight versions, gradients, optimizer state, in-flight activations: the simulator's
peak micro-batches in flight x the profiled bytes of one micro-batch, also with recomputation,
"activations_recompute" in the JSON). The chunked methods (interleaved, zb-v) are predicted on a
split into stages x 2 pieces, where the model has that many layers with parameters.

Recommendation rule: by predicted time to a model as good as synchronous training's, not by
samples per second alone. A candidate's time to target is its predicted seconds per mini-batch
times the updates it needs to reach 99 % of sequential's validation metric (101 % for
perplexity): the synchronous pipeline's updates in the equal-time study (docs/results.md) for
the task, --optimizer and the studied N nearest --stages, times the method's ratio to them as the
study measured it (1 for a synchronous method: gpipe, 1f1b-flush, zb-h1, interleaved, zb-v
compute the updates of non-pipelined training; "never reached" where the study saw that; unknown
where it did not run the method at that micro-batch count). Among the candidates whose largest
stage memory fits --memory-limit (all, without a limit), the shortest time to target is
recommended, taking an asynchronous method only where the study's advice for the task and N
recommends it with this optimizer (the advice `pipeoptim compare` ends with and the README
lists: the same table); candidates within --tie of the best are tied, and among tied ones a
synchronous method wins, then the study's method, then the smaller largest-stage memory, then
fewer micro-batches, then the earlier method in --methods. Where no study covers the case (a
task, --model, --batch-size or --optimizer the study did not run), the plan says so in one
line, recommends the fastest synchronous candidate and names the fastest asynchronous one as
the one to try with `pipeoptim compare`. The table by time to target shows, per candidate, its
samples/s, its ratio of updates, its time to target and where the ratio came from.

Writes the plan (task, model, batch size, stages, partition, method, micro-batches,
predictions, per-stage memory, the profile) to --out; `pipeoptim train --plan FILE` runs it."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="profile a model and recommend a partition, method and micro-batches",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("task")
    add_table_flags(g, "task")
    g.add_argument("--model", help="model of the task (default: the task's)")
    g.add_argument("--batch-size", type=int, help="mini-batch size (default: the task's)")
    add_table_flags(g, "limit", "seed")
    g.add_argument("--optimizer", default="momentum", choices=optimizer_names(),
                   help="optimizer whose update time and state are profiled, and whose ratios of updates to "
                        "the target (the equal-time study's, for this task) rank the candidates (default: momentum)")
    g = p.add_argument_group("pipeline and devices")
    g.add_argument("--stages", type=int, default=4, help="pipeline stages (default: 4)")
    g.add_argument("--device", default="cpu", help="where to profile: cpu, cuda, cuda:1 ... (default: cpu)")
    g.add_argument("--speeds", help="relative speed of each stage's device, e.g. 1,2 (stage 1 twice as "
                                    "fast); one per stage (default: all equal)")
    g.add_argument("--bandwidth", help="bytes per second of each link between stages, e.g. 1e9 or 10GB "
                                       "(default: transfers are free)")
    g.add_argument("--threads", type=int, help="torch threads while profiling (default: torch's; use the "
                                               "per-stage thread count of the run you plan)")
    g = p.add_argument_group("search")
    g.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="methods to consider (default: %(default)s)")
    g.add_argument("--microbatches", default=",".join(map(str, DEFAULT_MICROBATCHES)),
                   help="micro-batch counts to consider (default: %(default)s)")
    g.add_argument("--partitioner", default="time", choices=PARTITIONERS,
                   help="split the predictions use (default: time)")
    g.add_argument("--memory-limit", help="bytes per stage, e.g. 2GiB; candidates above it are not recommended")
    g.add_argument("--tie", type=float, default=0.02,
                   help="relative difference in predicted time to target (in throughput where no study covers "
                        "the case) counted as a tie (default: 0.02)")
    g.add_argument("--scaling", default="measure", choices=["measure", "linear"],
                   help="per-micro-batch costs: profile each micro-batch size (measure, default) or divide "
                        "the mini-batch profile by M (linear)")
    g.add_argument("--stage-timing", default="measured", choices=["measured", "profile"],
                   help="stage costs of the predictions: time each split's stages as the runtime runs them "
                        "(measured, default) or add up the profiled layers (profile, faster, optimistic)")
    g.add_argument("--batches", type=int, help="mini-batches per predicted run (default: one epoch of the data)")
    g.add_argument("--warmup", type=int, default=2, help="unmeasured runs per layer (default 2)")
    g.add_argument("--repeats", type=int, default=5, help="measured runs per layer (default 5)")
    g.add_argument("--statistic", default="median", choices=["median", "min"],
                   help="time kept of the repeats: median (default) or min (on a machine shared with "
                        "other jobs, closer to what the device can do)")
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=Path("plan.json"), help="plan file (default: plan.json)")
    g.add_argument("--json", action="store_true", help="print the plan as JSON on stdout, nothing else")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..lab.planner import format_plan, make_plan, parse_bytes, parse_int_list, parse_speeds, write_plan

    check_positive(args, ("stages", "batch_size", "limit", "batches", "threads", "repeats"))
    if args.warmup < 0:
        raise ValueError(f"--warmup must be at least 0, got {args.warmup}")
    refuse_traced_model(args.task, args.model, "plan")
    methods = known_methods(args.methods)
    microbatches = parse_int_list(args.microbatches, "--microbatches")
    speeds = parse_speeds(args.speeds, args.stages)
    bandwidth = None if args.bandwidth is None else parse_bytes(args.bandwidth, "--bandwidth")
    memory_limit = None if args.memory_limit is None else parse_bytes(args.memory_limit, "--memory-limit")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    log = log_for(args)
    plan = make_plan(task=args.task, model=args.model, stages=args.stages, device=args.device, speeds=speeds,
                     bandwidth=bandwidth, batch_size=args.batch_size, methods=methods,
                     microbatches=microbatches, memory_limit=memory_limit, partitioner=args.partitioner,
                     scaling=args.scaling, batches=args.batches, limit=args.limit, seed=args.seed,
                     optimizer=args.optimizer, warmup=args.warmup, repeats=args.repeats,
                     statistic=args.statistic, stage_timing=args.stage_timing, tie=args.tie, log=log)
    path = write_plan(plan, args.out)
    if args.json:
        print_json(plan)
    else:
        print(format_plan(plan))
        print(f"plan: {path}  (run it: pipeoptim train --plan {path})")
    return 0

