"""One stage process of the distributed runtime (:mod:`pipeoptim.lab.launcher` starts them, or a
user's torchrun runs ``pipeoptim train --runtime distributed`` in each): its guards against
signals and its launcher's death, its status file, its share of the run's Pipeline
(:func:`worker`), and the entry ``python -m pipeoptim.lab.stage_worker RUN.json`` of a local launch
(a training run's settings, or a benchmark's)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from .run_folder import last_checkpoint, read_statuses, resume_hint, write_status
from ..runtime import lifecycle
from ..runtime.lifecycle import Stop

#: the environment variable that gives a stage process its launcher's pid (a local launch)
LAUNCHER_PID = "PIPEOPTIM_LAUNCHER_PID"
#: how a stopped distributed run resumes
RESUME_COMMAND = "pipeoptim train --runtime distributed --resume {out}"


#: this stage process, for its signal watcher: its stage and run folder once known
_this_stage: Dict[str, Any] = {"stage": None, "out": None}


def guard_stage(stage: Optional[int], out: Optional[Path]) -> str:
    """Install this stage process's guards (:func:`pipeoptim.runtime.lifecycle.guard`): it ends
    at once on SIGINT, SIGTERM or SIGHUP and when its launcher dies, after recording why in its
    status file. Under a user's torchrun (no launcher of ours to report) the stage that got the
    signal, or rank 0 when torchrun forwarded it, also says so in one line on stderr."""
    _this_stage.update(stage=stage, out=Path(out) if out is not None else None)
    parent = os.environ.get(LAUNCHER_PID)
    return lifecycle.guard(_on_stop, parent=int(parent) if parent else None)


def _on_stop(stop: Stop) -> None:
    """(In the watcher thread, just before the process ends: no imports, no locks of the main
    thread's.)"""
    stage, out = _this_stage["stage"], _this_stage["out"]
    if stage is None:
        return
    how = {"launcher": f"stopped by {stop.signal_name} from its launcher (pid {stop.sender})",
           "signal": f"got {stop.signal_name}" + (f" from pid {stop.sender}" if stop.sender else ""),
           "parent-died": "its launcher died"}.get(stop.cause, f"got {stop.signal_name}")
    write_status(out, stage, state="interrupted", signal=stop.signal_name, cause=stop.cause,
                 sender=stop.sender, message=how)
    if os.environ.get(LAUNCHER_PID) is None and (stop.cause == "signal" or stage == 0):
        hint = resume_hint(out, "torchrun (the same flags) -m " + RESUME_COMMAND.format(out=out))
        line = f"pipeoptim train: stage {stage} (pid {os.getpid()}) {how}; the run stops" + \
               (f". {hint}" if hint else "") + "\n"
        os.write(2, line.encode())


_STARTED = time.time()  # (a peer's status from before this process began is an earlier run's)


def _peer_interrupted(out: Optional[Path], stage: int) -> bool:
    """Did another stage of this run stop on a signal (so that this one's lost contact is no
    news)?"""
    return any(r != stage and st.get("state") == "interrupted" and st.get("time", 0.0) >= _STARTED
               for r, st in read_statuses(out).items())


def rank_name(rank: int, stages: int = 0, replicas: int = 1, tensor: int = 1) -> str:
    """How a message names a process: ``stage k (rank r`` (the caller closes the parenthesis),
    with its replica where there are several and its tensor rank where each stage has T
    processes (rank r = (d*N + k)*T + t runs tensor rank t of stage k of replica d)."""
    if not stages or (replicas == 1 and tensor == 1):
        return f"stage {rank} (rank {rank}"
    k, d, t = (rank // tensor) % stages, rank // (stages * tensor), rank % tensor
    return (f"stage {k}" + (f" of replica {d}" if replicas > 1 else "") + (f", tensor rank {t}" if tensor > 1 else "")
            + f" (rank {rank}")


def worker(cfg, *, out: Optional[Path], timeout: float, device: str, threads: Optional[int],
           json: bool, progress: bool, resume: bool = False, diagnose_every: int = 0) -> int:
    """One process of a distributed `pipeoptim train`: its stage of the run's Pipeline, built
    and trained by :func:`pipeoptim.lab.experiment.run_experiment` from the same settings as a local
    run. Rank 0 names the run folder (every rank learns it from rank 0), writes it and the
    checkpoints' manifests, and prints the summary; every stage keeps its status file."""
    import torch.distributed as dist

    from ..checkpoint import CheckpointError
    from ..errors import NonFiniteLoss
    from .experiment import final_line, run_experiment
    from ..runtime.control import init_process_group
    from ..runtime.wire import PipelineCommError

    init_process_group(device=device, timeout=timeout, threads=threads)
    rank = dist.get_rank()
    tensor = cfg.tensor_parallel
    # a user's torchrun: the world over the stages and their tensor ranks
    replicas = dist.get_world_size() // ((cfg.stages or 1) * tensor)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if json else (lambda *a: print(*a, flush=True))

    def fail(kind: str, error: BaseException, code: int, quiet: bool = False) -> int:
        last = last_checkpoint(out)
        write_status(out, rank, state="failed", kind=kind, message=str(error))
        where = f"last checkpoint: {last}" if last is not None else "no checkpoint written yet"
        if not quiet and not (kind == "comm" and _peer_interrupted(out, rank)):
            print(f"pipeoptim train: {rank_name(rank, cfg.stages, replicas, tensor)}): error: {error} ({where})",
                  file=sys.stderr, flush=True)
        return code

    try:
        out = _agree_on_folder(out, timeout)
        _this_stage.update(stage=rank, out=out)
        write_status(out, rank, state="running", rank=rank)
        summary = run_experiment(cfg, out_dir=out, show_progress=progress, log=log, resume=resume,
                                 diagnose_every=diagnose_every,
                                 processes={"device": device, "timeout": timeout, "threads": threads})
        if rank == 0:
            if json:
                print(_dumps(summary, indent=2), flush=True)
            else:
                print(final_line(summary), flush=True)  # the line a one-process run ends with
                print(f"run folder: {out}", flush=True)
        write_status(out, rank, state="finished")
        return 0
    except PipelineCommError as error:
        return fail("comm", error, 1)
    except NonFiniteLoss as error:  # every rank sees it: one of them says so
        return fail("nonfinite", error, 1, quiet=rank != 0)
    except CheckpointError as error:
        return fail("checkpoint", error, 2)
    except BaseException as error:
        write_status(out, rank, state="failed", kind="error", message=f"{type(error).__name__}: {error}")
        if isinstance(error, Exception) and _peer_interrupted(out, rank):
            return 1  # cut off by a stage that was stopped: that one is the news, not this traceback
        raise
    finally:
        try:
            dist.destroy_process_group()  # the Pipeline has closed its own groups (run_experiment)
        except Exception:  # noqa: BLE001 - a broken group cannot always be torn down cleanly
            pass


def _agree_on_folder(out: Optional[Path], timeout: float) -> Optional[Path]:
    """Rank 0's run folder, on every rank (a run under a user's torchrun names it on rank 0)."""
    import torch.distributed as dist

    from ..runtime.wire import PipelineCommError, reason

    box = [str(out) if out is not None else None]
    try:
        dist.broadcast_object_list(box, src=0)
    except RuntimeError as error:
        raise PipelineCommError(f"agreeing on the run folder failed: {reason(error)}. A peer stage hung, "
                                f"died or is slower than the timeout ({timeout:g} s)") from error
    return Path(box[0]) if box[0] is not None else None


def _dumps(obj: Any, **kwargs: Any) -> str:
    import json as _json

    return _json.dumps(obj, **kwargs)


def main(argv: Optional[List[str]] = None) -> int:
    """Worker entry of a local launch: ``python -m pipeoptim.lab.stage_worker RUN.json``. The stage's
    guards (signals, the launcher's death) go in first, before torch starts any thread."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m pipeoptim.lab.stage_worker RUN.json (started by `pipeoptim train "
              "--runtime distributed`)", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    train = spec.get("kind") != "bench"
    guard_stage(int(os.environ.get("RANK", "0")) if train else None, spec.get("out") if train else None)
    from ..errors import command_line_words
    from ..options import OPTIONS
    from .config import LAB_OPTIONS

    with command_line_words((*OPTIONS, *LAB_OPTIONS)):  # a process of the command line's run: its words
        return _run(spec, train)


def _run(spec: Dict[str, Any], train: bool) -> int:
    """The benchmark or the training run of a local launch's ``spec``, its refusals said in one line."""
    if not train:
        from .bench_worker import bench_worker

        try:
            return bench_worker(spec)
        except ValueError as error:  # bad input the workers found (each finds it: rank 0 says it)
            if os.environ.get("PIPEOPTIM_DEBUG"):
                raise
            if os.environ.get("RANK", "0") == "0":
                print(f"pipeoptim bench: error: {error}", file=sys.stderr, flush=True)
            return 2
    from ..errors import MissingDataError
    from .config import RunConfig

    cfg = RunConfig(**spec["config"])
    try:
        return worker(cfg, out=Path(spec["out"]) if spec["out"] else None, timeout=spec["timeout"],
                      device=spec["device"], threads=spec["threads"], json=spec["json"],
                      progress=spec["progress"], resume=spec.get("resume", False),
                      diagnose_every=spec.get("diagnose_every", 0))
    except (ValueError, MissingDataError) as error:
        if os.environ.get("PIPEOPTIM_DEBUG"):
            raise
        print(f"pipeoptim train: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    code = main()
    # Leave without interpreter finalization: gloo's worker threads can still hold work objects
    # whose tensors reference Python, and tearing those down during finalization aborts the
    # process (SIGABRT, "terminate called without an active exception") after a clean run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
