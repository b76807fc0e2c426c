"""The equal-time study's statistical efficiency, as the planner reads it: per (task, optimizer,
N), the updates each variant needed to reach the target (the first validation evaluation at or
past 99 % / 101 % of sequential's mean final validation metric, as the report's time to target),
against the synchronous pipeline's (sequential's runs: the updates every synchronous schedule
computes).

``python -m study.make_results3 --package`` writes the table, as
``pipeoptim.lab.tasks.updates_to_target.UPDATES_TO_TARGET`` reads it, into the package's data
file (study/package_table.py); study/tests/test_make_results3.py holds the file to the committed
rows. The settings are the ones the package's ADVICE comes from
(study.make_results4.package_advice): the (task, N) whose study runs are all in, with issue 38's
arm's rows where its runs of that task are all in, and issue 51's rows of each of its arms (task,
optimizer, variant) whose planned runs are all in (study/make_results6.py).

Per variant: the seeds, how many reached the target, the mean updates to it (None unless every
seed reached it, as the report's time to target), and the ratio of that mean to the synchronous
pipeline's (its mean over the seeds that reached it: the target is 99 % of their mean). A variant
that computes another's updates bit for bit (study3_suite.SAME_AS: pipeoptim at M = 2 is XPipe)
gets the other's numbers under its own method and micro-batch count, so the planner finds it.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from study.make_results2_data import run_updates_to_target
from study.make_results3_arith import SYNC, Setting, read_rows, settings_of
from study.study3_suite import SAME_AS, variant_microbatches, variant_spec
from pipeoptim.lab.plan_targets import study_options

SIGNIFICANT = 6  #: significant digits of the table's ratios and updates


def _round(x: Optional[float]) -> Optional[float]:
    return None if x is None else float(f"{x:.{SIGNIFICANT}g}")


def updates_per_seed(st: Setting, variant: str) -> List[Optional[float]]:
    """Per seed of ``variant``'s arm, the updates to the setting's target (None: never)."""
    target = st.target()
    if target is None:
        return []
    return [run_updates_to_target(r, target, st.higher) for r in st.arms[variant].rows]


def variant_entry(st: Setting, variant: str, sync_updates: Optional[float],
                  as_variant: Optional[str] = None) -> Dict[str, Any]:
    """One variant's line: as :class:`pipeoptim.lab.tasks.updates_to_target.VariantRatio`'s fields.
    ``as_variant``: the name (and so the method and M) to list ``variant``'s runs under."""
    name = as_variant or variant
    method, options, _ = variant_spec(name, st.stages)
    seeds = updates_per_seed(st, variant)
    reached = [u for u in seeds if u is not None]
    updates = statistics.mean(reached) if reached and len(reached) == len(seeds) else None
    other = st.stages // 2 if st.stages > 1 else 2
    return {"variant": name, "method": method, "options": study_options(options),
            "microbatches": variant_microbatches(name, st.stages),
            "per_stage": (variant_microbatches(name, st.stages) == st.stages
                          and variant_microbatches(name, other) == other),
            "seeds": len(seeds), "reached": len(reached), "updates": _round(updates),
            "ratio": _round(updates / sync_updates) if updates is not None and sync_updates else None,
            "same_as": variant if as_variant else None}


def setting_entry(st: Setting) -> Optional[Dict[str, Any]]:
    """A setting's table entry, as ``StudiedSetting``'s fields; None where the synchronous
    pipeline never reached its own target (no ratio can be taken)."""
    sync = [u for u in updates_per_seed(st, SYNC) if u is not None]
    if not sync:
        return None
    sync_updates = statistics.mean(sync)
    first = st.arms[SYNC].rows[0]
    variants = [variant_entry(st, v, sync_updates) for v, arm in st.arms.items() if v != SYNC and arm.rows]
    for alias, other in SAME_AS.items():
        if other in st.arms and st.arms[other].rows and alias not in st.arms:
            variants.append(variant_entry(st, other, sync_updates, as_variant=alias))
    return {"task": st.task, "optimizer": st.optimizer, "stages": st.stages, "model": first.get("model"),
            "batch_size": first.get("batch_size"), "metric": st.metric, "higher_is_better": st.higher,
            "target": _round(st.target()), "sync_updates": _round(sync_updates),
            "sync_seeds": len(st.arms[SYNC].rows), "sync_reached": len(sync),
            "variants": tuple(variants)}


def target_entries(settings: Sequence[Setting],
                   complete: Sequence[Tuple[str, int]]) -> Dict[Tuple[str, str, int], Dict[str, Any]]:
    """(task, optimizer, N) -> the setting's entry, for the settings whose (task, N) is in ``complete``."""
    out: Dict[Tuple[str, str, int], Dict[str, Any]] = {}
    for st in settings:
        if (st.task, st.stages) in complete and (entry := setting_entry(st)) is not None:
            out[(st.task, st.optimizer, st.stages)] = entry
    return out


def package_targets(study: Path, arm: Optional[Path], translation: Optional[Path] = None,
                    feedback: Optional[Path] = None) -> Dict[Tuple[str, str, int], Dict[str, Any]]:
    """The package's UPDATES_TO_TARGET entries, from the rows the package's ADVICE comes from
    (make_results4.package_sources): each source replaces the entries of the (task, N) it decides."""
    from study.make_results4 import package_sources

    entries: Dict[Tuple[str, str, int], Dict[str, Any]] = {}
    for settings, cells in package_sources(study, arm, translation, feedback):
        entries = {k: v for k, v in entries.items() if (k[0], k[2]) not in cells}
        entries.update(target_entries(settings, cells))
    return dict(sorted(entries.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])))
