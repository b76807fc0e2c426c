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
    # per stage: whether its previous / next stage lives on another rank (asked once, not per action)
    remote_prev, remote_next = {}, {}
    for stage, rank in enumerate(rank_of):
        prev, nxt = schedule.prev_stage(stage), schedule.next_stage(stage)
        remote_prev[stage] = prev is not None and rank_of[prev] != rank
        remote_next[stage] = nxt is not None and rank_of[nxt] != rank
    F, E = Kind.F, Kind.E
    orders: List[List[Action]] = []
    for order in schedule.orders:
        lowered: List[Action] = []
        add = lowered.append
        for a in order:
            kind, k = a.kind, a.stage
            if kind is F or kind is E:
                recv, send = (Kind.RECV_F, Kind.SEND_F) if kind is F else (Kind.RECV_E, Kind.SEND_E)
                if remote_prev[k]:
                    add(Action(k, recv, a.index))
                add(a)
                if remote_next[k]:
                    add(Action(k, send, a.index))
            elif kind is grad_kind:
                if remote_next[k]:
                    add(Action(k, Kind.RECV_B, a.index))
                add(a)
                if remote_prev[k]:
                    add(Action(k, Kind.SEND_B, a.index))
            else:
                add(a)
        orders.append(lowered)
    return replace(schedule, orders=orders)
