"""Recovery without a person (tests/torchrun_restarts.py): under ``torchrun --max-restarts 2`` a worker
SIGKILLed mid-epoch is restarted by torchrun's agent, with every other worker, and each run started
with ``resume=True`` ends with the uninterrupted run's losses and weights exactly (a synchronous
method replicated, an asynchronous one sharded whose kill lands while a checkpoint is being written
in the background); a job started again on fewer processes continues with fewer replicas, to the
uninterrupted run's numbers within floating-point tolerance; the log says where each start began.

The jobs started again on 2 processes, the script's and the command line's, are one job
(tests/torchrun_jobs.py: a start of 2 processes importing torch, not two)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from made_up_images import use_made_up_images
from test_torchrun import HERE, REPO, _env, children
from torchrun_jobs import launch, run_here

SCRIPT = HERE / "torchrun_restarts.py"
#: one 4-process job (2 stages x 2 replicas): each run uninterrupted, then killed. Start 0: rank 3
#: kills itself after 11 losses (epoch 1, past the checkpoint at mini-batch 10); start 1: rank 0
#: after 5 (its checkpoint at 4 still being written in the background); start 2, the last: pipeoptim
#: uninterrupted (no dropout), its first epoch alone ("async-shrink", continued on 2 processes), and
#: the "shrink" run, after 11, which ends the job (no restart left) and is started again on 2 processes
ENTRIES = ["sync-whole:1f1b-flush:d:-", "sync-cut:1f1b-flush:d:0/3/11", "async-whole:pipeoptim:sbd:-",
           "async-cut:pipeoptim:sbd:1/0/5", "async-two:pipeoptim:-:-", "async-shrink:pipeoptim:h:-",
           "shrink:1f1b-flush:-:2/3/11"]
#: the runs the 2-process job continues with one replica
SHRUNK = ["shrink:1f1b-flush:-:-", "async-shrink:pipeoptim:-:-"]


#: `pipeoptim train` on made-up images: 3 epochs of 20 mini-batches, a checkpoint every 5
CLI = ["train", "--task", "image", "--model", "mlp", "--stages", "2", "--method", "1f1b-flush", "--epochs", "3",
       "--limit", "1280", "--checkpoint-every", "5", "--no-progress", "--json"]
#: the seconds the module's jobs may take together (a loaded 2-core machine runs them for minutes)
JOBS_TIMEOUT = 900


@pytest.fixture(scope="module")
def made_up_images(tmp_path_factory):
    yield from use_made_up_images(tmp_path_factory)


def torchrun(nproc: int, *args, timeout: float = 400) -> subprocess.CompletedProcess:
    """``torchrun --max-restarts 2 --nproc-per-node NPROC SCRIPT ARGS`` (killed, workers too, after ``timeout`` s)."""
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts", "2",
                            "--nproc-per-node", str(nproc), str(SCRIPT), *map(str, args)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO, start_new_session=True)
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, err = job.communicate()
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)


def command_line(run: Path, log: Path, kills: int) -> tuple:
    """The command line's one command for every start (``--resume --out RUN``, ``--stages 2`` and no
    ``--data-parallel``) under ``torchrun --max-restarts 1`` on 4 processes, its stderr appended to
    LOG; a stage SIGKILLed after each of the first KILLS new checkpoints. Its exit status, and how
    many kills it took (fewer where it ended first)."""
    latest, killed = run / "checkpoints" / "latest.json", 0
    with open(log, "a") as err:
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts",
                                "1", "--nproc-per-node", "4", "-m", "pipeoptim", *CLI, "--runtime",
                                "distributed", "--out", str(run), "--resume"], stdout=subprocess.DEVNULL, stderr=err,
                               text=True, env=_env(), cwd=REPO, start_new_session=True)
        try:
            seen = None
            while killed < kills and job.poll() is None:
                if latest.exists() and latest.read_text() != seen:
                    seen = latest.read_text()
                    os.kill(max(children(job.pid)), signal.SIGKILL)
                    killed += 1
                time.sleep(0.01)
            job.wait(timeout=300)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    return job.returncode, killed


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, made_up_images):
    """The script's job on 4 processes (``first``); the command line's on 4 processes, killed twice
    (``cli_code``, ``cli_kills``, its stderr in ``cli_log``, its run in ``cli_run``); then the one
    job on 2 processes (``second``, tests/torchrun_jobs.py) that goes on with the interrupted runs
    of both: the script's shrink runs, then the command line's (last: its worker ends the job's
    process group)."""
    folder, cli = tmp_path_factory.mktemp("restarts"), tmp_path_factory.mktemp("command-line")
    run, log = cli / "run", cli / "torchrun.log"
    first = torchrun(4, folder, *ENTRIES)
    cli_code, cli_kills = command_line(run, log, kills=2)
    second = launch({"shrunk": [SCRIPT, folder, *SHRUNK],  # the same runs, on 2 processes
                     "cli": ["-m", "pipeoptim", *CLI, "--runtime", "distributed", "--out", run, "--resume"]},
                    nproc=2, timeout=400)
    return SimpleNamespace(folder=folder, first=first, second=second, cli_run=run, cli_code=cli_code,
                           cli_kills=cli_kills, cli_log=log)


def result(folder: Path, name: str) -> dict:
    return json.loads((folder / name / "result.json").read_text())


def said(err: str) -> list:
    return [line for line in err.splitlines() if line.startswith("pipeoptim: ")]


@pytest.mark.timeout(JOBS_TIMEOUT)
def test_torchrun_restarts_a_killed_job_to_the_uninterrupted_losses_and_weights(jobs):
    folder, first = jobs.folder, jobs.first
    for whole, cut in (("sync-whole", "sync-cut"), ("async-whole", "async-cut")):
        assert (folder / cut / "result.json").exists(), first.stderr[-4000:]
        a, b = result(folder, whole), result(folder, cut)
        assert len(a["losses"]) == 16 and a["replicas"] == 2
        assert b["losses"] == a["losses"], cut
        assert b["weights"] == a["weights"], cut
    lines = said(first.stderr)
    store = lambda name: folder / name / "checkpoints"  # noqa: E731
    assert f"pipeoptim: no checkpoint in {store('sync-cut')} yet: training from the beginning" in lines
    # start 1: the killed run resumes mid-epoch; the finished one resumes at its end
    assert f"pipeoptim: torchrun restart 1 of at most 2: resumed from {store('sync-cut') / 'epoch0001-batch000002'} " \
           f"(epoch 1, mini-batch 2) (2 stages x 2 replicas on 4 processes)" in lines
    assert f"pipeoptim: torchrun restart 1 of at most 2: resumed from {store('sync-whole') / 'epoch0002-batch000000'} " \
           f"(epoch 2, mini-batch 0) (2 stages x 2 replicas on 4 processes)" in lines
    # start 2: the checkpoint at mini-batch 4, being written when rank 0 died, was never named
    assert f"pipeoptim: torchrun restart 2 of at most 2: resumed from {store('async-cut') / 'epoch0000-batch000002'} " \
           f"(epoch 0, mini-batch 2) (2 stages x 2 replicas (sharded) on 4 processes)" in lines
    # a rank the agent stops while restarts are left says so (start 0's or start 1's: which ranks the
    # agent stops, and which end first by their own error as the killed rank's connections close, is a
    # race, on a loaded machine too)
    stopped = [line for line in lines if "stopped by SIGTERM (launcher)" in line]
    assert any(re.search(r"torchrun restarts the job \(restart [12] of at most 2\), and fit\(\.\.\., "
                         r"resume=True\) continues it from the last checkpoint$", line) for line in stopped), stopped
    # every start joined over torchrun's store, which holds the earlier starts' keys (a peer of the killed
    # rank may still end with its own error before the agent stops it: not checked)
    assert "connectFullMesh failed" not in first.stderr and "fresh_join" not in first.stderr


@pytest.mark.timeout(JOBS_TIMEOUT)
def test_a_job_started_again_on_fewer_processes_continues_with_fewer_replicas(jobs, tmp_path):
    """The shrink run's last start (4 processes: 2 stages x 2 replicas) dies with no restart left;
    the job started again on 2 processes continues it with one replica, each mini-batch whole, the
    checkpoint resharded on load: 1f1b-flush's numbers stay those of the uninterrupted run."""
    folder, first, second = jobs.folder, jobs.first, jobs.second
    assert first.returncode != 0
    assert second.returncode == 0, second.stderr[-4000:]
    second.lines("shrunk")  # (fails unless the script ended on every rank)
    run_here(SCRIPT, tmp_path, "shrink:1f1b-flush:-:-")  # uninterrupted, in one process
    whole, shrunk = result(tmp_path, "shrink"), result(folder, "shrink")
    assert shrunk["replicas"] == 1 and len(shrunk["losses"]) == 16
    assert max(abs(x - y) / abs(x) for x, y in zip(whole["losses"], shrunk["losses"])) < 1e-6
    for name, value in whole["weights"].items():
        assert np.abs(np.subtract(value, shrunk["weights"][name])).max() <= 1e-6 * np.abs(value).max(), name
    assert [line for line in said(second.stderr) if str(jobs.cli_run) not in line] == [  # (the command line's: last)
        f"pipeoptim: resumed from {folder / name / 'checkpoints' / at} (epoch 1, mini-batch {int(at[-6:])}); written "
        f"by 2 stages x 2 replicas on 4 processes, now 2 stages on 2 processes"
        for name, at in (("shrink", "epoch0001-batch000002"), ("async-shrink", "epoch0001-batch000000"))]


@pytest.mark.timeout(JOBS_TIMEOUT)
def test_an_asynchronous_run_continued_with_fewer_replicas_stays_as_close_as_its_replicas_run(jobs, tmp_path):
    """pipeoptim on 2 replicas is not one replica's run (a replica's micro-batch j holds other samples
    than one replica's micro-batch j, and a mini-batch's micro-batches meet different weight versions); a
    run whose first epoch had 2 replicas and its second one stays within that distance of the one-replica
    run: its largest loss difference over the second epoch, and its final weights', at most those of the
    run with 2 replicas throughout (measured: 3.5e-3 against 4.2e-3; weights 1.59e-2 against 1.59e-2)."""
    folder, second = jobs.folder, jobs.second
    assert second.returncode == 0, second.stderr[-4000:]
    second.lines("shrunk")
    run_here(SCRIPT, tmp_path, "async-one:pipeoptim:-:-")
    one, two, shrunk = result(tmp_path, "async-one"), result(folder, "async-two"), result(folder, "async-shrink")
    assert (one["replicas"], two["replicas"], shrunk["replicas"]) == (1, 2, 1)
    assert shrunk["losses"][:8] == two["losses"][:8] and len(shrunk["losses"]) == 16

    def apart(run, start=0):
        return max(abs(x - y) for x, y in zip(run["losses"][start:], one["losses"][start:]))

    assert 0 < apart(shrunk, 8) <= apart(two, 8) and apart(shrunk) <= apart(two)

    def weights(run):
        return max(float(np.abs(np.subtract(run["weights"][k], one["weights"][k])).max()) for k in one["weights"])

    assert weights(shrunk) <= 1.1 * weights(two)


def test_each_join_gets_a_number_of_its_own_though_the_store_holds_an_earlier_starts_keys():
    """runtime/lifecycle.fresh_join over one store, as torchrun's agent keeps it across starts: an
    announcement left by an earlier start (read before the new one replaces it) leads nobody astray,
    and every join of 3 ranks agrees on a number no earlier join had."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist
    from pipeoptim.runtime.lifecycle import fresh_join

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    store.set("pipeoptim/join/hello/2", "a-rank-of-an-earlier-start")  # its answer would never come
    numbers = []
    for _ in range(2):
        got = {}
        threads = [threading.Thread(target=lambda r=r: got.__setitem__(r, fresh_join(store, r, 3, 30)))
                   for r in (2, 1, 0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(got) == [0, 1, 2] and len(set(got.values())) == 1, got
        numbers.append(got[0])
    assert numbers[1] > numbers[0] >= 1


@pytest.mark.timeout(JOBS_TIMEOUT)
def test_pipeoptim_train_under_torchrun_restarts_continues_by_itself_and_on_fewer_processes(jobs, made_up_images,
                                                                                            tmp_path):
    """The command line's one command for the first start and every restart (``--resume --out RUN``,
    ``--stages 2`` and no ``--data-parallel``) under ``torchrun --max-restarts 1`` on 4 processes (2
    stages x 2 replicas): a stage killed after the first checkpoint, the job continues from the newest
    one by itself; killed again after a later one, with no restart left, the job ends, and the same
    command on 2 processes (in the module's 2-process job, after the script's runs) continues it with
    one replica. Losses: those of the same run in one process (to 1e-5: the stage processes sum in
    other orders)."""
    from pipeoptim.cli import main

    run, second = jobs.cli_run, jobs.second
    assert jobs.cli_kills == 2, jobs.cli_log.read_text()[-4000:]  # the job was still running at each kill
    assert jobs.cli_code != 0, jobs.cli_log.read_text()[-4000:]  # the second kill ends it: no restart left
    stderr = jobs.cli_log.read_text() + second.stderr
    assert second.returncode == 0, stderr[-4000:]
    out = "\n".join(second.lines("cli"))
    lines = [line for line in said(stderr) if str(jobs.folder) not in line]  # (the script's: above)
    assert lines[0] == f"pipeoptim: no checkpoint in {run / 'checkpoints'} yet: training from the beginning"
    assert any(line.startswith(f"pipeoptim: torchrun restart 1 of at most 1: resumed from {run}")
               and line.endswith("(2 stages x 2 replicas on 4 processes)") for line in lines), lines
    assert lines[-1].startswith(f"pipeoptim: resumed from {run}") and lines[-1].endswith(
        "; written by 2 stages x 2 replicas on 4 processes, now 2 stages on 2 processes"), lines
    assert main([*CLI, "--out", str(tmp_path / "alone")]) == 0
    alone = json.loads((tmp_path / "alone" / "summary.json").read_text())["losses"]
    shrunk = json.loads(out)["losses"]
    assert len(shrunk) == len(alone) == 60
    assert np.allclose(shrunk, alone, rtol=1e-5, atol=1e-6)  # (the made-up images are learned: losses reach 0)
