"""`pipeoptim bench --ablate compile`: each method eager and compiled, the compiled runs named
'METHOD compiled' beside their eager twins and compared with them."""
from __future__ import annotations

import json

import pytest

from pipeoptim.cli import main
from pipeoptim.cli.bench import ratios


def test_a_compiled_run_is_compared_with_its_eager_twin():
    sps = {"1f1b-flush": 100.0, "1f1b-flush compiled": 125.0, "pipeoptim compiled": 50.0,
           "1f1b-flush x2 sharded": 80.0}
    assert ratios(sps, ["1f1b-flush", "pipeoptim"]) == {"1f1b-flush compiled/1f1b-flush": 1.25}


@pytest.mark.timeout(240)
def test_bench_times_each_method_eager_and_compiled(tmp_path, capfd):
    """2 processes: a warm-up round and a timed one of each run, the compiled one compiling on
    its untimed mini-batch (aot_eager: the path, without inductor's seconds of code generation;
    the losses' equality is tests/test_compile.py's)."""
    assert main(["bench", "--synthetic", "--methods", "pipeoptim", "--ablate", "compile", "--batches", "2",
                 "--warmup", "1", "--batch-size", "16", "--no-baselines", "--repeats", "1", "--json",
                 "--compile", "aot_eager", "--out", str(tmp_path / "bench.json"), "--timeout", "120"]) == 0
    result = json.loads(capfd.readouterr().out)
    assert set(result["samples_per_second"]) == {"pipeoptim", "pipeoptim compiled"}
    assert (result["settings"]["compile"], result["settings"]["ablate"]) == ("aot_eager", ["compile"])
    assert result["ratios"]["pipeoptim compiled/pipeoptim"] > 0
