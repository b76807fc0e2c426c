"""How many updates each method needs to reach the target, against the synchronous pipeline, per
task, optimizer and pipeline depth: the equal-time study's statistical efficiency, which
``pipeoptim plan`` ranks by (:mod:`pipeoptim.lab.plan_targets`).

The target is the report's (docs/results.md, "time to target"): 99 % of sequential's mean final
validation metric (101 % for perplexity), reached at the first validation evaluation at or past
it. Per variant the study ran: the mean updates to the target over its seeds (None unless every
seed reached it: "never reached"), and ``ratio``, that mean over the synchronous pipeline's
(sequential's runs: the updates every synchronous schedule computes, so 1 for them). A method's
predicted time to a model as good as synchronous training's is its seconds per mini-batch times
``ratio`` times ``sync_updates``.

The table is read from the data file beside :mod:`.advice` (``equal_time_study.json``, its
``"updates_to_target"``), which ``python -m study.make_results3 --package`` writes from the
committed rows (the settings the study's :data:`~pipeoptim.lab.tasks.advice.ADVICE` comes from);
study/tests/test_make_results3.py holds the file to them. This module imports nothing heavy (no
torch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from .advice import SOURCE, nearest_depth, not_studied_here, pairs, study_table


@dataclass(frozen=True)
class VariantRatio:
    """One variant of the study in one setting: its updates to the target against the
    synchronous pipeline's."""

    variant: str                #: the study's name (a method with its options and micro-batches)
    method: str
    options: Tuple[Tuple[str, str], ...]  #: method options beyond the defaults, as (option, value)
    microbatches: int           #: micro-batches per mini-batch it ran with at the setting's N
    per_stage: bool             #: it runs M = N at every N (so it stands for M = N at another depth)
    seeds: int
    reached: int                #: seeds that reached the target
    updates: Optional[float]    #: mean updates to the target; None unless every seed reached it
    ratio: Optional[float]      #: updates / the synchronous pipeline's; None: never reached
    same_as: Optional[str]      #: the variant whose runs these are (the same computation), if another's

    def describe(self) -> str:
        """Where the ratio comes from, in a few words."""
        runs = f"{self.same_as}'s runs (the same computation)" if self.same_as else self.variant
        if self.ratio is None:
            return f"{runs}: never reached ({self.reached} of {self.seeds} seeds reached it)"
        return f"{runs}: {self.updates:.0f} updates, {self.seeds} seed(s)"


@dataclass(frozen=True)
class StudiedSetting:
    """One (task, optimizer, N) of the study: its recipe and every variant's ratio."""

    task: str
    optimizer: str
    stages: int
    model: str                  #: the model the study trained
    batch_size: int
    metric: str
    higher_is_better: bool
    target: float               #: the validation metric counted as reached
    sync_updates: float         #: the synchronous pipeline's mean updates to the target
    sync_seeds: int
    sync_reached: int
    variants: Tuple[VariantRatio, ...]

    def name(self) -> str:
        return f"{self.task}, {self.optimizer}, N = {self.stages}"

    def lookup(self, method: str, microbatches: int, stages: int,
               options: Tuple[Tuple[str, str], ...] = ()) -> Optional[VariantRatio]:
        """The variant that is ``method`` with ``options`` beyond its defaults (none: its
        defaults; as (option, value) pairs, ``(("error_feedback", "True"),)``) at ``microbatches``
        on ``stages`` stages (a variant run at M = N stands for M = ``stages``); None if none is."""
        for v in self.variants:
            wanted = stages if v.per_stage else v.microbatches
            if v.method == method and v.options == tuple(options) and microbatches == wanted:
                return v
        return None


def studied_setting(task: Optional[str], optimizer: str, stages: int, model: Optional[str] = None,
                    batch_size: Optional[int] = None) -> Tuple[Optional[StudiedSetting], str]:
    """(the study's setting for ``task`` with ``optimizer`` at the studied N nearest ``stages``,
    or None; one line saying which, or why there is none: a task, model, batch size or optimizer
    the study did not run). ``task`` None: a model of the user's own."""
    if task is None:
        return None, f"a model of your own: {SOURCE} has no ratio of updates to the target for it"
    mine = [s for (t, _, _), s in UPDATES_TO_TARGET.items() if t == task]
    if not mine:
        tasks = ", ".join(dict.fromkeys(t for t, _, _ in UPDATES_TO_TARGET))
        return None, f"{SOURCE} did not run {task} (it ran {tasks}): no ratio of updates to the target for it"
    ran = mine[0]
    if model is not None and model != ran.model:
        return None, (f"{SOURCE} ran {task}'s model {ran.model}, not {model}: no ratio of updates to the target "
                      f"for it (--model {ran.model} plans the studied one)")
    if batch_size is not None and batch_size != ran.batch_size:
        return None, (f"{SOURCE} ran {task} at batch {ran.batch_size}, not {batch_size}: its ratios of updates "
                      f"to the target need not hold (--batch-size {ran.batch_size} plans the studied one)")
    depths = [s.stages for s in mine if s.optimizer == optimizer]
    if not depths:
        ran_with = ", ".join(dict.fromkeys(s.optimizer for s in mine))
        return None, (f"{SOURCE} ran {task} with {ran_with}, not {optimizer}: no ratio of updates to the target "
                      f"for it")
    setting = UPDATES_TO_TARGET[(task, optimizer, nearest_depth(depths, stages))]
    near = "" if setting.stages == stages else f" {not_studied_here(stages)}"
    return setting, f"ratios of updates to the target: {setting.name()} of {SOURCE}{near}"


def targets_table(table: Dict[str, Any]) -> Dict[Tuple[str, str, int], StudiedSetting]:
    """(task, optimizer, N) -> :class:`StudiedSetting`, from a table file's contents
    (``"updates_to_target"``, in its order)."""
    return {(e["task"], e["optimizer"], e["stages"]): StudiedSetting(**{
        **e, "variants": tuple(VariantRatio(**{**v, "options": pairs(v["options"])}) for v in e["variants"])})
        for e in table["updates_to_target"]}


#: (task, optimizer, N) -> the study's setting; only the (task, N) whose planned runs are all in
UPDATES_TO_TARGET: Dict[Tuple[str, str, int], StudiedSetting] = targets_table(study_table())
