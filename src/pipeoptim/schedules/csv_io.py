"""A schedule as the "compute_only" CSV of ``torch.distributed.pipelining`` (its ``_dump_csv`` /
``_load_csv``): one row per rank, one cell per time step, an action string such as ``0F0`` or an
empty cell where the rank idles.

The time steps are those of a *unit-cost* simulation (every action, updates included, takes one
step, no transfer cost), so the CSV depends only on the schedule's orders, not on measured costs.
torch has no update action: write with ``updates=False`` for a file its ``_load_csv`` accepts, and
read such a file back with ``add_updates=True``.

The cells follow torch's action grammar (``_Action.from_str``): ``2F5``, ``1B0``, ``0I3``,
``0W3``, and a forward paired with another micro-batch's backward on the same rank,
``(0F7;7B3)OVERLAP_F_B`` (``Schedule.pairs``): one cell at the pair's start, the backward's
steps left empty. Communication (``SEND_F`` ...) and torch's FSDP actions (``UNSHARD``,
``RESHARD``, ``REDUCE_GRAD``) are refused: the runtime adds the one by lowering and does the
other itself (``shard_replicas``).
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from .actions import Action, Kind, Schedule
from .simulate import Costs, SimResult, simulate

PathLike = Union[str, Path]
OVERLAP = "OVERLAP_F_B"  #: torch's name of a forward and a backward run together
#: torch's actions that the runtime does by itself, and why they are not in a schedule here
_TORCH_ONLY = {"UNSHARD": "gathers a sharded stage's parameters", "RESHARD": "frees them again",
               "REDUCE_GRAD": "reduces the gradients over replicas"}


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
    paired = set(schedule.pairs.values())
    for t in unit.timeline:
        if (t.action.kind is Kind.U and not updates) or t.action in paired:
            continue
        row, step = rows[t.rank], int(t.start)
        row.extend([""] * (step - len(row)))
        partner = schedule.pair_of(t.action)
        row.append(str(t.action) if partner is None else f"({t.action};{partner}){OVERLAP}")
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


def _insert_updates(orders: List[List[Action]], m: int) -> List[List[Action]]:
    """Put ``U(s, u)`` right after the last backward of update window ``u`` of stage ``s``."""
    result = []
    for order in orders:
        last: Dict[Tuple[int, int], int] = {}
        for pos, a in enumerate(order):
            if a.kind is Kind.W or a.kind is Kind.B:  # a micro-batch's last backward (B or W)
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
    pairs: Dict[Action, Action] = {}
    for r, row in enumerate(rows):
        order = []
        for cell in row:
            if cell.strip():
                parsed = parse_cell(cell, r)
                if len(parsed) == 2:
                    pairs[parsed[0]] = parsed[1]
                order += parsed
        orders.append(order)
    stage_to_rank: Dict[int, int] = {}
    for rank, order in enumerate(orders):
        for a in order:
            if stage_to_rank.setdefault(a.stage, rank) != rank:
                raise ValueError(f"{a}: stage {a.stage} appears on rows {stage_to_rank[a.stage]} and {rank}; "
                                 f"a stage's actions go on one row (one rank)")
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
        orders = _insert_updates(orders, m)
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
                    synchronous=synchronous, pairs=pairs)


def parse_cell(cell: str, row: int = 0) -> List[Action]:
    """The actions of one cell: one, or a pair ``(F;B)OVERLAP_F_B`` (its forward, then its backward)."""
    text = cell.strip()
    if text.startswith("("):
        inner, close, kind = text[1:].partition(")")
        parts = [p.strip() for p in inner.split(";") if p.strip()]
        if not close or kind != OVERLAP or len(parts) != 2:
            raise ValueError(f"row {row}: {cell!r} is not an action: a pair reads '(0F7;7B3){OVERLAP}', "
                             f"a forward and a backward")
        forward, backward = (_one(p, row) for p in parts)
        if forward.kind is not Kind.F or backward.kind not in (Kind.B, Kind.I):
            raise ValueError(f"row {row}: {cell!r} must pair a forward with a backward (B or I) of "
                             f"another micro-batch, the forward first, e.g. '(0F7;7B3){OVERLAP}'")
        return [forward, backward]
    return [_one(text, row)]


def _one(text: str, row: int) -> Action:
    head = text.lstrip("0123456789")
    for name, does in _TORCH_ONLY.items():
        if head.startswith(name):
            raise ValueError(f"row {row}: {text!r} is torch's FSDP action; the runtime {does} by itself "
                             f"(data_parallel, shard_replicas=True): remove it from the schedule")
    action = Action.parse(text)
    if action.kind.is_comm:
        raise ValueError(f"row {row}: {text!r} is communication; the compute_only CSV has none "
                         f"(the runtime adds it)")
    return action


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
