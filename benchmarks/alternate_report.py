"""benchmarks/alternate.py's arithmetic and reports, apart from running anything: the peer
worker's and ``pipeoptim bench``'s results read into per-run samples/s and CPU ms per
mini-batch, the ratios within each round and their spread over the rounds per commit, the
summary table, and the profile comparison (per-function tables from cProfile files, their
largest differences). Tested on canned results in tests/test_alternate.py."""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

#: (ratio, numerator run, denominator run); the bench's runs are named "bench <method>"
PAIRS = [
    ("1f1b-flush / Schedule1F1B, M=2 (fit)", "ours 1f1b-flush M=2", "torch Schedule1F1B M=2"),
    ("1f1b-flush / Schedule1F1B, M=2 (step)", "ours 1f1b-flush M=2 (step)", "torch Schedule1F1B M=2"),
    ("gpipe / ScheduleGPipe, M=2 (fit)", "ours gpipe M=2", "torch ScheduleGPipe M=2"),
    ("pipeoptim / async-naive (bench)", "bench pipeoptim", "bench async-naive"),
]


def quartiles(values: Sequence[float]) -> List[float]:
    """First quartile, median and third quartile (linear interpolation between order
    statistics, as numpy's ``percentile`` and ``pipeoptim bench``); one value gives it three times."""
    if not values:
        raise ValueError("quartiles of no values")
    xs = sorted(values)
    if len(xs) == 1:
        return [xs[0]] * 3

    def at(q: float) -> float:
        pos = q * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return [at(0.25), at(0.5), at(0.75)]


def spread(values: Sequence[float]) -> Dict[str, Any]:
    """The median of ``values`` with min, max, quartiles and the interquartile range."""
    q1, med, q3 = quartiles(values)
    return {"median": med, "min": min(values), "max": max(values), "q1": q1, "q3": q3,
            "iqr": q3 - q1, "n": len(values), "values": list(values)}


def parse_peer(result: Dict[str, Any]) -> Dict[str, Dict[str, float]]:
    """The peer worker's result -> per run: samples/s, CPU ms per mini-batch of all processes
    (``cpu_ms``) and of their main threads (``thread_ms``)."""
    batches = result["batches"]
    out = {}
    for name, r in result["runs"].items():
        out[name] = {"samples_per_second": result["batch_size"] * batches / r["wall"],
                     "cpu_ms": 1e3 * sum(r["cpu"]) / batches,
                     "thread_ms": 1e3 * sum(r["thread"]) / batches}
        if "switches" in r:  # voluntary context switches per mini-batch, all processes (their main threads)
            out[name]["switches"] = sum(r["switches"]) / batches
            out[name]["main_switches"] = sum(r["main_switches"]) / batches
    return out


def parse_bench(result: Dict[str, Any]) -> Dict[str, Dict[str, float]]:
    """``pipeoptim bench``'s results file -> per method "bench <method>": samples/s and CPU ms
    per mini-batch of all processes (the median round's CPU share of each process x its wall
    ms per mini-batch; with one round, that round's)."""
    out = {}
    for name, d in result["detail"].items():
        sps = d["samples_per_second"]
        rounds = d["rounds_samples_per_second"]
        median_round = sorted(range(len(rounds)), key=lambda i: rounds[i])[(len(rounds) - 1) // 2]
        shares = d["cpu_share"][median_round]
        out[f"bench {name}"] = {"samples_per_second": sps, "cpu_ms": sum(shares) * d["ms_per_batch"]}
    return out


def aggregate(rows: List[Dict[str, Any]], pairs=PAIRS) -> Dict[str, Any]:
    """Rows (one per commit and round: ``{"commit", "round", "runs": {run: {samples_per_second,
    cpu_ms, [thread_ms]}}}``) -> per commit, in the order first seen: per pair the ratio
    within each round and its spread over the rounds, its CPU ratio (numerator's CPU ms over
    the denominator's, per round), and per run the spread of samples/s and CPU ms per mini-batch."""
    by_commit: Dict[str, List[Dict[str, Dict[str, float]]]] = {}
    for row in rows:
        by_commit.setdefault(row["commit"], []).append(row["runs"])
    out: Dict[str, Any] = {}
    for commit, rounds in by_commit.items():
        ratios, cpu_ratios = {}, {}
        for name, num, den in pairs:
            have = [r for r in rounds if num in r and den in r]
            if have:
                ratios[name] = spread([r[num]["samples_per_second"] / r[den]["samples_per_second"] for r in have])
                cpu_ratios[name] = spread([r[num]["cpu_ms"] / r[den]["cpu_ms"] for r in have])
        runs: Dict[str, Dict[str, Any]] = {}
        for r in rounds:
            for name, v in r.items():
                entry = runs.setdefault(name, {})
                for key, x in v.items():
                    entry.setdefault(key, []).append(x)
        out[commit] = {"rounds": len(rounds), "ratios": ratios, "cpu_ratios": cpu_ratios,
                       "runs": {name: {k: spread(xs) for k, xs in v.items()} for name, v in runs.items()}}
    return out


def format_summary(summary: Dict[str, Any]) -> str:
    """The ratios (median [min-max, IQR]) per commit, then CPU ms per mini-batch per run."""
    commits = list(summary)
    lines = []

    def table(head: List[str], rows: List[List[str]]) -> None:
        widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
        fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
        lines.extend([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])

    def cell(s: Optional[Dict[str, Any]], digits: int = 3) -> str:
        if s is None:
            return "-"
        return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}, IQR {s['iqr']:.{digits}f}]"

    names = list(dict.fromkeys(n for c in commits for n in summary[c]["ratios"]))
    table(["ratio (within a round), median [min-max, IQR]"] + commits,
          [[n] + [cell(summary[c]["ratios"].get(n)) for c in commits] for n in names])
    lines.append("")
    table(["CPU ratio (numerator's CPU ms / denominator's)"] + commits,
          [[n] + [cell(summary[c]["cpu_ratios"].get(n)) for c in commits] for n in names])
    lines.append("")
    runs = list(dict.fromkeys(n for c in commits for n in summary[c]["runs"]))
    rows = []
    for n in runs:
        row = [n]
        for c in commits:
            e = summary[c]["runs"].get(n)
            if e is None:
                row.append("-")
                continue
            text = f"{e['cpu_ms']['median']:.1f}"
            if "thread_ms" in e:
                text += f" ({e['thread_ms']['median']:.1f} main)"
            text += f", {e['samples_per_second']['median']:.0f}/s"
            if "switches" in e:
                text += f", {e['switches']['median']:.1f} ({e['main_switches']['median']:.1f}) sw"
            row.append(text)
        rows.append(row)
    table(["run: CPU ms per mini-batch, all processes (main threads); samples/s; voluntary context switches "
           "per mini-batch, all processes (main threads); medians"] + commits, rows)
    lines.append("")
    lines.append("rounds: " + ", ".join(f"{c} {summary[c]['rounds']}" for c in commits))
    return "\n".join(lines)


# ---- profile comparison ---------------------------------------------------------------------

def function_table(prof: Path, batches: int) -> Dict[str, Dict[str, float]]:
    """A .prof -> per function ("pipeoptim/<path>:<name>", "torch/<path>:<name>" or a builtin's
    name; the line and a builtin's address left out, so that moved code and another process
    still match): calls, tottime and cumtime (ms) per mini-batch, summed over functions of one
    name in one file."""
    import pstats

    stats = pstats.Stats(str(prof))
    out: Dict[str, Dict[str, float]] = {}
    for (path, _, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        key = re.sub(r" at 0x[0-9a-f]+", "", name) if path == "~" else f"{short_path(path)}:{name}"
        e = out.setdefault(key, {"calls": 0.0, "tottime_ms": 0.0, "cumtime_ms": 0.0})
        e["calls"] += ncalls / batches
        e["tottime_ms"] += 1e3 * tottime / batches
        e["cumtime_ms"] = max(e["cumtime_ms"], 1e3 * cumtime / batches)  # recursion: not summed
    return out


def short_path(path: str) -> str:
    """A source path from the package folder on (``pipeoptim/runtime/link.py``), whichever tree."""
    parts = Path(path).parts
    for anchor in ("pipeoptim", "torch"):
        if anchor in parts:
            i = len(parts) - 1 - parts[::-1].index(anchor)
            return "/".join(parts[i:])
    return Path(path).name


def differences(base: Dict[str, Dict[str, float]], other: Dict[str, Dict[str, float]], key: str,
                top: int) -> List[Tuple[str, float, float]]:
    """The ``top`` functions whose ``key`` per mini-batch differs most (other - base), largest
    absolute difference first: (function, base's, other's)."""
    names = set(base) | set(other)
    rows = [(n, base.get(n, {}).get(key, 0.0), other.get(n, {}).get(key, 0.0)) for n in names]
    rows.sort(key=lambda r: -abs(r[2] - r[1]))
    return rows[:top]


def format_profile(report: Dict[str, Any]) -> str:
    lines = ["CPU ms per mini-batch unprofiled (process, main thread), and the process's under cProfile:"]
    for name, c in report["cpu"].items():
        lines.append(f"  {name}: {c['cpu_ms']:.1f}, {c['thread_ms']:.1f}; profiled {c['profiled_cpu_ms']:.1f}, "
                     f"{c['profiled_thread_ms']:.1f}")
    for name, rows in report["differences"].items():
        lines.append("")
        lines.append(f"{name} per mini-batch (base -> other, difference):")
        for fn, a, b in rows:
            lines.append(f"  {b - a:+9.3f}  {a:9.3f} -> {b:9.3f}  {fn}")
    lines.append(f"\nprofiles in {report['folder']}")
    return "\n".join(lines)
