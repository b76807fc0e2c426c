"""Time to target: how many updates a run needs to first reach a target metric, and how long that
takes on N devices.

Pure arithmetic on numbers a run already recorded (no torch): a *curve* is a sequence of
``(updates, metric)`` points in training order, such as a run's evaluations
(:func:`curve_from_evaluations` of ``TrainResult.metrics["evaluations"]`` or of a summary's
``evaluations``). The *target* is a share of a reference run's final metric (``sequential``'s, in
the study): 99 % of it when higher is better (accuracy, BLEU), 101 % when lower is better
(perplexity), :func:`target_from_reference`. The *time* to target is the updates times the
method's seconds per mini-batch on N devices (from the schedule simulator, or measured), as
PipeDream's time-to-accuracy: :func:`time_to_target`.

A run is only seen at its evaluations, so the updates to target are those of the first
evaluation at or past the target: an upper bound, coarse by at most ``eval_every`` mini-batches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

#: How far below (higher is better) or above (lower is better) the reference the target lies.
TARGET_TOLERANCE = 0.01

Curve = Sequence[Tuple[float, float]]  #: (updates, metric) points, in training order


def target_from_reference(reference: float, higher_is_better: bool,
                          tolerance: float = TARGET_TOLERANCE) -> float:
    """The target for a reference final metric: ``reference * (1 - tolerance)`` when higher is
    better (99 % by default), ``reference * (1 + tolerance)`` when lower is better (101 %).

    The reference must be a positive, finite metric (accuracy, BLEU, perplexity) and the
    tolerance in [0, 1); otherwise a ValueError says which."""
    if not (math.isfinite(reference) and reference > 0):
        raise ValueError(f"the reference metric must be positive and finite to take a share of it, "
                         f"got {reference}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1) (0.01: 99 % / 101 % of the reference), got {tolerance}")
    return reference * (1 - tolerance) if higher_is_better else reference * (1 + tolerance)


def reaches(value: float, target: float, higher_is_better: bool) -> bool:
    """Whether ``value`` is at or past ``target`` in the metric's direction (NaN never is)."""
    if math.isnan(value):
        return False
    return value >= target if higher_is_better else value <= target


def updates_to_target(curve: Curve, target: float, higher_is_better: bool) -> Optional[float]:
    """The update count of the first point of ``curve`` that reaches ``target``; None if none
    does. The points must be in training order (updates never decreasing): a ValueError
    otherwise, since "first" would mean nothing."""
    previous = -math.inf
    for updates, _ in curve:
        if updates < previous:
            raise ValueError(f"the curve's updates must not decrease (training order), but {updates} "
                             f"follows {previous}; sort the points by updates")
        previous = updates
    for updates, value in curve:
        if reaches(value, target, higher_is_better):
            return updates
    return None


def time_to_target(curve: Curve, target: float, higher_is_better: bool,
                   seconds_per_batch: float) -> Optional[float]:
    """Seconds to first reach ``target``: :func:`updates_to_target` times ``seconds_per_batch``
    (the method's time per mini-batch, one update each, on its N devices); None if never."""
    if not (math.isfinite(seconds_per_batch) and seconds_per_batch > 0):
        raise ValueError(f"seconds_per_batch must be a positive time, got {seconds_per_batch}")
    updates = updates_to_target(curve, target, higher_is_better)
    return None if updates is None else updates * seconds_per_batch


def curve_from_evaluations(evaluations: Iterable[Dict[str, Any]]) -> List[Tuple[float, float]]:
    """``(updates, metric)`` of each evaluation a run recorded (``fit(eval_every=...)``)."""
    return [(e["updates"], e["metric"]) for e in evaluations]


@dataclass(frozen=True)
class TargetResult:
    """One run against one target: the target, and the updates and seconds to first reach it
    (None: never reached within the run)."""

    target: float
    updates: Optional[float]
    seconds: Optional[float]


def against_reference(curve: Curve, reference: float, higher_is_better: bool, seconds_per_batch: float,
                      tolerance: float = TARGET_TOLERANCE) -> TargetResult:
    """A run's curve against the target that ``reference`` (a final metric) sets."""
    target = target_from_reference(reference, higher_is_better, tolerance)
    return TargetResult(target, updates_to_target(curve, target, higher_is_better),
                        time_to_target(curve, target, higher_is_better, seconds_per_batch))


__all__ = ["TARGET_TOLERANCE", "Curve", "TargetResult", "against_reference", "curve_from_evaluations",
           "reaches", "target_from_reference", "time_to_target", "updates_to_target"]
