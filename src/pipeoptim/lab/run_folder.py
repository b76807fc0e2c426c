"""The files of a run folder that the command line and the launcher read without torch.

A run folder (``pipeoptim train --out RUN``) holds ``config.json``, ``metrics.jsonl``,
``summary.json``, ``curves.png``, ``checkpoints/`` (see :mod:`pipeoptim.checkpoint`; its
``latest.json`` names the newest complete checkpoint) and, for the distributed runtime,
``status/stage-K.json``: each stage process's own account of itself (running, finished, failed and
why, or stopped by a signal), which lets the launcher tell the stage that was lost or signalled
from those that were stopped or cut off because of it.

Everything here is plain JSON and the standard library, so that a stage's signal watcher (which
may run while the main thread is still importing torch) and the command line can use it.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional

_status_lock = threading.Lock()  # the main thread and a signal watcher may both write a status


def write_status(out: Optional[Path], stage: int, **fields: Any) -> None:
    """Record this stage's state in ``RUN/status/stage-K.json`` (running, finished, failed,
    interrupted), so that the launcher can tell the stage that was lost from those that lost
    contact with it. Written to a temporary name and renamed: a reader sees the old state or the
    new one."""
    if out is None:
        return
    folder = Path(out) / "status"
    if not _status_lock.acquire(timeout=1.0):  # never wedge a stopping process on a status
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".stage-{stage}.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps({"stage": stage, "pid": os.getpid(), "time": time.time(), **fields}))
        os.replace(tmp, folder / f"stage-{stage}.json")
    except OSError:  # a status is advice; never fail a run over it
        pass
    finally:
        _status_lock.release()


def read_statuses(out: Optional[Path]) -> Dict[int, Dict[str, Any]]:
    """The stages' status files of a run folder, by stage."""
    found: Dict[int, Dict[str, Any]] = {}
    if out is None or not (Path(out) / "status").is_dir():
        return found
    for path in (Path(out) / "status").glob("stage-*.json"):
        try:
            entry = json.loads(path.read_text())
            found[int(entry["stage"])] = entry
        except (ValueError, KeyError, TypeError, OSError):
            continue
    return found


def clear_statuses(out: Optional[Path]) -> None:
    """Remove the stages' status files (before a run starts in the folder, e.g. a resumed one)."""
    if out is None or not (Path(out) / "status").is_dir():
        return
    for path in (Path(out) / "status").glob("stage-*.json"):
        try:
            path.unlink()
        except OSError:
            pass


def last_checkpoint(out: Optional[Path]) -> Optional[Path]:
    """The newest complete checkpoint of the run in ``out`` (what ``checkpoints/latest.json``
    names), or None: no run folder, no checkpoint yet, or an unreadable pointer."""
    if out is None:
        return None
    pointer = Path(out) / "checkpoints" / "latest.json"
    try:
        return pointer.parent / json.loads(pointer.read_text())["checkpoint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resume_hint(out: Optional[Path], command: str) -> str:
    """``Last checkpoint: C; continue with: COMMAND`` for the run in ``out``, or that none was
    written yet ('' without a run folder)."""
    if out is None:
        return ""
    last = last_checkpoint(out)
    if last is None:
        return "No checkpoint was written yet"
    return f"Last checkpoint: {last}; continue with: {command}"
