"""Issue 23's report, its arithmetic: the rows of a study (a run once), each setting's arms (the
synchronous pipeline and every variant at its chosen lr), the final metric at equal time, time to
target against the synchronous pipeline, the verdicts and the recommendation per task and N.
``make_results3.py`` writes the report from these (and re-exports them); the rules are in its
docstring, the tests in study/tests/test_make_results3.py."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from study.common import mean_sd, verdict
from study.make_results2_data import final_score, run_updates_to_target
from study.study2_plan import ranked_lrs
from study.study3_plan import load_rows
from study.study3_suite import SAME_AS
from pipeoptim.lab.time_to_target import target_from_reference

SCALE = {"accuracy": 100.0}
SYNC = "synchronous"  #: the report's name for sequential's runs priced as the fastest synchronous pipeline


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


class MetricUnits:
    """How a metric is written (a class with a ``metric``): ``scale`` (accuracy in points) and
    ``digits`` after the point."""

    metric: str

    @property
    def scale(self) -> float:
        return SCALE.get(self.metric, 1.0)

    @property
    def digits(self) -> int:
        return 2 if self.metric == "accuracy" else 1


@dataclass
class Setting(MetricUnits):
    task: str
    optimizer: str
    stages: int
    metric: str
    higher: bool
    budget: Dict[str, Any]
    arms: Dict[str, Arm]              #: SYNC first, then the variants

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


def welch_word(mine: Sequence[float], theirs: Sequence[float], higher: bool) -> Tuple[str, float]:
    """("wins", "ties", "loses" or "untested"; the two-sided p or nan) of ``mine`` against
    ``theirs``: Welch's t-test at 0.05, two-sided, uncorrected (an exploratory word; the answer is
    the confirmation's, study/make_results7.py). Fewer than 2 values a side: untested. A side with a
    diverged seed (an infinite value): a loss against one without, else a tie."""
    from study.stats import ALPHA, welch

    bad = [any(math.isinf(v) or math.isnan(v) for v in side) for side in (mine, theirs)]
    if any(bad):
        return ("loses" if bad[0] and not bad[1] else "wins" if bad[1] and not bad[0] else "ties"), math.nan
    if len(mine) < 2 or len(theirs) < 2:
        return "untested", math.nan
    c = welch(mine, theirs, higher)
    p = min(1.0, 2 * min(c.p, 1 - c.p))
    return ("ties" if p >= ALPHA else "wins" if c.effect > 0 else "loses"), p


def arm_word(st: Setting, variant: str, ref: Setting, ref_variant: str = SYNC) -> Tuple[str, float, float]:
    """("wins", "ties", "loses" or "untested"; mean difference; two-sided p) of ``st``'s
    ``variant`` against ``ref``'s ``ref_variant`` on the final test metric (:func:`welch_word`)."""
    mine = [final_score(r, st.higher) for r in st.arms[variant].rows]
    theirs = [final_score(r, ref.higher) for r in ref.arms[ref_variant].rows]
    word, p = welch_word(mine, theirs, st.higher)
    return word, st.final(variant)[0] - ref.final(ref_variant)[0], p


def word_at_equal_time(st: Setting, variant: str) -> Tuple[str, float, float]:
    """better, ties or worse than the synchronous pipeline at equal time (final test metric, on the
    seeds that chose the arm: :func:`welch_word`), the difference of the means and the p."""
    word, diff, p = arm_word(st, variant, st)
    return {"wins": "better", "ties": "ties", "loses": "worse", "untested": "untested"}[word], diff, p


def word_to_target(st: Setting, variant: str) -> Tuple[str, Optional[float]]:
    """sooner, ties, later or never against the synchronous pipeline's time to target (per seed,
    :func:`welch_word`), and the ratio synchronous time / the method's."""
    mine, sync = st.time_to_target(variant), st.time_to_target(SYNC)
    if mine is None:
        return ("never" if st.times_to_target(variant) else "-"), None
    if sync is None:
        return "-", None
    word, _ = welch_word([t for t in st.times_to_target(variant) if t is not None],
                         [t for t in st.times_to_target(SYNC) if t is not None], higher=False)
    return {"wins": "sooner", "ties": "ties", "loses": "later", "untested": "untested"}[word], sync[0] / mine[0]


def recommendation(settings: Sequence[Setting], task: str, stages: int) -> Optional[Dict[str, Any]]:
    """The OLD rule, kept to report what it said (study/make_results7.py's "before" column): the
    best mean final *test* metric at equal time over the task's arms; an asynchronous one where it
    beats the best synchronous pipeline beyond the larger seed spread. It reads test to choose, so
    no advice comes from it (the confirmation's does). Beside it: the runner-up, the best
    synchronous candidate and the best asynchronous one (None where there is none)."""
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
    best_async = max([c for c in candidates if c[1] != SYNC], key=key, default=None)
    return {"setting": best[0], "variant": best[1], "runner_up": runner, "synchronous": best_sync,
            "asynchronous": best_async}


class _Rows:
    """What make_results2.diagnosis reads of a setting: ``methods[variant].rows``."""

    def __init__(self, arms: Dict[str, Arm]) -> None:
        self.methods = arms

