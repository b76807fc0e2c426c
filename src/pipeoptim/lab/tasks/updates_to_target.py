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

``study/make_results3.py --targets`` prints :data:`UPDATES_TO_TARGET` from the committed
rows (the settings the study's :data:`~pipeoptim.lab.tasks.advice.ADVICE` comes from), and
tests/test_make_results3.py holds this one to it: paste its output below. This module imports
nothing heavy (no torch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from .advice import SOURCE, nearest_depth


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

    def lookup(self, method: str, microbatches: int, stages: int) -> Optional[VariantRatio]:
        """The variant that is ``method`` with its default options at ``microbatches`` on
        ``stages`` stages (a variant run at M = N stands for M = ``stages``); None if none is."""
        for v in self.variants:
            wanted = stages if v.per_stage else v.microbatches
            if v.method == method and not v.options and microbatches == wanted:
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
    near = "" if setting.stages == stages else f" (no study at N = {stages}; the nearest studied depth)"
    return setting, f"ratios of updates to the target: {setting.name()} of {SOURCE}{near}"


#: (task, optimizer, N) -> the study's setting; only the (task, N) whose planned runs are all in
UPDATES_TO_TARGET: Dict[Tuple[str, str, int], StudiedSetting] = {
    ('image', 'adamw', 8): StudiedSetting(
        task='image',
        optimizer='adamw',
        stages=8,
        model='vgg',
        batch_size=64,
        metric='accuracy',
        higher_is_better=True,
        target=0.903078,
        sync_updates=2100.0,
        sync_seeds=3,
        sync_reached=3,
        variants=(
            VariantRatio(variant='pipeoptim-2bw', method='pipeoptim-2bw', options=(), microbatches=8,
                per_stage=True, seeds=2, reached=2, updates=2400.0, ratio=1.14286, same_as=None),
            VariantRatio(variant='pipedream-2bw', method='pipedream-2bw', options=(), microbatches=8,
                per_stage=True, seeds=2, reached=2, updates=2550.0, ratio=1.21429, same_as=None),
            VariantRatio(variant='spectrain', method='spectrain', options=(), microbatches=1, per_stage=False,
                seeds=2, reached=2, updates=3000.0, ratio=1.42857, same_as=None),
            VariantRatio(variant='xpipe', method='xpipe', options=(), microbatches=2, per_stage=False,
                seeds=2, reached=2, updates=2700.0, ratio=1.28571, same_as=None),
            VariantRatio(variant='pipeoptim+lr_correction', method='pipeoptim',
                options=(('lr_correction', 'delay'),), microbatches=1, per_stage=False, seeds=2, reached=2,
                updates=3600.0, ratio=1.71429, same_as=None),
            VariantRatio(variant='pipeoptim+MN', method='pipeoptim', options=(), microbatches=8,
                per_stage=True, seeds=2, reached=2, updates=2400.0, ratio=1.14286, same_as=None),
            VariantRatio(variant='pipeoptim+M2', method='pipeoptim', options=(), microbatches=2,
                per_stage=False, seeds=2, reached=2, updates=2700.0, ratio=1.28571, same_as='xpipe'),
        ),
    ),
    ('image', 'momentum', 8): StudiedSetting(
        task='image',
        optimizer='momentum',
        stages=8,
        model='vgg',
        batch_size=64,
        metric='accuracy',
        higher_is_better=True,
        target=0.894036,
        sync_updates=1900.0,
        sync_seeds=3,
        sync_reached=3,
        variants=(
            VariantRatio(variant='pipeoptim-2bw', method='pipeoptim-2bw', options=(), microbatches=8,
                per_stage=True, seeds=2, reached=2, updates=1800.0, ratio=0.947368, same_as=None),
            VariantRatio(variant='pipedream-2bw', method='pipedream-2bw', options=(), microbatches=8,
                per_stage=True, seeds=2, reached=2, updates=2400.0, ratio=1.26316, same_as=None),
            VariantRatio(variant='spectrain', method='spectrain', options=(), microbatches=1, per_stage=False,
                seeds=2, reached=2, updates=2700.0, ratio=1.42105, same_as=None),
            VariantRatio(variant='pipeoptim+lr_correction', method='pipeoptim',
                options=(('lr_correction', 'delay'),), microbatches=1, per_stage=False, seeds=2, reached=2,
                updates=3150.0, ratio=1.65789, same_as=None),
            VariantRatio(variant='xpipe', method='xpipe', options=(), microbatches=2, per_stage=False,
                seeds=2, reached=2, updates=2550.0, ratio=1.34211, same_as=None),
            VariantRatio(variant='pipeoptim+MN', method='pipeoptim', options=(), microbatches=8,
                per_stage=True, seeds=2, reached=2, updates=2400.0, ratio=1.26316, same_as=None),
            VariantRatio(variant='pipeoptim+M2', method='pipeoptim', options=(), microbatches=2,
                per_stage=False, seeds=2, reached=2, updates=2550.0, ratio=1.34211, same_as='xpipe'),
        ),
    ),
    ('lm', 'adamw', 8): StudiedSetting(
        task='lm',
        optimizer='adamw',
        stages=8,
        model='gpt-narrow',
        batch_size=16,
        metric='perplexity',
        higher_is_better=False,
        target=51.7255,
        sync_updates=2000.0,
        sync_seeds=3,
        sync_reached=3,
        variants=(
            VariantRatio(variant='pipeoptim-2bw', method='pipeoptim-2bw', options=(), microbatches=8,
                per_stage=True, seeds=2, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='xpipe', method='xpipe', options=(), microbatches=2, per_stage=False,
                seeds=1, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim+lr_correction', method='pipeoptim',
                options=(('lr_correction', 'delay'),), microbatches=1, per_stage=False, seeds=1, reached=0,
                updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipedream-2bw', method='pipedream-2bw', options=(), microbatches=8,
                per_stage=True, seeds=1, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='spectrain', method='spectrain', options=(), microbatches=1, per_stage=False,
                seeds=1, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim+MN', method='pipeoptim', options=(), microbatches=8,
                per_stage=True, seeds=2, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipedream-2bw+ef', method='pipedream-2bw',
                options=(('error_feedback', 'True'),), microbatches=8, per_stage=True, seeds=2, reached=0,
                updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim-2bw+ef', method='pipeoptim-2bw',
                options=(('error_feedback', 'True'),), microbatches=8, per_stage=True, seeds=2, reached=0,
                updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim+M2', method='pipeoptim', options=(), microbatches=2,
                per_stage=False, seeds=1, reached=0, updates=None, ratio=None, same_as='xpipe'),
        ),
    ),
    ('lm', 'delay-nadamw', 8): StudiedSetting(
        task='lm',
        optimizer='delay-nadamw',
        stages=8,
        model='gpt-narrow',
        batch_size=16,
        metric='perplexity',
        higher_is_better=False,
        target=66.8164,
        sync_updates=1800.0,
        sync_seeds=2,
        sync_reached=1,
        variants=(
            VariantRatio(variant='pipeoptim', method='pipeoptim', options=(), microbatches=1, per_stage=False,
                seeds=1, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='xpipe', method='xpipe', options=(), microbatches=2, per_stage=False,
                seeds=2, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim-2bw', method='pipeoptim-2bw', options=(), microbatches=8,
                per_stage=True, seeds=2, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim+M2', method='pipeoptim', options=(), microbatches=2,
                per_stage=False, seeds=2, reached=0, updates=None, ratio=None, same_as='xpipe'),
        ),
    ),
    ('lm', 'muon', 8): StudiedSetting(
        task='lm',
        optimizer='muon',
        stages=8,
        model='gpt-narrow',
        batch_size=16,
        metric='perplexity',
        higher_is_better=False,
        target=42.5474,
        sync_updates=2000.0,
        sync_seeds=3,
        sync_reached=3,
        variants=(
            VariantRatio(variant='pipedream-2bw', method='pipedream-2bw', options=(), microbatches=8,
                per_stage=True, seeds=2, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='xpipe', method='xpipe', options=(), microbatches=2, per_stage=False,
                seeds=3, reached=3, updates=3000.0, ratio=1.5, same_as=None),
            VariantRatio(variant='pipeoptim', method='pipeoptim', options=(), microbatches=1, per_stage=False,
                seeds=2, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim-2bw', method='pipeoptim-2bw', options=(), microbatches=8,
                per_stage=True, seeds=2, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipedream-2bw+ef', method='pipedream-2bw',
                options=(('error_feedback', 'True'),), microbatches=8, per_stage=True, seeds=2, reached=0,
                updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim-2bw+ef', method='pipeoptim-2bw',
                options=(('error_feedback', 'True'),), microbatches=8, per_stage=True, seeds=2, reached=0,
                updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim+M2', method='pipeoptim', options=(), microbatches=2,
                per_stage=False, seeds=3, reached=3, updates=3000.0, ratio=1.5, same_as='xpipe'),
        ),
    ),
    ('lm', 'nadam', 8): StudiedSetting(
        task='lm',
        optimizer='nadam',
        stages=8,
        model='gpt-narrow',
        batch_size=16,
        metric='perplexity',
        higher_is_better=False,
        target=54.4611,
        sync_updates=2000.0,
        sync_seeds=2,
        sync_reached=2,
        variants=(
            VariantRatio(variant='pipedream-2bw', method='pipedream-2bw', options=(), microbatches=8,
                per_stage=True, seeds=1, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='xpipe', method='xpipe', options=(), microbatches=2, per_stage=False,
                seeds=1, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim', method='pipeoptim', options=(), microbatches=1, per_stage=False,
                seeds=1, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim-2bw', method='pipeoptim-2bw', options=(), microbatches=8,
                per_stage=True, seeds=1, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim+M2', method='pipeoptim', options=(), microbatches=2,
                per_stage=False, seeds=1, reached=0, updates=None, ratio=None, same_as='xpipe'),
        ),
    ),
    ('sentiment', 'adamw', 8): StudiedSetting(
        task='sentiment',
        optimizer='adamw',
        stages=8,
        model='lstm-deep',
        batch_size=64,
        metric='accuracy',
        higher_is_better=True,
        target=0.768965,
        sync_updates=346.667,
        sync_seeds=3,
        sync_reached=3,
        variants=(
            VariantRatio(variant='pipeoptim-2bw', method='pipeoptim-2bw', options=(), microbatches=8,
                per_stage=True, seeds=2, reached=1, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipedream-2bw', method='pipedream-2bw', options=(), microbatches=8,
                per_stage=True, seeds=2, reached=2, updates=520.0, ratio=1.5, same_as=None),
            VariantRatio(variant='spectrain', method='spectrain', options=(), microbatches=1, per_stage=False,
                seeds=2, reached=2, updates=320.0, ratio=0.923077, same_as=None),
            VariantRatio(variant='xpipe', method='xpipe', options=(), microbatches=2, per_stage=False,
                seeds=2, reached=2, updates=400.0, ratio=1.15385, same_as=None),
            VariantRatio(variant='pipeoptim+lr_correction', method='pipeoptim',
                options=(('lr_correction', 'delay'),), microbatches=1, per_stage=False, seeds=2, reached=2,
                updates=520.0, ratio=1.5, same_as=None),
            VariantRatio(variant='pipeoptim+MN', method='pipeoptim', options=(), microbatches=8,
                per_stage=True, seeds=2, reached=1, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim+M2', method='pipeoptim', options=(), microbatches=2,
                per_stage=False, seeds=2, reached=2, updates=400.0, ratio=1.15385, same_as='xpipe'),
        ),
    ),
    ('translation', 'adamw', 8): StudiedSetting(
        task='translation',
        optimizer='adamw',
        stages=8,
        model='transformer-deep',
        batch_size=64,
        metric='bleu',
        higher_is_better=True,
        target=14.9043,
        sync_updates=1173.0,
        sync_seeds=3,
        sync_reached=2,
        variants=(
            VariantRatio(variant='xpipe', method='xpipe', options=(), microbatches=2, per_stage=False,
                seeds=1, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim', method='pipeoptim', options=(), microbatches=1, per_stage=False,
                seeds=1, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim-2bw', method='pipeoptim-2bw', options=(), microbatches=8,
                per_stage=True, seeds=2, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipedream-2bw', method='pipedream-2bw', options=(), microbatches=8,
                per_stage=True, seeds=2, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='spectrain', method='spectrain', options=(), microbatches=1, per_stage=False,
                seeds=1, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim-2bw+ef', method='pipeoptim-2bw',
                options=(('error_feedback', 'True'),), microbatches=8, per_stage=True, seeds=3, reached=0,
                updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim+M2', method='pipeoptim', options=(), microbatches=2,
                per_stage=False, seeds=1, reached=0, updates=None, ratio=None, same_as='xpipe'),
        ),
    ),
    ('translation', 'muon', 8): StudiedSetting(
        task='translation',
        optimizer='muon',
        stages=8,
        model='transformer-deep',
        batch_size=64,
        metric='bleu',
        higher_is_better=True,
        target=14.8883,
        sync_updates=1173.0,
        sync_seeds=3,
        sync_reached=2,
        variants=(
            VariantRatio(variant='xpipe', method='xpipe', options=(), microbatches=2, per_stage=False,
                seeds=2, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim', method='pipeoptim', options=(), microbatches=1, per_stage=False,
                seeds=1, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim-2bw', method='pipeoptim-2bw', options=(), microbatches=8,
                per_stage=True, seeds=3, reached=1, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipedream-2bw', method='pipedream-2bw', options=(), microbatches=8,
                per_stage=True, seeds=2, reached=0, updates=None, ratio=None, same_as=None),
            VariantRatio(variant='pipeoptim+M2', method='pipeoptim', options=(), microbatches=2,
                per_stage=False, seeds=2, reached=0, updates=None, ratio=None, same_as='xpipe'),
        ),
    ),
}
