"""Where people look at a run (issue 65, item 3): ``fit(log_dir=DIR)`` and ``pipeoptim train
--tensorboard DIR`` write TensorBoard event files from rank 0 alone, read back here with
TensorBoard's own reader: each tag's points, steps and values are the run's own numbers (its
losses, the lrs its stages recorded, its evaluations, epochs and memory) to float32. ``wandb=``
logs the same scalars through the wandb package (a stand-in module here: wandb is not installed
for the tests); either is refused, with the command that installs it, where its package is
missing. Tiny models, a few mini-batches, in this process."""
from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import pipeoptim
from conftest import has_image_data
from pipeoptim.cli import main
from pipeoptim.errors import command_line_words
from pipeoptim.lab.config import LAB_OPTIONS
from pipeoptim.options import OPTIONS
from pipeoptim.run_log import check_run_log

LOSS = nn.functional.cross_entropy


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def halving(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def data(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(n)]


def read_back(folder: Path):
    """(the event files in ``folder``, tag -> [(step, value, wall time)])."""
    files = sorted(p.name for p in folder.iterdir())
    events = EventAccumulator(str(folder))
    events.Reload()
    return files, {tag: [(e.step, e.value, e.wall_time) for e in events.Scalars(tag)]
                   for tag in events.Tags()["scalars"]}


def f32(values):
    return [float(np.float32(v)) for v in values]


def test_fit_writes_the_runs_numbers_against_the_update_number(tmp_path):
    batches = data(5)
    began = time.time()
    result = pipeoptim.train(mlp(), batches, method="zb-h1", stages=2, loss_fn=LOSS, optimizer=sgd,
                             lr_scheduler=halving, epochs=2, eval_every=2, eval_loader=batches[:2],
                             log_dir=tmp_path / "tb")
    files, scalars = read_back(tmp_path / "tb")
    assert len(files) == 1 and files[0].startswith("events.out.tfevents.")
    stage_tags = [f"memory/stage{k}/{what}" for k in (0, 1) for what in ("state_bytes", "activations_peak_bytes")]
    assert sorted(scalars) == sorted(["train/loss", "train/lr", "eval/metric", "train/epoch_loss",
                                      "train/samples_per_second", "run/samples_per_second", *stage_tags])
    # one point per mini-batch, steps 1..10, the run's losses; the lr each update applied
    assert [s for s, _, _ in scalars["train/loss"]] == list(range(1, 11))
    assert [v for _, v, _ in scalars["train/loss"]] == f32(result.losses)
    stage0 = [u.lrs[0] for u in result.update_trace if u.stage == 0]
    assert [(s, v) for s, v, _ in scalars["train/lr"]] == list(zip(range(1, 11), f32(stage0)))
    assert stage0[:3] == [0.1, 0.05, 0.025]
    # every evaluation: every 2 mini-batches and each epoch's end (5 and 10)
    evaluations = result.metrics["evaluations"]
    assert [s for s, _, _ in scalars["eval/metric"]] == [2, 4, 5, 7, 9, 10] == [e["batch"] for e in evaluations]
    assert [v for _, v, _ in scalars["eval/metric"]] == f32(e["metric"] for e in evaluations)
    epochs = result.metrics["epochs"]
    assert [(s, v) for s, v, _ in scalars["train/epoch_loss"]] == list(zip([5, 10], f32(e["loss"] for e in epochs)))
    assert [v for _, v, _ in scalars["train/samples_per_second"]] == f32(e["samples_per_second"] for e in epochs)
    run_speed = f32([result.metrics["samples_per_second"]])[0]
    assert [(s, v) for s, v, _ in scalars["run/samples_per_second"]] == [(10, run_speed)]
    for k in (0, 1):
        assert scalars[f"memory/stage{k}/state_bytes"][0][:2] == (10, result.metrics["state_memory"][k]["total"])
        assert scalars[f"memory/stage{k}/activations_peak_bytes"][0][:2] == \
            (10, result.metrics["activations"][k]["peak_bytes"])
    # wall times: when each was written, in order
    times = [t for points in scalars.values() for _, _, t in points]
    assert began <= min(times) and max(times) <= time.time()
    assert [t for _, _, t in scalars["train/loss"]] == sorted(t for _, _, t in scalars["train/loss"])


def test_lrs_per_stage_where_they_differ_and_the_prediction_diagnostic(tmp_path):
    result = pipeoptim.train(mlp(), data(4), method="pipeoptim", stages=3, loss_fn=LOSS, optimizer=sgd,
                             lr_correction="delay", lr_correction_steps=4, diagnose_every=1,
                             log_dir=tmp_path / "tb")
    _, scalars = read_back(tmp_path / "tb")
    assert "train/lr" not in scalars  # a delay correction gives each stage its own lr
    for k in (0, 1, 2):
        lrs = [u.lrs[0] for u in result.update_trace if u.stage == k]
        assert [(s, v) for s, v, _ in scalars[f"train/lr/stage{k}"]] == list(zip(range(1, 5), f32(lrs)))
    assert (scalars["train/lr/stage0"][0][1], scalars["train/lr/stage2"][0][1]) == tuple(f32([0.05, 0.1]))
    diagnostics = result.metrics["epochs"][0]["prediction_error"]
    for k in (0, 1):  # the last stage has no delay, nothing to predict
        assert diagnostics[k]["probes"] > 0
        for name in ("prediction_error", "staleness_error"):
            assert [(s, v) for s, v, _ in scalars[f"diagnostic/stage{k}/{name}"]] == \
                [(4, f32([diagnostics[k][name]])[0])]
    assert "diagnostic/stage2/prediction_error" not in scalars


class WandbStandIn(types.ModuleType):
    """The part of the wandb package a run calls: ``init(project=...)`` -> a run with ``log``
    and ``finish``."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.projects, self.logged, self.finished = [], [], 0

    def init(self, project=None, **_):
        self.projects.append(project)
        return self

    def log(self, values, step=None):
        self.logged.append((step, dict(values)))

    def finish(self):
        self.finished += 1


def test_wandb_logs_the_scalars_tensorboard_gets_with_their_steps(tmp_path, monkeypatch):
    stand_in = WandbStandIn()
    monkeypatch.setitem(sys.modules, "wandb", stand_in)
    batches = data(3)
    result = pipeoptim.train(mlp(), batches, method="gpipe", stages=2, loss_fn=LOSS, optimizer=sgd,
                             eval_every=2, eval_loader=batches[:1], wandb="my-project", log_dir=tmp_path / "tb")
    assert stand_in.projects == ["my-project"] and stand_in.finished == 1
    memory = [f"memory/stage{k}/{w}" for k in (0, 1) for w in ("state_bytes", "activations_peak_bytes")]
    assert [(step, sorted(values)) for step, values in stand_in.logged] == [
        (1, ["train/loss", "train/lr"]), (2, ["train/loss", "train/lr"]), (2, ["eval/metric"]),
        (3, ["train/loss", "train/lr"]), (3, ["eval/metric"]),
        (3, ["train/epoch_loss", "train/samples_per_second"]), (3, sorted(["run/samples_per_second", *memory]))]
    assert [v["train/loss"] for _, v in stand_in.logged if "train/loss" in v] == result.losses
    assert [v["eval/metric"] for _, v in stand_in.logged if "eval/metric" in v] == \
        [e["metric"] for e in result.metrics["evaluations"]]
    # the same scalars, point for point, in the event files
    _, scalars = read_back(tmp_path / "tb")
    logged = {}
    for step, values in stand_in.logged:
        for tag, value in values.items():
            logged.setdefault(tag, []).append((step, float(np.float32(value))))
    assert {tag: [(s, v) for s, v, _ in points] for tag, points in scalars.items()} == logged


def test_only_rank_0_writes(tmp_path, monkeypatch):
    stand_in = WandbStandIn()
    monkeypatch.setitem(sys.modules, "wandb", stand_in)
    pipe = pipeoptim.Pipeline(mlp(), method="zb-h1", stages=2, loss_fn=LOSS, optimizer=sgd)
    pipe.world.rank = 1  # as a torchrun job's other ranks see themselves
    result = pipe.fit(data(2), log_dir=tmp_path / "tb", wandb="my-project")
    assert len(result.losses) == 2
    assert not (tmp_path / "tb").exists() and stand_in.projects == [] and stand_in.logged == []


def test_a_missing_package_is_refused_with_its_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed, whether it is here or not
    with pytest.raises(ValueError, match=r"^wandb logs to Weights & Biases, which needs the wandb package: "
                                         r"pip install wandb$"):
        pipeoptim.train(mlp(), data(2), method="zb-h1", stages=2, loss_fn=LOSS, optimizer=sgd, wandb="p")
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ValueError, match=r"^log_dir writes TensorBoard event files, which needs the tensorboard "
                                         r"package: pip install tensorboard \(in a clone of pipeoptim: "
                                         r"pip install '\.\[lab\]'\)$"):
        pipeoptim.train(mlp(), data(2), method="zb-h1", stages=2, loss_fn=LOSS, optimizer=sgd,
                        log_dir=tmp_path / "tb")
    with command_line_words((*OPTIONS, *LAB_OPTIONS)):
        with pytest.raises(ValueError, match=r"^--tensorboard writes TensorBoard event files"):
            check_run_log(tmp_path / "tb", None)
        with pytest.raises(ValueError, match=r"^--wandb logs to Weights & Biases"):
            check_run_log(None, "p")
    assert not (tmp_path / "tb").exists()


def test_the_command_line_refuses_tensorboard_without_its_package_before_writing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert main(["train", "--tensorboard", str(tmp_path / "tb"), "--out", str(tmp_path / "run")]) == 2
    assert "--tensorboard writes TensorBoard event files" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not (tmp_path / "tb").exists()


@pytest.mark.skipif(not has_image_data(), reason="needs Fashion-MNIST (apt-get install dataset-fashion-mnist)")
def test_train_tensorboard_writes_what_metrics_jsonl_holds(tmp_path, capsys):
    run, board = tmp_path / "run", tmp_path / "tb"
    assert main(["train", "--task", "image", "--model", "mlp", "--limit", "128", "--batch-size", "32", "--stages",
                 "2", "--epochs", "1", "--no-progress", "--json", "--out", str(run), "--tensorboard", str(board)]) == 0
    capsys.readouterr()
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    files, scalars = read_back(board)
    assert len(files) == 1
    losses = [e for e in lines if e["type"] == "batch"]
    assert len(losses) == 4
    assert [(s, v) for s, v, _ in scalars["train/loss"]] == [(e["batch"] + 1, f32([e["loss"]])[0]) for e in losses]
    evaluations = [e for e in lines if e["type"] == "eval"]
    assert [(s, v) for s, v, _ in scalars["eval/metric"]] == [(e["batch"], f32([e["metric"]])[0]) for e in evaluations]
    assert len(evaluations) == 1
    epoch = next(e for e in lines if e["type"] == "epoch")
    assert [v for _, v, _ in scalars["train/samples_per_second"]] == f32([epoch["samples_per_second"]])
    assert json.loads((run / "config.json").read_text())["tensorboard"] == str(board)  # a resume writes on
