"""The per-optimizer formulas of Delta (docs/architecture.md, "The prediction per optimizer").

Delta is the direction each optimizer applied at its last step relative to the group lr (the
table of :mod:`pipeoptim.weights.predict`). :class:`DirectionFormulas` is the Predictor's half
that knows the optimizers: which formula one follows (by its ``step`` function, per group for a
composite optimizer), what the step hooks capture before a step, how that and the optimizer's
state become Delta after it.

Each formula runs over a parameter group as multi-tensor operations (:mod:`.fused`): the same
operations per element as one parameter at a time, so the same bits. Parameters whose step
counts differ are taken by step count (their scalars differ). Per parameter stay the division
``m / d`` written into ``d`` (Adam, RAdam: torch has no multi-tensor op writing ``a / b`` into
``b``, and a second tensor would cost a weight-sized buffer) and Muon's orthogonalisation.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, List, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from ..compat import muon_lr_ratio, muon_orthogonalize
from ..delay_nadamw import DelayNAdamW, adam_denominators, lookahead_direction, runs_by
from .fused import Into, batches, copy_all, local_all

__all__ = ["KNOWN", "ComposedOptimizer", "DirectionFormulas", "formula_of", "parts_of", "optimizer_direction_supported",
           "muon_direction"]

#: (formula, optimizer class): the optimizers with an exact formula (Muon where torch has it;
#: DelayNAdamW is pipeoptim's own, :mod:`pipeoptim.delay_nadamw`)
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
    ("delay-nadamw", DelayNAdamW),
) + ((("muon", torch.optim.Muon),) if hasattr(torch.optim, "Muon") else ())


def formula_of(optimizer: torch.optim.Optimizer) -> str | None:
    """Name of the exact formula for ``optimizer``, or None: by its ``step`` function, not by
    ``isinstance`` (a subclass that overrides ``step`` gets None), both sides unwrapped from
    torch's hook/profiling wrapper."""
    step = inspect.unwrap(type(optimizer).step)
    for name, cls in KNOWN:
        if step is inspect.unwrap(cls.step):
            return name
    return None


@runtime_checkable
class ComposedOptimizer(Protocol):
    """An optimizer made of others, whose groups are its own (``muon_adamw.MuonWithAdamW``: Muon
    on a stage's matrices, AdamW on the rest); each group follows its part's formula."""

    parts: List[torch.optim.Optimizer]


def parts_of(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer] | None:
    """The optimizers a composed optimizer is made of (:class:`ComposedOptimizer`), or None."""
    return list(optimizer.parts) if isinstance(optimizer, ComposedOptimizer) and optimizer.parts else None


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


def _states(states: Sequence[dict[str, Any]], name: str) -> list[Tensor]:
    """The local shards of one state tensor of each parameter."""
    return local_all([state[name] for state in states])


def _on_host(tensor: Tensor) -> bool:
    return tensor.device.type == "cpu"


def _host(states: Sequence[dict[str, Any]], indices: Sequence[int], key: str = "step",
          on_host: Any = _on_host) -> dict[int, float]:
    """Each state's scalar ``key`` (index -> float), those on a device read in one copy: a
    capturable or fused optimizer keeps ``step`` on the device, where a ``float()`` per parameter
    would wait for the device once per parameter (float64 holds every float32 count exactly). One
    on the CPU is read where it is (no copy, nothing allocated)."""
    values = {i: states[i][key] for i in indices}
    tensors = [i for i, v in values.items() if isinstance(v, Tensor) and not on_host(v)]
    elsewhere = set(tensors)
    out = {i: (v.tolist() if isinstance(v, Tensor) else float(v)) for i, v in values.items() if i not in elsewhere}
    if tensors:
        read = torch.stack([values[i].detach().reshape(()).to(torch.float64) for i in tensors]).tolist()
        out.update(zip(tensors, read))
    return out


def muon_direction(group: dict[str, Any], param: Tensor, buf: Tensor, g: Tensor) -> None:
    """In place: ``g`` (the step's gradient) becomes ``r * NS(u)`` for ``param`` of ``group``,
    ``buf`` being the momentum buffer after the step. torch's Muon step on a 2-D W::

        m <- m.lerp(g, 1 - mu);  u = g.lerp(m, mu) under Nesterov, else m
        W <- (1 - lr * wd) * W - lr * r * NS(u)     (NS: Newton-Schulz in bfloat16; r from
                                                     adjust_lr_fn and W's shape)

    so Delta is ``r * NS(u) + wd * W_before`` (the decay added as for AdamW), computed with
    torch's own (private, through :mod:`pipeoptim.compat`) NS and ratio: the same bits."""
    update = g.lerp(buf, group["momentum"]) if group["nesterov"] else buf
    ortho = muon_orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
    ratio = muon_lr_ratio(group["adjust_lr_fn"], param.shape)
    g.copy_(ortho).mul_(ratio)


def kept_like(table: dict[Tensor, Tensor], p: Tensor) -> Tensor:
    """``table[p]``, a tensor kept from one update to the next: made like ``p`` when missing or
    no longer like it."""
    buf = table.get(p)
    if buf is None or buf.shape != p.shape or buf.dtype != p.dtype or buf.device != p.device:
        buf = table[p] = torch.empty_like(p)
    return buf


class DirectionFormulas:
    """Delta's formulas for the Predictor (attributes it sets: ``optimizer``, ``sgd_momentum``,
    ``steps_taken``, ``uses_fallback``, ``_kind``, ``_parts``, ``_stored``, ``_step_lr``,
    ``_group_of``, ``_computed``). Lists of parameters are of one group, in its order."""

    def _scratch(self, group: dict[str, Any], p: Tensor) -> Tensor | None:
        """The tensor an adaptive formula computes ``p``'s Delta into (kept across updates);
        None for the formulas that return a tensor they already have."""
        kind = self._kind_of(group)
        if (self.uses_fallback or self._needs_grad(group) or kind in ("sgd", "rmsprop")
                or not self.optimizer.state.get(p)):
            return None
        return kept_like(self._computed, p)

    def _kind_of(self, group: dict[str, Any]) -> str | None:
        """The formula of ``group``: the optimizer's, or that of the part holding the group."""
        if self._parts is None:
            return self._kind
        for part in self._parts:
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
        return kind in ("nadam", "adagrad", "adadelta", "muon", "delay-nadamw")

    def _l2(self, group: dict[str, Any]) -> float:
        """Weight decay that the optimizer adds to the gradient (0 when decoupled)."""
        wd = float(group.get("weight_decay", 0.0))
        kind = self._kind_of(group)
        if kind in ("muon", "delay-nadamw") or (kind in ("nadam", "radam", "adam")
                                                and group.get("decoupled_weight_decay")):
            return 0.0
        return wd

    def _capture_grads(self, group: dict[str, Any], params: Sequence[Tensor], bufs: Sequence[Tensor]) -> None:
        """Pre-step: ``bufs[i] <- g_i`` as the optimizer will use it (sign, L2 decay)."""
        for batch in batches(bufs):
            self._capture_batch(group, [params[i] for i in batch], [bufs[i] for i in batch])

    def _capture_batch(self, group: dict[str, Any], params: Sequence[Tensor], bufs: Sequence[Tensor]) -> None:
        grads = local_all([p.grad.to_dense() if p.grad.is_sparse else p.grad for p in params])
        own = local_all(bufs)
        if group.get("maximize", False):
            Into(own, grads)("neg")
        else:
            copy_all(own, grads)
        wd = self._l2(group)
        if wd != 0.0:
            torch._foreach_add_(own, local_all([p.detach() for p in params]), alpha=wd)
        if self._kind_of(group) == "adadelta":  # numerator uses acc_delta *before* the step
            eps = group["eps"]
            accs = [self.optimizer.state.get(p, {}).get("acc_delta") for p in params]
            fresh = [b for b, acc in zip(own, accs) if acc is None]
            if fresh:
                torch._foreach_mul_(fresh, math.sqrt(eps))
            seen = [i for i, acc in enumerate(accs) if acc is not None]
            if seen:
                roots = torch._foreach_add(local_all([accs[i] for i in seen]), eps)
                torch._foreach_sqrt_(roots)
                torch._foreach_mul_([own[i] for i in seen], roots)

    def _finish_all(self, group: dict[str, Any], params: Sequence[Tensor],
                    states: Sequence[dict[str, Any]], bufs: Sequence[Tensor]) -> None:
        """Post-step: turn the captured gradients ``bufs`` into Delta, in place."""
        for batch in batches(bufs):
            self._finish_batch(group, [params[i] for i in batch], [states[i] for i in batch],
                               [bufs[i] for i in batch])

    def _finish_batch(self, group: dict[str, Any], params: Sequence[Tensor],
                      states: Sequence[dict[str, Any]], bufs: Sequence[Tensor]) -> None:
        kind, g = self._kind_of(group), local_all(bufs)
        if kind == "sgd":
            mu = group["momentum"]
            if mu == 0:
                return
            if not group["nesterov"]:  # "code" variant
                torch._foreach_mul_(g, 1 - group["dampening"])
            torch._foreach_add_(g, _states(states, "momentum_buffer"), alpha=mu)
        elif kind == "nadam":
            steps, prods = _host(states, range(len(params))), _host(states, range(len(params)), "mu_product")
            for (step, prod), run in runs_by(range(len(params)), lambda i: (steps[i], prods[i])).items():
                self._nadam(group, step, prod, [g[i] for i in run], [states[i] for i in run])
            self._decoupled(group, params, g)
        elif kind == "delay-nadamw":
            steps = _host(states, range(len(params)))
            for step, run in runs_by(range(len(params)), steps.__getitem__).items():
                lookahead_direction(group, step, [g[i] for i in run], _states([states[i] for i in run], "exp_avg"),
                                    _states([states[i] for i in run], "exp_avg_sq"), in_place=True)
            self._decoupled(group, params, g)
        elif kind == "rmsprop":
            if group["centered"]:
                means = _states(states, "grad_avg")
                avgs = torch._foreach_addcmul(_states(states, "square_avg"), means, means, value=-1)
                torch._foreach_sqrt_(avgs)
            else:
                avgs = torch._foreach_sqrt(_states(states, "square_avg"))
            torch._foreach_add_(avgs, group["eps"])
            torch._foreach_div_(g, avgs)
        elif kind == "adagrad":
            roots = torch._foreach_sqrt(_states(states, "sum"))
            torch._foreach_add_(roots, group["eps"])
            torch._foreach_div_(g, roots)
            steps = _host(states, range(len(params)))
            for step, run in runs_by(range(len(params)), steps.__getitem__).items():
                torch._foreach_div_([g[i] for i in run], 1 + (step - 1) * group["lr_decay"])
        elif kind == "adadelta":
            roots = torch._foreach_add(_states(states, "square_avg"), group["eps"])
            torch._foreach_sqrt_(roots)
            torch._foreach_div_(g, roots)
        elif kind == "muon":  # the orthogonalisation is per matrix
            for p, state, buf in zip(params, states, bufs):
                muon_direction(group, p, state["momentum_buffer"], buf)
            self._decoupled(group, params, g)

    @staticmethod
    def _nadam(group: dict[str, Any], step: float, prod: float, g: list[Tensor],
               states: Sequence[dict[str, Any]]) -> None:
        """NAdam's Delta from its gradients ``g`` (local shards) at one step count."""
        b1, b2 = _betas(group)
        decay = group["momentum_decay"]
        mu = b1 * (1.0 - 0.5 * 0.96 ** (step * decay))
        mu_next = b1 * (1.0 - 0.5 * 0.96 ** ((step + 1) * decay))
        denoms = adam_denominators(_states(states, "exp_avg_sq"), b2, step, group["eps"])
        torch._foreach_mul_(g, (1 - mu) / (1 - prod))
        torch._foreach_add_(g, _states(states, "exp_avg"), alpha=mu_next / (1 - prod * mu_next))
        torch._foreach_div_(g, denoms)

    def _decoupled(self, group: dict[str, Any], params: Sequence[Tensor], deltas: list[Tensor]) -> None:
        """Add decoupled decay to ``deltas`` (local shards): ``delta <- (delta + wd * W_after) /
        (1 - lr_step * wd)``.

        Equals ``delta + wd * W_before`` since ``W_after = (1-lr*wd) W_before - lr*delta``.
        """
        wd = float(group.get("weight_decay", 0.0))
        if not deltas or wd == 0.0 or not (group.get("decoupled_weight_decay", False)
                                           or self._kind_of(group) in ("muon", "delay-nadamw")):
            return
        torch._foreach_add_(deltas, local_all([p.detach() for p in params]), alpha=wd)
        torch._foreach_div_(deltas, 1 - self._step_lr[id(group)] * wd)

    def _delta(self, p: Tensor, out: Tensor | None) -> Tensor | None:
        """Delta of one parameter, as :meth:`_deltas` gives it."""
        return self._deltas(self._group(p), [p], [out])[0]

    def _deltas(self, group: dict[str, Any], params: Sequence[Tensor],
                outs: Sequence[Tensor | None]) -> list[Tensor | None]:
        """Delta of each of ``params`` (of ``group``): a stored/state tensor (do not modify),
        ``outs[i]`` filled with it, or None (no step yet, no state).

        ``outs[i]`` is scratch space of the parameter's shape; one is allocated when None.
        """
        if self.steps_taken == 0:
            return [None] * len(params)
        if self.uses_fallback or self._needs_grad(group):
            return [self._stored.get(p) for p in params]
        states = [self.optimizer.state.get(p) for p in params]
        if self._kind_of(group) in ("sgd", "rmsprop"):
            # sgd: momentum, paper variant; rmsprop with momentum: the buffer holds g / avg
            return [state["momentum_buffer"] if state else None for state in states]
        deltas: list[Tensor | None] = [None] * len(params)
        held = [i for i, state in enumerate(states) if state]
        for i in held:
            deltas[i] = torch.empty_like(params[i]) if outs[i] is None else outs[i]
        steps = _host(states, held)
        for step, run in runs_by(held, steps.__getitem__).items():
            for batch in batches(deltas, run):
                self._adaptive(group, step, [params[i] for i in batch], [states[i] for i in batch],
                               local_all([deltas[i] for i in batch]))
        return deltas

    def _adaptive(self, group: dict[str, Any], step: float, params: Sequence[Tensor],
                  states: Sequence[dict[str, Any]], out: list[Tensor]) -> None:
        """Adam's, Adamax's or RAdam's Delta into ``out`` (local shards), at one step count."""
        kind = self._kind_of(group)
        b1, b2 = _betas(group)
        bc1 = 1 - b1**step
        if kind == "adam":
            Into(out, _states(states, "max_exp_avg_sq" if group["amsgrad"] else "exp_avg_sq"))("sqrt")
            torch._foreach_div_(out, math.sqrt(1 - b2**step))
            torch._foreach_add_(out, group["eps"])
            self._numerators(states, out)
            torch._foreach_div_(out, bc1)
        elif kind == "adamax":
            Into(out, _states(states, "exp_avg"), _states(states, "exp_inf"))("div")
            torch._foreach_div_(out, bc1)
        elif kind == "radam":
            bc2 = 1 - b2**step
            rho_inf = 2 / (1 - b2) - 1
            rho_t = rho_inf - 2 * step * b2**step / bc2
            if rho_t > 5.0:
                rect = math.sqrt(
                    (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
                )
                Into(out, _states(states, "exp_avg_sq"))("sqrt")
                torch._foreach_add_(out, group["eps"])
                self._numerators(states, out)
                torch._foreach_mul_(out, rect * math.sqrt(bc2) / bc1)
            else:
                Into(out, _states(states, "exp_avg"), bc1)("div")
        else:  # pragma: no cover - every known kind is handled above
            raise AssertionError(kind)
        self._decoupled(group, params, out)

    @staticmethod
    def _numerators(states: Sequence[dict[str, Any]], out: list[Tensor]) -> None:
        """``out[i] <- exp_avg_i / out[i]``: per parameter, torch having no multi-tensor op that
        writes ``a / b`` into ``b`` (see the module docstring)."""
        for m, d in zip(_states(states, "exp_avg"), out):
            torch.div(m, d, out=d)
