"""Issue 61: the tests the equal-time study's verdicts rest on.

* :func:`welch`: Welch's t-test of an asynchronous arm against the synchronous one, one-sided (the
  question "does the asynchronous pipeline give the better model?" has one side), with the effect
  (the difference of the means, in the direction "better") and its two-sided 95 % interval
  (Welch-Satterthwaite degrees of freedom);
* :func:`holm`: Holm's step-down correction of the four tasks' p-values (the family-wise chance
  of any false win at most ``alpha``);
* :func:`false_win_rates`: how often a rule calls a tie a win, simulated on two equal arms with the
  study's own spreads: the old rule (ahead by more than the larger of the two sample standard
  deviations), the old rule on the best of K asynchronous arms picked on test (as the old
  recommendation picked), and the new one (Welch, one-sided, at the Holm level).

scipy's ``ttest_ind`` and ``t`` do the arithmetic; the tests are in study/tests/test_confirm.py.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Dict, Sequence

import numpy as np
from scipy import stats as scipy_stats

ALPHA = 0.05


@dataclass(frozen=True)
class Comparison:
    """An asynchronous arm's runs against the synchronous arm's, on one metric."""

    effect: float          #: mean(async) - mean(sync) signed so that positive is better
    low: float             #: the 95 % interval of ``effect`` (two-sided)
    high: float
    t: float
    df: float
    p: float               #: one-sided: the chance of an effect this large if the arms were equal
    n_async: int
    n_sync: int


def welch(asynchronous: Sequence[float], synchronous: Sequence[float], higher: bool,
          level: float = 0.95) -> Comparison:
    """Welch's one-sided test that ``asynchronous`` is better than ``synchronous`` (higher, or
    lower where ``higher`` is False). Needs 2 values a side."""
    a, s = np.asarray(asynchronous, float), np.asarray(synchronous, float)
    if len(a) < 2 or len(s) < 2:
        raise ValueError(f"Welch's test needs 2 runs a side, not {len(a)} and {len(s)}")
    sign = 1.0 if higher else -1.0
    a, s = sign * a, sign * s
    with warnings.catch_warnings():  # (scipy warns of nearly equal values; the p it gives is still right)
        warnings.simplefilter("ignore", RuntimeWarning)
        result = scipy_stats.ttest_ind(a, s, equal_var=False, alternative="greater")
    va, vs = a.var(ddof=1) / len(a), s.var(ddof=1) / len(s)
    se = math.sqrt(va + vs)
    df = (va + vs) ** 2 / (va ** 2 / (len(a) - 1) + vs ** 2 / (len(s) - 1)) if se > 0 else math.inf
    effect = float(a.mean() - s.mean())
    half = float(scipy_stats.t.ppf(0.5 + level / 2, df)) * se if se > 0 else 0.0
    p = float(result.pvalue) if se > 0 else (0.0 if effect > 0 else 1.0)
    return Comparison(effect, effect - half, effect + half, float(result.statistic) if se > 0 else math.copysign(math.inf, effect or -1.0),
                      float(df), p, len(a), len(s))


def holm(p_values: Dict[str, float]) -> Dict[str, float]:
    """Holm's adjusted p-values (a key's is below ``alpha`` exactly where Holm's procedure at
    ``alpha`` rejects its hypothesis)."""
    order = sorted(p_values, key=lambda k: p_values[k])
    m, running, out = len(order), 0.0, {}
    for i, key in enumerate(order):
        running = max(running, min(1.0, (m - i) * p_values[key]))
        out[key] = running
    return out


def old_rule_wins(a: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The old rule, per simulated row: ahead (higher is better) by more than the larger sample sd."""
    return (a.mean(1) - s.mean(1)) > np.maximum(a.std(1, ddof=1), s.std(1, ddof=1))


def false_win_rates(sd_async: float, sd_sync: float, seeds: int = 3, arms: int = 1, tasks: int = 4,
                    draws: int = 20000, seed: int = 0, old_seeds: tuple = (2, 3)) -> Dict[str, float]:
    """How often each rule calls a win between equal arms (normal noise with these sds, ``seeds``
    runs a side): ``old`` (one asynchronous arm against the synchronous one), ``old_best_of`` (the
    best of ``arms`` equal asynchronous arms picked on the same runs, the old recommendation's
    way, at the old study's seeds: ``old_seeds`` = (per asynchronous arm, synchronous)), ``new`` (Welch one-sided at alpha, one task alone) and ``new_holm`` (the chance that this
    task is called a win when it is one of ``tasks`` equal tasks tested with Holm: at most
    alpha / tasks at Holm's first step, here with the other tasks also equal)."""
    rng = np.random.default_rng(seed)
    s = rng.normal(0.0, sd_sync, (draws, seeds))
    a = rng.normal(0.0, sd_async, (draws, arms, seeds))
    first = a[:, 0, :]
    many = rng.normal(0.0, sd_async, (draws, arms, old_seeds[0]))
    pick = many[np.arange(draws), many.mean(2).argmax(1), :]
    old_sync = rng.normal(0.0, sd_sync, (draws, old_seeds[1]))
    p_one = scipy_stats.ttest_ind(first, s, axis=1, equal_var=False, alternative="greater").pvalue
    # Holm over `tasks` equal tasks: this task's p with the others' drawn alike
    others = rng.uniform(size=(draws, tasks - 1))
    allp = np.concatenate([p_one[:, None], others], axis=1)
    order = np.sort(allp, axis=1)
    thresholds = ALPHA / (tasks - np.arange(tasks))
    passed = np.cumprod(order <= thresholds, axis=1).sum(1)  # how many Holm rejects
    rank = (allp < p_one[:, None]).sum(1)                    # this task's place among them
    return {"old": float(old_rule_wins(first, s).mean()), "old_best_of": float(old_rule_wins(pick, old_sync).mean()),
            "new": float((p_one < ALPHA).mean()), "new_holm": float((rank < passed).mean())}


def family_false_win(tasks: int = 4, draws: int = 20000, seed: int = 0) -> float:
    """The chance that Holm calls any of ``tasks`` equal tasks a win (exact p-values are uniform)."""
    rng = np.random.default_rng(seed)
    p = np.sort(rng.uniform(size=(draws, tasks)), axis=1)
    return float((p[:, 0] <= ALPHA / tasks).mean())


def is_open(p: float, tasks: int = 4) -> bool:
    """The rule fixed before any confirmation run, on the validation metric of the first three
    seeds a side: the question stays open (two more seeds a side) where the one-sided p lies in
    [alpha / tasks, 1/2): not yet a win even at Holm's strictest step, and the asynchronous arm
    not behind on the mean."""
    return ALPHA / tasks <= p < 0.5
