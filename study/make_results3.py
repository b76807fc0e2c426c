"""Issue 23's report: equal time, not equal updates. In the time the synchronous pipeline takes
for sequential's updates, which pipeline gives the better model, and which reaches the target
first?

Reads the study folder's ``runs.jsonl`` (study/study3.py) and ``times.json``
(study/study3_times.py: the budget B, each variant's seconds per mini-batch s_m) and writes
``docs/results.md``: this report first, then the second study's equal-update report
(study/make_results2.py, its headings one level down), which measures statistical
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
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from study.common import RESULTS, ROOT, fmt
from study.make_results2_findings import diagnosis
# (the arithmetic, re-exported: the tests and the advice read it from here)
from study.make_results3_arith import (SCALE, SYNC, Arm, Setting, _Rows, arm_of, chosen_lr,  # noqa: F401
                                            mean_curve, read_rows, recommendation, settings_of,
                                            word_at_equal_time, word_to_target)
from pipeoptim.lab.tasks.advice import metric_name


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
    m = metric_name(st.metric)
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
    half and better in none), no worse (never worse), no better (never better, worse in some),
    else mixed (better in some, worse in as many or more)."""
    total, better, worse = sum(equal_time.values()), equal_time.get("better", 0), equal_time.get("worse", 0)
    if better * 2 > total:
        return "better than the synchronous pipeline"
    if worse * 2 > total or (worse * 2 == total and not better):
        return "worse than the synchronous pipeline"
    if not worse:
        return "no worse than the synchronous pipeline"
    return "no better than the synchronous pipeline" if not better else "mixed"


def verdict_lines(settings: Sequence[Setting]) -> List[str]:
    out = []
    for variant, t in method_tally(settings).items():
        e, g = t["equal_time"], t["target"]
        untested = f", {e['untested']} untested (one seed)" if e.get("untested") else ""
        out.append(f"  - {variant}: {method_verdict(e)} at equal time ({e.get('better', 0)} better, "
                   f"{e.get('ties', 0)} ties, {e.get('worse', 0)} worse{untested} of {sum(e.values())} settings); "
                   f"to the target: {g.get('sooner', 0)} sooner, {g.get('ties', 0)} ties, {g.get('later', 0)} later, "
                   f"{g.get('never', 0)} never" + (f", {g['untested']} untested" if g.get("untested") else ""))
    return out or ["  - no setting has the synchronous pipeline's runs and a method's yet"]


def _seeds(arm: Any) -> str:
    return f"{len(arm.rows)} seed{'s' if len(arm.rows) != 1 else ''}"


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


def demoted(markdown: str) -> List[str]:
    """``markdown``'s lines with every heading one level down (its title becomes a section)."""
    return ["#" + line if line.startswith("#") else line for line in markdown.rstrip("\n").splitlines()]


def generate(study: Path, out: Path, plots: bool = True, name: str = "results.md",
             equal_updates: Optional[Path] = None, delay_fixes: Optional[Path] = None,
             translation: Optional[Path] = None, feedback: Optional[Path] = None,
             confirm: Optional[Path] = None) -> str:
    """Write ``out/name`` (and ``out/results3/*.png`` with ``plots``); return the markdown. With
    ``equal_updates`` (the second study's folder) the second study's report follows, its headings
    one level down (and its figures in ``out/results2/``). With ``delay_fixes`` (issue 38's arm's
    folder, study/make_results4.py) its rows join the study's and its section opens the report;
    with ``translation`` (issue 41's cell's folder, study/make_results5.py) its rows and
    budgets join too, and its section follows; with ``feedback`` (issue 51's arms' folder,
    study/make_results6.py) its rows join too (the image advice's third seed among them), and
    its section follows issue 41's."""
    from study.make_results3_advice import cut_lines, same_as_lines, status_line
    from study.make_results3_plot import curves_plot
    from study.make_results4 import arm_lines
    from study.make_results5 import section_lines
    from study import make_results6
    from study.study7_plan import merged_arms

    study_rows = read_rows(study)
    written = sum(1 for line in (study / "runs.jsonl").read_text().splitlines() if line.strip())
    rows, times = merged_arms(study, delay_fixes, translation, feedback)
    feedback_runs = make_results6.planned(feedback, study, [study, delay_fixes, translation], translation)
    settings = settings_of(rows, times)
    figures = out / "results3"
    if plots:
        figures.mkdir(parents=True, exist_ok=True)
    rel = study.resolve().relative_to(ROOT) if study.resolve().is_relative_to(ROOT) \
        else study.name
    lines = ["# Equal time, not equal updates: which pipeline gives the better model in the time a synchronous "
             "one takes?", "",
             f"Generated by `study/make_results3.py` from `{rel}/runs.jsonl` ({len(study_rows)} rows"
             + (f"; {written - len(study_rows)} repeated row(s) of a run dropped, the first kept"
                if written > len(study_rows) else "") + ") and "
             f"`{rel}/times.json` (`study/study3.py`, `study/study3_times.py`; the plan in "
             "[study_plan.md](study_plan.md))." + (" " + status if (status := status_line(study, study_rows, times)) else ""),
             "",
             "Each method trains U_m = floor(B / s_m) updates, B the synchronous pipeline's predicted time for "
             "sequential's U updates at its fastest schedule and micro-batch count, s_m the method's predicted "
             "seconds per mini-batch on N devices, with warm-up over 5 % of U_m and cosine decay to 10 % at U_m. "
             "The synchronous pipeline computes sequential's updates: its curve is sequential's runs at its "
             "seconds per mini-batch. Mean ± standard deviation over the seeds; the target is 99 % (101 % for "
             "perplexity) of sequential's mean final validation metric.", "",
             ]
    if confirm is not None:  # the answer first (issue 61), then the arms it was chosen from
        from study.make_results7 import confirmations, section_lines as confirmed_lines

        lines += confirmed_lines(confirmations(confirm))
    lines += arm_lines(settings, delay_fixes) if delay_fixes is not None else []
    lines += section_lines(settings, translation)
    lines += make_results6.section_lines(rows, feedback_runs, feedback, times) if feedback is not None else []
    lines += ["**The budget** (the fastest synchronous schedule and its M, against the second study's M = N):", ""]
    lines += budget_table(settings) + [""]
    lines += cut_lines(study, times)
    lines += same_as_lines(rows)
    lines += ["## Every arm, on the seeds that chose it", "", "What follows is the exploration the answer's arms were "
              "chosen from: every arm on the seeds its choice read (each variant's lr chosen on their validation "
              "metric), so their test numbers are not the answer. Each word against the synchronous pipeline is "
              "Welch's two-sided t-test at 0.05 on these seeds, uncorrected for the many arms (an arm on one seed "
              "is untested).", "", "**Verdict per method** (against the synchronous pipeline, over the settings):", ""]
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
        from study.make_results2 import generate as equal_update_report

        lines += demoted(equal_update_report(equal_updates, out, plots=plots, name=None))
    text = "\n".join(lines).rstrip("\n") + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(text)
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", type=Path, default=RESULTS / "study3",
                        help="the study folder: runs.jsonl, times.json")
    parser.add_argument("--equal-updates", type=Path, default=RESULTS / "study2",
                        help="the second study's folder, whose report follows (runs.jsonl, suite.json, times.json)")
    parser.add_argument("--alone", action="store_true", help="the equal-time report only, without the second study's")
    parser.add_argument("--delay-fixes", type=Path, default=RESULTS / "study3-delay_fixes",
                        help="issue 38's arm's folder, whose rows join the study's and whose section opens the report")
    parser.add_argument("--translation", type=Path, default=RESULTS / "study3-translation",
                        help="issue 41's cell's folder, whose rows and budgets join the study's and whose section "
                             "follows issue 38's")
    parser.add_argument("--feedback", type=Path, default=RESULTS / "study3-feedback",
                        help="issue 51's arms' folder, whose rows join the study's (the image advice's third seed "
                             "among them) and whose section follows issue 41's")
    parser.add_argument("--confirm", type=Path, default=RESULTS / "study3-confirm",
                        help="issue 61's confirmation folder, whose section (the answer) opens the report")
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="where the markdown goes")
    parser.add_argument("--name", default="results.md", help="the markdown's file name")
    parser.add_argument("--no-plots", action="store_true", help="write the markdown only")
    parser.add_argument("--package", action="store_true",
                        help="write the package's table of the study's conclusions (the recommendation per (task, N) "
                             "whose runs are all in, and the ratios of updates to the target of its settings), "
                             "src/pipeoptim/lab/tasks/equal_time_study.json, and nothing else")
    parser.add_argument("--readme", action="store_true",
                        help="rewrite README.md's advice block and demo line from the package's ADVICE "
                             "(write --package first) and its options table from pipeoptim.options, and "
                             "docs/measurements.md's findings and demo line from the confirmation, and "
                             "write nothing else")
    args = parser.parse_args(argv)
    if args.readme:
        from study.make_results3_advice import readme_with_advice, readme_with_options
        from study.make_results7 import MEASUREMENTS, measurements_with_findings

        readme = ROOT / "README.md"
        readme.write_text(readme_with_options(readme_with_advice(readme.read_text())))
        measurements = ROOT / MEASUREMENTS
        measurements.write_text(measurements_with_findings(measurements.read_text()))
        print(f"written: {readme} (advice block, demo line and options table), {measurements} (findings, demo line)")
        return 0
    if args.package:
        from study.package_table import write

        print(f"written: {write(args.study, args.delay_fixes, args.translation, args.feedback)}")
        return 0
    text = generate(args.study, args.out, plots=not args.no_plots, name=args.name,
                    equal_updates=None if args.alone else args.equal_updates, delay_fixes=args.delay_fixes,
                    translation=args.translation, feedback=args.feedback, confirm=args.confirm)
    print(f"written: {args.out / args.name} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
