"""Lowering: add the communication a compute-only schedule implies.

``RECV_F``/``SEND_F`` around a forward, ``RECV_B``/``SEND_B`` around a backward (or its half
``I``) and ``RECV_E``/``SEND_E`` around a forward-only ``E`` whose neighbour lives on another
rank (docs/architecture.md, "Schedules as data"). Sends
are non-blocking in the distributed executor, so this order never deadlocks where the
compute-only order does not."""
from __future__ import annotations

from dataclasses import replace
from typing import List

from .actions import Action, Kind, Schedule


def lower(schedule: Schedule) -> Schedule:
    """A copy of ``schedule`` with SEND/RECV actions around every cross-rank dependency."""
    if any(a.kind.is_comm for order in schedule.orders for a in order):
        raise ValueError(f"{schedule.name} is already lowered")
    rank_of = schedule.stage_to_rank
    grad_kind = Kind.I if schedule.split_backward else Kind.B
    orders: List[List[Action]] = []
    for rank, order in enumerate(schedule.orders):
        lowered: List[Action] = []
        for a in order:
            prev, nxt = (schedule.prev_stage(a.stage), schedule.next_stage(a.stage)) \
                if a.kind is not Kind.U else (None, None)
            remote_prev = prev is not None and rank_of[prev] != rank
            remote_next = nxt is not None and rank_of[nxt] != rank
            if a.kind is Kind.F or a.kind is Kind.E:
                recv, send = (Kind.RECV_F, Kind.SEND_F) if a.kind is Kind.F else (Kind.RECV_E, Kind.SEND_E)
                if remote_prev:
                    lowered.append(Action(a.stage, recv, a.index))
                lowered.append(a)
                if remote_next:
                    lowered.append(Action(a.stage, send, a.index))
            elif a.kind is grad_kind:
                if remote_next:
                    lowered.append(Action(a.stage, Kind.RECV_B, a.index))
                lowered.append(a)
                if remote_prev:
                    lowered.append(Action(a.stage, Kind.SEND_B, a.index))
            else:
                lowered.append(a)
        orders.append(lowered)
    return replace(schedule, orders=orders)
