"""Delay corrections of the asynchronous methods: options, all off by default (docs/architecture.md,
"Delay corrections").

Stage k of an asynchronous pipeline applies each update from a gradient ``tau_k = N-1-k`` updates
stale. Each correction is an option of the methods it applies to (:mod:`pipeoptim.options`); this
module holds their arithmetic:

* ``lr_correction="delay"`` (PipeMare): stage k applies update t with
  ``lr_k(t) = lr(t) / tau_k ** (1 - min(t / T, 1))``, T = ``lr_correction_steps``; the last stage
  and a synchronous warm-up's updates untouched. (:func:`delay_divisor`)
* ``horizon="scheduled"``: ``W_hat = W - (lr(t) + ... + lr(t+s-1)) * Delta`` (t the next update;
  a fractional s takes that share of the last lr) instead of ``s * lr(t)``, the lrs read from a
  shadow of the stage's scheduler stepped ahead (:class:`LrLookahead`), any
  ``torch.optim.lr_scheduler``. Equal to ``s * lr(t)`` under a constant lr.
* ``delta="ema"``: Delta is the average of the updates applied, per unit lr:
  ``d_t = (W_before - W_after) / lr_t``, ``u_1 = d_1``, ``u_t = g u_{t-1} + (1-g) d_t``, g =
  ``ema_decay`` (0.9): it sees weight decay, clipping and schedules, for any optimizer; one
  weight-sized buffer more per stage. (:class:`UpdateAverage`)
* ``prediction_warmup=T``: the prediction's step count ramps as ``s * min(1, t / T)``.
* ``sync_warmup=K``: the first K mini-batches run 1F1B with a flush (no staleness, prediction or
  lr correction), then the asynchronous schedule (:mod:`pipeoptim.schedules.concat`).

Only ``delta="ema"`` holds a weight copy.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .fused import applied_update, batches, clone_all, local_all


#: The corrections that change a prediction, in the order the diagnostic reports them.
PREDICTION_CORRECTIONS = ("lr_correction", "horizon", "delta", "prediction_warmup")


def delay_divisor(delay: int, update: int, steps: int) -> float:
    """What PipeMare divides update ``update``'s lr by at a stage ``delay`` updates stale:
    ``delay ** (1 - min(update / steps, 1))``, and 1 for ``delay < 1``."""
    if delay < 1:
        return 1.0
    return delay ** (1.0 - min(update / steps, 1.0))


def horizon_rate(rates: Sequence[float], steps: float) -> float:
    """The lr mass of the next ``steps`` updates whose lrs are ``rates`` (at least ceil(steps)
    of them): their sum, a fractional last step counting its share. When they are all equal it
    is ``rates[0] * steps``, the constant-lr prediction's own arithmetic (the same bits)."""
    whole = int(math.floor(steps))
    needed = whole + (1 if steps > whole else 0)
    used = rates[:needed]
    if all(r == used[0] for r in used):
        return used[0] * steps
    total = sum(used[:whole])
    if steps > whole:
        total += (steps - whole) * used[whole]
    return total


class LrLookahead:
    """The learning rates a stage's scheduler will set for the updates to come: a shadow
    scheduler, built by the user's factory on a stand-in optimizer with the stage optimizer's
    groups as they were before any scheduler touched them, stepped ahead as far as a prediction
    looks. :meth:`rates` of update u is the lr the real scheduler gives the u-th step (from 0)."""

    def __init__(self, optimizer: torch.optim.Optimizer, factory: Callable[[Any], Any]) -> None:
        self._factory = factory
        self._defaults = dict(optimizer.defaults)
        self._groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self._restart()

    def _restart(self) -> None:
        groups = [{**settings, "params": [torch.zeros(())]} for settings in self._groups]
        self._stand_in = torch.optim.Optimizer(groups, self._defaults)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": no optimizer here
            self._scheduler = self._factory(self._stand_in)
        self._position = 0                                # the update whose lrs the stand-in holds
        self._rates: Dict[int, Tuple[float, ...]] = {0: self._current()}

    def _current(self) -> Tuple[float, ...]:
        return tuple(float(g["lr"]) for g in self._stand_in.param_groups)

    def rates(self, group: int, first_update: int, count: int) -> List[float]:
        """The lrs of group ``group`` for updates ``first_update .. first_update + count - 1``."""
        if first_update not in self._rates and first_update <= self._position:
            self._restart()  # a state from earlier in the run was loaded
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            while self._position < first_update + count - 1:
                self._scheduler.step()
                self._position += 1
                self._rates[self._position] = self._current()
        for update in [u for u in self._rates if u < first_update]:
            del self._rates[update]
        return [self._rates[u][group] for u in range(first_update, first_update + count)]


class UpdateAverage:
    """Delta from the updates actually applied: an exponential moving average, per unit lr, of
    ``W_before - W_after`` (see the module docstring). Offers the :class:`~pipeoptim.weights.
    predict.Predictor`'s interface for predictions: :attr:`has_direction` and
    :meth:`directions`."""

    def __init__(self, optimizer: torch.optim.Optimizer, named: Sequence[Tuple[str, torch.Tensor]],
                 decay: float) -> None:
        self.optimizer = optimizer
        self.decay = decay
        self.named = list(named)
        self.updates = 0                                  #: updates averaged so far
        self.average: Dict[str, torch.Tensor] = {}        #: parameter name -> u
        self._plan: List[tuple] = []
        self._plan_groups: Optional[List[int]] = None

    @property
    def has_direction(self) -> bool:
        return self.updates > 0

    def directions(self) -> List[tuple]:
        """Per parameter group ``(group, params, deltas)``, Delta being the average (the same
        tensors from one update to the next, updated in place)."""
        ids = [id(g) for g in self.optimizer.param_groups]
        if self._plan_groups != ids or not self._plan:
            names = {id(p): n for n, p in self.named}
            plan = []
            for group in self.optimizer.param_groups:
                params = [p for p in group["params"] if id(p) in names and names[id(p)] in self.average]
                plan.append((group, params, [self.average[names[id(p)]] for p in params]))
            self._plan, self._plan_groups = plan, ids
        return self._plan

    @torch.no_grad()
    def observe(self, before: Sequence[torch.Tensor], lrs: Sequence[float]) -> None:
        """Fold in the update just applied. ``before`` holds each parameter's value before it
        (in ``named`` order; used as scratch), ``lrs`` the lr each group applied. An update with
        lr 0 says nothing about the direction and is skipped."""
        position = {id(p): i for i, (_, p) in enumerate(self.named)}
        first, added = self.updates == 0, False
        for group, lr in zip(self.optimizer.param_groups, lrs):
            mine = [position[id(p)] for p in group["params"] if id(p) in position]
            if lr != 0.0:
                for batch in batches(before, mine):
                    added = self._fold(before, batch, lr, first) or added
        self.updates += 1
        if added or first:
            self._plan = []  # new tensors: the plan is rebuilt (else its tensors were updated in place)

    def _fold(self, before: Sequence[torch.Tensor], positions: List[int], lr: float, first: bool) -> bool:
        """:meth:`observe` for the parameters at ``positions`` (of one group, applied at ``lr``),
        as multi-tensor ops on the local shards; whether an average was started for one."""
        d = applied_update([before[i] for i in positions], [self.named[i][1] for i in positions], lr)
        names = [self.named[i][0] for i in positions]
        new = [k for k, name in enumerate(names) if first or name not in self.average]
        old = [k for k in range(len(names)) if k not in new]
        added = any(names[k] not in self.average for k in new)
        self.average.update(zip([names[k] for k in new], clone_all([before[positions[k]] for k in new])))
        if old:  # u <- g u + (1 - g) d
            average = local_all([self.average[names[k]] for k in old])
            torch._foreach_mul_(average, self.decay)
            torch._foreach_add_(average, [d[k] for k in old], alpha=1.0 - self.decay)
        return added

    def state_dict(self) -> Dict[str, Any]:
        return {"updates": self.updates, "average": {n: t.clone() for n, t in self.average.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.updates = int(state["updates"])
        own = {n: p for n, p in self.named}
        self.average = {n: t.to(own[n].device).clone() for n, t in state["average"].items() if n in own}
        self._plan = []
