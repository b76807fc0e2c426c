"""DelayNAdamW: NAdamW with a constant beta1 whose Nesterov look-ahead spans the gradient delay of
a pipeline stage (``--optimizer delay-nadamw``).

The idea is after Ajanthan et al., "Nesterov Method for Asynchronous Pipeline Parallel
Optimization" (ICML 2025): a stage whose gradients are ``tau`` updates stale looks further ahead
along its momentum. The formulation below is ours, not the paper's. Per parameter, with ``t`` its
step count after this step (1 at its first), ``g`` its gradient (negated under ``maximize``) and
``k = tau + 1`` the look-ahead in updates::

    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    a = b1**k / (1 - b1**(t + k)),    b = (1 - b1**k) / (1 - b1**t)
    d = (a * m + b * g) / (sqrt(v / (1 - b2**t)) + eps)
    W = W * (1 - lr * weight_decay) - lr * d

``a * m + b * g`` is the first moment ``k`` updates ahead were the gradient to stay ``g``
(``m_{t+k} = b1**k * m_t + (1 - b1**k) * g``), its ``m`` part bias-corrected as the moment then
(``1 - b1**(t+k)``), its ``g`` part as the moment now (``1 - b1**t``), Dozat's choice for one
update ahead. With ``tau = 0`` it is Dozat's NAdam with a constant momentum ``b1`` and decoupled
weight decay; ``torch.optim.NAdam`` is not that: its momentum follows the schedule
``mu_t = b1 * (1 - 0.5 * 0.96**(t * momentum_decay))``, about ``0.5 * b1`` at the first step with
the default decay 0.004, ``0.9 * b1`` only after 10000 steps.

The delay is a group setting: ``delay=None`` (the default) counts as 0 until a pipeline sets the
stage's delay with :meth:`DelayNAdamW.set_pipeline_delay`, which leaves a delay the user gave
alone. A pipeline's delay is the one each update's gradients have (``Stage.gradient_delay``), never
more than the updates so far (``k <= t``), so ``b <= 1``; a delay fixed from the start weights the
first steps' gradient more (``b = 7.7`` at ``t = 1`` for ``b1 = 0.99``, ``delay = 7``). The
Predictor's exact Delta for this optimizer (``weights/formulas.py``) is :func:`lookahead_direction`
too.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["DelayNAdamW", "lookahead_coefficients", "lookahead_direction", "adam_denominators", "delay_of",
           "runs_by"]


def lookahead_coefficients(b1: float, step: float, delay: int) -> Tuple[float, float]:
    """``(a, b)``: the weights of the first moment ``m`` and of the gradient ``g`` in the look-ahead
    ``a * m + b * g`` of a parameter at step count ``step`` (>= 1), ``delay`` updates stale."""
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count after the step), got {step}")
    k = delay + 1
    return b1**k / (1 - b1 ** (step + k)), (1 - b1**k) / (1 - b1**step)


def delay_of(group: Dict[str, Any]) -> int:
    """The delay a group's look-ahead spans: its ``delay``, 0 while that is None."""
    return 0 if group["delay"] is None else int(group["delay"])


def adam_denominators(exp_avg_sqs: List[Tensor], b2: float, step: float, eps: float) -> List[Tensor]:
    """``sqrt(v / (1 - b2**step)) + eps`` of each ``v`` (new tensors)."""
    denoms = torch._foreach_div(exp_avg_sqs, 1 - b2**step)
    torch._foreach_sqrt_(denoms)
    torch._foreach_add_(denoms, eps)
    return denoms


def lookahead_direction(group: Dict[str, Any], step: float, grads: List[Tensor], exp_avgs: List[Tensor],
                        exp_avg_sqs: List[Tensor], *, in_place: bool = False) -> List[Tensor]:
    """``d = (a * m + b * g) / (sqrt(v / (1 - b2**t)) + eps)`` of parameters of ``group`` at step
    count ``step`` (after the step), with the group's delay; written into ``grads`` when
    ``in_place``. The step and the Predictor's Delta run these operations, so d has the same bits."""
    b1, b2 = (float(b) for b in group["betas"])
    a, b = lookahead_coefficients(b1, step, delay_of(group))
    if in_place:
        d = grads
        torch._foreach_mul_(d, b)
    else:
        d = torch._foreach_mul(grads, b)
    torch._foreach_add_(d, exp_avgs, alpha=a)
    torch._foreach_div_(d, adam_denominators(exp_avg_sqs, b2, step, group["eps"]))
    return d


def _check_delay(delay: Any) -> None:
    if delay is not None and (isinstance(delay, bool) or not isinstance(delay, int) or delay < 0):
        raise ValueError(f"delay must be None or an int >= 0, got {delay!r}")


def _check(settings: Dict[str, Any]) -> None:
    """Refuse a bad group setting with a ValueError naming it."""
    if not settings["lr"] > 0:
        raise ValueError(f"lr must be positive, got {settings['lr']}")
    b1, b2 = settings["betas"]
    if not 0 <= b1 < 1:
        raise ValueError(f"betas[0] (beta1) must lie in [0, 1), got {b1}")
    if not 0 <= b2 < 1:
        raise ValueError(f"betas[1] (beta2) must lie in [0, 1), got {b2}")
    if not settings["eps"] >= 0:
        raise ValueError(f"eps must be >= 0, got {settings['eps']}")
    if not settings["weight_decay"] >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {settings['weight_decay']}")
    _check_delay(settings["delay"])


def runs_by(indices: Iterable[int], key: Callable[[int], Any]) -> Dict[Any, List[int]]:
    """``indices`` by ``key`` (in first-seen order): the parameters whose per-parameter scalars
    (from the step count) are equal, so one run of multi-tensor operations each."""
    runs: Dict[Any, List[int]] = {}
    for i in indices:
        runs.setdefault(key(i), []).append(i)
    return runs


class DelayNAdamW(torch.optim.Optimizer):
    """NAdamW with a constant ``betas[0]`` and a look-ahead of ``delay + 1`` updates (the module
    docstring has the rule). State per parameter: ``step`` (a float32 tensor, as torch's
    optimizers keep it), ``exp_avg`` (m) and ``exp_avg_sq`` (v). Each group keeps
    ``fixed_delay``: whether its delay was given, so that a pipeline's delay does not override it.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: Tuple[float, float] = (0.99, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, delay: Optional[int] = None, *,
                 maximize: bool = False) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, delay=delay,
                        maximize=maximize)
        _check(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch's, after checking the group's settings and recording whether its delay is fixed."""
        settings = {**self.defaults, **param_group}
        _check(settings)
        param_group["fixed_delay"] = settings["delay"] is not None
        super().add_param_group(param_group)

    def set_pipeline_delay(self, delay: int) -> None:
        """Set ``delay`` (the stage's gradient delay in updates) on every group whose delay the
        user did not fix."""
        if delay is None:
            raise ValueError("delay must be an int >= 0, got None")
        _check_delay(delay)
        for group in self.param_groups:
            if not group["fixed_delay"]:
                group["delay"] = delay

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(group, params)
        return loss

    def _state(self, p: Tensor) -> Dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _step_group(self, group: Dict[str, Any], params: List[Tensor]) -> None:
        """One update of the parameters of ``group`` that have a gradient."""
        grads = [p.grad for p in params]
        if any(g.is_sparse for g in grads) or any(p.is_complex() for p in params):
            raise RuntimeError("DelayNAdamW supports neither sparse gradients nor complex parameters")
        if group["maximize"]:
            grads = torch._foreach_neg(grads)
        states = [self._state(p) for p in params]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        b1, b2 = (float(b) for b in group["betas"])
        torch._foreach_add_([s["step"] for s in states], 1.0)
        torch._foreach_lerp_(exp_avgs, grads, 1 - b1)
        torch._foreach_mul_(exp_avg_sqs, b2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - b2)
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        for step, run in runs_by(range(len(states)), lambda i: float(states[i]["step"])).items():
            d = lookahead_direction(group, step, [grads[i] for i in run], [exp_avgs[i] for i in run],
                                    [exp_avg_sqs[i] for i in run])
            moved = [params[i] for i in run]
            if wd != 0.0:
                torch._foreach_mul_(moved, 1 - lr * wd)
            torch._foreach_add_(moved, d, alpha=-lr)
