"""Issue 41's section of the equal-time report: translation, the paper's third task, at N = 8
with AdamW and with Muon (the cell's plan and rules: study/study5_plan.py).

``make_results3.py`` merges the cell's rows (its folder, ``study/results/study3-translation``)
and its budgets (that folder's own ``times.json``) into the study's, so that translation's
settings take part in every part of the report: the recommendation, the verdicts per method, and
a table and a figure per setting. :func:`section_lines` adds the cell's own section: how far its
plan is, and the verdicts of the paper's two claims on translation. "PipeOptim trains as well as
synchronous training" is read for pipeoptim and for xpipe, which is PipeOptim at M = 2 in this
library. "PipeOptim beats GPipe, PipeDream, PipeDream-2BW and SpecTrain" compares it with GPipe
(the synchronous pipeline, which computes sequential's updates), with pipedream-2bw and with
spectrain. PipeDream (weight stashing at M = 1) is not run: issue 23's study found it matched or
beaten by spectrain in every setting. The package's advice takes the translation entry once every
planned run of the cell is in (:func:`complete`).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from study.make_results3_arith import SYNC, Setting, arm_word, read_rows
from study.study3_suite import SUITES
from study.study4_plan import alias_times
from study.study5_plan import TASK, plan_runs, total_minutes

SUITE = "translation"
#: the claims' rivals: (report name, variant)
RIVALS = (("GPipe (the synchronous pipeline)", SYNC), ("PipeDream-2BW", "pipedream-2bw"), ("SpecTrain", "spectrain"))
#: PipeOptim's lines: the method at M = 1, and at M = 2 (xpipe, the same computation)
PIPEOPTIM = (("pipeoptim", "pipeoptim (M = 1)"), ("xpipe", "xpipe (PipeOptim at M = 2)"))


def cell_times(folder: Path) -> Optional[Dict[str, Any]]:
    """The cell's budgets (its own times file), with a ``+ef`` variant's filled in from its base."""
    path = folder / "times.json"
    return alias_times(json.loads(path.read_text())) if path.exists() else None


def with_translation(rows: List[Dict[str, Any]], times: Dict[str, Any],
                     folder: Optional[Path]) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """``rows`` and ``times`` with the cell's rows and budgets merged in (unchanged where the
    folder has no rows or no budgets)."""
    cell = cell_times(folder) if folder is not None else None
    if cell is None or not (folder / "runs.jsonl").exists():
        return rows, times
    merged = copy.deepcopy(times)
    merged["cells"][TASK] = cell["cells"][TASK]
    return rows + read_rows(folder), merged


def planned(folder: Path) -> List[Any]:
    """The cell's plan against its rows (empty where the folder has none)."""
    from study.study3_plan import load_rows

    cell = cell_times(folder)
    if cell is None or not (folder / "runs.jsonl").exists():
        return []
    return plan_runs(SUITES[SUITE], load_rows(folder / "runs.jsonl"), cell)


def complete(folder: Optional[Path]) -> bool:
    """Whether every planned run of the cell is in or cut (the advice's translation entry waits)."""
    runs = planned(folder) if folder is not None else []
    return bool(runs) and all(r.status in ("done", "dropped") for r in runs)


class Verdict(NamedTuple):
    """PipeOptim's line against one rival in one translation setting."""

    optimizer: str
    line: str       #: PipeOptim's line, as PIPEOPTIM names it
    rival: str      #: the rival's report name, as RIVALS names it
    word: str       #: "wins", "ties", "loses" or "untested"
    diff: float     #: the difference in BLEU
    p: float        #: Welch's two-sided p (nan: untested)
    single: bool    #: whether either rests on one seed (no test)


def verdicts(settings: Sequence[Setting]) -> List[Verdict]:
    """Per translation setting, PipeOptim's lines against each rival, by Welch's two-sided test at
    0.05 on the seeds (make_results3_arith.arm_word) on the final test BLEU at equal time."""
    out = []
    for st in [s for s in settings if s.task == TASK]:
        for variant, name in PIPEOPTIM:
            if not (st.arms.get(variant) and st.arms[variant].rows):
                continue
            for rival_name, rival in RIVALS:
                if not (st.arms.get(rival) and st.arms[rival].rows):
                    continue
                word, diff, p = arm_word(st, variant, st, rival)
                single = min(len(st.arms[variant].rows), len(st.arms[rival].rows)) < 2
                out.append(Verdict(st.optimizer, name, rival_name, word, diff, p, single))
    return out


def claim_lines(settings: Sequence[Setting]) -> List[str]:
    """Per translation setting and PipeOptim's line, its verdict against each rival."""
    out: Dict[Tuple[str, str], List[str]] = {}
    for v in verdicts(settings):
        said = {"wins": "beats", "ties": "ties", "loses": "loses to", "untested": "untested against"}[v.word]
        judged = "one seed: no test" if v.single else f"Welch p {v.p:.2f}"
        out.setdefault((v.optimizer, v.line), []).append(f"{said} {v.rival} ({v.diff:+.1f} BLEU, {judged})")
    return [f"  - {optimizer}, {name}: " + "; ".join(cells) for (optimizer, name), cells in out.items()] \
        or ["  - not in yet"]


def claim_summary(settings: Sequence[Setting]) -> List[str]:
    """The two claims' verdicts on translation, counted over both of PipeOptim's lines and the
    optimizers: the first against the synchronous pipeline alone, the second against every rival."""
    found = verdicts(settings)
    if not found:
        return []

    def counted(rows: Sequence[Verdict]) -> str:
        words = [r.word for r in rows]
        counts = [(words.count(w), one, many) for w, one, many in
                  (("wins", "win", "wins"), ("ties", "tie", "ties"), ("loses", "loss", "losses"),
                   ("untested", "untested", "untested")) if w != "untested" or w in words]
        return ", ".join(f"{n} {one if n == 1 else many}" for n, one, many in counts) + f" of {len(words)}"

    def said(rows: Sequence[Verdict], holds) -> str:
        """holds, does not hold, or cannot be told yet (only untested where it has not failed)."""
        tested = [r for r in rows if r.word != "untested"]
        if not all(holds(r) for r in tested):
            return "does not hold"
        return "holds" if len(tested) == len(rows) and rows else "cannot be told yet (one seed: untested)"

    sync = [r for r in found if r.rival == RIVALS[0][0]]
    held = said(sync, lambda r: r.word != "loses")
    beats = said(found, lambda r: r.word == "wins")
    return [f"  - \"PipeOptim trains as well as synchronous training\": {held} "
            f"on translation ({counted(sync)} against the synchronous pipeline).",
            f"  - \"PipeOptim beats GPipe, PipeDream-2BW and SpecTrain\": {beats} "
            f"on translation ({counted(found)}).", ""]


def plan_status(runs: Sequence[Any], what: str) -> str:
    """The status line of an arm's section: how many of its planned runs are in (dropped ones not
    counted) and the core-minutes left; ``what``: "The cell is", "The arms are"."""
    counted = [r for r in runs if r.status != "dropped"]
    done = sum(r.status == "done" for r in counted)
    left = sum(r.minutes for r in counted if r.status != "done")
    return (f"All {len(counted)} planned runs are in." if done == len(counted) else
            f"**{what} still running: {done} of {len(counted)} planned runs are in** (about {left:.0f} "
            f"core-minutes to go of {total_minutes(runs):.0f} planned); every number below may still move.")


def section_lines(settings: Sequence[Setting], folder: Optional[Path]) -> List[str]:
    """The cell's section (nothing where it has no rows)."""
    runs = planned(folder) if folder is not None else []
    if not runs:
        return []
    status = plan_status(runs, "The cell is")
    lines = ["## Issue 41: translation at equal time", "",
             "English to Spanish Bible verses, test BLEU of greedy translations (the first 500 test sentences), "
             "the model `transformer-deep` (9 blocks) at N = 8, the task's recipe over sequential's 1,224 updates "
             "(6 epochs), every variant's lr tuned afresh on the validation split (its first 300 pairs): two lrs "
             "of a grid, and a third beyond the better where it lay at an edge. Rows: "
             f"`{folder.relative_to(folder.parents[2]) if len(folder.parents) > 2 else folder}/runs.jsonl` "
             "(`python -m study.study3 --suite translation`; the plan and its rules in "
             "`study/study5_plan.py`). Each optimizer's table is in its setting below. " + status, "",
             "**The paper's claims on translation** (PipeOptim against synchronous training and against the "
             "methods it was compared with; PipeDream with weight stashing is not run, matched or beaten by "
             "SpecTrain in every setting of issue 23's study):", ""]
    lines += claim_summary(settings) + claim_lines(settings) + [""]
    dropped = [r for r in runs if r.status == "dropped"]
    if dropped:
        lines += ["**Runs cut as the cell went** (the decisive-gap cut):", ""]
        lines += [f"  - {r.optimizer}: {r.variant} seed {r.seed} ({r.why})" for r in dropped] + [""]
    return lines
