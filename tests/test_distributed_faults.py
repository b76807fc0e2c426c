"""Faults in a distributed run: a stage killed with SIGKILL, exact resume, refused checkpoints.

Every run here is the real command line (`pipeoptim train --runtime distributed`), two stage
processes on this machine, with the MLP (no dropout, so the losses are deterministic batch for
batch) on made-up images (tests/made_up_images.py: read in milliseconds by each process; what is
tested does not depend on the images). The command runs in this process (``main``, as
tests/test_distributed.py runs it): its stages are processes of their own under its agent, and
a thread kills one of them while the run trains (a SIGKILL cannot be caught: who sent it does not
matter, as it does for tests/test_signals.py's signals).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from made_up_images import use_made_up_images

pytestmark = pytest.mark.timeout(240)

#: the bound within which the surviving processes and the launcher must be gone after a kill
EXIT_BOUND_SECONDS = 60.0

#: 3 epochs of 20 mini-batches (the resumed run crosses two epoch boundaries), a checkpoint every 5:
#: the kill lands well before the end of the run, after the first checkpoint
RUN = ["train", "--runtime", "distributed", "--task", "image", "--model", "mlp", "--stages", "2",
       "--method", "pipeoptim", "--epochs", "3", "--limit", "1280", "--checkpoint-every", "5",
       "--no-progress", "--timeout", "120"]


@pytest.fixture(scope="module", autouse=True)
def made_up_images(tmp_path_factory):
    yield from use_made_up_images(tmp_path_factory)


def _main(*args: str) -> int:
    """``pipeoptim ARGS`` in this process (its output goes to pytest's capture)."""
    from pipeoptim.cli import main

    return main(list(args))


def _losses(run: Path) -> list:
    return json.loads((run / "summary.json").read_text())["losses"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    assert _main(*RUN, "--out", str(run)) == 0
    return run


def _kill_stage_1_after_the_first_checkpoint(run: Path, seconds: float, killed: dict) -> None:
    """In a thread: once ``run``'s first checkpoint is in, SIGKILL stage 1 (what it did: ``killed``)."""
    deadline = time.monotonic() + seconds
    while not (run / "checkpoints" / "latest.json").exists():
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)
    statuses = {k: json.loads((run / "status" / f"stage-{k}.json").read_text()) for k in (0, 1)}
    killed.update(victim=statuses[1]["pid"], survivor=statuses[0]["pid"])
    os.kill(killed["victim"], signal.SIGKILL)
    killed["at"] = time.monotonic()


def test_kill_9_of_one_stage_then_resume_gives_the_uninterrupted_losses(uninterrupted, tmp_path, capfd):
    run, killed = tmp_path / "run", {}
    killer = threading.Thread(target=_kill_stage_1_after_the_first_checkpoint, args=(run, 120, killed), daemon=True)
    killer.start()
    code = _main(*RUN, "--out", str(run))
    took = time.monotonic() - killed.get("at", float("nan"))
    killer.join(10)
    stderr = capfd.readouterr().err
    assert "at" in killed, f"the run ended (exit status {code}) before stage 1 was killed: {stderr[-3000:]}"
    victim, survivor = killed["victim"], killed["survivor"]
    assert code == 1, stderr[-3000:]
    assert took < EXIT_BOUND_SECONDS
    assert not _alive(survivor)
    last = json.loads((run / "checkpoints" / "latest.json").read_text())["checkpoint"]
    message = [line for line in stderr.splitlines() if line.startswith("pipeoptim train: error: stage 1")]
    assert message, stderr[-3000:]
    assert f"stage 1 (rank 1, pid {victim}) was lost: killed by SIGKILL" in message[-1]
    assert f"Last checkpoint: {run / 'checkpoints' / last}" in message[-1]
    assert f"--resume {run}" in message[-1]
    assert not (run / "summary.json").exists()

    assert _main("train", "--runtime", "distributed", "--resume", str(run), "--no-progress") == 0, \
        capfd.readouterr().err[-3000:]
    expected = _losses(uninterrupted)
    assert len(expected) == 60
    assert _losses(run) == expected  # every mini-batch, to the last bit


#: a damaged file of stage 1's process in every checkpoint of the run: a flipped byte (a truncated file
#: fails the same checksum comparison, both held in one process by tests/test_checkpoint.py; a damaged
#: newest checkpoint alone is passed over for the one before, tests/test_resume.py). Rank 0 checks the
#: manifest and every file before any rank loads, and a refusal reaches every rank as rank 0's, so a
#: manifest that does not fit the run (held in one process by tests/test_resume.py and
#: tests/test_checkpoint.py) takes the same way to the command line as this one.
def test_resume_refuses_a_damaged_checkpoint(uninterrupted, tmp_path, capfd):
    damage, why = "flip", "checksum mismatch"
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    store = run / "checkpoints"
    folder = store / json.loads((store / "latest.json").read_text())["checkpoint"]
    stage_file = folder / "__1_0.distcp"
    for each in (p for p in store.iterdir() if p.is_dir()):
        data = bytearray((each / "__1_0.distcp").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (each / "__1_0.distcp").write_bytes(bytes(data))
    code = _main("train", "--runtime", "distributed", "--resume", str(run), "--no-progress")
    stderr = capfd.readouterr().err
    assert code == 2, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if "error:" in line and str(stage_file) in line]
    assert errors and why in errors[-1] and "no whole checkpoint is left to resume from" in errors[-1], stderr[-3000:]
    assert "Traceback" not in stderr


def test_a_nan_loss_stops_every_stage_and_keeps_the_last_good_checkpoint(tmp_path, capfd):
    run = tmp_path / "run"
    code = _main("train", "--runtime", "distributed", "--task", "image", "--model", "mlp", "--method", "pipeoptim",
                 "--stages", "2", "--epochs", "1", "--limit", "1280", "--checkpoint-every", "3",
                 "--optimizer", "momentum", "--lr-schedule", "constant", "--lr", "7",  # nan at mini-batch 5
                 "--no-progress", "--out", str(run))
    stderr = capfd.readouterr().err
    assert code == 1, stderr[-3000:]
    last = run / "checkpoints" / json.loads((run / "checkpoints" / "latest.json").read_text())["checkpoint"]
    line = stderr.splitlines()[-1]
    assert line.startswith("pipeoptim train: error: loss became nan at mini-batch 5 of epoch 0 (every stage stopped)")
    assert f"Last good checkpoint: {last}" in line
    manifest = json.loads((last / "manifest.json").read_text())
    assert manifest["batch"] == 3 and len(manifest["losses"]) == 3
    assert all(loss == loss and abs(loss) < float("inf") for loss in manifest["losses"])
