"""How the links' gloo process groups are laid out, A/B in one job (issue 50, item 9): the same
code of this tree, on the runs of :mod:`benchmarks.peer_runs` (the ``blocks`` model split [4, 5],
batch 512, momentum SGD, 2 processes, gloo, one compute thread each), with each Pipeline's
links rearranged right after its ``PipeComm`` is built:

* ``tags``: every link a tag of the pipeline's control group (one gloo group, one socket pair
  and one socket thread per process carry both directions; ``PipeComm.gloo_link_groups`` off);
* ``shared``: one more gloo group for the links, both directions as tags in it (the control
  group apart);
* ``groups``: as shipped, a gloo group of its own per link, i.e. per direction;

beside torch's ``Schedule1F1B`` at the same M. The arrangements take turns within each round
(the order rotating), each timed from a barrier to a barrier after ``--warmup`` mini-batches:
throughput as a ratio to the same round's ``tags`` run, CPU time (all processes) likewise, and
the voluntary context switches of each process's main thread per mini-batch. Only the
rearrangement differs between the runs, so the ratios isolate the layout of the groups; the
CPU ratios say whether it changes work or only waiting.

``shared`` reaches into ``PipeComm`` (its ``_links``, each ``Link``'s ``group`` and ``tag``) and
fails saying so where those are gone. Writes ``benchmarks/results/link_groups.json``.

    .venv/bin/python -m benchmarks.link_groups [--rounds 20] [--batches 16] [--drive fit|step]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from benchmarks.peer_runs import BATCH, build, launch, make_data
from benchmarks.peer_throughput import spread

RESULTS = Path(__file__).resolve().parent / "results" / "link_groups.json"
ARRANGEMENTS = ("tags", "shared", "groups")
TORCH = "torch Schedule1F1B"


def rearranged(arrangement: str):
    """Patch ``PipeComm`` so that the ones built from now on lay their links out as
    ``arrangement`` says (and destroy the groups made for it when closed); the patch's undo."""
    import torch.distributed as dist

    from pipeoptim.runtime import transport

    init, close = transport.PipeComm.__init__, transport.PipeComm.close
    transport.PipeComm.gloo_link_groups = arrangement == "groups"  # else tags of the control group

    def patched_init(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        links = getattr(self, "_links", None)
        if links is None or any(not hasattr(link, "group") or not hasattr(link, "tag") for link in links.values()):
            raise RuntimeError("PipeComm no longer keeps _links of Links with a group and a tag: update "
                               "benchmarks/link_groups.py")
        group = dist.new_group(sorted({dist.get_rank(), *(link.peer for link in links.values())}),
                               backend="gloo")  # every rank, in the same order
        self._benchmark_groups = [group]
        for key in sorted(links):
            links[key].group = group

    def patched_close(self) -> None:
        made = getattr(self, "_benchmark_groups", [])
        close(self)
        for group in made:
            dist.destroy_process_group(group)
        self._benchmark_groups = []

    if arrangement == "shared":
        transport.PipeComm.__init__, transport.PipeComm.close = patched_init, patched_close

    def undo() -> None:
        transport.PipeComm.__init__, transport.PipeComm.close = init, close
        transport.PipeComm.gloo_link_groups = True
    return undo


def _timed(run, warm, timed) -> Dict[str, Any]:
    """Warm up, time between barriers, close: wall seconds; per rank CPU seconds and the main
    thread's voluntary context switches."""
    import torch
    import torch.distributed as dist

    try:
        run.train(warm)
        dist.barrier()
        switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
        start, cpu = time.perf_counter(), time.process_time()
        run.train(timed)
        spent = [time.process_time() - cpu, float(resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - switches)]
        dist.barrier()
        wall = time.perf_counter() - start
    finally:
        run.close()
    every = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, torch.tensor(spent, dtype=torch.float64))
    return {"wall": wall, "cpu": [float(t[0]) for t in every], "switches": [float(t[1]) for t in every]}


def summarise(rounds: List[Dict[str, Dict[str, Any]]], batches: int) -> Dict[str, Any]:
    """Per run: throughput and CPU as ratios to the same round's ``tags`` run (median and
    spread over the rounds), the rounds it beat ``tags`` in, and its medians per mini-batch."""
    out = {}
    for name in rounds[0]:
        entry = {"samples_per_second": spread([BATCH * batches / r[name]["wall"] for r in rounds]),
                 "cpu_ms_per_batch": spread([1e3 * sum(r[name]["cpu"]) / batches for r in rounds]),
                 "main_thread_switches_per_batch": [spread([r[name]["switches"][k] / batches for r in rounds])
                                                    for k in range(len(rounds[0][name]["switches"]))]}
        if name != "tags":
            entry["throughput_over_tags"] = spread([r["tags"]["wall"] / r[name]["wall"] for r in rounds])
            entry["cpu_over_tags"] = spread([sum(r[name]["cpu"]) / sum(r["tags"]["cpu"]) for r in rounds])
            entry["faster_than_tags"] = sum(r[name]["wall"] < r["tags"]["wall"] for r in rounds)
        out[name] = entry
    return out


def _worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from pipeoptim.runtime.control import init_process_group

    init_process_group(device="cpu", timeout=args.timeout, threads=1)
    rank = dist.get_rank()
    data = make_data(args.warmup + args.batches)
    warm, timed = data[:args.warmup], data[args.warmup:]
    side = "ours+step" if args.drive == "step" else "ours"
    names = list(args.arrangements) + [TORCH]
    rounds: List[Dict[str, Dict[str, Any]]] = []
    for r in range(args.rounds):
        shift = r % len(names)
        measured = {}
        for name in names[shift:] + names[:shift]:
            if name == TORCH:
                measured[name] = _timed(build("torch", "Schedule1F1B", args.micro, rank, 2, args.timeout), warm, timed)
                continue
            undo = rearranged(name)  # for the whole run: its PipeComm is built, used and closed patched
            try:
                measured[name] = _timed(build(side, args.method, args.micro, rank, 2, args.timeout), warm, timed)
            finally:
                undo()
        rounds.append({name: measured[name] for name in names})
        if rank == 0:
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {BATCH * args.batches / m['wall']:.0f}/s" for n, m in rounds[-1].items()), file=sys.stderr, flush=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"rounds": rounds, "summary": summarise(rounds, args.batches)}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds (default: 20)")
    parser.add_argument("--batches", type=int, default=16, help="timed mini-batches per run (default: 16)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed mini-batches per run first (default: 1)")
    parser.add_argument("--method", default="1f1b-flush", help="our method (default: %(default)s)")
    parser.add_argument("--micro", type=int, default=2, help="micro-batches, both sides (default: 2)")
    parser.add_argument("--drive", choices=["fit", "step"], default="fit",
                        help="ours by fit, or by step and a flush (default: fit)")
    parser.add_argument("--arrangements", default=",".join(ARRANGEMENTS),
                        help="comma-separated, tags first (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a process waits for its peer")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results file (default: %(default)s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.arrangements = [a.strip() for a in args.arrangements.split(",") if a.strip()]
    if args.arrangements[:1] != ["tags"] or any(a not in ARRANGEMENTS for a in args.arrangements):
        parser.error(f"--arrangements: tags first, then any of {', '.join(ARRANGEMENTS[1:])}")
    if args.worker:
        return _worker(args)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="link-groups-") as tmp:
        out = Path(tmp) / "result.json"
        code = launch("benchmarks.link_groups", [
            "--rounds", str(args.rounds), "--batches", str(args.batches), "--warmup", str(args.warmup),
            "--method", args.method, "--micro", str(args.micro), "--drive", args.drive,
            "--arrangements", ",".join(args.arrangements), "--timeout", str(args.timeout), "--out", str(out)])
        if code != 0 or not out.exists():
            print(f"link_groups: the workers failed (exit status {code})", file=sys.stderr)
            return 1
        result = json.loads(out.read_text())
    result["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "worker"}
    result["load_average"] = {"before": list(load_before), "after": list(os.getloadavg())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for name, e in result["summary"].items():
        line = (f"{name}: {e['samples_per_second']['median']:.0f} samples/s, "
                f"{e['cpu_ms_per_batch']['median']:.1f} CPU ms per mini-batch, main-thread switches "
                + "/".join(f"{s['median']:.2f}" for s in e["main_thread_switches_per_batch"]))
        if "throughput_over_tags" in e:
            t, c = e["throughput_over_tags"], e["cpu_over_tags"]
            line += (f"; throughput / tags' {t['median']:.3f} [IQR {t['q1']:.3f}-{t['q3']:.3f}], faster in "
                     f"{e['faster_than_tags']}/{len(result['rounds'])} rounds; CPU / tags' {c['median']:.3f}")
        print(line)
    print(f"load average before {result['load_average']['before']}, after {result['load_average']['after']}; "
          f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
