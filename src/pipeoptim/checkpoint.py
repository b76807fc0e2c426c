"""Checkpoints of a pipeline run: written atomically, checked on load, refused with a reason.

A checkpoint is taken at a drained point (no micro-batch in flight). Each stage writes one file,
``stage-K.pt``: its module's weights and the state :mod:`pipeoptim.runtime.named_state` keys by
parameter name (optimizer, scheduler, weight policy: the version, the predictor's directions),
the one state format of the package (``Pipeline.state_dict`` uses it too), with its counters and
the RNG states of its process. A
``manifest.json`` written last records the method, stages, partition, options, the data position
and the SHA-256 of every stage file; ``latest.json`` in the checkpoint folder names the newest
complete checkpoint. Every file goes to a temporary name first and is renamed into place, so a
crash leaves either the old checkpoint or the new one, never half of one.

Loading uses ``torch.load(..., weights_only=True)``; a missing, truncated, corrupted or
mismatched file is refused with :class:`CheckpointError` naming the file and the reason.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from .errors import CheckpointError  # defined there so that the command line can catch it without torch
from .runtime import named_state

#: 2: each stage's state keyed by parameter name (1, before: torch's positional optimizer state)
FORMAT = 2


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def rng_state() -> Dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": repr(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    import ast
    version, internal, gauss = ast.literal_eval(state["python"])
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_stage(stage, folder: Path) -> str:
    """Write ``stage-K.pt`` into ``folder`` (the drained stage's weights and its state by parameter
    name); return its SHA-256."""
    state = {"format": FORMAT, "module": stage.module.state_dict(), **named_state.stage_state(stage),
             "rng": rng_state()}
    folder.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    _atomic_write(folder / f"stage-{stage.index}.pt", data)
    return sha256(data)


def save_manifest(folder: Path, info: Dict[str, Any], checksums: Dict[int, str]) -> None:
    """Write the manifest (last), then point ``latest.json`` at this checkpoint."""
    manifest = {"format": FORMAT, **info, "files": {f"stage-{k}.pt": h for k, h in sorted(checksums.items())}}
    _atomic_write(folder / "manifest.json", json.dumps(manifest, indent=2).encode())
    _atomic_write(folder.parent / "latest.json", json.dumps({"checkpoint": folder.name}).encode())


def latest_checkpoint(root: Path) -> Optional[Path]:
    """The newest complete checkpoint under ``root`` (a run's ``checkpoints`` folder), or None."""
    pointer = root / "latest.json"
    if not pointer.exists():
        return None
    try:
        name = json.loads(pointer.read_text())["checkpoint"]
    except (ValueError, KeyError) as error:
        raise CheckpointError(f"{pointer}: unreadable ({error})") from None
    return root / name


def read_manifest(folder: Path, expect: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Read and check a checkpoint's manifest; ``expect`` lists fields that must match."""
    path = folder / "manifest.json"
    if not path.exists():
        raise CheckpointError(f"{path}: missing (the checkpoint was not completed)")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, this version reads {FORMAT} (stage "
                              f"state by parameter name): resume it with the pipeoptim that wrote it, or "
                              f"start the run again")
    for key, value in (expect or {}).items():
        if manifest.get(key) != value:
            raise CheckpointError(f"{path}: {key} is {manifest.get(key)!r} but this run has {value!r}")
    return manifest


def load_stage(folder: Path, manifest: Dict[str, Any], stage) -> Dict[str, Any]:
    """Check ``stage-K.pt`` against the manifest and load it into ``stage``."""
    name = f"stage-{stage.index}.pt"
    path = folder / name
    if name not in manifest["files"]:
        raise CheckpointError(f"{folder / 'manifest.json'}: lists no {name}")
    if not path.exists():
        raise CheckpointError(f"{path}: missing")
    data = path.read_bytes()
    if sha256(data) != manifest["files"][name]:
        raise CheckpointError(f"{path}: checksum mismatch (truncated or corrupted; "
                              f"{len(data)} bytes)")
    try:
        state = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointError(f"{path}: cannot be read ({type(error).__name__}: {error})") from None
    if state.get("stage") != stage.index:
        raise CheckpointError(f"{path}: holds stage {state.get('stage')}, expected {stage.index}")
    try:
        scheduler = getattr(stage, "scheduler", None)
        if (scheduler is None) != (state.get("scheduler") is None):
            raise ValueError("the run has " + ("no" if scheduler is None else "a") + " learning-rate "
                             "scheduler but the checkpoint " + ("has one" if scheduler is None else "has none"))
        stage.module.load_state_dict(state["module"])
        named_state.load_stages([stage], [state])
    except (RuntimeError, KeyError, ValueError) as error:
        raise CheckpointError(f"{path}: does not fit this model or optimizer ({error})") from None
    return state


def prune(root: Path, keep: int = 2) -> None:
    """Delete all but the ``keep`` newest complete checkpoints under ``root``."""
    import shutil

    done = sorted(p for p in root.iterdir() if p.is_dir() and (p / "manifest.json").exists())
    for old in done[:-keep] if keep > 0 else done:
        shutil.rmtree(old, ignore_errors=True)


def checkpoint_name(epoch: int, batch: int) -> str:
    return f"epoch{epoch:04d}-batch{batch:06d}"
