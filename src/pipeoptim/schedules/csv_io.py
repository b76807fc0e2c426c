"""A schedule as the "compute_only" CSV of ``torch.distributed.pipelining`` (its ``_dump_csv`` /
``_load_csv``): one row per rank, one cell per time step, an action string such as ``0F0`` or an
empty cell where the rank idles.

The time steps are those of a *unit-cost* simulation (every action, updates included, takes one
step, no transfer cost), so the CSV depends only on the schedule's orders, not on measured costs.
torch has no update action: write with ``updates=False`` for a file its ``_load_csv`` accepts, and
read such a file back with ``add_updates=True``.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from .actions import Action, Kind, Schedule
from .simulate import Costs, SimResult, simulate

PathLike = Union[str, Path]


def unit_costs(schedule: Schedule, updates: bool = True) -> Costs:
    """Costs under which every compute action takes one step (``U`` none if not ``updates``)."""
    split = schedule.split_backward  # I costs backward - weight: with a split backward, I = W = 1
    return Costs.uniform(schedule.num_stages, 1, 2 if split else 1, 1 if split else 0, update=1 if updates else 0)


def to_csv_rows(schedule_or_result: Union[Schedule, SimResult], updates: bool = True) -> List[List[str]]:
    """One row per rank, one cell per unit time step (:func:`unit_costs`, whatever costs a
    ``SimResult`` had): the action string, or ``""`` when idle; without ``updates`` no ``U``."""
    schedule = (schedule_or_result.schedule if isinstance(schedule_or_result, SimResult)
                else schedule_or_result)
    comm = next((a for order in schedule.orders for a in order if a.kind.is_comm), None)
    if comm is not None:
        raise ValueError(f"the compute_only CSV holds no communication; {schedule.name} has {comm}")
    unit = simulate(schedule, unit_costs(schedule, updates))
    rows: List[List[str]] = [[] for _ in range(schedule.num_ranks)]
    for t in unit.timeline:
        if t.action.kind is Kind.U and not updates:
            continue
        row, step = rows[t.rank], int(t.start)
        row.extend([""] * (step - len(row)))
        row.append(str(t.action))
    return rows


def write_csv(schedule_or_result: Union[Schedule, SimResult], path: PathLike, updates: bool = True) -> Path:
    """Write :func:`to_csv_rows` to ``path`` as torch's ``_dump_csv`` does; returns the path."""
    path = Path(path)
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(to_csv_rows(schedule_or_result, updates))
    return path


def _infer_pipelines(stages: Sequence[int], forwards: Dict[int, set]) -> List[List[int]]:
    """Chains of consecutive stages that forward the same micro-batches (one chain, unless the
    micro-batches change, as between the two pipelines of a bidirectional schedule)."""
    chains: List[List[int]] = []
    for s in stages:
        if chains and forwards.get(s, set()) == forwards.get(chains[-1][-1], set()):
            chains[-1].append(s)
        else:
            chains.append([s])
    return chains


def _insert_updates(orders: List[List[Action]], m: int, split: bool) -> List[List[Action]]:
    """Put ``U(s, u)`` right after the last backward of update window ``u`` of stage ``s``."""
    release = Kind.W if split else Kind.B
    result = []
    for order in orders:
        last: Dict[Tuple[int, int], int] = {}
        for pos, a in enumerate(order):
            if a.kind is release:
                last[(a.stage, a.index // m)] = pos
        after: Dict[int, List[Action]] = {}
        for (stage, u), pos in sorted(last.items()):
            after.setdefault(pos, []).append(Action(stage, Kind.U, u))
        new = []
        for pos, a in enumerate(order):
            new.append(a)
            new += after.get(pos, [])
        result.append(new)
    return result


def from_csv_rows(rows: Iterable[Sequence[str]], name: str = "csv",
                  microbatches_per_update: Optional[int] = None,
                  pipelines: Optional[List[List[int]]] = None,
                  synchronous: Optional[bool] = None,
                  add_updates: bool = False) -> Schedule:
    """A :class:`Schedule` from compute-only rows (row r = rank r, empty cells ignored).

    * stages: those found; stage s runs on the rank whose row holds it (each stage on one row);
    * ``pipelines``: by default consecutive stages that forward the same micro-batches form one
      chain (a straight pipeline ``[0..S-1]``, or the two chains of a bidirectional schedule);
    * ``microbatches_per_update`` (M): by default micro-batches / updates of stage 0, or all of
      them when the rows hold no update;
    * ``synchronous``: by default true when no forward of window u+1 runs before ``U(u)``;
    * ``add_updates``: when the rows hold no ``U`` (torch's format), insert ``U(s, u)`` after
      stage s's last backward of window u.
    """
    orders: List[List[Action]] = []
    for r, row in enumerate(rows):
        order = []
        for cell in row:
            if cell.strip():
                action = Action.parse(cell)
                if action.kind.is_comm:
                    raise ValueError(f"row {r}: {cell!r} is communication; the compute_only CSV has none")
                order.append(action)
        orders.append(order)
    stage_to_rank: Dict[int, int] = {}
    for rank, order in enumerate(orders):
        for a in order:
            if stage_to_rank.setdefault(a.stage, rank) != rank:
                raise ValueError(f"stage {a.stage} appears on rows {stage_to_rank[a.stage]} and {rank}")
    if not stage_to_rank:
        raise ValueError("the CSV holds no action")
    stages = sorted(stage_to_rank)
    if stages != list(range(len(stages))):
        raise ValueError(f"stages must be numbered 0..S-1, found {stages}")
    work = [a for order in orders for a in order if a.kind is not Kind.U]
    total = max(a.index for a in work) + 1 if work else 0
    forwards: Dict[int, set] = {}
    for a in work:
        if a.kind is Kind.F:
            forwards.setdefault(a.stage, set()).add(a.index)
    m = microbatches_per_update
    if m is None:
        updates0 = sum(1 for a in orders[stage_to_rank[0]] if a.kind is Kind.U and a.stage == 0)
        m = total // updates0 if updates0 and total % updates0 == 0 else max(total, 1)
    if add_updates and not any(a.kind is Kind.U for order in orders for a in order):
        orders = _insert_updates(orders, m, split=any(a.kind is Kind.I for a in work))
    if synchronous is None:
        synchronous = True
        for order in orders:
            done: Dict[int, int] = {}
            for a in order:
                if a.kind is Kind.U:
                    done[a.stage] = a.index + 1
                elif a.kind is Kind.F and a.index // m > done.get(a.stage, 0):
                    synchronous = False
    chains = pipelines if pipelines is not None else _infer_pipelines(stages, forwards)
    return Schedule(name, len(stages), len(orders), total, m, orders,
                    stage_to_rank=[stage_to_rank[s] for s in stages], pipelines=chains,
                    synchronous=synchronous)


def read_csv(path: PathLike, name: Optional[str] = None, microbatches_per_update: Optional[int] = None,
             pipelines: Optional[List[List[int]]] = None, synchronous: Optional[bool] = None,
             add_updates: bool = False) -> Schedule:
    """Read a compute-only CSV (ours or torch's ``_dump_csv``) into a :class:`Schedule`.

    ``name`` defaults to the file's stem; the other arguments are those of :func:`from_csv_rows`.
    """
    path = Path(path)
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return from_csv_rows(rows, name or path.stem, microbatches_per_update, pipelines, synchronous,
                         add_updates)
