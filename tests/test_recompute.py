"""Activation recomputation (runtime/recompute.py, ``Pipeline(recompute=...)``, ``--recompute``).

Every method gives the same losses and weights with and without it, bit for bit, on a model with
dropout (the recomputation draws the forward's masks); the recomputed forward of every method
runs on the weights the forward ran on (recorded by the model itself), which for the
asynchronous methods that update or predict in place takes the copy the stage keeps: without
it the losses differ (shown); the copies are counted in ``weight_versions``; a recomputing
stage's forward leaves autograd nothing to save but what torch's checkpoint keeps; bad settings
are refused with the fix.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeoptim
from pipeoptim import Pipeline
from pipeoptim.runtime.stage import Stage

LOSS = nn.functional.cross_entropy
METHODS = pipeoptim.method_names()
ASYNCHRONOUS = [m for m in METHODS if not pipeoptim.get_method(m).synchronous]


def sgdm(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class Recording(nn.Linear):
    """A linear layer that records, per call, its input's sum and the weight values it ran on."""

    calls: list = []

    def forward(self, x):
        Recording.calls.append((float(x.detach().double().sum()), self.weight.detach().clone()))
        return super().forward(x)


def model(width: int = 8, record: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    linear = Recording if record else nn.Linear
    blocks = [nn.Sequential(linear(width, width), nn.Dropout(0.25), nn.Tanh()) for _ in range(4)]
    return nn.Sequential(*blocks, nn.Linear(width, 3))


def data(count: int = 6, size: int = 8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 8, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(count)]


def fit(method: str, recompute, record: bool = False, epochs: int = 2, **options):
    torch.manual_seed(7)  # the dropout masks
    # 4 pieces of the model: 4 stages, or 2 stages x 2 chunks for a chunked method (interleaved)
    stages = {} if method == "sequential" else {"stages": 4 // pipeoptim.get_method(method).chunks}
    pipe = Pipeline(model(record=record), method=method, loss_fn=LOSS, optimizer=sgdm, recompute=recompute,
                    **stages, **options)
    result = pipe.fit(data(), epochs=epochs)
    return result, pipe


@pytest.mark.parametrize("method", METHODS)
def test_every_method_gives_the_same_losses_and_weights_with_recomputation(method):
    plain, _ = fit(method, False)
    again, pipe = fit(method, True)
    assert pipe.recompute == [True] * len(pipe.stages)
    assert again.losses == plain.losses and len(plain.losses) == 12
    for a, b in zip(again.model.parameters(), plain.model.parameters()):
        assert torch.equal(a, b)


def test_recomputation_chosen_per_stage():
    plain, _ = fit("pipeoptim", False)
    some, pipe = fit("pipeoptim", [True, False, False, True])
    assert [s.recompute for s in pipe.stages] == [True, False, False, True]
    assert some.losses == plain.losses


def test_pipeoptim_backward_predicted_holds_its_prediction_no_copy_needed():
    plain, _ = fit("pipeoptim", False, backward="predicted")
    again, _ = fit("pipeoptim", True, backward="predicted")
    assert again.losses == plain.losses
    assert again.metrics["weight_versions"] == plain.metrics["weight_versions"]


@pytest.mark.parametrize("method", ASYNCHRONOUS)
def test_the_recomputed_forward_runs_on_the_forwards_weights(method):
    """Each layer is called twice per micro-batch (forward, recomputation) on one input: both
    calls see the same weight values (one epoch: every input is new)."""
    Recording.calls = []
    fit(method, True, record=True, epochs=1)
    by_input = {}
    for key, weight in Recording.calls:
        by_input.setdefault(key, []).append(weight)
    microbatches = 6 * pipeoptim.get_method(method).microbatches(4, None)
    assert len(by_input) == 4 * microbatches and all(len(ws) == 2 for ws in by_input.values())
    assert all(torch.equal(first, again) for first, again in by_input.values())


@pytest.mark.parametrize("method", ["async-naive", "pipeoptim", "spectrain"])
def test_without_the_kept_copy_the_recomputation_would_differ(method, monkeypatch):
    """Why the copy: without it the recomputation runs on the weights of the backward (updated
    since the forward, or with the prediction swapped out), so the gradients and the losses
    change."""
    plain, _ = fit(method, False)
    monkeypatch.setattr(Stage, "_keep_forward_values", lambda self, microbatch, use: None)
    wrong, _ = fit(method, True)
    assert wrong.losses[:2] == plain.losses[:2]  # nothing has changed yet
    assert wrong.losses != plain.losses


def test_the_copies_are_counted_as_weight_versions():
    """async-naive at stage k keeps the forward's weights of each micro-batch in flight that an
    update overtakes: N-k of them at stages 0..N-2 (4 stages), none at the last."""
    plain, _ = fit("async-naive", False)
    again, _ = fit("async-naive", True)
    assert plain.metrics["weight_versions"] == [1.0, 1.0, 1.0, 1.0]
    assert again.metrics["weight_versions"] == [5.0, 4.0, 3.0, 1.0]


def test_a_recomputing_stage_keeps_only_its_input():
    """Stage 0 (three 64-wide blocks: linear, dropout, tanh), as the stage measures what it holds
    (runtime/held.py: autograd's saved tensors less the weights, and its output): without
    recomputation its input, and per block the dropout's mask (float on the CPU) and the tanh's output (the
    last one its output); with it, torch's checkpoint keeps the input alone, and the stage its
    output."""
    pipe = Pipeline(model(width=64), method="gpipe", stages=2, loss_fn=LOSS, optimizer=sgdm)
    stage = pipe.stages[0]
    x = torch.nn.functional.pad(torch.randn(32, 8), (0, 56))  # 32 x 64: the first layer's input
    activation = x.numel() * x.element_size()
    stage.forward(0, x)
    assert stage.held.now == 7 * activation  # input + 3 x (mask + output)
    stage.recompute = True
    stage.forward(1, x)
    assert stage.held.now - (7 * activation) == 2 * activation


@pytest.mark.parametrize("recompute,message", [
    ([True, False], "recompute lists 2 stages but the pipeline has 4; give one bool per stage"),
    ("yes", "recompute must be True, False or a list of one bool per stage"),
    ([1, 0, 0, 1], "recompute must be True, False or a list of one bool per stage"),
])
def test_bad_recompute_settings_name_the_fix(recompute, message):
    with pytest.raises(ValueError, match=message):
        Pipeline(model(), method="gpipe", stages=4, loss_fn=LOSS, optimizer=sgdm, recompute=recompute)


def test_the_command_lines_recompute_gives_the_same_run(tmp_path, capfd):
    """`pipeoptim train --recompute`: the same losses and test metric as without (and, in
    tests/test_distributed.py, the same under `--runtime distributed`)."""
    import json

    from pipeoptim.cli import main
    from pipeoptim.lab.tasks import MissingDataError, get_task

    try:
        get_task("image").load(batch_size=32, limit=256, seed=0)
    except MissingDataError as error:
        pytest.skip(f"needs Fashion-MNIST: {error}")
    args = ["train", "--task", "image", "--model", "mlp", "--limit", "256", "--batch-size", "32",
            "--stages", "2", "--epochs", "1", "--method", "pipeoptim", "--optimizer", "momentum", "--lr", "0.01",
            "--lr-schedule", "constant", "--no-progress", "--json"]
    runs = []
    for flags in ([], ["--recompute"]):
        assert main([*args, "--out", str(tmp_path / str(len(runs))), *flags]) == 0
        runs.append(json.loads(capfd.readouterr().out))
    config = json.loads((tmp_path / "1" / "config.json").read_text())
    assert config["recompute"] is True
    assert len(runs[0]["losses"]) == 8 and runs[1]["losses"] == runs[0]["losses"]
    assert runs[1]["final_metric"] == runs[0]["final_metric"]
