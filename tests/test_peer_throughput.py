"""The arithmetic of benchmarks/peer_throughput.py on given numbers (no timing, no processes):
per-round normalisation by the plain loop, per-round pair ratios, median, min/max and IQR."""
from __future__ import annotations

import pytest

from conftest import load_benchmark
from pipeoptim.lab.bench_worker import iqr, quartiles


@pytest.fixture(scope="module")
def peer():
    return load_benchmark("peer_throughput")


def test_quartiles_interpolate_like_numpy():
    assert quartiles([5.0]) == [5.0, 5.0, 5.0]
    assert quartiles([4.0, 1.0, 3.0, 2.0, 5.0]) == [2.0, 3.0, 4.0]
    assert quartiles([1.0, 2.0, 3.0, 4.0]) == pytest.approx([1.75, 2.5, 3.25])
    assert iqr([1.0, 2.0, 3.0, 4.0]) == pytest.approx(1.5)
    assert iqr([7.0]) == 0.0
    np = pytest.importorskip("numpy")
    xs = [0.3, 1.9, 0.7, 2.2, 1.1, 5.0]
    assert quartiles(xs) == pytest.approx(list(np.percentile(xs, [25, 50, 75])))
    with pytest.raises(ValueError):
        quartiles([])


def test_spread(peer):
    s = peer.spread([3.0, 1.0, 2.0, 5.0, 4.0])
    assert (s["median"], s["min"], s["max"], s["q1"], s["q3"], s["iqr"]) == (3.0, 1.0, 5.0, 2.0, 4.0, 2.0)
    assert s["median_spread"] is None  # five rounds: even the extremes cover the median 94 % of the time


def test_the_median_interval_is_the_order_statistics_that_cover_95_percent(peer):
    # coverage of [x_(k), x_(n+1-k)]: 1 - 2 P(Binomial(n, 1/2) < k)
    assert peer.median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None            # k = 1: 93.75 %
    assert peer.median_interval([6.0, 1.0, 5.0, 2.0, 4.0, 3.0]) == [1.0, 6.0]  # k = 1: 96.9 %
    values = [float(v) for v in range(1, 10)]                                  # n = 9: k = 2 (96.1 %)
    assert peer.median_interval(values) == [2.0, 8.0]
    assert peer.median_interval([float(v) for v in range(1, 31)]) == [10.0, 21.0]  # n = 30: k = 10
    assert peer.median_spread(values) == pytest.approx((8.0 - 2.0) / 2 / 5.0)
    assert peer.median_spread([1.0, 2.0]) == float("inf")


def test_the_spread_of_the_median_shrinks_with_rounds_where_the_iqr_does_not(peer):
    """The same scatter (ratios 0.92 .. 1.08, evenly), more rounds: the interquartile range stays
    near 8 % of the median, the spread of the median falls under 2 %, and ``converged`` says so."""
    def rounds(n):
        return [0.92 + 0.16 * i / (n - 1) for i in range(n)]
    few, many = peer.spread(rounds(9)), peer.spread(rounds(201))
    assert few["iqr"] == pytest.approx(many["iqr"], rel=0.05) == pytest.approx(0.08, rel=0.05)
    assert few["median_spread"] > 0.02 > many["median_spread"]
    assert not peer.converged({"a": few, "b": many}, 0.02)
    assert peer.converged({"b": many}, 0.02)
    assert not peer.converged({"a": peer.spread([1.0, 1.0])}, 0.02)  # undefined: keep going
    assert not peer.converged({}, 0.02)



def test_ratios_are_taken_within_each_round(peer):
    pairs = [("a/b", "a", "b"), ("c/best", "c", "best torch")]
    torch_runs = ["b", "d"]
    rounds = [{"plain (1 process)": 100.0, "a": 200.0, "b": 100.0, "c": 300.0, "d": 150.0},
              # the whole host twice as fast: the normalised figures and the ratios do not move
              {"plain (1 process)": 200.0, "a": 400.0, "b": 200.0, "c": 600.0, "d": 300.0},
              {"plain (1 process)": 100.0, "a": 120.0, "b": 100.0, "c": 100.0, "d": 200.0}]
    norm = peer.normalise(rounds)
    assert norm[0] == {"a": 2.0, "b": 1.0, "c": 3.0, "d": 1.5} == norm[1]
    assert norm[2] == {"a": 1.2, "b": 1.0, "c": 1.0, "d": 2.0}
    out = peer.pair_ratios(norm, pairs=pairs, torch_runs=torch_runs)
    assert out["a/b"]["values"] == pytest.approx([2.0, 2.0, 1.2])
    assert out["a/b"]["median"] == pytest.approx(2.0)
    assert (out["a/b"]["min"], out["a/b"]["max"]) == pytest.approx((1.2, 2.0))
    assert out["a/b"]["iqr"] == pytest.approx(0.4)  # q1 = 1.6, q3 = 2.0
    # the best torch run of each round: b, d in round 1 and 2 -> d (1.5); round 3 -> d (2.0)
    assert out["c/best"]["values"] == pytest.approx([2.0, 2.0, 0.5])
    assert out["c/best"]["median"] == pytest.approx(2.0)


def test_summarise_reports_every_run_and_the_five_ratios(peer):
    names = [label for label, _, _, _ in peer.RUNS]
    rounds = [dict({peer.PLAIN: 1000.0}, **{n: 1000.0 + 100 * i + 10 * r for i, n in enumerate(names)})
              for r in range(5)]
    summary = peer.summarise(rounds)
    assert set(summary["runs"]) == {peer.PLAIN, *names}
    assert "x_plain" not in summary["runs"][peer.PLAIN]
    assert summary["runs"][names[0]]["x_plain"]["median"] == pytest.approx(1.02)
    assert summary["runs"][names[0]]["samples_per_second"]["iqr"] == pytest.approx(20.0)
    assert list(summary["ratios"]) == [name for name, _, _ in peer.PAIRS]
    gpipe2 = summary["ratios"]["ours gpipe / torch ScheduleGPipe, M=2"]
    assert gpipe2["median"] == pytest.approx(1020.0 / 1120.0)
    best = summary["ratios"]["pipeoptim / torch's best synchronous schedule"]
    assert best["median"] == pytest.approx(1820.0 / 1720.0)  # torch Schedule1F1B M=4 is the fastest torch run
    table = peer.format_table(summary)
    assert "ours gpipe / torch ScheduleGPipe, M=2" in table and "IQR" in table and "spread of median" in table


def test_the_1f1b_set_pairs_our_1f1b_flush_with_torchs_schedule1f1b(peer):
    assert [label for label, _, _, _ in peer.SETS["1f1b"]] == [
        "ours 1f1b-flush M=2", "torch Schedule1F1B M=2", "ours 1f1b-flush M=4", "torch Schedule1F1B M=4"]
    rounds = [dict({peer.PLAIN: 100.0}, **{label: 100.0 + r for label, _, _, _ in peer.SETS["1f1b"]})
              for r in range(3)]
    assert list(peer.summarise(rounds)["ratios"]) == ["ours 1f1b-flush / torch Schedule1F1B, M=2",
                                                      "ours 1f1b-flush / torch Schedule1F1B, M=4"]
