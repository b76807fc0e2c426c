"""The per-optimizer formulas of Delta (docs/architecture.md, "The prediction per optimizer").

Delta is the direction each optimizer applied at its last step relative to the group lr (the
table of :mod:`pipeoptim.weights.predict`). This module holds which formula an optimizer follows
(by its ``step`` function, per group for a composite optimizer), what the step hooks capture
before a step, and how the capture and the optimizer's state become Delta after it.
:class:`DirectionFormulas` is the :class:`~pipeoptim.weights.predict.Predictor`'s half that
knows the optimizers; the Predictor keeps the hooks, the cache of Delta and the predictions.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import Tensor

from .muon_direction import muon_direction

__all__ = ["KNOWN", "DirectionFormulas", "formula_of", "parts_of", "optimizer_direction_supported"]

#: (formula, optimizer class): the optimizers with an exact formula (Muon where torch has it)
KNOWN: tuple[tuple[str, type[torch.optim.Optimizer]], ...] = (
    ("sgd", torch.optim.SGD),
    ("adam", torch.optim.Adam),
    ("adam", torch.optim.AdamW),
    ("adamax", torch.optim.Adamax),
    ("nadam", torch.optim.NAdam),
    ("radam", torch.optim.RAdam),
    ("rmsprop", torch.optim.RMSprop),
    ("adagrad", torch.optim.Adagrad),
    ("adadelta", torch.optim.Adadelta),
) + ((("muon", torch.optim.Muon),) if hasattr(torch.optim, "Muon") else ())


def formula_of(optimizer: torch.optim.Optimizer) -> str | None:
    """Name of the exact formula for ``optimizer``, or None.

    Decided on the ``step`` function itself, not on ``isinstance``: a subclass that overrides
    ``step`` gets None. Both sides are unwrapped because torch wraps ``step`` (per class,
    lazily) with its hook/profiling wrapper.
    """
    step = inspect.unwrap(type(optimizer).step)
    for name, cls in KNOWN:
        if step is inspect.unwrap(cls.step):
            return name
    return None


def parts_of(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer] | None:
    """The optimizers a composite optimizer is made of (its ``parts``), or None."""
    parts = getattr(optimizer, "parts", None)
    return list(parts) if isinstance(parts, (list, tuple)) and parts else None


def optimizer_direction_supported(optimizer: torch.optim.Optimizer) -> bool:
    """True when an exact Delta formula exists for ``optimizer`` (no fallback needed): for a
    composite optimizer, for each of its parts."""
    parts = parts_of(optimizer)
    if parts is not None:
        return all(formula_of(part) is not None for part in parts)
    return formula_of(optimizer) is not None


def _betas(group: dict[str, Any]) -> tuple[float, float]:
    b1, b2 = group["betas"]
    return float(b1), float(b2)



class DirectionFormulas:
    """Delta's formulas for the Predictor (attributes it sets: ``optimizer``, ``sgd_momentum``,
    ``steps_taken``, ``uses_fallback``, ``_kind``, ``_composite``, ``_stored``, ``_step_lr``,
    ``_group_of``, ``_computed``)."""

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


    def _kind_of(self, group: dict[str, Any]) -> str | None:
        """The formula of ``group``: the optimizer's, or that of the part holding the group."""
        if not self._composite:
            return self._kind
        for part in parts_of(self.optimizer) or ():
            if any(g is group for g in part.param_groups):
                return formula_of(part)
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
