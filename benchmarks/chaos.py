"""Chaos: a Pipeline run under torchrun with checkpoints, killed with SIGKILL several times, each
at a random moment and in a random process, and resumed each time; its losses and final weights
must equal the uninterrupted run's exactly, and the newest checkpoint must always be complete (a
torch distributed checkpoint: its ``.metadata`` and ``.distcp`` files, every one its manifest
lists and none it does not, each with the checksum it records).

    .venv/bin/python -m benchmarks.chaos [--kills 5] [--seed 0] [--batches 80] [--epochs 2] [--layout 2x1]
                                         [--kill-after 1 8]

Runs `tests/torchrun_checkpoint.py` (pipeoptim, Adam + StepLR, dropout, a checkpoint every 5
mini-batches) in ``--layout NxD`` (N stages x D replicas, N x D processes; ``2x2s``: each stage
sharded over its 2 replicas). The uninterrupted run: one process for one replica (which gives the
N-process numbers), else the same layout under torchrun. Writes benchmarks/results/chaos.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Tuple

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


def stages_and_replicas(layout: str) -> Tuple[int, int]:
    """N and D of a layout ``NxD`` (or ``NxDs``, sharded): N stages x D replicas, N x D processes."""
    found = re.fullmatch(r"(\d+)x(\d+)s?", layout)
    if found is None or min(int(found[1]), int(found[2])) < 1:
        raise SystemExit(f"--layout is NxD or NxDs (N stages x D replicas, s: sharded), e.g. 2x2s; got {layout!r}")
    return int(found[1]), int(found[2])


def script_args(run_dir: Path, args, delay: float = 0.0) -> list:
    """tests/torchrun_checkpoint.py's arguments: RUN BATCHES EPOCHS DELAY METHOD STOP_AFTER LAYOUT."""
    return [str(SCRIPT), str(run_dir), str(args.batches), str(args.epochs), str(delay), "pipeoptim", "-", args.layout]


def torchrun_command(count: int) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(count)]


def torchrun(run_dir: Path, args, count: int) -> subprocess.Popen:
    return subprocess.Popen(torchrun_command(count) + script_args(run_dir, args, args.delay),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env())


def wait_for_stages(job: subprocess.Popen, count: int, limit: float = 300.0) -> float:
    """Seconds until the ``count`` worker processes of ``job`` exist (torchrun starts them after
    its own start-up, which a loaded machine stretches far beyond the random wait before a kill)."""
    began = time.monotonic()
    while len(descendants(job.pid)) < count:
        if job.poll() is not None or time.monotonic() - began > limit:
            raise SystemExit(f"torchrun started no stage processes within {limit:g} s (exit {job.poll()})")
        time.sleep(0.1)
    return time.monotonic() - began


def check_newest(store: Path) -> str:
    """The newest checkpoint's name, after checking it is whole: a distributed checkpoint (its
    ``.metadata`` and at least one ``.distcp`` file), the manifest listing every file of the
    folder, each with its SHA-256."""
    name = json.loads((store / "latest.json").read_text())["checkpoint"]
    folder = store / name
    listed = json.loads((folder / "manifest.json").read_text())["files"]
    held = {p.name for p in folder.iterdir() if p.is_file() and p.name != "manifest.json"}
    assert set(listed) == held, f"{name}: the manifest lists {sorted(listed)}, the folder holds {sorted(held)}"
    assert ".metadata" in listed and any(f.endswith(".distcp") for f in listed), \
        f"{name}: no distributed checkpoint ({sorted(listed)})"
    for file, digest in listed.items():
        data = (folder / file).read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest, f"{name}/{file} does not match its manifest"
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batches", type=int, default=80)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--delay", type=float, default=0.2, help="seconds slept per mini-batch (a slower run)")
    parser.add_argument("--layout", default="2x1",
                        help="NxD: N stages x D replicas on N x D processes, 's' appended for each stage "
                             "sharded over its replicas, e.g. 2x2s (default: 2x1)")
    parser.add_argument("--kill-after", type=float, nargs=2, default=[1.0, 8.0], metavar=("LOW", "HIGH"),
                        help="each kill a random number of seconds in [LOW, HIGH] after the workers "
                             "started (their start-up, some seconds, comes first; default: 1 8)")
    args = parser.parse_args()
    stages, replicas = stages_and_replicas(args.layout)
    count = stages * replicas
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="pipeoptim-chaos-"))
    began = time.monotonic()
    # one replica: one process gives the N-process numbers; more: the same layout, uninterrupted
    launcher = [sys.executable] if replicas == 1 else torchrun_command(count)
    whole = subprocess.run(launcher + script_args(root / "whole", args), env=env(), capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr[-2000:]
    reference = json.loads((root / "whole" / "result.json").read_text())
    cut, kills = root / "cut", []
    for k in range(args.kills):
        job = torchrun(cut, args, count)
        started = wait_for_stages(job, count)  # start-up takes 2-4 s on a quiet machine, far more on a loaded one
        wait = rng.uniform(*args.kill_after)  # a whole run takes about 35 s once started
        time.sleep(wait)
        workers = [p for p in descendants(job.pid)]
        if job.poll() is not None or len(workers) < count:
            _, err = job.communicate()
            raise SystemExit(f"kill {k + 1}: the run ended (exit {job.returncode}) before it could be "
                             f"killed; use a larger --delay. Its last output: {err[-1500:]} "
                             f"{sorted(p.name for p in cut.rglob('*'))}")
        victim = rng.choice(sorted(workers)[-count:])  # the worker processes are the newest
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
    final = subprocess.run(torchrun_command(count) + script_args(cut, args), env=env(), capture_output=True, text=True)
    assert final.returncode == 0, final.stderr[-2000:]
    resumed = json.loads((cut / "result.json").read_text())
    same_losses = resumed["losses"] == reference["losses"]
    same_weights = resumed["weights"] == reference["weights"]
    wall = time.monotonic() - began
    report = {"layout": args.layout, "processes": count, "kills": kills, "mini_batches": len(reference["losses"]),
              "losses_equal": same_losses, "weights_equal": same_weights, "wall_seconds": round(wall, 1)}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"layout {args.layout} ({count} processes), after {args.kills} kills and resumes: losses equal "
          f"{same_losses}, weights equal {same_weights} ({len(reference['losses'])} mini-batches, {wall:.0f} s "
          f"in all); written: {RESULTS}")
    if not (same_losses and same_weights):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
