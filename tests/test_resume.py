"""Resume: a run interrupted and continued from its last checkpoint gives the uninterrupted
run's losses, batch for batch (local runtime; the distributed case is in test_faults.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeoptim
from pipeoptim.checkpoint import CheckpointError
from conftest import Crash, batches, crash_at

LOSS = nn.functional.cross_entropy
ADAM = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731


def model_with_dropout():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Sequential(nn.Dropout(0.2), nn.Linear(16, 16), nn.Tanh()),
                         nn.Sequential(nn.Dropout(0.2), nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 4)).double()


def run(tmp, method, **kwargs):
    torch.manual_seed(123)
    return pipeoptim.train(model_with_dropout(), batches(8), method=method, stages=3, optimizer=ADAM,
                           loss_fn=LOSS, epochs=2, checkpoint_dir=tmp, checkpoint_every=3, **kwargs)


@pytest.mark.parametrize("method", ["pipeoptim", "pipedream", "pipedream-2bw", "gpipe", "spectrain"])
def test_interrupted_run_resumes_to_the_same_losses(tmp_path, method):
    expected = run(tmp_path / "full", method).losses
    assert len(expected) == 16

    with pytest.raises(Crash):
        run(tmp_path / "cut", method, on_batch=crash_at(11))
    # checkpoints: after 3, 6 and 8 mini-batches (epoch end), then 11; the crash comes in the
    # segment after that, so the resumed run redoes mini-batches 11.. from the last checkpoint
    resumed = run(tmp_path / "cut", method, resume=True)
    assert resumed.losses == expected


def test_resume_without_checkpoint_starts_fresh_and_mismatch_is_refused(tmp_path):
    fresh = run(tmp_path / "a", "pipeoptim", resume=True)
    assert len(fresh.losses) == 16
    with pytest.raises(CheckpointError, match="method is 'pipeoptim' but this run has 'pipedream'"):
        run(tmp_path / "a", "pipedream", resume=True)


def test_continuous_runs_cannot_checkpoint_every_k(tmp_path):
    with pytest.raises(ValueError, match="continuous run never drains"):
        run(tmp_path, "pipeoptim", continuous=True)


def test_checkpoints_written_in_the_background_resume_alike(tmp_path):
    """async_checkpoint: the same losses; a run that dies while a checkpoint is being written
    resumes from the one before (the one being written is named the latest only once whole)."""
    expected = run(tmp_path / "full", "pipeoptim").losses
    assert run(tmp_path / "bg", "pipeoptim", async_checkpoint=True).losses == expected
    names = lambda folder: sorted(p.name for p in folder.iterdir())  # noqa: E731
    assert names(tmp_path / "bg") == names(tmp_path / "full")

    with pytest.raises(Crash):
        run(tmp_path / "cut", "pipeoptim", async_checkpoint=True,
            on_batch=crash_at(7))  # the checkpoint after 6 is written while 7 trains
    latest = (tmp_path / "cut" / "latest.json").read_text()
    assert "batch000003" in latest  # 6's is not named: its writer was never waited for
    assert run(tmp_path / "cut", "pipeoptim", async_checkpoint=True, resume=True).losses == expected


def test_resume_says_where_it_starts_and_passes_over_a_damaged_newest_checkpoint(tmp_path, capfd):
    """resume=True serves the first start and every restart: with no checkpoint it trains from the
    beginning and says so; a newest checkpoint damaged after it was written (a flipped byte) is passed
    over for the one before, named in the log, and the run still reaches the uninterrupted losses; a
    run whose every checkpoint is damaged is refused, naming the fix; one whose only checkpoint was
    torn while being written (no manifest) starts from the beginning."""
    expected = run(tmp_path / "full", "pipeoptim").losses
    capfd.readouterr()
    with pytest.raises(Crash):
        run(tmp_path / "cut", "pipeoptim", resume=True, on_batch=crash_at(13))
    assert capfd.readouterr().err == f"pipeoptim: no checkpoint in {tmp_path / 'cut'} yet: training from the beginning\n"
    store = tmp_path / "cut"
    newest = store / "epoch0001-batch000003"
    assert sorted(p.name for p in store.iterdir()) == ["epoch0001-batch000000", newest.name, "latest.json"]
    data = bytearray((newest / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (newest / "__0_0.distcp").write_bytes(bytes(data))
    assert run(store, "pipeoptim", resume=True).losses == expected
    err = capfd.readouterr().err.splitlines()
    assert err[0] == f"pipeoptim: passed over a checkpoint that is not whole: {newest / '__0_0.distcp'}: checksum " \
                     f"mismatch (truncated or corrupted; {len(data)} bytes)"
    assert err[1] == f"pipeoptim: resumed from {store / 'epoch0001-batch000000'} (epoch 1, mini-batch 0) " \
                     f"(3 stages on 1 process)"
    for folder in (p for p in store.iterdir() if p.is_dir()):  # the run wrote its own two again: damage both
        (folder / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"{store}: no whole checkpoint is left to resume from .*: delete "
                                              f"{store} to train from the beginning"):
        run(store, "pipeoptim", resume=True)
    torn = tmp_path / "torn" / "epoch0000-batch000003"
    torn.mkdir(parents=True)
    (torn / ".metadata").write_bytes(b"")  # renamed into place, killed before its manifest was written
    assert run(tmp_path / "torn", "pipeoptim", resume=True).losses == expected
    assert "manifest.json: missing (the checkpoint was not completed)" in capfd.readouterr().err
