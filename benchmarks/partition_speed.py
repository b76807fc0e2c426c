"""What the `time` partitioner buys: per-stage balance and 2-stage pipeline throughput of the
uniform, params and time splits of a model with deliberately unequal layers, and how close the
planner's predicted throughput is to the measured one (target: within 20%).

The model: six 3x3 conv blocks on 16x16 and 8x8 maps (much compute, few parameters) followed
by five 512-wide linear blocks (little compute, most parameters) and a classifier: 12 units.
`uniform` (6 | 6 units) puts all convolutions on stage 0; `params` balances parameters, which
puts even more compute on stage 0; `time` balances the profiled forward+backward time.

For each split the benchmark

* profiles the model (pipeoptim.profile, 1 thread, the same batch), splits it, times each
  split's stages as the runtime runs them (pipeoptim.stage_timing.measure_stages), and predicts the
  pipeline's throughput with pipeoptim.throughput.predict from those stage times, as
  `pipeoptim plan` does (the schedule simulator; no transfer cost unless --bandwidth); the
  prediction from the per-layer profile alone (`--stage-timing profile`) is reported too;
* measures it with the distributed runtime (pipeoptim.Pipeline, one stage per process):
  2 processes (one per stage, 1 thread each, gloo on 127.0.0.1), the same method, data and
  partition; --epochs epochs per launch, the first dropped as warm-up. On a shared machine the
  other processes' CPU use is read from /proc for every epoch (all CPU time minus our two
  processes'); the headline is the median of the *quiet* epochs (others under
  --quiet-threshold of the machine), launches repeat (the splits interleaved) until each split
  has --quiet-epochs of them or --budget seconds have passed; all epochs stay in the JSON;
* also runs the local runtime (all stages in one process, one after another) and simulates the
  schedule with the per-stage times it measured: the "time-sliced" estimate, which needs no
  second process.

Writes benchmarks/results/partition_speed.json.

    .venv/bin/python -m benchmarks.partition_speed [--batches 60] [--batch-size 32] [--rounds 2]
        [--epochs 4] [--methods pipeoptim] [--quiet-wait 60] [--bandwidth BYTES_PER_S] [--no-distributed]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn

import pipeoptim
from pipeoptim.lab.optimizers import make_optimizer
from pipeoptim.partition import plan_partition, plan_time_partition
from pipeoptim.throughput import describe_partition, predict
from pipeoptim.profile import format_profile, profile_model
from pipeoptim.stage_timing import measure_stages
from pipeoptim.schedules import Costs, simulate

LR = 0.01


def block(c_in: int, c_out: int, pool: bool = False) -> nn.Sequential:
    layers: List[nn.Module] = [nn.MaxPool2d(2)] if pool else []
    return nn.Sequential(*layers, nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU())


def fc(a: int, b: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(a, b), nn.ReLU())


def build_model(seed: int = 0) -> nn.Sequential:
    """Convolutions first (compute-heavy, parameter-light), wide linear layers after."""
    torch.manual_seed(seed)
    return nn.Sequential(
        block(3, 32), block(32, 32), block(32, 32),                 # 32 x 16 x 16
        block(32, 64, pool=True), block(64, 64), block(64, 64),     # 64 x 8 x 8
        nn.Sequential(nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 4 * 4, 512), nn.ReLU()),
        fc(512, 512), fc(512, 512), fc(512, 512), fc(512, 512),
        nn.Linear(512, 10),
    )


def make_batches(count: int, size: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(count, size, 3, 16, 16, generator=g)
    ys = torch.randint(0, 10, (count, size), generator=g)
    return [(xs[i], ys[i]) for i in range(count)]


def cpu_jiffies() -> Optional[List[int]]:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat (None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return [sum(values) - idle, sum(values)]


def others_share(before: Optional[List[int]], after: Optional[List[int]], own_cpu_seconds: float) -> Optional[float]:
    """Cores' worth of CPU that other processes used between two /proc/stat readings, as a share
    of the machine (0: we had it alone; 0.5: others took half of all cores)."""
    if before is None or after is None or after[1] == before[1]:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    total = (after[1] - before[1]) / ticks          # CPU-seconds available on all cores
    busy = (after[0] - before[0]) / ticks
    return max(0.0, (busy - own_cpu_seconds) / total)


def wait_for_quiet(max_wait: float, threshold: float = 0.25) -> Optional[float]:
    """Wait (at most ``max_wait`` s) until other processes use less than ``threshold`` of the
    machine over one second; returns the last share seen."""
    deadline = time.time() + max_wait
    while True:
        a = cpu_jiffies()
        time.sleep(1.0)
        share = others_share(a, cpu_jiffies(), 0.0)
        if share is None or share < threshold or time.time() >= deadline:
            return share


def load_average() -> List[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


# -- measured: distributed runtime, 2 processes --------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _worker(rank: int, world: int, port: int, model, batches, method: str, sizes, micro: int, epochs: int,
            out: str) -> None:
    from pipeoptim.runtime.control import init_process_group
    import torch.distributed as dist

    init_process_group(device="cpu", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                       threads=1, timeout=120)
    try:
        pids: List[Any] = [None] * world
        dist.all_gather_object(pids, os.getpid())
        shares: List[Optional[float]] = []
        mark = {"jiffies": cpu_jiffies(), "own": sum(proc_cpu_seconds(p) for p in pids)}

        def on_epoch(epoch: int, entry: Dict[str, Any]) -> None:
            # after each epoch: what other processes took from the machine meanwhile
            jiffies, own = cpu_jiffies(), sum(proc_cpu_seconds(p) for p in pids)
            shares.append(others_share(mark["jiffies"], jiffies, own - mark["own"]))
            mark.update(jiffies=jiffies, own=own)

        dist.barrier()
        mark.update(jiffies=cpu_jiffies(), own=sum(proc_cpu_seconds(p) for p in pids))
        with pipeoptim.Pipeline(model, method=method, optimizer=make_optimizer("momentum", LR),
                                loss_fn=nn.functional.cross_entropy, partition=list(sizes),
                                micro_batches=micro, timeout=120) as pipe:
            result = pipe.fit(batches, epochs, on_epoch=on_epoch)
        if rank == 0:
            for entry, share in zip(result.metrics["epochs"], shares):
                entry["others_cpu_share"] = share
            Path(out).write_text(json.dumps({
                "epochs": result.metrics["epochs"], "stage_seconds": result.metrics["stage_seconds"],
                "losses": result.losses}))
    finally:
        dist.destroy_process_group()


def measure_distributed(model, batches, method: str, sizes, micro: int, epochs: int) -> Dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(len(sizes), _free_port(), model, batches, method, list(sizes), micro, epochs, out),
                 nprocs=len(sizes), join=True)
        return json.loads(Path(out).read_text())


# -- measured: local runtime, and the time-sliced estimate --------------------------------------------

def measure_local(model, batches, method: str, sizes, micro: int, epochs: int) -> Dict[str, Any]:
    result = pipeoptim.train(model, batches, method=method, partition=list(sizes), micro_batches=micro,
                             optimizer=make_optimizer("momentum", LR), loss_fn=nn.functional.cross_entropy,
                             epochs=epochs)
    times = result.metrics["stage_seconds"]
    n = len(sizes)
    costs = Costs([t["F"] for t in times], [t["B"] for t in times], [0.0] * n,
                  update=max(t["U"] for t in times))
    schedule = pipeoptim.get_method(method).build_schedule(n, result.metrics["microbatches"], len(batches))
    makespan = simulate(schedule, costs).makespan
    samples = sum(int(x.shape[0]) for x, _ in batches)
    return {"samples_per_second": statistics.median(e["samples_per_second"] for e in result.metrics["epochs"][1:]
                                                    or result.metrics["epochs"]),
            "stage_seconds": times, "time_sliced_samples_per_second": samples / makespan}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=60, help="mini-batches per epoch (default 60)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=4, help="epochs per launch, the first dropped (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="launches per split (default 2)")
    parser.add_argument("--methods", default="pipeoptim", help="comma-separated (default pipeoptim)")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--bandwidth", type=float, help="bytes/s of the link in the prediction (default: free)")
    parser.add_argument("--repeats", type=int, default=11, help="profile repeats per layer (default 11)")
    parser.add_argument("--quiet-wait", type=float, default=30.0,
                        help="before each launch wait up to this many seconds for a quiet machine (default 30)")
    parser.add_argument("--quiet-threshold", type=float, default=0.10,
                        help="an epoch is quiet when other processes used less than this share of all CPUs "
                             "(default 0.10)")
    parser.add_argument("--quiet-epochs", type=int, default=4,
                        help="quiet epochs wanted per split; launches repeat until then (default 4)")
    parser.add_argument("--budget", type=float, default=900.0,
                        help="seconds to keep launching for quiet epochs (default 900)")
    parser.add_argument("--no-distributed", action="store_true", help="skip the 2-process measurement")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "partition_speed.json")
    args = parser.parse_args()
    torch.set_num_threads(1)

    model = build_model()
    batches = make_batches(args.batches, args.batch_size)
    x, y = batches[0]
    load_before = load_average()
    # the profile and the stage timings are taken again (within a third of the budget) while
    # other processes took CPU during them
    quiet_deadline = time.time() + args.budget / 3
    attempts: Dict[str, int] = {}

    def quietly(label: str, fn):
        while True:
            wait_for_quiet(args.quiet_wait, args.quiet_threshold)
            jiffies, own = cpu_jiffies(), time.process_time()
            result = fn()
            share = others_share(jiffies, cpu_jiffies(), time.process_time() - own)
            attempts[label] = attempts.get(label, 0) + 1
            if share is None or share < args.quiet_threshold or time.time() > quiet_deadline:
                return result, share
            print(f"{label}: other processes used {share:.0%} of the CPUs; again", flush=True)

    profile, profile_quiet = quietly("profile", lambda: profile_model(
        model, x, warmup=3, repeats=args.repeats, loss_fn=nn.functional.cross_entropy, target=y,
        optimizer=make_optimizer("momentum", LR), optimizer_name="momentum"))
    print(format_profile(profile))
    costs = profile.layer_costs()
    splits = {"uniform": plan_partition(model, 2, "uniform"), "params": plan_partition(model, 2, "params"),
              "time": plan_time_partition(model, 2, costs, None, profile.boundary_bytes(), args.bandwidth)}
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]

    report: Dict[str, Any] = {
        "benchmark": "partition_speed", "stages": 2, "batches": args.batches, "batch_size": args.batch_size,
        "epochs_per_launch": args.epochs, "rounds": args.rounds, "threads_per_process": 1,
        "micro_batches": args.micro_batches, "bandwidth": args.bandwidth, "cpu_count": os.cpu_count(),
        "quiet_threshold": args.quiet_threshold,
        "torch": torch.__version__, "load_average_before": load_before,
        "others_cpu_share_during_profile": profile_quiet, "attempts": attempts,
        "profile": profile.to_dict(), "splits": {}, "runs": {},
    }
    # each split's stages timed as the runtime runs them (what `pipeoptim plan` predicts from)
    timings = {}

    def stage_timing(sizes):
        return measure_stages(model, sizes, x, y, nn.functional.cross_entropy,
                              optimizer=make_optimizer("momentum", LR), warmup=3, repeats=args.repeats)

    for how, sizes in splits.items():
        timings[how], share = quietly(f"stage timing {how}", lambda: stage_timing(sizes))
        report["splits"][how] = describe_partition(profile, sizes, None, args.bandwidth)
        report["splits"][how]["measured_stage_seconds"] = [f + b for f, b in zip(timings[how]["forward"],
                                                                                 timings[how]["backward"])]
        report["splits"][how]["measured_stage_timing"] = timings[how]
        report["splits"][how]["others_cpu_share_during_timing"] = share
    reference = predict("sequential", profile, [len(model)], microbatches=1, batches=args.batches,
                        batch_size=args.batch_size,
                        measured=quietly("stage timing sequential", lambda: stage_timing([len(model)]))[0])
    report["predicted_sequential_samples_per_second"] = reference["samples_per_second"]

    distributed_error: Optional[str] = None
    # per method and split: every measured epoch (the first of each launch dropped) with the
    # share of the CPUs other processes used meanwhile; launches repeat until each split has
    # --quiet-epochs epochs under --quiet-threshold, or --budget seconds have passed
    epochs_of: Dict[str, Dict[str, List[Dict[str, Any]]]] = {m: {h: [] for h in splits} for m in methods}
    stage_seconds_of: Dict[str, Dict[str, List[Any]]] = {m: {h: [] for h in splits} for m in methods}
    launches = 0

    def quiet(entries):
        return [e for e in entries if e.get("others_cpu_share") is not None
                and e["others_cpu_share"] < args.quiet_threshold]

    if not args.no_distributed:
        try:
            from pipeoptim.runtime.distributed import DistributedExecutor  # noqa: F401
        except Exception as error:  # the runtime is not there (yet)
            distributed_error = f"import failed: {error}"
        deadline = time.time() + args.budget
        r = 0
        while distributed_error is None and (r < args.rounds or time.time() < deadline):
            lacking = [(m, h) for m in methods for h in splits if len(quiet(epochs_of[m][h])) < args.quiet_epochs]
            if r >= args.rounds and not lacking:
                break
            for method in methods:
                for how, sizes in splits.items():
                    if r >= args.rounds and (method, how) not in lacking:
                        continue
                    wait_for_quiet(min(args.quiet_wait, max(0.0, deadline - time.time())), args.quiet_threshold)
                    try:
                        res = measure_distributed(model, batches, method, sizes, args.micro_batches, args.epochs)
                    except Exception as error:
                        distributed_error = f"{type(error).__name__}: {error}".splitlines()[0]
                        traceback.print_exc()
                        break
                    launches += 1
                    kept = res["epochs"][1:] or res["epochs"]
                    epochs_of[method][how] += kept
                    stage_seconds_of[method][how].append(res["stage_seconds"])
                    print(f"launch {launches} {method} {how} {sizes}: " + ", ".join(
                        f"{e['samples_per_second']:.0f} ({(e.get('others_cpu_share') or 0):.0%})" for e in kept)
                        + "  samples/s (others' CPU share)", flush=True)
                if distributed_error:
                    break
            r += 1

    wait_for_quiet(args.quiet_wait, args.quiet_threshold)
    local_seq = measure_local(model, batches, "sequential", [len(model)], 1, 2)
    report["measured_sequential_local_samples_per_second"] = local_seq["samples_per_second"]
    report["distributed"] = "used" if distributed_error is None and not args.no_distributed else (
        f"not used: {distributed_error or '--no-distributed'}")
    report["launches"] = launches
    for method in methods:
        rows = {}
        for how, sizes in splits.items():
            pred = predict(method, profile, sizes, microbatches=args.micro_batches, batches=args.batches,
                           batch_size=args.batch_size, bandwidth=args.bandwidth, measured=timings[how])
            wait_for_quiet(args.quiet_wait, args.quiet_threshold)
            local = measure_local(model, batches, method, sizes, args.micro_batches, 2)
            pred_raw = predict(method, profile, sizes, microbatches=args.micro_batches, batches=args.batches,
                               batch_size=args.batch_size, bandwidth=args.bandwidth)
            row: Dict[str, Any] = {
                "partition": sizes,
                "predicted_samples_per_second": pred["samples_per_second"],
                "predicted_from_profile_samples_per_second": pred_raw["samples_per_second"],
                "predicted_stage_seconds": [f + b for f, b in zip(pred["stage_forward_seconds"],
                                                                  pred["stage_backward_seconds"])],
                "local_samples_per_second": local["samples_per_second"],
                "local_stage_seconds": [t["F"] + t["B"] for t in local["stage_seconds"]],
                "time_sliced_samples_per_second": local["time_sliced_samples_per_second"],
            }
            entries = epochs_of[method][how]
            if entries:
                calm = quiet(entries)
                use = calm or entries
                row["measured_samples_per_second"] = statistics.median(e["samples_per_second"] for e in use)
                row["measured_quiet_epochs"] = len(calm)
                row["measured_all_epochs_median"] = statistics.median(e["samples_per_second"] for e in entries)
                row["measured_epochs"] = [{"samples_per_second": e["samples_per_second"],
                                           "others_cpu_share": e.get("others_cpu_share")} for e in entries]
                row["measured_stage_seconds"] = [statistics.median(st[k]["F"] + st[k]["B"]
                                                                   for st in stage_seconds_of[method][how])
                                                 for k in range(2)]
                row["predicted_over_measured"] = (row["predicted_samples_per_second"]
                                                  / row["measured_samples_per_second"])
                row["profile_predicted_over_measured"] = (row["predicted_from_profile_samples_per_second"]
                                                          / row["measured_samples_per_second"])
            row["time_sliced_over_predicted"] = (row["time_sliced_samples_per_second"]
                                                 / row["predicted_samples_per_second"])
            rows[how] = row
        report["runs"][method] = rows
    report["load_average_after"] = load_average()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))

    print(f"\n2 stages, {args.batches} mini-batches of {args.batch_size}, 1 thread per stage; "
          f"distributed runtime: {report['distributed']}")
    print(f"sequential: predicted {reference['samples_per_second']:.0f} samples/s, measured (local runtime) "
          f"{local_seq['samples_per_second']:.0f}")
    for how, s in report["splits"].items():
        print(f"{how:>8} {str(s['sizes']):<9} stage F+B ms: profiled "
              + " | ".join(f"{t * 1e3:.1f}" for t in s["stage_seconds"]) + f" (slowest/mean {s['imbalance']:.2f}),"
              + " measured " + " | ".join(f"{t * 1e3:.1f}" for t in s["measured_stage_seconds"]))
    for method, rows in report["runs"].items():
        print(f"\n{method}, samples/s: predicted (from profile)  measured (2 processes)  predicted/measured"
              f"  time-sliced (local)  local (1 process)")
        for how, row in rows.items():
            meas = row.get("measured_samples_per_second")
            ratio = row.get("predicted_over_measured")
            raw_ratio = row.get("profile_predicted_over_measured")
            print(f"{how:>8}  {row['predicted_samples_per_second']:9.0f} "
                  f"({row['predicted_from_profile_samples_per_second']:5.0f})  "
                  f"{(f'{meas:.0f}' if meas else '-'):>22}  "
                  f"{(f'{ratio:.2f} ({raw_ratio:.2f})' if ratio else '-'):>18}  "
                  f"{row['time_sliced_samples_per_second']:19.0f}  {row['local_samples_per_second']:17.0f}")
    for method, rows in report["runs"].items():
        for how, row in rows.items():
            if "measured_quiet_epochs" in row:
                print(f"{method} {how}: {row['measured_quiet_epochs']} quiet epochs of "
                      f"{len(row['measured_epochs'])} (median of all epochs {row['measured_all_epochs_median']:.0f})")
    print(f"load average before {load_before}, after {report['load_average_after']}")
    print(f"written: {args.out}")


if __name__ == "__main__":
    sys.exit(main())
