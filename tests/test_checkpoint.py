"""Checkpoints in torch's distributed checkpoint format: exact round trips, into another partition
too, a plain torch.save file by torch's own conversion, and refusal of bad files with a reason."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from pipeoptim.checkpoint import (CheckpointError, checkpoint_state, checksums, latest_checkpoint, load_state,
                                  plan_load, read_manifest, save_manifest, verify, write_state)
from pipeoptim.checks import check_method_options
from pipeoptim.methods import get_method
from pipeoptim.runtime.build import build_stages
from pipeoptim.runtime.local import run_schedule
from conftest import batches, mlp

LOSS = nn.functional.cross_entropy


def make_stages(seed=0, method="pipeoptim", sizes=(4, 4), model=None):
    model = model if model is not None else mlp(seed=seed)
    stages = build_stages(model, list(sizes), get_method(method), check_method_options(get_method(method), {}),
                          lambda ps: torch.optim.Adam(ps, lr=1e-2), LOSS)
    return model, stages


def train_some(stages, data, method="pipeoptim"):
    schedule = get_method(method).build_schedule(len(stages), 1, len(data))
    micro = [(x, y, 1.0) for x, y in data]
    return run_schedule(stages, schedule, micro)


def save_all(stages, folder, **info):
    write_state(checkpoint_state(stages, 0), folder)
    save_manifest(folder, {"method": "pipeoptim", "stages": len(stages), **info}, checksums(folder))


def load_all(folder, stages, expect=None):
    verify(folder, read_manifest(folder, expect))
    return load_state(folder, stages, plan_load(folder, stages, 0))


def test_round_trip_continues_exactly(tmp_path):
    data = batches(6)
    _, stages = make_stages()
    train_some(stages, data[:3])
    folder = tmp_path / "ckpt" / "c1"
    save_all(stages, folder)
    expected = train_some(stages, data[3:])
    _, fresh = make_stages(seed=5)  # other initial weights: everything must come from the files
    load_all(latest_checkpoint(tmp_path / "ckpt"), fresh, {"method": "pipeoptim", "stages": 2})
    assert fresh[0].policy.predictor.steps_taken == 3 and fresh[0].policy.version == 3
    assert train_some(fresh, data[3:]) == expected


def test_a_checkpoint_loads_into_another_partition(tmp_path):
    """Written by 2 stages, read by 3 (weights, Adam's moments, the steps, by parameter name):
    the synchronous method continues with the losses of the 2-stage run."""
    data = batches(6)
    _, stages = make_stages(method="1f1b-flush")
    train_some(stages, data[:3], "1f1b-flush")
    save_all(stages, tmp_path / "c")
    expected = train_some(stages, data[3:], "1f1b-flush")
    _, three = make_stages(seed=5, method="1f1b-flush", sizes=(3, 3, 2))
    load_all(tmp_path / "c", three)
    got = train_some(three, data[3:], "1f1b-flush")
    assert got == pytest.approx(expected, rel=1e-12)


def test_the_converted_checkpoint_loads_into_the_users_module_without_pipeoptim(tmp_path):
    """torch's own dcp_to_torch_save, then load_state_dict(strict=True) in a process where
    pipeoptim cannot be imported."""
    model, stages = make_stages()
    train_some(stages, batches(2))
    save_all(stages, tmp_path / "c")
    code = ("import sys, torch; sys.modules['pipeoptim'] = None\n"
            "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
            f"dcp_to_torch_save({str(tmp_path / 'c')!r}, {str(tmp_path / 'model.pt')!r})\n"
            "from torch import nn\n"
            "layers = [nn.Linear(6, 12)] + [nn.Sequential(nn.Tanh(), nn.Linear(12, 12)) for _ in range(6)] "
            "+ [nn.Sequential(nn.Tanh(), nn.Linear(12, 4))]\n"
            "fresh = nn.Sequential(*layers).double()\n"
            f"fresh.load_state_dict(torch.load({str(tmp_path / 'model.pt')!r}, weights_only=True)['model'], strict=True)\n"
            f"torch.save(fresh.state_dict(), {str(tmp_path / 'fresh.pt')!r})\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = torch.load(tmp_path / "fresh.pt", weights_only=True)
    assert set(loaded) == set(model.state_dict())
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("damage,message", [
    ("truncate", "checksum mismatch"),
    ("flip", "checksum mismatch"),
    ("delete", "missing"),
    ("manifest", "not valid JSON"),
    ("no-manifest", "manifest.json: missing"),
])
def test_damaged_checkpoints_are_refused_with_the_file_named(tmp_path, damage, message):
    _, stages = make_stages()
    train_some(stages, batches(2))
    folder = tmp_path / "c"
    save_all(stages, folder)
    data_file = folder / "__0_0.distcp"
    if damage == "truncate":
        data_file.write_bytes(data_file.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(data_file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        data_file.write_bytes(bytes(data))
    elif damage == "delete":
        data_file.unlink()
    elif damage == "manifest":
        (folder / "manifest.json").write_text("{not json")
    else:
        (folder / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=message) as info:
        load_all(folder, stages)
    assert str(folder) in str(info.value)


def test_mismatched_manifest_is_refused(tmp_path):
    _, stages = make_stages()
    folder = tmp_path / "c"
    save_all(stages, folder)
    with pytest.raises(CheckpointError, match="method is 'pipeoptim' but this run has 'pipedream'"):
        read_manifest(folder, {"method": "pipedream"})


@pytest.mark.parametrize("other, says", [
    (mlp(width=10), r"0.weight is \[12, 6\] there but \[10, 6\] in this model"),  # the same names, other shapes
    (nn.Sequential(nn.Linear(6, 30), nn.Linear(30, 4)).double(), "holds no '1.bias' of this model"),
])
def test_a_checkpoint_of_another_model_is_refused(tmp_path, other, says):
    _, stages = make_stages()
    save_all(stages, tmp_path / "c")
    _, theirs = make_stages(model=other, sizes=(4, 4) if len(other) == 8 else (1, 1))
    with pytest.raises(CheckpointError, match=says):
        load_all(tmp_path / "c", theirs)


def test_no_temporary_files_left_behind(tmp_path):
    _, stages = make_stages()
    save_all(stages, tmp_path / "c")
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [".metadata", "__0_0.distcp", "manifest.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "latest.json"]
    assert set(json.loads((tmp_path / "c" / "manifest.json").read_text())["files"]) == {".metadata", "__0_0.distcp"}


@pytest.mark.parametrize("old, held", [(1, "torch's positional optimizer state"), (2, "a file per stage")])
def test_a_checkpoint_of_an_older_format_is_refused_naming_the_fix(tmp_path, old, held):
    _, stages = make_stages()
    folder = tmp_path / "c"
    save_all(stages, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "format": old}))
    with pytest.raises(CheckpointError, match=f"format {old} \\({held}\\), this version reads 3 .*resume it "
                                              f"with the pipeoptim that wrote it, or start the run again"):
        read_manifest(folder)
