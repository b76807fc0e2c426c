"""Signals end a run, every process of it, cleanly (issue 13, item 4).

Real processes, as a user meets them: `pipeoptim train --runtime distributed` (two stage
processes under torchrun's agent, in the launcher's process), the same under a user's
`torchrun`, `pipeoptim bench`, the local runtime, and a bare process guarded by
:mod:`pipeoptim.runtime.lifecycle`. For each signal:
every process of the run (the launcher and every descendant it had when the signal was sent) is
gone within ``BOUND`` seconds, checked by pid; the output holds no traceback and one line naming
the signal, the last checkpoint and the command that resumes; the exit status is 128 + the signal
(130 for SIGINT, 143 for SIGTERM). The resume from the checkpoint such a line names, to the
uninterrupted run's losses to the last bit, is tests/test_distributed_faults.py's (after a kill -9
of a stage: the same checkpoint, the same `--resume`).

Each run waits for its first checkpoint before the signal, so that there is one to name. The
runs train on made-up images (tests/made_up_images.py): the data set is only the work the run is
interrupted in, and each process reads it in milliseconds.

One case per path a signal takes (SIGINT, SIGTERM and SIGHUP take the same one everywhere: the
stages' watcher thread waits for all three, the launcher's and bench's agent forwards whichever
came, the local runtime's handler raises the same Interrupted): the launcher's agent forwarding a
signal to the stages (SIGINT, for pipeoptim train; SIGTERM, for pipeoptim bench, whose line is its
own), a stage signalled by someone else (SIGTERM, of stage 1: the signal the agent also stops the
other stage with, told apart by its sender), the launcher killed outright (its stages end by
themselves; pipeoptim bench's workers are the same stage_worker processes with the same guard), a
user's torchrun forwarding SIGTERM, the local runtime (SIGTERM: without its handler SIGTERM would
end the process with no word at all, where SIGINT would still raise KeyboardInterrupt).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import List, Optional

import pytest

from made_up_images import use_made_up_images

pytestmark = pytest.mark.timeout(150)

#: seconds within which every process of a run must be gone after a signal (the issue's bound)
BOUND = 5.0
REPO = Path(__file__).resolve().parents[1]
RUN = ["--task", "image", "--model", "mlp", "--stages", "2", "--method", "pipeoptim", "--epochs", "3",
       "--limit", "4096", "--checkpoint-every", "5", "--no-progress"]
DISTRIBUTED = ["train", "--runtime", "distributed", *RUN, "--timeout", "120"]


@pytest.fixture(scope="module", autouse=True)
def made_up_images(tmp_path_factory):
    """Every run of this module reads made-up images (the processes inherit the variable)."""
    yield from use_made_up_images(tmp_path_factory)


def _env() -> dict:
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PIPEOPTIM_LAUNCHER_PID", "PIPEOPTIM_DEBUG"):
        env.pop(name, None)
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _cli(*args: str) -> list:
    return [sys.executable, "-m", "pipeoptim", *args]


def _start(args: list, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _stat(pid: int) -> Optional[List[str]]:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Is the process there (a zombie, dead but not yet reaped, is gone for our purposes)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _descendants(pid: int) -> List[int]:
    """Every process below ``pid`` now, from /proc (children, their children, ...)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None:
                parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return sorted(found)


def _threads(pid: int) -> int:
    try:
        return int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                        if line.startswith("Threads:")))
    except (OSError, StopIteration, ValueError):
        return 0


def _wait_for(condition, process: subprocess.Popen, seconds: float, what: str, every: float = 0.01) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, f"the run ended before {what}: {process.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds} s"
        time.sleep(every)


def _gone_within(pids: List[int], process: Optional[subprocess.Popen], seconds: float) -> float:
    """Seconds until every pid is gone (and ``process`` has exited); fails past ``seconds``."""
    start = time.monotonic()
    while any(_alive(p) for p in pids) or (process is not None and process.poll() is None):
        if time.monotonic() - start > seconds:
            left = [p for p in pids if _alive(p)]
            if process is not None and process.poll() is None:
                process.kill()
            for p in left:
                os.kill(p, signal.SIGKILL)
            pytest.fail(f"processes {left} still there {seconds} s after the signal")
        time.sleep(0.01)
    return time.monotonic() - start


def _checkpoint_intact(folder: Path) -> None:
    """The checkpoint's manifest is there and every file matches its checksum."""
    from pipeoptim.checkpoint import read_manifest, sha256

    manifest = read_manifest(folder)
    written = {p.name for p in folder.iterdir() if p.name != "manifest.json"}
    assert ".metadata" in written and set(manifest["files"]) == written
    for name, digest in manifest["files"].items():
        assert sha256((folder / name).read_bytes()) == digest, name


# ---------------------------------------------------------------------------------------------
# pipeoptim train --runtime distributed


@pytest.mark.parametrize("target,sig", [
    ("launcher", signal.SIGINT),
    ("stage 1", signal.SIGTERM),
], ids=["launcher-SIGINT", "stage1-SIGTERM"])
def test_a_signal_ends_every_process_of_the_run_with_one_line(target, sig, tmp_path):
    """The launcher (SIGINT: its agent forwards it to the stages), or stage 1 (SIGTERM, from a
    process other than its launcher: the signal the agent also stops the other stage with; the
    stages' statuses tell the two apart). The launcher is a process of its own: were it this
    test's process, a signal sent from here would come from the stages' parent, and a stage would
    take it for its launcher's stop."""
    run = tmp_path / "run"
    launcher = _start(_cli(*DISTRIBUTED, "--out", str(run)))
    try:
        _wait_for((run / "checkpoints" / "latest.json").exists, launcher, 120, "the first checkpoint")
        processes = [launcher.pid] + _descendants(launcher.pid)
        stages = {k: json.loads((run / "status" / f"stage-{k}.json").read_text())["pid"] for k in (0, 1)}
        assert set(stages.values()) <= set(processes)
        victim = launcher.pid if target == "launcher" else stages[int(target[-1])]
        os.kill(victim, sig)
        took = _gone_within(processes, launcher, BOUND)
        stdout, stderr = launcher.communicate(timeout=10)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    print(f"{target} {sig.name}: every process gone {took:.2f} s after the signal")
    assert launcher.returncode == 128 + sig, stderr[-3000:]
    assert "Traceback" not in stdout + stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr  # one line, and nothing else on stderr (no agent log lines)
    latest = run / "checkpoints" / json.loads((run / "checkpoints" / "latest.json").read_text())["checkpoint"]
    _checkpoint_intact(latest)
    if target == "launcher":
        assert lines[0].startswith(f"pipeoptim train: interrupted by {sig.name}; every stage was stopped. ")
    else:
        k = int(target[-1])
        assert lines[0].startswith(f"pipeoptim train: stage {k} (rank {k}, pid {stages[k]}) got {sig.name}; "
                                   f"every stage was stopped. ")
        status = json.loads((run / "status" / f"stage-{k}.json").read_text())
        assert (status["state"], status["signal"], status["cause"]) == ("interrupted", sig.name, "signal")
    assert lines[0].endswith(f"Last checkpoint: {latest}; continue with: pipeoptim train --runtime distributed "
                             f"--resume {run}")
    assert not (run / "summary.json").exists()


def test_sigkill_of_the_launcher_stops_its_stages_and_keeps_the_last_checkpoint(tmp_path):
    run = tmp_path / "run"
    launcher = _start(_cli(*DISTRIBUTED, "--out", str(run)))
    try:
        _wait_for((run / "checkpoints" / "latest.json").exists, launcher, 120, "the first checkpoint")
        stages = _descendants(launcher.pid)
        assert len(stages) == 2
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        took = _gone_within(stages, None, BOUND)  # nobody forwards anything: they see it themselves
    finally:
        if launcher.poll() is None:
            launcher.kill()
    print(f"launcher SIGKILL: both stages gone {took:.2f} s after the kill")
    for k in (0, 1):
        status = json.loads((run / "status" / f"stage-{k}.json").read_text())
        assert (status["state"], status["cause"]) == ("interrupted", "parent-died"), status
    latest = run / "checkpoints" / json.loads((run / "checkpoints" / "latest.json").read_text())["checkpoint"]
    _checkpoint_intact(latest)


def test_sigterm_of_a_users_torchrun_ends_its_stages_with_one_line_from_rank_0(tmp_path):
    """Under a user's torchrun the agent is torchrun's: it forwards the signal; the stages end
    at once and rank 0 says so (torchrun's own traceback of its SignalException is torchrun's)."""
    run = tmp_path / "run"
    env = dict(_env(), OMP_NUM_THREADS="1")
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                 "-m", "pipeoptim", *DISTRIBUTED, "--out", str(run)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for((run / "checkpoints" / "latest.json").exists, torchrun, 120, "the first checkpoint")
        processes = [torchrun.pid] + _descendants(torchrun.pid)
        assert len(processes) == 3
        os.kill(torchrun.pid, signal.SIGTERM)
        took = _gone_within(processes, torchrun, BOUND)
        _, stderr = torchrun.communicate(timeout=10)
    finally:
        if torchrun.poll() is None:
            torchrun.kill()
    print(f"torchrun SIGTERM: every process gone {took:.2f} s after the signal")
    latest = run / "checkpoints" / json.loads((run / "checkpoints" / "latest.json").read_text())["checkpoint"]
    ours = [line for line in stderr.splitlines() if line.startswith("pipeoptim train:")]
    assert len(ours) == 1, stderr[-3000:]
    assert ours[0].startswith("pipeoptim train: stage 0 (pid ") and "stopped by SIGTERM from its launcher" in ours[0]
    assert ours[0].endswith(f"Last checkpoint: {latest}; continue with: torchrun (the same flags) -m pipeoptim "
                            f"train --runtime distributed --resume {run}")
    assert [line for line in stderr.splitlines() if 'File "' in line and "pipeoptim" in line] == []  # no traceback of ours
    for k in (0, 1):
        status = json.loads((run / "status" / f"stage-{k}.json").read_text())
        assert (status["state"], status["signal"], status["cause"]) == ("interrupted", "SIGTERM", "launcher")
    _checkpoint_intact(latest)


# ---------------------------------------------------------------------------------------------
# pipeoptim bench: its workers used to hang for minutes after the command was killed (SIGKILL:
# its workers are stage_worker processes guarded as a train's stages, whose case is above)


def test_a_killed_bench_takes_its_workers_with_it(tmp_path):
    sig = signal.SIGTERM
    bench = _start(_cli("bench", "--synthetic", "--methods", "gpipe", "--batches", "2000", "--warmup", "1",
                        "--batch-size", "16", "--no-baselines", "--timeout", "120", "--out",
                        str(tmp_path / "bench.json")))
    try:
        # both workers in their process group: beside the main thread, the signal watcher (started
        # first thing) and gloo's threads
        _wait_for(lambda: len(_descendants(bench.pid)) == 2 and all(_threads(p) >= 4 for p in _descendants(bench.pid)),
                  bench, 120, "two workers in their process group", every=0.1)  # (each look reads all of /proc)
        time.sleep(0.5)  # into the timed runs
        workers = _descendants(bench.pid)
        os.kill(bench.pid, sig)
        took = _gone_within(workers + [bench.pid], bench, BOUND)
        _, stderr = bench.communicate(timeout=10)
    finally:
        if bench.poll() is None:
            bench.kill()
    print(f"bench {sig.name}: every process gone {took:.2f} s after the signal")
    assert bench.returncode == 128 + sig
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == f"pipeoptim bench: interrupted by {sig.name}"


# ---------------------------------------------------------------------------------------------
# the local runtime


def test_the_local_runtime_names_the_last_checkpoint(tmp_path):
    sig = signal.SIGTERM
    run = tmp_path / "run"
    process = _start(_cli("train", *RUN, "--device", "cpu", "--out", str(run)))
    try:
        _wait_for((run / "checkpoints" / "latest.json").exists, process, 120, "the first checkpoint")
        os.kill(process.pid, sig)
        took = _gone_within([process.pid], process, BOUND)
        stdout, stderr = process.communicate(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
    print(f"local {sig.name}: gone {took:.2f} s after the signal")
    assert process.returncode == 128 + sig, stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    latest = run / "checkpoints" / json.loads((run / "checkpoints" / "latest.json").read_text())["checkpoint"]
    assert lines == [f"pipeoptim train: interrupted by {sig.name}. Last checkpoint: {latest}; continue with: "
                     f"pipeoptim train --resume {run}"]
    _checkpoint_intact(latest)


# ---------------------------------------------------------------------------------------------
# the guard itself, on a bare process whose main thread never comes back to the interpreter

GUARDED = textwrap.dedent("""
    import json, sys, threading
    from pipeoptim.runtime import lifecycle

    def on_stop(stop):
        with open(sys.argv[1], "w") as f:
            json.dump({"signal": stop.signal_name, "cause": stop.cause, "sender": stop.sender}, f)

    print(lifecycle.guard(on_stop, use_prctl=sys.argv[2] == "prctl"), flush=True)
    threading.Event().wait()  # the main thread blocks for good (as in a wait on a peer)
""")

# starts GUARDED as its child, says the child's pid, and waits to be killed
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], stdout=subprocess.PIPE, text=True)
    print(child.pid, child.stdout.readline().strip(), flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("how", ["prctl", "poll"])
def test_a_guarded_process_ends_when_its_parent_dies(how, tmp_path):
    record = tmp_path / "stop.json"
    parent = _start([sys.executable, "-c", PARENT, GUARDED, str(record), how])
    try:
        pid, watched = parent.stdout.readline().split()
        child = int(pid)
        assert watched == how and _alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        took = _gone_within([child], None, BOUND)
    finally:
        if parent.poll() is None:
            parent.kill()
    print(f"parent death ({how}): child gone {took:.2f} s after")
    assert json.loads(record.read_text())["cause"] == "parent-died"
    if how == "poll":
        assert took < 2.0  # polled every 0.25 s


@pytest.mark.parametrize("sender", ["parent", "other"])
def test_a_guarded_process_ends_at_once_on_sigterm_and_knows_who_sent_it(sender, tmp_path):
    record = tmp_path / "stop.json"
    child = _start([sys.executable, "-c", GUARDED, str(record), "prctl"])
    try:
        assert child.stdout.readline().strip() == "prctl"
        if sender == "parent":
            child.send_signal(signal.SIGTERM)  # from this process, its parent: a launcher forwarding
        else:
            subprocess.run(["kill", "-TERM", str(child.pid)], check=True)  # from a process of its own
        took = _gone_within([child.pid], child, BOUND)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 128 + signal.SIGTERM
    assert took < 2.0
    stop = json.loads(record.read_text())
    assert stop["signal"] == "SIGTERM"
    assert stop["cause"] == ("launcher" if sender == "parent" else "signal")
    if sender == "parent":
        assert stop["sender"] == os.getpid()


# ---------------------------------------------------------------------------------------------
# the launcher's reading of the status files (no processes)


def test_the_report_tells_a_signalled_stage_from_those_stopped_and_forgets_an_earlier_run(tmp_path):
    from pipeoptim.lab.launcher import failure_report, interrupted_stages
    from pipeoptim.lab.run_folder import clear_statuses, write_status

    run = tmp_path / "run"
    write_status(run, 0, state="interrupted", signal="SIGTERM", cause="launcher")  # stopped by the agent
    write_status(run, 1, state="interrupted", signal="SIGINT", cause="signal")    # `kill -INT` of stage 1
    assert [k for k, _ in interrupted_stages({0: (143, ""), 1: (130, "")}, run)] == [1]
    # a stage stopped by the agent (exit 143, says so) is not the one that failed
    write_status(run, 1, state="failed", kind="error", message="RuntimeError: boom")
    assert interrupted_stages({0: (143, ""), 1: (1, "")}, run) == []
    text, lost = failure_report({0: (143, ""), 1: (1, "")}, run)
    assert lost == [1] and "stage 1 (rank 1" in text and "RuntimeError: boom" in text
    # the statuses of an earlier run in the same folder (a resume) are cleared before the launch
    write_status(run, 1, state="interrupted", signal="SIGTERM", cause="signal")
    clear_statuses(run)
    assert interrupted_stages({0: (1, ""), 1: (1, "")}, run) == []
    assert list((run / "status").iterdir()) == []
