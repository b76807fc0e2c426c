"""Which method to use, per task and pipeline depth: the equal-time study's recommendation,
confirmed on fresh seeds (docs/results.md, "The answer, confirmed on fresh seeds").

The study gives every method the wall-clock time the synchronous pipeline takes for
``sequential``'s updates, on N devices as the schedule simulator predicts it, and asks which gives
the better model in that time. Per task, the synchronous arm and the asynchronous arm (method,
optimizer, lr) are chosen on the validation split, then run again on fresh seeds no choice read (3,
or 5 where the first three left the question open); Welch's one-sided t-test of "the asynchronous
arm gives the better test metric", corrected for the four tasks (Holm), decides. An asynchronous
method is recommended only where that test says better; otherwise the synchronous pipeline is (the
same model as non-pipelined training, for the same time).

:data:`ADVICE` holds a (task, N) only once its confirmation runs are all in. It is read
from the data file beside this module, ``equal_time_study.json`` (:data:`TABLE`), which
``python -m study.make_results3 --package`` writes from the committed rows; a test holds the file
to them. ``pipeoptim compare`` (and so ``make demo``) ends with the entry for its
task and stage count, the README lists every entry, and ``pipeoptim plan``
(:mod:`pipeoptim.lab.plan_targets`) recommends an asynchronous method only where the entry for
its task and depth does: the four read this one table, so that they cannot disagree.

This module imports nothing heavy (no torch).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Tuple

from ...methods import variant_name

#: the study's conclusions as the package ships them: this module's advice and the ratios of
#: :mod:`.updates_to_target` (pyproject's package-data installs it beside this module)
TABLE = Path(__file__).with_name("equal_time_study.json")
#: where the advice comes from (printed beside it)
SOURCE = "the equal-time study (docs/results.md)"
#: the studied metrics where a lower value is the better model (every other one: higher is better)
LOWER_IS_BETTER = ("perplexity",)
#: how a metric is written in a sentence, where not as its name
METRIC_NAMES = {"bleu": "BLEU"}


def metric_name(metric: str) -> str:
    """``metric`` as a sentence writes it (BLEU; accuracy and perplexity as they are)."""
    return METRIC_NAMES.get(metric, metric)


@dataclass(frozen=True)
class Advice:
    """The study's recommendation for one task at one pipeline depth, with its confirmation."""

    task: str
    stages: int
    #: a method name; for the synchronous pipeline, its fastest schedule in the study (every
    #: synchronous schedule computes sequential's updates: only their speed differs)
    method: str
    synchronous: bool
    microbatches: int           #: micro-batches per mini-batch the recommended run used
    options: Tuple[Tuple[str, str], ...]  #: method options beyond the defaults, as (option, value)
    optimizer: str
    lr: float                   #: the peak lr it ran at (chosen on validation for its length)
    metric: str
    value: float                #: mean final test metric at equal time over the fresh seeds (accuracy as a fraction)
    spread: float               #: its standard deviation over the fresh seeds
    seeds: int                  #: fresh seeds (none of them read by any choice)
    #: the other arm, "<method or the synchronous pipeline> with <optimizer>": for a synchronous
    #: recommendation the asynchronous arm chosen on validation, for an asynchronous one the
    #: synchronous arm (the choice the advice is about)
    runner_up: str
    runner_up_value: float
    runner_up_spread: float     #: the other arm's standard deviation over its fresh seeds
    runner_up_seeds: int
    margin: float               #: value - runner_up_value (in the metric's own unit)
    low: float                  #: the 95 % interval of ``margin`` (Welch)
    high: float
    #: Welch's one-sided p of "the asynchronous arm gives the better test metric", corrected for
    #: the study's tasks (Holm)
    p_value: float
    #: the asynchronous arm against the synchronous one: "better" (corrected p below 0.05),
    #: "worse" (the whole interval on the worse side) or "no detectable difference"
    verdict: str

    def variant(self) -> str:
        """The recommendation's name as the study and ``pipeoptim plan`` write it: the method, with
        ``+ef`` where it runs with error feedback (``pipeoptim-2bw+ef``), ``+ef+aware`` where its
        prediction knows the feedback too."""
        return variant_name(self.method, {o: v == "True" for o, v in self.options})

    def command(self) -> str:
        """The flags that train the recommended setting with ``pipeoptim train``."""
        flags = [f"--task {self.task}", f"--method {self.method}", f"--stages {self.stages}",
                 f"--micro-batches {self.microbatches}", f"--optimizer {self.optimizer}", f"--lr {self.lr:g}"]
        # a switch (error_feedback=True) is a bare flag on the command line; one left off is not written
        flags += [f"--{option.replace('_', '-')}" + ("" if value == "True" else f" {value}")
                  for option, value in self.options if value != "False"]
        return "pipeoptim train " + " ".join(flags)

    def describe(self) -> str:
        """One paragraph: what to use, its test metric over the fresh seeds, the other arm's, the
        difference asynchronous - synchronous with its 95 % interval and the corrected p, and the
        command."""
        scale, digits = (100.0, 2) if self.metric == "accuracy" else (1.0, 1)
        lower = "" if self.metric not in LOWER_IS_BETTER else ", lower is better"
        what = (f"the synchronous pipeline ({self.method}, M = {self.microbatches})" if self.synchronous
                else f"{self.method}" + "".join(f", {o} {v}" for o, v in self.options)
                + f" (M = {self.microbatches})")
        name = metric_name(self.metric)

        def number(x: float) -> str:
            return f"{x * scale:.{digits}f}"

        mine = f"test {name} {number(self.value)} ± {number(self.spread)} over {self.seeds} fresh seeds"
        rival = f"{number(self.runner_up_value)} ± {number(self.runner_up_spread)} over {self.runner_up_seeds}"
        sign = 1.0 if not self.synchronous else -1.0  # the difference as asynchronous - synchronous
        low, high = sorted((sign * self.low, sign * self.high))
        test = (f"difference asynchronous - synchronous {sign * self.margin * scale:+.{digits}f}{lower}, 95 % "
                f"interval [{low * scale:+.{digits}f}, {high * scale:+.{digits}f}]; one-sided Welch p "
                f"{'< 0.001' if self.p_value < 0.001 else f'= {self.p_value:.3f}'}, corrected for the study's "
                f"tasks; {SOURCE}")
        if not self.synchronous:
            text = (f"in the same time, {what} with {self.optimizer} gives a better model than {self.runner_up}: "
                    f"{mine}, against {rival} ({test})")
        else:
            said = {"worse": "worse", "better": "better"}.get(self.verdict, "not better by the test")
            text = (f"in the same time, use {what} with {self.optimizer}: {mine}. The asynchronous arm chosen on "
                    f"validation, {self.runner_up}, gave {rival}: {said} ({test})")
        return f"{self.task}, N = {self.stages}: {text}. To train it: {self.command()}"


@lru_cache(maxsize=1)
def study_table() -> Dict[str, Any]:
    """:data:`TABLE`'s contents, read once (the advice and the ratios of updates to the target)."""
    table = json.loads(TABLE.read_text())
    if table.get("format") != "pipeoptim-equal-time-study":
        raise ValueError(f"{TABLE} is not the equal-time study's table (no \"format\": \"pipeoptim-equal-time-study\")")
    return table


def pairs(options: Iterable[Iterable[str]]) -> Tuple[Tuple[str, str], ...]:
    """Method options as the dataclasses hold them, from the file's 2-item lists."""
    return tuple((option, value) for option, value in options)


def advice_table(table: Dict[str, Any]) -> Dict[Tuple[str, int], Advice]:
    """(task, N) -> :class:`Advice`, from a table file's contents (``"advice"``, in its order)."""
    return {(e["task"], e["stages"]): Advice(**{**e, "options": pairs(e["options"])}) for e in table["advice"]}


#: (task, N) -> the study's recommendation; only settings whose planned runs are all in
ADVICE: Dict[Tuple[str, int], Advice] = advice_table(study_table())


def nearest_depth(studied: Iterable[int], stages: int) -> int:
    """The studied depth nearest ``stages`` (the deeper of two as near): what ``compare``'s advice
    and ``plan``'s ratios of updates to target (:mod:`.updates_to_target`) both fall back on."""
    depths = sorted(set(studied))
    if not depths:
        raise ValueError("no studied depth to choose from")
    return min(depths, key=lambda n: (abs(n - stages), -n))


def not_studied_here(stages: int) -> str:
    """How every command says that the study's numbers it shows are another depth's: ``compare``'s
    and ``plan``'s advice, ``plan``'s ratios of updates to the target."""
    return f"(no study at N = {stages}; the nearest studied depth)"


def advised_lr(task: str, stages: int, optimizer: str, method: str,
               options: Dict[str, Any]) -> Optional[Tuple[float, str]]:
    """(lr, where it comes from) where the study's advice for ``task`` at ``stages`` is this very
    setting (the method, the optimizer and every option the advice names, as ``options`` sets
    them): the lr the advice trains it with, so that a run of the advised setting is the advice's
    run; None otherwise."""
    found = ADVICE.get((task, stages))
    if found is None or (found.method, found.optimizer) != (method, optimizer):
        return None
    if any(str(options.get(name)) != value for name, value in found.options):
        return None
    return found.lr, (f"the equal-time study's advice for {found.variant()}, {task}, N = {stages}, "
                      f"{optimizer} (docs/results.md); --lr overrides")


def advice(task: str, stages: int) -> Tuple[Optional[Advice], str]:
    """(the recommendation for ``task`` at ``stages`` stages, or None; a sentence saying where it
    comes from or why there is none). Another depth gets the nearest studied one, said so."""
    if (task, stages) in ADVICE:
        return ADVICE[(task, stages)], ADVICE[(task, stages)].describe()
    studied = [n for t, n in ADVICE if t == task]
    if not studied:
        return None, (f"{SOURCE[0].upper() + SOURCE[1:]} has no finished recommendation for {task} yet (it "
                      "runs N = 8 on image, sentiment, lm and translation); until it has, the synchronous "
                      "pipeline is the safe choice: at equal updates every asynchronous method ended behind it "
                      "(the second study, same file)")
    entry = ADVICE[(task, nearest_depth(studied, stages))]
    return entry, f"{not_studied_here(stages)} " + entry.describe()
