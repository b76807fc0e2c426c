"""Issue 51's arms of the equal-time study: error feedback's open ends, at N = 8.

The same harness and rules as issue 23's study (study/study3.py runs it with ``--suite
feedback``; its rows go to ``study/results/study3-feedback/runs.jsonl``), over the rows the
earlier arms wrote (issue 23's, issue 38's ``delay_fixes`` with its image arm, issue 41's
translation cell): the synchronous pipeline's time sets the budget B, each variant trains
U_m = floor(B / s_m) updates with the recipe scaled to U_m, the lr is chosen on the validation
split and the test metric is read at the end. Its runs, in this order, so that an interrupted
arm has the most telling rows first:

1. **The image advice's third seed**: pipeoptim-2bw with error feedback and AdamW on image, seed
   2 at the lr its tuning chose (the advice names it over the synchronous pipeline by a margin
   about its spread over 2 seeds).
2. **Translation with Muon and error feedback** (``pipeoptim-2bw+ef``), by the translation cell's
   rules (study/study5_plan.py): the cell's two lrs at seed 0, both to the end, one more a factor
   2 beyond the better where it lies at an edge of the grid; seed 1 at the better on validation
   (the decisive-gap cut drops it where seed 0 ended more than the gap behind the synchronous
   pipeline with Muon); seed 2 once seeds 0 and 1 are in, if its mean over them beats the cell's
   closest asynchronous variant so far (the one that has a seed 2), which would make it the
   closest.
3. **The feedback-aware prediction** (``pipeoptim-2bw+ef+aware``: ``predict_feedback=True``) at
   equal time where plain error feedback ran with pipeoptim-2bw: the LM with AdamW and with Muon,
   translation and image with AdamW. No lr of its own: the lr plain ``+ef`` won with in the cell,
   and plain ``+ef``'s seeds there (with 1.'s seed 2 on image), so that each row has its paired
   unaware row; seed 0 of every cell first, then the further seeds under the decisive-gap cut,
   and only where seed 0 ended farther from plain ``+ef``'s seed 0 than plain ``+ef``'s seed
   spread in the cell (else the two predictions train the same model there, and more seeds of
   the pair would measure the seeds, not the prediction).
   A caution: the aware prediction differs from the plain one by ``beta (u_prev - lr*Delta)``,
   which is small, since Delta is the direction of the step just applied (a schedule's lr change
   and decoupled decay make the difference; weights/predicted_2bw.py); these rows test whether
   that small difference shows at equal time, which is why they come after 1. and 2.

U_m is the base variant's (pipeoptim-2bw's: error feedback adds two passes over the weights an
update, the aware prediction one multi-tensor add a window). Minutes per run: the median CPU
minutes of the earlier whole runs (not resumed) of the variant in the cell, else of its base
(``+ef+aware`` -> ``+ef`` -> pipeoptim-2bw). The plan must fit ``budget_minutes``; where it does
not, runs are cut from the end of this order (the least telling first), each marked so.
"""
from __future__ import annotations

import copy
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from study import study2_plan
from study.study3_plan import Run, decided_by_seed0, load_rows, row_key
from study.study3_suite import sequential_updates
from study.study3_times import read_times
from study.study4_plan import alias_times, study_choice
from pipeoptim.lab.tasks import get_task

EF, AWARE, BASE = "pipeoptim-2bw+ef", "pipeoptim-2bw+ef+aware", "pipeoptim-2bw"
#: whose measured minutes a variant takes where it has none of its own
COST_CHAIN = {AWARE: EF, EF: BASE}
CUT = "cut to fit the budget"


def inputs(suite: Dict[str, Any], times: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
    """(the times of every cell, the translation cell's merged in and the variants aliased, as
    the planner and each run's seconds per mini-batch read them; the earlier arms' rows, by key)."""
    translation = read_times(Path(suite["translation_times"]))
    merged = copy.deepcopy(times)
    merged.setdefault("cells", {}).update(copy.deepcopy(translation.get("cells", {})))
    prior: Dict[str, Dict[str, Any]] = {}
    for path in suite["prior"]:
        prior.update(load_rows(Path(path)))
    return aliased(merged), prior


def aliased(times: Dict[str, Any]) -> Dict[str, Any]:
    """The times with ``+ef`` and ``+ef+aware`` taking pipeoptim-2bw's s_m and U_m (a copy)."""
    out = alias_times(times)
    for by_opt in out["cells"].values():
        for cell in by_opt.values():
            for at_n in cell["stages"].values():
                for table in (at_n["variants"], at_n["budget"]["updates"]):
                    if BASE in table:
                        table[AWARE] = table[BASE]
    return out


def cpu_minutes(rows: Dict[str, Dict[str, Any]], task: str, optimizer: str, variant: str, stages: int) -> float:
    """The median CPU minutes of the whole runs (not resumed, not diverged) of ``variant`` in the
    cell, else of the next variant of :data:`COST_CHAIN`; 10 where none has any."""
    while True:
        values = [r.get("cpu_seconds") or r["seconds"] for r in rows.values()
                  if (r["task"], r["optimizer"], r["variant"], r["stages"]) == (task, optimizer, variant, stages)
                  and r.get("until") != "third" and not r.get("diverged") and not r.get("resumed")]
        if values:
            return statistics.median(values) / 60
        if variant not in COST_CHAIN:
            return 10.0
        variant = COST_CHAIN[variant]


def finals(rows: Dict[str, Dict[str, Any]], task: str, optimizer: str, variant: str, stages: int,
           lr: Optional[float]) -> Dict[int, Optional[float]]:
    """Seed -> final test metric of the whole runs of a variant at ``lr`` (None: diverged)."""
    return {r["seed"]: r.get("final_metric") for r in rows.values()
            if (r["task"], r["optimizer"], r["variant"], r["stages"], r["lr"]) == (task, optimizer, variant, stages, lr)
            and r.get("until") != "third"}


def closest_so_far(rows: Dict[str, Dict[str, Any]], task: str, optimizer: str,
                   stages: int) -> Optional[Tuple[str, float]]:
    """(variant, lr) of the cell's closest asynchronous variant: the one given a seed 2."""
    for r in rows.values():
        if ((r["task"], r["optimizer"], r["stages"], r["seed"], r["phase"]) == (task, optimizer, stages, 2, "seeds")
                and r["variant"] != "sequential" and r.get("until") != "third"):
            return r["variant"], r["lr"]
    return None


def plan_runs(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]], times: Dict[str, Any],
              prior: Dict[str, Dict[str, Any]]) -> List[Run]:
    """Every run of the arms in order, with lr, U_m, status against ``rows`` (this arm's) and
    minutes, cut to ``budget_minutes``. ``prior``: the earlier arms' rows."""
    runs: List[Run] = []
    both = {**prior, **rows}
    times = aliased(times)
    n, gap = suite["stages"], suite["decisive_gap"]

    def updates_of(task: str, optimizer: str, variant: str) -> int:
        try:
            return int(times["cells"][task][optimizer]["stages"][str(n)]["budget"]["updates"][variant])
        except KeyError:
            raise KeyError(f"no budget for {task} x {optimizer} at N = {n} in the times files: run "
                           f"python -m study.study3_times (--suite translation for translation)") from None

    def add(run: Run, status: str = "ready", why: str = "") -> Run:
        run.updates = updates_of(run.task, run.optimizer, run.variant)
        run.index, run.status, run.why = len(runs), status, why
        run.minutes = cpu_minutes(both, run.task, run.optimizer, run.variant, run.stages)
        if run.status == "ready" and run.lr is not None and row_key(run.key_fields()) in both:
            run.status = "done"
        runs.append(run)
        return run

    def higher(task: str) -> bool:
        return get_task(task).higher_is_better

    def reference_lr(task: str, optimizer: str) -> Optional[float]:
        return study_choice(both, task, optimizer, "sequential", 1)[0]

    def next_seed(task: str, optimizer: str, variant: str, lr: Optional[float]) -> Tuple[str, str]:
        if lr is None:
            return "waiting", f"{variant}'s lr on {task} x {optimizer}"
        return decided_by_seed0(both, task, optimizer, variant, n, lr, reference_lr(task, optimizer),
                                higher(task), gap)

    def same_as_plain(task: str, optimizer: str, lr: Optional[float]) -> Optional[Tuple[str, str]]:
        """("dropped", why) where the aware prediction's seed 0 ended within plain +ef's seed
        spread (over its seeds in the cell, 2 or more) of plain +ef's seed 0 at the same lr."""
        aware = finals(both, task, optimizer, AWARE, n, lr).get(0)
        plain = finals(both, task, optimizer, EF, n, lr)
        seeds = [v for v in plain.values() if v is not None]
        if aware is None or plain.get(0) is None or len(seeds) < 2:
            return None
        apart, spread = abs(aware - plain[0]), statistics.stdev(seeds)
        if apart > spread:
            return None
        return "dropped", (f"its seed 0 ended {apart:.3g} from {EF}'s seed 0, within {EF}'s seed spread "
                           f"{spread:.3g}: the two predictions train the same model here")

    # 1. the image advice's third seed
    third = suite["third_seed"]
    ef_lr = {(t, o): study_choice(both, t, o, EF, n)[0] for t, o in suite["aware_cells"]}
    lr = ef_lr.get((third["task"], third["optimizer"]))
    add(Run("seeds", third["task"], third["optimizer"], third["variant"], n, third["seed"], lr,
            lr_source="its tuning's choice (a further seed)"),
        "ready" if lr is not None else "waiting", "" if lr is not None else f"{EF}'s tuning rows on image")

    # 2. translation with Muon and error feedback, tuned by the cell's rules
    task, optimizer = "translation", suite["muon_cell"]
    grid = list(suite["tasks"][task]["lr"][optimizer])

    def tune_row(at: float) -> Optional[Dict[str, Any]]:
        return both.get(row_key(Run("tune", task, optimizer, EF, n, 0, at,
                                    updates=updates_of(task, optimizer, EF)).key_fields()))

    lrs = list(grid)
    found = [(at, tune_row(at)) for at in lrs]
    if suite.get("extend_edges") and all(r is not None for _, r in found):
        ranked = study2_plan.ranked_lrs(found, higher(task))
        if ranked and ranked[0] in (min(grid), max(grid)):
            lrs.append(ranked[0] * 2 if ranked[0] == max(grid) else ranked[0] / 2)
    for at in lrs:
        add(Run("tune", task, optimizer, EF, n, 0, at,
                lr_source=("one beyond the grid's edge, where the better of its two lay (seed 0)" if at not in grid
                           else f"the cell's grid {', '.join(f'{x:g}' for x in grid)} (seed 0)")))
    found = [(at, tune_row(at)) for at in lrs]
    missing = [f"{at:g}" for at, r in found if r is None]
    ranked = [] if missing else study2_plan.ranked_lrs(found, higher(task))
    muon_lr = ranked[0] if ranked else None
    if missing:
        status, why = "waiting", f"{EF}'s tuning at lr {', '.join(missing)}"
    elif muon_lr is None:
        status, why = "dropped", f"{EF} diverged at every lr"
    else:
        status, why = next_seed(task, optimizer, EF, muon_lr)
    late: List[Tuple[Run, str, str]] = [(Run("seeds", task, optimizer, EF, n, 1, muon_lr,
                                             lr_source="chosen on validation"), status, why)]
    # its seed 2, if its mean over seeds 0 and 1 beats the closest variant's so far
    rival = closest_so_far(both, task, optimizer, n)
    mine = finals(both, task, optimizer, EF, n, muon_lr)
    if status == "dropped":
        close = ("dropped", why)
    elif muon_lr is None or any(seed not in mine for seed in (0, 1)):
        close = ("waiting", f"{EF}'s seeds 0 and 1 (the closest variant gets seed 2)")
    elif rival is None:
        close = ("ready", "")
    else:
        theirs = [v for s, v in finals(both, task, optimizer, rival[0], n, rival[1]).items() if s in (0, 1)]
        ours = [v for s, v in mine.items() if s in (0, 1)]
        better = (None not in ours and theirs and None not in theirs
                  and (statistics.mean(ours) > statistics.mean(theirs)) == higher(task))
        close = ("ready", "") if better else ("dropped", f"{rival[0]}'s mean over seeds 0 and 1 is as good: "
                                                         f"it stays the closest variant")
    late_seeds: List[Tuple[Run, str, str]] = [(Run("seeds", task, optimizer, EF, n, 2, muon_lr,
                                                   lr_source="chosen on validation (the closest asynchronous "
                                                             "variant)"), *close)]

    # 3. the aware prediction at plain error feedback's lr and seeds: every seed 0 first
    seeds_of = {}
    for t, o in suite["aware_cells"]:
        at = ef_lr[(t, o)]
        seeds = set(finals(both, t, o, EF, n, at)) if at is not None else set(suite["seeds"])
        if (t, o) == (third["task"], third["optimizer"]):
            seeds.add(third["seed"])
        seeds_of[(t, o)] = sorted(seeds | {0})
        add(Run("seeds", t, o, AWARE, n, 0, at, lr_source=f"{EF}'s choice in the cell"),
            "ready" if at is not None else "waiting", "" if at is not None else f"{EF}'s tuning rows on {t} x {o}")
    for run, status, why in late:
        add(run, status, why)
    for t, o in suite["aware_cells"]:
        at = ef_lr[(t, o)]
        status, why = next_seed(t, o, AWARE, at)
        if status == "ready":
            status, why = same_as_plain(t, o, at) or (status, why)
        for seed in seeds_of[(t, o)][1:]:
            late_seeds.append((Run("seeds", t, o, AWARE, n, seed, at, lr_source=f"{EF}'s choice in the cell"),
                               status, why))
    # further seeds: the seeds 1 before the seeds 2
    for run, status, why in sorted(late_seeds, key=lambda item: item[0].seed):
        add(run, status, why)
    cut_to_budget(runs, suite["budget_minutes"])
    return runs


def cut_to_budget(runs: Sequence[Run], budget: float) -> List[Run]:
    """Drop runs not yet done from the end of the plan until what is counted fits ``budget``
    core-minutes; the runs cut, each marked."""
    cut: List[Run] = []
    for run in reversed(runs):
        if total_minutes(runs) <= budget:
            break
        if run.status in ("ready", "waiting"):
            run.status, run.why = "dropped", f"{CUT} of {budget:.0f} core-minutes (the plan's last runs go first)"
            cut.append(run)
    return cut


def total_minutes(runs: Sequence[Run]) -> float:
    return sum(r.minutes for r in runs if r.status != "dropped")


def print_cuts(runs: Sequence[Run]) -> None:
    """What the budget cut, or that it cut nothing."""
    cut = [r for r in runs if r.status == "dropped" and r.why.startswith(CUT)]
    if not cut:
        print("cut: nothing (the plan fits its budget)")
        return
    print(f"cut: {len(cut)} runs, {sum(r.minutes for r in cut):.0f} core-minutes:")
    for r in cut:
        print(f"  {r.label()} ({r.minutes:.1f} min)")
