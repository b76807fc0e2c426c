"""The first study's report, docs/results-v1.md, and its curves (docs/results/*.png), from the
study's rows (study/results/study/: runs.jsonl, plans.jsonl, suite.json) and two committed
throughput benchmarks (benchmarks/results/distributed_throughput.json, local_overhead.json). No
number is typed by hand.

    .venv/bin/python -m study.make_results1 [--study study/results/study] [--out docs] [--no-plots]

The first study trained every method for a few epochs at sequential's lr, with no
schedule; its runner (benchmarks/study.py) is gone (commit 6bb0f1e is the last that holds it).
This is the code that wrote the report (benchmarks/make_results.py as of commit f3f473c, when the
report was docs/results.md), with today's module paths; study/tests/test_make_results1.py holds
docs/results-v1.md to what the rows give, byte for byte.

Scoring: a run whose loss became NaN or infinite ("diverged") scores 0 on the task's metric
(it is useless), and the tables say how many seeds diverged. Verdicts compare means over seeds:
within the larger of the two standard deviations is a tie.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from pipeoptim.lab.plots import smooth
from pipeoptim.methods import get_method
from study.common import RESULTS, ROOT, fmt, mean_sd, pyplot, verdict

#: the committed throughput benchmarks claim 3 reads (a performance measurement: benchmarks/)
BENCHMARK_RESULTS = ROOT / "benchmarks" / "results"
RIVALS = ["pipedream", "pipedream-2bw", "spectrain", "xpipe"]
SYNCHRONOUS = ["sequential", "gpipe", "1f1b-flush"]
PREDICTING = ["pipeoptim", "spectrain", "xpipe"]
SCALE = {"accuracy": 100.0}  # accuracy in percent; BLEU is already 0-100


def score(run: Dict[str, Any]) -> float:
    """The final metric; a diverged run scores 0."""
    return 0.0 if run.get("diverged") else run["final_metric"]


def time_to_target(run: Dict, target: float, higher: bool) -> Optional[int]:
    """Epochs until the metric first reaches ``target`` (None: never, or diverged)."""
    if run.get("diverged"):
        return None
    for entry in run["epochs_detail"]:
        value = entry.get("metric")
        if value is not None and (value >= target if higher else value <= target):
            return entry["epoch"] + 1
    return None


def stage_errors(runs: List[Dict]) -> List[Dict[str, float]]:
    """Per stage, mean over the (non-diverged) seeds of the prediction and staleness errors."""
    per_stage: Dict[int, Dict[str, List[float]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        for k, d in enumerate(r.get("prediction_error") or []):
            if d.get("probes"):
                per_stage[k]["prediction"].append(d["prediction_error"])
                per_stage[k]["staleness"].append(d["staleness_error"])
    out = []
    for k in sorted(per_stage):
        p, s = statistics.mean(per_stage[k]["prediction"]), statistics.mean(per_stage[k]["staleness"])
        out.append({"stage": k, "prediction": p, "staleness": s, "ratio": p / s if s > 0 else float("nan")})
    return out


class Setting:
    """One task, optimizer and stage count: every method's runs over the seeds, and the plan
    (every method's throughput predicted from one profile of the model), if the study made one."""

    def __init__(self, task: str, optimizer: str, stages: int, runs: List[Dict], spec: Dict[str, Any],
                 plan: Optional[Dict[str, Any]] = None):
        self.task, self.optimizer, self.stages, self.spec, self.plan = task, optimizer, stages, spec, plan
        self.metric = runs[0]["metric"]
        self.higher = self.metric != "loss"
        self.scale = SCALE.get(self.metric, 1.0)
        self.lr = runs[0]["lr"]
        self.by_method: Dict[str, List[Dict]] = defaultdict(list)
        for r in runs:
            self.by_method[r["method"]].append(r)

    def final(self, method: str) -> Tuple[float, float]:
        return mean_sd([score(r) for r in self.by_method.get(method, [])])

    def diverged(self, method: str) -> int:
        return sum(1 for r in self.by_method.get(method, []) if r.get("diverged"))

    def predicted(self, method: str) -> Optional[float]:
        """Samples/s the plan predicts for ``method`` at the micro-batch count the runs used."""
        if self.plan is None or method not in self.by_method:
            return None
        m = get_method(method).microbatches(self.stages, None)  # what the study's runs use
        for c in self.plan["candidates"]:
            if c["method"] == method and c["microbatches"] == m:
                return c["samples_per_second"]
        return None

    def name(self) -> str:
        return f"{self.task}, {self.optimizer}, N={self.stages}"


def table(st: Setting) -> List[str]:
    seq = st.final("sequential")
    target = 0.95 * seq[0] if st.higher else 1.05 * seq[0]
    m = st.metric
    lines = [f"| method | final {m} | best {m} | final training loss | epochs to {target * st.scale:.2f} "
             f"(per seed) | weight copies (stage 0..N-1) | micro-batches | predicted samples/s |",
             "|---|---|---|---|---|---|---|---|"]
    for method, rs in st.by_method.items():
        ok = [r for r in rs if not r.get("diverged")]
        final = fmt(st.final(method), st.scale)
        if st.diverged(method):
            final += f" ({st.diverged(method)} of {len(rs)} diverged)"
        best = fmt(mean_sd([r["best_metric"] for r in ok]), st.scale)
        loss = fmt(mean_sd([r["final_loss"] for r in ok]), 1.0, 3)
        ttt = ", ".join("-" if t is None else str(t) for t in (time_to_target(r, target, st.higher) for r in rs))
        copies = ",".join(f"{c:g}" for c in ok[0]["weight_copies"]) if ok else "-"
        pred = st.predicted(method)
        micro = get_method(method).microbatches(st.stages, None) if method != "sequential" else 1
        lines.append(f"| {method} | {final} | {best} | {loss} | {ttt} | {copies} | {micro} | "
                     f"{'-' if pred is None else f'{pred:.0f}'} |")
    return lines


def diagnostic_table(st: Setting) -> List[str]:
    methods = [m for m in PREDICTING + ["pipedream", "async-naive"] if m in st.by_method]
    rows = {m: stage_errors([r for r in st.by_method[m] if not r.get("diverged")]) for m in methods}
    stages = max((len(v) for v in rows.values()), default=0)
    if not stages:
        return []
    lines = ["Prediction error / staleness error per stage (mean over the seeds that did not diverge; "
             "below 1: the forward's weights were closer to the backward's than the stale weights "
             "were):", "",
             "| method | " + " | ".join(f"stage {k}" for k in range(stages)) + " |",
             "|---|" + "---|" * stages]
    for m in methods:
        cells = {d["stage"]: f"{d['ratio']:.2f} ({d['prediction']:.1e})" for d in rows[m]}
        lines.append(f"| {m} | " + " | ".join(cells.get(k, "-") for k in range(stages)) + " |")
    return lines + [""]


def curves(st: Setting, folder: Optional[Path]) -> str:
    """Draw the setting's training losses into ``folder`` (None: name the figure only)."""
    name = f"{st.task}-{st.optimizer}-N{st.stages}.png"
    if folder is None:
        return name
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for method, rs in st.by_method.items():
        ok = [r for r in rs if not r.get("diverged") and r.get("losses")]
        if ok:
            seed0 = min(ok, key=lambda r: r["seed"])
            ax.plot(smooth(seed0["losses"], max(1, len(seed0["losses"]) // 40)), label=method, linewidth=1.2)
    ax.set(xlabel="mini-batch", ylabel="training loss (moving average)",
           title=f"{st.name()} (first seed that did not diverge)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(folder / name, dpi=100)
    plt.close(fig)
    return name


def conclusions(settings: List[Setting]) -> List[str]:
    """A paragraph per claim of the paper, each backed by per-setting numbers."""
    out: List[str] = []
    tally: Dict[str, Dict[str, int]] = defaultdict(lambda: defaultdict(int))
    synchronous, rivals, throughput, shortfalls = [], [], [], []
    for st in settings:
        if "pipeoptim" not in st.by_method or "sequential" not in st.by_method:
            continue
        po, seq = st.final("pipeoptim"), st.final("sequential")
        word, diff, spread = verdict(po, seq, st.higher)
        tally["sequential"][word] += 1
        div = f", {st.diverged('pipeoptim')} of {len(st.by_method['pipeoptim'])} seeds diverged" \
            if st.diverged("pipeoptim") else ""
        synchronous.append(f"  - {st.name()}: {word} ({po[0] * st.scale:.2f} against {seq[0] * st.scale:.2f}, "
                           f"{diff * st.scale:+.2f} at a spread of {spread * st.scale:.2f}{div})")
        if word == "loses":
            errs = stage_errors([r for r in st.by_method["pipeoptim"] if not r.get("diverged")])
            if errs:
                worst = max(errs, key=lambda d: d["prediction"])
                shortfalls.append(
                    f"  - {st.name()}: the largest prediction error is at stage {worst['stage']} "
                    f"({worst['prediction']:.1e}, {worst['ratio']:.2f} of its staleness error); by stage: "
                    + ", ".join(f"{d['stage']}: {d['ratio']:.2f}" for d in errs))
            else:
                shortfalls.append(f"  - {st.name()}: every seed diverged, so no diagnostic was recorded")
        parts = []
        for rival in RIVALS:
            if rival in st.by_method:
                w, d, s = verdict(po, st.final(rival), st.higher)
                tally[rival][w] += 1
                div_r = st.diverged(rival)
                parts.append(f"{rival} {w} ({d * st.scale:+.2f}"
                             + (f"; {rival} diverged in {div_r} of {len(st.by_method[rival])}" if div_r else "") + ")")
        rivals.append(f"  - {st.name()}: " + ", ".join(parts))
        # measured in the runs; where every seed diverged, the design's count
        copies = [c for r in st.by_method["pipeoptim"] if not r.get("diverged") for c in r["weight_copies"]] \
            or get_method("pipeoptim").weight_versions(st.stages)
        pd_copies = [c for r in st.by_method.get("pipedream", []) if not r.get("diverged")
                     for c in r["weight_copies"]] or get_method("pipedream").weight_versions(st.stages)
        predicted = ""
        if st.predicted("pipeoptim") and st.predicted("1f1b-flush"):
            predicted = (f"predicted {st.predicted('pipeoptim') / st.predicted('1f1b-flush'):.2f}x the "
                         f"throughput of 1f1b-flush and {st.predicted('pipeoptim') / st.predicted('gpipe'):.2f}x "
                         f"gpipe's; ")
        throughput.append(f"  - {st.name()}: {predicted}at most {max(copies) if copies else float('nan'):g} "
                          f"weight copies per stage (pipedream: up to "
                          f"{max(pd_copies) if pd_copies else float('nan'):g})")
    n = len(synchronous)
    seq_t = tally["sequential"]

    def holds(t: Dict[str, int]) -> str:
        total = sum(t.values())
        if not total:
            return "untested"
        if t["loses"] * 2 >= total:
            return "does not hold"
        return "holds" if (t["wins"] + t["ties"]) * 4 >= 3 * total else "holds in part"

    rival_totals = {r: dict(tally[r]) for r in RIVALS}
    better = [r for r in RIVALS if holds(tally[r]) == "holds"]
    worse = [r for r in RIVALS if holds(tally[r]) == "does not hold"]
    pd_ratio = measured_ratio("pipeoptim/async-naive")
    out += ["**In short** (the verdicts below, counted: 'holds' when PipeOptim wins or ties in at "
            "least three quarters of the settings, 'does not hold' when it loses in half or more): "
            f"trains as well as sequential: {holds(seq_t)} ({seq_t['wins'] + seq_t['ties']} of {n}); "
            + "at least as good as " + ", ".join(f"{r}: {holds(tally[r])} (wins or ties in "
                                       f"{rival_totals[r].get('wins', 0) + rival_totals[r].get('ties', 0)} of "
                                       f"{sum(rival_totals[r].values())})" for r in RIVALS)
            + (f"; keeps asynchronous 1F1B's throughput: {'holds' if pd_ratio >= 0.95 else 'does not hold'} "
               f"(measured {pd_ratio:.2f}x)" if pd_ratio == pd_ratio else "") + ". "
            + " ".join(([f"It does as well or better than {', '.join(better)} in three quarters of the "
                         f"settings or more."] if better else [])
                       + ([f"{', '.join(worse)} train{'s' if len(worse) == 1 else ''} better than it in "
                           f"half the settings or more, at the same learning rate."] if worse else [])), ""]
    out += ["**Claim 1: PipeOptim trains as well as synchronous training.** Against `sequential` with "
            f"the same learning rate, PipeOptim wins in {seq_t['wins']}, ties in {seq_t['ties']} and "
            f"loses in {seq_t['loses']} of {n} settings (difference of the mean final metric; accuracy "
            "in percentage points, BLEU in points):", ""] + synchronous + [""]
    out += ["**Claim 2: PipeOptim trains better than PipeDream, PipeDream-2BW, SpecTrain and XPipe.** "
            "Per rival, PipeOptim's wins / ties / losses over the settings: "
            + "; ".join(f"{r} {tally[r]['wins']} / {tally[r]['ties']} / {tally[r]['loses']}" for r in RIVALS)
            + ". Per setting (PipeOptim's verdict and its lead):", ""] + rivals + [""]
    out += ["**Claim 3: at 1F1B's throughput with two weight versions.** " + measured_throughput() +
            " For N = 4 and 8 (more processes than this machine has cores), the throughput the "
            "simulator predicts from one profile of each model (`pipeoptim plan`, the study's uniform "
            "split and micro-batch counts; the same for every asynchronous method, as it does not "
            "charge the prediction's own cost, which the measurements above do), and the weight "
            "copies measured in the runs:", ""] + throughput + [""]
    if shortfalls:
        out += ["**Where PipeOptim falls short of sequential by more than the spread**, the "
                "prediction-error diagnostic per stage (ratio of prediction to staleness error):", ""] \
            + shortfalls + [""]
    return out


def caveats(settings: List[Setting], suite: Dict[str, Any]) -> List[str]:
    """What the scale of the study allows one to conclude: how far sequential got per task, and
    how often each method diverged at the sequential learning rate."""
    reach = []
    for task in suite["tasks"]:
        mine = [st for st in settings if st.task == task]
        if mine:
            values = [st.final("sequential")[0] * st.scale for st in mine]
            reach.append(f"{task} {min(values):.2f}-{max(values):.2f} ({mine[0].metric})")
    diverged: Dict[str, List[int]] = defaultdict(lambda: [0, 0])
    for st in settings:
        for method, rs in st.by_method.items():
            if method == "sequential" and st.stages != settings[0].stages:
                continue  # the same sequential runs serve every N: count them once
            diverged[method][0] += st.diverged(method)
            diverged[method][1] += len(rs)
    return ["**Scale and caveats.** The study is small: sequential reaches " + ", ".join(reach) +
            " at the end of its epochs, so differences on a task where it reaches little (a BLEU of "
            "a few points) are small in absolute terms. The learning rate is sequential's best, "
            "which for several tasks sits where the asynchronous methods are near their stability "
            "limit; runs that diverged, per method: "
            + ", ".join(f"{m} {d}/{n}" for m, (d, n) in diverged.items()) + ".", ""]


def measured_ratio(name: str) -> float:
    """A throughput ratio from the committed distributed benchmark (nan if absent)."""
    bench = BENCHMARK_RESULTS / "distributed_throughput.json"
    if not bench.exists():
        return float("nan")
    return json.loads(bench.read_text())["ratios"].get(name, float("nan"))


def measured_throughput() -> str:
    """The measured cost of the prediction, from the committed throughput benchmarks."""
    results = BENCHMARK_RESULTS
    parts = []
    bench = results / "distributed_throughput.json"
    if bench.exists():
        d = json.loads(bench.read_text())
        r, n = d["ratios"], d["settings"]["stages"]
        sps = d["samples_per_second"]
        parts.append(f"Measured on the distributed runtime ({n} processes, `{bench.relative_to(ROOT)}`): "
                     f"PipeOptim runs at {r['pipeoptim/async-naive']:.2f}x the throughput of the unpredicted "
                     f"asynchronous 1F1B, {sps['pipeoptim'] / sps['1f1b-flush']:.2f}x 1f1b-flush's and "
                     f"{r['pipeoptim/gpipe']:.2f}x gpipe's.")
    local = results / "local_overhead.json"
    if local.exists():
        d = json.loads(local.read_text())
        med = d["median_seconds"]
        parts.append(f"On the local runtime (all {d['stages']} stages in one process, `{d['model']}`), an "
                     f"epoch of PipeOptim takes {med['pipeoptim'] / med['async-naive']:.3f}x the time of "
                     f"asynchronous 1F1B without prediction.")
    return " ".join(parts)


def read_rows(study: Path) -> List[Dict[str, Any]]:
    """The study's rows, one per run: study processes sharing the file may both have run one (the
    last wins)."""
    rows = [json.loads(line) for line in (study / "runs.jsonl").read_text().splitlines() if line.strip()]
    return list({(r["task"], r["optimizer"], r["stages"], r["method"], r["seed"], r["lr"], r["sweep"]): r
                 for r in rows}.values())


def generate(study: Path, out: Path, plots: bool = True, name: str = "results-v1.md") -> str:
    """Write ``out/name`` (and ``out/results/*.png`` with ``plots``); return the markdown."""
    rows = read_rows(study)
    plans = {}
    if (study / "plans.jsonl").exists():
        for line in (study / "plans.jsonl").read_text().splitlines():
            p = json.loads(line)
            plans[(p["task"], p["optimizer"], p["stages"])] = p["plan"]
    suite = json.loads((study / "suite.json").read_text())
    figures = out / "results" if plots else None
    if figures is not None:
        figures.mkdir(parents=True, exist_ok=True)
    runs = [r for r in rows if not r["sweep"]]
    # the sweep, then per task and optimizer: sequential once per seed, the others per N and seed
    pipelined = len({r["method"] for r in rows} - {"sequential"})
    expected = sum(len(spec["lr"][o]) for spec in suite["tasks"].values() for o in suite["optimizers"]) + \
        len(suite["tasks"]) * len(suite["optimizers"]) * len(suite["seeds"]) * (1 + pipelined * len(suite["stages"]))
    done = {(r["task"], r["optimizer"], r["stages"], r["method"], r["seed"], r["lr"], r["sweep"]) for r in rows}
    rel = study.resolve().relative_to(ROOT) if study.resolve().is_relative_to(ROOT) else study.name
    lines = ["# Does PipeOptim deliver? Results of the reproduction study", "",
             f"Generated by `study/make_results1.py` from `{rel}/runs.jsonl` "
             f"(suite `{suite['suite']}`: {len(done)} of {expected} runs, "
             f"{sum(r.get('seconds', 0) for r in rows) / 60:.0f} minutes of training on one thread each). "
             f"Every method on each task with N = {' and '.join(map(str, suite['stages']))} stages, "
             f"{' and '.join(suite['optimizers'])}, seeds {suite['seeds']}, on the local runtime. "
             f"Learning rates are chosen for `sequential` by a sweep (seed 0, best final metric) and held "
             f"fixed for every method. Mean ± standard deviation over seeds; a run whose loss became "
             f"NaN or infinite scores 0 and is counted as diverged.", ""]
    settings: List[Setting] = []
    body: List[str] = []
    for task, spec in suite["tasks"].items():
        body += [f"## {task}: {spec['model']}, {spec['limit']} training examples, {spec['epochs']} epochs", ""]
        for optimizer in suite["optimizers"]:
            sweep = {r["lr"]: r for r in rows if r["sweep"] and r["task"] == task and r["optimizer"] == optimizer}
            for stages in suite["stages"]:
                # sequential (one stage) is run once per seed and is the reference for every N
                group = [r for r in runs if r["task"] == task and r["optimizer"] == optimizer
                         and (r["method"] == "sequential" or r.get("study_stages", r["stages"]) == stages)]
                if not group:
                    continue
                st = Setting(task, optimizer, stages, group, spec, plans.get((task, optimizer, stages)))
                settings.append(st)
                sweep_text = ", ".join(f"{lr:g} → " + ("diverged" if r.get("diverged") else
                                                       f"{r['final_metric'] * st.scale:.2f}")
                                       for lr, r in sorted(sweep.items()))
                body += [f"### {st.name()} (lr {st.lr:g})", "",
                         f"Learning-rate sweep for sequential ({st.metric}): {sweep_text}", ""]
                body += table(st) + [""]
                body += diagnostic_table(st)
                figure = curves(st, figures)
                body += [f"![{figure}](results/{figure})", ""]
    lines += ["## Conclusions, claim by claim", "",
              "The paper claims that PipeOptim keeps 1F1B's throughput and trains as well as "
              "synchronous methods, better than PipeDream, PipeDream-2BW, SpecTrain and XPipe. "
              "Verdicts per setting; a tie is a difference within the larger standard deviation over "
              "seeds.", ""]
    lines += conclusions(settings)
    lines += caveats(settings, suite)
    lines += body
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(text)
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", type=Path, default=RESULTS / "study", help="the first study's folder")
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="where the markdown goes")
    parser.add_argument("--no-plots", action="store_true", help="write the markdown only")
    args = parser.parse_args(argv)
    text = generate(args.study, args.out, plots=not args.no_plots)
    print(f"written: {args.out / 'results-v1.md'} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
