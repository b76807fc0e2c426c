"""Issue 23's study: the synchronous pipeline at its best sets the budget B; every variant's
predicted seconds per mini-batch s_m gives its updates U_m = floor(B / s_m).

Per cell (task, optimizer) of the study, each split's stages are timed as the runtime runs them
(study2_times.py's machinery, ``pipeoptim plan``'s ``measured`` stage timing; one thread, the
minimum of ``--repeats`` after ``--warmup``) at every micro-batch size the study prices, in
``--rounds`` rounds that each time every (split, size), the lowest price over the rounds kept.
From these, on the uniform split at N = 4 and 8, the simulator prices

* the **synchronous pipeline** at M = N, 2N and 4N micro-batches (the bubble shrinks with M, each
  micro-batch gets smaller: each size profiled): ``gpipe`` and ``1f1b-flush`` as the runtime runs
  them; ``zb-h1`` (1F1B with the backward split into I and W, W filling the bubble) with the
  measured backward split in half (the zero-bubble paper's T_I ~ T_W; ``--weight-share``), and
  ``interleaved-1f1b`` with V = 2 chunks per device, each half of that device's measured stage
  (the models have fewer layers than 2N chunks at N = 8, so no real split exists: an optimistic
  price, an upper bound on its speed, since halving a stage halves none of its fixed costs).
  Both compute sequential's updates (no staleness); executing them is another issue's work.
  The fastest candidate sets B = its seconds per mini-batch x U (sequential's updates: image
  2,577, sentiment 477, LM 2,000); the file says how far B moves
  from the second study's M = N (the faster of gpipe and 1f1b-flush there);
* every **asynchronous variant** of the study (its method, options and micro-batches:
  study3_suite.VARIANTS) and its updates U_m = floor(B / s_m).

Seconds per mini-batch are the steady state over one epoch of the study's mini-batches (the
predicted makespan / the mini-batches), as study2_times.py. Transfers are free.

The machine is shared (the committed file was measured beside a full test suite, other
sessions' benchmarks and a busy loop on 2 cores: load average 8-12). On the wall clock the
minimum of the repeats only escapes preemption if some repeat ran without one, and long calls
(a whole model, a mini-batch of 64) are preempted far more often than short ones (a stage, a
micro-batch of 2), which made the large-M synchronous schedules look faster than they are and the
M = 1 asynchronous ones slower. So the profile is timed on the calling thread's CPU time
(``--clock cpu``, the default; one thread computes everything), which preemption does not
inflate; what the other jobs still cost (a busy sibling hyperthread, shared caches) remains:
every absolute time was 1.2-2.2x the second study's quiet measurement, and the ratios U_m uses
may lean (docs/study_plan.md): measure again on a quiet machine before the study's first run.
Each cell records the load average and niceness it was measured at; a cell measured again keeps
the lower of each price (``--replace`` overwrites).

    OMP_NUM_THREADS=1 .venv/bin/python -m study.study3_times --replace  # 3-4 minutes if quiet
    .venv/bin/python -m study.study3_times --show                       # the table only
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from study.common import RESULTS, ROOT, load_average, machine, read_format, write_rounded
from study.study2_profile import ProfiledModel, ProfileSettings, profile_cell, split_of, stage_summary
from study.study3_suite import (INTERLEAVED_CHUNKS, SUITES, SYNC_FACTORS, SYNC_SCHEDULES, VARIANTS, cell_stages,
                                     sequential_updates, variant_microbatches, variant_spec)
from pipeoptim.throughput import candidate_problem, predict, schedule_makespan, stage_costs
from pipeoptim.schedules import Costs

FORMAT = "pipeoptim-study3-times"
VERSION = 1
TIMES = RESULTS / "study3" / "times.json"
WEIGHT_SHARE = 0.5  #: zb-h1: the share of a stage's backward that is W (weight gradients)


@contextlib.contextmanager
def profile_clock(kind: str) -> Iterator[None]:
    """Time the profile with ``kind``: ``wall`` (the profiler's own clock) or ``cpu``, the calling
    thread's CPU time (one thread computes everything on the CPU), which other jobs on a loaded
    machine do not inflate (they share only the caches and memory bandwidth), where the wall
    clock also counts every preemption."""
    if kind == "wall":
        yield
        return
    if kind != "cpu":
        raise ValueError(f"clock must be cpu or wall, got {kind!r}")
    from pipeoptim import profile

    wall = profile.Clock.time

    def cpu_time(self: Any, fn: Callable[[], Any]) -> Tuple[float, Any]:
        self.sync()
        start = time.thread_time()
        result = fn()
        self.sync()
        return time.thread_time() - start, result

    profile.Clock.time = cpu_time
    try:
        yield
    finally:
        profile.Clock.time = wall


def sync_counts(stages: Sequence[int]) -> List[int]:
    return sorted({f * n for n in stages for f in SYNC_FACTORS})


def microbatch_counts(stages: Sequence[int]) -> List[int]:
    """Every micro-batch count the study prices at these stage counts (1 always)."""
    variants = {variant_microbatches(v, n) for v in VARIANTS for n in stages}
    return sorted({1, *variants, *sync_counts(stages)})


def schedule_costs(model: ProfiledModel, schedule: str, stages: int, microbatches: int,
                   weight_share: float) -> Costs:
    """Simulator costs of one micro-batch of ``M = microbatches`` on the uniform split: as measured
    for gpipe and 1f1b-flush; the backward split into I and W for zb-h1; for interleaved-1f1b,
    V = 2 chunks per device, each half of that device's measured stage (model stage c * N + r,
    chunk c of device r, costs half of stage r): every device does the work it does in the
    N-stage pipeline, only the bubble shrinks."""
    sizes = split_of(model, "gpipe", stages)
    costs = stage_costs(model.profiles[microbatches], sizes, measured=model.stage_times(sizes, microbatches))
    if schedule == "zb-h1":
        return Costs(costs.forward, costs.backward, [b * weight_share for b in costs.backward], costs.update)
    if schedule == "interleaved-1f1b":
        halves = lambda values: [values[j % stages] / INTERLEAVED_CHUNKS  # noqa: E731
                                 for j in range(stages * INTERLEAVED_CHUNKS)]
        return Costs(halves(costs.forward), halves(costs.backward), [0.0] * (stages * INTERLEAVED_CHUNKS),
                     costs.update / INTERLEAVED_CHUNKS)
    return costs


def price_sync(model: ProfiledModel, schedule: str, stages: int, microbatches: int, batches: int,
               weight_share: float) -> Dict[str, Any]:
    """Seconds per mini-batch of a synchronous schedule, or why it cannot run."""
    if microbatches > model.batch_size:
        return {"problem": f"{microbatches} micro-batches need a batch of at least {microbatches}"}
    costs = schedule_costs(model, schedule, stages, microbatches, weight_share)
    makespan, result, _ = schedule_makespan(schedule, stages, microbatches, batches, costs,
                                            chunks=INTERLEAVED_CHUNKS)
    return {"seconds_per_batch": makespan / batches, "microbatches": microbatches,
            "microbatch_size": -(-model.batch_size // microbatches), "bubble_fraction": result.bubble_fraction}


def price_variant(model: ProfiledModel, variant: str, stages: int, batches: int) -> Dict[str, Any]:
    """Seconds per mini-batch of a study variant (its method, options and micro-batches)."""
    method, options, _ = variant_spec(variant, stages)
    n = 1 if method == "sequential" else stages
    m = variant_microbatches(variant, stages)
    problem = candidate_problem(method, n, m, model.batch_size)
    if problem:
        return {"problem": problem}
    sizes = split_of(model, method, n)
    row = predict(method, model.profiles[m], sizes, microbatches=m, batches=batches, batch_size=model.batch_size,
                  options=options, measured=model.stage_times(sizes, m))
    return {"seconds_per_batch": row["makespan_seconds"] / batches, "microbatches": m,
            "bubble_fraction": row["bubble_fraction"]}


def budget(sync: Dict[str, Dict[str, Dict[str, Any]]], variants: Dict[str, Dict[str, Any]], updates: int,
           stages: int) -> Dict[str, Any]:
    """B from the fastest synchronous candidate, against the second study's M = N (the faster of
    gpipe and 1f1b-flush), and each variant's U_m = floor(B / s_m)."""
    priced = [(row["seconds_per_batch"], name, int(m)) for name, by_m in sync.items() for m, row in by_m.items()
              if "seconds_per_batch" in row]
    seconds, schedule, m = min(priced)
    study2_like = min(sync[name][str(stages)]["seconds_per_batch"] for name in ("gpipe", "1f1b-flush"))
    total = seconds * updates
    return {"fastest": {"schedule": schedule, "microbatches": m}, "seconds_per_batch": seconds,
            "sequential_updates": updates, "budget_seconds": total,
            "m_equals_n": {"seconds_per_batch": study2_like, "budget_seconds": study2_like * updates},
            "budget_over_m_equals_n": seconds / study2_like,
            "updates": {v: math.floor(total / row["seconds_per_batch"] + 1e-9)
                        for v, row in variants.items() if "seconds_per_batch" in row}}


def cell_entry(model: ProfiledModel, stage_counts: Sequence[int], updates: int, batches: int,
               weight_share: float) -> Dict[str, Any]:
    """Every price of one profiled cell, and the budget at each N."""
    entry: Dict[str, Any] = {"batches": batches, "layers": model.layers, "stages": {},
                             "sequential": {**price_variant(model, "sequential", 1, batches),
                                            **stage_summary(model, split_of(model, "sequential", 1))}}
    for n in stage_counts:
        sync = {name: {str(f * n): price_sync(model, name, n, f * n, batches, weight_share) for f in SYNC_FACTORS}
                for name in SYNC_SCHEDULES}
        variants = {v: price_variant(model, v, n, batches) for v in VARIANTS if v != "sequential"}
        entry["stages"][str(n)] = {**stage_summary(model, split_of(model, "gpipe", n)), "synchronous": sync,
                                   "variants": variants, "budget": budget(sync, variants, updates, n)}
    return entry


def lower(old: Dict[str, Any], new: Dict[str, Any]) -> Dict[str, Any]:
    """The faster of two prices of one thing (a time only grows with the other jobs' load)."""
    if "seconds_per_batch" not in old or "seconds_per_batch" not in new:
        return new
    return old if old["seconds_per_batch"] <= new["seconds_per_batch"] else new


def merge_calls(old: Dict[str, Any], new: Dict[str, Any], updates: int) -> Dict[str, Any]:
    """A cell priced again: each price the lower of the two calls, the budgets recomputed from
    those, the calls' load averages kept. On a loaded machine every call overstates the times,
    long calls more than short ones; the lowest of several calls at different moments comes
    closest to what the model costs."""
    merged = dict(new)
    merged["sequential"] = {**new["sequential"], **lower(old["sequential"], new["sequential"])}
    merged["stages"] = {}
    for n, at_new in new["stages"].items():
        at_old = old["stages"].get(n)
        if at_old is None:
            merged["stages"][n] = at_new
            continue
        sync = {name: {m: lower(at_old["synchronous"][name][m], row) for m, row in by_m.items()}
                for name, by_m in at_new["synchronous"].items()}
        variants = {v: lower(at_old["variants"].get(v, row), row) for v, row in at_new["variants"].items()}
        merged["stages"][n] = {**at_new, "synchronous": sync, "variants": variants,
                               "budget": budget(sync, variants, updates, int(n))}
    merged["calls"] = old.get("calls", 1) + 1
    merged["call_load_averages"] = [*old.get("call_load_averages", [old["load_average"]]), new["load_average"]]
    return merged


def read_times(path: Path) -> Dict[str, Any]:
    """The file's contents, or an empty one (a missing file: nothing measured yet)."""
    return read_format(path, FORMAT, "study3 times", {"format": FORMAT, "version": VERSION, "cells": {}})


def write_times(path: Path, times: Dict[str, Any]) -> None:
    write_rounded(path, times)


def study2_budget(task: str, optimizer: str, stages: int, study2_times: Path) -> Optional[float]:
    """The second study's file's M = N synchronous seconds per mini-batch (the faster of gpipe and
    1f1b-flush), or None (no such cell there: the LM with NAdam or Muon)."""
    if not study2_times.exists():
        return None
    cells = json.loads(study2_times.read_text()).get("predict", {}).get("cells", {})
    methods = cells.get(task, {}).get(optimizer, {}).get("stages", {}).get(str(stages), {}).get("methods")
    if not methods:
        return None
    return min(methods[m]["seconds_per_batch"] for m in ("gpipe", "1f1b-flush"))


def with_study2(entry: Dict[str, Any], task: str, optimizer: str) -> Dict[str, Any]:
    """Each budget against the second study's file's M = N synchronous time (measured on a quieter
    machine with the wall clock), where that file has the cell."""
    for n, at_n in entry["stages"].items():
        b = at_n["budget"]
        old = study2_budget(task, optimizer, int(n), RESULTS / "study2" / "times.json")
        b["study2_file"] = None if old is None else {"seconds_per_batch": old,
                                                     "budget_seconds": old * b["sequential_updates"],
                                                     "budget_over_study2": b["seconds_per_batch"] / old}
    return entry


def price_cell(task: str, spec: Dict[str, Any], optimizer: str, stage_counts: Sequence[int], updates: int,
               settings: ProfileSettings, rounds: int, weight_share: float) -> Dict[str, Any]:
    """Profile the cell's model once, then time every (split, micro-batch size) the prices need
    ``rounds`` times over, round after round (each round times them all, so that every price sees
    the machine's load alike), and keep the lower of each price over the rounds."""
    quick = ProfileSettings(threads=1, warmup=0, repeats=1)  # (the layers' profile: only its shapes are used)
    model, batches = profile_cell(task, spec, optimizer, microbatch_counts(stage_counts), quick)
    model.settings = settings
    entry: Optional[Dict[str, Any]] = None
    for _ in range(rounds):
        model.timings.clear()
        load = load_average()
        priced = {**cell_entry(model, stage_counts, updates, batches, weight_share),
                  "load_average": {"start": load, "end": load_average()}}
        entry = priced if entry is None else merge_calls(entry, priced, updates)
    assert entry is not None
    entry["rounds"] = rounds
    return entry


def run(suite: Dict[str, Any], out: Path, settings: ProfileSettings, *, tasks: Optional[Sequence[str]] = None,
        resume: bool = False, weight_share: float = WEIGHT_SHARE, note: str = "", keep_lower: bool = True,
        clock: str = "cpu", rounds: int = 1, log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Price each cell (:func:`price_cell`) and write its prices and budgets into ``out`` (after
    each cell); a cell the file holds already (same settings) keeps the lower of each price
    (``keep_lower``)."""
    times = read_times(out)
    started = time.time()
    for task, optimizer in suite["cells"]:
        if tasks and task not in tasks:
            continue
        if resume and optimizer in times["cells"].get(task, {}):
            log(f"{task} x {optimizer}: in {out.name} already (--resume), skipped")
            continue
        spec, stage_counts = suite["tasks"][task], cell_stages(suite, task, optimizer)
        updates = sequential_updates(suite, task)
        cell_start, cell_load = time.time(), load_average()
        with profile_clock(clock):
            entry = price_cell(task, spec, optimizer, stage_counts, updates, settings, rounds, weight_share)
        entry.update(task=task, optimizer=optimizer, model=spec["model"], batch_size=spec["batch_size"],
                     settings={**settings.to_dict(), "clock": clock}, weight_share=weight_share,
                     seconds=time.time() - cell_start, load_average={"start": cell_load, "end": load_average()},
                     nice=os.nice(0), written=time.strftime("%Y-%m-%d %H:%M:%S"), note=note)
        previous = times["cells"].get(task, {}).get(optimizer)
        if previous is not None and previous["settings"] == entry["settings"] and keep_lower:
            entry = merge_calls(previous, entry, updates)
        times["cells"].setdefault(task, {})[optimizer] = with_study2(entry, task, optimizer)
        times.update(machine=machine(), stage_counts=suite["stages"], sync_schedules=list(SYNC_SCHEDULES),
                     sync_factors=list(SYNC_FACTORS), interleaved_chunks=INTERLEAVED_CHUNKS)
        write_times(out, times)
        log(f"[{time.time() - started:5.0f}s] {task} x {optimizer}: {time.time() - cell_start:.0f} s, load average "
            f"{cell_load[0]:.2f} -> {load_average()[0]:.2f}")
    return read_times(out)


def lookup(times: Dict[str, Any], task: str, optimizer: str, stages: int) -> Dict[str, Any]:
    """The budget entry of a (task, optimizer, N): B, the fastest schedule, U_m per variant.
    A KeyError names what the file lacks."""
    try:
        return times["cells"][task][optimizer]["stages"][str(stages)]["budget"]
    except KeyError:
        raise KeyError(f"no budget for {task} x {optimizer} at N = {stages} in the times file "
                       f"(run study/study3_times.py)") from None


def seconds_per_batch(times: Dict[str, Any], task: str, optimizer: str, stages: int, variant: str) -> float:
    """s_m of a variant (sequential: one device) from the times file."""
    cell = times["cells"][task][optimizer]
    if variant == "sequential":
        return float(cell["sequential"]["seconds_per_batch"])
    return float(cell["stages"][str(stages)]["variants"][variant]["seconds_per_batch"])


def format_table(times: Dict[str, Any]) -> str:
    """The budgets as text: per cell and N the synchronous candidates (ms per mini-batch), the
    fastest, B against M = N, and U_m per variant."""
    lines = []
    for task, by_opt in sorted(times["cells"].items()):
        for optimizer, cell in sorted(by_opt.items()):
            for n, at_n in sorted(cell["stages"].items(), key=lambda item: -int(item[0])):
                b = at_n["budget"]
                lines.append(f"{task} x {optimizer}, N = {n} (load average {cell['load_average']['start'][0]:.1f}):")
                for name, by_m in at_n["synchronous"].items():
                    cells = [f"M={m} " + (f"{row['seconds_per_batch'] * 1e3:.2f}" if "seconds_per_batch" in row
                                          else "-") for m, row in sorted(by_m.items(), key=lambda i: int(i[0]))]
                    lines.append(f"  {name:<17} " + "  ".join(cells) + " ms")
                f = b["fastest"]
                lines.append(f"  fastest {f['schedule']} M={f['microbatches']}: B = {b['budget_seconds']:.1f} s "
                             f"({b['budget_over_m_equals_n']:.2f} x M = N's {b['m_equals_n']['budget_seconds']:.1f} s)")
                lines.append("  U_m: " + ", ".join(f"{v} {u}" for v, u in b["updates"].items()))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default="default", choices=list(SUITES))
    parser.add_argument("--out", type=Path, help=f"the times file (default {TIMES.relative_to(ROOT)})")
    parser.add_argument("--tasks", help="comma-separated subset of the tasks")
    parser.add_argument("--resume", action="store_true", help="skip the cells the file holds already")
    parser.add_argument("--show", action="store_true", help="print the file's table and measure nothing")
    parser.add_argument("--replace", action="store_true",
                        help="replace the cells the file holds (default: keep the lower of each price, "
                             "call by call)")
    parser.add_argument("--note", default="", help="a line kept in each cell (what else ran on the machine)")
    parser.add_argument("--weight-share", type=float, default=WEIGHT_SHARE,
                        help="zb-h1: share of the backward that is W (default %(default)s)")
    parser.add_argument("--clock", default="cpu", choices=["cpu", "wall"],
                        help="cpu (default): the thread's CPU time, not inflated by other jobs; wall: the "
                             "profiler's wall clock (as study2_times.py)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured runs per stage timing (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="measured runs per stage timing and round "
                                                               "(default 3)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="rounds of timing every split and size, the lowest price kept (default 4)")
    args = parser.parse_args(argv)
    out = args.out or Path(SUITES[args.suite].get("times") or TIMES)
    if args.show:
        print(format_table(read_times(out)))
        return 0
    torch.set_num_threads(1)
    settings = ProfileSettings(threads=1, warmup=args.warmup, repeats=args.repeats)
    times = run(SUITES[args.suite], out, settings, tasks=args.tasks.split(",") if args.tasks else None,
                resume=args.resume, weight_share=args.weight_share, note=args.note, keep_lower=not args.replace,
                clock=args.clock, rounds=args.rounds, log=lambda line: print(line, flush=True))
    print(format_table(times))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
