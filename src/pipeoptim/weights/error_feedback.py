"""Error feedback on the update: ``error_feedback=True`` of the methods with a one-update delay
(docs/architecture.md, "Delay corrections").

PipeDream-2BW applies update t from a gradient computed on the weights of one update before.
With ``u_t = W_before - W_after`` the update the optimizer applies at step t (any optimizer;
weight decay, clipping and the lr schedule included), ``u_t`` is what synchronous training would
have applied one step earlier, where ``u_{t-1}`` was applied instead. Error feedback adds that
error, ``e_t = u_t - u_{t-1}``, with the update that reveals it::

    W_{t+1} = W_t - u_t - beta * (u_t - u_{t-1})

so that the sum applied follows the sum that should have been, one update ahead (it
telescopes). This is the correction of Zmushko et al. (arXiv 2606.30634, section 3) as this
library reads it, with ``beta = 1``. It applies only to an update whose gradient is one or more
updates stale and that has a previous update; it costs one weight-sized buffer (the previous
update) and a scratch copy of the weights during the update.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .fused import clone_all, copy_all, local_all, nbytes


class GradientDelay:
    """How stale an update's gradients are: the updates between the oldest weight version the
    forwards of its micro-batches ran on (or predicted from) and the live version. 0 for the
    synchronous methods, 1 in 2BW's steady state (pipeoptim-2bw's last stage: 0), N-1-k in
    asynchronous 1F1B's at stage k of N, predicted or not, about (N-1-k)/M with M micro-batches
    (XPipe)."""

    def __init__(self) -> None:
        self._forward: Dict[int, int] = {}       # micro-batch in flight -> its forward's version
        self._oldest: Optional[int] = None        # over the backwards since the last update

    def saw(self, kind: str, microbatch: int, version: int) -> None:
        """A pass of ``microbatch`` on ``version`` ("F", "B", "I" or "W", as the trace says)."""
        if kind == "F":
            self._forward[microbatch] = version
        elif kind != "W":  # a backward (the weight half belongs to its input half's)
            version = self._forward.pop(microbatch, version)
            self._oldest = version if self._oldest is None else min(self._oldest, version)

    def of(self, live: int) -> int:
        """The delay of the update about to be applied to version ``live``."""
        return 0 if self._oldest is None else max(0, live - self._oldest)

    def take(self, live: int) -> int:
        """:meth:`of`, then start counting for the next update."""
        delay, self._oldest = self.of(live), None
        return delay


class UpdateFeedback:
    """The error-feedback state of one stage: the update before the last one applied, by
    parameter name; :meth:`before_step` and :meth:`after_step` run around the optimizer's step."""

    def __init__(self, named: Sequence[Tuple[str, torch.Tensor]], scale: float = 1.0) -> None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
            raise ValueError(f"the error feedback's scale must be a positive number, got {scale!r}")
        self.named = list(named)
        self.scale = float(scale)
        self.updates = 0                                 #: updates seen so far
        self.corrected = 0                               #: of which corrected
        self.previous: Dict[str, torch.Tensor] = {}      #: parameter name -> u_{t-1}
        self._scratch: Optional[List[torch.Tensor]] = None

    @torch.no_grad()
    def before_step(self) -> None:
        """The weights before the optimizer's step, into the scratch copy (made once)."""
        live = [p.detach() for _, p in self.named]
        if self._scratch is None or any(s.shape != p.shape or s.device != p.device
                                        for s, p in zip(self._scratch, live)):
            self._scratch = clone_all(live)
        else:
            copy_all(self._scratch, live)

    @torch.no_grad()
    def after_step(self, delay: int) -> bool:
        """After the step: ``u_t`` from the scratch copy; ``W -= beta (u_t - u_{t-1})`` when the
        update's gradient was ``delay >= 1`` updates stale and a previous update exists. Keeps
        ``u_t`` for the next update; whether this one was corrected."""
        if self._scratch is None:
            raise RuntimeError("after_step without before_step")
        live = local_all([p.detach() for _, p in self.named])
        update = local_all(self._scratch)
        torch._foreach_sub_(update, live)                # u_t = W_before - W_after
        names = [n for n, _ in self.named]
        correct = delay >= 1 and all(n in self.previous for n in names)
        if correct:
            error = torch._foreach_sub(update, local_all([self.previous[n] for n in names]))
            torch._foreach_sub_(live, error, alpha=self.scale)
            self.corrected += 1
        # u_t becomes the previous update: the scratch tensors change hands, no copy
        old = [self.previous.get(n) for n in names]
        self.previous = dict(zip(names, self._scratch))
        reuse = [t for t in old if t is not None]
        self._scratch = reuse if len(reuse) == len(names) else None
        self.updates += 1
        return correct

    def nbytes(self) -> int:
        """Bytes held: the previous update and the scratch copy."""
        return nbytes(list(self.previous.values()) + (self._scratch or []))

    def state_dict(self) -> Dict[str, Any]:
        return {"updates": self.updates, "corrected": self.corrected,
                "previous": {n: t.clone() for n, t in self.previous.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        own = dict(self.named)
        self.updates = int(state["updates"])
        self.corrected = int(state.get("corrected", 0))
        self.previous = {n: t.to(own[n].device).clone() for n, t in state["previous"].items() if n in own}
        self._scratch = None
