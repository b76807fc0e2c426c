"""`pipeoptim plan`: profile a model, predict the methods, write a plan.

It profiles a task's model or your own, partitions it, predicts every method and micro-batch
count, recommends one and writes a plan file for `pipeoptim train --plan FILE`."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Tuple

from ..lab.optimizers import optimizer_names
from ..plan_defaults import DEFAULT_METHODS, DEFAULT_MICROBATCHES, PARTITIONERS
from ..methods import feedback_variants, method_names, split_variant
from .common import check_positive, log_for, print_json, say_default_task
from .flags import add_table_flags

DESCRIPTION = """\
Profile every layer of a model (forward, backward and update time, activation and parameter
bytes, after --warmup runs, on --device): a task's model (--task, --model), or your own
(--model-fn: any PyTorch module, a transformers model too, cut where the Pipeline would cut it,
at its blocks). Split it into --stages three ways (uniform layers, balanced parameters, balanced
profiled time) and report each split's slowest stage. Then, on the --partitioner split (default:
uniform), predict for every method and micro-batch count the throughput (the schedule simulator
with the per-stage costs of one micro-batch, measured at the micro-batch size, or scaled
linearly with --scaling linear; with --stage-timing measured, the default, each split's stages
are timed as whole stages the way a training run runs them; transfers cost bytes /
--bandwidth) and the memory of every stage (weights x the method's weight versions, gradients,
optimizer state, in-flight activations: the simulator's peak micro-batches in flight x the
profiled bytes of one micro-batch, also with activation recomputation). The chunked and
mirrored methods (interleaved, zb-v, dualpipev, bidirectional, bitpipe) are predicted on a split into
stages x their pieces, where the model is a chain of layers with that many layers with
parameters (a model the Pipeline traces, not a chain of layers, runs one piece per process).

On a busy machine: the sequential reference (the whole model as one stage) and every split's
stages are timed the same way and in turns, one mini-batch of each per round, so that other
work slows all of them alike; rounds go on from --repeats until each one's first and second
halves agree within 5 % (at most --max-rounds; the plan reports the rounds and each one's
spread), and --statistic min (the default) keeps each one's fastest round, what the machine can
do. A split whose stages add up to less than the whole model is raised to it. A candidate
predicted more than --stages times faster than the sequential reference is one no split can
give: it is flagged and not recommended. A chunked or mirrored method's pieces are timed as it
runs them (several on a process, its backward in two halves); what waiting between several
stages on a process costs is not simulated, so a plan that recommends one names the
`pipeoptim bench` that measures it against the best method with one stage per rank.

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
lists: the same table); candidates within --tie of the best are tied, and among tied ones the
study's method wins (the better model at equal time), then a synchronous method, then the smaller
largest-stage memory, then fewer micro-batches, then the earlier method in --methods. A candidate
METHOD+ef (pipeoptim-2bw+ef) is METHOD with error feedback: its time is the method's x the cost
the study measured (1.94 %), its memory two more weight copies per stage, its ratio of updates the
study's for the method with error feedback. Where no study covers the case (a
task, --model, --batch-size or --optimizer the study did not run, or --model-fn), the plan says
so in one line, recommends the fastest synchronous candidate and names the fastest asynchronous
one as the one to try with `pipeoptim compare` (your own model: by training both on your data).
The table by time to target shows, per candidate, its samples/s, its ratio of updates, its time
to target and where the ratio came from.

Tensor parallelism (--tensor-parallel T): every candidate with each stage on T processes, its
layers split by the model's own plan (a task's model: its _tp_plan; --model-fn: the model's
_tp_plan or transformers' base_model_tp_plan; an nn.Sequential only). Memory per process: the
planned layers' parameters, every weight version, gradients and optimizer state 1/T (a row-wise
layer's bias whole), the rest whole; activations as at T = 1 (an upper bound). Time: the planned
modules' share of each layer's forward time (timed module by module) runs 1/T, in the forward and
the backward alike (the update: the planned parameters' share of the stage that keeps the most,
an upper bound); per micro-batch each row-wise layer all-reduces its output in
the forward and each column-wise layer its input's gradient in the backward (a gathered output,
or a row-wise layer's whole input, is all-gathered instead), each process sending 2(T-1)/T of the
tensor's bytes for an all-reduce and (T-1)/T for an all-gather at --bandwidth (free without it),
added to the stage's pass (no overlap). The sequential reference stays one process; a candidate
may be up to N x T times faster.

Prints how the timing went (where it did not settle: what that means and what to do), the best
candidates by time to target, what the study says and the recommendation (--verbose: every
candidate, the partitions, the memory and the rule). Writes the plan (task, model, batch size,
stages, partition, method, micro-batches, predictions, per-stage memory, the profile) to --out
(default plan.json in the current folder) and says where; `pipeoptim train --plan FILE` runs a
task's plan; for your own model it prints the Pipeline call that runs it."""

MODEL_FN = """\
your own model instead of a task's: MODULE:FUNCTION (an importable module, e.g. my_models:build)
or FILE.py:FUNCTION (e.g. models/gpt.py:build). The function takes no arguments and returns
(model, batch) or (model, batch, loss): the model (any PyTorch module, e.g. a transformers
GPT-2), one mini-batch of its data as training feeds it, and the loss function. A batch that is
a dict of the model's keyword inputs with "labels", and no loss function, is a model that
computes its own loss (a transformers model's); otherwise the batch is (inputs, target) and
loss(output, target) is the loss. The plan's partition counts the model's blocks (the points it can be cut at, which
the plan lists). Not with --task, --model, --batch-size or --limit."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="profile a model and recommend a partition, method and micro-batches",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    add_table_flags(g, "task")
    g.add_argument("--model", help="model of the task (default: the task's)")
    g.add_argument("--model-fn", metavar="MODULE:FUNCTION", help=MODEL_FN)
    g.add_argument("--batch-size", type=int, help="mini-batch size (default: the task's)")
    add_table_flags(g, "limit", "seed")
    g.add_argument("--optimizer", default="adamw", choices=optimizer_names(),
                   help="optimizer whose update time and state are profiled, and whose ratios of updates to "
                        "the target (the equal-time study's, for this task) rank the candidates (default: adamw, "
                        "as pipeoptim train's recipes)")
    g = p.add_argument_group("pipeline and devices")
    g.add_argument("--stages", type=int, default=4, help="pipeline stages (default: 4)")
    g.add_argument("--device", default="cpu", help="where to profile: cpu, cuda, cuda:1 ... (default: cpu)")
    g.add_argument("--speeds", help="relative speed of each stage's device, e.g. 1,2 (stage 1 twice as "
                                    "fast); one per stage (default: all equal)")
    g.add_argument("--bandwidth", help="bytes per second of each link between stages, e.g. 1e9 or 10GB "
                                       "(default: transfers are free)")
    g.add_argument("--threads", type=int, help="torch threads while profiling (default: torch's; use the "
                                               "per-stage thread count of the run you plan)")
    add_table_flags(g, "tensor_parallel", notes={"tensor_parallel": "plan: every candidate so split, its memory per "
                                                 "process and its collectives priced at --bandwidth (the model: "
                                                 "above); pipeoptim train --plan FILE --runtime distributed "
                                                 "runs it"})
    g = p.add_argument_group("search")
    g.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="methods to consider; METHOD+ef is METHOD with error feedback, priced with its measured "
                        "cost, and METHOD+ef+aware with the prediction aware of it too, for the methods that "
                        "offer them (" + ", ".join(feedback_variants()) + ") (default: %(default)s)")
    g.add_argument("--micro-batches", default=",".join(map(str, DEFAULT_MICROBATCHES)),
                   help="micro-batch counts to consider, comma-separated (default: %(default)s)")
    g.add_argument("--partitioner", default="uniform", choices=PARTITIONERS,
                   help="split the predictions use: uniform (default, as pipeoptim train splits: equal numbers "
                        "of layers with parameters), params (balanced parameters) or time (balanced profiled "
                        "time); the plan's first table gives all three splits' slowest stage")
    g.add_argument("--memory-limit", help="bytes per stage, e.g. 2GiB; candidates above it are not recommended")
    g.add_argument("--tie", type=float, default=0.02,
                   help="relative difference in predicted time to target (in throughput where no study covers "
                        "the case) counted as a tie (default: 0.02)")
    g.add_argument("--scaling", default="measure", choices=["measure", "linear"],
                   help="per-micro-batch costs: profile each micro-batch size (measure, default) or divide "
                        "the mini-batch's by M (linear)")
    g.add_argument("--stage-timing", default="measured", choices=["measured", "profile"],
                   help="stage costs of the predictions: time each split's stages as a training run runs them "
                        "(measured, default) or add up the profiled layers (profile, faster, optimistic)")
    g.add_argument("--batches", type=int, help="mini-batches per predicted run (default: one epoch of the "
                                               "task's data; 100 with --model-fn)")
    g.add_argument("--warmup", type=int, default=2, help="untimed runs first, per layer and per split (default 2)")
    g.add_argument("--repeats", type=int, default=5,
                   help="timed runs per layer, and the fewest timed rounds of the splits (default 5)")
    g.add_argument("--max-rounds", type=int,
                   help="the most timed rounds of the splits while their halves disagree (default: 3 x --repeats)")
    g.add_argument("--statistic", default="min", choices=["median", "min"],
                   help="time kept of the runs: min (default: the fastest, what the machine can do when no "
                        "other work takes its cores) or median")
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=Path("plan.json"), help="plan file, always written and named at the "
                   "end (default: plan.json, in the current folder)")
    g.add_argument("--json", action="store_true", help="print the plan as JSON on stdout, nothing else")
    g.add_argument("--verbose", action="store_true", help="print every candidate, the partitions, the memory and "
                   "the rule (default: the recommendation and the best candidates; the plan file holds everything)")
    p.set_defaults(func=run)


def load_model_fn(spec: str) -> Tuple[Any, Any, Any]:
    """``MODULE:FUNCTION`` or ``FILE.py:FUNCTION`` -> what the function returns, as (model, batch,
    loss_fn or None); each problem a one-line ValueError naming the fix."""
    import importlib
    import importlib.util
    import sys

    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"--model-fn {spec!r} must be MODULE:FUNCTION or FILE.py:FUNCTION, e.g. my_models:build")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"--model-fn: no file {where}; give FILE.py:FUNCTION with a path from here")
        loader = importlib.util.spec_from_file_location(f"_pipeoptim_model_fn_{path.stem}", path)
        module = importlib.util.module_from_spec(loader)
        sys.path.insert(0, str(path.resolve().parent))  # the file's own imports, as `python FILE.py` finds them
        try:
            loader.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as error:
            raise ValueError(f"--model-fn: cannot import {where} ({error}); give MODULE:FUNCTION of a module on "
                             f"the Python path or in this folder, or FILE.py:FUNCTION") from None
        finally:
            sys.path.remove(str(Path.cwd()))
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"--model-fn: {where} has no function {name}; define def {name}(): return model, batch")
    made = fn()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise ValueError(f"--model-fn: {name}() returned {type(made).__name__}; return (model, batch) or "
                         f"(model, batch, loss)")
    return made[0], made[1], made[2] if len(made) == 3 else None


def run(args: argparse.Namespace) -> int:
    import torch

    from ..lab.planner import (format_plan, make_plan, parse_bytes, parse_int_list, parse_speeds, pipeline_call,
                               plan_model, write_plan)

    check_positive(args, ("stages", "batch_size", "limit", "batches", "threads", "repeats", "max_rounds",
                          "tensor_parallel"))
    if args.warmup < 0:
        raise ValueError(f"--warmup must be at least 0, got {args.warmup}")
    if args.model_fn is not None:  # (--task image, the default, is ignored)
        given = [f for f, v in (("--task", None if args.task == "image" else args.task), ("--model", args.model),
                                ("--batch-size", args.batch_size), ("--limit", args.limit)) if v is not None]
        if given:
            raise ValueError(f"--model-fn plans your own model on the batch its function returns; drop "
                             f"{', '.join(given)}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise ValueError("--methods is empty")
    for name in methods:  # a method, or one with error feedback (pipeoptim-2bw+ef, pipeoptim-2bw+ef+aware)
        try:
            split_variant(name)
        except ValueError:
            raise ValueError(f"unknown method {name}; choose from: "
                             f"{', '.join(method_names() + feedback_variants())}") from None
    microbatches = parse_int_list(args.micro_batches, "--micro-batches")
    speeds = parse_speeds(args.speeds, args.stages)
    bandwidth = None if args.bandwidth is None else parse_bytes(args.bandwidth, "--bandwidth")
    memory_limit = None if args.memory_limit is None else parse_bytes(args.memory_limit, "--memory-limit")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    log = log_for(args)
    common = dict(stages=args.stages, device=args.device, speeds=speeds, bandwidth=bandwidth, methods=methods,
                  microbatches=microbatches, memory_limit=memory_limit, partitioner=args.partitioner,
                  scaling=args.scaling, seed=args.seed, optimizer=args.optimizer, warmup=args.warmup,
                  repeats=args.repeats, max_rounds=args.max_rounds, statistic=args.statistic,
                  stage_timing=args.stage_timing, tie=args.tie, tensor_parallel=args.tensor_parallel, log=log)
    if args.model_fn is not None:
        model, batch, loss_fn = load_model_fn(args.model_fn)
        plan = plan_model(model, batch, loss_fn, batches=args.batches or 100, **common)
    else:
        say_default_task(args, log)
        plan = make_plan(task=args.task, model=args.model, batch_size=args.batch_size,
                         batches=args.batches, limit=args.limit, **common)
    path = write_plan(plan, args.out)
    wrote = f"wrote the plan to {path.resolve()} (--out FILE: another)"
    if args.json:
        log(wrote)  # on stderr: stdout holds the JSON alone
        print_json(plan)
    else:
        print(format_plan(plan, verbose=args.verbose))
        if plan["task"] is None:
            print(f"{wrote}  (run it: {pipeline_call(plan)})")
        else:
            distributed = " --runtime distributed" if plan.get("tensor_parallel", 1) > 1 else ""
            print(f"{wrote}  (run it: pipeoptim train --plan {path}{distributed})")
    return 0
