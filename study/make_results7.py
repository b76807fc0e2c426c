"""Issue 61's report: the equal-time study's answer, confirmed on fresh seeds.

Per task at N = 8 (study/study7_plan.py ran the runs, study/selection.py chose the arms on
validation): the synchronous and the asynchronous arm, their runs on fresh seeds, Welch's one-sided
test that the asynchronous arm gives the better test metric, corrected over the four tasks (Holm
once every task is in; Bonferroni, never smaller, while some still run), the difference and its
95 % interval; the verdict before (the old rule: the best test mean of every arm, a win beyond the
larger seed spread) and after. Then how often each rule calls a tie a win (stats.false_win_rates on
each task's own spreads), and how the verdicts stand if the asynchronous methods' speed-up were
the share of the predicted one that benchmarks/plan_vs_bench measured.

A verdict: **better** where the corrected p is below 0.05; **worse** where the whole 95 % interval
lies on the worse side; else **no detectable difference** (a tie at this many seeds). The advice
(:func:`advice_entries`) recommends the asynchronous arm only where it is better, else the
synchronous pipeline, for a task whose confirmation runs are all in."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from study.common import RESULTS, ROOT, fmt, mean_sd
from study.make_results2_data import final_score
from study.make_results3_arith import SYNC, MetricUnits, settings_of
from study.make_results3_arith import recommendation as old_recommendation
from study.selection import Choice
from study.stats import ALPHA, Comparison, false_win_rates, family_false_win, holm, welch
from study.study3_plan import load_rows
from study.study3_suite import SUITES
from study import study7_plan
from pipeoptim.lab.tasks import get_task
from pipeoptim.lab.tasks.advice import metric_name

FOLDER = RESULTS / "study3-confirm"
PLAN_VS_BENCH = ROOT / "benchmarks" / "results" / "plan_vs_bench.json"


@dataclass
class Confirmed(MetricUnits):
    """One task's confirmation: its arms, their fresh-seed runs, the test and the verdicts."""

    task: str
    metric: str
    higher: bool
    synchronous: Optional[Choice]
    asynchronous: Optional[Choice]
    candidates: Tuple[int, int]                 #: (synchronous, asynchronous) arms the choice weighed
    sync_rows: List[Dict[str, Any]] = field(default_factory=list)
    async_rows: List[Dict[str, Any]] = field(default_factory=list)
    planned: int = 0                            #: confirmation runs planned (not dropped)
    done: int = 0
    comparison: Optional[Comparison] = None     #: on the test metric
    p_corrected: Optional[float] = None
    before: str = ""                            #: the old rule's recommendation and verdict

    @property
    def complete(self) -> bool:
        return self.planned > 0 and self.done == self.planned

    def verdict(self) -> str:
        if not self.complete:
            return f"running ({self.done} of {self.planned} runs in)"
        c = self.comparison
        if c is None:
            return "no test (fewer than 2 runs a side)"
        if self.p_corrected is not None and self.p_corrected < ALPHA:
            return "better"
        if c.high < 0:
            return "worse"
        return "no detectable difference"

    def recommended(self) -> Optional[Choice]:
        """The arm the advice names: the asynchronous one only where it is better."""
        if not self.complete:
            return None
        return self.asynchronous if self.verdict() == "better" else self.synchronous

    def finals(self, rows: Sequence[Dict[str, Any]]) -> List[float]:
        return [final_score(r, self.higher) for r in rows]


def confirmations(folder: Path = FOLDER, suite_name: str = "confirm") -> Dict[str, Confirmed]:
    """task -> its confirmation, from the earlier arms' rows and ``folder``'s."""
    suite = SUITES[suite_name]
    prior_list, times = study7_plan.prior_rows(suite)
    prior = {study7_plan.row_key(r): r for r in prior_list}
    rows = load_rows(folder / "runs.jsonl")
    picked = study7_plan.choices(suite, rows, times, prior)
    runs = study7_plan.plan_runs(suite, rows, times, prior)
    settings = settings_of(prior_list, times)
    out: Dict[str, Confirmed] = {}
    for task in suite["order"]:
        info = get_task(task)
        p = picked[task]
        kinds = [c.synchronous for c in p["candidates"]]
        mine = [r for r in runs if r.task == task and r.phase == "confirm" and r.status != "dropped"]
        seeds = [r.seed for r in mine]
        result = Confirmed(task, info.metric, info.higher_is_better, p["synchronous"], p["asynchronous"],
                           (sum(kinds), len(kinds) - sum(kinds)), planned=len(mine),
                           done=sum(r.status == "done" for r in mine))
        if result.synchronous is not None:
            result.sync_rows = study7_plan.confirmation_rows(rows, result.synchronous, seeds)
        if result.asynchronous is not None:
            result.async_rows = study7_plan.confirmation_rows(rows, result.asynchronous, seeds)
        if len(result.sync_rows) >= 2 and len(result.async_rows) >= 2:
            result.comparison = welch(result.finals(result.async_rows), result.finals(result.sync_rows),
                                      result.higher)
        result.before = before(settings, task, result)
        out[task] = result
    tested = {t: c.comparison.p for t, c in out.items() if c.comparison is not None}
    every = all(c.complete for c in out.values())
    corrected = holm(tested) if every else {t: min(1.0, len(out) * p) for t, p in tested.items()}
    for task, p in corrected.items():
        out[task].p_corrected = p
    return out


def before(settings: Sequence[Any], task: str, result: Confirmed) -> str:
    """The old rule's recommendation (picked on test over every arm and seed run so far)."""
    rec = old_recommendation(settings, task, 8)
    if rec is None:
        return "-"
    st, variant = rec["setting"], rec["variant"]
    name = "synchronous" if variant == SYNC else variant
    if variant == SYNC or rec["synchronous"] is None:
        return f"{name} with {st.optimizer}: no asynchronous win"
    sync_st = rec["synchronous"][0]
    margin = (st.final(variant)[0] - sync_st.final(SYNC)[0]) * result.scale
    return f"{name} with {st.optimizer}: a win ({margin:+.{result.digits}f} beyond the larger spread)"


# --------------------------------------------------------------------------------------------
# the text


def value(result: Confirmed, rows: Sequence[Dict[str, Any]]) -> str:
    """Mean ± sd of ``rows``' final test metric, and how many."""
    return f"{fmt(mean_sd(result.finals(rows)), result.scale, result.digits)} ({len(rows)})" if rows else "-"


def choice_text(result: Confirmed, choice: Optional[Choice]) -> str:
    if choice is None:
        return "waits for its bracketing run"
    seeds = len(choice.seeds)
    return (f"{'synchronous' if choice.synchronous else choice.variant}, {choice.optimizer}, lr {choice.lr:g} "
            f"(validation {choice.validation * result.scale:.{result.digits}f} over {seeds} seed{'s' * (seeds != 1)})")


def choice_table(results: Dict[str, Confirmed]) -> List[str]:
    lines = ["| task | metric | synchronous arm | asynchronous arm | arms weighed (sync / async) |", "|---|---|---|---|---|"]
    for r in results.values():
        lines.append(f"| {r.task} | {metric_name(r.metric)} | {choice_text(r, r.synchronous)} | "
                     f"{choice_text(r, r.asynchronous)} | {r.candidates[0]} / {r.candidates[1]} |")
    return lines


def confirmation_table(results: Dict[str, Confirmed]) -> List[str]:
    lines = ["| task | synchronous: test (seeds) | asynchronous: test (seeds) | difference, better > 0 (95 % interval) "
             "| p, one-sided | p, corrected | before: the old rule, on test | after |", "|---|---|---|---|---|---|---|---|"]
    for r in results.values():
        c = r.comparison
        diff = (f"{c.effect * r.scale:+.{r.digits}f} [{c.low * r.scale:+.{r.digits}f}, {c.high * r.scale:+.{r.digits}f}]"
                if c else "-")
        p = p_text(c.p) if c else "-"
        pc = p_text(r.p_corrected) if r.p_corrected is not None else "-"
        lines.append(f"| {r.task} | {value(r, r.sync_rows)} | {value(r, r.async_rows)} | {diff} | {p} | {pc} | "
                     f"{r.before} | **{r.verdict()}** |")
    return lines


def p_text(p: float) -> str:
    """A p-value as the report writes it (three decimals; below 0.001 as "< 0.001")."""
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def spreads(result: Confirmed) -> Tuple[float, float]:
    """(async sd, sync sd) of the test metric over the confirmation runs (2 or more), else 1, 1
    (the rates are the same for any common scale)."""
    a, s = result.finals(result.async_rows), result.finals(result.sync_rows)
    if len(a) >= 2 and len(s) >= 2 and statistics.stdev(a) > 0 and statistics.stdev(s) > 0:
        return statistics.stdev(a), statistics.stdev(s)
    return 1.0, 1.0


def false_win_table(results: Dict[str, Confirmed], draws: int = 20000) -> List[str]:
    lines = ["| task | spreads (async / sync) | old rule, one arm | old rule, best of the task's asynchronous arms on "
             "test (2 seeds each against 3, as it ran) | Welch, one-sided, alone | Welch with Holm over 4 tasks |", "|---|---|---|---|---|---|"]
    for r in results.values():
        sa, ss = spreads(r)
        seeds = max(3, min(len(r.async_rows), len(r.sync_rows)))
        rates = false_win_rates(sa, ss, seeds=seeds, arms=max(1, r.candidates[1]), draws=draws)
        same = (sa, ss) == (1.0, 1.0)
        lines.append(f"| {r.task} ({seeds} seeds a side) | "
                     + ("equal (not in yet)" if same else f"{sa * r.scale:.{r.digits}f} / {ss * r.scale:.{r.digits}f}")
                     + f" | {rates['old']:.1%} | {rates['old_best_of']:.1%} (of {r.candidates[1]}) | {rates['new']:.1%} "
                     f"| {rates['new_holm']:.1%} |")
    return lines


def measured_factor(method: str, schedule: str, path: Path = PLAN_VS_BENCH) -> Optional[float]:
    """How much slower than predicted an asynchronous method ran against the synchronous schedule
    (plan_vs_bench: predicted / measured throughput of the method over that of the schedule); a
    method it did not measure takes its asynchronous family's largest; None without the file."""
    if not path.exists():
        return None
    rows = json.loads(path.read_text())["rows"]
    ratio = {r["method"]: r["ratio"] for r in rows}
    family = max(r["ratio"] for r in rows if r["family"] == "asynchronous")
    base = {"xpipe": "pipeoptim", "pipeoptim-2bw": "pipedream-2bw"}.get(method, method)
    return max(1.0, ratio.get(base, family) / ratio[schedule]) if schedule in ratio else None


def sensitivity_lines(results: Dict[str, Confirmed]) -> List[str]:
    out = []
    for r in results.values():
        if r.asynchronous is None or not r.complete:
            continue
        method = r.asynchronous.variant.split("+")[0]
        k = measured_factor(method, "zb-h1")
        if r.verdict() != "better":
            out.append(f"  - {r.task}: {r.verdict()}; an asynchronous pipeline slower than predicted "
                       f"(x{k:.2f} per mini-batch measured for {method}'s family) only trains fewer updates in the "
                       "budget, so the verdict stands" if k else f"  - {r.task}: {r.verdict()}; stands")
            continue
        curves = [[(e["updates"], e["metric"]) for e in row["evaluations"]] for row in r.async_rows]
        updates = r.async_rows[0]["updates"]
        fewer = int(updates / (k or 1.0))
        at = [max((u for u in curve if u[0] <= fewer), default=(0, math.nan))[1] for curve in curves]
        sync = statistics.mean(row["validation_metric"] for row in r.sync_rows)
        out.append(f"  - {r.task}: better; at the measured speed-up (x{k:.2f} per mini-batch, {fewer} of {updates} "
                   f"updates) its validation curve reads {statistics.mean(at) * r.scale:.{r.digits}f} against the "
                   f"synchronous pipeline's final {sync * r.scale:.{r.digits}f} (its schedule not shortened: a "
                   "pessimistic reading)")
    return out or ["  - no task is confirmed yet"]


def section_lines(results: Optional[Dict[str, Confirmed]] = None, draws: int = 20000) -> List[str]:
    results = results if results is not None else confirmations()
    planned = sum(r.planned for r in results.values())
    done = sum(r.done for r in results.values())
    status = ("All confirmation runs are in." if done == planned else
              f"**The confirmation is still running: {done} of {planned} planned runs are in**; a task without "
              "all of its runs has no verdict yet, and the advice names the synchronous pipeline for it.")
    return ["## The answer, confirmed on fresh seeds", "",
            "Generated by `study/make_results7.py` from `study/results/study3-confirm/runs.jsonl` "
            "(`python -m study.study3 --suite confirm`, planned by `study/study7_plan.py`). " + status, "",
            "Every choice is made on the validation split (`study/selection.py`; a test holds that the choice "
            "cannot read a test metric): per task, the synchronous pipeline of the optimizer with the best mean "
            "validation metric, and of every asynchronous variant and optimizer the one with the best. Each "
            "runs again on fresh seeds (100-102; 103-104 where the first three leave the question open by a rule "
            "fixed before the first run: a one-sided validation p in [0.0125, 0.5)). The verdict rests on these "
            "runs alone: Welch's t-test, one-sided (is the asynchronous arm better?), corrected for the four "
            "tasks (Holm; Bonferroni while some still run), with the difference and its 95 % interval. Better: "
            "corrected p below 0.05; worse: the whole interval on the worse side; else no detectable difference. "
            "Where the synchronous pipeline's lr sat at an edge of the second study's grid, one more lr a factor 2 "
            "beyond was run first, as the asynchronous arms got; error feedback's measured 1.9 % more time per "
            "update is taken out of its arm's updates.", "",
            "**The arms, chosen on validation:**", ""] + choice_table(results) + [
            "", "**Their confirmation on fresh seeds** (final test metric, mean ± sd over the seeds):", ""] + \
        confirmation_table(results) + [
            "", f"**How often a rule calls a tie a win** (two equal arms, normal noise with each task's spreads, "
            f"{draws:,} draws; Holm's family-wise rate over four equal tasks: {family_false_win(draws=draws):.1%}):", ""] + \
        false_win_table(results, draws) + [
            "", "**If the asynchronous methods were slower than the simulator predicts** (benchmarks/plan_vs_bench: "
            "predicted over measured throughput, the method's against zb-h1's):", ""] + sensitivity_lines(results) + [""]


# --------------------------------------------------------------------------------------------
# the advice the package ships


def arm_setting(choice: Choice, times: Dict[str, Any]) -> Tuple[str, Dict[str, Any], int]:
    """(method, options, micro-batches) that train ``choice``: the synchronous pipeline at the
    budget's fastest schedule, an asynchronous variant as the study ran it."""
    from study.study3_suite import variant_microbatches, variant_spec

    if choice.synchronous:
        fastest = times["cells"][choice.task][choice.optimizer]["stages"][str(choice.stages)]["budget"]["fastest"]
        schedule = fastest["schedule"]
        method, options = ("interleaved", {"chunks": 2}) if schedule == "interleaved-1f1b" else (schedule, {})
        return method, options, int(fastest["microbatches"])
    method, options, _ = variant_spec(choice.variant, choice.stages)
    return method, options, variant_microbatches(choice.variant, choice.stages)


def advice_entries(results: Dict[str, Confirmed], times: Dict[str, Any],
                   beta1: Dict[str, float]) -> Dict[Tuple[str, int], Dict[str, Any]]:
    """(task, N) -> ``pipeoptim.lab.tasks.advice.Advice``'s fields, for every task whose
    confirmation is complete: the asynchronous arm where it is better, else the synchronous one,
    against the other arm."""
    out: Dict[Tuple[str, int], Dict[str, Any]] = {}
    for r in results.values():
        chosen = r.recommended()
        if chosen is None or r.comparison is None:
            continue
        other = r.synchronous if chosen is r.asynchronous else r.asynchronous
        mine, theirs = ((r.async_rows, r.sync_rows) if chosen is r.asynchronous else (r.sync_rows, r.async_rows))
        method, options, micro = arm_setting(chosen, times)
        if chosen.optimizer in beta1:
            options = {**options, "beta1": beta1[chosen.optimizer]}
        (value, spread), (rival, rival_sd) = mean_sd(r.finals(mine)), mean_sd(r.finals(theirs))
        c = r.comparison
        # the comparison's effect is asynchronous - synchronous, better > 0; the margin is the
        # recommended arm's value - the other's, in the metric's own unit
        flip = (1.0 if r.higher else -1.0) * (1.0 if chosen is r.asynchronous else -1.0)
        low, high = sorted((flip * c.low, flip * c.high))
        out[(r.task, chosen.stages)] = {
            "task": r.task, "stages": chosen.stages, "method": method, "synchronous": chosen.synchronous,
            "microbatches": int(micro), "options": tuple((k, f"{v:g}" if isinstance(v, float) else str(v))
                                                         for k, v in sorted(options.items())),
            "optimizer": chosen.optimizer, "lr": chosen.lr, "metric": r.metric, "value": round(value, 6),
            "spread": round(spread, 6), "seeds": len(mine), "runner_up": other.name(),
            "runner_up_value": round(rival, 6), "runner_up_spread": round(rival_sd, 6), "runner_up_seeds": len(theirs),
            "margin": round(value - rival, 6), "low": round(low, 6), "high": round(high, 6),
            "p_value": round(r.p_corrected, 6), "verdict": r.verdict()}
    return out


def package_advice(folder: Path = FOLDER, suite_name: str = "confirm") -> Dict[Tuple[str, int], Dict[str, Any]]:
    """The package's ADVICE entries from the confirmation, in the study's task order."""
    suite = SUITES[suite_name]
    _, times = study7_plan.prior_rows(suite)
    return advice_entries(confirmations(folder, suite_name), times, suite["optimizer_arms"]["beta1"])


# --------------------------------------------------------------------------------------------
# the findings docs/measurements.md carries (written by python -m study.make_results3 --readme)


def budget_sentence(times: Dict[str, Any], stages: int = 8) -> str:
    """What the budgets say at N = ``stages``: the fastest synchronous schedule, and how many
    times the synchronous pipeline's updates the asynchronous 1F1B methods and the 2BW schedule run."""
    schedules, one_f, two_bw = set(), [], []
    for by_opt in times["cells"].values():
        for cell in by_opt.values():
            at_n = cell["stages"].get(str(stages))
            if at_n is None:
                continue
            b = at_n["budget"]
            schedules.add(f"{b['fastest']['schedule']} at M = {b['fastest']['microbatches']}")
            for variant, u in b["updates"].items():
                (two_bw if "2bw" in variant or variant.endswith("+MN") else one_f).append(u / b["sequential_updates"])
    return (f"At N = {stages} the synchronous pipeline at its best is {', '.join(sorted(schedules))} in every "
            f"setting; in its time the asynchronous 1F1B methods run {min(one_f):.1f}-{max(one_f):.1f}x its updates, "
            f"the 2BW schedule {min(two_bw):.1f}-{max(two_bw):.1f}x (the schedule simulator's prediction).")


def finding(r: Confirmed) -> str:
    """One task's confirmed finding, a sentence."""
    if r.synchronous is None or r.asynchronous is None:
        return f"{r.task}: its arms are still being chosen (a bracketing run to come)"
    arms = (f"the synchronous pipeline with {r.synchronous.optimizer} (lr {r.synchronous.lr:g}) against "
            f"{r.asynchronous.variant} with {r.asynchronous.optimizer} (lr {r.asynchronous.lr:g}), both chosen on "
            "validation")
    if not r.complete or r.comparison is None:
        return f"{r.task}: {arms}; confirmation {r.verdict()}"
    c, name = r.comparison, metric_name(r.metric)
    sign = 1.0 if r.higher else -1.0
    low, high = sorted((sign * c.low, sign * c.high))
    return (f"{r.task}: {arms}; test {name} {value(r, r.sync_rows)} against {value(r, r.async_rows)} (fresh seeds); "
            f"difference {sign * c.effect * r.scale:+.{r.digits}f}{'' if r.higher else ' (lower is better)'}, 95 % "
            f"interval [{low * r.scale:+.{r.digits}f}, {high * r.scale:+.{r.digits}f}], corrected p "
            f"{'< 0.001' if r.p_corrected < 0.001 else f'= {r.p_corrected:.3f}'}: "
            + {"better": "the asynchronous arm is **better**", "worse": "the asynchronous arm is **worse**"}.get(
                r.verdict(), f"**{r.verdict()}**"))


def findings_lines(results: Optional[Dict[str, Confirmed]] = None) -> List[str]:
    """docs/measurements.md's block: the budgets, then each task's confirmed finding."""
    results = results if results is not None else confirmations()
    _, times = study7_plan.prior_rows(SUITES["confirm"])
    better = [t for t, r in results.items() if r.complete and r.verdict() == "better"]
    done = [t for t, r in results.items() if r.complete]
    summary = (("Confirmed on all " if len(done) == len(results) else f"Confirmed so far: {len(done)} of ")
               + f"{len(results)} tasks; an asynchronous pipeline gives the better model in the same time on "
               f"{', '.join(better) if better else 'none of them'}.")
    return [budget_sentence(times), "", summary, ""] + [f"* {finding(r)}." for r in results.values()]


#: docs/measurements.md's generated blocks: the study's findings and the demo's last line
FINDINGS_START = ("<!-- findings: study/make_results7.findings_lines, written by python -m study.make_results3 "
                  "--readme (study/tests/test_confirm.py) -->\n")
FINDINGS_END = "<!-- /findings -->"
MEASUREMENTS = "docs/measurements.md"


def measurements_with_findings(text: str) -> str:
    """docs/measurements.md with its findings block and its demo's advice line written from the
    confirmation (study/make_results7.py) and the package's table."""
    import textwrap

    from pipeoptim.lab.tasks.advice import advice
    from study.make_results3_advice import WIDTH

    start = text.index(FINDINGS_START) + len(FINDINGS_START)
    block = "\n".join(textwrap.fill(line, WIDTH, subsequent_indent="  " if line.startswith("* ") else "",
                                     break_on_hyphens=False, break_long_words=False) if line else ""
                       for line in findings_lines())
    text = text[:start] + block + "\n" + text[text.index(FINDINGS_END):]
    demo = text.index("which method to use: ")
    line = textwrap.fill("which method to use: " + advice("image", 4)[1], WIDTH, subsequent_indent="  ",
                         break_on_hyphens=False, break_long_words=False)
    return text[:demo] + line + "\n" + text[text.index("```", demo):]
