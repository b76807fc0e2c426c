"""Issue 23's report: equal time, not equal updates. In the time the synchronous pipeline takes
for sequential's updates, which pipeline gives the better model, and which reaches the target
first?

Reads the study folder's ``runs.jsonl`` (benchmarks/study3.py) and ``times.json``
(benchmarks/study3_times.py: the budget B, each variant's seconds per mini-batch s_m) and writes
``docs/results.md``: this report first, then the second study's equal-update report
(benchmarks/make_results2.py, its headings one level down), which measures statistical
efficiency per update, what equal time does not; and a figure per setting (``results3/``, with
the second study's in ``results2/``). Per (task, optimizer, N):

* the **synchronous pipeline** is ``sequential``'s runs (U updates; gpipe, 1f1b-flush, zb-h1 and
  interleaved compute sequential's updates) at the fastest synchronous schedule's seconds per
  mini-batch: it ends at B;
* each **variant** is its runs at its chosen lr (the lr its seeds ran at; before the seeds are in,
  the tuning run best on validation): U_m = floor(B / s_m) updates, its curve against predicted
  time = updates x s_m;
* the **final metric at equal time** is the test metric at the end (mean ± standard deviation
  over the seeds), against sequential's; **time to target** as in the second study (the first
  validation evaluation at or past 99 % / 101 % of sequential's mean final validation metric,
  times s_m), against the synchronous pipeline's.

Verdicts use the first study's rule (win or lose beyond the larger of the two standard
deviations, else tie). The recommendation per task and N: the best mean final metric at equal time
among the synchronous pipeline and every variant, over the task's optimizers; an asynchronous
method is recommended only where it beats the best synchronous pipeline beyond the seed spread
(else the synchronous one is: the same model as non-pipelined training, for the same time).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

BENCHMARKS = Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
from make_results import fmt, mean_sd, verdict  # noqa: E402  (the first study's arithmetic, tested there)
from make_results2 import final_score, run_updates_to_target  # noqa: E402
from make_results2_findings import diagnosis  # noqa: E402
from study2 import ranked_lrs  # noqa: E402
from study3_plan import load_rows  # noqa: E402
from study3_suite import SAME_AS  # noqa: E402

from pipeoptim.time_to_target import target_from_reference  # noqa: E402

SCALE = {"accuracy": 100.0}
SYNC = "synchronous"  #: the report's name for sequential's runs priced as the fastest synchronous pipeline


# --------------------------------------------------------------------------------------------
# the arithmetic (tested in tests/test_make_results3.py)


def read_rows(study: Path) -> List[Dict[str, Any]]:
    """The study's rows, a run once: two workers that once ran the same run wrote it twice, and a
    second row of a run is no second seed (the first is kept, as the runner keeps it)."""
    return list(load_rows(study / "runs.jsonl").values())


def chosen_lr(rows: Sequence[Dict[str, Any]], higher: bool) -> Optional[float]:
    """The lr a variant's runs settled on: the one its seeds (or the reference's seeds) ran at;
    before any is in, the best of its tuning runs on validation (smaller lr on a tie)."""
    later = {r["lr"] for r in rows if r["phase"] in ("seeds", "reference")}
    if len(later) > 1:
        raise ValueError(f"seeds at several lrs: {sorted(later)}")
    if later:
        return later.pop()
    ranked = ranked_lrs([(r["lr"], r) for r in rows if r["phase"] == "tune"], higher)
    return ranked[0] if ranked else None


def mean_curve(rows: Sequence[Dict[str, Any]]) -> List[Tuple[float, float, float, float]]:
    """(updates, mean, lowest, highest) of the validation metric over the seeds at each evaluation
    every non-diverged seed has."""
    runs = [r for r in rows if not r.get("diverged")]
    if not runs:
        return []
    common = sorted(set.intersection(*({e["updates"] for e in r["evaluations"]} for r in runs)))
    out = []
    for updates in common:
        values = [next(e["metric"] for e in r["evaluations"] if e["updates"] == updates) for r in runs]
        out.append((updates, statistics.mean(values), min(values), max(values)))
    return out


@dataclass
class Arm:
    """A variant's (or the synchronous pipeline's) runs in one setting, at its chosen lr."""

    variant: str
    lr: Optional[float]
    rows: List[Dict[str, Any]]
    seconds: Optional[float]          #: predicted seconds per mini-batch on N devices
    tried: List[Tuple[float, Optional[float]]] = field(default_factory=list)  #: (lr, validation) of tuning runs
    source: str = ""

    @property
    def updates(self) -> Optional[int]:
        return self.rows[0]["updates"] if self.rows else None


@dataclass
class Setting:
    task: str
    optimizer: str
    stages: int
    metric: str
    higher: bool
    budget: Dict[str, Any]
    arms: Dict[str, Arm]              #: SYNC first, then the variants

    @property
    def scale(self) -> float:
        return SCALE.get(self.metric, 1.0)

    @property
    def digits(self) -> int:
        return 2 if self.metric == "accuracy" else 1

    def name(self) -> str:
        return f"{self.task}, {self.optimizer}, N={self.stages}"

    def final(self, variant: str) -> Tuple[float, float]:
        arm = self.arms.get(variant)
        return mean_sd([final_score(r, self.higher) for r in arm.rows]) if arm and arm.rows else (math.nan, math.nan)

    def target(self) -> Optional[float]:
        values = [r["validation_metric"] for r in self.arms[SYNC].rows if not r.get("diverged")]
        return target_from_reference(statistics.mean(values), self.higher) if values else None

    def times_to_target(self, variant: str) -> List[Optional[float]]:
        """Per seed, predicted seconds to the target on N devices (None: never)."""
        arm, target = self.arms[variant], self.target()
        if target is None or arm.seconds is None:
            return []
        return [None if (u := run_updates_to_target(r, target, self.higher)) is None else u * arm.seconds
                for r in arm.rows]

    def time_to_target(self, variant: str) -> Optional[Tuple[float, float]]:
        """Mean (sd) seconds to target over the seeds, None unless every seed reaches it (the
        synchronous pipeline: over the seeds that do, since the target is 99 % of their mean)."""
        times = self.times_to_target(variant)
        reached = [t for t in times if t is not None]
        if not reached or (variant != SYNC and len(reached) < len(times)):
            return None
        return mean_sd(reached)


def arm_of(rows: Sequence[Dict[str, Any]], variant: str, stages: int, seconds: Optional[float],
           higher: bool) -> Arm:
    mine = [r for r in rows if r.get("until") != "third"]
    lr = chosen_lr(mine, higher)
    tried = sorted({(r["lr"], r.get("validation_metric")) for r in rows
                    if r["phase"] == "tune" and r["stages"] == stages and r.get("until") != "third"},
                   key=lambda p: p[0])
    at = sorted([r for r in mine if r["lr"] == lr and r["stages"] == stages], key=lambda r: r["seed"])
    # where the lr comes from: the first run at it at the largest N (the tuning's, else seed 0's)
    first = sorted([r for r in mine if r["lr"] == lr],
                   key=lambda r: (-r["stages"], r["phase"] != "tune", r["phase"] != "reference", r["seed"]))
    return Arm(variant, lr, at, seconds, tried, first[0].get("lr_source", "") if first else "")


def settings_of(rows: Sequence[Dict[str, Any]], times: Dict[str, Any]) -> List[Setting]:
    """Every (task, optimizer, N) with a budget in ``times`` and rows in ``rows``, N = 8 first."""
    out = []
    for task, by_opt in times["cells"].items():
        for optimizer, cell in by_opt.items():
            here = [r for r in rows if (r["task"], r["optimizer"]) == (task, optimizer)]
            if not here:
                continue
            metric, higher = here[0]["metric"], here[0]["higher_is_better"]
            for n in sorted(cell["stages"], key=int, reverse=True):
                at_n = cell["stages"][n]
                variants = list(dict.fromkeys(r["variant"] for r in here
                                              if r["variant"] != "sequential" and r["stages"] == int(n)))
                # a variant that computes another's updates is that one's line (study3_suite.SAME_AS)
                variants = [v for v in variants if SAME_AS.get(v) not in variants]
                if not variants:
                    continue
                arms = {SYNC: arm_of([r for r in here if r["variant"] == "sequential"], SYNC, 1,
                                     at_n["budget"]["seconds_per_batch"], higher)}
                for v in variants:
                    arms[v] = arm_of([r for r in here if r["variant"] == v], v, int(n),
                                     at_n["variants"][v]["seconds_per_batch"], higher)
                out.append(Setting(task, optimizer, int(n), metric, higher, at_n["budget"], arms))
    return out


def word_at_equal_time(st: Setting, variant: str) -> Tuple[str, float, float]:
    """better, ties or worse than the synchronous pipeline at equal time (final test metric)."""
    word, diff, spread = verdict(st.final(variant), st.final(SYNC), st.higher)
    return {"wins": "better", "ties": "ties", "loses": "worse"}[word], diff, spread


def word_to_target(st: Setting, variant: str) -> Tuple[str, Optional[float]]:
    """sooner, ties, later or never against the synchronous pipeline's time to target, and the
    ratio synchronous time / the method's."""
    mine, sync = st.time_to_target(variant), st.time_to_target(SYNC)
    if mine is None:
        return ("never" if st.times_to_target(variant) else "-"), None
    if sync is None:
        return "-", None
    word = {"wins": "sooner", "ties": "ties", "loses": "later"}[verdict(mine, sync, higher=False)[0]]
    return word, sync[0] / mine[0]


def recommendation(settings: Sequence[Setting], task: str, stages: int) -> Optional[Dict[str, Any]]:
    """The method to use on ``task`` at N = ``stages``: the best mean final metric at equal time
    over the task's optimizers; an asynchronous one only where it beats the best synchronous
    pipeline beyond the seed spread."""
    here = [st for st in settings if (st.task, st.stages) == (task, stages)]
    candidates = [(st, v) for st in here for v, arm in st.arms.items() if arm.rows]
    if not candidates:
        return None
    higher = here[0].higher
    key = lambda c: c[0].final(c[1])[0] * (1 if higher else -1)  # noqa: E731
    best_sync = max([c for c in candidates if c[1] == SYNC], key=key, default=None)
    best = max(candidates, key=key)
    if best_sync is not None and best[1] != SYNC:
        word, _, _ = verdict(best[0].final(best[1]), best_sync[0].final(SYNC), higher)
        if word != "wins":
            best = best_sync
    rivals = [c for c in candidates if c != best]
    runner = max(rivals, key=key) if rivals else None
    return {"setting": best[0], "variant": best[1], "runner_up": runner, "synchronous": best_sync}


# --------------------------------------------------------------------------------------------
# the text


def value(x: Optional[float], st: Setting) -> str:
    return "-" if x is None or x != x else f"{x * st.scale:.{st.digits}f}"


def budget_table(settings: Sequence[Setting]) -> List[str]:
    lines = ["| task | optimizer | N | fastest synchronous schedule | s / mini-batch (ms) | U | B (s) | "
             "B against M = N |", "|---|---|---|---|---|---|---|---|"]
    for st in settings:
        b = st.budget
        lines.append(f"| {st.task} | {st.optimizer} | {st.stages} | {b['fastest']['schedule']}, M = "
                     f"{b['fastest']['microbatches']} | {b['seconds_per_batch'] * 1e3:.2f} | {b['sequential_updates']} "
                     f"| {b['budget_seconds']:.4g} | {b['budget_over_m_equals_n']:.2f}x |")
    return lines


def setting_table(st: Setting) -> List[str]:
    m = st.metric
    lines = [f"| method | lr (source; tried: validation {m}) | seeds | s / mini-batch (ms) | updates | final test {m} "
             f"at equal time | against synchronous | time to target (s, per seed) | against synchronous |",
             "|---|---|---|---|---|---|---|---|---|"]
    for variant, arm in st.arms.items():
        if not arm.rows:
            lines.append(f"| {variant} | - | 0 | - | - | - | - | - | - |")
            continue
        tried = "; ".join(f"{lr:g}: {value(v, st)}" for lr, v in arm.tried)
        lr = f"{arm.lr:g} ({arm.source}" + (f"; {tried})" if tried else ")")
        final = fmt(st.final(variant), st.scale, st.digits)
        diverged = sum(1 for r in arm.rows if r.get("diverged"))
        final += f" ({diverged} diverged)" if diverged else ""
        per_seed = ", ".join("never" if t is None else f"{t:.4g}" for t in st.times_to_target(variant)) or "-"
        if variant == SYNC:
            equal, to_target = "reference", "reference"
        else:
            word, diff, _ = word_at_equal_time(st, variant)
            equal = f"{word} ({diff * st.scale:+.{st.digits}f})"
            word, ratio = word_to_target(st, variant)
            to_target = word + (f" ({ratio:.2f}x)" if ratio else "")
        name = "synchronous pipeline (sequential's runs)" if variant == SYNC else variant
        lines.append(f"| {name} | {lr} | {len(arm.rows)} | {arm.seconds * 1e3:.2f} | {arm.updates} | {final} | "
                     f"{equal} | {per_seed} | {to_target} |")
    return lines


def method_tally(settings: Sequence[Setting]) -> Dict[str, Dict[str, Dict[str, int]]]:
    """variant -> {"equal_time": {better, ties, worse: settings}, "target": {sooner, ties, later,
    never: settings}} over the settings with the synchronous pipeline's runs in."""
    tallies: Dict[str, Dict[str, Dict[str, int]]] = {}
    for st in settings:
        if not st.arms[SYNC].rows:
            continue
        for variant, arm in st.arms.items():
            if variant == SYNC or not arm.rows:
                continue
            tally = tallies.setdefault(variant, {"equal_time": {}, "target": {}})
            for kind, word in (("equal_time", word_at_equal_time(st, variant)[0]),
                               ("target", word_to_target(st, variant)[0])):
                tally[kind][word] = tally[kind].get(word, 0) + 1
    return tallies


def method_verdict(equal_time: Dict[str, int]) -> str:
    """A method over the settings: better (in more than half), worse (in more than half, or in
    half and better in none), no worse (never worse), else mixed (better in some, worse in as
    many or more)."""
    total, better, worse = sum(equal_time.values()), equal_time.get("better", 0), equal_time.get("worse", 0)
    if better * 2 > total:
        return "better than the synchronous pipeline"
    if worse * 2 > total or (worse * 2 == total and not better):
        return "worse than the synchronous pipeline"
    return "no worse than the synchronous pipeline" if not equal_time.get("worse") else "mixed"


def verdict_lines(settings: Sequence[Setting]) -> List[str]:
    out = []
    for variant, t in method_tally(settings).items():
        e, g = t["equal_time"], t["target"]
        out.append(f"  - {variant}: {method_verdict(e)} at equal time ({e.get('better', 0)} better, "
                   f"{e.get('ties', 0)} ties, {e.get('worse', 0)} worse of {sum(e.values())} settings); to the "
                   f"target: {g.get('sooner', 0)} sooner, {g.get('ties', 0)} ties, {g.get('later', 0)} later, "
                   f"{g.get('never', 0)} never")
    return out or ["  - no setting has the synchronous pipeline's runs and a method's yet"]


def recommendation_lines(settings: Sequence[Setting]) -> List[str]:
    out = []
    for task, stages in dict.fromkeys((st.task, st.stages) for st in settings):
        rec = recommendation(settings, task, stages)
        if rec is None:
            continue
        st, variant = rec["setting"], rec["variant"]
        final = st.final(variant)
        name = (f"the synchronous pipeline ({st.budget['fastest']['schedule']}, M = "
                f"{st.budget['fastest']['microbatches']})" if variant == SYNC else f"`{variant}`")
        text = f"  - {task}, N = {stages}: {name} with {st.optimizer}, final test {st.metric} " \
               f"{fmt(final, st.scale, st.digits)}"
        if rec["runner_up"] is not None:
            rst, rv = rec["runner_up"]
            margin = (final[0] - rst.final(rv)[0]) * st.scale
            single = min(len(st.arms[variant].rows), len(rst.arms[rv].rows)) < 2
            spread = "one seed, no spread yet" if single else \
                f"seed spread {max(final[1], rst.final(rv)[1]) * st.scale:.{st.digits}f}"
            text += (f"; next: {'the synchronous pipeline' if rv == SYNC else rv} with {rst.optimizer} "
                     f"{fmt(rst.final(rv), st.scale, st.digits)} (margin {margin:+.{st.digits}f}, {spread})")
            if margin and (margin > 0) != st.higher:  # a better mean, not beyond the spread
                text += f": {rv} is better on the mean, not beyond the seed spread"
        out.append(text)
    return out or ["  - none yet"]


def carried_lines(settings: Sequence[Setting]) -> List[str]:
    """Per setting, the arms whose lr came from the second study without a check at their length."""
    out = []
    for st in settings:
        carried = [f"{'synchronous' if v == SYNC else v} {arm.lr:g}" for v, arm in st.arms.items()
                   if arm.rows and "unchecked" in arm.source]
        if carried:
            out.append(f"  - {st.name()}: {', '.join(carried)}")
    return out or ["  - none"]


def closing_lines(settings: Sequence[Setting]) -> List[str]:
    """Where no asynchronous method beats the synchronous pipeline at equal time: the diagnostic's
    reading for the method that came closest."""
    out = []
    for st in settings:
        rivals = [v for v, a in st.arms.items() if v != SYNC and a.rows]
        if not rivals or not st.arms[SYNC].rows or any(word_at_equal_time(st, v)[0] == "better" for v in rivals):
            continue
        closest = max(rivals, key=lambda v: st.final(v)[0] * (1 if st.higher else -1))
        reading = diagnosis(_Rows({closest: st.arms[closest]}), closest)
        out.append(f"  - {st.name()}: no asynchronous method beats the synchronous pipeline; the closest, "
                   f"{closest} ({word_at_equal_time(st, closest)[1] * st.scale:+.{st.digits}f}): {reading}")
    return out or ["  - none"]


class _Rows:
    """What make_results2.diagnosis reads of a setting: ``methods[variant].rows``."""

    def __init__(self, arms: Dict[str, Arm]) -> None:
        self.methods = arms


def demoted(markdown: str) -> List[str]:
    """``markdown``'s lines with every heading one level down (its title becomes a section)."""
    return ["#" + line if line.startswith("#") else line for line in markdown.rstrip("\n").splitlines()]


def generate(study: Path, out: Path, plots: bool = True, name: str = "results.md",
             equal_updates: Optional[Path] = None) -> str:
    """Write ``out/name`` (and ``out/results3/*.png`` with ``plots``); return the markdown. With
    ``equal_updates`` (the second study's folder) the second study's report follows, its headings
    one level down (and its figures in ``out/results2/``)."""
    from make_results3_advice import same_as_lines, status_line
    from make_results3_plot import curves_plot

    rows = read_rows(study)
    written = sum(1 for line in (study / "runs.jsonl").read_text().splitlines() if line.strip())
    times = json.loads((study / "times.json").read_text())
    settings = settings_of(rows, times)
    figures = out / "results3"
    if plots:
        figures.mkdir(parents=True, exist_ok=True)
    rel = study.resolve().relative_to(BENCHMARKS.parent) if study.resolve().is_relative_to(BENCHMARKS.parent) \
        else study.name
    lines = ["# Equal time, not equal updates: which pipeline gives the better model in the time a synchronous "
             "one takes?", "",
             f"Generated by `benchmarks/make_results3.py` from `{rel}/runs.jsonl` ({len(rows)} rows"
             + (f"; {written - len(rows)} repeated row(s) of a run dropped, the first kept" if written > len(rows)
                else "") + ") and "
             f"`{rel}/times.json` (`benchmarks/study3.py`, `benchmarks/study3_times.py`; the plan in "
             "[study_plan.md](study_plan.md))." + (" " + status if (status := status_line(study, rows, times)) else ""),
             "",
             "Each method trains U_m = floor(B / s_m) updates, B the synchronous pipeline's predicted time for "
             "sequential's U updates at its fastest schedule and micro-batch count, s_m the method's predicted "
             "seconds per mini-batch on N devices, with warm-up over 5 % of U_m and cosine decay to 10 % at U_m. "
             "The synchronous pipeline computes sequential's updates: its curve is sequential's runs at its "
             "seconds per mini-batch. Mean ± standard deviation over the seeds; the target is 99 % (101 % for "
             "perplexity) of sequential's mean final validation metric.", "",
             "**The budget** (the fastest synchronous schedule and its M, against the second study's M = N):", ""]
    lines += budget_table(settings) + [""]
    lines += same_as_lines(rows)
    lines += ["## The answer", "", "**Recommendation** (best final test metric at equal time, per task and N):", ""]
    lines += recommendation_lines(settings) + [""]
    lines += ["**Verdict per method** (against the synchronous pipeline, over the settings):", ""]
    lines += verdict_lines(settings) + [""]
    lines += ["**Learning rates carried over from the second study unchecked** (the longer schedule could "
              "move them; the others were re-tuned on the validation split, as each table's lr column says):", ""]
    lines += carried_lines(settings) + [""]
    for st in settings:
        lines += [f"### {st.name()}", ""]
        fig = curves_plot(st, figures if plots else None)
        lines += [f"![curves](results3/{fig})", ""] + setting_table(st) + [""]
    lines += ["## Closing note", "", "Verdicts and recommendation as above. Where no asynchronous method beats "
              "the synchronous pipeline at equal time, the diagnostic's reading:", ""]
    lines += closing_lines(settings) + [""]
    if equal_updates is not None:
        from make_results2 import generate as equal_update_report

        lines += demoted(equal_update_report(equal_updates, out, plots=plots, name=None))
    text = "\n".join(lines).rstrip("\n") + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(text)
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", type=Path, default=BENCHMARKS / "results" / "study3",
                        help="the study folder: runs.jsonl, times.json")
    parser.add_argument("--equal-updates", type=Path, default=BENCHMARKS / "results" / "study2",
                        help="the second study's folder, whose report follows (runs.jsonl, suite.json, times.json)")
    parser.add_argument("--alone", action="store_true", help="the equal-time report only, without the second study's")
    parser.add_argument("--out", type=Path, default=BENCHMARKS.parent / "docs", help="where the markdown goes")
    parser.add_argument("--name", default="results.md", help="the markdown's file name")
    parser.add_argument("--no-plots", action="store_true", help="write the markdown only")
    parser.add_argument("--advice", action="store_true",
                        help="print the recommendation per (task, N) whose runs are all in, as "
                             "src/pipeoptim/tasks/advice.py's ADVICE, and write nothing")
    parser.add_argument("--readme", action="store_true",
                        help="rewrite README.md's advice block and demo line from the package's ADVICE "
                             "(paste --advice first), and write nothing else")
    args = parser.parse_args(argv)
    if args.readme:
        from make_results3_advice import readme_with_advice

        readme = BENCHMARKS.parent / "README.md"
        readme.write_text(readme_with_advice(readme.read_text()))
        print(f"written: {readme} (advice block and demo line)")
        return 0
    if args.advice:
        from make_results3_advice import advice_entries, advice_source, complete_cells

        rows = read_rows(args.study)
        times = json.loads((args.study / "times.json").read_text())
        print(advice_source(advice_entries(settings_of(rows, times), complete_cells(args.study, times))))
        return 0
    text = generate(args.study, args.out, plots=not args.no_plots, name=args.name,
                    equal_updates=None if args.alone else args.equal_updates)
    print(f"written: {args.out / args.name} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
