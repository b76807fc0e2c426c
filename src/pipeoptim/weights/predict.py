"""Optimizer-aware weight prediction (PipeOptim; docs/architecture.md, "The prediction per
optimizer").

A :class:`Predictor` watches an optimizer through its step hooks and predicts the weights ``s``
optimizer steps ahead, ``W_hat = W - lr * s * Delta``, Delta being the direction the last step
applied per unit of the group lr. ``g`` below is the step's gradient, negated under ``maximize``,
with ``wd * W_before`` added for the optimizers that fold weight decay into it:

=============  ==========================================================================
SGD            plain: ``g``; momentum: ``m`` (the buffer after the step, the paper),
               or ``mu * m + (1 - dampening) * g`` with ``sgd_momentum="code"`` (the
               authors' released code); Nesterov: ``g + mu * m``.
Adam / AdamW   ``m_hat / (sqrt(v_hat) + eps)`` with ``v = max_exp_avg_sq`` under amsgrad.
Adamax         ``m / ((1 - beta1^t) * u)`` with ``u`` the exponentially weighted inf-norm.
NAdam          ``((1-mu_t)/(1-prod mu) * g + mu_{t+1}/(1-prod mu * mu_{t+1}) * m) / denom``.
RAdam          ``m_hat * r_t * sqrt(1-beta2^t) / (sqrt(v) + eps)`` if ``rho_t > 5``, else
               ``m_hat``.
RMSprop        ``g / (sqrt(v [- mean_g^2 if centered]) + eps)``; with momentum: the buffer.
Adagrad        ``g / (sqrt(sum) + eps) / (1 + (t - 1) * lr_decay)`` (lr decay folded in:
               Delta is relative to the group lr).
Adadelta       ``sqrt(acc_delta_before + eps) / sqrt(v + eps) * g``.
Muon           ``r * NS(u) + wd * W_before`` (:func:`.formulas.muon_direction`); decay
               always decoupled.
DelayNAdamW    :mod:`pipeoptim.delay_nadamw`'s ``d``, plus decoupled decay.
=============  ==========================================================================

A composite optimizer's ``parts`` (:class:`pipeoptim.muon_adamw.MuonWithAdamW`) each follow their
own formula. Decoupled decay (AdamW; NAdam / RAdam with ``decoupled_weight_decay=True``) is
recovered from ``W_after``, without storing ``W_before``. Any other optimizer: the last applied
update ``(W_before - W_after) / lr``, with a warning. Delta is built at the first prediction after
a step (so a scheduler's change to a setting it reads, OneCycleLR's betas, is seen) and reused
until it changes (:meth:`Predictor.directions`).

Memory: Delta read from the state (SGD, RMSprop momentum) costs nothing; every other formula, and
the fallback, keeps one tensor per parameter, reused across steps. Complex parameters are not
supported by the exact formulas."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import Tensor

from ..compat import tensor_version
from .formulas import DirectionFormulas, formula_of, kept_like, optimizer_direction_supported, parts_of
from .fused import applied_update, copy_all

__all__ = ["Predictor", "optimizer_direction_supported", "predict_plan"]

#: The group settings a Delta formula reads (besides the lr of the last step): a change to any
#: of them between two predictions rebuilds Delta.
_DELTA_SETTINGS = ("betas", "eps", "amsgrad", "weight_decay", "decoupled_weight_decay", "momentum",
                   "nesterov", "dampening", "centered", "lr_decay", "maximize", "momentum_decay")


def _setting(value: Any) -> Any:
    """A hashable, comparable form of one group setting; a tensor by identity and version (read
    without waiting for its device)."""
    if torch.is_tensor(value):
        return id(value), tensor_version(value)
    if isinstance(value, (tuple, list)):
        return tuple(_setting(v) for v in value)
    return value


@torch.no_grad()
def predict_plan(plan: list[tuple[dict[str, Any], list[Tensor], list[Tensor]]],
                 rate: Callable[[int, dict[str, Any]], float]) -> dict[Tensor, Tensor]:
    """``W - rate * Delta`` (new tensors) of each parameter of ``plan`` (in the form of
    :meth:`Predictor.directions`), ``rate(index, group)`` being group number ``index``'s lr mass:
    one multi-tensor add per group (DTensors: torch's own sharded one)."""
    out: dict[Tensor, Tensor] = {}
    for index, (group, params, deltas) in enumerate(plan):
        if params:
            out.update(zip(params, torch._foreach_add([p.detach() for p in params], deltas,
                                                      alpha=-rate(index, group))))
    return out


class Predictor(DirectionFormulas):
    """Predicts weights from an optimizer's own update rule (see the module docstring).

    Args:
        optimizer: the optimizer to watch; hooks are registered on it at construction.
        sgd_momentum: ``"paper"`` (Delta = momentum buffer) or ``"code"``
            (Delta = mu*m + (1-dampening)*g); only affects SGD with momentum, no Nesterov.

    Attributes:
        steps_taken: number of optimizer steps seen by the hooks.
        uses_fallback: True when no exact formula exists and the last applied update is used.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, sgd_momentum: str = "paper") -> None:
        if sgd_momentum not in ("paper", "code"):  # (a Predictor made by hand; a policy's: checked already)
            raise ValueError(f"sgd_momentum must be 'paper' or 'code', got {sgd_momentum!r}")
        self.optimizer = optimizer
        self.sgd_momentum = sgd_momentum
        self.steps_taken: int = 0
        self._kind = formula_of(optimizer)
        self._parts = parts_of(optimizer)  # a composed optimizer's: each group's formula is its part's
        self.uses_fallback: bool = not optimizer_direction_supported(optimizer)
        # Per-parameter tensors owned by the predictor: the captured gradient turned into Delta
        # by the post-hook (exact formulas), or W_before turned into Delta (fallback).
        self._stored: dict[Tensor, Tensor] = {}
        self._pending: list[tuple[dict[str, Any], Tensor]] = []
        self._step_lr: dict[int, float] = {}  # id(group) -> lr used by the last step
        self._group_of: dict[Tensor, dict[str, Any]] = {}
        # Delta of the current update (see directions()): per group (group, params, deltas), the
        # same list by parameter, the tensors computed for the adaptive formulas, and the key
        # that says whether they are still the current Delta.
        self._plan: list[tuple[dict[str, Any], list[Tensor], list[Tensor]]] = []
        self._delta_of: dict[Tensor, Tensor] = {}
        self._computed: dict[Tensor, Tensor] = {}
        self._plan_key: Any = None
        self._generation = 0  # bumped when a state is loaded (the optimizer's or ours)
        if self.uses_fallback:
            warnings.warn(f"Predictor: no exact update-direction formula for {type(optimizer).__name__}; "
                          "using the last applied update (W_before - W_after) / lr as Delta.",
                          RuntimeWarning, stacklevel=2)
        self._handles = [optimizer.register_step_pre_hook(self._pre_hook),
                         optimizer.register_step_post_hook(self._post_hook)]
        if hasattr(optimizer, "register_load_state_dict_post_hook"):  # torch >= 2.2
            self._handles += [optimizer.register_load_state_dict_pre_hook(self._loading),
                              optimizer.register_load_state_dict_post_hook(self._loaded)]
        self._loading_lrs: list[float | None] = []

    # ------------------------------------------------------------------ public API
    @property
    def has_direction(self) -> bool:
        """True once the optimizer has stepped at least once."""
        return self.steps_taken > 0

    def detach(self) -> None:
        """Remove the step hooks; later steps are no longer observed."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def state_dict(self) -> dict[str, Any]:
        """What the next prediction depends on besides the optimizer's own state: the step
        count, the per-parameter tensors the hooks keep (by position in the optimizer's
        parameter groups), and the lr of each group's last step."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return {"steps_taken": self.steps_taken,
                "stored": {i: self._stored[p].clone() for i, p in enumerate(params) if p in self._stored},
                "step_lr": [self._step_lr.get(id(g)) for g in self.optimizer.param_groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.steps_taken = int(state["steps_taken"])
        self._stored = {params[int(i)]: t.clone() for i, t in state["stored"].items()}
        self._loaded(self.optimizer, state["step_lr"])

    def _loading(self, optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
        self._loading_lrs = [self._step_lr.get(id(g)) for g in optimizer.param_groups]

    def _loaded(self, optimizer: torch.optim.Optimizer, lrs: list[float | None] | None = None) -> None:
        """A state was loaded (the optimizer's: new group dicts, the last step's lrs following
        them by position, and new tensors; or ours, with ``lrs``): Delta is rebuilt."""
        lrs = self._loading_lrs if lrs is None else lrs
        self._step_lr = {id(g): lr for g, lr in zip(optimizer.param_groups, lrs) if lr is not None}
        self._group_of = {}
        self._generation += 1

    def lr(self, param: Tensor) -> float:
        """Current lr of ``param``'s group (a tensor lr is converted to float)."""
        return float(self._group(param).get("lr", 1.0))

    def direction(self, param: Tensor) -> Tensor | None:
        """Delta of ``param`` (a new tensor), or None before its first update."""
        self._group(param)  # KeyError for a parameter this optimizer does not manage
        delta = self._directions_by_param().get(param)
        return None if delta is None else delta.clone()

    def directions(self) -> list[tuple[dict[str, Any], list[Tensor], list[Tensor]]]:
        """Delta of the current update, per parameter group: ``(group, params, deltas)`` for
        the parameters that have one (none before their first step). Built once per update
        (into tensors kept across updates) and the same lists returned until the optimizer
        steps, loads a state, a setting Delta reads changes or a parameter is modified in place.
        The tensors are Delta itself, some the optimizer's own state: never write them."""
        key = self._key()
        if key != self._plan_key:
            self._build_plan()
            self._plan_key = key
        return self._plan

    def predict(self, steps: float) -> dict[Tensor, Tensor]:
        """Map every parameter of the optimizer to ``W - lr * steps * Delta`` (new tensors).

        Parameters without a direction yet (before the first step) map to a clone of W.
        The live parameters are not modified.
        """
        moved = predict_plan(self.directions(), lambda index, group: float(group.get("lr", 1.0)) * steps)
        return {p: moved[p] if p in moved else p.detach().clone()
                for group in self.optimizer.param_groups for p in group["params"]}

    def predict_into(self, param: Tensor, steps: float, out: Tensor) -> bool:
        """Write ``W - lr * steps * Delta`` into ``out``; False (``out`` untouched) if no Delta.

        ``out`` must have ``param``'s shape; it may be ``param`` itself. Nothing is allocated.
        """
        self._group(param)
        delta = self._directions_by_param().get(param)
        if delta is None:
            return False
        with torch.no_grad():
            torch.add(param.detach(), delta, alpha=-self.lr(param) * steps, out=out)
        return True

    def _directions_by_param(self) -> dict[Tensor, Tensor]:
        self.directions()
        return self._delta_of

    def _key(self) -> Any:
        """What the current Delta depends on besides the optimizer's state (which only a step or
        a load changes): the step count, loads, each group's settings, the parameters' versions
        (for the formulas that read W: decoupled decay)."""
        groups = tuple(
            (id(g), tuple(_setting(g.get(name)) for name in _DELTA_SETTINGS),
             tuple(tensor_version(p) for p in g["params"]))
            for g in self.optimizer.param_groups)
        return self.steps_taken, self._generation, groups

    def _build_plan(self) -> None:
        plan: list[tuple[dict[str, Any], list[Tensor], list[Tensor]]] = []
        by_param: dict[Tensor, Tensor] = {}
        if self.steps_taken > 0:
            with torch.no_grad():
                for group in self.optimizer.param_groups:
                    every = group["params"]
                    self._group_of.update((p, group) for p in every)
                    found = self._deltas(group, every, [self._scratch(group, p) for p in every])
                    kept = [(p, delta) for p, delta in zip(every, found) if delta is not None]
                    plan.append((group, [p for p, _ in kept], [delta for _, delta in kept]))
                    by_param.update(kept)
        self._plan, self._delta_of = plan, by_param

    # ------------------------------------------------------------------ hooks
    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._pending = []
        with torch.no_grad():
            for group in optimizer.param_groups:
                self._step_lr[id(group)] = float(group.get("lr", 1.0))
                self._group_of.update((p, group) for p in group["params"])
                if not (self.uses_fallback or self._needs_grad(group)):
                    continue
                params = [p for p in group["params"] if self.uses_fallback or p.grad is not None]
                bufs = [kept_like(self._stored, p) for p in params]
                if self.uses_fallback:
                    copy_all(bufs, [p.detach() for p in params])
                else:
                    self._capture_grads(group, params, bufs)
                if params:
                    self._pending.append((group, params))

    def _post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.steps_taken += 1
        with torch.no_grad():
            for group, params in self._pending:
                bufs = [self._stored[p] for p in params]
                if self.uses_fallback:
                    applied_update(bufs, params, self._step_lr[id(group)])
                else:
                    self._finish_all(group, params, [optimizer.state[p] for p in params], bufs)
        self._pending = []
