"""Issue 61: every choice of the equal-time study made on the validation split, none on test.

The earlier arms chose each variant's lr on validation but the winning arm (method, variant,
optimizer) on the test metric. Here the choice per task at N stages is:

* the **synchronous arm**: of the task's optimizers, the synchronous pipeline (sequential's runs)
  with the best mean validation metric over its runs at its lr;
* the **asynchronous arm**: of every asynchronous variant and optimizer the task ran, the one with
  the best mean validation metric over its runs at its lr (each variant's lr was chosen on
  validation already: make_results3_arith.chosen_lr);
* **equal effort**: where the synchronous pipeline's lr was carried over from the second study at
  an edge of its grid (its optimum not bracketed, as the asynchronous arms were re-tuned at an
  edge), one more run a factor 2 beyond it at seed 0 (:func:`brackets`); the better of the two on
  validation (seed 0 against seed 0, as the tuning compares) is the synchronous arm's lr.

A diverged run counts as the worst validation value, so that an arm with one ranks last. Ties
go to the name first in sort order (a fixed rule, not a look at test).

The choice sees the rows through :func:`blind`: each row without its test fields, and a read of
one raises :class:`ChoiceReadTest` (study/tests/test_confirm.py holds the choice to that: it
runs on rows whose test fields would raise)."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from study.make_results3_arith import SYNC, Setting, settings_of
from study.study3_plan import at_edge, tuning
from study.study3_suite import SUITES as STUDY3_SUITES, study2_rows
from study import study2_plan

#: what a row holds of the test split (the metric and the loss read at the end on it)
TEST_FIELDS = ("final_metric", "final_loss")


class ChoiceReadTest(LookupError):
    """A choice read a test field."""


class Blind(dict):
    """A row as the choice sees it: its test fields left out, and a read of one raises."""

    def __getitem__(self, key: Any) -> Any:
        if key in TEST_FIELDS:
            raise ChoiceReadTest(f"{key!r} read while choosing: choices are made on validation only")
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        if key in TEST_FIELDS:
            raise ChoiceReadTest(f"{key!r} read while choosing: choices are made on validation only")
        return super().get(key, default)


def blind(rows: Iterable[Dict[str, Any]]) -> List[Blind]:
    return [Blind({k: v for k, v in r.items() if k not in TEST_FIELDS}) for r in rows]


@dataclass(frozen=True)
class Choice:
    """An arm chosen for confirmation: what to run again on fresh seeds."""

    task: str
    optimizer: str
    variant: str                 #: SYNC for the synchronous pipeline (sequential's runs)
    stages: int                  #: N of the setting (the synchronous arm runs sequential, one device)
    lr: float
    validation: float            #: mean validation metric of its runs at lr (what chose it)
    seeds: Tuple[int, ...]       #: the seeds that mean is over
    why: str = ""

    @property
    def synchronous(self) -> bool:
        return self.variant == SYNC

    @property
    def run_variant(self) -> str:
        """The study's variant its runs train: sequential for the synchronous pipeline."""
        return "sequential" if self.synchronous else self.variant

    def name(self) -> str:
        return f"{'the synchronous pipeline' if self.synchronous else self.variant} with {self.optimizer}"


def worst(higher: bool) -> float:
    return -math.inf if higher else math.inf


def validation_of(rows: Sequence[Dict[str, Any]], higher: bool) -> float:
    """Mean validation metric of ``rows`` (a diverged run: the worst value)."""
    values = [worst(higher) if r.get("diverged") or r.get("validation_metric") is None else r["validation_metric"]
              for r in rows]
    return statistics.mean(values) if values else math.nan


def brackets(suite_name: str = "default") -> Dict[Tuple[str, str], Tuple[float, float]]:
    """(task, optimizer) -> (carried lr, the lr one factor 2 beyond it) where the synchronous
    pipeline's lr came from the second study at an edge of its grid (never re-tuned)."""
    suite = STUDY3_SUITES[suite_name]
    rows2 = study2_rows(suite)
    out = {}
    for task, optimizer in [tuple(c) for c in suite["cells"]]:
        kind, lrs, _ = tuning(suite, rows2, task, optimizer, "sequential")
        if kind != "carried" or not suite.get("study2"):
            continue
        grid = study2_plan.sweep_lrs(study2_plan.SUITES["default"], task, optimizer)
        if at_edge(lrs[0], grid):
            lr = lrs[0]
            out[(task, optimizer)] = (lr, float(f"{lr * (2 if lr == max(grid) else 0.5):.3g}"))
    return out


def bracket_row(rows: Iterable[Dict[str, Any]], task: str, optimizer: str, lr: float) -> Optional[Dict[str, Any]]:
    """The bracketing run (sequential at ``lr``, seed 0, phase tune) among ``rows``, or None."""
    for r in rows:
        if ((r["task"], r["optimizer"], r["variant"], r["stages"], r["seed"], r["phase"]) ==
                (task, optimizer, "sequential", 1, 0, "tune") and r["lr"] == lr and r.get("until") is None):
            return r
    return None


def synchronous_candidate(st: Setting, own: Sequence[Dict[str, Any]],
                          bracket: Optional[Tuple[float, float]]) -> Optional[Choice]:
    """The synchronous arm of a setting at its lr (after its bracketing run, where it has one);
    None while that run is not in."""
    arm = st.arms[SYNC]
    if not arm.rows:
        return None
    lr, rows, why = arm.lr, arm.rows, f"lr {arm.lr:g} ({arm.source})"
    if bracket is not None:
        carried, beyond = bracket
        run = bracket_row(own, st.task, st.optimizer, beyond)
        if run is None:
            return None
        seed0 = [r for r in arm.rows if r["seed"] == 0]
        ranked = study2_plan.ranked_lrs([(carried, seed0[0] if seed0 else None), (beyond, run)], st.higher)
        if ranked and ranked[0] == beyond:
            lr, rows = beyond, [run]
            why = f"lr {beyond:g}, one factor 2 beyond the second study's edge {carried:g}, better on validation at seed 0"
        else:
            why = f"lr {carried:g} (the second study's, at its grid's edge; {beyond:g} beyond it was worse on validation at seed 0)"
    return Choice(st.task, st.optimizer, SYNC, st.stages, lr, validation_of(rows, st.higher),
                  tuple(r["seed"] for r in rows), why)


def asynchronous_candidates(st: Setting) -> List[Choice]:
    return [Choice(st.task, st.optimizer, v, st.stages, arm.lr, validation_of(arm.rows, st.higher),
                   tuple(r["seed"] for r in arm.rows), f"lr {arm.lr:g} ({arm.source})")
            for v, arm in st.arms.items() if v != SYNC and arm.rows]


def best(choices: Sequence[Choice], higher: bool) -> Optional[Choice]:
    """The best mean validation metric (ties: the first name in sort order)."""
    ranked = sorted(choices, key=lambda c: (-c.validation if higher else c.validation, c.optimizer, c.variant))
    return ranked[0] if ranked else None


def prior_settings(rows: Iterable[Dict[str, Any]], times: Dict[str, Any]) -> List[Setting]:
    """The earlier arms' settings built from ``rows`` seen blind."""
    return settings_of(blind(rows), times)


def choose(settings: Sequence[Setting], own: Sequence[Dict[str, Any]], task: str, stages: int,
           bracketed: Dict[Tuple[str, str], Tuple[float, float]]) -> Dict[str, Any]:
    """{"synchronous": Choice or None (None: a bracketing run still to come), "asynchronous":
    Choice or None, "waiting": the (task, optimizer) whose bracketing run is not in, "candidates":
    every candidate considered (both kinds)} for ``task`` at N = ``stages``, on validation."""
    here = [st for st in settings if (st.task, st.stages) == (task, stages)]
    if not here:
        return {"synchronous": None, "asynchronous": None, "waiting": [], "candidates": []}
    higher = here[0].higher
    sync, waiting = [], []
    for st in here:
        found = synchronous_candidate(st, blind(own), bracketed.get((st.task, st.optimizer)))
        if found is None and st.arms[SYNC].rows:
            waiting.append((st.task, st.optimizer))
        elif found is not None:
            sync.append(found)
    asynchronous = [c for st in here for c in asynchronous_candidates(st)]
    return {"synchronous": None if waiting else best(sync, higher), "asynchronous": best(asynchronous, higher),
            "waiting": waiting, "candidates": sync + asynchronous}
