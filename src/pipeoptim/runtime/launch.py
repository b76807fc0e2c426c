"""Starting the distributed runtime: one process per pipeline stage, under ``torchrun``.

One machine, started for you (the processes bind to 127.0.0.1)::

    pipeoptim train --runtime distributed --stages 4 --method pipeoptim ...

runs ``python -m torch.distributed.run --nnodes 1 --nproc-per-node 4 --rdzv-backend c10d
--rdzv-endpoint 127.0.0.1:0 -m pipeoptim.runtime.launch RUN.json`` (the run's settings in a
temporary file) and returns its exit status.

Under torchrun yourself, as with any PyTorch job (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT come from torchrun; the world size is the number of stages)::

    torchrun --nproc-per-node 4 -m pipeoptim train --runtime distributed --stages 4 ...

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
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from .distributed import DEFAULT_TIMEOUT

_DISTRIBUTED_OPTIONS = ("--timeout", "--device", "--threads")


def add_distributed_options(parser: argparse.ArgumentParser) -> None:
    """The options of the distributed runtime (idempotent: a parser that has them is left as is)."""
    existing = {s for a in parser._actions for s in a.option_strings}
    if any(o in existing for o in _DISTRIBUTED_OPTIONS):
        return
    g = parser.add_argument_group(
        "distributed runtime (--runtime distributed)",
        "One process per stage. Without torchrun, torchrun is started for you on this machine; "
        "under torchrun (torchrun --nproc-per-node N -m pipeoptim train --runtime distributed ...) "
        "the world size is the number of stages. Several machines: run torchrun on each with "
        "--nnodes, --node-rank, --master-addr/--master-port (or --rdzv-backend c10d "
        "--rdzv-endpoint HOST:PORT). See `python -m pydoc pipeoptim.runtime.launch`.")
    g.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help="seconds a stage waits for a peer before the run fails (default: %(default)g)")
    g.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: gloo; cuda: NCCL, one GPU per stage (cuda:LOCAL_RANK). Default cpu")
    g.add_argument("--threads", type=int, default=1,
                   help="compute threads per stage process on CPU (default: 1)")


def under_torchrun() -> bool:
    """True in a process started by torchrun (or any launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _options(args: argparse.Namespace) -> Dict[str, Any]:
    timeout = getattr(args, "timeout", DEFAULT_TIMEOUT)
    threads = getattr(args, "threads", 1)
    if not timeout > 0:
        raise ValueError(f"--timeout must be positive, got {timeout}")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}")
    return {"timeout": float(timeout), "device": getattr(args, "device", "cpu"), "threads": threads,
            "json": bool(args.json), "progress": not args.no_progress}


def _stages_given() -> bool:
    return any(a == "--stages" or a.startswith("--stages=") for a in sys.argv[1:])


def run_distributed_train(args: argparse.Namespace, cfg) -> int:
    """`pipeoptim train --runtime distributed`: a worker under torchrun, else start torchrun."""
    from ..cli.common import output_dir

    if getattr(args, "resume", None) is not None or getattr(cfg, "checkpoint_every", None) is not None:
        raise ValueError("--checkpoint-every and --resume work with --runtime local; the distributed "
                         "runtime does not checkpoint yet")
    opts = _options(args)
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if cfg.method == "sequential":
            if world != 1:
                raise ValueError(f"sequential runs as one stage; start it with --nproc-per-node 1 "
                                 f"(world size is {world})")
        elif cfg.partition is not None:
            if len(cfg.partition) != world:
                raise ValueError(f"--partition has {len(cfg.partition)} stages but the world size is "
                                 f"{world}: start one process per stage")
        elif cfg.stages != world:
            if _stages_given():
                raise ValueError(f"--stages {cfg.stages} but the world size is {world}: start one "
                                 f"process per stage (torchrun --nproc-per-node {cfg.stages}) or "
                                 f"pass --stages {world}")
            cfg = dataclasses.replace(cfg, stages=world)
        out = None
        if int(os.environ["RANK"]) == 0:
            out = output_dir(args, f"{cfg.method}-N{world}")
        return worker(cfg, out=out, **opts)
    out = output_dir(args, f"{cfg.method}-N{cfg.stages}")
    return launch(cfg, out=out, **opts)


def stage_count(cfg) -> int:
    if cfg.method == "sequential":
        return 1
    return len(cfg.partition) if cfg.partition is not None else cfg.stages


def torchrun_command(nproc: int, module: str, module_args: List[str]) -> List[str]:
    """The command that starts ``nproc`` processes of ``python -m module`` on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--max-restarts", "0",
            "-m", module, *module_args]


def torchrun_env(threads: Optional[int]) -> Dict[str, str]:
    """The environment of a local launch: loopback for gloo, one compute thread per process."""
    env = dict(os.environ)
    if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    env.setdefault("OMP_NUM_THREADS", str(threads or 1))  # (also quiets torchrun's banner)
    src = str(Path(__file__).resolve().parents[2])  # the package importable in the workers
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def launch(cfg, *, out: Optional[Path], timeout: float, device: str, threads: Optional[int],
           json: bool, progress: bool) -> int:
    """Start torchrun with one process per stage on this machine; return its exit status."""
    import json as _json

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
        }))
        command = torchrun_command(nproc, "pipeoptim.runtime.launch", [str(config)])
        if not json:
            print(f"starting {nproc} process{'es' if nproc != 1 else ''} (one per stage) under torchrun "
                  f"--nproc-per-node {nproc}", flush=True)
        return subprocess.call(command, env=torchrun_env(threads))


def worker(cfg, *, out: Optional[Path], timeout: float, device: str, threads: Optional[int],
           json: bool, progress: bool) -> int:
    """One process of a distributed `pipeoptim train`: train its stage; rank 0 writes the run."""
    import torch
    import torch.distributed as dist

    from ..experiment import progress_bar, summarize_run
    from ..optimizers import make_optimizer
    from ..tasks import get_task
    from .distributed import PipeComm, PipelineCommError, init_process_group, train_distributed

    dev = init_process_group(device=device, timeout=timeout, threads=threads)
    rank = dist.get_rank()
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if json else (lambda *a: print(*a, flush=True))
    try:
        started = time.time()
        task = get_task(cfg.task)
        cfg = cfg.resolved(task)
        data = task.load(batch_size=cfg.batch_size, limit=cfg.limit, seed=cfg.seed)
        model = task.build_model(cfg.model, data, seed=cfg.seed)
        torch.manual_seed(cfg.seed)  # as the local runtime (each process draws its own, see distributed.py)
        optimizer = make_optimizer(cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.momentum)
        comm = PipeComm(device=dev, timeout=timeout)
        writer = comm.stage == 0
        log_file = None
        if writer and out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(_dumps(dataclasses.asdict(cfg), indent=2))  # as local runs
            log_file = open(out / "metrics.jsonl", "w")
        bar = progress_bar(len(data.train) * cfg.epochs,
                           f"{cfg.method} ({comm.num_stages} processes)", progress and writer)

        def on_update(_: int) -> None:
            bar.update(1)

        def on_batch(index: int, loss: float) -> None:
            if log_file:
                log_file.write(_dumps({"type": "batch", "batch": index, "loss": loss}) + "\n")

        def on_epoch(epoch: int, entry: Dict[str, Any]) -> None:
            if log_file:
                log_file.write(_dumps({"type": "epoch", **entry}) + "\n")
                log_file.flush()
            bar.clear()
            log(f"{cfg.method:>14} epoch {epoch + 1}/{cfg.epochs}: loss {entry['loss']:.4f}  "
                f"{task.metric} {entry.get('metric', float('nan')):.4f}  "
                f"{entry['samples_per_second']:.0f} samples/s")

        try:
            result = train_distributed(
                model, data.train, method=cfg.method, optimizer=optimizer, loss_fn=task.loss,
                stages=cfg.stages, partition=cfg.partition, partitioner=cfg.partitioner,
                epochs=cfg.epochs, micro_batches=cfg.micro_batches, continuous=cfg.continuous,
                comm=comm, evaluate=lambda m: task.evaluate(m, data), on_batch=on_batch,
                on_epoch=on_epoch, on_update=on_update, **cfg.method_options)
        finally:
            bar.close()
            if log_file:
                log_file.close()
        if writer:
            summary = summarize_run(cfg, task, data, result, started=started, out_dir=out)
            summary["runtime"] = "distributed"
            summary["device"] = str(dev) if device == "cuda" else "cpu"
            if out is not None:
                (out / "summary.json").write_text(_dumps(summary, indent=2))
            if json:
                print(_dumps(summary, indent=2), flush=True)
            else:
                print(f"final {summary['metric']}: {summary['final_metric']:.4f} (best "
                      f"{summary['best_metric']:.4f}), final loss {summary['final_loss']:.4f}, "
                      f"{summary['samples_per_second']:.0f} samples/s, weight copies per stage "
                      f"{summary['weight_copies']}", flush=True)
                print(f"run folder: {out}", flush=True)
        dist.barrier(group=comm.control)
        return 0
    except PipelineCommError as error:
        print(f"pipeoptim train: rank {rank}: error: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group cannot always be torn down cleanly
            pass


def _dumps(obj: Any, **kwargs: Any) -> str:
    import json as _json

    return _json.dumps(obj, **kwargs)


def main(argv: Optional[List[str]] = None) -> int:
    """Worker entry of a local launch: ``python -m pipeoptim.runtime.launch RUN.json``."""
    from ..experiment import RunConfig
    from ..tasks import MissingDataError

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m pipeoptim.runtime.launch RUN.json (started by `pipeoptim train "
              "--runtime distributed`)", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    if spec.get("kind") == "bench":
        from ..cli.bench import bench_worker

        return bench_worker(spec)
    cfg = RunConfig(**spec["config"])
    try:
        return worker(cfg, out=Path(spec["out"]) if spec["out"] else None, timeout=spec["timeout"],
                      device=spec["device"], threads=spec["threads"], json=spec["json"],
                      progress=spec["progress"])
    except (ValueError, MissingDataError) as error:
        if os.environ.get("PIPEOPTIM_DEBUG"):
            raise
        print(f"pipeoptim train: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
