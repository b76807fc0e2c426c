"""`pipeoptim schedule`: build a schedule, simulate it, and show it.

As text, PNG, Chrome trace or CSV.

NAME is a schedule (``gpipe``, ``async-1f1b``, ...) or a training method (``pipeoptim``,
``pipedream``, ...). For a method, the command shows the method's schedule, uses its default
number of micro-batches when ``--micro-batches`` is not given, and reports the weight versions
each stage holds. ``--from-csv FILE`` shows a schedule of one's own instead: torch's
compute-only CSV (one row per rank, ``(0F7;7B3)OVERLAP_F_B`` included), checked as
``Pipeline(schedule=FILE)`` checks it, repeated for ``--batches`` mini-batches.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..methods import get_method, method_names
from ..schedules import Costs, analytic_bubble_fraction, build_schedule, schedule_names, simulate
from ..schedules import csv_io, render
from ..schedules.concat import repeat
from ..schedules.custom import load_order

FORMATS = ("text", "png", "chrome", "csv")
EXTENSIONS = {"png": "png", "chrome": "json", "csv": "csv", "text": "txt"}
ASYNC_SCHEDULES = ("async-1f1b", "2bw")


def register(subparsers: argparse._SubParsersAction) -> None:
    names = list(dict.fromkeys(schedule_names() + method_names()))
    parser = subparsers.add_parser(
        "schedule",
        help="simulate a pipeline schedule and show its timeline, bubbles and memory",
        description="Build the schedule of NAME, simulate it with the given costs, and show when "
                    "each stage computes and idles: a text timeline, a PNG, a Chrome/Perfetto "
                    "trace or torch.distributed.pipelining's compute-only CSV.",
        epilog="schedules: " + ", ".join(schedule_names()) + ". methods: " + ", ".join(method_names())
               + ". Example: pipeoptim schedule pipeoptim --stages 4 --batches 8 --format png",
    )
    parser.add_argument("name", metavar="NAME", nargs="?",
                        help=f"a schedule or a method name, one of: {', '.join(names)}")
    parser.add_argument("--from-csv", metavar="FILE", default=None,
                        help="show the schedule of this compute-only CSV instead of NAME's (torch's "
                             "format, one row per rank: 0F1, 1B0, 0I2, 0W2, (0F7;7B3)OVERLAP_F_B; the "
                             "updates added after each stage's last backward): checked as "
                             "Pipeline(schedule=FILE) checks it; its ranks and micro-batches are the file's")
    parser.add_argument("--stages", "-N", metavar="N", default=None,
                        help="pipeline stages, one per rank (ranks for interleaved-1f1b, zb-v, "
                             "bidirectional and bitpipe, which put several stages on a rank); default 4 (with "
                             "--from-csv, the file's)")
    parser.add_argument("--micro-batches", "-M", metavar="M", default=None,
                        help="micro-batches per mini-batch, i.e. per update. Default: the "
                             "method's own (gpipe, 1f1b-flush, zb-h1, pipedream-2bw, pipeoptim-2bw: N; xpipe: 2; "
                             "others: 1); for a schedule name N for synchronous schedules and 2bw "
                             "(rounded up to even for bidirectional and bitpipe), 1 for async-1f1b")
    parser.add_argument("--batches", "-T", metavar="T", default=None,
                        help="mini-batches (updates) to run; default 1 for synchronous schedules, "
                             "2N for asynchronous ones (async-1f1b, 2bw and the methods on them)")
    parser.add_argument("--chunks", "-V", metavar="V", default=None,
                        help="model chunks per rank for interleaved-1f1b; default 2")
    parser.add_argument("--costs", metavar="F,B[,W]", default="1,1",
                        help="time of one forward and one backward per stage (and of the weight "
                             "half W of a split backward, default B/2); default 1,1")
    parser.add_argument("--comm", metavar="C", default="0",
                        help="time to send one activation or gradient between ranks; default 0")
    parser.add_argument("--update-cost", metavar="U", default="0",
                        help="time of one optimizer update; default 0 (updates are drawn as ticks)")
    parser.add_argument("--format", choices=FORMATS, default="text",
                        help="text: a timeline in the terminal (default); png: a picture; chrome: "
                             "trace-event JSON for ui.perfetto.dev (1 unit of cost = 1 ms); csv: "
                             "torch.distributed.pipelining's compute-only CSV, one row per rank, "
                             "an empty cell per idle unit step")
    parser.add_argument("--out", metavar="FILE", default=None,
                        help="file to write; default schedule-NAME-N{N}-M{M}.png / .json / .csv "
                             "in the current directory (text is printed unless --out is given)")
    parser.add_argument("--width", metavar="COLS", default="120",
                        help="columns of the text timeline; default 120")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (schedule, method, stages, ranks, microbatches, "
                             "batches, makespan, bubble_fraction, analytic_bubble_fraction, "
                             "peak_activations, weight_copies: per stage, stage 0 first, the weight versions "
                             "it holds, busy, out) instead of a summary")
    parser.set_defaults(func=run)


def _integer(option: str, text: Optional[str], minimum: int = 1) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"{option} must be an integer, got {text!r}") from None
    if value < minimum:
        raise ValueError(f"{option} must be at least {minimum}, got {value}")
    return value


def _number(option: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{option} must be a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{option} must be a finite number >= 0, got {text!r}")
    return value


def _costs(text: str) -> List[float]:
    parts = [p for p in text.split(",")]
    if not 2 <= len(parts) <= 3:
        raise ValueError(f"--costs takes F,B or F,B,W (e.g. 1,2 or 1,2,1), got {text!r}")
    values = [_number("--costs", p.strip()) for p in parts]
    if values[0] <= 0 or values[1] <= 0:
        raise ValueError(f"--costs: forward and backward must take some time, got {text!r}")
    return values


#: the schedules whose order is list-scheduled against the costs (two pipelines, half the
#: micro-batches each: an even M)
LIST_SCHEDULED = ("bidirectional", "bitpipe")


def _default_microbatches(schedule: str, stages: int) -> int:
    if schedule == "async-1f1b":
        return 1
    if schedule in LIST_SCHEDULED:
        return stages + stages % 2
    return stages


def _from_csv(args: argparse.Namespace):
    """The schedule of ``--from-csv`` for ``--batches`` mini-batches (default 1)."""
    if args.name is not None:
        raise ValueError(f"give NAME or --from-csv FILE, not both (got {args.name!r})")
    for option, value in (("--stages", args.stages), ("--micro-batches", args.micro_batches),
                          ("--chunks", args.chunks)):
        if value is not None:
            raise ValueError(f"--from-csv takes its stages, chunks and micro-batches from the file: drop {option}")
    one = load_order(args.from_csv)
    batches = _integer("--batches", args.batches) if args.batches is not None else 1
    return one.name, repeat(one, batches)


def versions_key(copies: List[int]) -> str:
    """What the list of weight versions is: per stage, stage 0 first, the copies of its weights
    that stage holds (the last holding fewer where its backward follows its forward at once)."""
    last = (f"; the last runs each backward right after its forward, so it holds {copies[-1]}"
            if len(copies) > 1 and copies[-1] < max(copies) else "")
    return f"(the copies of its weights each stage holds, stage 0 first{last})"


def run(args: argparse.Namespace) -> int:
    name = args.name
    method = None
    if args.from_csv is not None:
        name, schedule = _from_csv(args)
        schedule_name, stages, microbatches = name, schedule.num_ranks, schedule.microbatches_per_update
    elif name is None:
        raise ValueError("give a schedule or method NAME, or --from-csv FILE")
    elif name in method_names():
        method = get_method(name)
        schedule_name = method.schedule
    elif name in schedule_names():
        schedule_name = name
    else:
        raise ValueError(f"unknown schedule or method {name!r}; schedules: {', '.join(schedule_names())}; "
                         f"methods: {', '.join(method_names())}")
    width = _integer("--width", args.width)
    if args.from_csv is None:
        stages = _integer("--stages", args.stages if args.stages is not None else "4")
        chunks = _integer("--chunks", args.chunks) if args.chunks is not None else 2
        if args.micro_batches is not None:
            microbatches = _integer("--micro-batches", args.micro_batches)
        elif method is not None:
            microbatches = method.microbatches(stages, None)
        else:
            microbatches = _default_microbatches(schedule_name, stages)
    asynchronous = schedule_name in ASYNC_SCHEDULES
    batches = (_integer("--batches", args.batches) if args.batches is not None
               else (2 * stages if asynchronous else 1))
    forward, backward, *weight = _costs(args.costs)
    comm = _number("--comm", args.comm)
    update = _number("--update-cost", args.update_cost)

    notes = []
    if name == "sequential":
        notes.append(f"sequential runs as one stage; shown is the gpipe schedule it maps to, "
                     f"with {stages} stages")

    def costs_for(num_stages: int) -> Costs:
        return Costs.uniform(num_stages, forward, backward, weight[0] if weight else None,
                             update=update, comm=comm)

    if args.from_csv is None:
        schedule = build_schedule(schedule_name, stages, microbatches, batches, chunks)
    costs = costs_for(schedule.num_stages)
    if schedule_name in LIST_SCHEDULED and args.from_csv is None:  # its order is list-scheduled against the costs
        schedule = build_schedule(schedule_name, stages, microbatches, batches, chunks, costs)
    result = simulate(schedule, costs)
    analytic = analytic_bubble_fraction(schedule, costs)
    weight_copies = method.weight_versions(stages) if method is not None else None

    out: Optional[Path] = None
    if args.format != "text" or args.out is not None:
        out = Path(args.out) if args.out else Path(
            f"schedule-{name}-N{stages}-M{microbatches}.{EXTENSIONS[args.format]}")
        title = f"{name} ({schedule_name} schedule)" if method is not None else None
        if args.format == "png":
            render.to_png(result, out, title=title)
        elif args.format == "chrome":
            render.write_chrome_trace(result, out)
        elif args.format == "csv":
            csv_io.write_csv(schedule, out)
        else:
            out.write_text(render.to_text(result, width=width) + "\n")

    if args.json:
        report: Dict[str, Any] = {
            "schedule": schedule_name,
            "method": method.name if method is not None else None,
            "stages": schedule.num_stages,
            "ranks": schedule.num_ranks,
            "microbatches": schedule.microbatches_per_update,
            "batches": schedule.num_updates,
            "total_microbatches": schedule.num_microbatches,
            "costs": {"forward": forward, "backward": backward,
                      "weight": costs.weight[0], "update": update, "comm": comm},
            "makespan": result.makespan,
            "bubble_fraction": result.bubble_fraction,
            "analytic_bubble_fraction": analytic,
            "peak_activations": result.peak_activations,
            "weight_copies": weight_copies,
            "busy": result.busy,
            "format": args.format,
            "out": str(out) if out is not None else None,
            "notes": notes,
        }
        print(json.dumps(report))
        return 0

    lines = []
    if method is not None:
        lines.append(f"method {name}: the {schedule_name} schedule, weight versions per stage "
                     f"{weight_copies} {versions_key(weight_copies)}")
    lines += [f"note: {n}" for n in notes]
    lines.append(f"peak activations per stage (micro-batches held) {result.peak_activations}")
    if args.format == "text" and out is None:
        lines.append(render.to_text(result, width=width))  # its first line is the summary
    else:
        lines += [render.summary(result), f"wrote {out}"]
    print("\n".join(lines))
    return 0
