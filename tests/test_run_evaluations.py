"""A run's evaluations during training and its validation split, through the experiment layer
and the command line: the summary's evaluations, metrics.jsonl's eval lines, the validation and
test metrics, the compare table."""
from __future__ import annotations

import json

import pytest

from conftest import has_image_data, roll_back_to_older_checkpoint
from pipeoptim.cli import main
from pipeoptim.lab.config import RunConfig
from pipeoptim.lab.experiment import load_data, run_experiment
from pipeoptim.lab.tasks import get_task

QUICK = ["--task", "image", "--model", "mlp", "--limit", "640", "--no-progress"]




pytestmark = pytest.mark.skipif(not has_image_data(),
                                reason="needs Fashion-MNIST (apt-get install dataset-fashion-mnist)")
QUIET = dict(show_progress=False, log=lambda *a, **k: None)


def test_a_run_with_holdout_evaluates_validation_during_training_and_test_at_the_end(tmp_path):
    task = get_task("image")
    cfg = RunConfig(task="image", model="mlp", method="sequential", limit=640, epochs=2, eval_every=4,
                    holdout=1000).resolved(task)
    data = load_data(task, cfg)
    assert sum(y.shape[0] for _, y in data.validation) == 1000
    held = run_experiment(cfg, out_dir=tmp_path / "held", task=task, data=data, **QUIET)
    # the same training on the same data, evaluated on the test split as runs without holdout are
    on_test = run_experiment(RunConfig(**{**cfg.__dict__, "holdout": None}), out_dir=None, task=task,
                             data=data, **QUIET)
    assert held["losses"] == on_test["losses"]
    assert held["eval_split"] == "validation" and on_test["eval_split"] == "test"
    assert held["final_metric"] == on_test["final_metric"]  # the test metric of the final model
    evaluations = held["evaluations"]
    assert [e["batch"] for e in evaluations] == [4, 8, 10, 14, 18, 20]
    assert [e["updates"] for e in evaluations] == [4, 8, 10, 14, 18, 20]
    assert held["validation_metric"] == evaluations[-1]["metric"] == held["epochs_detail"][-1]["metric"]
    assert held["best_metric"] == max(evaluations[2]["metric"], evaluations[5]["metric"])
    assert "validation_metric" not in on_test and held["holdout"] == 1000 and held["eval_every"] == 4
    lines = [json.loads(line) for line in (tmp_path / "held" / "metrics.jsonl").read_text().splitlines()]
    evals = [line for line in lines if line["type"] == "eval"]
    assert [(e["batch"], e["split"]) for e in evals] == [(b, "validation") for b in (4, 8, 10, 14, 18, 20)]
    assert [e["metric"] for e in evals] == [e["metric"] for e in evaluations]
    assert [line["metric"] for line in lines if line["type"] == "test"] == [held["final_metric"]]
    assert json.loads((tmp_path / "held" / "config.json").read_text())["holdout"] == 1000


def test_cli_train_with_eval_every_and_holdout(tmp_path, capsys):
    assert main(["train", *QUICK, "--method", "gpipe", "--stages", "2", "--epochs", "1", "--eval-every", "3",
                 "--holdout", "500", "--json", "--out", str(tmp_path / "run")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [e["batch"] for e in summary["evaluations"]] == [3, 6, 9, 10]
    assert summary["eval_split"] == "validation" and summary["data"]["n_validation"] == 500
    assert summary["data"]["batches"]["validation"] == 8  # 500 images in batches of 64
    assert 0 <= summary["validation_metric"] <= 1 and 0 <= summary["final_metric"] <= 1
    assert main(["train", *QUICK, "--method", "gpipe", "--stages", "2", "--holdout", "500",
                 "--out", str(tmp_path / "printed")]) == 0
    assert "final test accuracy: " in capsys.readouterr().out


def test_cli_train_evaluates_in_the_bubbles_to_the_drained_numbers(tmp_path, capsys):
    """`--eval-in-bubbles`: each mid-epoch evaluation runs in the next mini-batch's bubbles, with
    the metrics and losses of the drained run."""
    runs = {}
    for name, extra in (("drained", []), ("filled", ["--eval-in-bubbles"])):
        assert main(["train", *QUICK, "--method", "1f1b-flush", "--stages", "2", "--epochs", "1", "--eval-every", "3",
                     "--holdout", "500", "--json", "--out", str(tmp_path / name), *extra]) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    drained, filled = runs["drained"], runs["filled"]
    assert [e["batch"] for e in filled["evaluations"]] == [3, 6, 9, 10]
    assert [e["metric"] for e in filled["evaluations"]] == [e["metric"] for e in drained["evaluations"]]
    assert filled["losses"] == drained["losses"] and filled["final_metric"] == drained["final_metric"]
    # an asynchronous method is refused in one line, naming the fix
    assert main(["train", *QUICK, "--method", "pipeoptim", "--stages", "2", "--epochs", "1", "--eval-every", "3",
                 "--eval-in-bubbles", "--out", str(tmp_path / "async")]) != 0
    assert "evaluate drained (eval_in_bubbles=False)" in capsys.readouterr().err


def test_cli_compare_reports_test_and_validation_columns(tmp_path, capsys):
    assert main(["compare", *QUICK, "--methods", "sequential,gpipe", "--stages", "2", "--epochs", "1", "--holdout", "500",
                 "--eval-every", "5", "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert "final test accuracy" in out and "validation accuracy" in out and "best validation accuracy" in out
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    sequential, gpipe = report["runs"]
    assert sequential["losses"] == pytest.approx(gpipe["losses"], rel=1e-5)  # gpipe: sequential's arithmetic
    assert [e["batch"] for e in gpipe["evaluations"]] == [5, 10]


def test_cli_resume_of_a_run_with_eval_every_and_holdout_gives_the_same_curve(tmp_path, capsys):
    common = ["train", *QUICK, "--method", "pipeoptim", "--stages", "2", "--epochs", "2",
              "--checkpoint-every", "4", "--eval-every", "3", "--holdout", "500", "--json"]
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    full = json.loads(capsys.readouterr().out)
    assert main([*common, "--out", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    roll_back_to_older_checkpoint(tmp_path / "b")  # as if the run had died after its first one
    assert main(["train", "--resume", str(tmp_path / "b"), "--json", "--no-progress"]) == 0
    resumed = json.loads(capsys.readouterr().out)
    strip = lambda evals: [{k: v for k, v in e.items() if k != "seconds"} for e in evals]  # noqa: E731
    assert resumed["losses"] == full["losses"]
    assert strip(resumed["evaluations"]) == strip(full["evaluations"])
    assert [e["batch"] for e in full["evaluations"]] == [3, 6, 9, 10, 13, 16, 19, 20]
    assert (resumed["final_metric"], resumed["validation_metric"]) == (full["final_metric"], full["validation_metric"])


def test_global_clipping_makes_a_clipped_gpipe_run_equal_sequential(tmp_path, capsys):
    """--clip-scope global (a synchronous method's default) clips by the whole model's norm, as
    the one-stage run does; per stage the bound is looser, so the losses differ."""
    def losses(*args):
        out = tmp_path / "-".join(args).replace("--", "")
        assert main(["train", *QUICK, "--clip-grad", "0.05", "--json", "--out", str(out), *args]) == 0
        return json.loads(capsys.readouterr().out)["losses"]
    sequential = losses("--method", "sequential")
    global_gpipe = losses("--method", "gpipe", "--stages", "2")
    stage_gpipe = losses("--method", "gpipe", "--stages", "2", "--micro-batches", "2", "--clip-scope", "stage")
    assert global_gpipe == pytest.approx(sequential, rel=1e-5)
    assert stage_gpipe != pytest.approx(sequential, rel=1e-5)
