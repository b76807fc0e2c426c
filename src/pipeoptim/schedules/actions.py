"""The action representation shared by every schedule, the simulator, the renderers and the executors.

A schedule is data: for each rank, an ordered list of :class:`Action` (stage, kind, index;
docs/architecture.md, "Schedules as data"). For compute and communication actions the index is
the micro-batch, counted across the whole schedule ("Glossary"); for an update ``U`` the
update's number at that stage; for a forward-only ``E`` the evaluation micro-batch's number.

Actions print compactly, as in ``torch.distributed.pipelining``: ``2F5`` is stage 2's forward of
micro-batch 5, ``0U3`` stage 0's fourth update, ``1SEND_F4`` the send of 4's activation."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from itertools import repeat
from operator import attrgetter
from typing import Dict, Iterable, List, NamedTuple, Optional


class Kind(str, Enum):
    """What an action does."""

    F = "F"  #: forward of a micro-batch
    B = "B"  #: full backward (input and weight gradients)
    I = "I"  #: backward for the input gradient only (zero-bubble split)  # noqa: E741
    W = "W"  #: backward for the weight gradient only (zero-bubble split)
    U = "U"  #: optimizer update of the stage
    #: forward-only pass of an evaluation micro-batch (its own numbering), on the weights the
    #: stage holds then; nothing of training depends on it (``schedules/fill.py``)
    E = "E"
    SEND_F = "SEND_F"  #: send an activation to the next stage
    RECV_F = "RECV_F"  #: receive an activation from the previous stage
    SEND_B = "SEND_B"  #: send an input gradient to the previous stage
    RECV_B = "RECV_B"  #: receive an output gradient from the next stage
    SEND_E = "SEND_E"  #: send a forward-only (evaluation) activation to the next stage
    RECV_E = "RECV_E"  #: receive a forward-only (evaluation) activation from the previous stage

    # The simulator hashes millions of actions: use str's C-level hash, not Enum's Python one.
    __hash__ = str.__hash__

    def __str__(self) -> str:  # "F", not "Kind.F"
        return self.value

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return not self.is_compute


COMPUTE_KINDS = (Kind.F, Kind.B, Kind.I, Kind.W, Kind.U, Kind.E)
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|SEND_E|RECV_E|F|B|I|W|U|E)(\d+)$")


class Action(NamedTuple):
    """One unit of work of one stage (a named tuple: cheap to hash, compare and sort)."""

    stage: int
    kind: Kind
    index: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.index}"

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Parse the compact form, e.g. ``"2F5"`` or ``"1SEND_B0"``."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(f"not an action: {text!r} (expected e.g. '2F5', '0U3', '1SEND_F4')")
        stage, kind, index = match.groups()
        return cls(int(stage), Kind(kind), int(index))


def actions_of(stage: int, kind: Kind, indices: Iterable[int]) -> List[Action]:
    """``[Action(stage, kind, i) for i in indices]``, built without a Python call per action.

    A NamedTuple's generated ``__new__`` is a Python function; ``tuple.__new__(Action, triple)``
    builds the same Action in C, which is what generating 10^5 actions mostly costs.
    """
    return list(map(tuple.__new__, repeat(Action), zip(repeat(stage), repeat(kind), indices)))


@dataclass
class Schedule:
    """Ordered actions per rank, plus what is needed to interpret them.

    ``pipelines`` lists the chains of model stages that activations flow through: one chain
    ``[0, 1, ..., N-1]`` for a straight pipeline, ``[0..N*V-1]`` for interleaved chunks, two
    chains for a bidirectional schedule. ``microbatches_per_update`` (M) is how many micro-batches
    a stage accumulates before one update ``U``. ``synchronous`` is true when every forward of
    an update window runs on the same weights (a flush before each update). ``pairs`` maps a
    forward to the backward of another micro-batch that its rank runs together with it, right
    after it in its order (torch's ``OVERLAP_F_B``; ``schedules/v_shape.py``): both start once
    the inputs of both are there.
    """

    name: str
    num_stages: int
    num_ranks: int
    num_microbatches: int
    microbatches_per_update: int
    orders: List[List[Action]]
    stage_to_rank: List[int]
    pipelines: List[List[int]]
    synchronous: bool
    options: Dict[str, object] = field(default_factory=dict)
    pairs: Dict[Action, Action] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.orders) != self.num_ranks:
            raise ValueError(f"{self.name}: {len(self.orders)} rank orders for {self.num_ranks} ranks")
        self._prev: Dict[int, Optional[int]] = {}
        self._next: Dict[int, Optional[int]] = {}
        for chain in self.pipelines:
            for pos, stage in enumerate(chain):
                self._prev[stage] = chain[pos - 1] if pos > 0 else None
                self._next[stage] = chain[pos + 1] if pos + 1 < len(chain) else None

    # -- structure -------------------------------------------------------------------------
    def prev_stage(self, stage: int) -> Optional[int]:
        """The stage whose output feeds ``stage`` (None for a pipeline's first stage)."""
        return self._prev[stage]

    def next_stage(self, stage: int) -> Optional[int]:
        """The stage that consumes ``stage``'s output (None for a pipeline's last stage)."""
        return self._next[stage]

    def stages_of_rank(self, rank: int) -> List[int]:
        return [s for s in range(self.num_stages) if self.stage_to_rank[s] == rank]

    def stage_actions(self, stage: int) -> List[Action]:
        """The actions of one model stage, in the order its rank runs them."""
        return [a for a in self.orders[self.stage_to_rank[stage]] if a.stage == stage]

    @property
    def num_updates(self) -> int:
        return self.num_microbatches // self.microbatches_per_update

    @property
    def split_backward(self) -> bool:
        """Whether backwards are split into I and W (some at least: a schedule may mix them, as
        torch's DualPipeV does; a ``B`` there stands for both halves of its micro-batch). (Sets of
        kinds are built in C: a Python loop over the actions of a large schedule costs more than
        simulating it.)"""
        return any(Kind.I in set(map(attrgetter("kind"), order)) for order in self.orders)

    def pair_of(self, action: Action) -> Optional[Action]:
        """The backward run together with forward ``action`` (None: it runs alone)."""
        return self.pairs.get(action) if self.pairs else None

    def update_window(self, update: int) -> range:
        """The micro-batches whose gradients update number ``update`` applies."""
        m = self.microbatches_per_update
        return range(update * m, (update + 1) * m)

    def __str__(self) -> str:
        lines = [f"{self.name}: {self.num_stages} stages on {self.num_ranks} ranks, "
                 f"{self.num_microbatches} micro-batches, update every {self.microbatches_per_update}"]
        for rank, order in enumerate(self.orders):
            lines.append(f"  rank {rank}: " + " ".join(str(a) for a in order))
        return "\n".join(lines)


def straight(num_stages: int) -> Dict[str, object]:
    """Placement of a straight pipeline: stage k on rank k."""
    return {"stage_to_rank": list(range(num_stages)), "pipelines": [list(range(num_stages))]}


def one_f_one_b(forwards: List[Action], backwards: List[List[Action]], warmup: int) -> List[Action]:
    """1F1B's order: ``warmup`` forwards, then each further forward followed by the oldest backward
    step not run yet, then the steps left. A step is a backward and what runs right after it."""
    order = forwards[:warmup]
    for forward, step in zip(forwards[warmup:], backwards):
        order.append(forward)
        order += step
    for step in backwards[len(forwards) - warmup:]:
        order += step
    return order


def check_positive(**values: int) -> None:
    """Raise a ValueError naming the first argument that is not a positive integer."""
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
