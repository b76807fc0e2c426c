"""Exit stress: run a finished torchrun job many times under a CPU hog and count the runs that
end badly (a non-zero exit, a C++ ``terminate called ...`` line, SIGABRT) although their work
was done.

    .venv/bin/python -m benchmarks.exit_stress [--runs 200] [--job example|pipeline|both]
                                               [--hog 2] [--cores DIR] [--label before]

Jobs (2 processes each, ``torchrun --standalone --nproc-per-node 2``):

* ``example``: ``examples/fashion_mnist_pipeline.py --limit 384 --epochs 2 --stages 2`` (the
  README's script: DataLoader, AdamW, warm-up + cosine, clipping, bf16, evaluation);
* ``pipeline``: ``benchmarks/exit_stress_job.py``, the smallest Pipeline run that ends with a
  pipelined evaluation (a two-layer model on random data, one epoch of four mini-batches).

``--hog K`` keeps K busy-looping processes running for the whole stress (the default: one per
core), so that the stages are descheduled at random moments, as in a loaded CI run. With
``--cores DIR`` each run works in a directory of its own below DIR with core dumps enabled
(``ulimit -c unlimited``; the kernel's ``core`` pattern writes them there), so that an abort can
be read with gdb afterwards; Python's faulthandler prints every thread's stack on SIGABRT in
either case.

One JSON line per run is appended to ``benchmarks/results/exit_stress.jsonl`` (label, job, run,
exit code, seconds, whether it aborted, the first suspicious line); a rerun with the same label
skips the runs already there. The last line printed is the count per job.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "exit_stress.jsonl"
JOBS = {
    "example": [str(REPO / "examples" / "fashion_mnist_pipeline.py"), "--limit", "384", "--epochs", "2",
                "--stages", "2"],
    "pipeline": [str(REPO / "benchmarks" / "exit_stress_job.py")],
}
#: text that marks a run that ended badly although torchrun may not say why
SUSPICIOUS = ("terminate called", "Fatal Python error", "Aborted", "SIGABRT", "Signal 6", "core dumped",
              "exitcode  : -6", "Segmentation fault")


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    e["PYTHONPATH"] = str(REPO / "src") + os.pathsep + e.get("PYTHONPATH", "")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(key, None)
    if os.path.exists("/sys/class/net/lo"):
        e.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return e


def start_hog(count: int) -> list:
    """``count`` processes that spin until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def enable_cores() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def run_once(job: str, workdir: Path, cores: bool, timeout: float) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *JOBS[job]]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env(), cwd=workdir, timeout=timeout,
                              preexec_fn=enable_cores if cores else None)
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        code, text = "timeout", str(expired.stderr or "")
    seconds = time.perf_counter() - start
    hits = [line for line in text.splitlines() if any(s in line for s in SUSPICIOUS)]
    return {"exit": code, "seconds": round(seconds, 2), "aborted": code != 0 or bool(hits),
            "line": hits[0][:300] if hits else None,
            "tail": text[-3000:] if (code != 0 or hits) else None}


def done_runs(label: str) -> set:
    if not RESULTS.exists():
        return set()
    rows = (json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip())
    return {(r["job"], r["run"]) for r in rows if r["label"] == label}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200, help="runs per job (default 200)")
    parser.add_argument("--job", choices=["example", "pipeline", "both"], default="both",
                        help="which job to run (default both, alternating)")
    parser.add_argument("--hog", type=int, default=os.cpu_count() or 2,
                        help="busy-looping processes beside the runs (default: one per core)")
    parser.add_argument("--cores", type=Path, default=None,
                        help="run each job in DIR/<job>-<run> with core dumps enabled")
    parser.add_argument("--label", default="run", help="the name of this stress in the results file")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take")
    parser.add_argument("--json", action="store_true", help="print the counts as one JSON line")
    args = parser.parse_args()
    jobs = ["example", "pipeline"] if args.job == "both" else [args.job]
    skip = done_runs(args.label)
    todo = [(job, i) for i in range(args.runs) for job in jobs if (job, i) not in skip]
    # a SIGTERM ends the stress through the finally below, so that the hog does not outlive it
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    hog = start_hog(args.hog)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(RESULTS, "a") as out:
            for job, i in tqdm(todo, desc=f"exit stress ({args.label})", unit="run",
                               disable=None if sys.stderr.isatty() else True):
                workdir = (args.cores / f"{job}-{i}") if args.cores else REPO
                row = {"label": args.label, "job": job, "run": i, "hog": args.hog,
                       **run_once(job, workdir, args.cores is not None, args.timeout)}
                out.write(json.dumps(row) + "\n")
                out.flush()
                if row["aborted"]:
                    tqdm.write(f"{job} run {i}: exit {row['exit']}: {row['line']}")
    finally:
        for p in hog:
            p.kill()
            p.wait()
    rows = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]
    counts = {}
    for job in jobs:
        mine = [r for r in rows if r["label"] == args.label and r["job"] == job]
        counts[job] = {"runs": len(mine), "aborted": sum(r["aborted"] for r in mine)}
    if args.json:
        print(json.dumps({"label": args.label, "counts": counts}))
    else:
        for job, c in counts.items():
            print(f"{args.label}: {job}: {c['aborted']} of {c['runs']} runs ended badly")


if __name__ == "__main__":
    main()
