"""Chaos: Pipeline runs under torchrun's elastic agent, killed at random moments in random processes,
that recover by themselves: started once, each ends with the uninterrupted run's numbers.

    .venv/bin/python -m benchmarks.chaos [--kills 3] [--seed 0] [--method pipeoptim] [--batches 40] [--epochs 2]
                                         [--delay 0.1] [--layout 2x1] [--kill-after 0 3] [--no-scale-down]
                                         [--scale-down-method 1f1b-flush]

* **restarts**: `tests/torchrun_checkpoint.py` (``--method``, Adam + StepLR, dropout, a checkpoint every
  5 mini-batches, written in the background, ``resume=True``) in ``--layout NxD`` (N stages x D
  replicas on N x D processes; ``2x2s``: each stage sharded over its 2 replicas) under ``torchrun
  --max-restarts KILLS``, started once. Each kill is a SIGKILL of a random worker, a random number
  of seconds after that start wrote its first checkpoint; the first kill waits instead for the
  next checkpoint being written in the background (its ``.partial-`` folder present). Torchrun's agent
  restarts every worker each time; the run must end with the uninterrupted run's losses and final
  weights exactly (that run: one process for one replica, which gives the N-process numbers, else
  the same layout under torchrun), and the newest checkpoint after each kill must be whole (its
  ``.metadata`` and ``.distcp`` files, every one its manifest lists and none it does not, each with
  its checksum).
* **scale-down**: two elastic agents on this machine play two nodes (``torchrun --nnodes 1:2
  --nproc-per-node 2`` each, one c10d rendezvous), 4 processes: 2 stages x 2 replicas of
  `tests/torchrun_restarts.py`'s run (``--scale-down-method``, default 1f1b-flush). At a random
  moment one agent is killed with its workers, as a node that does not come back; the other's
  workers fail, its agent re-forms the job on its own 2 processes, and the run continues with one
  replica, each mini-batch whole: its losses and weights must equal the uninterrupted run's (one
  process) to 1e-6 relative. An asynchronous method's 2-replica run is not its one-replica run (a
  replica's micro-batch j holds other samples, and a mini-batch's micro-batches meet different
  weight versions): its largest loss and weight differences from the one-replica run must then be
  at most those of the same run uninterrupted on 2 replicas (4 processes), the bound it shows.

Prints a table (kills, restarts, layouts, equal or not, seconds) and the lines the runs printed
from ``pipeoptim:`` (what a user sees on a restart); writes benchmarks/results/chaos.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "torchrun_checkpoint.py"
SHRINK = REPO / "tests" / "torchrun_restarts.py"
RESULTS = REPO / "benchmarks" / "results" / "chaos.json"
RUN = [sys.executable, "-m", "torch.distributed.run"]


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = str(REPO / "src") + os.pathsep + e.get("PYTHONPATH", "")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(key, None)
    if os.path.exists("/sys/class/net/lo"):
        e.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return e


def children() -> Dict[int, List[int]]:
    """Every process's children (from /proc)."""
    kids: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except OSError:
                pass
    return kids


def workers(agent: int) -> List[int]:
    """The live worker processes of torchrun's agent ``agent`` (its children)."""
    return sorted(p for p in children().get(agent, []) if _alive(p))


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def rank_of(pid: int) -> str:
    """The RANK torchrun gave worker ``pid`` (from its environment)."""
    try:
        env_vars = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return "?"
    return next((v[5:].decode() for v in env_vars if v.startswith(b"RANK=")), "?")


def stages_and_replicas(layout: str) -> Tuple[int, int]:
    """N and D of a layout ``NxD`` (or ``NxDs``, sharded): N stages x D replicas, N x D processes."""
    found = re.fullmatch(r"(\d+)x(\d+)s?", layout)
    if found is None or min(int(found[1]), int(found[2])) < 1:
        raise SystemExit(f"--layout is NxD or NxDs (N stages x D replicas, s: sharded), e.g. 2x2s; got {layout!r}")
    return int(found[1]), int(found[2])


def script_args(run_dir: Path, args, delay: float = 0.0) -> list:
    """tests/torchrun_checkpoint.py's arguments: RUN BATCHES EPOCHS DELAY METHOD STOP_AFTER LAYOUT BACKGROUND."""
    return [str(SCRIPT), str(run_dir), str(args.batches), str(args.epochs), str(delay), args.method, "-",
            args.layout, "1"]


def new_workers(agent: int, count: int, old: set, job: subprocess.Popen, log: Path, limit: float = 300.0) -> List[int]:
    """The ``count`` workers of the agent's next start (none of ``old``), once all are up (``log``:
    the agent's stderr, for the message if it ends first)."""
    began = time.monotonic()
    while True:
        now = [p for p in workers(agent) if p not in old]
        if len(now) >= count:
            return now
        if job.poll() is not None or time.monotonic() - began > limit:
            raise SystemExit(f"no start of {count} workers within {limit:g} s (exit {job.poll()}; use a larger "
                             f"--delay if the run ended): {log.read_text()[-2000:]}")
        time.sleep(0.05)


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


def newest_name(store: Path) -> str:
    """What ``latest.json`` names now ("" before the first checkpoint)."""
    try:
        return json.loads((store / "latest.json").read_text())["checkpoint"]
    except (OSError, ValueError):
        return ""


def said(stderr: str) -> List[str]:
    return [line for line in stderr.splitlines() if line.startswith("pipeoptim: ")]


def started_again(stderr: str) -> int:
    """How many times torchrun's agent restarted the workers, as the runs' log says (a stopped
    rank's line, or where a restarted run began)."""
    return max(map(int, re.findall(r"^pipeoptim: .*\brestart (\d+) of at most", stderr, re.M)), default=0)


def agent(command: list, log: Path, **kwargs) -> subprocess.Popen:
    """torchrun's agent running ``command``, its stderr (and the workers') into ``log``: a pipe
    left unread while the run goes on would fill and stop it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(RUN + command, stdout=subprocess.DEVNULL, stderr=open(log, "w"), text=True, env=env(),
                            **kwargs)


def restarts(args, root: Path, rng: random.Random) -> dict:
    """The restarts scenario (module docstring)."""
    stages, replicas = stages_and_replicas(args.layout)
    count = stages * replicas
    began = time.monotonic()
    launcher = [sys.executable] if replicas == 1 else RUN + ["--standalone", "--nproc-per-node", str(count)]
    whole = subprocess.run(launcher + script_args(root / "whole", args), env=env(), capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr[-2000:]
    reference = json.loads((root / "whole" / "result.json").read_text())
    cut, kills, seen, log = root / "cut", [], set(), root / "cut.log"
    job = agent(["--standalone", "--nproc-per-node", str(count), "--max-restarts", str(args.kills)]
                + script_args(cut, args, args.delay), log)
    store = cut / "checkpoints"
    for k in range(args.kills):
        up = new_workers(job.pid, count, seen, job, log)
        seen.update(up)
        before = newest_name(store)
        while newest_name(store) == before:  # this start has made progress: a checkpoint of its own
            if job.poll() is not None:
                raise SystemExit(f"kill {k + 1}: the run ended first; use a larger --delay or --batches")
            time.sleep(0.005)
        if k == 0:  # while the next checkpoint is being written in the background
            while not list(store.glob(".partial-*")):
                if job.poll() is not None:
                    raise SystemExit("the run ended before a checkpoint was written in the background")
                time.sleep(0.005)
            moment = "while " + ", ".join(p.name[9:] for p in store.glob(".partial-*")) + " was being written"
        else:
            wait = rng.uniform(*args.kill_after)
            time.sleep(wait)
            moment = f"{wait:.1f} s after this start's first checkpoint"
        victim = rng.choice(up)
        rank = rank_of(victim)
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            raise SystemExit(f"kill {k + 1}: the worker had ended; use a larger --delay") from None
        newest = check_newest(cut / "checkpoints") if (cut / "checkpoints" / "latest.json").exists() else None
        kills.append({"rank": rank, "moment": moment, "newest_checkpoint_whole": newest})
        print(f"kill {k + 1}: rank {rank} of {count} (pid {victim}), {moment}; newest checkpoint: "
              f"{newest + ' (whole)' if newest else 'none yet'}", flush=True)
    job.wait(timeout=900)
    err = log.read_text()
    assert job.returncode == 0, err[-3000:]
    resumed = json.loads((cut / "result.json").read_text())
    return {"scenario": "restarts", "layouts": f"{args.method} {args.layout} on {count} processes", "kills": len(kills),
            "restarts": started_again(err), "losses_equal": resumed["losses"] == reference["losses"],
            "weights_equal": resumed["weights"] == reference["weights"], "mini_batches": len(reference["losses"]),
            "seconds": round(time.monotonic() - began, 1), "kill_log": kills, "log": said(err)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scale_down(args, root: Path, rng: random.Random) -> dict:
    """The scale-down scenario (module docstring)."""
    from pipeoptim.methods import get_method

    began = time.monotonic()
    entry = f"shrink:{args.scale_down_method}:w:-"  # (w: slow enough to be killed at a random moment)
    alone = subprocess.run([sys.executable, str(SHRINK), str(root / "alone"), entry], env=env(),
                           capture_output=True, text=True)
    assert alone.returncode == 0, alone.stderr[-2000:]
    reference = json.loads((root / "alone" / "shrink" / "result.json").read_text())
    bound = None
    if not get_method(args.scale_down_method).synchronous:  # the bound: 2 replicas throughout
        two = subprocess.run(RUN + ["--standalone", "--nproc-per-node", "4", str(SHRINK), str(root / "two"),
                                    f"shrink:{args.scale_down_method}:-:-"], env=env(), capture_output=True, text=True)
        assert two.returncode == 0, two.stderr[-2000:]
        bound = distances(reference, json.loads((root / "two" / "shrink" / "result.json").read_text()))
    port = free_port()

    def node(host: bool) -> subprocess.Popen:
        return agent(["--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "2", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "chaos", "--rdzv-conf",
                      f"is_host={int(host)},last_call_timeout=5", str(SHRINK), str(root / "elastic"), entry],
                     root / f"node-{int(not host)}.log", start_new_session=True)

    kept = node(True)  # it hosts the rendezvous store; both join its first round (a node that joins a round
    lost = node(False)  # formed without it makes the agents re-form the job, which torch 2.13 gets wrong)
    new_workers(kept.pid, 2, set(), kept, root / "node-0.log")
    gone = new_workers(lost.pid, 2, set(), lost, root / "node-1.log")
    while not (root / "elastic" / "shrink" / "checkpoints" / "latest.json").exists():  # the run under way
        if kept.poll() is not None:
            raise SystemExit(f"the run ended before its first checkpoint: {(root / 'node-0.log').read_text()[-2000:]}")
        time.sleep(0.01)
    wait = rng.uniform(0.2, 1.5)  # its 16 mini-batches take some 5 s
    time.sleep(wait)
    for pid in [lost.pid, *gone]:  # the node, its agent and its workers, gone for good
        os.kill(pid, signal.SIGKILL)
    print(f"scale-down: one of the two agents killed with its 2 workers {wait:.1f} s after the first checkpoint",
          flush=True)
    kept.wait(timeout=900)
    lost.wait()
    err = (root / "node-0.log").read_text()
    assert kept.returncode == 0, err[-3000:]
    shrunk = json.loads((root / "elastic" / "shrink" / "result.json").read_text())
    losses, weights = distances(reference, shrunk)
    layouts = f"{args.scale_down_method} 2x2 on 4 processes -> 2x{shrunk['replicas']} on 2"
    row = {"scenario": "scale-down", "layouts": layouts, "kills": 1, "restarts": 1,
           "mini_batches": len(reference["losses"])}
    if bound is None:
        row.update(losses_equal=losses < 1e-6, weights_equal=weights < 1e-6,
                   largest_relative_difference=max(losses, weights))
    else:  # within the distance of the uninterrupted 2-replica run (float noise allowed)
        row.update(losses_equal=losses <= bound[0] * (1 + 1e-6), weights_equal=weights <= bound[1] * 1.1,
                   within="2-replica run's", relative_differences=[losses, weights], bound=list(bound))
    return {**row, "seconds": round(time.monotonic() - began, 1), "log": said(err)}


def distances(reference: dict, run: dict) -> Tuple[float, float]:
    """``run``'s largest relative differences from ``reference``: of the losses, and of the final
    weights (each tensor's largest, over its own largest magnitude)."""
    import numpy as np

    losses = max(abs(a - b) / abs(a) for a, b in zip(reference["losses"], run["losses"]))
    weights = max(float(np.abs(np.subtract(reference["weights"][k], run["weights"][k])).max()
                        / np.abs(reference["weights"][k]).max()) for k in reference["weights"])
    return losses, weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3, help="kills of the restarts run, and its --max-restarts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--delay", type=float, default=0.1, help="seconds slept per mini-batch (a slower run)")
    parser.add_argument("--method", default="pipeoptim",
                        help="the restarts run's method (interleaved, zb-v, dualpipev: 2 chunks per process; "
                             "bitpipe: 4 pieces)")
    parser.add_argument("--layout", default="2x1",
                        help="NxD: N stages x D replicas on N x D processes, 's' appended for each stage "
                             "sharded over its replicas, e.g. 2x2s (default: 2x1)")
    parser.add_argument("--kill-after", type=float, nargs=2, default=[0.0, 3.0], metavar=("LOW", "HIGH"),
                        help="each kill but the first a random number of seconds in [LOW, HIGH] after the "
                             "start's first checkpoint (default: 0 3)")
    parser.add_argument("--no-scale-down", action="store_true", help="leave out the scale-down run")
    parser.add_argument("--scale-down-method", default="1f1b-flush",
                        help="the scale-down run's method; an asynchronous one is held to the distance its "
                             "uninterrupted 2-replica run keeps from one replica")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="pipeoptim-chaos-"))
    rows = [restarts(args, root / "restarts", rng)]
    if not args.no_scale_down:
        rows.append(scale_down(args, root / "scale-down", rng))
    wide = max(len(r["layouts"]) for r in rows)
    print(f"\n{'scenario':<11} {'layouts':<{wide}} {'kills':>5} {'restarts':>8} {'losses':>7} {'weights':>7} "
          f"{'seconds':>8}")
    for r in rows:
        same, other = ("within", "BEYOND") if "bound" in r else ("equal", "DIFFER")
        print(f"{r['scenario']:<11} {r['layouts']:<{wide}} {r['kills']:>5} {r['restarts']:>8} "
              f"{same if r['losses_equal'] else other:>7} {same if r['weights_equal'] else other:>7} "
              f"{r['seconds']:>8.1f}")
    for r in rows:
        if "bound" in r:
            (losses, weights), (most_losses, most_weights) = r["relative_differences"], r["bound"]
            print(f"{r['scenario']}: largest relative differences from one replica, losses {losses:.3g} and "
                  f"weights {weights:.3g}; uninterrupted on 2 replicas: {most_losses:.3g} and {most_weights:.3g}")
    for r in rows:
        print(f"\n{r['scenario']}: what the run printed from pipeoptim")
        for line in r["log"]:
            print(f"  {line}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=2))
    print(f"\nwritten: {RESULTS}")
    if not all(r["losses_equal"] and r["weights_equal"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
