"""The rule a plan recommends by where no study measured a model, and the flags beside it.

:func:`pipeoptim.plan` follows it, and the lab's ``pipeoptim plan`` for a model no study covers.
The rule: :data:`RULE`, :func:`recommend`. The flags: a prediction no split can reach
(:func:`reach`), a method whose several stages per process the simulator over-predicts
(:func:`pieces_note`)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

from .errors import Shown, option
from .methods import get_method, split_variant

RULE = ("the fastest synchronous candidate (predicted samples/s) among those whose largest process memory fits the "
        "memory limit and whose speedup a split can reach (at most the process count); within {tie:.0%} of the "
        "best counts as a tie, and ties go to less memory, then fewer micro-batches, then the earlier method; the "
        "fastest asynchronous candidate is named as the one to try")


def reach(row: Dict[str, Any], reference: float, processes: int, speeds: Optional[Sequence[float]] = None,
          tensor: int = 1) -> None:
    """Set ``row``'s ``speedup`` over the sequential ``reference`` (samples/s), ``processes``,
    ``fits`` and ``reachable``: a pipeline over P processes runs at most P times the sequential
    speed (the sum of the speeds, with ``speeds``; times T with ``tensor`` = T processes per
    stage), and a prediction above it says the profile was disturbed; ``unreachable`` says so
    (where it is)."""
    bound = tensor * (processes if speeds is None or processes == 1 else sum(speeds) / max(speeds))
    processes *= tensor
    row["speedup"] = row["samples_per_second"] / reference
    row["processes"] = processes
    row["reachable"] = row["speedup"] <= bound * (1 + 1e-9)
    row["fits"] = row.get("memory_fits", True)
    if not row["reachable"]:
        row["unreachable"] = (f"predicted {row['speedup']:.2f}x sequential on {processes} processes, more than "
                              f"any split can give ({bound:g}x): the timings were disturbed")


def recommend(candidates: Sequence[Dict[str, Any]], memory_limit: Optional[float] = None, tie: float = 0.02,
              order: Optional[Sequence[str]] = None, prefer: Optional[str] = None) -> Dict[str, Any]:
    """The recommended candidate: among those whose ``max_stage_memory`` fits ``memory_limit``
    (all, without a limit), whose speedup a split can reach (``reachable``, True where absent) and
    which may be recommended (``eligible``, True where absent; all that fit and reach, where none
    may; all that fit, where none reaches), the shortest ``time_to_target_seconds`` where every
    one has it, else the highest ``samples_per_second``. Candidates within ``tie`` (relative) of
    the best are tied, and among them ``prefer`` wins (the study's method: the better model at
    equal time), then a synchronous method, then the smaller largest-stage memory, then fewer micro-batches, then the earlier method in ``order``. A
    candidate's name there is its ``variant`` where it has one (``pipeoptim-2bw+ef``: with error
    feedback), else its ``method``. Raises ValueError when no candidate fits."""
    if not candidates:
        raise ValueError("no candidate (method, micro-batches) can run; see the reasons in the plan")
    fits = [c for c in candidates if memory_limit is None or c["max_stage_memory"] <= memory_limit]
    if not fits:
        least = min(candidates, key=lambda c: c["max_stage_memory"])
        limit = option("memory_limit", Shown(f"{memory_limit:.0f}"))
        raise ValueError(f"no method fits {limit} bytes per stage; the smallest, "
                         f"{candidate_name(least)} with {least['microbatches']} micro-batches, needs "
                         f"{least['max_stage_memory']} bytes")
    reached = [c for c in fits if c.get("reachable", True)] or fits
    pool = [c for c in reached if c.get("eligible", True)] or reached
    timed = all(c.get("time_to_target_seconds") is not None for c in pool)
    cost = (lambda c: c["time_to_target_seconds"]) if timed else (lambda c: 1.0 / c["samples_per_second"])
    best = min(cost(c) for c in pool)
    tied = [c for c in pool if cost(c) * (1.0 - tie) <= best]
    rank = {m: i for i, m in enumerate(order or [])}
    return min(tied, key=lambda c: (candidate_name(c) != prefer, not c["synchronous"], c["max_stage_memory"],
                                    c["microbatches"], rank.get(candidate_name(c), len(rank))))


def candidate_name(c: Dict[str, Any]) -> str:
    """A candidate's name: its variant (a method with its options, pipeoptim-2bw+ef), else its method."""
    return c.get("variant") or c["method"]


def _m(c: Dict[str, Any]) -> str:
    return f"{candidate_name(c)} (M = {c['microbatches']})"


def unstudied_notes(candidates: Sequence[Dict[str, Any]], best: Dict[str, Any],
                    try_it: Callable[[List[str]], str]) -> List[str]:
    """What a plan says beside ``best`` where no study measured the updates the asynchronous
    methods need: the flagged candidates, and the fastest asynchronous one, to try with
    ``try_it([methods])`` (the command or the code that compares them)."""
    out = reach_notes(candidates, best)
    if not best.get("eligible", True):
        out.append(f"no synchronous candidate fits or was asked for: {_m(best)} is recommended on throughput alone")
    rivals = [c for c in candidates if c["fits"] and c.get("reachable", True) and not c["synchronous"]
              and c is not best]
    if rivals and best["synchronous"]:
        fast = max(rivals, key=lambda c: c["samples_per_second"])
        if fast["samples_per_second"] < 1.005 * best["samples_per_second"]:
            out.append(f"so the fastest synchronous candidate is recommended, {_m(best)}; no asynchronous one is "
                       f"predicted faster (the fastest, {_m(fast)}, {fast['samples_per_second']:.0f} samples/s)")
        else:
            out.append(f"so the fastest synchronous candidate is recommended, {_m(best)}; the fastest asynchronous "
                       f"one, {_m(fast)}, predicts {fast['samples_per_second']:.0f} samples/s "
                       f"({fast['samples_per_second'] / best['samples_per_second']:.2f}x), but what its staleness "
                       f"costs in updates is unmeasured here; to try it: "
                       + try_it([candidate_name(best), candidate_name(fast)]))
    return out


def pieces_note(candidates: Sequence[Dict[str, Any]], best: Dict[str, Any], check: Callable[[List[str]], str]
                ) -> List[str]:
    """Where ``best`` holds several model pieces per process (a chunked or mirrored method): the
    simulator has predicted those faster than they ran (benchmarks/plan_vs_bench.py: the waits of
    several pieces on a process are not simulated), so name the one-piece candidate to measure it
    against, with ``check([methods])``."""
    if get_method(best["method"]).chunks == 1 or best.get("processes", 1) == 1:
        return []
    plain = [c for c in candidates if get_method(c["method"]).chunks == 1 and c.get("reachable", True)
             and c["fits"] and c["synchronous"] == best["synchronous"]]
    rival = max(plain, key=lambda c: c["samples_per_second"], default=None)
    line = (f"{_m(best)} runs {get_method(best['method']).chunks} stages on each process, whose waits the "
            f"simulator does not see: measured by pipeoptim bench, such methods have run slower than predicted")
    if rival is not None:
        line += (f"; measure it against {_m(rival)} ({rival['samples_per_second']:.0f} samples/s predicted) before "
                 f"relying on it: " + check([candidate_name(best), candidate_name(rival)]))
    return [line]


def reach_notes(candidates: Sequence[Dict[str, Any]], best: Dict[str, Any]) -> List[str]:
    """The line on the candidates no split can reach (none where every one can)."""
    flagged = [c for c in candidates if not c.get("reachable", True)]
    if not flagged:
        return []
    top = max(flagged, key=lambda c: c["speedup"])
    line = (f"{len(flagged)} candidate(s) predict more than their process count times sequential, which no split "
            f"can give (the most: {_m(top)}, {top['speedup']:.2f}x on {top['processes']}): flagged, not "
            f"recommended; the machine's other work disturbed the timings: plan again on a quieter machine, with "
            f"more repeats, or with the min statistic")
    if not best.get("reachable", True):
        line += f"; every candidate that fits is flagged, so {_m(best)} is recommended on these numbers alone"
    return [line]


def _call(name: str) -> str:
    """A candidate's keyword arguments: ``method='pipeoptim-2bw', error_feedback=True`` for
    ``pipeoptim-2bw+ef``."""
    method, options = split_variant(name)
    return ", ".join([f"method={method!r}"] + [f"{k}={v!r}" for k, v in options.items()])


def time_in_code(methods: List[str]) -> str:
    """How to measure ``methods``' speed on a model of your own (variant names, as
    :func:`pipeoptim.methods.split_variant` reads them)."""
    return (f"time Pipeline({_call(methods[0])}) and Pipeline({_call(methods[-1])}) on your model under "
            f"torchrun, one process per pipeline rank")


def try_in_code(methods: List[str]) -> str:
    """How to compare ``methods`` on a model of your own (variant names, as
    :func:`pipeoptim.methods.split_variant` reads them)."""
    return ("train them on your data for the same time and compare the models (pipeoptim.train with "
            f"{_call(methods[0])} and {_call(methods[-1])})")
