"""Whole stages timed as the runtime runs them. Layers timed one by one (:mod:`pipeoptim.profile`)
add up to less than a whole stage (caches, the runtime's own work per pass)."""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .profile import Activation, Clock, OptimizerFactory, check_statistic, on_device


class StageTimer:
    """A copy of ``model`` split by ``sizes`` (a mirrored method's pieces, held twice) into stages
    driven by the local executor under ``method`` over mini-batches of ``microbatches``
    micro-batches, every forward, backward (or its two halves) and update timed by its stage's
    record, on a clock that waits for the device. :meth:`run`
    trains mini-batches; :meth:`summary` gives each stage's seconds per micro-batch. The planner
    runs timers in turns, so that they see the same load (:func:`pipeoptim.planning.time_splits`)."""

    def __init__(self, model: nn.Sequential, sizes: List[int], sample: Activation, target: Any,
                 loss_fn: Callable[[Any, Any], torch.Tensor], *, device: str = "cpu",
                 optimizer: Optional[OptimizerFactory] = None, method: str = "gpipe", microbatches: int = 1) -> None:
        from .methods import get_method
        from .runtime.build import build_stages
        from .runtime.microbatch import batch_size, split_batch

        dev = torch.device(device)
        work = copy.deepcopy(model).to(dev)
        work.train()
        self.method, self.microbatches = get_method(method), microbatches
        # every pass timed by its stage's record, on a clock that waits for the device
        self.stages = build_stages(work, list(sizes) * (2 if self.method.mirrored else 1), self.method, {},
                                   optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.0)), loss_fn,
                                   clock=Clock(dev).now)
        self.ranks = len(self.stages) // self.method.chunks
        self.rounds: List[float] = []  #: seconds of every timed pass, per mini-batch run
        #: per run, per stage: seconds per pass of each kind (forward, backward, weight, update)
        self.runs: List[List[Dict[str, float]]] = []
        x, y = on_device(sample, dev), None if target is None else on_device(target, dev)
        pieces = split_batch(x, torch.zeros(batch_size(x)) if y is None else y, microbatches)
        self.batch = [(piece, None if y is None else t, share) for piece, t, share in pieces]

    def _totals(self) -> List[Tuple[float, ...]]:
        """Each stage's record so far: (F, B, W, U seconds; F, B, U passes)."""
        return [(r.time["F"], r.time["B"], r.weight_seconds, r.time["U"], r.count["F"], r.count["B"], r.count["U"])
                for r in (stage.record for stage in self.stages)]

    def run(self, count: int = 1) -> None:
        from .runtime.local import run_schedule

        for _ in range(count):
            before = self._totals()
            run_schedule(self.stages, self.method.build_schedule(self.ranks, self.microbatches, 1), self.batch)
            per_stage = []
            for (f, b, w, u, nf, nb, nu), (f0, b0, w0, u0, nf0, nb0, nu0) in zip(self._totals(), before):
                # a split backward's two halves count once (at W): B / passes = I + W per micro-batch
                per_stage.append({"forward": (f - f0) / max(1, nf - nf0), "backward": (b - b0) / max(1, nb - nb0),
                                  "weight": (w - w0) / max(1, nb - nb0), "update": (u - u0) / max(1, nu - nu0),
                                  "total": (f - f0) + (b - b0) + (u - u0)})
            self.runs.append(per_stage)
            self.rounds.append(sum(one["total"] for one in per_stage))

    def totals(self, skip: int = 0) -> List[float]:
        return self.rounds[skip:]  # seconds of each mini-batch run after the first skip, all its timed passes

    def summary(self, skip: int = 0, statistic: str = "median") -> Dict[str, List[float]]:
        """Per stage, seconds per pass in one mini-batch run after the first ``skip``: the run
        whose total is the ``statistic`` of the runs' (min: the fastest; median: the middle one),
        so that every stage comes from the same run, as a whole model timed as one stage does (a
        minimum taken stage by stage would add up each one's luckiest run). ``forward``,
        ``backward`` (a split one's two halves added), ``update``, and ``weight`` (the weight
        half) where the backward was split."""
        check_statistic(statistic)
        runs = sorted(range(skip, len(self.rounds)), key=self.rounds.__getitem__)
        pick = self.runs[runs[0] if statistic == "min" else runs[(len(runs) - 1) // 2]]
        out = {kind: [one[kind] for one in pick] for kind in ("forward", "backward", "update", "weight")}
        if not any(out["weight"]):
            del out["weight"]
        return out


def measure_stages(model: nn.Sequential, sizes: List[int], sample: Activation, target: torch.Tensor,
                   loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], *, device: str = "cpu",
                   optimizer: Optional[OptimizerFactory] = None, warmup: int = 2, repeats: int = 5,
                   statistic: str = "median") -> Dict[str, List[float]]:
    """Seconds of each stage's forward, backward and update for the split ``sizes``, timed as the
    runtime runs them (the median, or fastest, of ``repeats`` mini-batches of ``sample`` after
    ``warmup``: :meth:`StageTimer.summary`)."""
    timer = StageTimer(model, sizes, sample, target, loss_fn, device=device, optimizer=optimizer)
    timer.run(warmup + repeats)
    return timer.summary(warmup, statistic)
