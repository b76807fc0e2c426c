"""The segment an executor runs: the streamed horizon (:func:`next_horizon`), the checks on a
schedule, the global clipping coefficient and the last stage's losses per mini-batch
(:class:`WindowLosses`).

A *segment* is the mini-batches between two drains, run on orders built for a horizon past the
mini-batches fed and drained on those for exactly the mini-batches fed (why that is exact:
docs/architecture.md, "Schedules as data")."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..schedules.actions import Schedule

MicroBatch = Tuple[Any, torch.Tensor, float]  # inputs, target, share of the mini-batch loss
ScheduleFor = Callable[[int], Schedule]        # mini-batches -> the segment's schedule


def check_runnable(schedule: Schedule, num_stages: int, mirrored: bool = False) -> None:
    """The runtimes run one chain of ``num_stages`` stages (a rank holding one or several), or,
    ``mirrored``, two chains of half of them each, the second replicating the first's pieces."""
    half = num_stages // 2
    chains = [list(range(half)), list(range(half, num_stages))] if mirrored else [list(range(num_stages))]
    if schedule.num_stages != num_stages or schedule.pipelines != chains:
        raise ValueError(f"schedule {schedule.name} runs {schedule.num_stages} stages in chains "
                         f"{schedule.pipelines}; the pipeline's {num_stages} stages run in {chains} "
                         f"(use the schedule with `pipeoptim schedule` to simulate)")


def replica_pairs(schedule: Schedule) -> Dict[int, int]:
    """Stage -> the stage holding the other replica of its piece (two pipelines of the same
    pieces: the j-th stage of each), both ways; empty for one chain."""
    if len(schedule.pipelines) != 2:
        return {}
    first, second = schedule.pipelines
    return {**dict(zip(first, second)), **dict(zip(second, first))}


def stage_orders(schedule: Schedule) -> List[List[Any]]:
    """Per stage, the actions of that stage in the order its rank runs them (a rank's order
    itself where it holds one stage): what a stage's weight policy reads."""
    if schedule.num_ranks == schedule.num_stages:
        return [schedule.orders[schedule.stage_to_rank[k]] for k in range(schedule.num_stages)]
    return [schedule.stage_actions(k) for k in range(schedule.num_stages)]


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient for the gradient norm ``total`` (a 0-dim
    tensor, left on its device): min(1, max_norm / (total + 1e-6))."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def next_horizon(fed: int, horizon: int, expected: Optional[int], built: bool) -> Optional[Tuple[int, bool]]:
    """After ``fed`` mini-batches of a segment: None if the orders built for ``horizon`` still
    do (they must reach past the data fed, so that the drain never runs early), else
    (mini-batches to build them for, whether more may follow): a segment of known length
    (``expected``) once, for exactly that many; otherwise the horizon doubles."""
    if expected is not None and fed > expected:
        raise ValueError(f"this segment was to hold {expected} mini-batches and has drained; got one "
                         f"more (does the loader yield more than its len() says?)")
    if built and (fed < horizon or fed == expected):
        return None
    if expected is not None:
        return expected, False
    return max(fed + 1, 2 * horizon, 4), True


class WindowLosses(dict):
    """The last stage's micro-batch losses summed per update window (mini-batch), in micro-batch
    order, each window reported to ``on_loss(window, loss)`` as soon as its losses are in.

    Losses on an accelerator stay there (the host never waits for the device): without
    ``on_loss``, a complete window's are copied to pinned host memory without blocking and taken
    once there (:meth:`take_completed`). Two pipelines (``halves``: the micro-batches of a window
    that the first takes) sum each pipeline's losses apart, then the two sums; a process holding
    one pipeline's last stage receives ``expected`` losses a window and reports its half's sum."""

    def __init__(self, microbatches: int, on_loss: Optional[Callable[[int, float], None]] = None,
                 halves: Optional[int] = None, expected: Optional[int] = None) -> None:
        super().__init__()
        self.microbatches = microbatches
        self.on_loss = on_loss
        self.halves = halves
        self.expected = microbatches if expected is None else expected
        self._parts: Dict[int, List[Any]] = {}
        self._ready: List[Tuple[int, Any, Any]] = []  # (window, floats or a pinned tensor, event)

    def add(self, microbatch: int, loss: Any) -> None:
        window = microbatch // self.microbatches
        parts = self._parts.setdefault(window, [])
        parts.append((microbatch, loss))
        if len(parts) < self.expected:
            return
        ordered = sorted(self._parts.pop(window), key=lambda part: part[0])
        if self.halves is not None and len(ordered) == self.microbatches:  # both pipelines here
            first = [loss for i, loss in ordered if i % self.microbatches < self.halves]
            second = [loss for i, loss in ordered if i % self.microbatches >= self.halves]
            parts = [float_sum([float_sum(first), float_sum(second)])]
        else:
            parts = [loss for _, loss in ordered]
        on_device = [p for p in parts if torch.is_tensor(p) and p.device.type == "cuda"]
        if self.on_loss is None and on_device:
            device = on_device[0].device
            with torch.cuda.device(device):
                values = torch.stack([torch.as_tensor(p, device=device).reshape(()) for p in parts])
                host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                host.copy_(values, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            self._ready.append((window, host, event))
            return
        total = float_sum(parts)
        self[window] = total
        self._ready.append((window, None, None))
        if self.on_loss is not None:
            self.on_loss(window, total)

    def take_completed(self, wait: bool = False) -> List[Tuple[int, float]]:
        """The windows completed since the last call, with their losses, in window order (one
        still on its way from the device: at a later call, or waited for with ``wait``)."""
        done = []
        while self._ready:
            window, host, event = self._ready[0]
            if event is not None:
                if not wait and not event.query():
                    break
                event.synchronize()
                self[window] = float_sum(host.tolist())
            self._ready.pop(0)
            done.append((window, self[window]))
        return done


def float_sum(values: Sequence[Any]) -> float:
    """The float sum of ``values``, in order (a bidirectional window's loss: its two pipelines'
    sums, the first pipeline's first)."""
    total = 0.0
    for value in values:
        total += float(value)
    return total
