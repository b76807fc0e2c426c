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
