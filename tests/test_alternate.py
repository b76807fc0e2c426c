"""The parsing and arithmetic of benchmarks/alternate.py (its report, alternate_report.py, and its
worker's module map, alternate_worker.py) on canned results (no training, no processes, no
worktrees): the peer worker's and pipeoptim bench's results read into per-run
samples/s and CPU ms per mini-batch, the ratios within each round and their spread per commit,
the summary table, and the profile comparison's function table."""
from __future__ import annotations

import cProfile
import json
import time
from pathlib import Path

import pytest

from benchmarks import alternate as alt
from benchmarks import alternate_report as report
from benchmarks import alternate_worker as worker


def peer_result(walls, cpu=(0.8, 0.8), thread=(0.75, 0.75)):
    """The peer worker's result: 16 mini-batches of 512, each run's wall seconds as given."""
    return {"batches": 16, "batch_size": 512,
            "runs": {name: {"wall": w, "cpu": list(cpu), "thread": list(thread),
                            "switches": [32.0, 16.0], "main_switches": [16.0, 8.0]} for name, w in walls.items()}}


def bench_result(sps, shares, ms):
    """pipeoptim bench's results file, one round per method."""
    return {"detail": {m: {"samples_per_second": sps[m], "rounds_samples_per_second": [sps[m]],
                           "cpu_share": [shares[m]], "ms_per_batch": ms[m]} for m in sps}}


def test_quartiles_and_spread():
    assert report.quartiles([5.0]) == [5.0, 5.0, 5.0]
    assert report.quartiles([4.0, 1.0, 3.0, 2.0, 5.0]) == [2.0, 3.0, 4.0]
    assert report.quartiles([1.0, 2.0, 3.0, 4.0]) == pytest.approx([1.75, 2.5, 3.25])
    s = report.spread([1.1, 0.9, 1.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (1.0, 0.9, 1.1, 3)
    assert s["iqr"] == pytest.approx(0.1)
    with pytest.raises(ValueError):
        report.quartiles([])


def test_parse_peer():
    runs = report.parse_peer(peer_result({"ours 1f1b-flush M=2": 2.0}, cpu=(0.8, 0.4), thread=(0.7, 0.3)))
    r = runs["ours 1f1b-flush M=2"]
    assert r["samples_per_second"] == pytest.approx(512 * 16 / 2.0)  # 4096
    assert r["cpu_ms"] == pytest.approx(1e3 * 1.2 / 16)  # 75 ms, both processes
    assert r["thread_ms"] == pytest.approx(1e3 * 1.0 / 16)
    assert (r["switches"], r["main_switches"]) == (3.0, 1.5)


def test_parse_bench():
    runs = report.parse_bench(bench_result({"pipeoptim": 3000.0, "async-naive": 2500.0},
                                        {"pipeoptim": [0.9, 0.8], "async-naive": [1.0, 1.0]},
                                        {"pipeoptim": 40.0, "async-naive": 50.0}))
    assert runs["bench pipeoptim"] == {"samples_per_second": 3000.0, "cpu_ms": pytest.approx(68.0)}
    assert runs["bench async-naive"]["cpu_ms"] == pytest.approx(100.0)
    # several rounds: the CPU share of the median round
    three = {"detail": {"x": {"samples_per_second": 2.0, "rounds_samples_per_second": [3.0, 1.0, 2.0],
                              "cpu_share": [[0.1], [0.2], [0.5]], "ms_per_batch": 10.0}}}
    assert report.parse_bench(three)["bench x"]["cpu_ms"] == pytest.approx(5.0)


def rows_of(alt):
    """Two commits, three rounds; the old commit's 1F1B by fit 5 % faster than torch's, the new
    one's 10 % slower; PipeOptim against async-naive from the bench."""
    rows = []
    for r, (old, new) in enumerate([(1.05, 0.90), (1.00, 0.92), (1.10, 0.88)]):
        for commit, ratio in (("old", old), ("new", new)):
            torch_wall = 2.0
            runs = report.parse_peer(peer_result({
                "plain (1 process)": 3.0, "torch Schedule1F1B M=2": torch_wall,
                "ours 1f1b-flush M=2": torch_wall / ratio, "ours 1f1b-flush M=2 (step)": torch_wall,
                "ours gpipe M=2": 2.0, "torch ScheduleGPipe M=2": 2.2}))
            runs.update(report.parse_bench(bench_result({"pipeoptim": 1100.0 + r, "async-naive": 1000.0},
                                                     {"pipeoptim": [1.0, 1.0], "async-naive": [0.5, 0.5]},
                                                     {"pipeoptim": 40.0, "async-naive": 40.0})))
            rows.append({"commit": commit, "round": r, "runs": runs})
    return rows


def test_aggregate_ratios_per_commit():
    summary = report.aggregate(rows_of(alt))
    assert list(summary) == ["old", "new"]
    old, new = summary["old"], summary["new"]
    assert old["rounds"] == new["rounds"] == 3
    fit = "1f1b-flush / Schedule1F1B, M=2 (fit)"
    assert old["ratios"][fit]["median"] == pytest.approx(1.05)
    assert (old["ratios"][fit]["min"], old["ratios"][fit]["max"]) == pytest.approx((1.00, 1.10))
    assert old["ratios"][fit]["iqr"] == pytest.approx(0.05)
    assert new["ratios"][fit]["median"] == pytest.approx(0.90)
    assert new["ratios"][fit]["values"] == pytest.approx([0.90, 0.92, 0.88])
    assert old["ratios"]["1f1b-flush / Schedule1F1B, M=2 (step)"]["median"] == pytest.approx(1.0)
    assert old["ratios"]["gpipe / ScheduleGPipe, M=2 (fit)"]["median"] == pytest.approx(1.1)
    assert new["ratios"]["pipeoptim / async-naive (bench)"]["median"] == pytest.approx(1.101)
    assert new["cpu_ratios"]["pipeoptim / async-naive (bench)"]["median"] == pytest.approx(2.0)
    assert new["cpu_ratios"][fit]["median"] == pytest.approx(1.0)  # the same CPU time in the canned rows
    assert new["runs"]["ours 1f1b-flush M=2"]["cpu_ms"]["median"] == pytest.approx(100.0)
    assert new["runs"]["ours 1f1b-flush M=2"]["samples_per_second"]["median"] == pytest.approx(512 * 16 / (2.0 / 0.9))


def test_aggregate_leaves_out_pairs_not_measured():
    rows = [r for r in rows_of(alt)]
    for r in rows:  # --no-bench
        r["runs"] = {k: v for k, v in r["runs"].items() if not k.startswith("bench ")}
    summary = report.aggregate(rows)
    assert "pipeoptim / async-naive (bench)" not in summary["old"]["ratios"]
    assert len(summary["old"]["ratios"]) == 3


def test_format_summary_and_rows_file(tmp_path, capsys):
    rows = rows_of(alt)
    text = report.format_summary(report.aggregate(rows))
    assert "1.050 [1.000-1.100, IQR 0.050]" in text and "0.900 [0.880-0.920, IQR 0.020]" in text
    assert "rounds: old 3, new 3" in text
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert alt.main(["--from-rows", str(path)]) == 0
    assert "1.050 [1.000-1.100, IQR 0.050]" in capsys.readouterr().out


def test_function_table_and_differences(tmp_path):
    def work(n):
        return sum(i * i for i in range(n))

    profile = cProfile.Profile(time.thread_time)
    profile.enable()
    for _ in range(4):
        work(1000)
        object.__new__(object)  # a builtin whose name holds its type's address
    profile.disable()
    path = tmp_path / "r0.prof"
    profile.dump_stats(str(path))
    table = report.function_table(path, batches=2)
    key = next(k for k in table if k.endswith(":work"))
    assert table[key]["calls"] == 2.0  # 4 calls over 2 mini-batches
    assert table[key]["cumtime_ms"] >= table[key]["tottime_ms"] >= 0.0
    assert table["<built-in method __new__ of type object>"]["calls"] == 2.0  # no address: matches across processes
    base = {"a": {"calls": 1.0}, "b": {"calls": 5.0}}
    other = {"a": {"calls": 4.0}, "c": {"calls": 0.5}}
    assert report.differences(base, other, "calls", 2) == [("b", 5.0, 0.0), ("a", 1.0, 4.0)]
    assert report.short_path("/tmp/pipeoptim-alt/abc/src/pipeoptim/runtime/link.py") == "pipeoptim/runtime/link.py"
    assert report.short_path("/x/site-packages/torch/nn/modules/module.py") == "torch/nn/modules/module.py"


def test_commands_spell_each_commit_alike():
    class Args:
        batches, warmup, timeout = 16, 1, 120.0

    cmd = alt.bench_command(Path("/tmp/tree"), Args, Path("/tmp/out.json"))
    assert cmd[1:4] == ["-m", "pipeoptim", "bench"]
    assert "--optimizer" in cmd and cmd[cmd.index("--optimizer") + 1] == "momentum"  # adamw became the default
    assert cmd[cmd.index("--methods") + 1] == "pipeoptim,async-naive"
    env = alt.env_of(Path("/tmp/tree"))
    assert env["PYTHONPATH"].split(":")[:2] == ["/tmp/tree/src", "/tmp/tree"]
    assert env["OMP_NUM_THREADS"] == "1"
    assert set(worker.COMPAT) == {"blocks_model", "make_optimizer", "init_process_group", "split", "Pipeline"}
