"""The planner's predictions against `pipeoptim bench`'s measurements of the same split (issue 49,
finding 9): one table per run, a row per method (grouped by family: flushed 1F1B, zero bubble,
chunked, mirrored, asynchronous), its predicted and measured samples/s and their ratio, beside the
same ratio for the sequential reference (`plan`'s whole model as one stage against `bench`'s
``sequential-1dev``): what a process of its own and the machine cost every method alike, so that a
family whose ratio stands above the reference's is one the planner's cost model over-predicts.

Both commands run on the same task model, stages, partitioner, batch size, micro-batch count,
optimizer and one compute thread per stage (``plan --threads 1``; ``bench`` runs one process per
stage with one thread), ``--rounds`` times in turns (plan, bench, plan, ...); each side's median
over the rounds is compared.

    .venv/bin/python -m benchmarks.plan_vs_bench [--model resnet] [--stages 2] [--micro-batches 4]
        [--bandwidth 1e9]   # plan's links priced (transfers, a mirrored method's replica sums)

Writes benchmarks/results/plan_vs_bench.json (the rounds' raw numbers and the table)."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

FAMILIES = {"flushed 1F1B": ["gpipe", "1f1b-flush"], "zero bubble": ["zb-h1"], "chunked": ["interleaved", "zb-v"],
            "mirrored": ["bidirectional", "bitpipe"], "asynchronous": ["pipedream", "pipedream-2bw", "pipeoptim"]}


def run_json(argv: List[str], out: Path) -> Dict[str, Any]:
    """``python -m pipeoptim ARGV --json --out OUT``'s JSON (its progress on stderr)."""
    done = subprocess.run([sys.executable, "-m", "pipeoptim", *argv, "--json", "--out", str(out)], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, check=True)
    return json.loads(done.stdout)


def compare(plans: List[Dict[str, Any]], benches: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The table's rows: per method, the medians over the rounds of predicted and measured samples/s."""
    def median(values: List[float]) -> float:
        return float(statistics.median(values))

    predicted = {c["method"]: median([next(x["samples_per_second"] for x in p["candidates"]
                                           if x["method"] == c["method"]) for p in plans])
                 for c in plans[0]["candidates"]}
    measured = {m: median([b["samples_per_second"][m] for b in benches]) for m in benches[0]["samples_per_second"]}
    reference = median([p["reference"]["samples_per_second"] for p in plans]) / measured["sequential-1dev"]
    rows = [{"family": "reference", "method": "sequential (one process)", "predicted": predicted.get("sequential")
             or median([p["reference"]["samples_per_second"] for p in plans]),
             "measured": measured["sequential-1dev"], "ratio": reference, "against_reference": 1.0}]
    for family, methods in FAMILIES.items():
        for method in methods:
            if method in predicted and method in measured:
                ratio = predicted[method] / measured[method]
                rows.append({"family": family, "method": method, "predicted": predicted[method],
                             "measured": measured[method], "ratio": ratio, "against_reference": ratio / reference})
    return rows


def table(rows: List[Dict[str, Any]]) -> str:
    lines = ["family         method                     predicted  measured  ratio  ratio / reference's",
             "-------------  -------------------------  ---------  --------  -----  -------------------"]
    for r in rows:
        lines.append(f"{r['family']:<13}  {r['method']:<25}  {r['predicted']:>9.0f}  {r['measured']:>8.0f}  "
                     f"{r['ratio']:>5.2f}  {r['against_reference']:>19.2f}")
    return "\n".join(lines)


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="image")
    parser.add_argument("--model", default="resnet", help="a model of the task (default: resnet)")
    parser.add_argument("--stages", type=int, default=2, help="processes (default: 2)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per mini-batch (default: 4)")
    parser.add_argument("--partitioner", default="uniform", choices=["uniform", "params"])
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--batches", type=int, default=16, help="mini-batches per bench run and per prediction")
    parser.add_argument("--rounds", type=int, default=1, help="plan and bench, in turns (default: 1)")
    parser.add_argument("--methods", default=",".join(m for ms in FAMILIES.values() for m in ms))
    parser.add_argument("--bandwidth", default=None,
                        help="plan's --bandwidth, bytes/s of a link (transfers and a mirrored method's replica sums "
                             "priced; default: plan's, unpriced)")
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_vs_bench.json")
    args = parser.parse_args(argv)
    same = ["--task", args.task, "--model", args.model, "--stages", str(args.stages), "--partitioner",
            args.partitioner, "--micro-batches", str(args.micro_batches), "--methods", args.methods,
            "--batches", str(args.batches), "--optimizer", args.optimizer]
    plans, benches = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            print(f"round {r + 1}: plan", file=sys.stderr, flush=True)
            priced = ["--bandwidth", args.bandwidth] if args.bandwidth else []
            plans.append(run_json(["plan", *same, "--threads", "1", "--limit", "256", *priced], Path(tmp) / "plan.json"))
            print(f"round {r + 1}: bench", file=sys.stderr, flush=True)
            benches.append(run_json(["bench", *same, "--repeats", "3", "--synthetic"], Path(tmp) / "bench.json"))
    rows = compare(plans, benches)
    split = benches[0]["settings"]
    print(f"{args.task} / {args.model}, {args.stages} processes, M = {args.micro_batches}, partition "
          f"{split['partition']}, batch {split['batch_size']}, {args.rounds} round(s)")
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)}, "rows": rows,
                                    "plans": [{"reference": p["reference"], "measurement": p["measurement"],
                                               "candidates": [{k: c[k] for k in ("method", "microbatches",
                                                                                 "partition", "samples_per_second",
                                                                                 "speedup", "reachable")}
                                                              for c in p["candidates"]]} for p in plans],
                                    "benches": [b["samples_per_second"] for b in benches]}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
