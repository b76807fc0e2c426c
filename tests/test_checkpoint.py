"""Checkpoint files: atomic writes, exact round trips, and refusal of bad files with a reason."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from pipeoptim.checkpoint import (CheckpointError, latest_checkpoint, load_stage, read_manifest,
                                  save_manifest, save_stage)
from pipeoptim.methods import get_method
from pipeoptim.runtime.build import build_stages
from pipeoptim.runtime.local import run_schedule
from conftest import batches, mlp

LOSS = nn.functional.cross_entropy


def make_stages(seed=0, method="pipeoptim"):
    model = mlp(seed=seed)
    stages = build_stages(model, [4, 4], get_method(method), get_method(method).resolve_options({}),
                          lambda ps: torch.optim.Adam(ps, lr=1e-2), LOSS)
    return model, stages


def train_some(stages, data):
    schedule = get_method("pipeoptim").build_schedule(2, 1, len(data))
    micro = [(x, y, 1.0) for x, y in data]
    return run_schedule(stages, schedule, micro)


def save_all(stages, folder, **info):
    sums = {s.index: save_stage(s, folder) for s in stages}
    save_manifest(folder, {"method": "pipeoptim", "stages": 2, **info}, sums)


def test_round_trip_continues_exactly(tmp_path):
    data = batches(6)
    _, stages = make_stages()
    train_some(stages, data[:3])
    folder = tmp_path / "ckpt" / "c1"
    save_all(stages, folder)
    expected = train_some(stages, data[3:])
    _, fresh = make_stages(seed=5)  # other initial weights: everything must come from the files
    manifest = read_manifest(latest_checkpoint(tmp_path / "ckpt"), {"method": "pipeoptim", "stages": 2})
    for stage in fresh:
        load_stage(folder, manifest, stage)
    assert fresh[0].policy.predictor.steps_taken == 3 and fresh[0].policy.version == 3
    assert train_some(fresh, data[3:]) == expected


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
    stage_file = folder / "stage-1.pt"
    if damage == "truncate":
        stage_file.write_bytes(stage_file.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(stage_file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        stage_file.write_bytes(bytes(data))
    elif damage == "delete":
        stage_file.unlink()
    elif damage == "manifest":
        (folder / "manifest.json").write_text("{not json")
    else:
        (folder / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=message) as info:
        manifest = read_manifest(folder)
        for stage in stages:
            load_stage(folder, manifest, stage)
    assert str(folder) in str(info.value)


def test_mismatched_manifest_is_refused(tmp_path):
    _, stages = make_stages()
    folder = tmp_path / "c"
    save_all(stages, folder)
    with pytest.raises(CheckpointError, match="method is 'pipeoptim' but this run has 'pipedream'"):
        read_manifest(folder, {"method": "pipedream"})
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["stage-1.pt"] = manifest["files"]["stage-0.pt"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="stage-1.pt: checksum mismatch"):
        load_stage(folder, read_manifest(folder), stages[1])


def test_stage_file_of_another_model_is_refused(tmp_path):
    _, stages = make_stages()
    folder = tmp_path / "c"
    save_all(stages, folder)
    wide = nn.Sequential(nn.Linear(6, 30), nn.Linear(30, 4)).double()
    other = build_stages(wide, [1, 1], get_method("pipeoptim"), get_method("pipeoptim").resolve_options({}),
                         lambda ps: torch.optim.Adam(ps, lr=1e-2), LOSS)
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_stage(folder, read_manifest(folder), other[0])


def test_no_temporary_files_left_behind(tmp_path):
    _, stages = make_stages()
    save_all(stages, tmp_path / "c")
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["manifest.json", "stage-0.pt", "stage-1.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "latest.json"]


def test_a_checkpoint_of_the_positional_format_is_refused_naming_the_fix(tmp_path):
    """Format 2 keys each stage's state by parameter name (the state Pipeline.state_dict holds);
    a format-1 checkpoint (torch's positional optimizer state) is refused, with what to do."""
    _, stages = make_stages()
    train_some(stages, batches(2))
    folder = tmp_path / "c"
    save_all(stages, folder)
    state = torch.load(folder / "stage-0.pt", weights_only=True)
    names = ["0.weight", "0.bias"] + [f"{k}.1.{p}" for k in (1, 2, 3) for p in ("weight", "bias")]
    assert state["format"] == 2 and state["groups"] == [names]  # the model's own names, stage 0's layers 0-3
    assert set(state["optimizer"]["state"]) == set(names)
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "format": 1}))
    with pytest.raises(CheckpointError, match="format 1, this version reads 2 .*resume it with the pipeoptim "
                                              "that wrote it, or start the run again"):
        read_manifest(folder)
