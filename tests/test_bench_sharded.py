"""`pipeoptim bench --ablate shard-replicas`: each method replicated and sharded over its replicas
(FSDP2; `--shard-replicas` alone: sharded only), the sharded runs named 'METHOD xD sharded' beside their replicated twins, each process's state
bytes in the report; refused, with the fix, where it cannot run."""
from __future__ import annotations

import json

import pytest

from pipeoptim.cli import main
from pipeoptim.cli.bench import format_memory, ratios


@pytest.mark.parametrize("argv, says", [
    (["--shard-replicas"], "--shard-replicas shards each stage over its replicas: give --data-parallel D"),
    (["--ablate", "shard-replicas", "--data-parallel", "1"],
     "--ablate shard-replicas shards each stage over its replicas: give --data-parallel D with D >= 2"),
    (["--shard-replicas", "--data-parallel", "2", "--optimizer", "muon"],
     "--shard-replicas with --optimizer muon: Muon orthogonalizes each whole matrix"),
    (["--ablate", "compile,sharded"],
     "--ablate takes comma-separated settings of compile, recompute, shard-replicas, tensor-parallel, got 'compile,sharded'"),
])
def test_what_cannot_shard_is_refused_in_one_line_naming_the_fix(argv, says, capsys):
    assert main(["bench", "--synthetic", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_a_sharded_run_is_compared_with_its_replicated_twin():
    sps = {"1f1b-flush x2": 100.0, "1f1b-flush x2 sharded": 80.0, "pipeoptim x2 sharded": 50.0}
    assert ratios(sps, ["1f1b-flush", "pipeoptim"]) == {"1f1b-flush x2 sharded/1f1b-flush x2": 0.8}


def test_the_state_table_shows_every_run_with_its_parameters():
    row = {"parameters": 2048, "gradients": 2048, "optimizer": 4096, "weights": 4096, "weights_closed_form": 4096}
    lines = format_memory({"detail": {"pipeoptim x2 sharded": {"state_memory": [row]}}})
    assert lines[-1] == "  pipeoptim x2 sharded: [2] 4 / 4 + 2 + 4"


@pytest.mark.timeout(180)
def test_bench_times_each_method_replicated_and_sharded(tmp_path, capfd):
    """2 stages x 2 replicas on 4 processes: a warm-up run and a timed one of each (the second
    sharded run after the first one's groups are gone); each process of a sharded stage holds
    about half its parameters, gradients and optimizer state (FSDP2's dim-0 chunks)."""
    assert main(["bench", "--synthetic", "--methods", "1f1b-flush", "--stages", "2", "--data-parallel", "2",
                 "--ablate", "shard-replicas", "--batches", "2", "--warmup", "1", "--batch-size", "16",
                 "--no-baselines", "--repeats", "1", "--json", "--out", str(tmp_path / "bench.json"),
                 "--timeout", "60"]) == 0
    result = json.loads(capfd.readouterr().out)
    assert set(result["samples_per_second"]) == {"1f1b-flush x2", "1f1b-flush x2 sharded"}
    assert (result["settings"]["shard_replicas"], result["settings"]["ablate"]) == (False, ["shard_replicas"])
    assert "1f1b-flush x2 sharded/1f1b-flush x2" in result["ratios"]
    replicated = result["detail"]["1f1b-flush x2"]["state_memory"]
    sharded = result["detail"]["1f1b-flush x2 sharded"]["state_memory"]
    for whole, part in zip(replicated, sharded):
        for key in ("parameters", "gradients", "optimizer", "weights"):
            assert 0.45 < part[key] / whole[key] <= 0.55, (key, part, whole)
        assert part["weights"] == part["weights_closed_form"]
