"""Cross-action dependencies: what must finish before an action may start.

The same rules serve the simulator, the greedy generators and the executors' checks:

* ``F(s, i)`` needs the previous stage's ``F(s-1, i)`` (its activation);
* ``B(s, i)`` / ``I(s, i)`` need ``F(s, i)`` and the next stage's backward of ``i`` (its gradient);
* ``W(s, i)`` needs ``I(s, i)``;
* ``U(s, u)`` needs every backward of stage s in update window u.

Order within a rank is implied by the rank's list and is not a dependency here. Dependencies
come back as plain ``(stage, kind, index)`` tuples, which hash and compare equal to the
:class:`~.actions.Action` they name (the simulator builds hundreds of thousands of them).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from .actions import Action, Kind

_F, _B, _I, _W, _U = Kind.F, Kind.B, Kind.I, Kind.W, Kind.U
Dep = Tuple[int, Kind, int]


def schedule_dependencies(schedule) -> Callable[[Action], List[Dep]]:
    """The dependency function of one schedule."""
    split = schedule.split_backward
    backward_kind = _I if split else _B
    last_backward = _W if split else _B
    m = schedule.microbatches_per_update
    prev = [schedule.prev_stage(s) for s in range(schedule.num_stages)]
    nxt = [schedule.next_stage(s) for s in range(schedule.num_stages)]
    runs = None
    if len(schedule.pipelines) > 1:  # two pipelines split the micro-batches between them
        runs = {(a.stage, a.index) for order in schedule.orders for a in order if a.kind is _F}

    def dependencies(action: Action) -> List[Dep]:
        s, kind, i = action
        if kind is _F:
            p = prev[s]
            return [] if p is None else [(p, _F, i)]
        if kind is _B or kind is _I:
            n = nxt[s]
            return [(s, _F, i)] if n is None else [(s, _F, i), (n, backward_kind, i)]
        if kind is _W:
            return [(s, _I, i)]
        if kind is _U:
            return [(s, last_backward, j) for j in range(i * m, (i + 1) * m)
                    if runs is None or (s, j) in runs]
        raise ValueError(f"no dependency rule for {action} (simulate before lowering communication)")

    return dependencies
