"""The one layout function (runtime/layout.py): (method, stages or partition, chunks, processes,
replicas) -> stages, chunks per stage and replicas, the same for the Pipeline's worlds, the
launcher and its worker under a user's torchrun; and the settings no job can hold, refused with
the fix."""
from __future__ import annotations

import pytest

from pipeoptim.methods import get_method
from pipeoptim.runtime.layout import Layout, plan_layout


@pytest.mark.parametrize("method,settings,layout", [
    ("1f1b-flush", dict(stages=4), Layout(4, 1, 1)),
    ("1f1b-flush", dict(partition=[2, 2, 1]), Layout(3, 1, 1)),
    ("interleaved", dict(partition=[1, 1, 1, 1]), Layout(2, 2, 1)),       # 4 pieces, 2 per stage
    ("interleaved", dict(partition=[1] * 6, chunks=3), Layout(2, 3, 1)),
    ("zb-v", dict(stages=2), Layout(2, 2, 1)),
    ("pipeoptim", dict(), Layout(None, 1, 1)),                           # one process: the partitioner decides
    ("pipeoptim", dict(data_parallel=2, stages=2), Layout(2, 1, 2)),     # what a launcher would start
    ("sequential", dict(stages=4), Layout(1, 1, 1)),
    # in a torchrun job of 4 processes
    ("pipeoptim", dict(processes=4), Layout(4, 1, 1)),                   # one stage per process
    ("pipeoptim", dict(processes=4, stages=2), Layout(2, 1, 2)),         # 2 stages x 2 replicas
    ("pipeoptim", dict(processes=4, data_parallel=2), Layout(2, 1, 2)),
    ("zb-v", dict(processes=2, partition=[1, 1, 1, 1]), Layout(2, 2, 1)),
    ("sequential", dict(processes=2), Layout(1, 1, 2)),
])
def test_the_layout_of_each_setting(method, settings, layout):
    assert plan_layout(get_method(method), **settings) == layout
    if layout.ranks is not None:
        assert layout.processes == layout.ranks * layout.replicas


@pytest.mark.parametrize("method,settings,message", [
    ("pipeoptim", dict(processes=2, stages=3), "WORLD_SIZE 2 is not a multiple of the 3 stages: start N x D"),
    ("pipeoptim", dict(processes=4, stages=2, data_parallel=3),
     "data_parallel=3, but WORLD_SIZE 4 with 2 stages makes 2 replicas; start 6 processes or drop data_parallel"),
    ("interleaved", dict(partition=[1, 1, 1], chunks=2), "a partition for 2 chunks per stage lists stages x 2"),
    ("interleaved", dict(partition=[1, 1, 1, 1], stages=4), r"stages=4 but partition=\[1, 1, 1, 1\] makes 2 "
                                                            r"stages of 2 chunks: drop one of them"),
    ("pipeoptim", dict(chunks=2), "pipeoptim runs one chunk per stage; chunks=2 needs"),
    ("zb-v", dict(chunks=3), "zb-v places exactly 2 chunks per stage"),
    ("pipeoptim", dict(data_parallel=0), "data_parallel must be at least 1"),
    ("pipeoptim", dict(stages=0), "stages must be at least 1"),
])
def test_a_layout_no_job_can_hold_is_refused_with_the_fix(method, settings, message):
    with pytest.raises(ValueError, match=message):
        plan_layout(get_method(method), **settings)


def test_the_number_of_stages_is_needed_to_count_processes():
    with pytest.raises(ValueError, match="give stages=N or partition$"):
        Layout(None).processes
