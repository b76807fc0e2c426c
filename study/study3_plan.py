"""Issue 23's study: the plan (every run, its lr, its updates U_m and its estimated minutes).

Per cell (task, optimizer), in this order, so that an interrupted study has the most useful rows
first (item 6: N = 8 before N = 4):

1. ``reference``: ``sequential``, seeds 0-2, U updates at the second study's lr (its schedule is
   the second study's, so its lr carries over; rerun because the second study's sequential was
   not clipped on sentiment and the LM).
2. ``tune`` (N = 8, seed 0), per variant:
   * *carried and re-tuned* (``cuts.retune_cells``; with ``cuts.retune = "edge"`` only where the
     second study's choice lies at an edge of its 4-lr grid, where the optimum was not
     bracketed): the second study's best lr and one neighbour (:func:`neighbour`), both to the
     end; the better on validation is kept;
   * *carried* (other cells): the second study's best lr, unchecked (the report says so);
     ``pipeoptim+M2`` and ``pipeoptim+MN`` carry ``pipeoptim``'s;
   * *swept* (what the second study never tuned: ``pipeoptim-2bw``; the LM with NAdam or Muon):
     4 log-spaced lrs (the second study's range, or ``lr_grid``), successive halving (the first
     third, the best 2 to the end), as the second study; where the best at the end is at an edge
     of the grid (``extend_edges``), one more whole run a factor 2 beyond it.
3. ``seeds``: N = 8, the remaining seeds at the chosen lr (in rounds: seed 1 everywhere, then
   seed 2); then N = 4, seeds 0-2 at N = 8's lr.

A run trains U_m = floor(B / s_m) updates (study3_times.py); its minutes are U_m times the
second study's measured seconds per update of the same (task, method, N) (evaluations
included; a variant the second study lacks costs as the one in ``cost_like``).
"""
from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from study import study2_plan
from study.common import keyed_rows
from study.make_results2_data import settings_of
from study.study3_suite import cell_methods, cell_stages, sequential_updates
from study.study3_times import lookup
from pipeoptim.lab.tasks import get_task


@dataclasses.dataclass
class Run:
    """One planned run (or its first third, or the rest of one), and where it stands."""

    phase: str               #: reference, tune or seeds
    task: str
    optimizer: str
    variant: str
    stages: int
    seed: int
    lr: Optional[float]      #: None until the runs it depends on are in
    updates: int = 0         #: U_m
    until: Optional[str] = None  #: swept runs: "third" or "end"; None: a whole run
    lr_source: str = ""      #: second study, neighbour, sweep, chosen on validation
    index: int = 0
    status: str = "ready"    #: ready, waiting, dropped or done
    why: str = ""
    minutes: float = 0.0

    def key_fields(self) -> Dict[str, Any]:
        """What identifies the run in runs.jsonl: U_m too, so that a budget measured again (another
        U_m) never takes a row of the old one for done."""
        return {"task": self.task, "optimizer": self.optimizer, "variant": self.variant, "stages": self.stages,
                "lr": self.lr, "seed": self.seed, "phase": self.phase, "until": self.until, "updates": self.updates}

    def folder_name(self) -> str:
        return f"{self.task}-{self.optimizer}-{self.variant}-N{self.stages}-lr{self.lr:g}-seed{self.seed}"

    def label(self) -> str:
        lr = f"{self.lr:g}" if self.lr is not None else "?"
        return (f"{self.phase}{f' ({self.until})' if self.until else ''} {self.task} {self.optimizer} "
                f"{self.variant} N={self.stages} lr {lr} seed {self.seed}, {self.updates} updates")


def row_key(row: Dict[str, Any]) -> str:
    return "|".join([row["task"], row["optimizer"], row["variant"], str(row["stages"]), repr(float(row["lr"])),
                     str(row["seed"]), row["phase"], str(row.get("until")), str(row.get("updates"))])


def load_rows(path: Path) -> Dict[str, Dict[str, Any]]:
    """The rows of a runs.jsonl by key (the first of duplicates; a torn last line ignored)."""
    return keyed_rows(path, row_key)


# --------------------------------------------------------------------------------------------
# what the second study chose


def study2_choice(suite2: Dict[str, Any], rows2: Dict[str, Dict[str, Any]], task: str, optimizer: str,
                  variant: str) -> Optional[Tuple[float, Optional[float]]]:
    """(best lr, runner-up lr or None) of the second study's sweep, on validation; None where it
    has no sweep of this variant in this cell."""
    if (task, optimizer) not in [tuple(c) for c in suite2["cells"]] or variant not in ["sequential",
                                                                                        *suite2["methods"]]:
        return None
    lr, status, _ = study2_plan.best_lr(suite2, rows2, task, optimizer, variant)
    if status != "ready":
        return None
    winners, _ = study2_plan.halving_winners(suite2, rows2, task, optimizer, variant)
    ends = [(w, rows2.get(study2_plan.row_key(study2_plan.sweep_run(suite2, task, optimizer, variant, w, "end").key_fields())))
            for w in winners or []]
    ranked = study2_plan.ranked_lrs([(w, r) for w, r in ends if r is not None], get_task(task).higher_is_better)
    return lr, (ranked[1] if len(ranked) > 1 else None)


def neighbour(lr: float, runner_up: Optional[float], grid: Sequence[float] = ()) -> float:
    """One lr beside ``lr`` (a factor 2): beyond the edge of the second study's ``grid`` when
    ``lr`` is at one (the optimum was not bracketed there), else toward its runner-up (the
    closest rival, which a longer schedule may favour); half without either."""
    if grid and lr == max(grid):
        up = True
    elif grid and lr == min(grid):
        up = False
    else:
        up = runner_up is not None and runner_up > lr
    return float(f"{lr * (2 if up else 0.5):.3g}")


def at_edge(lr: float, grid: Sequence[float]) -> bool:
    return bool(grid) and lr in (min(grid), max(grid))


def carried_variant(variant: str) -> str:
    """Whose second-study lr a variant carries (pipeoptim at another M: pipeoptim's)."""
    return "pipeoptim" if variant in ("pipeoptim+M2", "pipeoptim+MN") else variant


def sweep_grid(suite: Dict[str, Any], task: str, optimizer: str) -> List[float]:
    grid = suite["lr_grid"].get((task, optimizer)) or suite["tasks"][task]["lr"][optimizer]
    return study2_plan.log_spaced(grid[0], grid[1], suite["lrs"])


def dominated_variants(rows2: Dict[str, Dict[str, Any]]) -> Dict[str, str]:
    """The second study's asynchronous variants that another one matched or beat in every setting
    (mean final test metric, every (cell, N)): variant -> the one that dominates it."""
    settings = settings_of(study2_plan.SUITES["default"], rows2, None)
    variants = study2_plan.SUITES["default"]["methods"]
    out: Dict[str, str] = {}
    for a in variants:
        for b in variants:
            if a == b or a in out:
                continue
            if all((st.final(b)[0] >= st.final(a)[0]) if st.higher else (st.final(b)[0] <= st.final(a)[0])
                   for st in settings):
                out[a] = b
    return out


def carried_choice(suite: Dict[str, Any], rows2: Dict[str, Dict[str, Any]], task: str, optimizer: str,
                   variant: str) -> Optional[Tuple[float, Optional[float]]]:
    """(lr, runner-up or None) a variant carries over: the suite's own (``carried_lrs``), else the
    second study's choice for it (pipeoptim at another M: pipeoptim's); None where there is none."""
    who = carried_variant(variant)
    fixed = suite.get("carried_lrs", {}).get(who)
    if fixed is not None:
        return fixed, None
    if not suite.get("study2"):
        return None
    return study2_choice(study2_plan.SUITES["default"], rows2, task, optimizer, who)


def tuning(suite: Dict[str, Any], rows2: Dict[str, Dict[str, Any]], task: str, optimizer: str,
           variant: str) -> Tuple[str, List[float], str]:
    """(kind, lrs, where they come from): kind ``carried`` (one lr), ``pair`` (two, both to the
    end) or ``sweep`` (4, halving)."""
    choice = carried_choice(suite, rows2, task, optimizer, variant)
    if choice is None:
        return "sweep", sweep_grid(suite, task, optimizer), "swept (not tuned by the second study)"
    lr, runner_up = choice
    source = "second study" + (f" ({carried_variant(variant)}'s)" if carried_variant(variant) != variant else "")
    grid = study2_plan.sweep_lrs(study2_plan.SUITES["default"], task, optimizer) if suite.get("study2") else []
    retune = (task, optimizer) in [tuple(c) for c in suite["cuts"]["retune_cells"]] and (
        suite["cuts"].get("retune") != "edge" or at_edge(lr, grid))
    if variant != "sequential" and retune:
        return "pair", [lr, neighbour(lr, runner_up, grid)], source + " and one neighbour"
    return "carried", [lr], source + ", carried over unchecked"


# --------------------------------------------------------------------------------------------
# the plan


def measured_step_seconds(suite: Dict[str, Any], rows2: Dict[str, Dict[str, Any]], task: str, optimizer: str,
                          variant: str, stages: int) -> float:
    """Seconds per update (evaluations included) of the second study's whole runs of this cell,
    method and N (median); the task's measured step time x 1.1 where it has none."""
    opt2 = optimizer if optimizer in ("momentum", "adamw") else "adamw"
    like = suite["cost_like"].get(variant, variant)
    values = [r["seconds"] / r["updates"] for r in rows2.values()
              if r["task"] == task and r["optimizer"] == opt2 and r["variant"] == like
              and r["stages"] == stages and r.get("until") is None and not r.get("diverged")]
    if values:
        return statistics.median(values)
    return suite["tasks"][task]["seconds_per_step"] * 1.1


def decided_by_seed0(rows: Dict[str, Dict[str, Any]], task: str, optimizer: str, variant: str, stages: int,
                     lr: float, reference_lr: Optional[float], higher: bool, gap: float) -> Tuple[str, str]:
    """(status, why) of a variant's next seed under the decisive-gap cut: "dropped" where its
    seed 0 at ``lr`` ended more than ``gap`` (a share of the reference's metric) behind the mean
    of the reference's runs in (``sequential`` at ``reference_lr``: the synchronous pipeline's
    final test metric), since a second seed cannot move a verdict by that much; "waiting" until
    its seed 0 is in; else "ready"."""
    def finals(name: str, at: Optional[float], seeds: Optional[Sequence[int]] = None) -> List[Optional[float]]:
        return [r.get("final_metric") for r in rows.values()
                if (r["task"], r["optimizer"], r["variant"], r["lr"]) == (task, optimizer, name, at)
                and r["stages"] == (1 if name == "sequential" else stages) and r.get("until") != "third"
                and (seeds is None or r["seed"] in seeds)]
    first = finals(variant, lr, [0])
    if not first:
        return "waiting", f"{variant}'s seed 0 (the decisive-gap cut reads it)"
    reference = [v for v in finals("sequential", reference_lr) if v is not None]
    if first[0] is None or not reference:  # a diverged seed 0 decides nothing
        return "ready", ""
    mean = statistics.mean(reference)
    behind = (mean - first[0]) / mean if higher else (first[0] - mean) / mean
    if behind > gap:
        return "dropped", f"seed 0 ended {behind:.0%} behind the synchronous pipeline (the decisive-gap cut)"
    return "ready", ""


def plan_runs(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]], times: Dict[str, Any],
              rows2: Dict[str, Dict[str, Any]]) -> List[Run]:
    """Every run in the order they are run, with lr, U_m, status against ``rows`` and minutes."""
    runs: List[Run] = []
    share, keep = suite["halving"]["share"], suite["halving"]["keep"]

    def updates_of(task: str, optimizer: str, variant: str, stages: int) -> Optional[int]:
        if variant == "sequential":
            return sequential_updates(suite, task)
        try:
            return int(lookup(times, task, optimizer, stages)["updates"][variant])
        except KeyError:
            return None

    def third_of(task: str, total: int) -> int:
        return study2_plan.stop_point(total, 1, suite["tasks"][task]["eval_every"], share)

    def add(run: Run, status: str = "ready", why: str = "", part: Tuple[float, float] = (0.0, 1.0)) -> None:
        total = updates_of(run.task, run.optimizer, run.variant, run.stages)
        if total is None:
            status, why = "waiting", f"no U_m for {run.variant} in the times file (study3_times.py)"
        run.updates, run.index, run.status, run.why = total or 0, len(runs), status, why
        seconds = measured_step_seconds(suite, rows2, run.task, run.optimizer, run.variant, run.stages)
        if total:
            start = 0 if run.until != "end" else third_of(run.task, total)
            end = third_of(run.task, total) if run.until == "third" else total
            run.minutes = (end - start) * seconds / 60
        if run.status == "ready" and row_key(run.key_fields()) in rows:
            run.status = "done"
        runs.append(run)

    def chosen(task: str, optimizer: str, variant: str) -> Tuple[Optional[float], str, str]:
        """(lr, status, why) of a variant at N = 8 after its tuning."""
        kind, lrs, _ = tuning(suite, rows2, task, optimizer, variant)
        n = 1 if variant == "sequential" else max(cell_stages(suite, task, optimizer))
        higher = get_task(task).higher_is_better
        if kind == "carried":
            return lrs[0], "ready", ""
        ends = [(lr, None) for lr in lrs] if kind == "pair" else None
        if kind == "sweep":
            winners = swept_winners(task, optimizer, variant, lrs, n)
            if winners is None:
                return None, "waiting", f"the first thirds of {variant}'s sweep"
            beyond, decided = extension(task, optimizer, variant, lrs, n)
            if not decided:
                return None, "waiting", f"{variant}'s tuning at lr {', '.join(f'{lr:g}' for lr in winners)}"
            ends = [(lr, "end") for lr in winners] + ([(beyond, None)] if beyond is not None else [])
        found = [(lr, rows.get(row_key({**base(task, optimizer, variant, n, lr), "phase": "tune", "until": until})))
                 for lr, until in ends]
        missing = [f"{lr:g}" for lr, r in found if r is None]
        if missing:
            return None, "waiting", f"{variant}'s tuning at lr {', '.join(missing)}"
        ranked = study2_plan.ranked_lrs(found, higher)
        return (ranked[0], "ready", "") if ranked else (None, "dropped", f"{variant} diverged at every lr")

    def base(task: str, optimizer: str, variant: str, n: int, lr: float) -> Dict[str, Any]:
        return {"task": task, "optimizer": optimizer, "variant": variant, "stages": n, "lr": lr, "seed": 0,
                "updates": updates_of(task, optimizer, variant, n)}

    def extension(task: str, optimizer: str, variant: str, lrs: Sequence[float], n: int) -> Tuple[Optional[float], bool]:
        """(the lr one step beyond the sweep's edge, or None; whether that is decided): where the
        best run at the end is at the edge of the 4-lr grid (its optimum not bracketed), one more
        whole run a factor 2 beyond it (``extend_edges``; once, not again beyond that)."""
        winners = swept_winners(task, optimizer, variant, lrs, n) or []
        found = [(lr, rows.get(row_key({**base(task, optimizer, variant, n, lr), "phase": "tune", "until": "end"})))
                 for lr in winners]
        if not winners or any(r is None for _, r in found):
            return None, False
        ranked = study2_plan.ranked_lrs(found, get_task(task).higher_is_better)
        if not suite.get("extend_edges") or not ranked or ranked[0] not in (min(lrs), max(lrs)):
            return None, True
        return float(f"{ranked[0] * (2 if ranked[0] == max(lrs) else 0.5):.3g}"), True

    def swept_winners(task: str, optimizer: str, variant: str, lrs: Sequence[float], n: int) -> Optional[List[float]]:
        thirds = [(lr, rows.get(row_key({**base(task, optimizer, variant, n, lr), "phase": "tune", "until": "third"})))
                  for lr in lrs]
        if any(r is None for _, r in thirds):
            return None
        return study2_plan.ranked_lrs(thirds, get_task(task).higher_is_better)[:keep]

    cells = [tuple(c) for c in suite["cells"]]

    def tuned_variants(task: str, optimizer: str) -> List[str]:
        """What a cell tunes at N = 8: its variants, and sequential where it has no carried lr."""
        carried = tuning(suite, rows2, task, optimizer, "sequential")[0] == "carried"
        return ([] if carried else ["sequential"]) + cell_methods(suite, task, optimizer,
                                                                 max(cell_stages(suite, task, optimizer)))

    for task, optimizer in cells:  # 1. the reference, where its lr carries over
        kind, lrs, source = tuning(suite, rows2, task, optimizer, "sequential")
        if kind == "carried":
            for seed in suite["seeds"]:
                add(Run("reference", task, optimizer, "sequential", 1, seed, lrs[0], lr_source=source))
    for until in ("third", "end"):  # 2. tuning at N = 8: the sweeps' thirds, then every run to the end
        for task, optimizer in cells:
            for variant in tuned_variants(task, optimizer):
                n = 1 if variant == "sequential" else max(cell_stages(suite, task, optimizer))
                kind, lrs, source = tuning(suite, rows2, task, optimizer, variant)
                if kind == "sweep" and until == "third":
                    for lr in lrs:
                        add(Run("tune", task, optimizer, variant, n, 0, lr, until="third", lr_source=source))
                elif kind == "sweep":
                    winners = swept_winners(task, optimizer, variant, lrs, n)
                    for rank in range(keep):
                        if winners is None:
                            add(Run("tune", task, optimizer, variant, n, 0, None, until="end"), "waiting",
                                f"the first thirds of {variant}'s sweep")
                        elif rank < len(winners):
                            add(Run("tune", task, optimizer, variant, n, 0, winners[rank], until="end",
                                    lr_source=source))
                    beyond, _ = extension(task, optimizer, variant, lrs, n)
                    if beyond is not None:
                        add(Run("tune", task, optimizer, variant, n, 0, beyond,
                                lr_source=source + ", one step beyond the edge its best reached"))
                elif kind == "pair" and until == "end":
                    for lr in lrs:
                        add(Run("tune", task, optimizer, variant, n, 0, lr, lr_source=source))
    for n in sorted(suite["stages"], reverse=True):  # 3. the seeds, N = 8 first, in rounds
        for seed in suite["cuts"].get("seeds_at", {}).get(n, suite["seeds"]):
            for task, optimizer in cells:
                if n not in cell_stages(suite, task, optimizer):
                    continue
                first = n == max(cell_stages(suite, task, optimizer))
                variants = tuned_variants(task, optimizer) if first else cell_methods(suite, task, optimizer, n)
                for variant in variants:
                    kind = tuning(suite, rows2, task, optimizer, variant)[0]
                    if first and seed == 0 and kind != "carried":
                        continue  # seed 0 at N = 8 is the tuning's run
                    lr, status, why = chosen(task, optimizer, variant)
                    gap = suite["cuts"].get("decisive_gap")
                    if gap and first and seed > 0 and variant != "sequential" and status == "ready":
                        status, why = decided_by_seed0(rows, task, optimizer, variant, n, lr,
                                                       chosen(task, optimizer, "sequential")[0],
                                                       get_task(task).higher_is_better, gap)
                    phase = "reference" if variant == "sequential" else "seeds"
                    source = tuning(suite, rows2, task, optimizer, variant)[2] if kind == "carried" else \
                        "chosen on validation"
                    add(Run(phase, task, optimizer, variant, 1 if variant == "sequential" else n, seed, lr,
                            lr_source=source), status, why)
    return runs


def shard_runs(runs: Sequence[Run], shard: Tuple[int, int]) -> List[Run]:
    index, count = shard
    return [run for run in runs if run.index % count == index]


def print_plan(runs: Sequence[Run], budget_minutes: float = 1200.0) -> None:
    """Every run (minutes each), then minutes per cell and phase, and the total against the budget."""
    print(f"{'#':>4} {'phase':<9} {'until':<5} {'task':<9} {'opt':<8} {'variant':<23} {'N':>2} {'lr':>8} "
          f"{'seed':>4} {'U_m':>5} {'min':>6}  status")
    for r in runs:
        lr = f"{r.lr:g}" if r.lr is not None else "?"
        print(f"{r.index:>4} {r.phase:<9} {r.until or '':<5} {r.task:<9} {r.optimizer:<8} {r.variant:<23} "
              f"{r.stages:>2} {lr:>8} {r.seed:>4} {r.updates:>5} {r.minutes:>6.2f}  {r.status}"
              f"{': ' + r.why if r.why else ''}")
    counted = [r for r in runs if r.status != "dropped"]
    groups: Dict[str, List[Run]] = {}
    for r in counted:
        groups.setdefault(f"{r.task} x {r.optimizer}, N = {r.stages if r.variant != 'sequential' else 'ref'}",
                          []).append(r)
    print(f"\n{'cell':<32} {'rows':>5} {'core-min':>9}")
    for name, group in groups.items():
        print(f"{name:<32} {len(group):>5} {sum(r.minutes for r in group):>9.1f}")
    total = sum(r.minutes for r in counted)
    left = sum(r.minutes for r in counted if r.status != "done")
    print(f"\ntotal: {len(counted)} rows, {total:.0f} core-minutes ({total / 120:.1f} h on 2 cores; budget "
          f"{budget_minutes:.0f}); {sum(r.status == 'done' for r in counted)} done, {left:.0f} core-minutes left")
