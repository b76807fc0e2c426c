"""What to run first on a machine with GPUs: the CUDA tests, then the distributed path, torchrun
jobs over NCCL (one GPU per process), training a tied GPT (a traced model, its head's weight the
embedding's) with every method family, a DCP checkpoint written and resumed, compiled stages,
bf16, sharded replicas and stages split over 2 tensor ranks, one table judged against
``sequential`` and one process. Without CUDA it says so in one line and exits 0.

    scripts/gpu_check.sh [--updates 8] [--rows a,b] [--json] [--out rows.json] [--require-all]
    python scripts/gpu_check.py --device cpu --size tiny --updates 3
        (the same jobs on the CPU: gloo, with NCCL's rules kept by PIPEOPTIM_STRICT_TRANSPORT=1)

The jobs: ``python -m torch.distributed.run --standalone --nproc-per-node P`` of
scripts/gpu_check_worker.py, one of 2 processes (2 stages) for every row but ``sharded`` and
``tensor``, one of 4 for them (2 stages x 2 replicas; 2 stages x 2 tensor ranks). Each job's
rank 0 then trains ``sequential``, the reference, in each precision, and each asynchronous row again, in its process alone (every stage on its
GPU: the table's ``python 1`` rows). With fewer GPUs than a job needs its rows are not run: NCCL
refuses two ranks on one GPU. With one GPU, every row runs in one process instead (python 1).

A row holds when all of these hold (:data:`TOLERANCES`, :data:`ASYNC_SHARE`):

- against ``sequential`` in the same precision. A synchronous method equals it up to rounding,
  mini-batch by mini-batch: its training losses and its loss after K updates (the trained model
  on a held-out mini-batch, fp32, plain torch) within a relative 1e-5 in fp32 (the tests hold
  1e-6 on the CPU; a GPU's kernels, chosen by shape, round the micro-batches' sums otherwise;
  and not to the bit even on the CPU: the tied gradient is summed over the holders' processes,
  by autograd in one process), 1e-4 compiled with inductor (its kernels fuse and reorder), 2e-3
  in bf16 (the tests' bf16 tolerance). An asynchronous method trains on stale or predicted
  weights by design: its loss after K holds when it closes at least half of the gap from the
  untrained model's loss to sequential's (|loss - sequential| <= 0.5 |initial - sequential|),
  the bound printed as a relative difference;
- to the bit, training losses and loss after K, where the runtime promises it: an asynchronous
  torchrun row (not sharded, not split over tensor ranks: their sums run in another order)
  against the same row in one process (the distributed runtime's
  promise, docs/architecture.md; on CUDA the worker asks torch for deterministic kernels), a
  checkpoint row (stopped, resumed from its checkpoint by a new Pipeline) against its
  uninterrupted run (the same checkpoints: an asynchronous method drains at each);
- the process group's backend is NCCL (gloo on the CPU), and the trained head is still the
  embedding.

Exit status: 0 when every row that ran holds (and the CUDA tests passed); 1 otherwise. A row
not run for want of GPUs is printed as such, with the reason, and does not count against exit 0:
the machine cannot check it, and the rows it can check are still judged (``--require-all``:
it counts, exit 1).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "scripts" / "gpu_check_worker.py"
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402

import gpu_check_worker as worker  # noqa: E402
import pipeoptim  # noqa: E402

#: relative tolerances of a synchronous row against sequential in the same precision, its loss of
#: each mini-batch and after K updates
TOLERANCES = {"fp32": 1e-5, "inductor": 1e-4, "bf16": 2e-3}
#: an asynchronous row: its loss after K updates closes at least this share of the gap from the
#: untrained model's loss to sequential's after K (|loss - sequential| <= share x |initial - sequential|)
ASYNC_SHARE = 0.5


def kind(row: Dict[str, Any]) -> str:
    """Which tolerance a row's comparisons take: asynchronous, bf16, inductor or fp32."""
    if not pipeoptim.get_method(row["method"]).synchronous:
        return "asynchronous"
    if row["precision"] == "bf16":
        return "bf16"
    if row["compiled"] not in (False, None, "aot_eager", "eager"):  # aot_eager, eager: torch's eager kernels
        return "inductor"
    return "fp32"


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


def judge(rows: List[Dict[str, Any]], backend: str) -> List[Dict[str, Any]]:
    """Every row with its verdict: ``holds`` (True, False, None: not run), ``against`` (the
    relative difference from sequential: a synchronous row's largest over its losses, an
    asynchronous one's of the loss after K) and ``bound`` (the most that holds), ``partner`` and
    ``same`` (a torchrun row compared to the bit: ``uninterrupted`` for a checkpoint row, ``1
    process`` for an asynchronous one; ``equal``, or the largest relative difference), ``why``
    (what failed). The sequential rows are the references, judged only for having run."""
    def key(r: Dict[str, Any]) -> Tuple:
        return r["method"], r["precision"], r["compiled"]

    alone = {key(r): r for r in rows if r.get("processes") == 1 and "loss" in r}
    sequential = {r["precision"]: r for r in rows if r["method"] == "sequential" and r.get("processes") == 1
                  and "loss" in r}
    out = []
    for row in map(dict, rows):
        why: List[str] = []
        if row.get("not_run"):
            row["holds"] = None
            out.append(row)
            continue
        if "error" in row:
            why.append(row["error"])
        elif row["method"] != "sequential":
            why += against_sequential(row, sequential.get(row["precision"]))
            if not row.get("tied"):
                why.append("the trained head is no longer the embedding")
            if row["processes"] > 1:
                if row.get("backend") != backend:
                    why.append(f"the process group's backend is {row.get('backend')}, not {backend}")
                if row.get("latest"):
                    why += against_partner(row, row.get("uninterrupted"), "uninterrupted")
                elif kind(row) == "asynchronous" and not row.get("sharded") and row.get("tensor", 1) == 1:
                    why += against_partner(row, alone.get(key(row)), "1 process")
        row["holds"] = not why
        if why:
            row["why"] = "; ".join(why)
        out.append(row)
    return out


def against_sequential(row: Dict[str, Any], reference: Optional[Dict[str, Any]]) -> List[str]:
    """A row against sequential (sets ``against`` and ``bound``)."""
    if reference is None:
        return [f"no sequential run in {row['precision']} to compare with"]
    if kind(row) == "asynchronous":
        row["against"] = relative(row["loss"], reference["loss"])
        row["bound"] = ASYNC_SHARE * relative(reference["initial"], reference["loss"])
        if not row["against"] <= row["bound"]:
            return [f"asynchronous: {row['against']:.2e} from sequential, over {row['bound']:.2e} (it closed less "
                    f"than {ASYNC_SHARE:g} of the gap from the untrained model's loss to sequential's)"]
        return []
    if len(row["losses"]) != len(reference["losses"]):
        return [f"{len(row['losses'])} losses, sequential {len(reference['losses'])}"]
    pairs = list(zip(row["losses"] + [row["loss"]], reference["losses"] + [reference["loss"]]))
    row["against"], row["bound"] = max(relative(a, b) for a, b in pairs), TOLERANCES[kind(row)]
    if not row["against"] <= row["bound"]:
        worst = max(range(len(pairs)), key=lambda i: relative(*pairs[i]))
        where = "the loss after K" if worst == len(row["losses"]) else f"mini-batch {worst}'s loss"
        return [f"{kind(row)}: {row['against']:.2e} from sequential ({where}), over {row['bound']:g}"]
    return []


def against_partner(row: Dict[str, Any], partner: Optional[Dict[str, Any]], name: str) -> List[str]:
    """A torchrun row against the run it must equal to the bit, losses of every mini-batch and
    the loss after K (sets ``partner`` and ``same``)."""
    row["partner"] = name
    if partner is None:
        row["same"] = "not run"
        return [f"no {name} run of it to compare with"]
    if len(row["losses"]) != len(partner["losses"]):
        row["same"] = "differs"
        return [f"{len(row['losses'])} losses, the {name} run {len(partner['losses'])}"]
    pairs = list(zip(row["losses"] + [row["loss"]], partner["losses"] + [partner["loss"]]))
    worst = max(relative(a, b) for a, b in pairs)
    row["same"] = "equal" if worst == 0 else f"{worst:.1e}"
    if worst:
        first = next(i for i, (a, b) in enumerate(pairs) if a != b)
        return [f"differs from the {name} run from "
                + (f"mini-batch {first}'s loss on" if first < len(row["losses"]) else "the loss after K")]
    return []


def table(rows: List[Dict[str, Any]], updates: int) -> List[str]:
    """The judged rows as text: one line each, then what failed and what was not run."""
    head = (f"{'row':<24}{'launcher':<17}{'precision':<10}{'compiled':<10}{f'loss after {updates}':>13}"
            f"{'sequential':>11}{'rel diff':>9}{'bound':>9}  {'same run':<25}holds")
    lines = [head]
    sequential = {r["precision"]: r.get("loss") for r in rows
                  if r["method"] == "sequential" and r.get("processes") == 1}
    for r in rows:
        launcher = ("python 1" if r.get("processes") == 1 else
                    f"torchrun {r.get('processes')} {r.get('backend') or ''}".rstrip())
        start = f"{r['row']:<24}{launcher:<17}{r['precision']:<10}{str(r['compiled'] or '-'):<10}"
        if r.get("not_run"):
            lines.append(start + f"  not run: {r['not_run']}")
            continue
        if "error" in r:
            lines.append(start + f"  failed: {r['error']}")
            continue
        verdict = "yes" if r["holds"] else "NO"
        if r["method"] == "sequential":
            untrained = f"(untrained: {r['initial']:.7f})"
            lines.append(start + f"{r['loss']:>13.7f}{'the reference':>29}  {untrained:<25}{verdict}")
            continue
        ref = sequential.get(r["precision"])
        same = f"{r['partner']}: {r['same']}" if r.get("partner") else "-"
        lines.append(start + f"{r['loss']:>13.7f}{'-' if ref is None else f'{ref:.7f}':>11}"
                     f"{r.get('against', float('nan')):>9.1e}{r.get('bound', float('nan')):>9.1e}  {same:<25}{verdict}")
    for r in rows:
        if r.get("why") and "error" not in r:
            lines.append(f"  {r['row']} ({'python 1' if r.get('processes') == 1 else 'torchrun'}): {r['why']}")
    return lines


def launch(rows: List[str], processes: int, args: argparse.Namespace, scratch: str) -> Tuple[List[dict], str]:
    """One job of the worker (``processes`` 1: python alone), its JSON lines and the end of its stderr."""
    command = [sys.executable, str(WORKER), "--device", args.device, "--rows", ",".join(rows), "--updates",
               str(args.updates), "--size", args.size, "--compile", args.compile, "--lr", str(args.lr),
               "--scratch", scratch]
    if processes > 1:
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if args.device == "cpu":
        env.setdefault("PIPEOPTIM_STRICT_TRANSPORT", "1")  # NCCL's rules on gloo (runtime/strict.py)
        if args.compile == "inductor":  # compiling for minutes: not a pair that never meets (its 30 s)
            env.setdefault("PIPEOPTIM_STRICT_TIMEOUT", "600")
    else:
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic workspace
    job = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        out, err = job.communicate(timeout=args.job_timeout)
    except subprocess.TimeoutExpired:  # the launcher and its workers: their own process group
        os.killpg(job.pid, signal.SIGKILL)
        out, err = job.communicate()
        err += f"\n(the job was stopped after {args.job_timeout:g} s: --job-timeout)"
    lines = []
    for text in out.splitlines():
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if isinstance(line, dict) and "row" in line:
            lines.append(line)
    last = [t for t in err.strip().splitlines() if t.strip()][-1:] or [f"exit status {job.returncode}"]
    return merge(lines), f"exit status {job.returncode}: {last[0]}" if job.returncode else ""


def merge(lines: List[dict]) -> List[dict]:
    """The worker's lines with a torchrun row that failed on several ranks as one line: every
    rank's error in it, in rank order (a peer's error may be the cause of rank 0's)."""
    failed: Dict[Tuple, List[dict]] = {}
    out = []
    for line in lines:
        if "error" in line and line.get("processes", 1) > 1:
            key = (line["row"], line["processes"])
            if key not in failed:
                out.append(key)
            failed.setdefault(key, []).append(line)
        else:
            out.append(line)
    for i, item in enumerate(out):
        if isinstance(item, tuple):
            errors = sorted(failed[item], key=lambda e: e.get("rank", 0))
            out[i] = {**errors[0], "error": "; ".join(f"rank {e.get('rank', '?')}: {e['error']}" for e in errors)}
    return out


def check(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Every job this machine can run, their rows in the order asked, then the one-process rows."""
    specs = worker.plan(args.rows.split(","), args.updates)
    gpus = torch.cuda.device_count() if args.device == "cuda" else None
    found: List[dict] = []
    not_run: List[dict] = []
    ran_jobs = 0
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        for processes in sorted({s["processes"] for s in specs}):
            mine = [s for s in specs if s["processes"] == processes]
            if gpus is not None and gpus < processes:
                reason = (f"needs {processes} GPUs, this machine has {gpus} (NCCL refuses two ranks on one GPU)")
                not_run += [shell(s, args, processes, not_run=reason) for s in mine]
                continue
            lines, failure = launch([s["row"] for s in mine], processes, args, os.path.join(scratch, str(processes)))
            ran_jobs += 1
            got = {line["row"] for line in lines if line.get("processes", 0) > 1}
            found += lines
            found += [shell(s, args, processes, error=f"the job ended before this row ({failure or 'no line'})")
                      for s in mine if s["row"] not in got]
        if not ran_jobs:  # not one torchrun job: the one-process rows alone
            lines, failure = launch([s["row"] for s in specs], 1, args, os.path.join(scratch, "1"))
            found += lines
            got = {line["row"] for line in lines}
            plain = {s["row"]: s for s in map(worker.plain, specs)}
            found += [shell(s, args, 1, error=f"the job ended before this row ({failure or 'no line'})")
                      for row, s in plain.items() if row not in got]
    many = [r for r in found if r.get("processes", 0) > 1]
    ones, seen = [], set()
    for r in found:  # each job's rank 0 trains its rows alone: one of each
        key = (r["row"], r["method"], r["precision"], r["compiled"])
        if r.get("processes") == 1 and key not in seen:
            seen.add(key)
            ones.append(r)
    order = {s["row"]: i for i, s in enumerate(specs)}
    many.sort(key=lambda r: order.get(r["row"], len(order)))
    return many + not_run + ones


def shell(spec: Dict[str, Any], args: argparse.Namespace, processes: int, **why: str) -> Dict[str, Any]:
    """A row that produced no line of its own: why (``not_run`` or ``error``; ``row``: another name)."""
    return {"row": spec["row"], "method": spec["method"], "processes": processes,
            "precision": "bf16" if spec["bf16"] else "fp32", "compiled": args.compile if spec["compiled"] else False,
            "sharded": spec["sharded"] and processes > 1, "tensor": 2 if spec["tensor"] and processes > 1 else 1,
            **why}


def cuda_tests(quiet: bool) -> Optional[int]:
    """The test suite's CUDA tests (pytest's exit status), or None without pytest; ``quiet``: what
    pytest prints goes to stderr (stdout is the JSON's)."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        return None
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "tests/test_pipeline.py", "tests/test_profile.py", "-k", "cuda"], cwd=REPO,
                          stdout=sys.stderr if quiet else None)
    return done.returncode


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda (default; without one: say so, exit 0): NCCL; cpu: gloo")
    parser.add_argument("--updates", type=int, default=8, help="updates K each row trains (default 8)")
    parser.add_argument("--rows", default=",".join(worker.ROWS),
                        help="comma-separated METHOD[+bf16][+compiled][+checkpoint][+sharded][+tensor] (default: "
                        + ", ".join(worker.ROWS) + ")")
    parser.add_argument("--size", default="full", choices=sorted(worker.SIZES), help="the GPT's and data's size "
                        "(default full; tiny: the tests')")
    parser.add_argument("--compile", default=None, help="the compiled rows' torch.compile backend (default: "
                        "inductor on CUDA, aot_eager on the CPU, which needs no C++ compiler)")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW's learning rate (default 1e-2)")
    parser.add_argument("--json", action="store_true", help="print the judged rows as one JSON object, no table")
    parser.add_argument("--out", type=Path, default=None, help="also write that JSON object here")
    parser.add_argument("--require-all", action="store_true", help="a row not run (too few GPUs) fails the check")
    parser.add_argument("--no-tests", action="store_true", help="skip the CUDA tests of the suite")
    parser.add_argument("--job-timeout", type=float, default=1800.0, help="seconds a job may run (default 1800)")
    args = parser.parse_args(argv)
    if args.compile is None:
        args.compile = "inductor" if args.device == "cuda" else "aot_eager"
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
              f"nothing to check")
        return 0
    say = (lambda text: print(text, file=sys.stderr)) if args.json else print
    tests = None
    if args.device == "cuda":
        say(f"gpu_check: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}")
        if not args.no_tests:
            tests = cuda_tests(quiet=args.json)
            say("gpu_check: the CUDA tests " + ("were not run (no pytest)" if tests is None else
                                                "passed" if tests == 0 else f"failed (pytest exit {tests})"))
    rows = judge(check(args), backend="nccl" if args.device == "cuda" else "gloo")
    failed = [r["row"] for r in rows if r["holds"] is False]
    skipped = [r for r in rows if r["holds"] is None]
    ok = not failed and tests in (None, 0) and not (args.require_all and skipped)
    summary = {"device": args.device, "updates": args.updates, "size": args.size,
               "tolerances": {**TOLERANCES, "asynchronous_share": ASYNC_SHARE},
               "holds": ok, "failed": failed, "not_run": [r["row"] for r in skipped], "cuda_tests": tests, "rows": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2))
    if args.json:
        print(json.dumps(summary))
    else:
        print("\n".join(table(rows, args.updates)))
        print(f"gpu_check: {'every row that ran holds' if not failed else f'rows that do not hold: {len(failed)}'}"
              + (f"; {len(skipped)} not run ({skipped[0]['not_run']})"
                 + (", which --require-all counts" if args.require_all else "") if skipped else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
