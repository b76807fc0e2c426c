"""Training a study run, as the second study trained them and the equal-time study (study3.py)
still does: a run to its first part (to a checkpoint, resumed) or its end, its evaluations as the
curve time to target reads, the data shared by consecutive runs, and the checkpoints freed once a
run is done. (The second study's own runner, benchmarks/study2.py, is in commit 6bb0f1e.)"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence, Tuple

from study.study2_plan import SYNCHRONOUS
from pipeoptim.checkpoint import latest_checkpoint, read_manifest
from pipeoptim.lab.config import RunConfig
from pipeoptim.lab.experiment import load_data, run_experiment


class ReachedStop(Exception):
    """A sweep run trained its first part and checkpointed the evaluation it stops at."""


class UntilCheckpoint:
    """One epoch of training mini-batches that ends the run once the checkpoint ``manifest``
    exists: Pipeline.fit drains, evaluates and checkpoints at the stop point, then asks for the
    next mini-batch (or the next epoch's first), and gets :class:`ReachedStop` instead. The
    checkpoint is the one an uninterrupted run writes there, so resuming from it continues the
    same run (same lr schedule over the whole run, same data order, same drains)."""

    def __init__(self, batches: Sequence[Any], manifest: Path) -> None:
        self.batches = batches
        self.manifest = manifest

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches:
            if self.manifest.exists():
                raise ReachedStop
            yield batch


def has_checkpoint(folder: Path) -> bool:
    return latest_checkpoint(folder / "checkpoints") is not None


def train_until(cfg: RunConfig, folder: Path, data: Any, manifest: Path, label: str,
                options: Dict[str, Any]) -> Tuple[bool, Dict[str, Any]]:
    """Train a run's first part, resuming from its folder's last checkpoint if it has one, until
    the checkpoint ``manifest`` is written (at once if it already was: a call stopped between
    the checkpoint and the row). Returns (resumed, the checkpoint's manifest); ``options`` are
    run_experiment's (quiet output, the task, the diagnostic)."""
    resumed = has_checkpoint(folder)
    if not manifest.exists():
        try:
            run_experiment(cfg, out_dir=folder, resume=resumed,
                           data=dataclasses.replace(data, train=UntilCheckpoint(data.train, manifest)), **options)
        except ReachedStop:
            pass
        else:
            raise RuntimeError(f"{label}: trained to the end without reaching its stop point ({manifest.parent.name})")
    return resumed, read_manifest(manifest.parent)


def drop_checkpoints(folder: Path) -> None:
    """Free the disk once a run's checkpoints will never be resumed (the run folder's summary,
    metrics.jsonl and curves stay)."""
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)


def curve(evaluations: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The evaluations as time to target reads them: updates, metric, training seconds."""
    return [{"updates": e["updates"], "metric": e["metric"], "seconds": round(e["seconds"], 2)} for e in evaluations]


def cached_data(data_cache: Dict[Any, Any], task_name: str, seed: int, task: Any, resolved: Any) -> Any:
    """The task's data for a run's settings, loaded once for consecutive runs that share them
    (task, seed, batch size, limit, holdout); the cache keeps one entry."""
    key = (task_name, seed, resolved.batch_size, resolved.limit, resolved.holdout)
    if key not in data_cache:
        data_cache.clear()
        data_cache[key] = load_data(task, resolved)
    return data_cache[key]


def quiet_options(task: Any, method: str, diagnose_every: int) -> Dict[str, Any]:
    """run_experiment's settings for a study run: no progress bar or log, the diagnostic every
    ``diagnose_every`` mini-batches for the asynchronous methods (the synchronous ones have none)."""
    return dict(show_progress=False, log=lambda *a, **k: None, task=task,
                diagnose_every=0 if method in SYNCHRONOUS else diagnose_every)
