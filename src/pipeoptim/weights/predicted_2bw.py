"""PipeOptim on PipeDream-2BW's schedule: each update window shares one *predicted* version
(docs/architecture.md, "Weight versions per method", row pipeoptim-2bw).

2BW runs every micro-batch of window t, forward and backward, on one version; the window's
gradient joins update t, applied to W^(t). This policy runs the window on W_hat from the version
v the stage holds at the window's first forward, s being the updates this stage applies between
that forward and update t (Delta and lr read at that forward): in the steady state the table's v
and s, where 2BW would use W^(t-1) at the last stage too. Window 0, and every window before the
stage's first update, runs unpredicted on W^(v), kept (as a stash keeps it) through any update
that comes while the window is in flight. With one stage s is always 0: sequential training.

``predict_feedback=True`` (with ``error_feedback=True``): the prediction extrapolates the update
the weights will receive, the optimizer's step and error feedback's term
(:meth:`PipeOptim2BWPolicy.feedback_prediction` derives it)."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import torch

from ..schedules.actions import Kind
from .base import WeightUse, alias, nbytes
from .predict import predict_plan
from .predicting import PredictingPolicy
from .stash import VersionStore, window_of


@dataclass
class _Window:
    """One update window in flight at this stage."""

    version: int                                #: the version it runs on (or predicts from)
    steps: float                                #: the prediction steps
    tensors: Optional[List[torch.Tensor]]       #: the predicted tensors; None: the version itself
    left: int                                   #: its backwards not run yet
    #: while diagnosing with error feedback on: the window's weights under the other choice of
    #: ``predict_feedback`` (the diagnostic's variant; not counted as a copy, as the probes' are not)
    other: Optional[List[torch.Tensor]] = None


class PipeOptim2BWPolicy(VersionStore, PredictingPolicy):
    """pipeoptim-2bw: 2BW's windows, each on ``W - lr*s*Delta`` over the updates its gradient
    misses (see the module docstring)."""

    description = "2BW windows, forward and backward on W - lr*s*Delta(optimizer), s = updates the window misses"

    #: the diagnostic's name for the prediction the run does not use (:meth:`prediction_variants`)
    VARIANT = {True: "without predict_feedback", False: "with predict_feedback"}

    def __init__(self, *args, predict_feedback: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        #: predict_feedback=True (checked to come with error_feedback: pipeoptim.checks): windows run on :meth:`feedback_prediction`
        self.predict_feedback = predict_feedback
        self._windows: Dict[int, _Window] = {}
        self._window_steps: Dict[int, int] = {}
        self._diagnosing = False         # a probe asked for the variant: windows keep it from then on
        self._other: Dict[int, Optional[List[torch.Tensor]]] = {}  # probed before their window opened

    def learn_orders(self, stage_actions, full_orders, synchronous_updates: int = 0) -> None:
        super().learn_orders(stage_actions, full_orders, synchronous_updates)
        m = self.window = window_of(stage_actions)
        # per window: the updates between its first forward and its last backward, after which
        # the update its gradient joins comes
        self._window_steps = {
            a.index // m: self._updates_before[(Kind.B, a.index + m - 1)] - self._updates_before[(Kind.F, a.index)]
            for a in stage_actions if a.kind is Kind.F and a.index % m == 0
            and (Kind.B, a.index + m - 1) in self._updates_before}

    def ever_predicts(self) -> bool:
        return self.stage < self.num_stages - 1

    def base_forward_steps(self, microbatch: int) -> float:
        return self._window_steps[microbatch // self.window]

    def begin_epoch(self, *args, **kwargs) -> None:
        if self._windows:
            raise RuntimeError(f"stage {self.stage}: a schedule starts with windows in flight")
        super().begin_epoch(*args, **kwargs)

    @torch.no_grad()
    def feedback_prediction(self, steps: float) -> List[torch.Tensor]:
        """New tensors (in ``named`` order): the weights ``steps`` updates ahead when error
        feedback corrects each of them, ``W - (lr*s + beta*lr) * Delta + beta * u_prev``.

        Update t applies ``u_t + beta (u_t - u_(t-1))`` (``u`` the optimizer's step, beta the
        feedback's scale). At a window's first forward the stage holds version v and the feedback
        holds ``u_prev = u_(v-1)``, the step of the last update applied (kept whether that update
        was corrected or not); over the next s updates v .. v+s-1 the sum applied telescopes:
        ``sum u_(v+i) + beta (u_(v+s-1) - u_(v-1))``. With every future step taken equal to the
        optimizer's predicted step ``p = lr*Delta`` (the plain prediction's own assumption) this is
        ``s*p + beta (p - u_prev)``. It assumes too that every one of the s updates is corrected:
        so in 2BW's steady state, where each update's gradient is one update stale at every stage
        that predicts (a window predicts only once its stage has updated, so ``u_prev`` exists).
        The lr mass is the plain prediction's (``horizon_lr``) plus beta times one step's; where
        the feedback holds no previous update (nothing to correct yet) it is the plain prediction.

        What it adds to the plain prediction, ``beta (u_prev - lr*Delta)``, is small: Delta is the
        direction of the step just applied, so ``lr*Delta`` is ``u_prev`` but for the lr's change
        since that step (a schedule's) and, for decoupled decay, the weights it is read from
        (moved by the feedback after the step); with momentum SGD it is nothing (to rounding).
        The feedback's own term over the s updates, ``beta (u_(v+s-1) - u_(v-1))``, is the
        change of the steps to come, which an extrapolation of the last step takes as 0."""
        feedback = self.feedback
        if feedback is None or any(n not in feedback.previous for n, _ in self.named):
            return self.predicted(steps)
        beta, steps = feedback.scale, self.ramp(steps)
        out = predict_plan(self.source.directions(), lambda index, group: self.horizon_lr(index, group, steps)
                           + beta * self.horizon_lr(index, group, 1))
        moved = [n for n, p in self.named if p in out]
        if moved:  # one multi-tensor add: + beta * u_prev
            by_name = dict(self.named)
            torch._foreach_add_([out[by_name[n]] for n in moved], [feedback.previous[n] for n in moved],
                                alpha=beta)
        return [out[p] if p in out else p.detach().clone() for _, p in self.named]

    def _window_tensors(self, microbatch: int, aware: bool) -> Optional[List[torch.Tensor]]:
        """The tensors a window opened now at ``microbatch`` runs on (None: its version itself)."""
        steps = self.forward_steps(microbatch) if self.source.has_direction else 0
        if not steps:
            return None
        base = self.base_forward_steps(microbatch)
        return self.feedback_prediction(base) if aware else self.predicted(base)

    def _open(self, microbatch: int) -> _Window:
        """The window of ``microbatch``, made at its first forward."""
        window = microbatch // self.window
        entry = self._windows.get(window)
        if entry is None:
            steps = self.forward_steps(microbatch) if self.source.has_direction else 0
            tensors = self._window_tensors(microbatch, self.predict_feedback)
            entry = self._windows[window] = _Window(self.version, steps, tensors, self.window)
            if self._diagnosing:
                entry.other = self._other.pop(window) if window in self._other else \
                    self._window_tensors(microbatch, not self.predict_feedback)
        return entry

    def prediction_variants(self, microbatch: int) -> Dict[str, List[torch.Tensor]]:
        """For the diagnostic, with error feedback on: the weights ``microbatch``'s forward would
        run on under the other choice of ``predict_feedback``, made when its window opens (so
        from the same version, Delta and previous update as the window's own)."""
        if self.feedback is None:
            return super().prediction_variants(microbatch)
        self._diagnosing = True
        window = microbatch // self.window
        entry = self._windows.get(window)
        if entry is None:  # it opens at this forward: made now, handed to the window
            other = self._other[window] = self._window_tensors(microbatch, not self.predict_feedback)
        elif entry.other is not None or entry.tensors is None:
            other = entry.other
        else:  # opened before the first probe: made from the state now
            other = entry.other = self._window_tensors(microbatch, not self.predict_feedback)
        if other is None:  # an unpredicted window: both choices run on its version
            other = list(self.weights_of(entry.version).values()) if entry is not None else [p for _, p in self.named]
        # copies: the probe takes its differences in them
        return {self.VARIANT[self.predict_feedback]: [t.detach().clone() for t in other]}

    def forward_weights(self, microbatch: int) -> WeightUse:
        entry = self._open(microbatch)
        self._forward_version[microbatch] = entry.version
        if entry.tensors is not None:
            weights = {n: alias(t) for (n, _), t in zip(self.named, entry.tensors)}
        else:
            self.users[entry.version] += 1  # kept through an update while this window needs it
            weights = self.weights_of(entry.version)
        return WeightUse(weights, entry.version, entry.steps)

    @contextmanager
    def backward_pass(self, microbatch: int, use: WeightUse) -> Iterator[WeightUse]:
        # the aliases saved at the forward hold the window's values
        yield WeightUse(use.weights, use.version, use.steps)
        window = microbatch // self.window
        entry = self._windows[window]
        self._forward_version.pop(microbatch)
        if entry.tensors is None:
            self.users[entry.version] -= 1
        entry.left -= 1
        if entry.left == 0:
            del self._windows[window]
        self._drop_unneeded()

    def before_update(self) -> None:
        VersionStore.before_update(self)       # keep the live version if a window runs on it
        PredictingPolicy.before_update(self)   # delta="ema": W before the update

    def copy_bytes(self) -> int:
        held = sum(nbytes(w.tensors) for w in self._windows.values() if w.tensors is not None)
        return VersionStore.copy_bytes(self) + PredictingPolicy.copy_bytes(self) + held
