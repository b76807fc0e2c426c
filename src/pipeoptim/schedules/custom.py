"""A user's own schedule (``Pipeline(schedule=...)``): read, and checked before any work.

It is a :class:`~.actions.Schedule` of one mini-batch, or a path to torch's compute-only CSV
(``csv_io``; its updates added after each stage's last backward). :func:`check_order` refuses,
naming the action, what the runtime could not run: actions of a stage on two ranks,
communication, a micro-batch without its forward or backward (or with one twice), a backward
before its forward or a weight half before its input half on the rank's list, a pair that is not
a forward followed by an independent backward, and any order the simulator finds deadlocked
(pairs taken whole). The method then repeats it once per mini-batch (``concat.repeat``)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Dict, Tuple, Union

from .actions import Action, Kind, Schedule
from .csv_io import read_csv
from .simulate import DeadlockError, simulate

_F, _B, _I, _W, _U = Kind.F, Kind.B, Kind.I, Kind.W, Kind.U


def load_order(given: Union[Schedule, str, Path]) -> Schedule:
    """``given``, or the schedule its CSV file holds, checked (:func:`check_order`)."""
    if isinstance(given, Schedule):
        schedule = given
    elif isinstance(given, (str, Path)):
        path = Path(given)
        if not path.is_file():
            raise ValueError(f"schedule={str(given)!r}: no such file; give a Schedule or the path of "
                             f"torch's compute-only CSV (one row per rank)")
        schedule = read_csv(path, add_updates=True)
    else:
        raise ValueError(f"schedule must be a pipeoptim.schedules.Schedule or the path of a compute-only "
                         f"CSV, got {type(given).__name__}")
    check_order(schedule)
    return schedule


def check_order(schedule: Schedule) -> None:
    """Raise ValueError, naming the action and the fix, where ``schedule`` cannot be run as one
    mini-batch's order by a synchronous method."""
    name = f"schedule {schedule.name}"
    if schedule.pipelines != [list(range(schedule.num_stages))]:
        raise ValueError(f"{name} runs the chains {schedule.pipelines}; a schedule here is one chain of "
                         f"stages 0..{schedule.num_stages - 1} (two pipelines: method='bidirectional')")
    per_rank = Counter(schedule.stage_to_rank)
    if set(per_rank.values()) != {schedule.num_stages // schedule.num_ranks} or \
            sorted(per_rank) != list(range(schedule.num_ranks)):
        raise ValueError(f"{name} places stages on ranks {schedule.stage_to_rank}: every rank must hold "
                         f"the same number of stages")
    if schedule.num_updates != 1 or schedule.num_microbatches != schedule.microbatches_per_update:
        raise ValueError(f"{name} holds {schedule.num_microbatches} micro-batches in updates of "
                         f"{schedule.microbatches_per_update}; give one mini-batch's schedule (one update "
                         f"per stage), which runs once per mini-batch")
    seen: Counter = Counter()
    for rank, order in enumerate(schedule.orders):
        done: Dict[Tuple[int, Kind], set] = {}
        for a in order:
            if a.kind.is_comm:
                raise ValueError(f"{name}: {a} is communication; give compute actions only (the runtime "
                                 f"adds the transfers)")
            if schedule.stage_to_rank[a.stage] != rank:
                raise ValueError(f"{name}: {a} is on rank {rank}, stage {a.stage} on rank "
                                 f"{schedule.stage_to_rank[a.stage]}: a stage's actions go on one rank")
            if a.kind in (_B, _I) and a.index not in done.get((a.stage, _F), ()):
                raise ValueError(f"{name}: rank {rank} runs {a} before {Action(a.stage, _F, a.index)}: "
                                 f"put every backward after its forward")
            if a.kind is _W and a.index not in done.get((a.stage, _I), ()):
                raise ValueError(f"{name}: rank {rank} runs {a} before {Action(a.stage, _I, a.index)}: "
                                 f"put a weight half after its input half")
            done.setdefault((a.stage, a.kind), set()).add(a.index)
            seen[a] += 1
    twice = [a for a, count in seen.items() if count > 1]
    if twice:
        raise ValueError(f"{name}: {twice[0]} appears twice")
    for stage in range(schedule.num_stages):
        for i in range(schedule.num_microbatches):
            _check_passes(name, seen, stage, i)
        if Action(stage, _U, 0) not in seen:
            raise ValueError(f"{name}: stage {stage} has no update {Action(stage, _U, 0)}: add one after its "
                             f"last backward (read torch's CSV with add_updates)")
    _check_pairs(name, schedule)
    try:
        simulate(schedule)
    except DeadlockError as e:
        raise ValueError(f"{name} cannot run: {e}") from None


def _check_passes(name: str, seen: Counter, stage: int, i: int) -> None:
    """Micro-batch ``i`` at ``stage``: one forward, and one backward (whole, or its two halves)."""
    forward = Action(stage, _F, i)
    if forward not in seen:
        raise ValueError(f"{name}: no {forward}; every micro-batch 0..M-1 needs a forward on every stage")
    whole, halves = Action(stage, _B, i) in seen, (Action(stage, _I, i) in seen, Action(stage, _W, i) in seen)
    if whole and any(halves):
        raise ValueError(f"{name}: {Action(stage, _B, i)} and its halves {Action(stage, _I, i)}/"
                         f"{Action(stage, _W, i)} both appear: keep one")
    if not whole and halves != (True, True):
        missing = Action(stage, _B, i) if not any(halves) else Action(stage, _W if halves[0] else _I, i)
        raise ValueError(f"{name}: no {missing}; every forward needs its backward ({Action(stage, _B, i)}, "
                         f"or {Action(stage, _I, i)} and {Action(stage, _W, i)})")


def _check_pairs(name: str, schedule: Schedule) -> None:
    """Each pair: a forward, right after it on its rank the backward of another micro-batch or stage."""
    for rank, order in enumerate(schedule.orders):
        at = {a: p for p, a in enumerate(order)}
        for f, b in schedule.pairs.items():
            if f not in at:
                continue
            if f.kind is not _F or b.kind not in (_B, _I):
                raise ValueError(f"{name}: the pair ({f};{b}) must be a forward and a backward")
            if at.get(b) != at[f] + 1:
                raise ValueError(f"{name}: the pair ({f};{b}) must run on one rank, the backward right "
                                 f"after the forward")
            if (f.stage, f.index) == (b.stage, b.index):
                raise ValueError(f"{name}: the pair ({f};{b}) runs a micro-batch's backward with its own "
                                 f"forward; pair passes of two micro-batches")
