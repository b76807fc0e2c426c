"""The arithmetic of benchmarks/profile_stage.py and benchmarks/link_threads.py on given numbers
(no profile, no processes): which part of a stage's work a profiled function's own time is,
the side-by-side table, and per-thread counts per mini-batch."""
from __future__ import annotations

import pytest

from conftest import load_benchmark


@pytest.fixture(scope="module")
def prof():
    return load_benchmark("profile_stage")


def test_each_function_falls_in_one_part(prof):
    site = "/x/lib/python3.11/site-packages/torch"
    cases = {
        ("/x/src/pipeoptim/runtime/link.py", 1, "recv"): "our runtime (Python)",
        (f"{site}/distributed/pipelining/schedules.py", 1, "step"): "torch pipelining (Python)",
        (f"{site}/distributed/distributed_c10d.py", 1, "isend"): "communication (Python, posting)",
        ("~", 0, "<built-in method torch._C._distributed_c10d.wait>"): "communication waits",
        ("~", 0, "<method 'wait' of 'torch._C._distributed_c10d.Work' objects>"): "communication waits",
        ("~", 0, "<built-in method torch._C._distributed_c10d.send>"): "communication (Python, posting)",
        ("~", 0, "<method 'run_backward' of 'torch._C._EngineBase' objects>"): "compute",
        ("~", 0, "<built-in method torch._C._nn.linear>"): "compute",
        (f"{site}/nn/modules/linear.py", 1, "forward"): "compute",
        ("~", 0, "<method 'append' of 'list' objects>"): "other",
        ("/usr/lib/python3.11/contextlib.py", 1, "__exit__"): "other",
    }
    for key, part in cases.items():
        assert prof.part_of(key) == part, key
    assert set(cases.values()) == set(prof.PARTS)


class FakeStats:
    """What pstats.Stats keeps: key -> (primitive calls, calls, tottime, cumtime, callers)."""

    def __init__(self, entries):
        self.stats = {key: (n, n, t, t, {}) for key, (n, t) in entries.items()}


def test_parts_and_calls_per_mini_batch(prof):
    stats = FakeStats({("/a/pipeoptim/runtime/stage.py", 10, "forward"): (8, 0.004),
                       ("~", 0, "<built-in method torch._C._nn.linear>"): (32, 0.016)})
    parts = prof.parts(stats, per=4)
    assert parts["our runtime (Python)"] == pytest.approx(1.0) and parts["compute"] == pytest.approx(4.0)
    assert parts["total"] == pytest.approx(5.0)
    calls = prof.calls(stats, per=4)
    assert calls["runtime/stage.py:10(forward)"] == pytest.approx((2.0, 500.0, "our runtime (Python)"))
    assert calls["<built-in method torch._C._nn.linear>"][:2] == pytest.approx((8.0, 500.0))


def test_side_by_side_ranks_the_functions_by_the_own_time_their_difference_costs(prof):
    def rank(parts_ms, calls):
        return {"parts": {**dict.fromkeys(prof.PARTS, 0.0), **parts_ms, "total": sum(parts_ms.values())},
                "calls": calls, "gc": {"ms_per_batch": 0.0, "collections_per_batch": [0.0, 0.0, 0.0]}}
    ours = [rank({"compute": 10.0}, {"a": (4.0, 100.0, "compute"), "b": (1.0, 10.0, "other")})] * 2
    theirs = [rank({"compute": 9.0}, {"a": (2.0, 100.0, "compute")})] * 2
    text = prof.side_by_side(ours, theirs, ("ours", "torch"))
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("function"))
    assert lines[first + 1].startswith("a ") and lines[first + 1].split()[-1] == "0.40"  # 2 x 2 calls x 100 us
    assert lines[first + 2].startswith("b ") and lines[first + 2].split()[-1] == "0.02"
    assert "compute" in text and "10.00" in text and "9.00" in text


def test_thread_counts_per_mini_batch_by_name():
    threads = load_benchmark("link_threads")
    before = {1: ("python", 10, 1.0), 2: ("gloo_tcp_loop", 100, 0.5)}
    after = {1: ("python", 30, 1.5), 2: ("gloo_tcp_loop", 140, 0.6), 3: ("gloo_tcp_loop", 8, 0.2)}
    assert threads.by_name(before, after, 4, 1) == {"gloo_tcp_loop": 12.0, "python": 5.0}
    assert threads.by_name(before, after, 4, 2) == pytest.approx({"gloo_tcp_loop": 0.075, "python": 0.125})
