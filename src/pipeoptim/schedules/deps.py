"""Cross-action dependencies: what must finish before an action may start.

The same rules serve the simulator, the greedy generators and the executors' checks:

* ``F(s, i)`` needs the previous stage's ``F(s-1, i)`` (its activation);
* ``B(s, i)`` / ``I(s, i)`` need ``F(s, i)`` and the next stage's backward of ``i`` (its gradient);
* ``W(s, i)`` needs ``I(s, i)``;
* ``U(s, u)`` needs every backward of stage s in update window u;
* ``E(s, j)`` (forward only, evaluation micro-batch j) needs the previous stage's ``E(s-1, j)``.

A schedule that splits some backwards may run others whole (torch's DualPipeV): there a ``B(s, i)``
counts as both ``I(s, i)`` and ``W(s, i)`` for whatever waits on them (the simulator records it so).

Order within a rank is implied by the rank's list and is not a dependency here. Dependencies
come back as plain ``(stage, kind, index)`` tuples, which hash and compare equal to the
:class:`~.actions.Action` they name; the simulator reads :func:`dependency_rules`' tables directly.
"""
from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Set, Tuple

from .actions import Action, Kind

_F, _B, _I, _W, _U, _E = Kind.F, Kind.B, Kind.I, Kind.W, Kind.U, Kind.E
Dep = Tuple[int, Kind, int]


class DependencyRules(NamedTuple):
    """The dependency rules of one schedule, as tables.

    ``same_index[kind][stage]`` lists the ``(stage, kind)`` pairs whose action with the *same
    index* must finish before ``(stage, kind, index)`` may start, in the order they are checked.
    It holds F, B, I, W and E, and U where every update window is the one micro-batch ``u``. Else
    ``U(s, u)`` needs ``(s, window_kind, j)`` for each ``j`` of ``window(s, u)``.
    """

    same_index: Dict[Kind, List[List[Tuple[int, Kind]]]]
    window_kind: Kind                   #: the last backward of a micro-batch (B, or W when split)
    microbatches_per_update: int
    runs: Optional[Set[Tuple[int, int]]]  #: (stage, micro-batch) pairs that run; None: all of them

    def window(self, stage: int, update: int) -> List[int]:
        """The micro-batches whose backward at ``stage`` update ``update`` waits for."""
        m, runs = self.microbatches_per_update, self.runs
        return [j for j in range(update * m, (update + 1) * m) if runs is None or (stage, j) in runs]


def dependency_rules(schedule, split: Optional[bool] = None) -> DependencyRules:
    """The rules of ``schedule``; ``split`` (whether backwards are split into I and W) is read off
    the schedule when not given."""
    if split is None:
        split = schedule.split_backward
    backward_kind = _I if split else _B
    stages = range(schedule.num_stages)
    prev = [schedule.prev_stage(s) for s in stages]
    nxt = [schedule.next_stage(s) for s in stages]
    same_index = {
        _F: [[] if prev[s] is None else [(prev[s], _F)] for s in stages],
        _B: [[(s, _F)] if nxt[s] is None else [(s, _F), (nxt[s], backward_kind)] for s in stages],
        _W: [[(s, _I)] for s in stages],
        _E: [[] if prev[s] is None else [(prev[s], _E)] for s in stages],
    }
    same_index[_I] = same_index[_B]
    window_kind, m = _W if split else _B, schedule.microbatches_per_update
    runs = None
    if len(schedule.pipelines) > 1:  # two pipelines split the micro-batches between them
        runs = {(a.stage, a.index) for order in schedule.orders for a in order if a.kind is _F}
    elif m == 1:  # U(s, u) needs the last backward of micro-batch u: no window to walk
        same_index[_U] = [[(s, window_kind)] for s in stages]
    return DependencyRules(same_index, window_kind, m, runs)


def schedule_dependencies(schedule) -> Callable[[Action], List[Dep]]:
    """The dependency function of one schedule."""
    rules = dependency_rules(schedule)
    same_index, window_kind = rules.same_index, rules.window_kind

    def dependencies(action: Action) -> List[Dep]:
        s, kind, i = action
        per_stage = same_index.get(kind)
        if per_stage is not None:
            return [(stage, k, i) for stage, k in per_stage[s]]
        if kind is _U:
            return [(s, window_kind, j) for j in rules.window(s, i)]
        raise ValueError(f"no dependency rule for {action} (simulate before lowering communication)")

    return dependencies
