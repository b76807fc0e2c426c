"""study/common.py, what the studies' scripts share: the seed statistics and the verdict
rule the reports print, the rows of a runs.jsonl (the first of a run kept, a torn line skipped),
a times file's format check and ``--shard``."""
from __future__ import annotations

import argparse
import math

import pytest

from study import common


def test_mean_sd_skips_missing_values_and_a_diverged_seed_is_infinite():
    assert common.mean_sd([0.8, None, 0.0]) == pytest.approx((0.4, 0.565685424949238))
    assert common.mean_sd([40.0, math.inf]) == (math.inf, 0.0)
    assert all(math.isnan(x) for x in common.mean_sd([]))
    assert common.fmt((0.8, 0.01), 100.0) == "80.00 ± 1.00" and common.fmt((math.nan, math.nan)) == "-"


def test_verdicts_tie_within_the_larger_spread():
    assert common.verdict((0.80, 0.01), (0.79, 0.02), True)[0] == "ties"
    assert common.verdict((0.80, 0.01), (0.75, 0.02), True)[0] == "wins"
    assert common.verdict((0.80, 0.01), (0.75, 0.02), False)[0] == "loses"   # lower is better
    assert common.verdict((math.inf, 0.0), (math.inf, 0.0), False)[0] == "ties"  # both diverged


def test_rows_keep_the_first_of_a_run_and_skip_a_torn_line(tmp_path):
    path = tmp_path / "runs.jsonl"
    assert common.keyed_rows(path, lambda r: r["run"]) == {}
    common.append_line(path, {"run": "a", "value": 1})
    common.append_line(path, {"run": "a", "value": 2})
    with path.open("a") as f:
        f.write('{"run": "b", "val')
    assert common.keyed_rows(path, lambda r: r["run"]) == {"a": {"run": "a", "value": 1}}


def test_a_times_file_is_checked_and_written_rounded(tmp_path):
    path = tmp_path / "times.json"
    assert common.read_format(path, "f", "test", {"format": "f"}) == {"format": "f"}
    common.write_rounded(path, {"format": "f", "seconds": 0.123456789, "list": [1.0 / 3]})
    assert common.read_format(path, "f", "test", {}) == {"format": "f", "seconds": 0.1235, "list": [0.3333]}
    with pytest.raises(ValueError, match="is not a other file"):
        common.read_format(path, "g", "other", {})


def test_shard():
    assert common.parse_shard("1/2") == (1, 2)
    with pytest.raises(argparse.ArgumentTypeError):
        common.parse_shard("2/2")
