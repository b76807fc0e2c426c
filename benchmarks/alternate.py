"""Two or more commits measured in turn in one run (issue 50, item 9), so that a loss of speed
between them shows however loaded the host: the commits take turns round after round (their
order rotating), so that a drift of the host hits all of them alike.

Each commit runs from a git worktree of its own, ``--worktrees``/<full sha> (``/tmp/pipeoptim-alt``
by default; made with ``git worktree add --detach``, reused when present; ``.``: this working
tree as it is, uncommitted edits included), through the interpreter running this script (the
repository's ``.venv``) with ``PYTHONPATH=<tree>/src:<tree>``, checked to import ``pipeoptim``
from that tree. One measurement of a commit is the same two commands for every commit:

* ``peer``: this file's worker (the same code for every commit, run as a file so that no
  ``benchmarks`` package of the commit's enters; only its ``pipeoptim`` does), 2 processes under
  ``torch.distributed.run`` (gloo, one compute thread each): the ``blocks`` model of
  ``pipeoptim bench`` split [4, 5], Fashion-MNIST-shaped synthetic batches of 512, momentum SGD
  (lr 0.01), as ``benchmarks/peer_throughput.py`` builds it. Runs, in an order rotating with the
  round: a plain one-thread loop on rank 0, ours ``gpipe`` and ``1f1b-flush`` at M = 2 through
  ``Pipeline.fit``, ours ``1f1b-flush`` at M = 2 through ``step`` per mini-batch and a
  ``flush`` (as torch's loop drives its schedule), and torch's ``ScheduleGPipe`` and
  ``Schedule1F1B`` at M = 2 on the same split. Each run gets fresh weights, ``--warmup``
  untimed mini-batches, then ``--batches`` timed from a barrier to a barrier: the wall time and
  each process's CPU time (``time.process_time``) and its main thread's (``time.thread_time``).
  Where the commits keep things in different modules the worker maps them (:data:`COMPAT`:
  6bb0f1e has ``pipeoptim.bench_worker`` and ``pipeoptim.optimizers``, later commits
  ``pipeoptim.lab.bench_worker`` and ``pipeoptim.lab.optimizers``). Each run also counts the
  voluntary context switches per mini-batch (of every process and of its main thread: how
  often it blocked, on a message or a lock; a count, not a time).
* ``bench``: the commit's own ``python -m pipeoptim bench --task image --synthetic --methods
  pipeoptim,async-naive --optimizer momentum --lr 0.01 --no-baselines --repeats 1`` (the
  spelling is the same from 6bb0f1e on; the optimizer is given because its default changed
  from momentum to adamw; the methods' order rotates with the round), for PipeOptim against
  async-naive through the commit's own bench worker (its command line and worker are the
  commit's, so a change there shows too); its CPU per mini-batch is the processes' CPU shares x
  the wall ms per mini-batch. ``--no-bench`` leaves it out.

Reported per commit: the median over rounds of each ratio taken within a round (ours / torch's
for 1F1B-flush by fit and by step and for GPipe; PipeOptim / async-naive), with its min, max and
interquartile range, and the CPU ms per mini-batch of every run (all processes; the peer runs
also the main threads'), which on a loaded host is the steadier measure. Rows go to
``--out`` (JSON lines, one per commit and round, appended as they come) and the summary beside
it (``.summary.json``); ``--from-rows FILE`` summarises rows again without running anything.

``--profile`` measures instead: per commit, one job of 2 processes in which each rank fits
``--batches`` mini-batches of ``--profile-method`` (default ``1f1b-flush``) at
``--profile-micro`` micro-batches (default 2; 0: the method's own) after ``--warmup``
(``--fresh``: a new Pipeline's first fit, as ``pipeoptim bench`` times a run), unprofiled
(CPU per mini-batch of the process and its main thread), then on a second Pipeline under
cProfile timed by the main thread's CPU clock (``time.thread_time``, so other work on the
host does not enter); then per
rank the functions whose own time (tottime), cumulative time and calls per mini-batch differ
most between the first commit and each other one (functions matched by their path within the
package and name; ``--top`` rows). The ``.prof`` files stay in ``--profile-dir``.

    .venv/bin/python -m benchmarks.alternate --commits 6bb0f1e,main,. [--rounds 5] [--batches 16]
    .venv/bin/python -m benchmarks.alternate --commits 6bb0f1e,main --profile [--top 25] [--fresh]
        [--profile-method pipeoptim --profile-micro 0] [--profile-dir /tmp/alt-prof]
    .venv/bin/python -m benchmarks.alternate --from-rows benchmarks/results/alternate.jsonl
    .venv/bin/python -m benchmarks.alternate --commits 6bb0f1e,main --remove-worktrees  # and nothing else
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
WORKTREES = Path("/tmp/pipeoptim-alt")
RESULTS = ROOT / "benchmarks" / "results" / "alternate.jsonl"
BATCH = 512
PARTITION = [4, 5]
LR = 0.01
PLAIN = "plain (1 process)"
#: the peer job's runs: (label, side, schedule, micro-batches, drive); side "ours": the commit's
#: pipeoptim.Pipeline, "torch": torch.distributed.pipelining on the same split; drive "fit" or "step"
PEER_RUNS = [
    ("ours gpipe M=2", "ours", "gpipe", 2, "fit"),
    ("torch ScheduleGPipe M=2", "torch", "ScheduleGPipe", 2, ""),
    ("ours 1f1b-flush M=2", "ours", "1f1b-flush", 2, "fit"),
    ("ours 1f1b-flush M=2 (step)", "ours", "1f1b-flush", 2, "step"),
    ("torch Schedule1F1B M=2", "torch", "Schedule1F1B", 2, ""),
]
BENCH_METHODS = ["pipeoptim", "async-naive"]
#: (ratio, numerator run, denominator run); the bench's runs are named "bench <method>"
PAIRS = [
    ("1f1b-flush / Schedule1F1B, M=2 (fit)", "ours 1f1b-flush M=2", "torch Schedule1F1B M=2"),
    ("1f1b-flush / Schedule1F1B, M=2 (step)", "ours 1f1b-flush M=2 (step)", "torch Schedule1F1B M=2"),
    ("gpipe / ScheduleGPipe, M=2 (fit)", "ours gpipe M=2", "torch ScheduleGPipe M=2"),
    ("pipeoptim / async-naive (bench)", "bench pipeoptim", "bench async-naive"),
]
#: where each commit keeps what the worker uses: (what, [module candidates, newest first])
COMPAT = {
    "blocks_model": ["pipeoptim.lab.bench_worker", "pipeoptim.bench_worker"],
    "make_optimizer": ["pipeoptim.lab.optimizers", "pipeoptim.optimizers"],
    "init_process_group": ["pipeoptim.runtime.control", "pipeoptim.runtime.distributed"],
    "split": ["pipeoptim.partition"],
    "Pipeline": ["pipeoptim.pipeline"],
}


# ---- arithmetic (tested in tests/test_alternate.py) -----------------------------------------

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


# ---- commits and worktrees -----------------------------------------------------------------

def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def resolve(commits: Sequence[str]) -> List[Tuple[str, str]]:
    """``--commits`` -> (label, full sha, or "." for this working tree), each commit once
    (a second name of a commit already given is dropped, and said)."""
    out, seen = [], {}
    for name in commits:
        sha = "." if name == "." else git("rev-parse", "--verify", f"{name}^{{commit}}")
        if sha in seen:
            print(f"alternate: {name} is {seen[sha]} ({sha[:7]}): measured once", file=sys.stderr)
            continue
        seen[sha] = name
        out.append((name, sha))
    return out


def tree_of(sha: str, worktrees: Path) -> Path:
    """The tree that runs ``sha``: this working tree for ".", else its worktree (made if absent)."""
    if sha == ".":
        return ROOT
    path = worktrees / sha
    if path.exists():
        try:
            if git("rev-parse", "HEAD", cwd=path) == sha:
                return path
        except subprocess.CalledProcessError:
            pass
        raise RuntimeError(f"{path} exists but is not a worktree at {sha}: remove it")
    worktrees.mkdir(parents=True, exist_ok=True)
    git("worktree", "add", "--detach", str(path), sha)
    return path


def remove_worktrees(commits: Sequence[Tuple[str, str]], worktrees: Path) -> None:
    for _, sha in commits:
        path = worktrees / sha
        if sha != "." and path.exists():
            git("worktree", "remove", "--force", str(path))
            print(f"alternate: removed {path}", file=sys.stderr)


def env_of(tree: Path) -> Dict[str, str]:
    """The environment that imports the tree's code: its src and root first on PYTHONPATH,
    one compute thread, gloo on loopback."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "src"), str(tree)])
    if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def check_import(tree: Path) -> str:
    """Where ``pipeoptim`` comes from under :func:`env_of`; refuses a path outside ``tree``."""
    where = subprocess.run([sys.executable, "-c", "import pipeoptim; print(pipeoptim.__file__)"],
                           env=env_of(tree), cwd=tree, check=True, capture_output=True, text=True).stdout.strip()
    if not Path(where).resolve().is_relative_to((tree / "src").resolve()):
        raise RuntimeError(f"pipeoptim imports from {where}, not from {tree / 'src'}")
    return where


def torchrun(tree: Path, worker_args: Sequence[str], timeout: float) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE), "--worker", *worker_args]
    subprocess.run(cmd, env=env_of(tree), cwd=tree, check=True, timeout=timeout)


def bench_command(tree: Path, args: argparse.Namespace, out: Path, r: int = 0) -> List[str]:
    """The commit's ``pipeoptim bench`` for PipeOptim against async-naive (spelled alike from
    6bb0f1e on; the optimizer named, as its default changed), the methods' order rotated by
    the round ``r``."""
    shift = r % len(BENCH_METHODS)
    methods = BENCH_METHODS[shift:] + BENCH_METHODS[:shift]
    return [sys.executable, "-m", "pipeoptim", "bench", "--task", "image", "--synthetic",
            "--methods", ",".join(methods), "--optimizer", "momentum", "--lr", str(LR),
            "--stages", "2", "--no-baselines", "--repeats", "1", "--batches", str(args.batches),
            "--warmup", str(args.warmup), "--timeout", str(args.timeout), "--out", str(out), "--json"]


def measure(tree: Path, r: int, args: argparse.Namespace) -> Dict[str, Dict[str, float]]:
    """One measurement of the commit in ``tree``: the peer job and (unless --no-bench) its bench."""
    with tempfile.TemporaryDirectory(prefix="pipeoptim-alt-") as tmp:
        out = Path(tmp) / "peer.json"
        torchrun(tree, ["--round", str(r), "--batches", str(args.batches), "--warmup", str(args.warmup),
                        "--timeout", str(args.timeout), "--out", str(out)], timeout=args.job_timeout)
        runs = parse_peer(json.loads(out.read_text()))
        if not args.no_bench:
            bench = Path(tmp) / "bench.json"
            subprocess.run(bench_command(tree, args, bench, r), env=env_of(tree), cwd=tree, check=True,
                           stdout=subprocess.DEVNULL, timeout=args.job_timeout)
            runs.update(parse_bench(json.loads(bench.read_text())))
    return runs


# ---- the worker (one per rank, under torch.distributed.run, importing the commit's pipeoptim) -

def _compat() -> Dict[str, Any]:
    """What the worker uses from the commit's pipeoptim, wherever that commit keeps it."""
    import importlib

    found = {}
    for name, modules in COMPAT.items():
        for module in modules:
            try:
                found[name] = getattr(importlib.import_module(module), name)
                break
            except (ImportError, AttributeError):
                continue
        else:
            raise ImportError(f"no {name} in {', '.join(modules)}")
    return found


def _data(count: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, 1, 28, 28, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(count)]


def _build(api: Dict[str, Any], side: str, schedule: str, micro: int, drive: str, rank: int, timeout: float):
    """(train(batches), close()) of one run on this process."""
    import torch
    from torch import nn

    loss_fn = nn.functional.cross_entropy
    optimizer = api["make_optimizer"]("momentum", LR)
    if side == "plain":
        model = api["blocks_model"](2)
        opt = optimizer(model.parameters())

        def plain(batches):
            if rank != 0:
                return
            for x, y in batches:
                opt.zero_grad(set_to_none=True)
                loss_fn(model(x), y).backward()
                opt.step()
        return plain, (lambda: None)
    if side == "ours":
        pipeline = api["Pipeline"](api["blocks_model"](2), method=schedule, loss_fn=loss_fn, optimizer=optimizer,
                                   stages=2, partition=PARTITION, micro_batches=micro, devices="cpu",
                                   timeout=timeout, threads=1)

        def by_step(batches):
            for x, y in batches:
                pipeline.step(x, y, segment_length=len(batches))
            pipeline.flush()
        return (by_step if drive == "step" else (lambda batches: pipeline.fit(list(batches)))), pipeline.close
    from torch.distributed import pipelining

    part = api["split"](api["blocks_model"](2), PARTITION)[rank]
    stage = pipelining.PipelineStage(part, rank, 2, torch.device("cpu"))
    sched = getattr(pipelining, schedule)(
        stage, n_microbatches=micro, scale_grads=False,
        loss_fn=lambda output, target: loss_fn(output, target) * (target.shape[0] / BATCH))
    opt = optimizer(part.parameters())

    def peer(batches):
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            if rank == 0:
                sched.step(x)
            else:
                sched.step(target=y, losses=[])
            opt.step()
    return peer, (lambda: None)


def _timed(train, close, warm, timed) -> Dict[str, Any]:
    """Warm up, time from a barrier to a barrier, close: wall seconds, every rank's process and
    main-thread CPU seconds."""
    import resource

    import torch
    import torch.distributed as dist

    def switches() -> List[float]:  # voluntary context switches: the process's, its main thread's
        return [float(resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw),
                float(resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw)]

    try:
        train(warm)
        dist.barrier()
        before = switches()
        start, cpu, thread = time.perf_counter(), time.process_time(), time.thread_time()
        train(timed)
        spent = [time.process_time() - cpu, time.thread_time() - thread] + [b - a for a, b in zip(before, switches())]
        dist.barrier()
        wall = time.perf_counter() - start
    finally:
        close()
    every = [torch.zeros(4, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, torch.tensor(spent, dtype=torch.float64))
    return {"wall": wall, "cpu": [float(t[0]) for t in every], "thread": [float(t[1]) for t in every],
            "switches": [float(t[2]) for t in every], "main_switches": [float(t[3]) for t in every]}


def _worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    api = _compat()
    api["init_process_group"](device="cpu", timeout=args.timeout, threads=1)
    rank = dist.get_rank()
    data = _data(args.warmup + args.batches)
    warm, timed = data[:args.warmup], data[args.warmup:]
    try:
        if args.profile_dir:
            return _profile_worker(api, rank, warm, timed, args)
        runs = [(PLAIN, "plain", "", 0, "")] + PEER_RUNS
        shift = args.round % len(runs)
        result = {"batches": args.batches, "batch_size": BATCH, "runs": {}}
        for label, side, schedule, micro, drive in runs[shift:] + runs[:shift]:
            result["runs"][label] = _timed(*_build(api, side, schedule, micro, drive, rank, args.timeout), warm, timed)
        if rank == 0:
            Path(args.out).write_text(json.dumps(result))
        return 0
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _profile_worker(api, rank: int, warm, timed, args: argparse.Namespace) -> int:
    """``--profile-method`` at ``--profile-micro`` micro-batches by fit: CPU per mini-batch
    unprofiled, then a cProfile on the main thread's CPU clock, each on a Pipeline of its own
    (``--fresh``: its first fit, setup included, as ``pipeoptim bench`` times it; else after
    ``warm``); ``<profile-dir>/r<rank>.prof`` and ``r<rank>.json``."""
    import cProfile

    import torch.distributed as dist

    micro = args.profile_micro or None
    info: Dict[str, Any] = {"batches": len(timed)}
    for profiled in (False, True):
        train, close = _build(api, "ours", args.profile_method, micro, "fit", rank, args.timeout)
        try:
            if not args.fresh:
                train(warm)
            dist.barrier()
            profile = cProfile.Profile(time.thread_time) if profiled else None
            cpu, thread = time.process_time(), time.thread_time()
            if profile is not None:
                profile.enable()
            train(timed)
            if profile is not None:
                profile.disable()
            key = "profiled_" if profiled else ""
            info[key + "cpu_ms"] = 1e3 * (time.process_time() - cpu) / len(timed)
            info[key + "thread_ms"] = 1e3 * (time.thread_time() - thread) / len(timed)
        finally:
            close()
    folder = Path(args.profile_dir)
    profile.dump_stats(str(folder / f"r{rank}.prof"))
    (folder / f"r{rank}.json").write_text(json.dumps(info))
    return 0


# ---- profile comparison ---------------------------------------------------------------------

def function_table(prof: Path, batches: int) -> Dict[str, Dict[str, float]]:
    """A .prof -> per function ("pipeoptim/<path>:<name>", "torch/<path>:<name>" or a builtin's
    name; the line left out, so that moved code still matches): calls, tottime and cumtime (ms)
    per mini-batch, summed over functions of one name in one file."""
    import pstats

    stats = pstats.Stats(str(prof))
    out: Dict[str, Dict[str, float]] = {}
    for (path, _, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        key = name if path == "~" else f"{short_path(path)}:{name}"
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


def profile_commits(commits: List[Tuple[str, str, Path]], args: argparse.Namespace) -> Dict[str, Any]:
    folder = Path(args.profile_dir or tempfile.mkdtemp(prefix="pipeoptim-alt-profile-"))
    tables, plain = {}, {}
    for label, sha, tree in commits:
        out = folder / (f"{sha[:12] if sha != '.' else 'worktree'}-{args.profile_method}-M{args.profile_micro}"
                        + ("-fresh" if args.fresh else ""))
        out.mkdir(parents=True, exist_ok=True)
        torchrun(tree, ["--profile-dir", str(out), "--batches", str(args.batches), "--warmup", str(args.warmup),
                        "--timeout", str(args.timeout), "--profile-method", args.profile_method,
                        "--profile-micro", str(args.profile_micro)] + (["--fresh"] if args.fresh else []),
                 timeout=args.job_timeout)
        for rank in (0, 1):
            info = json.loads((out / f"r{rank}.json").read_text())
            plain[(label, rank)] = info
            tables[(label, rank)] = function_table(out / f"r{rank}.prof", info["batches"])
    report: Dict[str, Any] = {"folder": str(folder), "cpu": {}, "differences": {}}
    base = commits[0][0]
    for label, _, _ in commits:
        for rank in (0, 1):
            report["cpu"][f"{label} r{rank}"] = plain[(label, rank)]
    for label, _, _ in commits[1:]:
        for rank in (0, 1):
            for key in ("tottime_ms", "cumtime_ms", "calls"):
                report["differences"][f"{label} - {base}, rank {rank}, {key}"] = differences(
                    tables[(base, rank)], tables[(label, rank)], key, args.top)
    return report


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


# ---- the command ----------------------------------------------------------------------------

def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", default="6bb0f1e,main,.",
                        help="comma-separated commits (any git name; '.': this working tree), at least two "
                             "unless --remove-worktrees (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each measuring every commit (default: 5)")
    parser.add_argument("--batches", type=int, default=16, help="timed mini-batches per run (default: 16)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed mini-batches per run first (default: 1)")
    parser.add_argument("--no-bench", action="store_true", help="leave out pipeoptim bench (PipeOptim / async-naive)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a process waits for its peer")
    parser.add_argument("--job-timeout", type=float, default=1800.0, help="seconds one job may take (default: 1800)")
    parser.add_argument("--worktrees", type=Path, default=WORKTREES, help="where the worktrees go (default: %(default)s)")
    parser.add_argument("--remove-worktrees", action="store_true",
                        help="remove the commits' worktrees (git worktree remove --force) and exit")
    parser.add_argument("--out", type=Path, default=RESULTS, help="rows, JSON lines (default: %(default)s)")
    parser.add_argument("--from-rows", type=Path, default=None, help="summarise these rows; run nothing")
    parser.add_argument("--profile", action="store_true", help="profile 1f1b-flush's fit per commit instead")
    parser.add_argument("--profile-dir", default=None, help="where the .prof files go (default: a new temporary folder)")
    parser.add_argument("--profile-method", default="1f1b-flush", help="the method profiled (default: %(default)s)")
    parser.add_argument("--profile-micro", type=int, default=2,
                        help="its micro-batches (default: %(default)s; 0: the method's own)")
    parser.add_argument("--fresh", action="store_true",
                        help="profile a new Pipeline's first fit, its setup included (as pipeoptim bench times a run)")
    parser.add_argument("--top", type=int, default=20, help="functions listed per comparison (default: 20)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    if args.from_rows is not None:
        rows = [json.loads(line) for line in args.from_rows.read_text().splitlines() if line.strip()]
        print(format_summary(aggregate(rows)))
        return 0
    for name in ("rounds", "batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    commits = resolve([c.strip() for c in args.commits.split(",") if c.strip()])
    if args.remove_worktrees:
        remove_worktrees(commits, args.worktrees)
        return 0
    if len(commits) < 2:
        parser.error("--commits needs two commits or more")
    trees = [(label, sha, tree_of(sha, args.worktrees)) for label, sha in commits]
    for label, sha, tree in trees:
        print(f"alternate: {label} ({sha[:12]}): pipeoptim from {check_import(tree)}", file=sys.stderr)
    if args.profile:
        report = profile_commits(trees, args)
        print(format_profile(report))
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    load_before = os.getloadavg()
    with args.out.open("a") as sink:
        for r in range(args.rounds):
            shift = r % len(trees)
            for label, sha, tree in trees[shift:] + trees[:shift]:
                start = time.monotonic()
                try:
                    runs = measure(tree, r, args)
                except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError, ValueError) as error:
                    # (a tree mid-edit that does not run): this round goes without it
                    print(f"alternate: round {r + 1}, {label} failed ({error}); left out", file=sys.stderr)
                    continue
                row = {"commit": label, "sha": sha, "round": r, "runs": runs, "load": list(os.getloadavg())}
                rows.append(row)
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                print(f"alternate: round {r + 1}/{args.rounds}, {label}: {time.monotonic() - start:.0f} s", file=sys.stderr)
    if not rows:
        print("alternate: no measurement succeeded", file=sys.stderr)
        return 1
    summary = aggregate(rows)
    summary_path = args.out.with_suffix(".summary.json")
    summary_path.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                        "commits": {label: sha for label, sha, _ in trees},
                                        "load_before": list(load_before), "load_after": list(os.getloadavg()),
                                        "summary": summary}, indent=2))
    print(format_summary(summary))
    print(f"rows appended to {args.out}; summary in {summary_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
