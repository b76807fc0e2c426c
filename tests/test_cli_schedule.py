"""Tests for `pipeoptim schedule`."""
from __future__ import annotations

import csv
import json
import struct

import pytest

from pipeoptim.cli import main
from pipeoptim.methods import method_names
from pipeoptim.schedules import schedule_names


def run_json(capsys, *argv):
    assert main(["schedule", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one JSON object on one line
    return json.loads(out)


def test_pipeoptim_json(capsys):
    report = run_json(capsys, "pipeoptim", "--stages", "4", "--batches", "8")
    assert report["schedule"] == "async-1f1b" and report["method"] == "pipeoptim"
    assert report["weight_copies"] == [2, 2, 2, 1]  # the last stage predicts over s = 0: no cache
    assert (report["stages"], report["ranks"], report["microbatches"], report["batches"]) == (4, 4, 1, 8)
    assert report["makespan"] == 22
    assert report["bubble_fraction"] == pytest.approx(3 / 11, abs=1e-12)
    assert report["analytic_bubble_fraction"] == pytest.approx(3 / 11, abs=1e-12)
    assert report["peak_activations"] == [4, 3, 2, 1]
    assert report["busy"] == [16, 16, 16, 16]
    assert report["out"] is None


def test_pipedream_json_weight_copies(capsys):
    report = run_json(capsys, "pipedream", "--stages", "4", "--batches", "8")
    assert report["weight_copies"] == [4, 3, 2, 1]
    assert report["method"] == "pipedream" and report["schedule"] == "async-1f1b"


def test_pipeoptim_2bw_and_micro_batched_pipeoptim_json(capsys):
    ours = run_json(capsys, "pipeoptim-2bw", "--stages", "4", "--batches", "8")
    twobw = run_json(capsys, "pipedream-2bw", "--stages", "4", "--batches", "8")
    assert ours["schedule"] == "2bw" and ours["microbatches"] == 4
    assert ours["weight_copies"] == [3, 3, 3, 1] and twobw["weight_copies"] == [2, 2, 2, 2]
    assert ours["makespan"] == twobw["makespan"] == 70
    for m, makespan in ((2, 38), (4, 70)):   # pipeoptim with M micro-batches per update
        report = run_json(capsys, "pipeoptim", "--stages", "4", "--batches", "8", "--micro-batches", str(m))
        assert (report["schedule"], report["microbatches"], report["makespan"]) == ("async-1f1b", m, makespan)


def test_gpipe_json_matches_the_closed_form(capsys):
    report = run_json(capsys, "gpipe", "--stages", "4", "--micro-batches", "8")
    assert report["analytic_bubble_fraction"] == pytest.approx(3 / 11, abs=1e-15)
    assert report["bubble_fraction"] == pytest.approx(report["analytic_bubble_fraction"], abs=1e-12)
    assert report["peak_activations"] == [8, 8, 8, 8]
    assert report["makespan"] == 22


def test_schedule_name_has_no_method_and_costs_apply(capsys):
    report = run_json(capsys, "async-1f1b", "--stages", "3", "--batches", "10", "--costs", "1,2",
                      "--comm", "0.5")
    assert report["method"] is None and report["weight_copies"] is None
    assert report["analytic_bubble_fraction"] is None  # F != B, and a transfer cost
    assert report["costs"] == {"forward": 1.0, "backward": 2.0, "weight": 1.0, "update": 0.0, "comm": 0.5}
    assert report["busy"] == [30.0, 30.0, 30.0]


def test_method_default_microbatches_and_explicit_override(capsys):
    assert run_json(capsys, "pipedream-2bw", "--stages", "4", "--batches", "2")["microbatches"] == 4
    assert run_json(capsys, "xpipe", "--stages", "4", "--batches", "2")["microbatches"] == 2
    assert run_json(capsys, "gpipe", "--stages", "3", "-M", "5")["microbatches"] == 5
    # asynchronous schedules default to 2N mini-batches, synchronous ones to 1
    assert run_json(capsys, "pipeoptim", "--stages", "3")["batches"] == 6
    assert run_json(capsys, "1f1b-flush", "--stages", "3")["batches"] == 1


def test_sequential_shows_gpipe_and_says_so(capsys):
    report = run_json(capsys, "sequential", "--stages", "2")
    assert report["schedule"] == "gpipe" and report["method"] == "sequential"
    assert "sequential runs as one stage" in report["notes"][0]
    assert main(["schedule", "sequential", "--stages", "2"]) == 0
    assert "note: sequential runs as one stage" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(dict.fromkeys(schedule_names() + method_names())))
def test_every_name_runs(capsys, name):
    report = run_json(capsys, name, "--stages", "4", "--batches", "2")
    assert 0 <= report["bubble_fraction"] < 1
    assert len(report["busy"]) == report["ranks"]
    assert len(report["peak_activations"]) == report["stages"]


def test_text_output_has_summary_and_timeline(capsys):
    assert main(["schedule", "1f1b-flush", "--stages", "2", "-M", "2", "--width", "24"]) == 0
    out = capsys.readouterr().out
    assert "method 1f1b-flush: the 1f1b-flush schedule, weight versions per stage [1, 1]" in out
    assert "peak activations per stage (micro-batches held) [2, 1]" in out
    assert "makespan 6, bubble 33.3% (closed form 33.3%)" in out
    assert "stage 0 |F0--F1--....B0==....B1=U|" in out
    assert "stage 1 |....F0--B0==F1--B1=U....|" in out


def test_png_chrome_csv_and_text_files(tmp_path, capsys):
    png = tmp_path / "s.png"
    assert main(["schedule", "pipeoptim", "--stages", "4", "--batches", "8", "--format", "png",
                 "--out", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24]) == (1200, 370)

    trace = tmp_path / "t.json"
    report = run_json(capsys, "gpipe", "--stages", "2", "-M", "2", "--format", "chrome", "--out", str(trace))
    assert report["out"] == str(trace)
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 10 and {e["tid"] for e in events} == {0, 1}

    table = tmp_path / "s.csv"
    assert main(["schedule", "1f1b-flush", "--stages", "2", "-M", "2", "--format", "csv",
                 "--out", str(table)]) == 0
    with open(table, newline="") as f:
        assert list(csv.reader(f)) == [["0F0", "0F1", "", "0B0", "", "0B1", "0U0"],
                                       ["", "1F0", "1B0", "1F1", "1B1", "1U0"]]

    text = tmp_path / "s.txt"
    assert main(["schedule", "gpipe", "--stages", "2", "-M", "1", "--out", str(text)]) == 0
    assert text.read_text().startswith("gpipe: 2 stages")


def test_default_out_is_in_the_current_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    report = run_json(capsys, "zb-h1", "--stages", "3", "-M", "6", "--format", "csv")
    assert report["out"] == "schedule-zb-h1-N3-M6.csv"
    assert (tmp_path / "schedule-zb-h1-N3-M6.csv").stat().st_size > 0
    assert main(["schedule", "pipeoptim", "--stages", "2", "--format", "chrome"]) == 0
    assert (tmp_path / "schedule-pipeoptim-N2-M1.json").exists()


@pytest.mark.parametrize("argv,message", [
    (["nope"], "unknown schedule or method 'nope'"),
    (["gpipe", "--stages", "0"], "--stages must be at least 1, got 0"),
    (["gpipe", "--stages", "two"], "--stages must be an integer, got 'two'"),
    (["gpipe", "--micro-batches", "-1"], "--micro-batches must be at least 1"),
    (["gpipe", "--costs", "1"], "--costs takes F,B or F,B,W"),
    (["gpipe", "--costs", "1,x"], "--costs must be a number, got 'x'"),
    (["gpipe", "--costs", "1,0"], "forward and backward must take some time"),
    (["gpipe", "--costs", "1,1,2"], "W cost 2.0 must lie between 0 and the backward cost 1.0"),
    (["gpipe", "--comm", "-1"], "--comm must be a finite number >= 0"),
    (["2bw", "--stages", "4", "-M", "2"], "2bw needs micro-batches per update m >= stages N"),
    (["interleaved-1f1b", "--stages", "4", "-M", "6"], "multiple of the ranks"),
])
def test_errors_exit_2_with_one_line(capsys, argv, message):
    assert main(["schedule", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("pipeoptim schedule: error: ")
    assert message in captured.err


def test_help_exits_0_and_documents_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["schedule", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--stages", "--micro-batches", "--batches", "--chunks", "--costs", "--comm",
                   "--update-cost", "--format", "--out", "--width", "--json", "NAME"):
        assert option in out
    assert "pipeoptim" in out and "async-1f1b" in out
