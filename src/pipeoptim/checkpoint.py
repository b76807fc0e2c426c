"""Checkpoints of a pipeline run in torch's distributed checkpoint format (DCP), written whole or
not at all, checked on load, refused with a reason.

A checkpoint is taken at a drained point (no micro-batch in flight), by every process of the job
at once: ``torch.distributed.checkpoint.save`` of :func:`checkpoint_state`, each stage's weights
and its state by the original model's parameter names (optimizer, scheduler, weight policy: the
version, the predictor's directions, ``delta="ema"``'s averages; the format of
:mod:`pipeoptim.runtime.named_state`), a sharded stage's tensors as shards. So it loads into any
layout of the same model, torch resharding what it reads (:func:`load_state`): other stages,
other replicas, sharded or not, one process. A ``manifest.json`` written last records the
method (and a user's own schedule's digest, :func:`schedule_digest`), options, the data position
and the SHA-256 of every file; ``latest.json`` in the
checkpoint folder names the newest complete checkpoint (a crash mid-write leaves the previous
one named). Its ``model`` entries are the model's ``state_dict``: torch's own
``dcp_to_torch_save`` turns a checkpoint into one ``torch.save`` file whose ``["model"]`` loads
into the user's ``nn.Module`` (README, "Checkpoints").

A missing, truncated, corrupted or mismatched file is refused with :class:`CheckpointError`
naming the file and the reason, and so is a checkpoint of another model or of an older format.
A resumed run takes the newest *whole* checkpoint (:func:`newest_whole`): one torn or damaged
(:class:`Damaged`) is passed over for the one before it, and the run's log says so.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from .compat import is_dtensor
from .errors import CheckpointError  # defined there so that the command line can catch it without torch
from .runtime import named_state

if TYPE_CHECKING:
    from .state_names import StateNames

class Damaged(CheckpointError):
    """A checkpoint whose files are not whole: a file missing, truncated or corrupted (its checksum
    differs), its manifest unreadable or never written. ``completed``: its manifest was written
    (the checkpoint was whole once), else it was torn while being written."""

    def __init__(self, message: str, completed: bool = True) -> None:
        super().__init__(message)
        self.completed = completed


#: 3: torch's distributed checkpoint, keyed by the model's parameter names
FORMAT = 3
#: what a checkpoint of each older format holds, for the message that refuses it
FORMATS = {1: "torch's positional optimizer state", 2: "a file per stage"}
#: the weight policy's per-parameter tensors, by section of its state: section -> its field of
#: tensors by parameter name (the predictor's stored directions, ``delta="ema"``'s averages,
#: ``error_feedback``'s previous updates)
POLICY_TENSORS = {"predictor": "stored", "ema": "average", "error_feedback": "previous"}


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
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())  # one tensor: one checkpoint entry
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    import ast
    version, internal, gauss = ast.literal_eval(state["python"])
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def checkpoint_state(stages, rank: int, names: Optional["StateNames"] = None) -> Dict[str, Any]:
    """What this process writes of a drained pipeline (the module docstring): tensors under
    ``model``, ``optim`` and ``policy`` keyed by the original model's names (a sharded stage's as
    DTensors, stored as shards), the rest of each stage's state under ``stages.K``, this process's
    RNG under ``rng.RANK``. ``names``: a traced model's state-dict names, so that ``model`` loads
    into the model's class with ``strict=True`` (every name of a tied weight, no buffer it does
    not save)."""
    state: Dict[str, Any] = {"model": {}, "optim": {}, "policy": {}, "stages": {}, "rng": {str(rank): rng_state()}}
    for stage in stages:
        if stage.shards is not None:
            stage.shards.release()  # its module's parameters: the shards, not gathered copies
        entry = named_state.stage_state(stage)
        weights = stage.module.state_dict()
        state["model"].update(weights if names is None else names.complete(weights))
        for name, per in entry["optimizer"]["state"].items():
            state["optim"][name] = per
        policy = dict(entry["policy"])
        for section, field in POLICY_TENSORS.items():  # the tensors out, their names left in place
            if section in policy:
                for name, t in policy[section][field].items():
                    state["policy"].setdefault(name, {})[section] = t
                policy[section] = {**policy[section], field: sorted(policy[section][field])}
        entry = {**entry, "policy": policy,
                 "optimizer": {**entry["optimizer"], "state": sorted(entry["optimizer"]["state"])}}
        try:  # one opaque entry (a checkpoint splits a dict into one entry per leaf)
            state["stages"][str(stage.index)] = json.dumps(entry)
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"stage {stage.index}'s optimizer or scheduler state cannot be written "
                                  f"as JSON ({error}); give it numbers, strings and lists only") from None
    return state


def write_state(state: Dict[str, Any], folder: Path, group: Any = None, background: bool = False) -> Any:
    """``dcp.save`` of :func:`checkpoint_state`, every process of the job at once (``group``:
    the job's; None: this process alone). Replicas write what they hold alike once.
    ``background``: ``dcp.async_save``, which returns once the state is copied in memory; the
    returned future completes when the files are written."""
    import torch.distributed.checkpoint as dcp

    folder.mkdir(parents=True, exist_ok=True)
    if background and group is None:  # its thread warns as it runs, after any block's filter is gone
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                                "uninitialized, assuming the intent is to save in a single process")
    with warnings.catch_warnings():  # (one process: torch warns that it assumes so)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if background:
            return dcp.async_save(state, checkpoint_id=str(folder), process_group=group, no_dist=group is None)
        dcp.save(state, checkpoint_id=str(folder), process_group=group, no_dist=group is None)
    return None


def checksums(folder: Path) -> Dict[str, str]:
    """The SHA-256 of every file of a written checkpoint (its manifest aside)."""
    return {p.name: sha256(p.read_bytes()) for p in sorted(folder.iterdir())
            if p.is_file() and p.name != "manifest.json" and ".tmp" not in p.name}


def verify(folder: Path, manifest: Dict[str, Any]) -> None:
    """Every file the manifest lists is there with its checksum."""
    for name, digest in manifest["files"].items():
        path = folder / name
        if not path.exists():
            raise Damaged(f"{path}: missing")
        data = path.read_bytes()
        if sha256(data) != digest:
            raise Damaged(f"{path}: checksum mismatch (truncated or corrupted; {len(data)} bytes)")


def _template(meta: Any, prefix: str, names: Any, like: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, Any]]:
    """The per-parameter entries under ``prefix`` to read for ``names``: an empty tensor of the
    saved size (a DTensor sharded as the parameter where it has the parameter's shape), or a
    placeholder for a value that is not a tensor."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out: Dict[str, Dict[str, Any]] = {}
    for key, path in meta.planner_data.items():
        if len(path) != 3 or path[0] != prefix or path[1] not in names:
            continue
        stored = meta.state_dict_metadata[key]
        if not isinstance(stored, TensorStorageMetadata):
            out.setdefault(path[1], {})[path[2]] = ""
            continue
        param = like.get(path[1])
        dtype = stored.properties.dtype
        if is_dtensor(param) and tuple(stored.size) == tuple(param.shape):
            value = torch.empty_like(param, dtype=dtype)
        else:
            device = param.device if param is not None and not is_dtensor(param) else "cpu"
            value = torch.empty(tuple(stored.size), dtype=dtype, device=device)
        out.setdefault(path[1], {})[path[2]] = value
    return out


def plan_load(folder: Path, stages, rank: int, state_names: Optional["StateNames"] = None) -> Dict[str, Any]:
    """What this process reads of a checkpoint written by any layout of the same model (other
    stages, replicas, sharding, one process): the tensors to read into, by name (its stages'
    own weights, and empty ones for their optimizer and policy state) and every saved stage's
    other state. Refuses, naming the checkpoint, one of another model; reads no tensor yet, so
    that every process can learn of a refusal before they read together (:func:`load_state`).
    ``state_names``: as :func:`checkpoint_state`'s ``names`` (a tied weight is read by one of its
    names; a buffer the model does not save is not read)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(folder)).read_metadata()
    except Exception as error:  # noqa: BLE001 - any failure to read the metadata means a bad file
        raise CheckpointError(f"{folder / '.metadata'}: cannot be read ({type(error).__name__}: {error})") from None
    keys = {path[:2] for path in meta.planner_data.values()}
    model, names, params = {}, set(), {}
    held = {stage.index for stage in stages}
    for stage in stages:
        if stage.shards is not None:
            stage.shards.release()
        if stage.replica_of not in held:  # a replica beside its piece copies it after the load
            weights = stage.module.state_dict()
            model.update(weights if state_names is None else state_names.persistent(weights))
        for group_names in named_state.stage_groups(stage):
            names.update(group_names)
        params.update(dict(stage.module.named_parameters()))
    missing = sorted(k for k in model if ("model", k) not in keys)
    if missing:
        raise CheckpointError(f"{folder}: holds no {missing[0]!r} of this model (written for another "
                              f"model?): resume with the model that wrote it, or train without resume")
    for key, path in meta.planner_data.items():
        if path[0] == "model" and path[1] in model:
            saved, here = list(getattr(meta.state_dict_metadata[key], "size", [])), list(model[path[1]].shape)
            if saved != here:
                raise CheckpointError(f"{folder}: {path[1]} is {saved} there but {here} in this model (written "
                                      f"for another model?): resume with the model that wrote it, or train "
                                      f"without resume")
    saved_stages = sorted({path[1] for path in meta.planner_data.values() if path[0] == "stages"}, key=int)
    own_rng = str(rank) if ("rng", str(rank)) in keys else "0"
    return {"model": model, "optim": _template(meta, "optim", names, params),
            "policy": _template(meta, "policy", names, params),
            "stages": {j: "" for j in saved_stages}, "rng": _template(meta, "rng", {own_rng}, {})}


def load_state(folder: Path, stages, state: Dict[str, Any], group: Any = None) -> Dict[str, Any]:
    """Read :func:`plan_load`'s ``state`` (every process of the job at once; ``group``: the
    job's, None: this process alone; torch reshards what it reads) and load it into ``stages``:
    weights in place, optimizer, scheduler and policy state by name. Returns this process's
    saved RNG state (rank 0's where this rank wrote none)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException)

    saved_stages = list(state["stages"])
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(folder), process_group=group, no_dist=group is None)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - torch names the mismatch
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise CheckpointError(f"{folder}: does not fit this model or optimizer ({lines[-1] if lines else type(error).__name__})"
                              ) from None
    saved = []
    for j in saved_stages:
        entry = json.loads(state["stages"][j])
        entry["optimizer"] = {**entry["optimizer"], "state": {n: state["optim"][n] for n in entry["optimizer"]["state"]
                                                              if n in state["optim"]}}
        policy = dict(entry["policy"])
        for section, field in POLICY_TENSORS.items():  # the tensors this process read, by name
            if section in policy:
                policy[section] = {**policy[section], field: {
                    n: state["policy"][n][section] for n in policy[section][field] if n in state["policy"]}}
        entry["policy"] = policy
        saved.append(entry)
    try:
        for stage in stages:
            scheduler = stage.scheduler
            if (scheduler is None) != (saved[0].get("scheduler") is None):
                raise ValueError("the run has " + ("no" if scheduler is None else "a") + " learning-rate scheduler "
                                 "but the checkpoint " + ("has one" if scheduler is None else "has none"))
        named_state.load_stages(stages, saved)
    except (RuntimeError, KeyError, ValueError) as error:
        raise CheckpointError(f"{folder}: does not fit this model or optimizer ({error})") from None
    for stage in stages:
        if stage.shards is not None:
            stage.shards.release()  # the next pass gathers the loaded shards
    return next(iter(state["rng"].values()))


def save_manifest(folder: Path, info: Dict[str, Any], files: Dict[str, str]) -> None:
    """Write the manifest (last), then point ``latest.json`` at this checkpoint."""
    manifest = {"format": FORMAT, **info, "files": files}
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
        raise Damaged(f"{pointer}: unreadable ({error})") from None
    return root / name


def newest_whole(root: Path, expect: Optional[Dict[str, Any]] = None) -> Tuple[Optional[Path], List[str]]:
    """The newest whole checkpoint under ``root`` (None: none yet) and why each newer one was
    passed over. The first candidate is the one ``latest.json`` names, then every other folder
    older than it, newest first (all of them where ``latest.json`` is missing or unreadable);
    one :class:`Damaged` is passed over. A checkpoint of another run (``expect``, as
    :func:`read_manifest`) or of another format is refused, not passed over; and so is a run
    whose every checkpoint was damaged after it was completed (starting again would silently
    lose it): the message names the fix. Checkpoints torn while being written, and nothing
    else, leave None (the run starts from the beginning)."""
    passed: List[str] = []
    try:
        named = latest_checkpoint(root)
    except CheckpointError as error:
        named, passed = None, [str(error)]
    folders = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                     reverse=True) if root.is_dir() else []
    if named is not None:
        folders = [named] + [p for p in folders if p.name < named.name]
    completed = False
    for folder in folders:
        try:
            verify(folder, read_manifest(folder, expect=expect))
            return folder, passed
        except Damaged as error:
            passed.append(str(error))
            completed = completed or error.completed
    if completed:
        raise CheckpointError(f"{root}: no whole checkpoint is left to resume from ({'; '.join(passed)}): "
                              f"delete {root} to train from the beginning")
    return None, passed


def read_manifest(folder: Path, expect: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Read and check a checkpoint's manifest; ``expect`` lists fields that must match."""
    path = folder / "manifest.json"
    if not path.exists():
        raise Damaged(f"{path}: missing (the checkpoint was not completed)", completed=False)
    try:
        manifest = json.loads(path.read_text())
    except ValueError as error:
        raise Damaged(f"{path}: not valid JSON ({error})") from None
    if manifest.get("format") != FORMAT:
        held = FORMATS.get(manifest.get("format"), "unknown")
        raise CheckpointError(f"{path}: format {manifest.get('format')!r} ({held}), this version reads {FORMAT} "
                              f"(torch's distributed checkpoint): resume it with the pipeoptim that wrote it, "
                              f"or start the run again")
    for key, value in (expect or {}).items():
        if key == "schedule" and manifest.get(key) != value:
            raise CheckpointError(f"{path}: {_schedule_words(manifest.get(key), manifest.get('method'))} wrote it, "
                                  f"but this run has {_schedule_words(value, expect.get('method'))}: resume with "
                                  f"the schedule that wrote it, or give another checkpoint_dir to train from the "
                                  f"beginning")
        if manifest.get(key) != value:
            raise CheckpointError(f"{path}: {key} is {manifest.get(key)!r} but this run has {value!r}")
    return manifest


def schedule_digest(schedule: Any) -> str:
    """The identity a checkpoint records of a user's schedule (``Pipeline(schedule=...)``): the
    SHA-256 of its actions rank by rank, its placement, pipelines, micro-batches per update and
    paired forwards and backwards; not its name (a file's path, say), which changes nothing run."""
    text = json.dumps({"orders": [[str(a) for a in order] for order in schedule.orders],
                       "stage_to_rank": list(schedule.stage_to_rank),
                       "pipelines": [list(p) for p in schedule.pipelines],
                       "microbatches_per_update": schedule.microbatches_per_update,
                       "pairs": sorted(f"{f};{b}" for f, b in schedule.pairs.items())}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _schedule_words(digest: Optional[str], method: Optional[str]) -> str:
    if digest is None:
        return f"{method}'s own schedule (no schedule=)"
    return f"the schedule= whose actions' digest is {digest[:12]}"


def prune(root: Path, keep: int = 2) -> None:
    """Delete all but the ``keep`` newest complete checkpoints under ``root``."""
    import shutil

    done = sorted(p for p in root.iterdir() if p.is_dir() and (p / "manifest.json").exists())
    for old in done[:-keep] if keep > 0 else done:
        shutil.rmtree(old, ignore_errors=True)


def checkpoint_name(epoch: int, batch: int) -> str:
    return f"epoch{epoch:04d}-batch{batch:06d}"
