"""The local executor: every stage in one process, interpreting the schedule's action lists.

Each stage follows its own list; the executor only moves activations and gradients between
stages through mailboxes and runs whichever stage's next action is ready. Since a stage's
results depend only on its own order, any valid interleaving gives the same numbers.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..schedules.actions import Kind, Schedule
from .stage import Stage, WindowLosses

MicroBatch = Tuple[Any, torch.Tensor, float]  # inputs, target, share of the mini-batch loss


class ScheduleStuck(RuntimeError):
    """No stage can make progress: the schedule and the data disagree."""


def check_runnable(schedule: Schedule, num_stages: int) -> None:
    """The runtimes run straight pipelines: stage k on rank k, one chain."""
    if schedule.num_ranks != num_stages or schedule.pipelines != [list(range(num_stages))]:
        raise ValueError(f"schedule {schedule.name} places several stages per rank; the runtimes "
                         f"run one stage per rank (use it with `pipeoptim schedule` to simulate)")
    if schedule.split_backward:
        raise ValueError(f"schedule {schedule.name} splits the backward; the runtimes run full backwards")


def run_schedule(stages: Sequence[Stage], schedule: Schedule, microbatches: Sequence[MicroBatch],
                 on_loss: Optional[Callable[[int, float], None]] = None,
                 trace_offset: int = 0) -> Dict[int, float]:
    """Run one schedule over ``microbatches`` (indexed as the schedule's micro-batches).

    Returns the loss of each update window (mini-batch): the sum of its micro-batches' scaled
    losses. ``on_loss(window, loss)`` is called as soon as a window's loss is complete.
    ``trace_offset`` numbers this schedule's micro-batches after earlier epochs' in the traces.
    """
    n = len(stages)
    check_runnable(schedule, n)
    m = schedule.microbatches_per_update
    for stage in stages:
        stage.policy.begin_epoch(schedule.orders[stage.index], schedule.orders)
        stage.trace_offset = trace_offset
    activations: Dict[Tuple[int, int], Any] = {}
    gradients: Dict[Tuple[int, int], Any] = {}
    window_loss = WindowLosses(m, on_loss)
    pointer = [0] * n
    remaining = sum(len(o) for o in schedule.orders)
    while remaining:
        progressed = False
        for k, stage in enumerate(stages):
            order = schedule.orders[k]
            while pointer[k] < len(order):
                action = order[pointer[k]]
                i = action.index
                if action.kind is Kind.F:
                    if stage.is_first:
                        inputs = microbatches[i][0]
                    elif (k, i) in activations:
                        inputs = activations.pop((k, i))
                    else:
                        break
                    _, target, share = microbatches[i]
                    out = stage.forward(i, inputs, target if stage.is_last else None, share)
                    if stage.is_last:
                        window_loss.add(i, out)
                    else:
                        activations[(k + 1, i)] = out
                elif action.kind is Kind.B:
                    if stage.is_last:
                        grad = None
                    elif (k, i) in gradients:
                        grad = gradients.pop((k, i))
                    else:
                        break
                    grad_in = stage.backward(i, grad)
                    if not stage.is_first:
                        gradients[(k - 1, i)] = grad_in
                elif action.kind is Kind.U:
                    stage.update()
                else:
                    raise ValueError(f"the local executor runs compute actions, not {action}")
                pointer[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            heads = [str(schedule.orders[k][pointer[k]]) for k in range(n) if pointer[k] < len(schedule.orders[k])]
            raise ScheduleStuck(f"no stage can proceed; waiting: {', '.join(heads)}")
    return window_loss
