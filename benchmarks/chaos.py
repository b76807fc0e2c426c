"""Chaos: a Pipeline run under torchrun with checkpoints, killed with SIGKILL several times, each
at a random moment and on a random stage, and resumed each time; its losses and final weights must
equal the uninterrupted run's exactly, and the newest checkpoint must always be complete (every
file its manifest lists, with the checksum it records).

    .venv/bin/python -m benchmarks.chaos [--kills 5] [--seed 0] [--batches 60] [--epochs 2]

Runs `tests/torchrun_checkpoint.py` (pipeoptim, 2 stages, Adam + StepLR, dropout, a checkpoint
every 5 mini-batches). Writes benchmarks/results/chaos.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "torchrun_checkpoint.py"
RESULTS = REPO / "benchmarks" / "results" / "chaos.json"


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = str(REPO / "src") + os.pathsep + e.get("PYTHONPATH", "")
    return e


def descendants(pid: int) -> list:
    """Every process below ``pid`` (from /proc)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        frontier += kids
    return found


def torchrun(run_dir: Path, args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(SCRIPT), str(run_dir), str(args.batches), str(args.epochs), str(args.delay)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env())


def wait_for_stages(job: subprocess.Popen, limit: float = 300.0) -> float:
    """Seconds until both stage processes of ``job`` exist (torchrun starts them after its own
    start-up, which a loaded machine stretches far beyond the random wait before a kill)."""
    began = time.monotonic()
    while len(descendants(job.pid)) < 2:
        if job.poll() is not None or time.monotonic() - began > limit:
            raise SystemExit(f"torchrun started no stage processes within {limit:g} s (exit {job.poll()})")
        time.sleep(0.1)
    return time.monotonic() - began


def check_newest(store: Path) -> str:
    """The newest checkpoint's name, after checking it is whole."""
    name = json.loads((store / "latest.json").read_text())["checkpoint"]
    manifest = json.loads((store / name / "manifest.json").read_text())
    for file, digest in manifest["files"].items():
        data = (store / name / file).read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest, f"{name}/{file} does not match its manifest"
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batches", type=int, default=80)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--delay", type=float, default=0.2, help="seconds slept per mini-batch (a slower run)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="pipeoptim-chaos-"))
    whole = subprocess.run([sys.executable, str(SCRIPT), str(root / "whole"), str(args.batches), str(args.epochs)],
                           env=env(), capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr[-2000:]
    reference = json.loads((root / "whole" / "result.json").read_text())
    cut, kills = root / "cut", []
    for k in range(args.kills):
        job = torchrun(cut, args)
        started = wait_for_stages(job)  # start-up takes 2-4 s on a quiet machine, far more on a loaded one
        wait = rng.uniform(1.0, 8.0)  # a whole run takes about 35 s once started
        time.sleep(wait)
        workers = [p for p in descendants(job.pid)]
        if job.poll() is not None or len(workers) < 2:
            _, err = job.communicate()
            raise SystemExit(f"kill {k + 1}: the run ended (exit {job.returncode}) before it could be "
                             f"killed; use a larger --delay. Its last output: {err[-1500:]} "
                             f"{sorted(p.name for p in cut.rglob('*'))}")
        victim = rng.choice(sorted(workers)[-2:])  # the two stage processes are the newest
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        job.communicate(timeout=120)
        gone = time.monotonic() - killed_at
        left = [p for p in descendants(job.pid) if os.path.exists(f"/proc/{p}")]
        newest = check_newest(cut / "checkpoints") if (cut / "checkpoints" / "latest.json").exists() else None
        kills.append({"after_s": round(wait, 2), "start_up_s": round(started, 2), "victim": victim, "exit": job.returncode,
                      "seconds_until_job_ended": round(gone, 2), "processes_left": len(left),
                      "newest_checkpoint": newest})
        print(f"kill {k + 1}: {wait:.1f} s after the stages started ({started:.1f} s), pid {victim}; job ended {gone:.1f} s later (exit "
              f"{job.returncode}, {len(left)} processes left); newest checkpoint: "
              f"{newest + ' (whole)' if newest else 'none yet'}", flush=True)
    final = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            str(SCRIPT), str(cut), str(args.batches), str(args.epochs)],
                           env=env(), capture_output=True, text=True)
    assert final.returncode == 0, final.stderr[-2000:]
    resumed = json.loads((cut / "result.json").read_text())
    same_losses = resumed["losses"] == reference["losses"]
    same_weights = resumed["weights"] == reference["weights"]
    report = {"kills": kills, "mini_batches": len(reference["losses"]), "losses_equal": same_losses,
              "weights_equal": same_weights}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"after {args.kills} kills and resumes: losses equal {same_losses}, weights equal {same_weights} "
          f"({len(reference['losses'])} mini-batches); written: {RESULTS}")
    if not (same_losses and same_weights):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
