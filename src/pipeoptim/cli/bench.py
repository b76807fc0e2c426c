"""`pipeoptim bench`: the methods' throughput, measured under torchrun.

One run starts one process per pipeline rank (torchrun on this machine, one compute thread each) and
times, inside the workers, every method in turn through ``pipeoptim.Pipeline`` (one stage per
process, as a user's script under torchrun) on the same model, data and partition, beside
the single-process ``sequential`` run of the same model on one device (on CPU: one thread,
``sequential-1dev``) and on all cores (``sequential-all``). Process start-up is not timed: each
run first trains ``--warmup`` mini-batches, then ``--repeats`` rounds time every run on
``--batches`` mini-batches in turn (from a barrier to the last stage's end; each includes the
pipeline's fill and drain, and starts from fresh weights); the median round is reported, with
the interquartile range of the rounds' throughput, and per stage its time per pass and, per
mini-batch, its compute time, the time it waited on each link and the bytes each carried. The
runs take turns, in an order rotated from round to round (no run always follows the same one),
so that other work on the machine hits all of them alike; the CPU share of each
process (its CPU time over the wall time) shows whether it had its core.

The default model, ``blocks``, is built so that every stage does the same work: on the
flattened image, four fully connected blocks (linear + ReLU, 512 wide) per stage and a linear
head of 10 classes on the last stage. The first block maps the 784 pixels to 512 features;
it computes no input gradient, and its larger input (784/512 ~ 3/2) makes its forward and
weight gradient cost what another block's forward, input gradient and weight gradient cost
(measured: stage times within 2-4% of each other). The workers run
:mod:`pipeoptim.lab.bench_worker`; this module parses, starts them and prints. ``--model NAME`` benches one of the task's
own models instead, split by ``--partitioner``.

``--recompute``, ``--compile [BACKEND]`` and ``--shard-replicas`` are the flags of ``pipeoptim
train``: each turns its setting on for every method. ``--ablate`` names settings to compare
instead: each method runs without and with each of them (every combination), beside one
another in the same rounds.

Per run and stage it also reports the peak of activations held, measured from the tensors the
stage keeps (``runtime/held.py``, not the process's memory) against the prediction (the
simulator's peak count of micro-batches in flight x the profiled bytes one micro-batch holds);
``--ablate recompute`` runs every method with and without activation recomputation (the second
named 'METHOD+recompute').

With ``--data-parallel D``, ``--ablate shard-replicas`` runs every method with its stages replicated
and sharded over their D replicas (torch's FSDP2, ``Pipeline(shard_replicas=True)``; the runs
named 'METHOD xD sharded'): the training state table shows each process's bytes (parameters,
gradients, optimizer state, weights against their closed form), a sharded stage's about 1/D.

``--ablate compile`` runs every method eagerly and with each stage's forward compiled (with
``--compile``'s backend, inductor where it names none; the runs named 'METHOD compiled', each
compiled on an untimed mini-batch first), and reports each compiled run against its eager twin.

``--tensor-parallel T`` splits every stage over T processes (N x D x T in all; torch's tensor
parallelism by the model's own plan: the blocks model's pairs of blocks column-wise then
row-wise, a task's model its ``_tp_plan``; the runs named 'METHOD tpT'): the state table shows
each process's bytes, the planned layers' about 1/T. ``--ablate tensor-parallel`` runs every
method at T = 1 too, in a job of N x D processes of its own before the T one (the rounds take
turns within a job, not across the two), and reports each 'METHOD tpT' against its twin.

Writes ``benchmarks/results/bench-<time>.json`` (``--out`` for another file); ``--json`` prints
``{"samples_per_second": {"sequential-1dev": x, "sequential-all": y, "<method>": z, ...},
"ratios": {...}, "settings": {...}, "detail": {"<method>": {..., "activations": [{"measured_bytes",
"measured_in_flight", "predicted_bytes", "predicted_in_flight", ...} per stage]}}, ...}``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

from ..errors import interrupt_on_signals
from ..lab.bench_worker import COMPILED_SUFFIX, SHARDED_SUFFIX, TENSOR_SUFFIX
from ..lab.optimizers import optimizer_names
from .common import check_positive, known_methods, refuse_traced_model
from .flags import add_table_flags

DEFAULT_METHODS = "gpipe,1f1b-flush,zb-h1,interleaved,zb-v,async-naive,pipedream,pipedream-2bw,spectrain,xpipe,pipeoptim,pipeoptim-2bw"
ASYNC_1F1B = ("async-naive", "pipedream", "spectrain", "pipeoptim")  # one micro-batch per update


#: what --ablate compares, by its flag's name -> the setting of the workers' spec (tensor-parallel:
#: a job of its own at T = 1, the process count being another)
ABLATIONS = {"compile": "compile", "recompute": "recompute", "shard-replicas": "shard_replicas",
             "tensor-parallel": "tensor_parallel"}


def ablations(text: str) -> List[str]:
    """--ablate: comma-separated names of :data:`ABLATIONS` (an unknown one refused with the choices)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ABLATIONS]
    if unknown or not names:
        raise ValueError(f"--ablate takes comma-separated settings of {', '.join(ABLATIONS)}, got {text!r}")
    return list(dict.fromkeys(names))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure the methods' throughput on the distributed runtime",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    add_table_flags(p, "task")
    p.add_argument("--model", default=None,
                   help="blocks (the default with --task image: identical blocks, so that every stage does the "
                        "same work and the runs compare the methods, not the split) or a model of the task "
                        "(the default of the other tasks: the task's)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated methods to time (default: every pipelined method, %(default)s; "
                        "sequential is timed as the baselines)")
    p.add_argument("--stages", type=int, default=2,
                   help="pipeline stages, one process each (default: 2, so that each process of a two-core "
                        "machine has a core of its own)")
    p.add_argument("--data-parallel", type=int, default=None, metavar="D",
                   help="D replicas of the pipeline (stages x D processes), each on its shard of "
                        "every mini-batch, the runs named 'METHOD xD'; with --stages 1, the whole model "
                        "data parallel ('sequential xD'). Default: 1")
    p.add_argument("--batches", type=int, default=32,
                   help="timed mini-batches per run (default: 32; every run times the same number, not an epoch)")
    p.add_argument("--warmup", type=int, default=2, help="untimed mini-batches first (default: 2)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed rounds, the runs taking turns; the median is reported with the "
                        "interquartile range (default: 5)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="mini-batch size (default: 512 for blocks, else the task's)")
    add_table_flags(p, "micro_batches", "partitioner", "recompute", "compile", "shard_replicas", "tensor_parallel",
                    notes={
        "partitioner": "a model of the task's; the blocks model has its own balanced split",
        "recompute": "in every method's runs; the report's memory table shows per stage the peak of "
                     "activations held, measured and predicted",
        "compile": "a compiled run first trains one untimed mini-batch, in which it compiles",
        "shard_replicas": "the report's state table shows each process's bytes of parameters, gradients, "
                          "optimizer state and weights",
        "tensor_parallel": "every method's runs (named 'METHOD tpT'); the blocks model splits each pair of blocks "
                           "column-wise then row-wise, a task's model by its own plan; the state table shows each "
                           "process's bytes, the planned layers' about 1/T"})
    p.add_argument("--ablate", default="", metavar="SETTING,...",
                   help="run each method without and with each of these settings (every combination), "
                        "beside one another: compile (the runs named 'METHOD compiled'; with --compile's "
                        "backend, default inductor), recompute ('METHOD+recompute'), shard-replicas "
                        "('METHOD xD sharded'), tensor-parallel (T = 1 beside --tensor-parallel T's 'METHOD "
                        "tpT', in a job of its own first); default: none")
    p.add_argument("--optimizer", default="adamw", choices=optimizer_names(), help="default: adamw")
    p.add_argument("--lr", type=float, default=0.01,
                   help="learning rate (default: 0.01; the speed does not depend on it, so bench takes "
                        "neither the recipe's nor a tuned one)")
    p.add_argument("--synthetic", action="store_true",
                   help="random inputs of the task's shape instead of the data set (images; lm: token ids; "
                        "speed does not depend on the values; for machines without the data)")
    p.add_argument("--no-baselines", action="store_true", help="skip the two sequential runs")
    add_table_flags(p, "timeout")
    p.add_argument("--out", type=Path, default=None, help="results file (default: benchmarks/results/bench-<time>.json)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout, nothing else")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> List[str]:
    args.ablate = ablations(args.ablate) if args.ablate else []
    check_positive(args, ("stages", "batches", "repeats", "batch_size", "micro_batches", "data_parallel"))
    if args.warmup < 0:
        raise ValueError(f"--warmup must be at least 0, got {args.warmup}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be positive, got {args.timeout}")
    methods = [m for m in known_methods(args.methods) if m != "sequential"]  # it is the baseline
    if args.synthetic and args.task not in ("image", "lm"):
        raise ValueError("--synthetic makes random images or token ids: use it with --task image or lm")
    if args.model is None:
        from ..lab.tasks import get_task

        args.model = "blocks" if args.task == "image" else get_task(args.task).default_model
    if args.model == "blocks" and args.task != "image":
        raise ValueError("the blocks model reads images: use --task image, or --model NAME of the task")
    _check_tensor(args)
    if args.shard_replicas or "shard-replicas" in args.ablate:
        flag = "--shard-replicas" if args.shard_replicas else "--ablate shard-replicas"
        if (args.data_parallel or 1) < 2:
            raise ValueError(f"{flag} shards each stage over its replicas: give --data-parallel D with D >= 2")
        if args.optimizer == "muon":
            raise ValueError(f"{flag} with --optimizer muon: Muon orthogonalizes each whole matrix, which a "
                             f"sharded stage holds in pieces; drop {flag} or use another optimizer")
    return methods


def _check_tensor(args: argparse.Namespace) -> None:
    """--tensor-parallel T (and --ablate tensor-parallel) beside the other flags."""
    tensor = args.tensor_parallel
    if tensor < 1:
        raise ValueError(f"--tensor-parallel must be at least 1, got {tensor}")
    if "tensor-parallel" in args.ablate and tensor < 2:
        raise ValueError("--ablate tensor-parallel runs each method at T = 1 and at --tensor-parallel T: give "
                         "--tensor-parallel T with T >= 2")
    if tensor == 1:
        return
    for flag, given in (("--shard-replicas", args.shard_replicas or "shard-replicas" in args.ablate),
                        ("--compile", args.compile or "compile" in args.ablate)):
        if given:
            raise ValueError(f"--tensor-parallel and {flag} do not run together yet: drop one of them")
    if args.optimizer == "muon":
        raise ValueError("--tensor-parallel with --optimizer muon: Muon orthogonalizes each whole matrix, which a "
                         "split stage holds in pieces; drop --tensor-parallel or use another optimizer")
    from ..lab.bench_worker import BLOCKS_PER_STAGE, bench_data, blocks_model
    from ..lab.experiment import check_tensor_planned, check_tensor_split

    if args.model == "blocks":  # (its pairs of blocks stay on one stage, BLOCKS_PER_STAGE being even)
        model, name = blocks_model(args.stages, per_stage=BLOCKS_PER_STAGE), "the blocks model"
    else:
        check_tensor_planned(args.task, args.model, tensor, "bench")
        spec = {"task": args.task, "batch_size": args.batch_size, "synthetic": args.synthetic}
        task, _, _, data = bench_data(spec, 1)
        model, name = task.build_model(args.model, data, seed=0), f"{args.task}'s model {args.model}"
    check_tensor_split(model, tensor, name)


def run(args: argparse.Namespace) -> int:
    methods = _check(args)
    if args.model != "blocks":
        refuse_traced_model(args.task, args.model, "bench")
    from ..lab.launcher import run_workers, torchrun_env

    replicas = args.data_parallel or 1
    if args.stages < 2 and replicas < 2:
        raise ValueError("a pipeline needs --stages 2 or more (or --stages 1 --data-parallel D)")
    if args.stages == 1:
        methods = ["sequential"]  # the replicas of the whole model: sequential, data parallel
    if args.batch_size is not None and args.batch_size % replicas:
        raise ValueError(f"--batch-size {args.batch_size} does not split into {replicas} equal shards")
    batch = args.batch_size or (512 if args.model == "blocks" else None)
    out = args.out or Path("benchmarks") / "results" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    load_before = os.getloadavg()
    spec = {"kind": "bench", "task": args.task, "model": args.model, "methods": methods,
            "data_parallel": replicas, "tensor_parallel": args.tensor_parallel,
            "stages": args.stages, "batches": args.batches, "warmup": args.warmup,
            "repeats": args.repeats, "batch_size": batch, "micro_batches": args.micro_batches,
            "partitioner": args.partitioner, "optimizer": args.optimizer, "lr": args.lr,
            "recompute": args.recompute, "shard_replicas": args.shard_replicas,
            "compile": args.compile or ("inductor" if "compile" in args.ablate else False),
            "ablate": [ABLATIONS[name] for name in args.ablate],
            "synthetic": args.synthetic, "baselines": not args.no_baselines,
            "timeout": args.timeout, "verbose": not args.json}
    # --ablate tensor-parallel: a job at T = 1 (with the baselines) before the T one
    tensors = [1, args.tensor_parallel] if "tensor-parallel" in args.ablate else [args.tensor_parallel]
    busy_before, ours_before, wall_before = _machine_busy(), _children_cpu(), time.monotonic()
    results = []
    for job, tensor in enumerate(tensors):
        job_spec = dict(spec, tensor_parallel=tensor, baselines=spec["baselines"] and job == 0)
        processes = args.stages * replicas * tensor
        log(f"bench: {processes} processes ({args.stages} stages x {replicas} replicas"
            + (f" x {tensor} tensor ranks" if tensor > 1 else "") + f"), methods {', '.join(methods)}; timing "
            f"inside the workers")
        found = _run_job(job_spec, processes, run_workers, torchrun_env)
        if found == 2:
            return 2
        if isinstance(found, str):
            print(f"pipeoptim bench: error: the workers failed ({found}); see above", file=sys.stderr)
            return 1
        results.append(found)
    busy_after, ours_after, wall = _machine_busy(), _children_cpu(), time.monotonic() - wall_before
    result = merge_jobs(results)
    result["load_average"] = {"before": list(load_before), "after": list(os.getloadavg())}
    if busy_before is not None and busy_after is not None:
        # CPU time the whole machine spent busy during the bench, less this bench's own processes
        other = max(0.0, (busy_after - busy_before) - (ours_after - ours_before))
        result["other_work"] = {"cpu_seconds": round(other, 2), "wall_seconds": round(wall, 2),
                                "cores_busy_on_average": round(other / wall, 2)}
    result["ratios"] = ratios(result["samples_per_second"], methods)
    out.parent.mkdir(parents=True, exist_ok=True)
    result["out"] = str(out)
    out.write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_report(result))
    return 0


def _run_job(spec: Dict[str, Any], processes: int, run_workers: Any, env: Any) -> Any:
    """One job of the bench's workers: its results, a string naming the ranks that failed, or 2
    where each failed on bad input (which rank 0 said)."""
    with tempfile.TemporaryDirectory(prefix="pipeoptim-bench-") as tmp:
        spec = dict(spec, result=str(Path(tmp) / "result.json"))
        config = Path(tmp) / "bench.json"
        config.write_text(json.dumps(spec))
        with interrupt_on_signals():  # Ctrl-C, SIGTERM: the workers are stopped, one line, 128 + signal
            failures = run_workers(processes, "pipeoptim.lab.stage_worker", [str(config)], env(1))
        if failures.get(0, (0, ""))[0] == 2:
            return 2  # bad input the workers found: rank 0 said it in one line
        if failures:
            return ", ".join(f"rank {r}: " + (sig or f"exit status {code}") for r, (code, sig) in failures.items())
        return json.loads(Path(spec["result"]).read_text())


def merge_jobs(results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The results of the bench's jobs as one (``--ablate tensor-parallel``: the T = 1 job's runs
    and then the T one's; the settings the last job's, with every job's tensor ranks and processes)."""
    merged = dict(results[-1])
    merged["samples_per_second"] = {k: v for r in results for k, v in r["samples_per_second"].items()}
    merged["detail"] = {k: v for r in results for k, v in r["detail"].items()}
    merged["settings"] = dict(results[-1]["settings"], jobs=[
        {"tensor_parallel": r["settings"].get("tensor_parallel", 1), "processes": r["settings"]["processes"]}
        for r in results])
    return merged


def _machine_busy():
    """Seconds of CPU time the machine has spent busy (all cores, all processes), or None."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    """CPU seconds used by this process's finished (waited-for) descendants: the bench's."""
    t = os.times()
    return t.children_user + t.children_system


def ratios(sps: Dict[str, float], methods: List[str]) -> Dict[str, float]:
    """The ratios worth reading: each run against the baselines, pipeoptim against async-naive,
    the asynchronous 1F1B methods against gpipe, each sharded run against its replicated twin,
    each compiled run against its eager twin and each tensor-parallel run against its T = 1 twin."""
    out: Dict[str, float] = {}
    runs = [name for name in sps if not name.startswith("sequential-")]
    for base in ("sequential-1dev", "sequential-all"):
        if base in sps:
            for m in runs:
                out[f"{m}/{base}"] = sps[m] / sps[base]
    if "pipeoptim" in sps and "async-naive" in sps:
        out["pipeoptim/async-naive"] = sps["pipeoptim"] / sps["async-naive"]
    if "gpipe" in sps:
        for m in methods:
            if m in ASYNC_1F1B and m in sps:
                out[f"{m}/gpipe"] = sps[m] / sps["gpipe"]
    for suffix in (SHARDED_SUFFIX, COMPILED_SUFFIX, TENSOR_SUFFIX):  # each variant against its plain twin
        for name in runs:
            twin = re.sub(suffix.format(r"\d+") if "{" in suffix else re.escape(suffix), "", name)
            if twin != name and twin in sps:
                out[f"{name}/{twin}"] = sps[name] / sps[twin]
    return out


def format_memory(result: Dict[str, Any]) -> List[str]:
    """Per run and model stage: the peak of activations held, measured (KiB, micro-batches in
    flight) against the prediction (the simulator's in-flight count x the profiled bytes of one
    micro-batch); and the training state's bytes (runtime/state_memory.py), the weights against
    their closed form."""
    lines = ["peak activations held per stage, KiB (micro-batches in flight): measured / predicted"]
    for name, d in result["detail"].items():
        cells = []
        for a in d.get("activations", []):
            pred = (f"{a['predicted_bytes'] / 1024:.0f} ({a['predicted_in_flight']})"
                    if "predicted_bytes" in a else "-")
            cells.append(f"{a['measured_bytes'] / 1024:.0f} ({a['measured_in_flight']}) / {pred}")
        if cells:
            lines.append(f"  {name}: " + "; ".join(cells))
    lines.append("training state per stage, KiB of one process (a sharded stage: its shard; a tensor-parallel "
                 "stage: its tensor rank's part): [parameters] weights measured / closed form (parameters x the "
                 "design's versions), + gradients + optimizer state")
    for name, d in result["detail"].items():
        cells = [f"[{m['parameters'] / 1024:.0f}] {m['weights'] / 1024:.0f} / {m['weights_closed_form'] / 1024:.0f}"
                 f" + {m['gradients'] / 1024:.0f} + {m['optimizer'] / 1024:.0f}" for m in d.get("state_memory", [])]
        if cells:
            lines.append(f"  {name}: " + "; ".join(cells))
    return lines


def format_bubbles(result: Dict[str, Any]) -> List[str]:
    """Per pipelined run: its bubble measured (the ranks' idle share of the wall time) against
    the simulator's on the measured stage costs."""
    pipelined = {name: d for name, d in result["detail"].items() if "bubble" in d and not name.startswith("sequential")}
    if not pipelined:
        return []
    lines = ["bubble (idle share of rank-time): measured / simulated on the measured stage costs; "
             "KiB per process: weights, peak activations"]
    for name, d in pipelined.items():
        held = d["process_bytes"]
        per_rank = " | ".join(f"{w / 1024:.0f}, {a / 1024:.0f}" for w, a in zip(held["weights"], held["activations"]))
        lines.append(f"  {name}: {100 * d['bubble']['measured']:.1f} % / {100 * d['bubble']['simulated']:.1f} %;"
                     f" {per_rank}")
    return lines


def format_report(result: Dict[str, Any]) -> str:
    s = result["settings"]
    sps = result["samples_per_second"]
    tensor = [job["tensor_parallel"] for job in s.get("jobs", [])] or [s.get("tensor_parallel", 1)]
    lines = [f"{s['task']} / {s['model']} ({s['parameters'] / 1e6:.2f} M parameters), {s['stages']} stages "
             f"x {s.get('data_parallel', 1)} replica(s) "
             + (f"x {' and '.join(map(str, tensor))} tensor rank(s) " if tensor != [1] else "") +
             f"{s['partition']}, batch {s['batch_size']}, {s['batches']} timed mini-batches per run, "
             f"{s['repeats']} round(s) (after {s['warmup']} warm-up), {s['optimizer']} lr {s['lr']}, 1 thread per stage",
             ""]
    base = sps.get("sequential-1dev")
    head = ["method", "micro-batches", "samples/s", "IQR", "x sequential-1dev", "x sequential-all",
            "CPU share per process"]
    rows = []
    for name, value in sps.items():
        d = result["detail"][name]
        shares = [statistics.median(col) for col in zip(*d["cpu_share"])]
        spread = d.get("iqr_samples_per_second")
        rows.append([name, str(d["microbatches"]), f"{value:.0f}",
                     f"{spread:.0f} ({100 * spread / value:.0f}%)" if spread is not None and value else "-",
                     f"{value / base:.2f}" if base else "-",
                     f"{value / sps['sequential-all']:.2f}" if "sequential-all" in sps else "-",
                     " / ".join(f"{x:.2f}" for x in shares)])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    lines += [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
    lines += [""] + format_memory(result) + format_bubbles(result)
    extra = {k: v for k, v in result["ratios"].items() if "sequential" not in k}
    if extra:
        lines.append("")
        lines += [f"{k}: {v:.2f}" for k, v in extra.items()]
    la = result["load_average"]
    lines.append("")
    lines.append("samples/s: the median round; IQR: the interquartile range of the rounds' samples/s "
                 "(and as a share of the median)")
    lines.append("CPU share: CPU time of each process over the wall time (1 thread: at most 1.00, less "
                 "when it waits on its peer or other work takes the core)")
    if len(tensor) > 1:
        lines.append(f"METHOD tp{tensor[-1]}: each stage split over {tensor[-1]} processes, timed in a job of its "
                     f"own after the T = 1 runs' (the rounds take turns within a job, not across the two)")
    lines.append(f"load average (1/5/15 min) before {', '.join(f'{x:.2f}' for x in la['before'])}; after "
                 f"{', '.join(f'{x:.2f}' for x in la['after'])} on {os.cpu_count()} CPUs")
    other = result.get("other_work")
    if other is not None:
        lines.append(f"other processes kept {other['cores_busy_on_average']:.2f} cores busy on average "
                     f"during the bench ({other['cpu_seconds']:.1f} CPU-s in {other['wall_seconds']:.0f} s)"
                     + ("; the figures are distorted, re-run on a quiet machine"
                        if other["cores_busy_on_average"] > 0.1 else ""))
    lines.append(f"wrote {result['out']}")
    return "\n".join(lines)
