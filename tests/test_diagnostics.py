"""The prediction-error diagnostic: how far each forward's weights were from the backward's."""
from __future__ import annotations

import torch
from torch import nn

import pipeoptim
from conftest import batches, mlp

SGDM = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731


def errors(method, **options):
    result = pipeoptim.train(mlp(), batches(40), method=method, stages=4, optimizer=SGDM,
                             loss_fn=nn.functional.cross_entropy, diagnose_every=3, **options)
    return result.metrics["prediction_error"]


def test_unpredicted_methods_have_prediction_error_equal_to_staleness():
    for row in errors("async-naive")[:3]:
        assert row["probes"] > 5
        assert row["prediction_error"] == row["staleness_error"] > 0


def test_pipeoptim_prediction_beats_staleness_on_every_stale_stage():
    rows = errors("pipeoptim")
    for row in rows[:3]:
        assert row["prediction_error"] < 0.8 * row["staleness_error"]
    assert rows[3] == {"probes": 0}      # the last stage is never stale


def test_pipedream_forward_weights_are_the_stale_version():
    for row in errors("pipedream")[:3]:
        assert row["prediction_error"] == row["staleness_error"] > 0


def test_each_epoch_reports_its_own_probes_and_they_add_up_to_the_run():
    result = pipeoptim.train(mlp(), batches(20), method="pipeoptim", stages=4, optimizer=SGDM,
                             loss_fn=nn.functional.cross_entropy, diagnose_every=3, epochs=2)
    whole = result.metrics["prediction_error"]
    first, second = (e["prediction_error"] for e in result.metrics["epochs"])
    for k in range(3):
        n1, n2 = first[k]["probes"], second[k]["probes"]
        assert n1 > 0 and n2 > 0 and n1 + n2 == whole[k]["probes"]
        mean = (first[k]["prediction_error"] * n1 + second[k]["prediction_error"] * n2) / (n1 + n2)
        assert abs(mean - whole[k]["prediction_error"]) < 1e-12 * max(1.0, mean)
    assert first[3] == second[3] == {"probes": 0}


def test_the_diagnostic_line_gives_the_ratio_per_stage():
    from pipeoptim.lab.experiment import format_prediction_error

    line = format_prediction_error([{"probes": 4, "prediction_error": 1e-3, "staleness_error": 4e-3},
                                    {"probes": 0}])
    assert line == "prediction/staleness error per stage: 0: 1.00e-03/4.00e-03 (0.25) | 1: -"


def test_train_command_prints_the_diagnostic_each_epoch(tmp_path, capsys):
    import json

    from pipeoptim.cli import main

    out = tmp_path / "run"
    assert main(["train", "--task", "image", "--model", "mlp", "--method", "pipeoptim", "--stages", "4", "--limit", "640",
                 "--epochs", "2", "--diagnose-every", "3", "--no-progress", "--out", str(out)]) == 0
    printed = [l for l in capsys.readouterr().out.splitlines() if "prediction/staleness error" in l]
    assert len(printed) == 2 and all(l.strip().endswith("| 3: -") for l in printed)
    epochs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"epoch"' in l]
    assert [len(e["prediction_error"]) for e in epochs if e["type"] == "epoch"] == [4, 4]
    assert len(json.loads((out / "summary.json").read_text())["prediction_error"]) == 4
