"""study/study3_times.py, the equal-time study's budget: B from the fastest synchronous
schedule and M, U_m = floor(B / s_m), the zb-h1 and interleaved costs built from a stage profile,
the synchronous candidates' order on a made-up profile (exact), a cell priced twice keeping the
lower of each price, the CPU clock that other jobs do not inflate, and the planner's
schedule_makespan (the same number as a method's own for the same schedule)."""
from __future__ import annotations

import time

import pytest
import torch

from study.tests.helpers import mlp
from study import study3_times
from pipeoptim.throughput import scaled_profile, schedule_makespan, simulated_makespan
from pipeoptim.profile import LayerProfile, ModelProfile
from pipeoptim.schedules import Costs


@pytest.fixture(scope="module")
def times_mod():
    return study3_times


def _sync(**prices):
    """{schedule: {M: row}} from name_M=seconds keywords."""
    out = {}
    for key, seconds in prices.items():
        name, m = key.rsplit("_", 1)
        out.setdefault(name.replace("_", "-"), {})[m] = {"seconds_per_batch": seconds}
    return out


def test_budget_from_the_fastest_synchronous_candidate(times_mod):
    sync = _sync(gpipe_8=0.02, gpipe_16=0.018, **{"1f1b_flush_8": 0.016, "1f1b_flush_16": 0.015},
                 zb_h1_8=0.012, zb_h1_16=0.013)
    sync["gpipe"]["32"] = {"problem": "32 micro-batches need a batch of at least 32"}
    variants = {"pipeoptim": {"seconds_per_batch": 0.0075}, "xpipe": {"seconds_per_batch": 0.007},
                "pipeoptim-2bw": {"problem": "needs micro-batches >= stages"}}
    b = times_mod.budget(sync, variants, 1000, 8)
    assert b["fastest"] == {"schedule": "zb-h1", "microbatches": 8}
    assert b["budget_seconds"] == pytest.approx(12.0)
    assert b["m_equals_n"]["seconds_per_batch"] == 0.016  # the faster of gpipe and 1f1b-flush at M = N
    assert b["budget_over_m_equals_n"] == pytest.approx(0.75)
    assert b["updates"] == {"pipeoptim": 1600, "xpipe": 1714}  # floor(12 / 0.0075), floor(12 / 0.007)


def _made_up(layers: int, batch: int) -> ModelProfile:
    """Layer k: forward (1 + k % 3) ms, backward twice that, update 0.1 ms (uneven stages)."""
    rows = [LayerProfile(index=k, name="Linear", forward=1e-3 * (1 + k % 3), backward=2e-3 * (1 + k % 3),
                         output_bytes=1000, saved_bytes=1000, saved_input_bytes=0, saved_output_bytes=0,
                         parameter_bytes=4000, parameters=1000, update=1e-4, optimizer_bytes=4000)
            for k in range(layers)]
    return ModelProfile(layers=rows, device="cpu", batch_size=batch, input_bytes=100, warmup=0, repeats=1,
                        threads=1, loss_forward=1e-4, loss_backward=1e-4)


def test_synchronous_candidates_on_a_made_up_profile(times_mod):
    net, batch, batches = mlp(depth=8), 64, 200
    full = _made_up(8, batch)
    counts = (1, 2, 4, 8, 16, 32)
    profiles = {m: scaled_profile(full, -(-batch // m) / batch) if m > 1 else full for m in counts}
    model = times_mod.ProfiledModel(net, batch, profiles, times_mod.ProfileSettings(stage_timing="profile"))
    s = {(name, m): times_mod.price_sync(model, name, 4, m, batches, 0.5)["seconds_per_batch"]
         for name in times_mod.SYNC_SCHEDULES for m in (4, 8, 16)}
    for m in (4, 8, 16):
        # W fills the bubble; half-size chunks shrink it; all forwards first waits longer on
        # uneven stages
        assert s[("zb-h1", m)] < s[("1f1b-flush", m)]
        assert s[("interleaved-1f1b", m)] < s[("1f1b-flush", m)]
        assert s[("gpipe", m)] > s[("1f1b-flush", m)]
    # with costs proportional to the samples, more micro-batches only shrink the bubble
    assert s[("1f1b-flush", 16)] < s[("1f1b-flush", 8)] < s[("1f1b-flush", 4)]
    entry = times_mod.cell_entry(model, [4], 1000, batches, 0.5)
    b = entry["stages"]["4"]["budget"]
    assert b["seconds_per_batch"] == pytest.approx(min(s.values()))
    assert b["budget_over_m_equals_n"] < 1
    # every variant is priced; U_m is what the budget buys at its price
    variants = entry["stages"]["4"]["variants"]
    assert set(variants) == set(times_mod.VARIANTS) - {"sequential"}
    for v, u in b["updates"].items():
        assert u == int(b["budget_seconds"] / variants[v]["seconds_per_batch"])
    assert variants["pipeoptim+MN"]["microbatches"] == 4 and variants["pipeoptim+M2"]["microbatches"] == 2
    # asynchronous 1F1B never flushes: at the pace of the slowest stage (and its update), which no
    # synchronous candidate beats (their bubble only shrinks toward it)
    slowest = max(entry["stages"]["4"]["stage_seconds"]) + entry["stages"]["4"]["update_seconds"]
    assert slowest < variants["pipeoptim"]["seconds_per_batch"] < 1.02 * slowest
    assert b["updates"]["pipeoptim"] >= 1000


def test_zero_bubble_and_interleaved_costs(times_mod):
    net, batch = mlp(depth=8), 64
    full = _made_up(8, batch)
    model = times_mod.ProfiledModel(net, batch, {1: full, 4: scaled_profile(full, 0.25)},
                                    times_mod.ProfileSettings(stage_timing="profile"))
    plain = times_mod.schedule_costs(model, "1f1b-flush", 4, 4, 0.5)
    zb = times_mod.schedule_costs(model, "zb-h1", 4, 4, 0.3)
    assert zb.weight == pytest.approx([0.3 * b for b in plain.backward]) and zb.backward == plain.backward
    inter = times_mod.schedule_costs(model, "interleaved-1f1b", 4, 4, 0.5)
    # device r runs chunks r and 4 + r, each half of its stage: the same work, a smaller bubble
    assert inter.forward == pytest.approx([f / 2 for f in plain.forward] * 2)
    assert len(inter.backward) == 8 and inter.update == pytest.approx(plain.update / 2)


def test_a_cell_priced_again_keeps_the_lower_of_each_price(times_mod):
    def entry(gpipe, pipeoptim, load):
        sync = {"gpipe": {"8": {"seconds_per_batch": gpipe}}, "1f1b-flush": {"8": {"seconds_per_batch": 0.05}}}
        variants = {"pipeoptim": {"seconds_per_batch": pipeoptim}}
        return {"sequential": {"seconds_per_batch": 0.1}, "load_average": load,
                "stages": {"8": {"synchronous": sync, "variants": variants, "budget": {}}}}

    merged = times_mod.merge_calls(entry(0.02, 0.01, [5.0]), entry(0.03, 0.008, [2.0]), 100)
    at8 = merged["stages"]["8"]
    assert at8["synchronous"]["gpipe"]["8"]["seconds_per_batch"] == 0.02
    assert at8["variants"]["pipeoptim"]["seconds_per_batch"] == 0.008
    assert at8["budget"]["budget_seconds"] == pytest.approx(2.0) and at8["budget"]["updates"] == {"pipeoptim": 250}
    assert merged["calls"] == 2 and merged["call_load_averages"] == [[5.0], [2.0]]


def test_the_cpu_clock_does_not_count_waiting(times_mod):
    from pipeoptim import profile

    clock = profile.Clock(torch.device("cpu"))
    with times_mod.profile_clock("cpu"):
        waited, _ = clock.time(lambda: time.sleep(0.05))
    assert waited < 0.01  # asleep (as when preempted): no CPU time
    with times_mod.profile_clock("wall"):
        assert clock.time(lambda: time.sleep(0.05))[0] >= 0.05
    assert clock.time(lambda: time.sleep(0.05))[0] >= 0.05  # the profiler's own clock is back


def test_schedule_makespan_prices_a_method_schedule_alike():
    costs = Costs([1.0, 1.5, 1.0, 1.2], [2.0, 3.0, 2.0, 2.4], [0.0] * 4, update=0.1)
    for batches in (10, 100):  # exact, and extrapolated from 32 and 64 mini-batches
        by_method = simulated_makespan("1f1b-flush", 4, 8, batches, costs)[0]
        assert schedule_makespan("1f1b-flush", 4, 8, batches, costs)[0] == pytest.approx(by_method)
    two = Costs([0.5] * 8, [1.0] * 8, [0.0] * 8)
    assert schedule_makespan("interleaved-1f1b", 4, 8, 10, two, chunks=2)[0] > 0
