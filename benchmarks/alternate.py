"""Two or more commits measured in turn in one run (issue 50, item 9), so that a loss of speed
between them shows however loaded the host: the commits take turns round after round (their
order rotating), so that a drift of the host hits all of them alike.

Each commit runs from a git worktree of its own, ``--worktrees``/<full sha> (``/tmp/pipeoptim-alt``
by default; made with ``git worktree add --detach``, reused when present; ``.``: this working
tree as it is, uncommitted edits included), through the interpreter running this script (the
repository's ``.venv``) with ``PYTHONPATH=<tree>/src:<tree>``, checked to import ``pipeoptim``
from that tree. One measurement of a commit is the same two commands for every commit:

* ``peer``: benchmarks/alternate_worker.py (the same code for every commit, run as a file so that no
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
  from momentum to adamw, ``--optimizer`` names another; the methods' order rotates with the
  round), for PipeOptim against async-naive through the commit's own bench worker (its command
  line and worker are the commit's, so a change there shows too); its CPU per mini-batch is the
  processes' CPU shares x the wall ms per mini-batch. ``--no-bench`` leaves it out.

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
package and name; ``--top`` rows). With ``--profile-against METHOD`` each commit (one is
enough) profiles that method too, and the differences are ``--profile-method``'s against it on
the same tree (PipeOptim against async-naive: what the prediction costs). ``--optimizer`` sets
the profiled fit's optimizer (momentum SGD by default; adamw is ``pipeoptim bench``'s). The
``.prof`` files stay in ``--profile-dir``.

    .venv/bin/python -m benchmarks.alternate --commits 6bb0f1e,main,. [--rounds 5] [--batches 16]
    .venv/bin/python -m benchmarks.alternate --commits 6bb0f1e,main --profile [--top 25] [--fresh]
        [--profile-method pipeoptim --profile-micro 0] [--profile-dir /tmp/alt-prof]
    .venv/bin/python -m benchmarks.alternate --commits . --profile --profile-method pipeoptim \\
        --profile-against async-naive --profile-micro 0 --optimizer adamw
    .venv/bin/python -m benchmarks.alternate --from-rows benchmarks/results/alternate.jsonl
    .venv/bin/python -m benchmarks.alternate --commits 6bb0f1e,main --remove-worktrees  # and nothing else
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks.alternate_report import aggregate, differences, format_profile, format_summary, function_table, \
    parse_bench, parse_peer
from benchmarks.alternate_worker import LR

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
WORKER = HERE.with_name("alternate_worker.py")  #: run as a file by torch.distributed.run, per commit
WORKTREES = Path("/tmp/pipeoptim-alt")
RESULTS = ROOT / "benchmarks" / "results" / "alternate.jsonl"
BENCH_METHODS = ["pipeoptim", "async-naive"]


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
           str(WORKER), *worker_args]
    subprocess.run(cmd, env=env_of(tree), cwd=tree, check=True, timeout=timeout)


def bench_command(tree: Path, args: argparse.Namespace, out: Path, r: int = 0,
                  optimizer: str = "momentum") -> List[str]:
    """The commit's ``pipeoptim bench`` for PipeOptim against async-naive (spelled alike from
    6bb0f1e on; the optimizer named, as its default changed), the methods' order rotated by
    the round ``r``."""
    shift = r % len(BENCH_METHODS)
    methods = BENCH_METHODS[shift:] + BENCH_METHODS[:shift]
    return [sys.executable, "-m", "pipeoptim", "bench", "--task", "image", "--synthetic",
            "--methods", ",".join(methods), "--optimizer", optimizer, "--lr", str(LR),
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
            subprocess.run(bench_command(tree, args, bench, r, args.optimizer), env=env_of(tree), cwd=tree, check=True,
                           stdout=subprocess.DEVNULL, timeout=args.job_timeout)
            runs.update(parse_bench(json.loads(bench.read_text())))
    return runs


def profile_commits(commits: List[Tuple[str, str, Path]], args: argparse.Namespace) -> Dict[str, Any]:
    """The ``--profile`` job of each commit (and method, with ``--profile-against``) and the
    differences per rank: each commit against the first, or per commit ``--profile-method``
    against ``--profile-against``."""
    folder = Path(args.profile_dir or tempfile.mkdtemp(prefix="pipeoptim-alt-profile-"))
    methods = [args.profile_method] + ([args.profile_against] if args.profile_against else [])
    tables, plain, names = {}, {}, []
    for label, sha, tree in commits:
        for method in methods:
            name = f"{label} {method}" if args.profile_against else label
            names.append(name)
            out = folder / (f"{sha[:12] if sha != '.' else 'worktree'}-{method}-M{args.profile_micro}"
                            + ("-fresh" if args.fresh else "") + f"-{args.optimizer}")
            out.mkdir(parents=True, exist_ok=True)
            torchrun(tree, ["--profile-dir", str(out), "--batches", str(args.batches), "--warmup", str(args.warmup),
                            "--timeout", str(args.timeout), "--profile-method", method, "--optimizer", args.optimizer,
                            "--profile-micro", str(args.profile_micro)] + (["--fresh"] if args.fresh else []),
                     timeout=args.job_timeout)
            for rank in (0, 1):
                info = json.loads((out / f"r{rank}.json").read_text())
                plain[(name, rank)] = info
                tables[(name, rank)] = function_table(out / f"r{rank}.prof", info["batches"])
    pairs = list(zip(names[1::2], names[0::2])) if args.profile_against else [(names[0], n) for n in names[1:]]
    report: Dict[str, Any] = {"folder": str(folder), "cpu": {}, "differences": {}}
    for name in names:
        for rank in (0, 1):
            report["cpu"][f"{name} r{rank}"] = plain[(name, rank)]
    for base, other in pairs:
        for rank in (0, 1):
            for key in ("tottime_ms", "cumtime_ms", "calls"):
                report["differences"][f"{other} - {base}, rank {rank}, {key}"] = differences(
                    tables[(base, rank)], tables[(other, rank)], key, args.top)
    return report


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
    parser.add_argument("--profile-against", default=None,
                        help="profile this method too on each commit and compare --profile-method against it "
                             "(then one commit is enough)")
    parser.add_argument("--optimizer", default="momentum",
                        help="the optimizer of the bench and the profile (default: %(default)s; pipeoptim bench's "
                             "own default is adamw)")
    parser.add_argument("--fresh", action="store_true",
                        help="profile a new Pipeline's first fit, its setup included (as pipeoptim bench times a run)")
    parser.add_argument("--top", type=int, default=20, help="functions listed per comparison (default: 20)")
    args = parser.parse_args(argv)
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
    if len(commits) < (1 if args.profile and args.profile_against else 2):
        parser.error("--commits needs two commits or more (one with --profile --profile-against)")
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
