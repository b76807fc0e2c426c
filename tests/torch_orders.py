"""torch's own orders of its multi-stage schedules (``torch.distributed.pipelining``), as the rows
of its compute-only CSV, made without a process group: each class's per-rank order is computed
from the few numbers it reads (ranks, micro-batches, stages per rank), on a stand-in for the
schedule object. Tests and the torchrun scripts read them with ``schedules.csv_io``."""
from __future__ import annotations

import types
from typing import List

#: torch's schedule classes whose orders the tests run, by the name the tests use
CLASSES = {"dualpipev": "ScheduleDualPipeV", "zbv": "ScheduleZBVZeroBubble",
           "interleaved": "ScheduleInterleaved1F1B", "interleaved-zb": "ScheduleInterleavedZeroBubble"}


def torch_rows(name: str, ranks: int, microbatches: int) -> List[List[str]]:
    """Rank r's row of torch's ``CLASSES[name]`` on ``ranks`` ranks, two stages per rank: its
    actions as torch prints them, ``""`` where torch idles a step (the idle steps that
    ``ScheduleInterleavedZeroBubble`` adds after, in its constructor, only shift actions in time)."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, CLASSES[name])
    rounds = max(1, microbatches // ranks)
    stand_in = types.SimpleNamespace(pp_group_size=ranks, _n_microbatches=microbatches, n_local_stages=2,
                                     num_stages=2 * ranks, number_of_rounds=rounds,
                                     microbatches_per_round=microbatches // rounds, rank=0)
    orders = [cls._calculate_single_rank_operations(stand_in, r) for r in range(ranks)]
    return [["" if a is None else str(a) for a in order] for order in orders]
