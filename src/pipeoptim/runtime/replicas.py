"""The two replicas of a model piece in a bidirectional run: their gradients summed before the
update (docs/architecture.md, "Bidirectional pipelines").

A mirrored method runs two pipelines of the same P pieces in opposite directions: stages j and
P+j hold copies of piece j, each seeing its pipeline's half of the micro-batches. Before update
u, each replica's gradient becomes the sum of both replicas' over window u, so that both apply
the same update and stay equal. Each replica's update waits for the other's last backward of the
window; whichever comes first sums for both. Replicas on two processes sum over the piece's
2-process group instead, started after the last backward of the window (at the update, after
the tied weights' sums over their holders, where a tie crosses processes).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ..schedules.actions import Kind, Schedule
from .segment import replica_pairs


class ReplicaUpdates:
    """When a replicated stage may update, and the sum of its replicas' gradients."""

    def __init__(self, stages: Sequence, summers: Optional[Dict[int, Any]] = None) -> None:
        """``stages``: by stage number (None where another process holds one). ``summers``: piece
        -> the summer of its replicas' gradients over their 2-process group
        (``averaging.GradientAverager``, ``mean=False``), where the other replica is elsewhere."""
        self.stages = list(stages)
        self.summers = dict(summers or {})
        self.pieces = len(self.stages) // 2
        self.partner: Dict[int, int] = {}
        self.expected: Counter = Counter()          # (stage, window) -> the backwards its update waits for
        self.m = 1
        self.done: Counter = Counter()              # (stage, window) -> its backwards finished
        self.summed: Set[Tuple[int, int]] = set()   # (stage, window) whose gradient is the sum already

    def use(self, schedule: Schedule) -> None:
        """The current schedule: what each window's update waits for (the counts so far stay)."""
        self.partner = replica_pairs(schedule)
        m = schedule.microbatches_per_update
        self.expected = Counter((a.stage, a.index // m) for order in schedule.orders for a in order
                                if a.kind is Kind.F)
        self.m = m

    def backward_done(self, stage: int, microbatch: int) -> None:
        """``stage`` finished the backward of ``microbatch``; after its last of the window, a piece
        whose other replica is on another process starts their sum."""
        self.done[(stage, microbatch // self.m)] += 1
        summer = self.summers.get(stage % self.pieces) if self.summers else None
        if summer is not None and not _ties_first(self.stages[stage]) and self.window_done(stage, microbatch):
            summer.overlap()
            summer.ready_all(list(self.stages[stage].parameters()))
            summer.launch_bucketed()

    def window_done(self, stage: int, microbatch: int) -> bool:
        """Whether ``stage``'s backwards of the window of ``microbatch`` are all done (its count
        is forgotten once it says so)."""
        key = (stage, microbatch // self.m)
        if self.done[key] < self.expected[key]:
            return False
        del self.done[key]
        return True

    def ready(self, stage: int, update: int) -> bool:
        """Whether ``stage`` may run update ``update`` now; the first of a pair to be ready sums
        both replicas' gradients (into each), the second finds them summed; a piece summed over
        two processes waits here for its sum (a parameter without a gradient there takes a zero
        one; in one process none)."""
        if self.summers:
            summer = self.summers.get(stage % self.pieces)
            if summer is not None:
                if _ties_first(self.stages[stage]):  # a tied weight's holders' sum comes first
                    self.stages[stage].sync_gradients()
                summer(self.stages[stage].parameters())
                return True
        if (stage, update) in self.summed:
            self.summed.discard((stage, update))
            return True
        other = self.partner.get(stage)
        if other is None:
            return True
        if any(self.done[(s, update)] < self.expected[(s, update)] for s in (stage, other)):
            return False
        self._sum(self.stages[stage], self.stages[other])
        self.summed.add((other, update))
        for s in (stage, other):
            del self.done[(s, update)]
        return True

    @staticmethod
    @torch.no_grad()
    def _sum(a, b) -> None:
        """Both replicas' gradients become their sum (the same values in each)."""
        for p, q in zip(a.parameters(), b.parameters()):
            if p.grad is None and q.grad is None:
                continue
            total = p.grad if q.grad is None else q.grad if p.grad is None else p.grad + q.grad
            p.grad, q.grad = total, total.clone()


def _ties_first(stage: Any) -> bool:
    """Whether ``stage``'s process sums tied weights over processes (runtime/tied.py's
    ``TieRound``): then each tie's holders are summed first (in each pipeline) and the replicas
    after, at the update, not as the last backward ends."""
    return stage.tied is not None and stage.tied.round is not None


@torch.no_grad()
def copy_to_replicas(stages: Sequence) -> None:
    """Each replica stage takes the weights and buffers of the stage it copies (``replica_of``):
    after a load, which reads each piece once."""
    by_index = {stage.index: stage for stage in stages}
    for stage in stages:
        original = by_index.get(stage.replica_of)
        if original is None:
            continue
        for mine, theirs in zip(stage.module.state_dict().values(), original.module.state_dict().values()):
            mine.copy_(theirs)


def replica_pair_groups(placement: Sequence[int], rank: int, timeout: float,
                        to_global: Sequence[Callable[[int], int]] = (lambda k: k,)) -> Tuple[List[Any], Dict[int, Any]]:
    """A run of two pipelines of the same pieces under torchrun (``placement``: the pipeline rank
    of each stage; ``to_global``: a pipeline rank's global rank, one map per tensor rank, each
    a pipeline of its own): a 2-process group for each piece whose two replicas are on two ranks.
    One group per piece, not per pair of ranks: two pieces of one pair may become final in
    another order on each rank, which one group would pair up wrongly. Every rank makes every
    group, in piece order (then tensor rank). Returns (every group made, this rank's: piece -> group)."""
    import datetime

    import torch.distributed as dist

    half = len(placement) // 2
    made, own = [], {}
    for piece in range(half):
        for global_of in to_global:
            ranks = sorted({global_of(placement[piece]), global_of(placement[half + piece])})
            if len(ranks) == 1:
                continue
            group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout))
            made.append(group)
            if rank in ranks:
                own[piece] = group
    return made, own
