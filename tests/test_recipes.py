"""The plain command trains with the task's recipe (pipeoptim.lab.tasks.recipes) and each method's
tuned peak lr, says where the lr came from, and lets every flag override its setting."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeoptim.cli import main
from pipeoptim.lab.tasks.recipes import RECIPES, TUNED_LRS, default_lr, describe, recipe, tuned_lrs
from pipeoptim.lab.tasks import task_names


def test_every_task_has_a_recipe_with_a_known_model_and_schedule():
    from pipeoptim.lab.lr_schedules import LR_SCHEDULES
    from pipeoptim.lab.optimizers import optimizer_names
    from pipeoptim.lab.tasks import get_task

    assert sorted(RECIPES) == sorted(task_names())
    for name, r in RECIPES.items():
        assert r.model in get_task(name).model_names()
        assert r.optimizer in optimizer_names() and r.lr_schedule in LR_SCHEDULES
    assert {t for t, _, _ in TUNED_LRS} == {"image", "sentiment", "lm"}  # translation: not studied


def test_the_default_lr_is_the_tuned_one_then_the_recipes_then_none():
    assert default_lr("image", "momentum", "pipeoptim") == (
        0.005, "tuned for pipeoptim, image, momentum, N = 8 (second study, docs/results.md); --lr overrides")
    lr, source = default_lr("lm", "adamw", "gpipe")  # equal to sequential: sequential's tuned lr
    assert lr == 0.004 and source.startswith("tuned for gpipe (as sequential, which every synchronous method "
                                             "equals), lm, adamw")
    # one rule, one wording for every synchronous method (issue 65): zb-h1 too, with any optimizer
    assert default_lr("image", "momentum", "zb-h1") == (
        0.01, "tuned for zb-h1 (as sequential, which every synchronous method equals), image, momentum, N = 8 "
              "(second study, docs/results.md); --lr overrides")
    assert default_lr("translation", "adamw", "interleaved")[1].startswith(
        "not tuned for interleaved (as sequential, which every synchronous method equals) on translation")
    lr, source = default_lr("translation", "adamw", "pipeoptim")  # nothing tuned: the recipe's
    assert lr == 1e-3 and source.startswith("not tuned for pipeoptim on translation with adamw: the recipe's")
    lr, source = default_lr("image", "nesterov", "pipeoptim")  # another optimizer: the task knows
    assert lr is None and "the task's usual lr" in source
    with pytest.raises(ValueError, match="no recipe for task 'nope'"):
        recipe("nope")


def test_describe_lists_the_tuned_lrs_per_optimizer():
    assert tuned_lrs("sentiment") == {"adamw": {"async-naive": 0.008, "pipedream": 0.004, "pipedream-2bw": 0.008,
                                                "pipeoptim": 0.008, "sequential": 0.008, "spectrain": 0.008,
                                                "xpipe": 0.008}}
    assert describe("translation").endswith("no lr tuned per method yet: every method starts from the recipe's lr")


QUICK = ["--task", "image", "--model", "mlp", "--limit", "64", "--stages", "2", "--no-progress"]


def train(tmp_path: Path, capsys, *extra: str) -> tuple:
    out = tmp_path / "run"
    assert main(["train", *QUICK, "--out", str(out), *extra]) == 0
    printed = capsys.readouterr().out
    return json.loads((out / "config.json").read_text()), json.loads((out / "summary.json").read_text()), printed


def test_the_plain_command_runs_the_recipe_with_the_tuned_lr(tmp_path, capsys):
    config, summary, printed = train(tmp_path, capsys, "--method", "pipeoptim")
    image = RECIPES["image"]
    assert (config["optimizer"], config["lr"], config["lr_schedule"], config["epochs"], config["batch_size"],
            config["clip_grad"]) == (image.optimizer, 0.001, "warmup-cosine", image.epochs, image.batch_size, None)
    source = "tuned for pipeoptim, image, adamw, N = 8 (second study, docs/results.md); --lr overrides"
    assert config["lr_source"] == summary["lr_source"] == source
    assert f"pipeoptim: lr 0.001: {source}" in printed
    assert len(summary["epochs_detail"]) == image.epochs


def test_each_flag_overrides_the_recipe(tmp_path, capsys):
    config, summary, printed = train(tmp_path, capsys, "--method", "gpipe", "--lr", "0.02", "--optimizer",
                                     "momentum", "--epochs", "1", "--lr-schedule", "constant",
                                     "--clip-grad", "2.5", "--batch-size", "32")
    assert (config["optimizer"], config["lr"], config["lr_source"], config["lr_schedule"], config["epochs"],
            config["batch_size"], config["clip_grad"]) == ("momentum", 0.02, "--lr", "constant", 1, 32, 2.5)
    assert config["clip_scope"] == "global"  # a synchronous method clips as the plain loop does
    assert "gpipe: lr 0.02: --lr" in printed


def test_an_untuned_combination_falls_back_and_says_so(tmp_path, capsys):
    config, summary, printed = train(tmp_path, capsys, "--method", "pipeoptim", "--optimizer", "nesterov",
                                     "--epochs", "1", "--batch-size", "16", "--clip-grad", "none")
    assert config["lr"] == 0.01 and config["clip_grad"] is None  # the image task's lr for nesterov
    assert summary["lr_source"] == ("not tuned for pipeoptim on image with nesterov: the task's usual lr "
                                    "for it; --lr overrides")
    assert "pipeoptim: lr 0.01: not tuned for pipeoptim on image with nesterov" in printed


def test_the_readme_shows_the_recipes_as_they_are():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for task, r in RECIPES.items():
        clip = "none" if r.clip_grad is None else f"{r.clip_grad:.1f}"
        row = f"| {task} | {r.model} | {r.optimizer} {r.lr:g} | {r.lr_schedule} | {clip} | {r.batch_size} | {r.epochs} |"
        assert row in readme, row


def test_the_advised_setting_trains_at_the_advices_lr_and_nothing_else_does(monkeypatch):
    """Where the advice for image at N = 8 is pipeoptim-2bw with error feedback and AdamW at its own
    lr (installed here: the committed advice fills as the confirmation finishes), which no
    second-study tuning holds (the recipe's lr before): that setting trains at it; pipeoptim-2bw
    without the feedback, at another depth, or with another optimizer is not the advised setting
    and keeps the old source, and so does the advised setting where no advice is in yet."""
    from pipeoptim.cli import build_parser
    from pipeoptim.cli.common import run_config
    from test_plan_targets import IMAGE_EF, LM_XPIPE, SENTIMENT_SYNC, use_advice

    advised = use_advice(monkeypatch, IMAGE_EF, LM_XPIPE, SENTIMENT_SYNC)[("image", 8)]
    assert (advised.method, advised.optimizer, advised.options) == ("pipeoptim-2bw", "adamw",
                                                                    (("error_feedback", "True"),))

    def lr_of(*argv):
        args = build_parser().parse_args(["compare", "--task", "image", "--optimizer", "adamw", *argv])
        cfg = run_config(args, "pipeoptim-2bw", strict=False)
        return cfg.lr, cfg.lr_source

    lr, source = lr_of("--stages", "8", "--error-feedback")
    assert lr == advised.lr == 0.002 and source.startswith("the equal-time study's advice for pipeoptim-2bw+ef")
    assert lr_of("--stages", "8") == default_lr("image", "adamw", "pipeoptim-2bw") != (0.002, source)
    assert lr_of("--stages", "4", "--error-feedback") == default_lr("image", "adamw", "pipeoptim-2bw")
    assert lr_of("--stages", "8", "--error-feedback", "--lr", "0.01") == (0.01, "--lr")
    assert lr_of("--stages", "8", "--error-feedback", "--optimizer", "momentum") == default_lr(
        "image", "momentum", "pipeoptim-2bw")
    use_advice(monkeypatch)  # no advice in yet: the tuned lr or the recipe's, as before
    assert lr_of("--stages", "8", "--error-feedback") == default_lr("image", "adamw", "pipeoptim-2bw")
