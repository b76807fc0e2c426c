"""What `pipeoptim.Pipeline` costs against the plain PyTorch loop a user would write, and whether
its memory grows with the data set (issue 12's benchmark).

Time: on the full 60,000 Fashion-MNIST images, one epoch of (a) the plain loop (a `DataLoader`
over tensors, the model, momentum SGD, a warm-up + cosine `LambdaLR`, clipping), (b)
`Pipeline(method="sequential")` on the same model, loader, optimizer and scheduler, and (c)
`Pipeline(method="pipeoptim", stages=4)`; rounds interleaved (a, b, c, a, b, c, ...), one compute
thread, each round's ratio to its own plain loop; the median and spread over rounds are reported
(targets: sequential <= 1.05x, pipeoptim <= 1.15x).

Memory: in a fresh process per size, the peak resident memory during one epoch of
`Pipeline(method="pipeoptim", stages=4)` (sampled every 5 ms) minus the bytes of the data set's own
tensors, at 10,000 and at 60,000 images (target: the 60,000 figure within 10% of the 10,000 one,
i.e. the loader is streamed, not materialised).

    .venv/bin/python -m benchmarks.pipeline_overhead [--rounds 3] [--limit 60000] [--model vgg]

Writes benchmarks/results/pipeline_overhead.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pipeoptim
from pipeoptim.lab.tasks.image import build_image_model, load_arrays

RESULTS = Path(__file__).resolve().parent / "results" / "pipeline_overhead.json"
BATCH, LR, CLIP = 64, 0.01, 5.0


def dataset(limit: int) -> TensorDataset:
    data = load_arrays()
    x = torch.tensor(data.train_images[:limit], dtype=torch.float32).unsqueeze(1) / 255
    return TensorDataset((x - data.mean) / data.std, torch.tensor(data.train_labels[:limit], dtype=torch.long))


def loader(ds: TensorDataset) -> DataLoader:
    return DataLoader(ds, batch_size=BATCH, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(0))


def schedule_factory(total: int):
    warmup = max(1, total // 20)
    multiplier = lambda s: (s + 1) / warmup if s < warmup else \
        0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup)))  # noqa: E731
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, multiplier)


def optimizer_factory(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def plain_epoch(model: nn.Sequential, train: DataLoader) -> float:
    """The loop a user writes."""
    model = model.train()
    opt = optimizer_factory(model.parameters())
    sched = schedule_factory(len(train))(opt)
    start = time.perf_counter()
    for x, y in train:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the user reads the loss, as the Pipeline does
    return time.perf_counter() - start


def pipeline_epoch(model: nn.Sequential, train: DataLoader, method: str, stages: int) -> float:
    pipe = pipeoptim.Pipeline(model, method=method, stages=None if method == "sequential" else stages,
                              loss_fn=nn.functional.cross_entropy, optimizer=optimizer_factory,
                              lr_scheduler=schedule_factory(len(train)), clip_grad_norm=CLIP)
    start = time.perf_counter()
    pipe.fit(train)
    return time.perf_counter() - start


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_probe(limit: int, model_name: str, stages: int) -> dict:
    """Runs in its own process: peak RSS of one pipeoptim epoch, and the data tensors' bytes."""
    torch.set_num_threads(1)
    ds = dataset(limit)
    data_bytes = sum(t.numel() * t.element_size() for t in ds.tensors)
    model = build_image_model(model_name, seed=0)
    before = rss_bytes()
    peak, stop = [before], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.005)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    pipeline_epoch(model, loader(ds), "pipeoptim", stages)
    stop.set()
    sampler.join()
    return {"images": limit, "data_bytes": data_bytes, "rss_before_epoch": before, "peak_rss": peak[0],
            "peak_minus_data": peak[0] - data_bytes, "growth_during_epoch": peak[0] - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit", type=int, default=60_000)
    parser.add_argument("--small", type=int, default=10_000, help="images of the memory comparison's small run")
    parser.add_argument("--model", default="vgg")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--probe", type=int, help=argparse.SUPPRESS)  # internal: one memory probe
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(memory_probe(args.probe, args.model, args.stages)))
        return
    torch.set_num_threads(1)
    report = {"model": args.model, "stages": args.stages, "batch_size": BATCH, "threads": 1,
              "host": os.uname().nodename}
    if not args.skip_time:
        ds = dataset(args.limit)
        train = loader(ds)
        kinds = ["plain", "sequential", "pipeoptim"]
        warm = loader(torch.utils.data.Subset(ds, range(min(len(ds), 20 * BATCH))))
        for kind in kinds:  # untimed: first-call costs (allocator, kernels) out of round 1
            model = build_image_model(args.model, seed=0)
            plain_epoch(model, warm) if kind == "plain" else pipeline_epoch(model, warm, kind, args.stages)
        seconds = {k: [] for k in kinds}
        for r in range(args.rounds):
            for kind in kinds:
                model = build_image_model(args.model, seed=0)
                t = plain_epoch(model, train) if kind == "plain" else \
                    pipeline_epoch(model, train, kind, args.stages)
                seconds[kind].append(t)
                print(f"round {r + 1}/{args.rounds} {kind:>10}: {t:.2f} s", file=sys.stderr, flush=True)
        ratios = {k: [s / p for s, p in zip(seconds[k], seconds["plain"])] for k in kinds[1:]}
        report["time"] = {
            "images": args.limit, "rounds": args.rounds, "epoch_seconds": seconds,
            "ratio_per_round": ratios,
            "median_ratio": {k: statistics.median(v) for k, v in ratios.items()},
            "ratio_range": {k: [min(v), max(v)] for k, v in ratios.items()},
            "targets": {"sequential": 1.05, "pipeoptim": 1.15}}
        for k in kinds[1:]:
            print(f"{k:>10} / plain loop: median {report['time']['median_ratio'][k]:.3f} "
                  f"(rounds {', '.join(f'{x:.3f}' for x in ratios[k])})")
    probes = []
    for limit in (args.small, args.limit):
        done = subprocess.run([sys.executable, __file__, "--probe", str(limit), "--model", args.model,
                               "--stages", str(args.stages)], capture_output=True, text=True, check=True)
        probes.append(json.loads(done.stdout))
    ratio = probes[1]["peak_minus_data"] / probes[0]["peak_minus_data"]
    report["memory"] = {"probes": probes, "ratio_large_to_small": ratio, "target": 1.10}
    for p in probes:
        print(f"memory at {p['images']:>6} images: peak RSS {p['peak_rss'] / 2**20:.0f} MiB, data "
              f"{p['data_bytes'] / 2**20:.0f} MiB, peak minus data {p['peak_minus_data'] / 2**20:.0f} MiB")
    print(f"peak minus data, {args.limit} / {args.small} images: {ratio:.3f} (target <= 1.10)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
