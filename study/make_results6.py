"""Issue 51's section of the equal-time report: error feedback's open ends at N = 8 (the plan and
its rules: study/study6_plan.py; rows in ``study/results/study3-feedback/runs.jsonl``, written by
``python -m study.study3 --suite feedback``).

``make_results3.py`` merges the suite's rows into the study's (:func:`with_feedback`), so that
the image advice's third seed joins its first two (issue 38's arm) in every part of the report,
translation with Muon and error feedback joins its cell's table, and the feedback-aware
prediction (``pipeoptim-2bw+ef+aware``) is a variant of its settings. The package's advice and
ratios (study/make_results4.py's package_sources) take a feedback arm's rows, an arm being a
(task, optimizer, variant), once every planned run of that arm is in or cut
(:func:`complete_arms`). :func:`section_lines` adds the suite's own section: how far its plan
is, what rows each arm has (the aware prediction's each beside plain error feedback's row at the
same lr and seed), which planned runs are not in yet, and why the aware prediction can change
little.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from study.common import fmt
from study.make_results3_arith import SYNC, read_rows, recommendation, settings_of, word_at_equal_time
from study.make_results5 import plan_status
from study.study3_plan import load_rows
from study.study3_suite import SUITES
from study.study6_plan import AWARE, EF, aliased, plan_runs

SUITE = "feedback"
STAGES = 8


def with_feedback(rows: List[Dict[str, Any]], times: Dict[str, Any], folder: Optional[Path],
                  arms: Optional[Set[Tuple[str, str, str]]] = None) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """``rows`` with the suite's rows merged in (those of the (task, optimizer, variant) in ``arms``
    only, where given) and ``times`` with the aware variant's budgets filled in from
    pipeoptim-2bw's; unchanged where the folder has no rows."""
    if folder is None or not (folder / "runs.jsonl").exists():
        return rows, times
    mine = [r for r in read_rows(folder) if arms is None or (r["task"], r["optimizer"], r["variant"]) in arms]
    return rows + mine, aliased(times)


def planned(folder: Optional[Path], study: Path, prior: Sequence[Path], translation: Optional[Path]) -> List[Any]:
    """The suite's plan against its rows (empty where the folder has none), over the earlier arms'
    rows (``prior``: the folders of issue 23's study, issue 38's arm, issue 41's cell) and the
    budgets of ``study`` and the translation cell."""
    if folder is None or not (folder / "runs.jsonl").exists():
        return []
    suite = copy.deepcopy(SUITES[SUITE])
    times = json.loads((study / "times.json").read_text())
    if translation is not None and (translation / "times.json").exists():
        cell = json.loads((translation / "times.json").read_text())
        times.setdefault("cells", {}).update(copy.deepcopy(cell.get("cells", {})))
    earlier: Dict[str, Dict[str, Any]] = {}
    for path in prior:
        if path is not None and (path / "runs.jsonl").exists():
            earlier.update(load_rows(path / "runs.jsonl"))
    return plan_runs(suite, load_rows(folder / "runs.jsonl"), aliased(times), earlier)


def complete_arms(runs: Sequence[Any]) -> Set[Tuple[str, str, str]]:
    """The (task, optimizer, variant) whose every planned run is in or cut, one at least in."""
    arms: Dict[Tuple[str, str, str], List[str]] = {}
    for r in runs:
        arms.setdefault((r.task, r.optimizer, r.variant), []).append(r.status)
    return {arm for arm, said in arms.items() if "done" in said and all(s in ("done", "dropped") for s in said)}


def _value(row: Optional[Dict[str, Any]]) -> str:
    if row is None:
        return "(not in yet)"
    if row.get("diverged") or row.get("final_metric") is None:
        return "diverged"
    scale = 100.0 if row["metric"] == "accuracy" else 1.0
    return f"{row['final_metric'] * scale:.{2 if row['metric'] == 'accuracy' else 1}f}"


def _rows_of(rows: Sequence[Dict[str, Any]], task: str, optimizer: str, variant: str) -> List[Dict[str, Any]]:
    return sorted([r for r in rows if (r["task"], r["optimizer"], r["variant"], r["stages"])
                   == (task, optimizer, variant, STAGES) and r.get("until") != "third"],
                  key=lambda r: (r["lr"], r["seed"]))


def muon_table(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """Translation with Muon and error feedback: every row in, with its validation and test BLEU."""
    lines = ["| phase | lr | seed | validation BLEU | final test BLEU |", "|---|---|---|---|---|"]
    for r in _rows_of(rows, "translation", "muon", EF):
        lines.append(f"| {r['phase']} | {r['lr']:g} | {r['seed']} | "
                     f"{'-' if r.get('validation_metric') is None else format(r['validation_metric'], '.1f')} | "
                     f"{_value(r)} |")
    return lines if len(lines) > 2 else ["  - no row in yet"]


def aware_table(rows: Sequence[Dict[str, Any]], cells: Sequence[Tuple[str, str]]) -> List[str]:
    """The aware prediction's rows, each beside plain error feedback's at the same lr and seed; a
    cell without any, a line saying so."""
    lines = ["| task, optimizer | lr | seed | final test, +ef+aware | final test, +ef | difference |",
             "|---|---|---|---|---|---|"]
    for task, optimizer in cells:
        plain = {(r["lr"], r["seed"]): r for r in _rows_of(rows, task, optimizer, EF)}
        aware = _rows_of(rows, task, optimizer, AWARE)
        if not aware:
            lines.append(f"| {task}, {optimizer} | - | - | (none in yet) | - | - |")
        for r in aware:
            other = plain.get((r["lr"], r["seed"]))
            diff = "-"
            if other is not None and None not in (r.get("final_metric"), other.get("final_metric")) \
                    and not r.get("diverged") and not other.get("diverged"):
                scale = 100.0 if r["metric"] == "accuracy" else 1.0
                digits = 2 if r["metric"] == "accuracy" else 1
                diff = f"{(r['final_metric'] - other['final_metric']) * scale:+.{digits}f}"
            lines.append(f"| {task}, {optimizer} | {r['lr']:g} | {r['seed']} | {_value(r)} | {_value(other)} "
                         f"| {diff} |")
    return lines


def probe_lines(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """Per run that also probed the other prediction (without using it), plain error feedback's
    (``+ef``) and the aware one's (``+ef+aware``), each's error over the staleness error per
    stage: the run's own prediction and the one it probed, on the same weights."""
    out = []
    probe = {EF: "with predict_feedback", AWARE: "without predict_feedback"}
    for r in sorted([r for r in rows if r["variant"] in probe], key=lambda r: (r["variant"] != EF, r["task"],
                                                                               r["optimizer"], r["lr"], r["seed"])):
        stages = [s for group in r.get("prediction_error") or [] for s in group
                  if s.get("probes") and s.get("staleness_error")]
        other = probe[r["variant"]]
        if not stages or any(other not in (s.get("variants") or {}) for s in stages):
            continue
        own = ", ".join(f"{s['prediction_error'] / s['staleness_error']:.2f}" for s in stages)
        probed = ", ".join(f"{s['variants'][other] / s['staleness_error']:.2f}" for s in stages)
        plain, aware = (own, probed) if r["variant"] == EF else (probed, own)
        out.append(f"  - {r['task']}, {r['optimizer']}, lr {r['lr']:g}, seed {r['seed']}, a run of {r['variant']}: "
                   f"plain {plain}; aware {aware}")
    return out


def finding_lines() -> List[str]:
    """Why the aware prediction can change little (measured while it was built)."""
    return ["**Why the aware prediction can do little.** The aware prediction, W - (lr s + beta lr) Delta + "
            "beta u_prev, and the plain one differ only by beta (u_prev - lr Delta). Delta is the direction of "
            "the step just applied, so lr Delta is almost u_prev, and the difference almost vanishes: with "
            "momentum SGD it is zero up to rounding (the losses agree to 1e-12); with AdamW what is left comes "
            "only from the lr schedule's change between steps and from decoupled weight decay. On a small "
            "8-stage model (AdamW, 300 updates) the per-stage error over staleness (stages 0-6) was 0.44, "
            "0.48, 0.54, 0.69, 0.78, 1.21, 2.73 for pipeoptim-2bw; 0.79, 0.89, 1.01, 1.26, 1.45, 2.25, 4.95 "
            "with error feedback; and 0.80, 0.89, 1.02, 1.27, 1.46, 2.25, 4.95 with error feedback and the "
            "aware prediction. What the prediction misses is error feedback's own term, beta (u_t - u_(t-1)): "
            "how the step changes from one update to the next, which no extrapolation of the last step can "
            "foresee.", ""]


#: the issue's changes in the order they were made: (what the step says, which rows it adds, the
#: variant it changed, the variant it made). The image arm's rows are issue 38's (held back until
#: the planner could plan error feedback) and the suite's third seed.
STEPS = [("error feedback on image (issue 38's arm merged, a third seed)",
          lambda r: r["task"] == "image" and r["variant"] == EF, "pipeoptim-2bw", EF),
         ("error feedback on translation with Muon", lambda r: (r["task"], r["optimizer"], r["variant"])
          == ("translation", "muon", EF), "pipeoptim-2bw", EF),
         ("the aware prediction", lambda r: r["variant"] == AWARE, EF, AWARE)]


def _named(rec: Optional[Dict[str, Any]]) -> str:
    if rec is None:
        return "-"
    if rec["variant"] == SYNC:
        return f"the synchronous pipeline with {rec['setting'].optimizer}"
    return f"`{rec['variant']}` with {rec['setting'].optimizer}"


def gap_tables(rows: Sequence[Dict[str, Any]], times: Dict[str, Any]) -> List[str]:
    """What each change did to the gap, a table per task it touched: per optimizer, the variant the
    change was made to and the variant it made, each with its final test metric at equal time and
    its gap to the synchronous pipeline with the same optimizer (positive: the asynchronous one is
    better; the study's verdict beside it), and the task's recommendation before the change's rows
    joined (every row but the ones of this and the later :data:`STEPS`) and after."""
    stages = [[r for r in rows if not any(rule(r) for _, rule, _, _ in STEPS)]]
    for _, rule, _, _ in STEPS:
        stages.append(stages[-1] + [r for r in rows if rule(r)])
    settings = [[st for st in settings_of(these, times) if st.stages == STAGES] for these in stages]
    lines: List[str] = []
    for task in dict.fromkeys(r["task"] for r in rows if any(rule(r) for _, rule, _, _ in STEPS)):
        lines += [f"**{task}, N = {STAGES}** (final test metric at equal time, mean ± sd over the seeds (their "
                  "number); gap: against the synchronous pipeline with the same optimizer):", "",
                  "| change | optimizer | synchronous | before: variant | its final test, gap | after: variant "
                  "| its final test, gap | the old rule's pick before (on test; not the answer) | after |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for i, (said, rule, base, made) in enumerate(STEPS):
            before, after = recommendation(settings[i], task, STAGES), recommendation(settings[i + 1], task, STAGES)
            for st in [st for st in settings[-1] if st.task == task]:
                if not any(rule(r) for arm in st.arms.values() for r in arm.rows) or base not in st.arms:
                    continue

                def cell(variant: str) -> str:
                    word, diff, p = word_at_equal_time(st, variant)
                    test = "" if p != p else f"; p {p:.2f}"
                    return (f"{fmt(st.final(variant), st.scale, st.digits)} ({len(st.arms[variant].rows)}), "
                            f"{(1 if st.higher else -1) * diff * st.scale:+.{st.digits}f} "
                            f"({'a tie' if word == 'ties' else word}{test})")
                lines.append(f"| {said} | {st.optimizer} | {fmt(st.final(SYNC), st.scale, st.digits)} | {base} | "
                             f"{cell(base)} | {made} | {cell(made)} | {_named(before)} | {_named(after)} |")
        lines.append("")
    return lines


def section_lines(rows: Sequence[Dict[str, Any]], runs: Sequence[Any], folder: Path,
                  times: Optional[Dict[str, Any]] = None) -> List[str]:
    """The suite's section (nothing where it has no plan). ``rows``: every study's rows, merged;
    with ``times`` (their budgets) the section adds what each change did to the gap."""
    if not runs:
        return []
    suite = SUITES[SUITE]
    status = plan_status(runs, "The arms are")
    where = folder.relative_to(folder.parents[2]) if len(folder.parents) > 2 else folder
    lines = ["## Issue 51: error feedback's open ends", "",
             "Three arms at N = 8 on the same harness: the third seed of the image advice's "
             f"`{EF}` with AdamW (its table and the recommendation below count it); `{EF}` on translation "
             "with Muon, tuned by the translation cell's rules; and the feedback-aware prediction "
             f"(`{AWARE}`: `predict_feedback=True`) at plain error feedback's lr and seeds, where plain error "
             f"feedback ran. Rows: `{where}/runs.jsonl` (`python -m study.study3 --suite feedback`; the plan "
             "and its rules in `study/study6_plan.py`). " + status, "",
             f"**Translation with Muon and error feedback** (`{EF}`; its setting's table below has the synchronous "
             "pipeline and the other variants):", ""]
    lines += muon_table(rows) + [""]
    lines += ["**The aware prediction**, each row beside plain error feedback's at the same lr and seed "
              "(final test metric; accuracy in %):", ""]
    lines += aware_table(rows, suite["aware_cells"]) + [""]
    probes = probe_lines(rows)
    if probes:
        lines += ["**The diagnostic with and without the aware prediction** (error over the staleness error, "
                  "stages 0-6; each run computes both predictions on the same weights, and trains on its own):",
                  ""] + probes + [""]
    lines += finding_lines()
    if times is not None:
        lines += ["**What each change did to the gap**, per task it touched: the variant each change was made "
                  "to and the variant it made, each against the synchronous pipeline with the same optimizer "
                  "(gap positive where the asynchronous variant is better; the word: Welch's two-sided test at 0.05 "
                  "on these seeds, uncorrected), and the arm the old rule picked on test before the change's rows "
                  "joined and after (what the advice once said; the answer is the confirmation's). "
                  "The aware prediction's arms that stop at seed 0 are compared seed for seed above.", ""] + gap_tables(rows, times)
    pending = [r for r in runs if r.status in ("ready", "waiting")]
    dropped = [r for r in runs if r.status == "dropped"]
    if pending:
        lines += ["**Planned runs not in yet** (`python -m study.study3 --suite feedback --plan`):", ""]
        by_arm: Dict[Tuple[str, str, str], List[str]] = {}
        for r in pending:
            at = "lr to be chosen on validation" if r.lr is None else f"lr {r.lr:g}"
            by_arm.setdefault((r.task, r.optimizer, r.variant), []).append(
                f"seed {r.seed} at {at}" + (" (tuning)" if r.phase == "tune" else ""))
        lines += [f"  - {task}, {optimizer}, {variant}: {'; '.join(said)}"
                  for (task, optimizer, variant), said in by_arm.items()] + [""]
    if dropped:
        lines += ["**Runs cut:**", ""]
        lines += [f"  - {r.task}, {r.optimizer}: {r.variant} seed {r.seed} ({r.why})" for r in dropped] + [""]
    return lines
