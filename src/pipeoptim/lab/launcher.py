"""Starting the distributed runtime: one process per pipeline stage, under ``torchrun``.

One machine, started for you (the processes bind to 127.0.0.1)::

    pipeoptim train --runtime distributed --stages 4 --method pipeoptim ...

runs torchrun's elastic agent in this process (``torch.distributed.launcher.api.elastic_launch``,
as ``torchrun --nnodes 1 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0
--max-restarts 0 -m pipeoptim.lab.stage_worker RUN.json`` would, the run's settings in a temporary
file). If a stage fails or is killed, the agent stops the others within a tenth of a second and
the command says which stage was lost and how (each stage keeps ``RUN/status/stage-K.json`` up to
date, so that a stage killed outright is told apart from those cut off from it), names the last
checkpoint, and exits with status 1 (2 for bad input found by the workers).

Ctrl-C (SIGINT), SIGTERM or SIGHUP of the command, or of one stage, stops every process of the
run within a fraction of a second and prints one line: the signal (and the stage, if one was signalled),
the last checkpoint and the command that resumes; the exit status is 128 + the signal (130, 143,
129). A stage whose launcher is killed outright (SIGKILL) ends by itself (Linux's parent-death
signal), leaving the last complete checkpoint as it was (see :mod:`pipeoptim.runtime.lifecycle`).

Checkpoints and ``--resume RUN`` work as in the local runtime: every rank writes its own stage
file into ``RUN/checkpoints/...`` and rank 0 the manifest, so the run folder must be reachable
from every rank (one machine, or a shared file system).

Under torchrun yourself, as with any PyTorch job (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT come from torchrun; the world size is the stages times the replicas: without
``--data-parallel``, the replicas the world over ``--stages``)::

    torchrun --nproc-per-node 4 -m pipeoptim train --runtime distributed --stages 4 ...

With ``--resume --out RUN`` the one command line serves the first start and every restart
(``torchrun --max-restarts K``); a job re-formed on fewer processes (``--nnodes MIN:MAX``)
continues the run's stages with fewer replicas, unless the run was given ``--data-parallel``.

Several machines: the same command on every node, with torchrun's rendezvous flags, e.g. two
nodes of two stages each (stage k runs on global rank k; ranks fill node 0 first)::

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank R --master-addr HOST0 --master-port 29500 \\
        -m pipeoptim train --runtime distributed --stages 4 ...
    # or elastic rendezvous: --rdzv-backend c10d --rdzv-endpoint HOST0:29500 --rdzv-id JOB

(gloo picks the network interface from the host name; set ``GLOO_SOCKET_IFNAME`` (NCCL:
``NCCL_SOCKET_IFNAME``) if that is the wrong one.) Every node needs the data set: each rank
loads it from the same seed and uses its own part (stage 0 the inputs, the last stage the
targets). Rank 0 writes the run folder and prints the ``--json`` summary.

``--device cuda`` uses NCCL and one GPU per stage, ``cuda:LOCAL_RANK``; ``--device cpu`` (the
default) uses gloo with ``--threads`` compute threads per process (default 1).
``--timeout`` (seconds, default 300) bounds every wait on a peer: a hung or dead stage makes
the run fail with a message naming what was awaited, instead of hanging.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..errors import STOP_SIGNALS, Interrupted, interrupt_on_signals
from .config import flag_given
from .run_folder import clear_statuses, last_checkpoint, read_statuses, resume_hint
from ..runtime.defaults import DEFAULT_TIMEOUT
from ..runtime.layout import Layout, plan_layout
from ..runtime.lifecycle import under_torchrun
from .stage_worker import LAUNCHER_PID, RESUME_COMMAND, guard_stage, rank_name, worker

#: set in the stage processes of a local launch: the launcher's pid (it reports for them)
#: seconds the agent gives a stage to end on a forwarded signal before SIGKILL (they take ms)
SHUTDOWN_SECONDS = 3


def _options(args: argparse.Namespace) -> Dict[str, Any]:
    timeout = getattr(args, "timeout", DEFAULT_TIMEOUT)
    threads = getattr(args, "threads", 1)
    if not timeout > 0:
        raise ValueError(f"--timeout must be positive, got {timeout}")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}")
    return {"timeout": float(timeout), "device": distributed_device(getattr(args, "device", "cpu")),
            "threads": threads, "json": bool(args.json), "progress": not args.no_progress,
            "diagnose_every": int(getattr(args, "diagnose_every", 0) or 0)}


def distributed_device(device: str) -> str:
    """``--device`` for one process per pipeline rank: ``cpu`` (gloo) or ``cuda`` (NCCL, each stage on
    cuda:LOCAL_RANK); ``auto`` picks cuda when a GPU is visible."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" or device.startswith("cuda") and "," not in device:
        return "cpu" if device == "cpu" else "cuda"
    raise ValueError(f"--device {device} with --runtime distributed: give cpu, cuda or auto (each "
                     f"stage process takes cuda:LOCAL_RANK)")


def run_distributed_train(args: argparse.Namespace, cfg, output_dir: Callable[[str], Path]) -> int:
    """`pipeoptim train --runtime distributed`: a worker under torchrun, else start torchrun.
    ``output_dir(label)`` names a new run folder (called on the rank that names it)."""
    opts = _options(args)
    resume = getattr(args, "resume", None)
    opts["resume"] = resume is not None
    if cfg.tensor_parallel != 1:
        from .experiment import check_tensor_planned
        from .tasks import get_task

        check_tensor_planned(cfg.task, cfg.model or get_task(cfg.task).default_model, cfg.tensor_parallel)
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        cfg = dataclasses.replace(cfg, stages=job_stages(cfg, world, resume, flag_given(args, "--stages")))
        out = resume
        if out is None and int(os.environ["RANK"]) == 0:  # the others learn it from rank 0
            out = output_dir(f"{cfg.method}-N{world}")
        guard_stage(int(os.environ["RANK"]), out)
        return worker(cfg, out=out, **opts)
    out = resume if resume is not None else output_dir(f"{cfg.method}-N{cfg.stages}")
    return launch(cfg, out=out, **opts)


def run_layout(cfg) -> Layout:
    """The layout of the run ``cfg`` (:func:`pipeoptim.runtime.layout.plan_layout`)."""
    from ..methods import get_method

    return plan_layout(get_method(cfg.method), stages=cfg.stages, partition=cfg.partition, chunks=cfg.chunks,
                       data_parallel=cfg.data_parallel, tensor_parallel=cfg.tensor_parallel)


def stage_count(cfg) -> int:
    """Processes a local launch starts: T per stage of each replica (N x D x T)."""
    return run_layout(cfg).processes


def job_stages(cfg, world: int, resumed: Optional[Path] = None, stages_given: bool = True) -> int:
    """The stages of ``cfg`` in the user's own torchrun job of ``world`` processes, placed as the
    engine places a Pipeline there (:func:`~pipeoptim.runtime.layout.plan_layout`): the stages
    fixed (``--stages``; a run ``resumed`` from its folder keeps its own), the replicas the world
    over the stages, unless ``--data-parallel`` is given (or recorded by the run), which the job
    must then hold exactly. So a job re-formed on fewer processes continues with fewer replicas.
    A new run without ``--stages`` (and no ``--partition``) takes the world over the replicas.
    Refused, with the fix, where the job cannot hold the stages or the replicas given."""
    tensor = cfg.tensor_parallel
    if resumed is None and not stages_given and cfg.partition is None and cfg.method != "sequential":
        cfg = dataclasses.replace(cfg, stages=max(1, world // ((cfg.data_parallel or 1) * tensor)))
    n = run_layout(dataclasses.replace(cfg, data_parallel=None)).processes  # one replica's processes: N x T
    replicas = cfg.data_parallel
    if world % n == 0 and (replicas is None or replicas * n == world):
        return n // tensor
    given = "sequential" if cfg.method == "sequential" else \
        f"--partition {','.join(map(str, cfg.partition))}" if cfg.partition is not None else f"--stages {cfg.stages}"
    if resumed is not None:
        given = f"the run in {resumed} ({given}"
        given += f" --data-parallel {replicas})" if replicas is not None else ")"
    if tensor > 1:
        given += f" --tensor-parallel {tensor}"
    each = f"{n} stage process{'es' if n != 1 else ''}"
    if world % n:
        raise ValueError(f"{given} runs {each} per replica but the world size is {world}: start a multiple of "
                         f"{n} processes, {f'{tensor} per stage' if tensor > 1 else 'one per stage'} of each "
                         f"replica (torchrun --nproc-per-node {n}"
                         + (f" or {n * (world // n)}" if world >= 2 * n else "") + ")")
    drop = f"set \"data_parallel\": null in {resumed / 'config.json'}" if resumed is not None else \
        "leave out --data-parallel"
    raise ValueError(f"{given}{'' if resumed is not None else f' --data-parallel {replicas}'} runs {each} x "
                     f"{replicas} replicas but the world size is {world}: start {n * replicas} processes "
                     f"(torchrun --nproc-per-node {n * replicas}), or {drop}, so that the replicas follow the "
                     f"world size ({world // n} here)")


def torchrun_env(threads: Optional[int]) -> Dict[str, str]:
    """The environment of a local launch: loopback for gloo, one compute thread per process,
    the package importable, and this process's pid (``PIPEOPTIM_LAUNCHER_PID``)."""
    env = dict(os.environ)
    if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    env.setdefault("OMP_NUM_THREADS", str(threads or 1))  # (also quiets torchrun's banner)
    src = str(Path(__file__).resolve().parents[2])  # the package importable in the workers
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env[LAUNCHER_PID] = str(os.getpid())  # the workers watch this process, and leave reporting to it
    return env


def launch(cfg, *, out: Optional[Path], timeout: float, device: str, threads: Optional[int],
           json: bool, progress: bool, resume: bool = False, diagnose_every: int = 0) -> int:
    """Start one process per pipeline rank on this machine (torchrun's agent, in this process) and wait
    for them. If a stage fails, the others are stopped at once and the reply names the stage
    that was lost, how, and the last checkpoint to resume from; returns the exit status (0, 1
    for a lost stage or a failed run, 2 for bad input found by the workers). A signal (see the
    module docstring) raises :class:`Interrupted`, whose message is the command line's one line."""
    with interrupt_on_signals():
        try:
            return _launch(cfg, out=out, timeout=timeout, device=device, threads=threads, json=json,
                           progress=progress, resume=resume, diagnose_every=diagnose_every)
        except Interrupted as stop:
            if str(stop):  # a stage was signalled: already said
                raise
            hint = resume_hint(out, RESUME_COMMAND.format(out=out))
            raise Interrupted(stop.signum, f"interrupted by {stop.signal_name}; every stage was stopped"
                                           + (f". {hint}" if hint else "")) from None


def _launch(cfg, *, out: Optional[Path], timeout: float, device: str, threads: Optional[int],
            json: bool, progress: bool, resume: bool, diagnose_every: int) -> int:
    import json as _json

    check_before_launch(cfg)
    nproc = stage_count(cfg)
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < nproc:
            raise ValueError(f"--device cuda with {nproc} stages needs {nproc} GPUs on this machine, "
                             f"found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="pipeoptim-launch-") as tmp:
        config = Path(tmp) / "run.json"
        config.write_text(_json.dumps({
            "kind": "train", "config": dataclasses.asdict(cfg), "out": str(out) if out is not None else None,
            "timeout": timeout, "device": device, "threads": threads, "json": json, "progress": progress,
            "resume": resume, "diagnose_every": diagnose_every,
        }))
        if not json:
            each = (f"{cfg.tensor_parallel} per stage" if cfg.tensor_parallel > 1 else "one per stage") + \
                (f" of each of {cfg.data_parallel} replicas" if (cfg.data_parallel or 1) > 1 else "")
            print(f"starting {nproc} process{'es' if nproc != 1 else ''} ({each}), as torchrun "
                  f"--nproc-per-node {nproc} would", flush=True)
        clear_statuses(out)  # a resumed run's folder holds the last run's: they would mislead the report
        failures = run_workers(nproc, "pipeoptim.lab.stage_worker", [str(config)], torchrun_env(threads))
    if not failures:
        return 0
    shape = run_layout(cfg)
    layout = (shape.ranks or nproc, shape.replicas, shape.tensor)
    signalled = interrupted_stages(failures, out)
    if signalled:
        stage, status = signalled[0]
        hint = resume_hint(out, RESUME_COMMAND.format(out=out))
        raise Interrupted(getattr(signal, status["signal"], signal.SIGTERM),
                          f"{rank_name(stage, *layout)}, pid {status.get('pid')}) got {status['signal']}; "
                          f"every stage was stopped" + (f". {hint}" if hint else ""))
    text, lost = failure_report(failures, out, layout)
    print(f"pipeoptim train: error: {text}", file=sys.stderr, flush=True)
    return 2 if all(failures[r][0] == 2 for r in lost) else 1  # 2: bad input, found by a worker


def check_before_launch(cfg) -> None:
    """Refuse settings the workers would refuse (stages against layers, micro-batches against
    the batch size, ...) here, once, before any process starts: one line, exit status 2."""
    from .experiment import check_run, check_tensor_split, load_data
    from .tasks import get_task

    task = get_task(cfg.task)
    cfg = cfg.resolved(task)
    data = load_data(task, cfg)
    data.split(cfg.eval_split, f"task {task.name}")
    model = task.build_model(cfg.model, data, seed=cfg.seed)
    check_tensor_split(model, cfg.tensor_parallel, f"{task.name}'s model {cfg.model}")
    check_run(cfg, model, data.train)


def run_workers(nproc: int, module: str, module_args: List[str], env: Dict[str, str]) -> Dict[int, Tuple[int, str]]:
    """Run ``python -m module *module_args`` as ``nproc`` ranks on this machine under torchrun's
    elastic agent (no restarts; the rendezvous on 127.0.0.1); return the failed ranks as
    ``{rank: (exit code, signal name or "")}``, empty if all succeeded. When one rank fails
    the agent stops the others (SIGTERM) within its monitor interval (0.1 s).

    A SIGINT, SIGTERM or SIGHUP of this process is forwarded to the ranks by the agent, which
    waits for them (at most ``SHUTDOWN_SECONDS``, then SIGKILL); then :class:`Interrupted`
    is raised. The agent's own log lines (the signal it forwards, the rank that failed) are
    silenced: the caller reports (``PIPEOPTIM_DEBUG=1`` keeps them)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    settings = dict(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"pipeoptim-{os.getpid()}",
                    rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                    monitor_interval=0.1, local_addr="127.0.0.1")
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:  # torch >= 2.8 or so
        settings["shutdown_timeout"] = SHUTDOWN_SECONDS
    config = LaunchConfig(**settings)
    saved = dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS}  # the agent replaces them
    quiet = _quiet_agent_logs() if not os.environ.get("PIPEOPTIM_DEBUG") else {}
    os.environ.clear()
    os.environ.update(env)  # the agent hands its own environment to the workers
    try:
        elastic_launch(config, sys.executable)("-m", module, *module_args)
        return {}
    except ChildFailedError as error:
        return {rank: (f.exitcode, f.signal_name() if f.exitcode < 0 else "")
                for rank, f in sorted(error.failures.items())}
    except SignalException as error:  # the agent has stopped the ranks with the same signal
        raise Interrupted(int(error.sigval)) from None
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for s, handler in handlers.items():
            if handler is not None:
                signal.signal(s, handler)
        for logger, level in quiet.items():
            logger.setLevel(level)


def _quiet_agent_logs() -> Dict[logging.Logger, int]:
    """Raise torch's elastic agent's loggers to CRITICAL; return their previous levels."""
    import torch.distributed.elastic.agent.server.api  # noqa: F401  (create the loggers)
    import torch.distributed.elastic.multiprocessing.api  # noqa: F401

    saved = {}
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logger = logging.getLogger(name)
            saved[logger] = logger.level
            logger.setLevel(logging.CRITICAL)
    return saved


def interrupted_stages(failures: Dict[int, Tuple[int, str]], out: Optional[Path]) -> List[Tuple[int, Dict[str, Any]]]:
    """The failed stages that ended on a signal someone other than the launcher sent them
    (``kill -TERM`` of a stage), by the time they recorded it; with their status."""
    statuses = read_statuses(out)
    found = [(r, statuses[r]) for r in failures
             if statuses.get(r, {}).get("state") == "interrupted" and statuses[r].get("cause") == "signal"]
    return sorted(found, key=lambda item: item[1].get("time", 0.0))


def failure_report(failures: Dict[int, Tuple[int, str]], out: Optional[Path],
                   layout: Tuple[int, ...] = (0, 1)) -> Tuple[str, List[int]]:
    """One paragraph for a failed run: which stage was lost (or failed first) and how, and the
    last checkpoint (``layout``: the stages, replicas and tensor ranks, for
    :func:`~pipeoptim.lab.stage_worker.rank_name`); and the ranks
    it names."""
    statuses = read_statuses(out)
    # A stage that died by a signal the agent did not send (kill -9, the OOM killer, a crash)
    # was lost; otherwise the stages that failed on their own, not for want of a peer.
    # (A stage the agent stopped says so in its status: interrupted, by the launcher.)
    lost = [r for r, (code, sig) in failures.items() if code < 0 and sig != "SIGTERM"]
    if not lost:
        lost = [r for r, (code, _) in failures.items() if code > 0 and statuses.get(r, {}).get("kind") != "comm"
                and statuses.get(r, {}).get("state") != "interrupted"]
    if not lost:
        lost = sorted(failures)[:1]
    messages = {statuses.get(r, {}).get("message") for r in lost}
    last = last_checkpoint(out)
    if all(statuses.get(r, {}).get("kind") == "nonfinite" for r in lost) and len(messages) == 1:
        # every stage saw the same loss; resuming would repeat the same steps
        text = f"{messages.pop()} (every stage stopped)"
        if last is not None:
            text += f". Last good checkpoint: {last}; resuming repeats the same steps, so start again " \
                    f"with other settings (a lower --lr)"
        return text, lost
    parts = []
    for r in lost:
        code, sig = failures.get(r, (1, ""))
        status = statuses.get(r, {})
        pid = f", pid {status['pid']}" if status.get("pid") else ""
        if code < 0:
            how = {"SIGKILL": "killed by SIGKILL (kill -9, or the out-of-memory killer)",
                   "SIGABRT": "aborted (SIGABRT)", "SIGSEGV": "crashed (SIGSEGV)"}.get(sig, f"killed by {sig}")
            parts.append(f"{rank_name(r, *layout)}{pid}) was lost: {how}")
        else:
            parts.append(f"{rank_name(r, *layout)}{pid}) failed (exit status {code})"
                         + (f": {status['message']}" if status.get("message") else ""))
    text = "; ".join(parts) + ". The other stages were stopped"
    if last is not None:
        text += f". Last checkpoint: {last}; continue with: pipeoptim train --runtime distributed --resume {out}"
    else:
        text += ". No checkpoint was written yet"
    return text, lost
