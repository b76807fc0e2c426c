"""Optimizer-aware weight prediction (PipeOptim; docs/architecture.md, "The prediction per
optimizer").

A :class:`Predictor` watches an optimizer through its step hooks and, after every step, can
predict the weights ``s`` optimizer steps ahead::

    W_hat = W - lr * s * Delta

``lr`` is the *current* learning rate of the parameter's group (read at prediction time, so
LR schedulers are honoured) and ``Delta`` is the update direction, relative to the group lr,
that the optimizer applied at its last step. For the optimizers with an exact formula,
``Delta`` equals ``(W_before - W_after) / lr`` of the step just taken; in the formulas below,
``g`` is that step's gradient, negated when ``maximize`` is set and with the L2 term
``wd * W_before`` added for the optimizers that fold weight decay into the gradient:

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
Adagrad        ``g / (sqrt(sum) + eps) / (1 + (t - 1) * lr_decay)``: lr decay is folded in
               because Delta is relative to the group lr.
Adadelta       ``sqrt(acc_delta_before + eps) / sqrt(v + eps) * g``.
Muon           ``r * NS(u) + wd * W_before``: ``u`` the Nesterov update ``g.lerp(m, mu)`` (or
               the buffer ``m`` without Nesterov), ``NS`` torch's Newton-Schulz
               orthogonalisation, ``r`` torch's shape ratio (``adjust_lr_fn``); decay is
               always decoupled.
=============  ==========================================================================

An optimizer made of several (``parts``: torch optimizers whose ``param_groups`` are, dict for
dict, the composite's, as :class:`pipeoptim.muon_adamw.MuonWithAdamW`) gets each group's
formula from the part that holds the group.

Decoupled weight decay (AdamW, and NAdam / RAdam with ``decoupled_weight_decay=True``)
shrinks W *before* the adaptive update: ``W_after = (1 - lr*wd) W_before - lr * a``. The exact
Delta, ``a + wd * W_before``, is recovered without storing ``W_before`` as
``(a + wd * W_after) / (1 - lr_step * wd)``, with ``lr_step`` the lr of that step.

Any other optimizer (including subclasses of the above that override ``step``) uses the
fallback ``Delta = (W_before - W_after) / lr_step`` recorded by the hooks, with a warning.

Delta is computed at most once per update: :meth:`Predictor.directions` builds it at the first
prediction after a step (lazily, so that a scheduler's change to a setting it reads, e.g.
OneCycleLR's betas, is seen as before) and hands the same tensors to every later prediction until
the optimizer steps again, loads a state, or a setting Delta depends on changes. Predictions are
then one ``torch.add(W, Delta, alpha=-lr*s)`` per parameter, the arithmetic of the per-forward
formula before this cache, so the predicted values are the same bits.

Memory: formulas read from the optimizer state (SGD momentum, RMSprop momentum) need nothing
extra; those that need the step's gradient (SGD plain/Nesterov/``code``, NAdam, RMSprop without
momentum, Adagrad, Adadelta) keep one tensor per parameter, reused across steps, which becomes
Delta; the adaptive formulas computed from the state (Adam, AdamW, Adamax, RAdam) keep Delta in
one tensor per parameter, allocated at the first prediction and reused; the fallback keeps one
snapshot per parameter. Complex parameters are not supported by the exact formulas.
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any

import torch
from torch import Tensor

from .muon_direction import muon_direction

__all__ = ["Predictor", "optimizer_direction_supported"]

_KNOWN: tuple[tuple[str, type[torch.optim.Optimizer]], ...] = ((("muon", torch.optim.Muon),)
                                                                 if hasattr(torch.optim, "Muon") else ()) + (
    ("sgd", torch.optim.SGD),
    ("adam", torch.optim.Adam),
    ("adam", torch.optim.AdamW),
    ("adamax", torch.optim.Adamax),
    ("nadam", torch.optim.NAdam),
    ("radam", torch.optim.RAdam),
    ("rmsprop", torch.optim.RMSprop),
    ("adagrad", torch.optim.Adagrad),
    ("adadelta", torch.optim.Adadelta),
)


def _kind(optimizer: torch.optim.Optimizer) -> str | None:
    """Name of the exact formula for ``optimizer``, or None.

    Decided on the ``step`` function itself, not on ``isinstance``: a subclass that overrides
    ``step`` gets None. Both sides are unwrapped because torch wraps ``step`` (per class,
    lazily) with its hook/profiling wrapper.
    """
    step = inspect.unwrap(type(optimizer).step)
    for name, cls in _KNOWN:
        if step is inspect.unwrap(cls.step):
            return name
    return None


def _parts(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer] | None:
    """The optimizers a composite optimizer is made of (its ``parts``), or None."""
    parts = getattr(optimizer, "parts", None)
    return list(parts) if isinstance(parts, (list, tuple)) and parts else None


def optimizer_direction_supported(optimizer: torch.optim.Optimizer) -> bool:
    """True when an exact Delta formula exists for ``optimizer`` (no fallback needed): for a
    composite optimizer, for each of its parts."""
    parts = _parts(optimizer)
    if parts is not None:
        return all(_kind(part) is not None for part in parts)
    return _kind(optimizer) is not None


def _betas(group: dict[str, Any]) -> tuple[float, float]:
    b1, b2 = group["betas"]
    return float(b1), float(b2)


#: The group settings a Delta formula reads (besides the lr of the last step): a change to any
#: of them between two predictions rebuilds Delta.
_DELTA_SETTINGS = ("betas", "eps", "amsgrad", "weight_decay", "decoupled_weight_decay", "momentum",
                   "nesterov", "dampening", "centered", "lr_decay", "maximize", "momentum_decay")


def _setting(value: Any) -> Any:
    """A hashable, comparable form of one group setting; a tensor by identity and version (read
    without waiting for its device)."""
    if torch.is_tensor(value):
        return id(value), value._version
    if isinstance(value, (tuple, list)):
        return tuple(_setting(v) for v in value)
    return value


class Predictor:
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
        if sgd_momentum not in ("paper", "code"):
            raise ValueError(f"sgd_momentum must be 'paper' or 'code', got {sgd_momentum!r}")
        self.optimizer = optimizer
        self.sgd_momentum = sgd_momentum
        self.steps_taken: int = 0
        self._kind = _kind(optimizer)
        self._composite = _parts(optimizer) is not None
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
            warnings.warn(
                f"Predictor: no exact update-direction formula for {type(optimizer).__name__}; "
                "using the last applied update (W_before - W_after) / lr as Delta.",
                RuntimeWarning,
                stacklevel=2,
            )
        self._handles = [
            optimizer.register_step_pre_hook(self._pre_hook),
            optimizer.register_step_post_hook(self._post_hook),
        ]
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
        self._step_lr = {id(g): lr for g, lr in zip(self.optimizer.param_groups, state["step_lr"])
                         if lr is not None}
        self._group_of = {}
        self._generation += 1

    def _loading(self, optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
        self._loading_lrs = [self._step_lr.get(id(g)) for g in optimizer.param_groups]

    def _loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer loaded a state: its groups are new dicts (the last step's lrs follow
        them by position) and its tensors new, so Delta is rebuilt."""
        self._step_lr = {id(g): lr for g, lr in zip(optimizer.param_groups, self._loading_lrs)
                         if lr is not None}
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
        the parameters that have one (none before the first step; a parameter the optimizer has
        not updated yet has none).

        Built at most once per update: the first call after a step computes it (the adaptive
        formulas into tensors kept from one update to the next, so nothing is allocated after
        the first time), later calls return the same lists until the optimizer steps again,
        loads a state, a setting Delta depends on changes or a parameter is modified in place
        (its version counter moves). The tensors are Delta itself, some of them the optimizer's
        own state: read them, never write them.
        """
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
        by_param = self._directions_by_param()
        out: dict[Tensor, Tensor] = {}
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                alpha = -float(group.get("lr", 1.0)) * steps
                for p in group["params"]:
                    delta = by_param.get(p)
                    w = p.detach()
                    out[p] = w.clone() if delta is None else torch.add(w, delta, alpha=alpha)
        return out

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
             tuple(p._version for p in g["params"]))
            for g in self.optimizer.param_groups)
        return self.steps_taken, self._generation, groups

    def _build_plan(self) -> None:
        plan: list[tuple[dict[str, Any], list[Tensor], list[Tensor]]] = []
        by_param: dict[Tensor, Tensor] = {}
        if self.steps_taken > 0:
            with torch.no_grad():
                for group in self.optimizer.param_groups:
                    params, deltas = [], []
                    for p in group["params"]:
                        self._group_of[p] = group
                        delta = self._delta(p, self._scratch(group, p))
                        if delta is not None:
                            params.append(p)
                            deltas.append(delta)
                            by_param[p] = delta
                    plan.append((group, params, deltas))
        self._plan, self._delta_of = plan, by_param

    def _scratch(self, group: dict[str, Any], p: Tensor) -> Tensor | None:
        """The tensor an adaptive formula computes ``p``'s Delta into (kept across updates);
        None for the formulas that return a tensor they already have."""
        kind = self._kind_of(group)
        if (self.uses_fallback or self._needs_grad(group) or kind in ("sgd", "rmsprop")
                or not self.optimizer.state.get(p)):
            return None
        buf = self._computed.get(p)
        if buf is None or buf.shape != p.shape or buf.dtype != p.dtype or buf.device != p.device:
            buf = torch.empty_like(p)
            self._computed[p] = buf
        return buf

    # ------------------------------------------------------------------ hooks
    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._pending = []
        with torch.no_grad():
            for group in optimizer.param_groups:
                self._step_lr[id(group)] = float(group.get("lr", 1.0))
                capture = self.uses_fallback or self._needs_grad(group)
                for p in group["params"]:
                    self._group_of[p] = group
                    if not capture or (p.grad is None and not self.uses_fallback):
                        continue
                    buf = self._stored.get(p)
                    if buf is None or buf.shape != p.shape or buf.dtype != p.dtype:
                        buf = torch.empty_like(p)
                        self._stored[p] = buf
                    if self.uses_fallback:
                        buf.copy_(p.detach())
                    else:
                        self._capture_grad(group, p, buf)
                    self._pending.append((group, p))

    def _post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.steps_taken += 1
        with torch.no_grad():
            for group, p in self._pending:
                buf = self._stored[p]
                if self.uses_fallback:
                    buf.sub_(p.detach())
                    lr = self._step_lr[id(group)]
                    if lr != 0.0:
                        buf.div_(lr)
                else:
                    self._finish(group, p, optimizer.state[p], buf)
        self._pending = []

    # ------------------------------------------------------------------ formulas
    def _kind_of(self, group: dict[str, Any]) -> str | None:
        """The formula of ``group``: the optimizer's, or that of the part holding the group."""
        if not self._composite:
            return self._kind
        for part in _parts(self.optimizer) or ():
            if any(g is group for g in part.param_groups):
                return _kind(part)
        raise KeyError("a parameter group that no part of the optimizer holds")

    def _group(self, param: Tensor) -> dict[str, Any]:
        group = self._group_of.get(param)
        if group is None:
            for g in self.optimizer.param_groups:
                for p in g["params"]:
                    self._group_of[p] = g
            group = self._group_of.get(param)
            if group is None:
                raise KeyError("parameter is not managed by this optimizer")
        return group

    def _needs_grad(self, group: dict[str, Any]) -> bool:
        """Whether this group's Delta needs the step's gradient (kept between hooks)."""
        kind = self._kind_of(group)
        if kind == "sgd":
            return (
                group["momentum"] == 0 or group["nesterov"] or self.sgd_momentum == "code"
            )
        if kind == "rmsprop":
            return group["momentum"] == 0
        return kind in ("nadam", "adagrad", "adadelta", "muon")

    def _l2(self, group: dict[str, Any]) -> float:
        """Weight decay that the optimizer adds to the gradient (0 when decoupled)."""
        wd = float(group.get("weight_decay", 0.0))
        kind = self._kind_of(group)
        if kind == "muon" or (kind in ("nadam", "radam", "adam") and group.get("decoupled_weight_decay")):
            return 0.0
        return wd

    def _capture_grad(self, group: dict[str, Any], p: Tensor, buf: Tensor) -> None:
        """Pre-step: ``buf <- g`` as the optimizer will use it (sign, L2 decay)."""
        grad = p.grad
        if grad.is_sparse:
            grad = grad.to_dense()
        if group.get("maximize", False):
            torch.neg(grad, out=buf)
        else:
            buf.copy_(grad)
        wd = self._l2(group)
        if wd != 0.0:
            buf.add_(p.detach(), alpha=wd)
        if self._kind_of(group) == "adadelta":  # numerator uses acc_delta *before* the step
            eps = group["eps"]
            acc = self.optimizer.state.get(p, {}).get("acc_delta")
            if acc is None:
                buf.mul_(math.sqrt(eps))
            else:
                buf.mul_(acc.add(eps).sqrt_())

    def _finish(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], g: Tensor) -> None:
        """Post-step: turn the captured gradient ``g`` into Delta, in place."""
        kind = self._kind_of(group)
        if kind == "sgd":
            mu = group["momentum"]
            if mu == 0:
                return
            if group["nesterov"]:
                g.add_(state["momentum_buffer"], alpha=mu)
            else:  # "code" variant
                g.mul_(1 - group["dampening"]).add_(state["momentum_buffer"], alpha=mu)
        elif kind == "nadam":
            b1, b2 = _betas(group)
            step = float(state["step"])
            decay = group["momentum_decay"]
            mu = b1 * (1.0 - 0.5 * 0.96 ** (step * decay))
            mu_next = b1 * (1.0 - 0.5 * 0.96 ** ((step + 1) * decay))
            prod = float(state["mu_product"])
            denom = state["exp_avg_sq"].div(1 - b2**step).sqrt_().add_(group["eps"])
            g.mul_((1 - mu) / (1 - prod))
            g.add_(state["exp_avg"], alpha=mu_next / (1 - prod * mu_next)).div_(denom)
            self._decoupled(group, p, g)
        elif kind == "rmsprop":
            sq = state["square_avg"]
            if group["centered"]:
                avg = torch.addcmul(sq, state["grad_avg"], state["grad_avg"], value=-1).sqrt_()
            else:
                avg = sq.sqrt()
            g.div_(avg.add_(group["eps"]))
        elif kind == "adagrad":
            step = float(state["step"])
            g.div_(state["sum"].sqrt().add_(group["eps"]))
            g.div_(1 + (step - 1) * group["lr_decay"])
        elif kind == "adadelta":
            g.div_(state["square_avg"].add(group["eps"]).sqrt_())
        elif kind == "muon":
            muon_direction(group, p, state["momentum_buffer"], g)
            self._decoupled(group, p, g)

    def _decoupled(self, group: dict[str, Any], p: Tensor, delta: Tensor) -> None:
        """Add decoupled decay: ``delta <- (delta + wd * W_after) / (1 - lr_step * wd)``.

        Equals ``delta + wd * W_before`` since ``W_after = (1-lr*wd) W_before - lr*delta``.
        """
        wd = float(group.get("weight_decay", 0.0))
        if wd == 0.0 or not (group.get("decoupled_weight_decay", False) or self._kind_of(group) == "muon"):
            return
        delta.add_(p.detach(), alpha=wd).div_(1 - self._step_lr[id(group)] * wd)

    def _delta(self, p: Tensor, out: Tensor | None) -> Tensor | None:
        """Delta of ``p``: a stored/state tensor (do not modify), or ``out`` filled with it.

        ``out`` is scratch space of ``p``'s shape; one is allocated when None is given.
        """
        if self.steps_taken == 0:
            return None
        stored = self._stored.get(p)
        group = self._group(p)
        if self.uses_fallback or self._needs_grad(group):
            return stored
        state = self.optimizer.state.get(p)
        if not state:
            return None
        kind = self._kind_of(group)
        if kind == "sgd":  # momentum, paper variant: the buffer itself
            return state["momentum_buffer"]
        if kind == "rmsprop":  # with momentum: the buffer already holds g / avg
            return state["momentum_buffer"]
        if out is None:
            out = torch.empty_like(p)
        step = float(state["step"])
        b1, b2 = _betas(group)
        bc1 = 1 - b1**step
        if kind == "adam":
            v = state["max_exp_avg_sq"] if group["amsgrad"] else state["exp_avg_sq"]
            torch.sqrt(v, out=out).div_(math.sqrt(1 - b2**step)).add_(group["eps"])
            torch.div(state["exp_avg"], out, out=out).div_(bc1)
        elif kind == "adamax":
            torch.div(state["exp_avg"], state["exp_inf"], out=out).div_(bc1)
        elif kind == "radam":
            bc2 = 1 - b2**step
            rho_inf = 2 / (1 - b2) - 1
            rho_t = rho_inf - 2 * step * b2**step / bc2
            if rho_t > 5.0:
                rect = math.sqrt(
                    (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
                )
                torch.sqrt(state["exp_avg_sq"], out=out).add_(group["eps"])
                torch.div(state["exp_avg"], out, out=out).mul_(rect * math.sqrt(bc2) / bc1)
            else:
                torch.div(state["exp_avg"], bc1, out=out)
        else:  # pragma: no cover - every known kind is handled above
            raise AssertionError(kind)
        self._decoupled(group, p, out)
        return out
