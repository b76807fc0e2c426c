"""Issue 38's section of the equal-time report: the published fixes for delay, measured at equal
time, and the close calls settled (the arm's plan and rules: study/study4_plan.py).

``make_results3.py`` writes docs/results.md from issue 23's rows and this arm's together (the
arm's folder, ``study/results/study3-delay_fixes``, merged in: its third seeds join the
arms they belong to, its new variants and its new optimizer become arms and settings of their
own) and opens it with :func:`arm_lines`. Per new arm: the final test metric at equal time
(mean ± standard deviation over the seeds) against the synchronous pipeline with the same
optimizer and against the best synchronous setting of the task and N, by Welch's two-sided test
at 0.05 on the seeds (make_results3_arith.arm_word; one seed: untested), and, for error feedback, what it did to
the variant it was added to: the share of that variant's gap to the synchronous pipeline that
it closed.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from study.common import fmt
from study.make_results3_arith import SYNC, Setting, arm_word, read_rows
from study.study3_suite import SUITES
from study.study4_plan import BASE_VARIANT, alias_times, plan_runs, total_minutes

ARM = "delay_fixes"


def merged(study: Path, arm: Optional[Path]) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """Issue 23's rows and the arm's (when its folder has rows), and the times file with the
    arm's optimizers and variants filled in from their bases."""
    rows = read_rows(study)
    times = json.loads((study / "times.json").read_text())
    if arm is None or not (arm / "runs.jsonl").exists():
        return rows, times
    return rows + read_rows(arm), alias_times(times)


def gap_closed(base: float, fixed: float, sync: float, higher: Optional[bool] = None) -> Optional[float]:
    """The share of ``base``'s gap to ``sync`` that ``fixed`` closed (1: all of it, above 1: past
    the synchronous pipeline, below 0: wider); None where ``base`` had no gap (also, given the
    metric's direction ``higher``, where ``base`` was already ahead of ``sync``)."""
    if any(math.isnan(x) or math.isinf(x) for x in (base, fixed, sync)) or base == sync:
        return None
    if higher is not None and (base > sync) == higher:
        return None
    return (base - fixed) / (base - sync)


def best_sync(settings: Sequence[Setting], task: str, stages: int) -> Optional[Setting]:
    """The setting of ``task`` at ``stages`` whose synchronous pipeline ends best (over the optimizers)."""
    here = [st for st in settings if (st.task, st.stages) == (task, stages) and st.arms[SYNC].rows]
    if not here:
        return None
    sign = 1 if here[0].higher else -1
    return max(here, key=lambda st: sign * st.final(SYNC)[0])


def _against(st: Setting, variant: str, ref: Setting) -> str:
    """The word (Welch's two-sided test at 0.05 on the seeds: make_results3_arith.arm_word)."""
    word, diff, _ = arm_word(st, variant, ref)
    word = {"wins": "better", "ties": "ties", "loses": "worse", "untested": "untested"}[word]
    return f"{word} ({diff * st.scale:+.{st.digits}f})"


def new_arms(suite: Dict[str, Any]) -> List[Tuple[str, str, str, List[str]]]:
    """(name, task, optimizer, variants) of the arm's fixes, in its order."""
    return [(a["name"], a["task"], a["optimizer"], a["variants"]) for a in suite["arms"] if a["kind"] == "fix"]


def fix_table(settings: Sequence[Setting], suite: Dict[str, Any]) -> List[str]:
    lines = ["| fix | task, optimizer | method | lr (source) | seeds | final test at equal time | against the "
             "synchronous pipeline, same optimizer | against the task's best synchronous setting | gap to "
             "synchronous closed |", "|---|---|---|---|---|---|---|---|---|"]
    for name, task, optimizer, variants in new_arms(suite):
        st = next((s for s in settings if (s.task, s.optimizer, s.stages) == (task, optimizer, 8)), None)
        for variant in variants:
            key = SYNC if variant == "sequential" else variant
            arm = st.arms.get(key) if st is not None else None
            if arm is None or not arm.rows:
                lines.append(f"| {name} | {task}, {optimizer} | {variant} | - | 0 | (not in yet) | - | - | - |")
                continue
            final = st.final(key)
            same = "reference" if key == SYNC else _against(st, key, st)
            best = best_sync(settings, task, 8)
            against_best = _against(st, key, best) + f" ({best.optimizer})" if best is not None else "-"
            closed = "-"
            base = BASE_VARIANT.get(variant)
            if base is not None and st.arms.get(base) and st.arms[base].rows:
                share = gap_closed(st.final(base)[0], final[0], st.final(SYNC)[0], st.higher)
                closed = (f"{share:.0%} (from {fmt(st.final(base), st.scale, st.digits)})" if share is not None
                          else f"no gap: {base} was ahead ({fmt(st.final(base), st.scale, st.digits)})")
            lines.append(f"| {name} | {task}, {optimizer} | {variant} | {arm.lr:g} ({arm.source}) | {len(arm.rows)} | "
                         f"{fmt(final, st.scale, st.digits)} | {same} | {against_best} | {closed} |")
    return lines


def close_call_lines(settings: Sequence[Setting], suite: Dict[str, Any]) -> List[str]:
    """The close calls with every seed in: each side's mean ± sd and seeds, the verdict."""
    out = []
    for arm in [a for a in suite["arms"] if a["kind"] == "seeds"]:
        st = next((s for s in settings if (s.task, s.optimizer, s.stages) == (arm["task"], arm["optimizer"], 8)), None)
        if st is None:
            continue
        rivals = [v for v in arm["variants"] if v != "sequential"] or [
            v for v in st.arms if v != SYNC and st.arms[v].rows]
        for variant in rivals:
            if variant not in st.arms or not st.arms[variant].rows:
                continue
            word, diff, p = arm_word(st, variant, st)
            ref = best_sync(settings, st.task, 8)
            best = (f"; the task's best synchronous setting is {ref.optimizer}'s, "
                    f"{fmt(ref.final(SYNC), ref.scale, ref.digits)}") if ref is not None and ref is not st else ""
            said = {"wins": "better", "ties": "a tie", "loses": "worse", "untested": "untested"}[word]
            out.append(f"  - {st.name()}: {variant} {fmt(st.final(variant), st.scale, st.digits)} "
                       f"({len(st.arms[variant].rows)} seeds) against the synchronous pipeline "
                       f"{fmt(st.final(SYNC), st.scale, st.digits)} ({len(st.arms[SYNC].rows)} seeds): "
                       f"{said} ({diff * st.scale:+.{st.digits}f}, Welch p {p:.2f}){best}")
    return out or ["  - none in yet"]


def adamw_lines(settings: Sequence[Setting]) -> List[str]:
    """What each fix did on the LM with AdamW at N = 8, where every asynchronous method is furthest behind."""
    st = next((s for s in settings if (s.task, s.optimizer, s.stages) == ("lm", "adamw", 8)), None)
    if st is None:
        return ["  - not in yet"]
    out = []
    for fixed, base in BASE_VARIANT.items():
        if st.arms.get(fixed) and st.arms[fixed].rows and st.arms.get(base) and st.arms[base].rows:
            share = gap_closed(st.final(base)[0], st.final(fixed)[0], st.final(SYNC)[0], st.higher)
            out.append(f"  - error feedback on {base}: {fmt(st.final(base), st.scale, st.digits)} -> "
                       f"{fmt(st.final(fixed), st.scale, st.digits)} against the synchronous pipeline's "
                       f"{fmt(st.final(SYNC), st.scale, st.digits)}"
                       + (f": {share:.0%} of the gap closed" if share is not None else ""))
    nesterov = next((s for s in settings if (s.task, s.optimizer, s.stages) == ("lm", "delay-nadamw", 8)), None)
    if nesterov is not None:
        for variant, arm in nesterov.arms.items():
            if variant == SYNC or not arm.rows or not st.arms.get(variant) or not st.arms[variant].rows:
                continue
            share = gap_closed(st.final(variant)[0], nesterov.final(variant)[0], st.final(SYNC)[0], st.higher)
            out.append(f"  - the delay-aware Nesterov step in AdamW's place on {variant}: "
                       f"{fmt(st.final(variant), st.scale, st.digits)} -> "
                       f"{fmt(nesterov.final(variant), st.scale, st.digits)} against AdamW's synchronous pipeline "
                       f"{fmt(st.final(SYNC), st.scale, st.digits)}"
                       + (f": {share:.0%} of the gap closed" if share is not None else ""))
    return out or ["  - not in yet"]


def planned(arm: Path) -> List[Any]:
    """The arm's plan against its rows (empty where the folder has none)."""
    if not (arm / "runs.jsonl").exists():
        return []
    from study.study3_plan import load_rows

    suite = SUITES[ARM]
    study3 = Path(suite["study3"])
    times = alias_times(json.loads((study3 / "times.json").read_text()))
    return plan_runs(suite, load_rows(arm / "runs.jsonl"), times, load_rows(study3 / "runs.jsonl"))


def arm_complete(arm: Optional[Path], task: str, stages: int) -> bool:
    """Whether every planned run of the arm on ``task`` (at N = ``stages`` or its synchronous
    reference) is in or cut: the advice for (task, N) waits for them."""
    if arm is None:
        return True
    return all(r.status in ("done", "dropped") for r in planned(arm)
               if r.task == task and r.stages in (1, stages))


def diagnostic_lines(settings: Sequence[Setting], suite: Dict[str, Any]) -> List[str]:
    """The diagnostic (the forward's weights against the backward's, per stage) of each new arm."""
    from study.make_results2_findings import diagnosis
    from study.make_results3_arith import _Rows

    out = []
    for name, task, optimizer, variants in new_arms(suite):
        st = next((s for s in settings if (s.task, s.optimizer, s.stages) == (task, optimizer, 8)), None)
        for variant in variants:
            if st is None or variant == "sequential" or not st.arms.get(variant) or not st.arms[variant].rows:
                continue
            out.append(f"  - {st.name()}, {variant}: {diagnosis(_Rows({variant: st.arms[variant]}), variant)}")
    return out or ["  - none in yet"]


def package_sources(study: Path, arm: Optional[Path], translation: Optional[Path] = None,
                    feedback: Optional[Path] = None) -> List[Tuple[List[Setting], List[Tuple[str, int]]]]:
    """What the package's tables (ADVICE, UPDATES_TO_TARGET) are read from, in the order each takes
    over: (settings, the (task, N) they decide). Issue 23's rows for every (task, N) whose study
    runs are all in; the study's and the arm's together where the arm's runs of that task are all
    in too; then translation at N = 8 once issue 41's cell (``translation``,
    study/make_results5.py) has every planned run in; last, every (task, N) decided so far again
    with issue 51's arms' rows (``feedback``, study/make_results6.py) joined, an arm's (task,
    optimizer, variant) once every planned run of it is in or cut (the image advice's third seed
    joins its first two, the aware prediction once all its seeds of a cell are in)."""
    from study.make_results3_advice import complete_cells
    from study.make_results3_arith import settings_of
    from study.make_results5 import TASK, complete as translation_complete, with_translation

    times = json.loads((study / "times.json").read_text())
    complete = complete_cells(study, times)
    rows, filled = merged(study, arm)
    sources = [(settings_of(read_rows(study), times), complete),
               (settings_of(rows, filled), [c for c in complete if arm_complete(arm, *c)])]
    if translation_complete(translation):
        sources.append((settings_of(*with_translation(rows, filled, translation)), [(TASK, 8)]))
    if feedback is not None:
        from study import make_results6

        arms = make_results6.complete_arms(make_results6.planned(feedback, study, [study, arm, translation],
                                                                 translation))
        # the cells decided with the arm's rows (a cell the study alone decides keeps its advice)
        decided = list(dict.fromkeys(c for _, cells in sources[1:] for c in cells))
        touched = [c for c in decided if any((t, make_results6.STAGES) == c for t, _, _ in arms)]
        if touched:
            both = with_translation(rows, filled, translation) if translation_complete(translation) \
                else (rows, filled)
            sources.append((settings_of(*make_results6.with_feedback(*both, feedback, arms)), touched))
    return sources


def nadam_lines() -> List[str]:
    """Which NAdam the study ran, against AsyncPP's public code, and what ``delay-nadamw`` is."""
    return ["**The NAdam arm and AsyncPP's code.** The public code of AsyncPP (arXiv 2505.01099; its "
            "`optim/nadamw.py`) builds its optimizer on `torch.optim.NAdam` with betas (0.99, 0.999), torch's "
            "default momentum decay (0.004) and weight decay applied apart from the gradient (decoupled). The "
            "study's NAdam arm (`--optimizer nadam`, beta1 0.99) is that same torch optimizer with the same "
            "betas and momentum decay, but without weight decay: the lab's `weight_decay` is 0 unless given "
            "(only adamw and muon keep torch's own), the study gives none, so `decoupled_weight_decay` is left "
            "off and would change nothing at 0. It is that code's optimizer less its weight decay. "
            "`delay-nadamw` is this library's reading of the paper's description (a constant beta1 whose "
            "Nesterov look-ahead spans each stage's delay, decoupled weight decay 0.01 by default), not that "
            "code.", ""]


def arm_lines(settings: Sequence[Setting], arm: Path) -> List[str]:
    """The section that opens docs/results.md (nothing where the arm has no rows)."""
    runs = planned(arm)
    if not runs:
        return []
    suite = SUITES[ARM]
    done = sum(r.status == "done" for r in runs)
    counted = [r for r in runs if r.status != "dropped"]
    left = sum(r.minutes for r in counted if r.status != "done")
    status = (f"All {len(counted)} planned runs are in." if done == len(counted) else
              f"**The arm is still running: {done} of {len(counted)} planned runs are in** (about {left:.0f} "
              f"core-minutes to go of {total_minutes(runs):.0f} planned); every number below may still move.")
    dropped = [r for r in runs if r.status == "dropped"]
    lines = ["## Issue 38: the published fixes for delay, at equal time", "",
             "Error feedback on the methods with a one-update delay (`error_feedback=True`: each update whose "
             "gradient is stale also subtracts u_t - u_(t-1), u the step the optimizer applied) and the "
             "delay-aware Nesterov step (`--optimizer delay-nadamw`: NAdamW with a constant beta1 = 0.99 whose "
             "look-ahead spans each stage's delay; the synchronous pipeline runs it too, at delay 0), on the "
             "equal-time harness below (same budget rule, recipe scaled to each method's updates), each new "
             "method tuned at its base's lr and one neighbour on the validation split, at N = 8. Rows: "
             f"`{arm.relative_to(arm.parents[2]) if len(arm.parents) > 2 else arm}/runs.jsonl` "
             "(`python -m study.study3 --suite delay_fixes`; the plan and its rules in "
             "`study/study4_plan.py`). " + status, ""]
    lines += fix_table(settings, suite) + [""]
    lines += nadam_lines()
    lines += ["**What each fix did to the LM with AdamW** (where every asynchronous method is furthest behind):", ""]
    lines += adamw_lines(settings) + [""]
    lines += ["**The close calls, with the third seeds:**", ""] + close_call_lines(settings, suite) + [""]
    lines += ["**The diagnostic of each new arm, per stage** (how far the weights a forward ran on were from "
              "those live at its backward, against the stale weights' distance):", ""]
    lines += diagnostic_lines(settings, suite) + [""]
    if dropped:
        lines += ["**Runs cut as the arm went** (the decisive-gap cut):", ""]
        lines += [f"  - {r.task}, {r.optimizer}: {r.variant} seed {r.seed} ({r.why})" for r in dropped] + [""]
    return lines
