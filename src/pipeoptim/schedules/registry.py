"""Schedules by name, each built from (stages, micro-batches per update, mini-batches, chunks)."""
from __future__ import annotations

from typing import Callable, Dict, Optional

from .actions import Schedule
from .async_1f1b import async_1f1b, two_bw
from .bidirectional import bidirectional, bitpipe
from .flush_1f1b import gpipe, interleaved_1f1b, one_f_one_b_flush, zb_h1
from .simulate import Costs, gc_paused
from .v_shape import dualpipev, zb_v

_BUILDERS: Dict[str, Callable[..., Schedule]] = {
    "gpipe": lambda n, m, t, v, c: gpipe(n, m, t),
    "1f1b-flush": lambda n, m, t, v, c: one_f_one_b_flush(n, m, t),
    "async-1f1b": lambda n, m, t, v, c: async_1f1b(n, t, m),
    "2bw": lambda n, m, t, v, c: two_bw(n, m, t),
    "interleaved-1f1b": lambda n, m, t, v, c: interleaved_1f1b(n, m, v, t),
    "bidirectional": lambda n, m, t, v, c: bidirectional(n, m, t, c),
    "bitpipe": lambda n, m, t, v, c: bitpipe(n, m, t, c),
    "zb-h1": lambda n, m, t, v, c: zb_h1(n, m, t),
    "zb-v": lambda n, m, t, v, c: zb_v(n, m, t),
    "dualpipev": lambda n, m, t, v, c: dualpipev(n, m, t),
}

DESCRIPTIONS: Dict[str, str] = {
    "gpipe": "all forwards, then all backwards, one update per mini-batch (GPipe)",
    "1f1b-flush": "warm-up, one forward one backward, flush, one update (DAPPLE, PipeDream-Flush)",
    "async-1f1b": "1F1B with no flush, an update after every backward (PipeDream, PipeOptim)",
    "2bw": "async 1F1B over micro-batches, an update every m >= N (PipeDream-2BW)",
    "interleaved-1f1b": "v model chunks per rank, smaller bubble (Megatron-LM)",
    "bidirectional": "two pipelines in opposite directions, two stages per rank (Chimera)",
    "bitpipe": "two V-shaped pipelines in opposite directions, four stages per rank (BitPipe)",
    "zb-h1": "1F1B with split backward, weight gradients fill the bubble (zero bubble H1)",
    "zb-v": "two chunks per rank in a V, split backward, weight gradients fill the bubble (ZB-V)",
    "dualpipev": "two chunks per rank in a V, a forward paired with another micro-batch's backward "
                 "(OVERLAP_F_B; DeepSeek's DualPipeV)",
}


def schedule_names() -> list[str]:
    return list(_BUILDERS)


def build_schedule(name: str, stages: int, microbatches: int = 1, batches: int = 1,
                   chunks: int = 2, costs: Optional[Costs] = None) -> Schedule:
    """Build the schedule ``name``. ``microbatches`` is per update (per mini-batch)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown schedule {name!r}; choose one of: {', '.join(_BUILDERS)}")
    with gc_paused():
        return _BUILDERS[name](stages, microbatches, batches, chunks, costs)
