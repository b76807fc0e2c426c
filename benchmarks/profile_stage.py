"""cProfile of a stage process of the distributed executor (issue 14, item 2): 2 processes
(gloo, one thread each), the ``blocks`` model of ``pipeoptim bench``, batch 512, split [4, 5],
momentum SGD, as in ``benchmarks/peer_throughput.py``. For each run (``ours gpipe M=2`` and
``ours pipeoptim`` by default), every rank trains one warm-up mini-batch, then profiles
``--fits`` fits of ``--batches`` mini-batches and writes ``OUT/<run>-r<rank>.prof`` with the top
25 entries by tottime and by cumtime beside it (``.txt``), and a line of how much of the
process time is spent in pipeoptim's own Python functions (tottime under ``pipeoptim/``).

    PYTHONPATH=src .venv/bin/python -m benchmarks.profile_stage [--out /tmp/pipeoptim-profile]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

RUNS = {"gpipe": ("gpipe", 2), "pipeoptim": ("pipeoptim", None), "1f1b-flush": ("1f1b-flush", 2)}


def ours_share(stats: pstats.Stats) -> str:
    entries = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in entries.values())
    ours = sum(v[2] for k, v in entries.items() if f"{os.sep}pipeoptim{os.sep}" in k[0])
    return f"tottime in pipeoptim/: {ours * 1000:.1f} ms of {total:.3f} s ({100 * ours / total:.1f}%)"


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch import nn

    from pipeoptim.lab.bench_worker import blocks_model
    from pipeoptim.lab.optimizers import make_optimizer
    from pipeoptim.pipeline import Pipeline
    from pipeoptim.runtime.control import init_process_group

    init_process_group(device="cpu", timeout=120.0, threads=1)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(512, 1, 28, 28, generator=g), torch.randint(0, 10, (512,), generator=g))
            for _ in range(1 + args.batches)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.runs:
        method, micro = RUNS[name]
        pipeline = Pipeline(blocks_model(2), method=method, loss_fn=nn.functional.cross_entropy,
                            optimizer=make_optimizer("momentum", 0.01), stages=2, partition=[4, 5],
                            micro_batches=micro, devices="cpu", timeout=120.0, threads=1)
        pipeline.fit(data[:1])
        dist.barrier()
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        for _ in range(args.fits):
            pipeline.fit(data[1:])
        profile.disable()
        dist.barrier()
        seconds = time.perf_counter() - start
        path = out / f"{name}-r{rank}"
        profile.dump_stats(str(path) + ".prof")
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        text.write(f"{name}, rank {rank}: {seconds:.3f} s, "
                   f"{args.fits * args.batches * 512 / seconds:.0f} samples/s (profiled); {ours_share(stats)}\n")
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumtime").print_stats(25)
        path.with_suffix(".txt").write_text(text.getvalue())
        print(text.getvalue().splitlines()[0], flush=True)
    dist.destroy_process_group()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/pipeoptim-profile", help="folder of the .prof/.txt files")
    parser.add_argument("--runs", nargs="+", default=["gpipe", "pipeoptim"], choices=sorted(RUNS))
    parser.add_argument("--batches", type=int, default=16, help="mini-batches per profiled fit")
    parser.add_argument("--fits", type=int, default=2, help="profiled fits per run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).resolve()), "--worker", "--out", args.out, "--runs", *args.runs,
           "--batches", str(args.batches), "--fits", str(args.fits)]
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
