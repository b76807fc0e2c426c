"""Whole stages timed as the runtime runs them. Layers timed one by one (:mod:`pipeoptim.profile`)
add up to less than a whole stage (caches, the runtime's own work per pass)."""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .profile import Activation, Clock, OptimizerFactory, check_statistic, detached, on_device

class StageTimer:
    """A copy of ``model`` split by ``sizes`` (a mirrored method's pieces, held twice) into stages
    driven by the local executor under ``method`` over mini-batches of ``microbatches``
    micro-batches, every forward, backward (or its two halves) and update timed. :meth:`run`
    trains mini-batches; :meth:`summary` gives each stage's seconds per micro-batch. The planner
    runs timers in turns, so that they see the same load (:func:`pipeoptim.planning.time_splits`)."""

    KINDS = ("forward", "backward", "backward_input", "backward_weight", "update")

    def __init__(self, model: nn.Sequential, sizes: List[int], sample: Activation, target: Any,
                 loss_fn: Callable[[Any, Any], torch.Tensor], *, device: str = "cpu",
                 optimizer: Optional[OptimizerFactory] = None, method: str = "gpipe", microbatches: int = 1) -> None:
        from .methods import get_method
        from .runtime.build import build_stages
        from .runtime.microbatch import batch_size, split_batch

        dev = torch.device(device)
        self.clock = Clock(dev)
        work = copy.deepcopy(model).to(dev)
        work.train()
        self.method, self.microbatches = get_method(method), microbatches
        self.stages = build_stages(work, list(sizes) * (2 if self.method.mirrored else 1), self.method, {},
                                   optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.0)), loss_fn)
        self.ranks = len(self.stages) // self.method.chunks
        self.rounds: List[float] = []  #: seconds of every timed call, per mini-batch run
        self.calls: List[List[Tuple[int, str, float]]] = [[] for _ in self.stages]  # (run, kind, seconds)
        for stage, calls in zip(self.stages, self.calls):
            for name in self.KINDS:
                def timed(*args: Any, _call=getattr(stage, name), _name=name, _calls=calls, **kwargs: Any) -> Any:
                    seconds, out = self.clock.time(lambda: _call(*args, **kwargs))
                    _calls.append((len(self.rounds), _name, seconds))
                    return out
                setattr(stage, name, timed)
        x, y = on_device(detached(sample), dev), None if target is None else on_device(target, dev)
        pieces = split_batch(x, torch.zeros(batch_size(x)) if y is None else y, microbatches)
        self.batch = [(piece, None if y is None else t, share) for piece, t, share in pieces]

    def run(self, count: int = 1) -> None:
        from .runtime.local import run_schedule

        for _ in range(count):
            run_schedule(self.stages, self.method.build_schedule(self.ranks, self.microbatches, 1), self.batch)
            self.rounds.append(sum(t for calls in self.calls for r, _, t in calls if r == len(self.rounds)))

    def totals(self, skip: int = 0) -> List[float]:
        return self.rounds[skip:]  # seconds of each mini-batch run after the first skip, all its timed calls

    def summary(self, skip: int = 0, statistic: str = "median") -> Dict[str, List[float]]:
        """Per stage, seconds per call in one mini-batch run after the first ``skip``: the run
        whose total is the ``statistic`` of the runs' (min: the fastest; median: the middle one),
        so that every stage comes from the same run, as a whole model timed as one stage does (a
        minimum taken stage by stage would add up each one's luckiest run). ``forward``,
        ``backward`` (a split one's two halves added), ``update``, and ``weight`` (the weight
        half) where the backward was split."""
        check_statistic(statistic)
        runs = sorted(range(skip, len(self.rounds)), key=self.rounds.__getitem__)
        pick = runs[0] if statistic == "min" else runs[(len(runs) - 1) // 2]

        def of(calls: List[Tuple[int, str, float]], kind: str) -> float:
            times = [t for r, k, t in calls if k == kind and r == pick]
            return sum(times) / len(times) if times else 0.0

        out: Dict[str, List[float]] = {"forward": [], "backward": [], "update": [], "weight": []}
        for calls in self.calls:
            out["forward"].append(of(calls, "forward"))
            out["backward"].append(of(calls, "backward") + of(calls, "backward_input") + of(calls, "backward_weight"))
            out["weight"].append(of(calls, "backward_weight"))
            out["update"].append(of(calls, "update"))
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
