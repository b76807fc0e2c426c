"""Issue 26's two figures, from committed JSON (``plot`` regenerates them without measuring):

* ``docs/bubble.png``: the bubble (idle share of the processes' time) of 1f1b-flush, zb-h1 and
  interleaved (V = 2) at N = 2 and 4, M = 4, simulated and measured side by side. Simulated:
  the schedule simulator with the per-pass times that the N = 2 run measured (the blocks model
  has the same 4 blocks per stage at any N, so stage costs do not depend on N; interleaved's
  pieces are half a stage, zb-h1's weight half is half the backward). Measured:
  ``pipeoptim bench`` on the distributed runtime at N = 2 (2 processes, one thread each), the
  bubble being 1 - (compute time of all stages) / (N x wall time), per mini-batch, median round.
  N = 4 is simulated only: 4 processes on this machine's 2 cores would measure the sharing of
  cores, not the schedule.
* ``docs/memory.png``: per stage, the peak of activations held with and without activation
  recomputation (``pipeoptim bench --ablate recompute``, gpipe and 1f1b-flush, N = 2, M = 4,
  micro-batches of 64), measured from the tensors each stage keeps beside the prediction (the
  simulator's micro-batches in flight x the profiled bytes of one micro-batch).

    PYTHONPATH=src .venv/bin/python -m benchmarks.issue26_figures measure   # ~2 minutes, a quiet machine
    PYTHONPATH=src .venv/bin/python -m benchmarks.issue26_figures plot
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "issue26_figures.json"
METHODS = ["1f1b-flush", "zb-h1", "interleaved"]
SCHEDULE = {"1f1b-flush": "1f1b-flush", "zb-h1": "zb-h1", "interleaved": "interleaved-1f1b"}
M = 4


def bench(args: List[str]) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", "pipeoptim", "bench", "--synthetic", "--no-baselines", "--json",
               "--optimizer", "momentum", "--out", str(out), *args]  # SGD momentum, as the figures were made
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def measured_bubble(detail: Dict[str, Any], stages: int) -> float:
    """1 - compute of all stages / (processes x wall), per mini-batch (the median round)."""
    compute = sum(s["compute"] for s in detail["profile_ms_per_batch"])
    return 1.0 - compute / (stages * detail["ms_per_batch"])


def simulated_bubble(method: str, stages: int, stage_ms: Dict[str, float]) -> float:
    """The simulator's bubble of ``method`` on ``stages`` equal stages of the measured costs."""
    from pipeoptim.schedules import Costs, build_schedule, simulate

    f, b, u = stage_ms["F"], stage_ms["B"], stage_ms["U"]
    if method == "interleaved":
        costs = Costs.uniform(2 * stages, f / 2, b / 2, update=u / 2)
    else:
        costs = Costs.uniform(stages, f, b, update=u)
    return simulate(build_schedule(SCHEDULE[method], stages, M, 2), costs).bubble_fraction


def measure(args: argparse.Namespace) -> int:
    timing = bench(["--stages", "2", "--micro-batches", str(M), "--methods", ",".join(METHODS),
                    "--batches", str(args.batches), "--warmup", "2", "--repeats", str(args.repeats)])
    stage_ms = {k: sum(s[k] for s in timing["detail"]["1f1b-flush"]["stage_ms"]) / 2 for k in ("F", "B", "U")}
    bubble = {m: {"measured_n2": measured_bubble(timing["detail"][m], 2),
                  "simulated_n2": simulated_bubble(m, 2, stage_ms),
                  "simulated_n4": simulated_bubble(m, 4, stage_ms)} for m in METHODS}
    memory_run = bench(["--stages", "2", "--micro-batches", str(M), "--methods", "gpipe,1f1b-flush",
                        "--ablate", "recompute", "--batch-size", "256", "--batches", "2", "--warmup", "0",
                        "--repeats", "1"])
    memory = {name: d["activations"] for name, d in memory_run["detail"].items()}
    result = {"bubble": bubble, "stage_ms_mean": stage_ms, "memory": memory,
              "settings": {"bench_timing": timing["settings"], "bench_memory": memory_run["settings"],
                           "load_average": timing["load_average"], "other_work": timing.get("other_work"),
                           "microbatches": M}}
    RESULTS.write_text(json.dumps(result, indent=2))
    print(json.dumps(bubble, indent=2))
    return 0


def plot(args: argparse.Namespace) -> int:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(RESULTS.read_text())
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bars = [("simulated_n2", "N = 2 simulated"), ("measured_n2", "N = 2 measured (2 processes)"),
            ("simulated_n4", "N = 4 simulated")]
    width = 0.26
    for j, (key, label) in enumerate(bars):
        values = [data["bubble"][m][key] for m in METHODS]
        ax.bar([i + (j - 1) * width for i in range(len(METHODS))], values, width, label=label)
    ax.set_xticks(range(len(METHODS)), ["1f1b-flush", "zb-h1", "interleaved (V = 2)"])
    ax.set_ylabel("bubble (idle share)")
    ax.set_title(f"The bubble zb-h1 and interleaved remove, M = {M} (blocks model)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "bubble.png", dpi=110)

    fig, ax = plt.subplots(figsize=(9, 4))
    names = list(data["memory"])
    labels, measured, predicted = [], [], []
    for name in names:
        for k, row in enumerate(data["memory"][name]):
            labels.append(name.replace("+recompute", "\n+recompute") + f"\nstage {k}")
            measured.append(row["measured_bytes"] / 2 ** 20)
            predicted.append(row.get("predicted_bytes", 0) / 2 ** 20)
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], measured, 0.4, label="measured (tensors kept)")
    ax.bar([x + 0.2 for x in xs], predicted, 0.4, label="predicted (in flight x bytes per micro-batch)")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("peak activations held (MiB)")
    ax.set_title(f"Activation memory with and without recomputation, N = 2, M = {M}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "memory.png", dpi=110)
    print("wrote docs/bubble.png, docs/memory.png")
    return 0


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="run pipeoptim bench, write the JSON")
    m.add_argument("--batches", type=int, default=16, help="timed mini-batches per run (default 16)")
    m.add_argument("--repeats", type=int, default=5, help="rounds (default 5)")
    m.set_defaults(func=measure)
    sub.add_parser("plot", help="the figures from the JSON").set_defaults(func=plot)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
