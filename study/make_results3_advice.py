"""What the equal-time study says so far: the plan against the rows (how many runs are in, which
(task, N) have all of theirs, which variants are another's line); the README's advice block and
demo line written from the package's table (``--readme``; tests/test_advice.py holds the README to
it; the table's advice is the confirmation's, study/make_results7.py, which writes
docs/measurements.md's findings too), with the README's options table written from
``pipeoptim.options.OPTIONS`` (tests/test_docs.py holds the README to it)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from study.study3_plan import load_rows, plan_runs
from study.study3_suite import SAME_AS, SUITES as STUDY3_SUITES, study2_rows


def suite_of(study: Path) -> Optional[Dict[str, Any]]:
    """The suite the runner ran in ``study`` (named in its ``suite.json``); None for a folder
    without one (a hand-made one)."""
    suite_file = study / "suite.json"
    if not suite_file.exists():
        return None
    return STUDY3_SUITES[json.loads(suite_file.read_text())["suite"]]


def planned_runs(study: Path, times: Dict[str, Any], dropped: bool = False) -> List[Any]:
    """The study's plan (study3_plan.Run, dropped runs left out; with ``dropped``, those only)
    against its rows; empty for a folder without the runner's ``suite.json`` (a hand-made one)."""
    suite = suite_of(study)
    if suite is None:
        return []
    return [r for r in plan_runs(suite, load_rows(study / "runs.jsonl"), times, study2_rows(suite))
            if (r.status == "dropped") == dropped]


def cut_lines(study: Path, times: Dict[str, Any]) -> List[str]:
    """The planned runs the plan dropped as the study went (the decisive-gap cut: a second seed
    whose seed 0 ended far behind the synchronous pipeline), one line per setting; none for a
    hand-made folder."""
    by_setting: Dict[str, List[Any]] = {}
    for r in planned_runs(study, times, dropped=True):
        by_setting.setdefault(f"{r.task}, {r.optimizer}, N={r.stages}", []).append(r)
    if not by_setting:
        return []
    gap = suite_of(study)["cuts"].get("decisive_gap")
    why = ("the decisive-gap cut, docs/study_plan.md: a variant's second seed is not run where its seed 0 ended "
           f"more than {gap:.0%} of the synchronous pipeline's final metric behind it, so far that a second seed "
           "could not turn the verdict into a tie unless the two differed more than any arm of these methods did "
           "in either study; such an arm rests on one seed" if gap else "docs/study_plan.md")
    lines = [f"**Runs cut as the study went** ({why}):", ""]
    for name, runs in by_setting.items():
        lines.append(f"  - {name}: " + "; ".join(f"{r.variant} seed {r.seed} ({r.why.split(' (')[0]})"
                                                 for r in runs))
    return lines + [""]


def status_line(study: Path, rows: Sequence[Dict[str, Any]], times: Dict[str, Any]) -> str:
    """How far the study is: rows in against the plan (study3_plan.py), the core-minutes spent and
    left; empty for a folder without the runner's ``suite.json`` (a hand-made one)."""
    planned = planned_runs(study, times)
    if not planned:
        return ""
    done = sum(r.status == "done" for r in planned)
    spent = sum(r.get("cpu_seconds", r.get("seconds", 0)) for r in rows) / 60  # (older rows: wall clock)
    left = sum(r.minutes for r in planned if r.status != "done")
    if done == len(planned):
        return f"All {len(planned)} planned runs are in ({spent:.0f} core-minutes of training)."
    return (f"**The study is still running: {done} of {len(planned)} planned runs are in** ({spent:.0f} "
            f"core-minutes of training so far, about {left:.0f} planned to go); settings and arms without "
            "their runs are missing below, and every number may still move.")


def same_as_lines(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """One paragraph per variant that computes another's updates (study3_suite.SAME_AS): why it
    has no line of its own, and how the runs made of both compare (same settings, same seed)."""
    fields = ("task", "optimizer", "stages", "lr", "seed", "phase", "until", "updates")
    out = []
    for variant, other in SAME_AS.items():
        theirs = {tuple(r.get(f) for f in fields): r for r in rows if r["variant"] == other}
        pairs = [(r, theirs[key]) for r in rows if r["variant"] == variant
                 and (key := tuple(r.get(f) for f in fields)) in theirs]
        text = (f"**{variant} is {other}'s line.** This library's {other} is the same computation "
                f"(PipeOptim's prediction along the optimizer's own direction, exact steps, backward on the "
                f"latest weights, M = 2; tested bit for bit), so the study runs {other} only.")
        if pairs:
            def numbers(row: Dict[str, Any]) -> Tuple[Any, ...]:
                curve = tuple((e["updates"], e["metric"]) for e in row.get("evaluations") or [])
                return row.get("validation_metric"), row.get("final_metric"), curve

            alike = sum(numbers(a) == numbers(b) for a, b in pairs)
            cells: Dict[str, List[float]] = {}
            for a, _ in pairs:
                cells.setdefault(f"{a['task']} x {a['optimizer']}", []).append(a["lr"])
            where = "; ".join(f"{cell} at lr {', '.join(f'{lr:g}' for lr in sorted(set(lrs)))}"
                              for cell, lrs in cells.items())
            text += (f" Of the {len(pairs)} runs made under both names before that was noticed ({where}), "
                     f"{alike} agree with {other}'s in every evaluation and at the end.")
        out += [text, ""]
    return out


def complete_cells(study: Path, times: Dict[str, Any]) -> List[Tuple[str, int]]:
    """The (task, N) whose every planned run (sequential's references included) is in."""
    planned = planned_runs(study, times)
    cells = dict.fromkeys((r.task, r.stages) for r in planned if r.variant != "sequential")
    return [(task, n) for task, n in cells
            if all(r.status == "done" for r in planned
                   if r.task == task and (r.stages == n or r.variant == "sequential"))]


#: the README's advice block: its markers, what it says of the tasks still running, and its width
README_START = "<!-- advice: pipeoptim.lab.tasks.advice.ADVICE, one line per entry (tests/test_advice.py) -->\n"
README_END = "<!-- /advice -->"
NOT_FINISHED = ("Their confirmation on fresh seeds is still running (`python -m study.study3 --suite confirm "
                "--plan` says how far); until it has finished, use a synchronous pipeline: at equal updates "
                "every asynchronous method ended behind it (the second study, docs/results.md).")
STUDIED_TASKS = ("image", "sentiment", "lm", "translation")
WIDTH = 100


def readme_with_advice(readme: str) -> str:
    """``readme`` with its advice block (a bullet per ``ADVICE`` entry, then the tasks not
    finished) and the demo's "which method to use" line (image at N = 4, as ``make demo`` runs
    it) written from the package's table. Write the table (``--package``) first."""
    import textwrap

    from pipeoptim.lab.tasks.advice import ADVICE, advice

    def wrapped(text: str, first: str, rest: str) -> str:
        return textwrap.fill(text, WIDTH, initial_indent=first, subsequent_indent=rest,
                             break_on_hyphens=False, break_long_words=False)

    items = [entry.describe() for entry in ADVICE.values()]
    running = [task for task in sorted(STUDIED_TASKS) if task not in {t for t, _ in ADVICE}]
    if running:
        items.append(f"Not finished yet: {', '.join(running)}. {NOT_FINISHED}")
    block = "\n".join(wrapped(item, "- ", "  ") for item in items)
    start = readme.index(README_START) + len(README_START)
    readme = readme[:start] + block + "\n" + readme[readme.index(README_END):]
    demo = readme.index("which method to use: ")
    line = wrapped("which method to use: " + advice("image", 4)[1], "", "  ")
    return readme[:demo] + line + "\n" + readme[readme.index("```", demo):]


#: the README's options table: its markers
OPTIONS_START = "<!-- options: pipeoptim.options.OPTIONS, written by python -m study.make_results3 --readme (tests/test_docs.py) -->\n"
OPTIONS_END = "<!-- /options -->"


def options_table() -> str:
    """The README's table of every option (``pipeoptim.options.OPTIONS``): a row per place that
    takes it (the Pipeline, a method, the delay corrections, ``fit``), each option as
    ``name=default`` with its command-line flag, in the table's order."""
    from pipeoptim.options import CORRECTIONS, OPTIONS, REQUIRED

    def item(option) -> str:
        default = option.default
        text = f"`{option.name}` (required)" if default is REQUIRED else \
            f"`{option.name}`" if default is None or default is False else f"`{option.name}={default!r}`"
        return text + (f" `{option.flag.flag_name(option.name)}`" if option.flag else "")

    rows = [("`Pipeline(model, ...)`", lambda o: o.scope == "pipeline"),
            ("a method's own (`Pipeline(...)`)",
             lambda o: o.scope == "method" and not (o.flag and o.flag.group == CORRECTIONS)),
            ("delay corrections (`Pipeline(...)`; asynchronous methods, all off by default)",
             lambda o: o.scope == "method" and o.flag is not None and o.flag.group == CORRECTIONS),
            ("`fit(loader, ...)`, `train(model, loader, ...)`", lambda o: o.scope == "fit")]
    lines = ["| where | keyword (default) and command-line flag |", "|---|---|"]
    lines += [f"| {where} | " + ", ".join(item(o) for o in OPTIONS if chosen(o)) + " |" for where, chosen in rows]
    return "\n".join(lines) + "\n"


def readme_with_options(readme: str) -> str:
    """``readme`` with its options table written from ``pipeoptim.options.OPTIONS``."""
    start = readme.index(OPTIONS_START) + len(OPTIONS_START)
    return readme[:start] + options_table() + readme[readme.index(OPTIONS_END):]
