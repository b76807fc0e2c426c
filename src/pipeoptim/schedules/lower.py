"""Lowering: add the communication a compute-only schedule implies.

``RECV_F``/``SEND_F`` around a forward, ``RECV_B``/``SEND_B`` around a backward (or its half
``I``) and ``RECV_E``/``SEND_E`` around a forward-only ``E`` whose neighbour lives on another
rank (docs/architecture.md, "Schedules as data"). A forward paired with a backward
(``Schedule.pairs``, torch's ``OVERLAP_F_B``) gets both receives before the pair and both sends
after it, as torch lowers one: the two may then run at once. Sends are non-blocking in the
distributed executor, so this order never deadlocks where the compute-only order (pairs taken
whole, as the simulator takes them) does not."""
from __future__ import annotations

from dataclasses import replace
from typing import List

from .actions import Action, Kind, Schedule


def lower(schedule: Schedule) -> Schedule:
    """A copy of ``schedule`` with SEND/RECV actions around every cross-rank dependency."""
    if any(a.kind.is_comm for order in schedule.orders for a in order):
        raise ValueError(f"{schedule.name} is already lowered")
    rank_of = schedule.stage_to_rank
    # per stage: whether its previous / next stage lives on another rank (asked once, not per action)
    remote_prev, remote_next = {}, {}
    for stage, rank in enumerate(rank_of):
        prev, nxt = schedule.prev_stage(stage), schedule.next_stage(stage)
        remote_prev[stage] = prev is not None and rank_of[prev] != rank
        remote_next[stage] = nxt is not None and rank_of[nxt] != rank
    F, E, B, I = Kind.F, Kind.E, Kind.B, Kind.I
    pairs = schedule.pairs

    def around(a: Action):
        """The receive before ``a`` and the send after it (None where it needs none)."""
        kind, k = a.kind, a.stage
        if kind is F or kind is E:
            recv, send = (Kind.RECV_F, Kind.SEND_F) if kind is F else (Kind.RECV_E, Kind.SEND_E)
            return (Action(k, recv, a.index) if remote_prev[k] else None,
                    Action(k, send, a.index) if remote_next[k] else None)
        if kind is B or kind is I:
            return (Action(k, Kind.RECV_B, a.index) if remote_next[k] else None,
                    Action(k, Kind.SEND_B, a.index) if remote_prev[k] else None)
        return None, None

    orders: List[List[Action]] = []
    for order in schedule.orders:
        lowered: List[Action] = []
        add = lowered.append
        held = None  # a paired forward, lowered with its backward
        for a in order:
            if held is not None:
                if a != pairs[held]:
                    raise ValueError(f"{schedule.name}: {held} is paired with {pairs[held]}, "
                                     f"which must come right after it; {a} does")
                recvs, sends = zip(around(held), around(a))
                lowered += [c for c in recvs if c is not None] + [held, a] + [c for c in sends if c is not None]
                held = None
                continue
            if pairs and a in pairs:
                held = a
                continue
            kind, k = a.kind, a.stage  # around(a), inline: lowering a long order is per action
            if kind is F or kind is E:
                recv, send = (Kind.RECV_F, Kind.SEND_F) if kind is F else (Kind.RECV_E, Kind.SEND_E)
                if remote_prev[k]:
                    add(Action(k, recv, a.index))
                add(a)
                if remote_next[k]:
                    add(Action(k, send, a.index))
            elif kind is B or kind is I:
                if remote_next[k]:
                    add(Action(k, Kind.RECV_B, a.index))
                add(a)
                if remote_prev[k]:
                    add(Action(k, Kind.SEND_B, a.index))
            else:
                add(a)
        if held is not None:
            raise ValueError(f"{schedule.name}: {held} is paired with {pairs[held]}, which its rank never runs")
        orders.append(lowered)
    return replace(schedule, orders=orders)
