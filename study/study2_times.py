"""Issue 16's study: the seconds per mini-batch of every method, the time axis of time to target.

The study (benchmarks/study2.py, last in commit 6bb0f1e) trained every run on the local
runtime, one process on one thread, so its runs' wall times say nothing about an N-device pipeline. The time each method
would take per mini-batch on N devices is predicted instead, with the planner's machinery
(``pipeoptim plan``, :mod:`pipeoptim.lab.planner`):

* **profile** (once per task, model, batch size and optimizer of the study, reused for both N
  and every method): every layer of the model on the CPU, one thread, at each micro-batch size
  the study's methods use (``throughput.profile_sizes``: forward, backward, update; the
  ``--statistic`` of ``--repeats`` runs after ``--warmup``); with ``--stage-timing measured``
  (the planner's default) each split's stages are then timed as whole stages, as the runtime
  runs them (``stage_timing.measure_stages``), once per (split, micro-batch size);
* **predict** (``throughput.predict``: the schedule simulator): each method on the ``uniform``
  split (the study's partitioner, RunConfig's default) with the micro-batches it uses in the
  study (``Method.microbatches(N, None)``, what ``checks.check_run`` resolves: gpipe,
  1f1b-flush and pipedream-2bw N, xpipe 2, the others 1), over one epoch of the study's
  mini-batches (the data the study loads); seconds per mini-batch = the predicted makespan /
  the mini-batches, i.e. 1 / (predicted mini-batches per second), the steady state with the
  pipeline's one fill and drain spread over the epoch. ``sequential``: the whole model on one
  device, one thread.

Transfers between stages are free in these predictions (no ``--bandwidth``): on one machine
they cost little beside the compute, and the check below measures what they do cost. The study's
runs also drain at every evaluation (every ``eval_every`` mini-batches), one more fill and drain
per segment, which the epoch's steady state leaves out (about (N - 1) stage times per segment:
a few per cent at N = 8).

Other jobs on the machine inflate the times, long calls (a whole model's forward, the sequential
reference) more than short ones (a stage's), since the minimum of the repeats escapes a
preemption only if some call ran without one: on a shared machine, run part 1 at a higher
priority (``nice -n -10``, as root; one thread still, and for a minute or two), or pause the
other jobs (the committed times and check were measured with the study's shards stopped by
SIGSTOP); each cell records the load average and the niceness it was measured at.

``--check-n2`` runs the check the study needs instead: for the image task (vgg, batch 64,
momentum) and the LM (gpt-narrow, batch 16, AdamW), the prediction at N = 2 of gpipe,
1f1b-flush, async-naive and pipeoptim (and sequential) against the distributed runtime's
measurement, ``pipeoptim bench --stages 2 --partitioner uniform`` (torchrun, one process per
stage, one thread each; the same micro-batches, the bench's default), with measured / predicted
per method. The bench times rounds of ``--bench-batches`` mini-batches that each include the
pipeline's fill and drain, so the prediction it is held against is the simulator's over as many
mini-batches (the steady-state one is recorded beside it). Two stage processes need both cores:
run it on a quiet machine (the bench records the other processes' load). The bench's own
results file is kept beside the times file (``times-n2-bench-TASK-OPTIMIZER.json``).

Both parts write into one file (``--out``, default
``study/results/study2/times.json``): part 1 its ``predict`` section, cell by cell as
each is done, the check its ``check_n2`` section, task by task; neither touches the other's.

    OMP_NUM_THREADS=1 nice -n -10 .venv/bin/python -m study.study2_times  # part 1, 1-2 minutes
    OMP_NUM_THREADS=1 .venv/bin/python -m study.study2_times --check-n2   # the check (quiet machine)

:func:`seconds_per_batch` reads one number from the file (the report's lookup).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from pipeoptim.methods import get_method
from pipeoptim.throughput import microbatch_size

from study.common import RESULTS, load_average, machine, read_format, rounded, write_rounded  # noqa: F401
from study.study2_plan import SUITES, variant_method
from study.study2_profile import (PARTITIONER, ProfiledModel, ProfileSettings, cell_table,  # noqa: F401
                                       load_cell, predict_method, profile_cell, split_of, stage_summary,
                                       study_microbatches)

FORMAT = "pipeoptim-study2-times"
VERSION = 1
#: the check at N = 2: the cells, and the methods bench times (sequential-1dev comes with them)
CHECK_CELLS = (("image", "momentum"), ("lm", "adamw"))
CHECK_STAGES = 2
CHECK_METHODS = ("gpipe", "1f1b-flush", "async-naive", "pipeoptim")


# --------------------------------------------------------------------------------------------
# the lookup the report uses


class MissingTime(KeyError):
    """A time the file does not hold; the message names what is missing and what is there."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0])


def _have(mapping: Dict[str, Any]) -> str:
    return ", ".join(sorted(mapping, key=lambda k: (len(k), k))) or "nothing"


def seconds_per_batch(times: Dict[str, Any], task: str, optimizer: str, stages: int, method: str) -> float:
    """Predicted seconds per mini-batch of ``method`` on ``stages`` devices in the study's
    ``task`` x ``optimizer`` cell, from the contents of times.json. ``method`` may be one of the
    study's variants (``pipeoptim+lr_correction`` runs pipeoptim's schedule: same time);
    ``sequential`` ignores ``stages`` (one device). Raises :class:`MissingTime` (a KeyError)
    naming what is missing."""
    cells = times.get("predict", {}).get("cells")
    if not cells:
        raise MissingTime("times hold no predictions (run study/study2_times.py, part 1)")
    if task not in cells:
        raise MissingTime(f"no predicted times for task {task!r} (the file has: {_have(cells)})")
    if optimizer not in cells[task]:
        raise MissingTime(f"no predicted times for task {task!r} with optimizer {optimizer!r} "
                          f"(it has: {_have(cells[task])})")
    cell = cells[task][optimizer]
    name = variant_method(method)[0]
    if name == "sequential":
        return float(cell["sequential"]["seconds_per_batch"])
    per_n = cell["stages"]
    if str(stages) not in per_n:
        raise MissingTime(f"no predicted times for {task} x {optimizer} at N = {stages} (it has N = {_have(per_n)})")
    methods = per_n[str(stages)]["methods"]
    if name not in methods:
        raise MissingTime(f"no predicted time of method {method!r} for {task} x {optimizer} at N = {stages} "
                          f"(it has: {', '.join(methods)})")
    return float(methods[name]["seconds_per_batch"])


# --------------------------------------------------------------------------------------------
# what the study runs


def study_methods(suite: Dict[str, Any]) -> List[str]:
    """The study's methods, each once: sequential, the confirmations, the asynchronous ones (a
    variant with options, as pipeoptim+lr_correction, times as its method)."""
    names = ["sequential", *suite["confirm"]["methods"], *(variant_method(v)[0] for v in suite["methods"])]
    return list(dict.fromkeys(names))


def microbatch_counts(methods: Sequence[str], stage_counts: Sequence[int]) -> List[int]:
    """Every micro-batch count the methods use at the stage counts (1, the mini-batch, always)."""
    return sorted({1, *(study_microbatches(m, n) for m in methods for n in stage_counts)})


# --------------------------------------------------------------------------------------------
# the file


def read_times(path: Path) -> Dict[str, Any]:
    """The file's contents, or an empty shell (a missing file: nothing done yet)."""
    return read_format(path, FORMAT, "study2 times", {"format": FORMAT, "version": VERSION})


def write_times(path: Path, times: Dict[str, Any]) -> None:
    """Write atomically (a stopped call leaves the previous file whole), keys sorted."""
    write_rounded(path, times)


# --------------------------------------------------------------------------------------------
# part 1: the predictions


def selected_cells(suite: Dict[str, Any], tasks: Optional[str],
                   cells: Optional[Sequence[Tuple[str, str]]] = None) -> List[Tuple[str, str]]:
    chosen = list(cells if cells is not None else suite["cells"])
    if not tasks:
        return chosen
    wanted = tasks.split(",")
    unknown = [t for t in wanted if t not in {t for t, _ in chosen}]
    if unknown:
        raise ValueError(f"--tasks {', '.join(unknown)}: not among this part's tasks "
                         f"({', '.join(dict.fromkeys(t for t, _ in chosen))})")
    return [(t, o) for t, o in chosen if t in wanted]


def run_predict(suite: Dict[str, Any], out: Path, settings: ProfileSettings, *, tasks: Optional[str] = None,
                methods: Optional[Sequence[str]] = None, resume: bool = False,
                log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Part 1: profile each cell's model once and write every method's seconds per mini-batch at
    each of the study's N into ``out``'s ``predict`` section (after each cell)."""
    methods = list(methods or study_methods(suite))
    stage_counts = list(suite["stages"])
    counts = microbatch_counts(methods, stage_counts)
    started, load_start = time.time(), load_average()
    times = read_times(out)
    section = times.setdefault("predict", {})
    section.setdefault("cells", {})
    for task, optimizer in selected_cells(suite, tasks):
        spec = suite["tasks"][task]
        done = section["cells"].get(task, {}).get(optimizer)
        if (resume and done and done.get("settings") == settings.to_dict()
                and set(done["stages"]) == set(map(str, stage_counts))):
            log(f"{task} x {optimizer}: in {out.name} already (--resume), skipped")
            continue
        cell_start, cell_load = time.time(), load_average()
        model, batches = profile_cell(task, spec, optimizer, counts, settings)
        profiled = time.time() - cell_start
        table = cell_table(model, stage_counts, methods, batches)
        table.update(task=task, model=spec["model"], batch_size=spec["batch_size"], optimizer=optimizer,
                     settings=settings.to_dict(), microbatch_counts=counts,
                     profile_seconds=profiled, seconds=time.time() - cell_start,
                     load_average={"start": cell_load, "end": load_average()}, nice=os.nice(0),
                     written=time.strftime("%Y-%m-%d %H:%M:%S"))
        section["cells"].setdefault(task, {})[optimizer] = table
        section.update(settings=settings.to_dict(), methods=methods, stage_counts=stage_counts,
                       partitioner=PARTITIONER, machine=machine(),
                       last_call={"started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
                                  "seconds": time.time() - started, "nice": os.nice(0),
                                  "load_average": {"start": load_start, "end": load_average()}})
        write_times(out, times)
        sizes = "/".join(str(microbatch_size(spec["batch_size"], m)) for m in counts)
        log(f"[{time.time() - started:6.0f}s] {task} x {optimizer}: {spec['model']} ({model.layers} layers), batch "
            f"{spec['batch_size']}, micro-batch sizes {sizes}: "
            f"profiled in {profiled:.0f} s, stages timed and predicted in {time.time() - cell_start - profiled:.0f} s; "
            f"load average {cell_load[0]:.2f} -> {load_average()[0]:.2f}")
    return times


def format_table(times: Dict[str, Any]) -> str:
    """The predictions as text: seconds per mini-batch (ms) and speed-up over sequential."""
    cells = times.get("predict", {}).get("cells", {})
    lines = [f"{'task':<10} {'optimizer':<9} {'N':>2} {'method':<14} {'M':>2} {'ms/batch':>9} {'x seq':>6} "
             f"{'bubble':>6}"]
    for task, by_opt in sorted(cells.items()):
        for optimizer, cell in sorted(by_opt.items()):
            seq = cell["sequential"]["seconds_per_batch"]
            lines.append(f"{task:<10} {optimizer:<9} {'1':>2} {'sequential':<14} {1:>2} {seq * 1e3:>9.2f} {1:>6.2f}")
            for n, at_n in sorted(cell["stages"].items(), key=lambda item: -int(item[0])):
                for method, row in at_n["methods"].items():
                    s = row["seconds_per_batch"]
                    lines.append(f"{task:<10} {optimizer:<9} {n:>2} {method:<14} {row['microbatches']:>2} "
                                 f"{s * 1e3:>9.2f} {seq / s:>6.2f} {row['bubble_fraction']:>6.2f}")
                total = sum(at_n["stage_seconds"])
                whole = sum(cell["sequential"]["stage_seconds"])
                lines.append(f"{'':<10} {'':<9} {n:>2} (forward + backward of the {n} stages add up to "
                             f"{total * 1e3:.2f} ms, {total / whole:.2f} x the whole model's)")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# part 2: the check at N = 2


def bench_command(task: str, spec: Dict[str, Any], optimizer: str, methods: Sequence[str], out: Path,
                  batches: int, repeats: int, warmup: int) -> List[str]:
    """`pipeoptim bench` arguments that measure ``methods`` at N = 2 on the study's model and batch."""
    return ["bench", "--task", task, "--model", spec["model"], "--stages", str(CHECK_STAGES),
            "--methods", ",".join(methods), "--batch-size", str(spec["batch_size"]), "--partitioner", PARTITIONER,
            "--optimizer", optimizer, "--batches", str(batches), "--repeats", str(repeats),
            "--warmup", str(warmup), "--out", str(out)]


def compare(predicted: Dict[str, Dict[str, Any]], bench: Dict[str, Any], batch_size: int) -> Dict[str, Any]:
    """Per method: predicted (over the bench's mini-batches, and steady state), measured
    (batch size / the bench's median samples per second) and measured / predicted."""
    out: Dict[str, Any] = {}
    for method, row in predicted.items():
        name = "sequential-1dev" if method == "sequential" else method
        sps = bench["samples_per_second"].get(name)
        measured = batch_size / sps if sps else None
        out[method] = {**row, "measured_seconds_per_batch": measured,
                       "measured_over_predicted": measured / row["seconds_per_batch"] if measured else None,
                       "measured_microbatches": bench.get("detail", {}).get(name, {}).get("microbatches")}
    return out


def run_check(suite: Dict[str, Any], out: Path, settings: ProfileSettings, *, tasks: Optional[str] = None,
              bench_batches: int = 32, bench_repeats: int = 5, bench_warmup: int = 2,
              log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Part 2: predict and measure gpipe, 1f1b-flush, async-naive, pipeoptim (and sequential on
    one device) at N = 2 for the check's cells; writes ``out``'s ``check_n2`` section after each."""
    from pipeoptim.cli import main as pipeoptim_main

    methods = ["sequential", *CHECK_METHODS]
    counts = microbatch_counts(methods, [CHECK_STAGES])
    started = time.time()
    cells = [cell for cell in CHECK_CELLS if cell in suite["cells"]]
    for task, optimizer in selected_cells(suite, tasks, cells):
        spec = suite["tasks"][task]
        load_start = load_average()
        model, epoch = profile_cell(task, spec, optimizer, counts, settings)
        predicted = {}
        for method in methods:
            row = predict_method(model, method, CHECK_STAGES, bench_batches)
            row["steady_seconds_per_batch"] = predict_method(model, method, CHECK_STAGES, epoch)["seconds_per_batch"]
            predicted[method] = row
        log(f"[{time.time() - started:6.0f}s] {task} x {optimizer}: predicted at N = {CHECK_STAGES}; measuring with "
            f"pipeoptim bench")
        bench_file = out.with_name(f"{out.stem}-n2-bench-{task}-{optimizer}.json")
        command = bench_command(task, spec, optimizer, CHECK_METHODS, bench_file, bench_batches, bench_repeats,
                                bench_warmup)
        code = pipeoptim_main(command)
        if code != 0:
            raise RuntimeError(f"pipeoptim {' '.join(command)} failed (exit status {code})")
        bench = json.loads(bench_file.read_text())
        partition = split_of(model, "async-naive", CHECK_STAGES)
        if bench["settings"]["partition"] != partition:
            raise RuntimeError(f"bench split {bench['settings']['partition']}, the prediction {partition}")
        entry = {"task": task, "model": spec["model"], "optimizer": optimizer, "batch_size": spec["batch_size"],
                 "stages": CHECK_STAGES, "partition": partition, "bench_batches": bench_batches,
                 "steady_batches": epoch, "settings": settings.to_dict(),
                 "methods": compare(predicted, bench, spec["batch_size"]),
                 "bench": {"command": "pipeoptim " + " ".join(command), "file": bench_file.name,
                           "repeats": bench_repeats, "warmup": bench_warmup,
                           "load_average": bench.get("load_average"), "other_work": bench.get("other_work")},
                 "load_average": {"start": load_start, "end": load_average()},
                 "written": time.strftime("%Y-%m-%d %H:%M:%S")}
        times = read_times(out)  # (re-read: part 1 may have written meanwhile)
        section = times.setdefault("check_n2", {})
        section.setdefault("cells", {}).setdefault(task, {})[optimizer] = entry
        section.update(machine=machine(), methods=methods)
        write_times(out, times)
        for method, row in entry["methods"].items():
            measured, ratio = row["measured_seconds_per_batch"], row["measured_over_predicted"]
            log(f"  {method:<12} predicted {row['seconds_per_batch'] * 1e3:8.2f} ms/batch, measured "
                + (f"{measured * 1e3:8.2f} ms/batch: measured / predicted {ratio:.2f}" if measured else "nothing"))
    return read_times(out)


# --------------------------------------------------------------------------------------------
# the command line


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default="default", choices=list(SUITES),
                        help="the study2 suite whose cells, models, batch sizes, N and methods are timed "
                             "(default: default)")
    parser.add_argument("--check-n2", action="store_true",
                        help="run the check at N = 2 (prediction against `pipeoptim bench`, image x momentum "
                             "and lm x adamw) instead of part 1; needs both cores quiet")
    parser.add_argument("--tasks", help="comma-separated subset of the tasks (default: all of the part's)")
    parser.add_argument("--methods", help="comma-separated methods to predict in part 1 (default: the study's: "
                                          "sequential, gpipe, 1f1b-flush and the asynchronous ones)")
    parser.add_argument("--out", type=Path, help="the times file (default: study/results/study2/times.json, "
                                                 "or study2-SUITE/times.json for another suite)")
    parser.add_argument("--resume", action="store_true",
                        help="part 1: skip the cells the file holds already with the same settings")
    g = parser.add_argument_group("profile (as `pipeoptim plan`)")
    g.add_argument("--threads", type=int, default=1, help="torch threads while profiling (default 1)")
    g.add_argument("--warmup", type=int, default=ProfileSettings.warmup,
                   help="unmeasured runs per layer and per stage (default %(default)s)")
    g.add_argument("--repeats", type=int, default=ProfileSettings.repeats,
                   help="measured runs per layer and per stage (default %(default)s)")
    g.add_argument("--statistic", default=ProfileSettings.statistic, choices=["min", "median"],
                   help="time kept of the repeats (default %(default)s: on a machine shared with other jobs, "
                        "closer to what the device can do)")
    g.add_argument("--stage-timing", default=ProfileSettings.stage_timing, choices=["measured", "profile"],
                   help="stage costs: time each split's stages as the runtime runs them (measured, default) "
                        "or add up the profiled layers (profile: faster, optimistic)")
    g = parser.add_argument_group("the check at N = 2 (pipeoptim bench)")
    g.add_argument("--bench-batches", type=int, default=32,
                   help="timed mini-batches per bench round; the prediction compared is over as many "
                        "(default %(default)s, the bench's)")
    g.add_argument("--bench-repeats", type=int, default=5, help="bench rounds (default %(default)s)")
    g.add_argument("--bench-warmup", type=int, default=2, help="bench warm-up mini-batches (default %(default)s)")
    args = parser.parse_args(argv)
    for name in ("threads", "repeats", "bench_batches", "bench_repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.bench_warmup < 0:
        parser.error("--warmup and --bench-warmup must be at least 0")
    suite = SUITES[args.suite]
    out = args.out or RESULTS / ("study2" if args.suite == "default" else f"study2-{args.suite}") / "times.json"
    settings = ProfileSettings(args.threads, args.warmup, args.repeats, args.statistic, args.stage_timing)
    torch.set_num_threads(args.threads)
    try:
        if args.check_n2:
            run_check(suite, out, settings, tasks=args.tasks, bench_batches=args.bench_batches,
                      bench_repeats=args.bench_repeats, bench_warmup=args.bench_warmup,
                      log=lambda line: print(line, flush=True))
        else:
            methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
            for m in methods or []:
                get_method(m)  # a ValueError naming the known methods
            times = run_predict(suite, out, settings, tasks=args.tasks, methods=methods, resume=args.resume,
                                log=lambda line: print(line, flush=True))
            print()
            print(format_table(rounded(times)))
    except ValueError as error:
        print(f"study2_times: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
