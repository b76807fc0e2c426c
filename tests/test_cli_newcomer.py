"""The command line as a newcomer meets it (issue 65): the engine alone installed names the lab
extra; a short run fits the recipe's warm-up to itself; every throughput says what it counts; a
run without --task says it trains image; `plan` is short, says where it writes and what "not
stable" means; `schedule` says what its list of weight versions is. In-process and small: the
one training run is an MLP on 64 images, one update."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from conftest import has_image_data
from pipeoptim.cli import main

needs_data = pytest.mark.skipif(not has_image_data(), reason="Fashion-MNIST is not installed")
REPO = Path(__file__).resolve().parents[1]


# -- the engine alone: `pip install .` without the lab extra ----------------------------------------

def test_a_missing_package_of_the_lab_extra_names_the_install(monkeypatch, capsys):
    """matplotlib not installed (an import that fails, as in the engine-only install): one line
    naming the fix, exit 2, before any work."""
    for name in ("pipeoptim.lab.experiment", "pipeoptim.lab.plots"):  # imported again, and failing
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["train", "--task", "image", "--limit", "64"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("pipeoptim train: error: the command line needs the lab extra (missing: matplotlib): "
                            "pip install '.[lab]' in the clone   (or: make setup)\n")


def test_another_import_error_is_not_taken_for_the_lab_extra(monkeypatch):
    from pipeoptim.cli import schedule

    def broken(args):
        raise ModuleNotFoundError("No module named 'not_ours'", name="not_ours")

    monkeypatch.setattr(schedule, "run", broken)
    with pytest.raises(ModuleNotFoundError, match="not_ours"):
        main(["schedule", "gpipe"])


def test_the_lab_extra_is_pyprojects():
    import tomllib

    from pipeoptim.cli.common import LAB_EXTRA

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["lab"]
    assert sorted(LAB_EXTRA) == sorted(re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0] for r in extra)


# -- a short run and the recipe's warm-up ----------------------------------------------------------

def test_the_recipes_warm_up_scales_to_the_run():
    from pipeoptim.lab.lr_schedules import default_warmup, lr_multiplier, make_lr_schedule, warmup_note

    totals = (1, 2, 3, 10, 29, 30, 100, 1874)
    assert [default_warmup("warmup-cosine", t, None) for t in totals] == [0, 0, 1, 1, 1, 2, 5, 94]
    assert [default_warmup("step", t, None) for t in totals] == [0] * len(totals)
    assert make_lr_schedule("warmup-cosine", 1) is not None  # one update: no warm-up, no refusal
    assert [lr_multiplier("warmup-cosine", u, 2, 0) for u in (0, 1)] == [1.0, pytest.approx(0.1)]
    assert warmup_note("warmup-cosine", 2, None) == (
        "no warm-up: a run of 2 updates is too short for the recipe's (5 % of the updates, at least 1, at most a "
        "third of them; --warmup-steps W sets it)")
    assert warmup_note("warmup-cosine", 3, None) is None and warmup_note("warmup-cosine", 1, 0) is None
    with pytest.raises(ValueError) as refused:  # given: refused, with what to do
        make_lr_schedule("warmup-cosine", 1, 1)
    assert str(refused.value) == ("--warmup-steps 1 leaves no update after the warm-up (1 update in the run): give "
                                  "--warmup-steps 0, or a longer run (more --epochs, a larger --limit)")
    with pytest.raises(ValueError, match=r"\(10 updates in the run\): give --warmup-steps 9 or fewer, or a longer"):
        make_lr_schedule("warmup-cosine", 10, 500)


QUICK = ["--model", "mlp", "--limit", "64", "--epochs", "1", "--stages", "2", "--no-progress"]


@needs_data
def test_a_one_update_run_trains_and_says_what_it_did(tmp_path, capsys):
    """`train --limit 64` of one epoch (one update of the recipe's batch 64), no --task: it says the
    task is the default, that the warm-up was left out, and labels both throughputs, each the
    summary's number (the whole training's no more than the epoch's: it adds the epoch-end
    evaluation and checkpoint)."""
    from pipeoptim.lab.experiment import THROUGHPUTS

    out = tmp_path / "run"
    assert main(["train", *QUICK, "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "task: image (the default; --task image|lm|sentiment|translation)"
    assert lines[1].startswith("zb-h1: lr 0.004: tuned for zb-h1 (as sequential, which every synchronous method "
                               "equals), image, adamw")
    assert lines[1].endswith("; no warm-up: a run of 1 update is too short for the recipe's (5 % of the updates, at "
                             "least 1, at most a third of them; --warmup-steps W sets it)")
    summary = json.loads((out / "summary.json").read_text())
    epoch = summary["epochs_detail"][0]["samples_per_second"]
    assert re.search(rf"epoch 1/1: .*  {epoch:.0f} training samples/s$", lines[2]), lines[2]
    assert f", {summary['samples_per_second']:.0f} {THROUGHPUTS['run']}, weight copies" in lines[3]
    assert THROUGHPUTS["run"] == "samples/s over the whole training (epoch-end evaluations and checkpoints included)"
    assert summary["samples_per_second"] <= epoch
    assert len(summary["losses"]) == 1


@needs_data
def test_a_warm_up_given_too_long_names_the_fix(tmp_path, capsys):
    assert main(["train", "--task", "image", *QUICK, "--warmup-steps", "1", "--out", str(tmp_path / "run")]) == 2
    captured = capsys.readouterr()
    assert "task:" not in captured.out  # --task given: nothing to say
    assert captured.err == ("pipeoptim train: error: --warmup-steps 1 leaves no update after the warm-up (1 update "
                            "in the run): give --warmup-steps 0, or a longer run (more --epochs, a larger --limit)\n")


# -- the compare table's key ----------------------------------------------------------------------

def test_the_compare_table_says_what_its_throughputs_count():
    from pipeoptim.cli.compare import format_table

    row = {"method": "sequential", "final_metric": 0.9, "best_metric": 0.9, "final_loss": 0.3, "weight_copies": [1],
           "samples_per_second": 2197.0, "predicted_samples_per_second": 2915.0, "lr": 0.004}
    lines = format_table([row, dict(row, method="pipeoptim", samples_per_second=1178.0)], "accuracy").splitlines()
    assert lines[0].split()[-3:] == ["samples/s", "predicted", "samples/s"] and len(lines) == 6
    assert lines[4] == ("samples/s: each run's samples over its whole training in this one process, the stages taking "
                        "turns on its cores (epoch-end evaluations and checkpoints included)")
    assert lines[5] == ("predicted samples/s: the schedule simulated with one device per stage, from the stages' "
                        "measured times (no transfer cost)")


# -- plan -------------------------------------------------------------------------------------------

def small_plan():
    import torch
    from torch import nn

    from pipeoptim.lab.planner import plan_model

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    batch = (torch.randn(16, 8), torch.randint(0, 3, (16,)))
    return plan_model(net, batch, nn.functional.cross_entropy, stages=2, batches=4, warmup=0, repeats=1,
                      methods=["gpipe", "1f1b-flush", "zb-h1", "pipedream", "pipeoptim"], microbatches=[1, 2],
                      stage_timing="profile", scaling="linear")


def test_the_plan_is_short_unless_verbose():
    from pipeoptim.lab.planner import SHORT_ROWS, format_plan

    plan = small_plan()
    assert len(plan["candidates"]) == 10 > SHORT_ROWS
    short, verbose = format_plan(plan, verbose=False), format_plan(plan)
    assert "... and 2 more (--verbose: every candidate, with the partitions, the memory and the rule; the plan " \
           "file holds them all)" in short
    for detail in ("partition   layers per stage", "predicted (uniform partition", "rule: ", "activations: "):
        assert detail not in short and detail in verbose
    assert f"recommended: {plan['method']} with" in short and len(short.splitlines()) < len(verbose.splitlines())
    # the recommendation is in the short table, wherever it ranks
    rows = [line for line in short.splitlines() if re.match(r"\S+ +\d+ +\d+ ", line)]
    assert len(rows) in (SHORT_ROWS, SHORT_ROWS + 1)
    assert any(r.split()[:2] == [plan["method"], str(plan["microbatches"])] for r in rows)


def test_ratios_from_another_depth_say_so():
    from pipeoptim.lab.plan_targets import target_table

    plan = small_plan()
    plan["study"].update(covered=True, setting="image, adamw, N = 8", target_updates=2100, studied_stages=8)
    assert " ".join(target_table(plan)[:2]).replace("   ", " ").startswith(
        "by predicted time to target (image, adamw, N = 8 of the equal-time study: 2100 updates of the synchronous "
        "pipeline to the target) (no study at N = 2; the nearest studied depth):")
    plan["study"]["studied_stages"] = 2
    assert "no study at N" not in target_table(plan)[0]


def test_an_asynchronous_recommendation_from_another_depth_says_so(monkeypatch):
    """lm with Muon at N = 4: the study ran N = 8 only, where its advice is xpipe; the plan may
    recommend it here, and says that no run measured it at N = 4, with the comparison to run."""
    from test_plan_targets import LM_XPIPE, cand, plan, use_advice

    use_advice(monkeypatch, LM_XPIPE)
    cands = [cand("zb-h1", 4, 1600, batch=16), cand("xpipe", 2, 3200, batch=16)]
    study, best, said = plan(cands, task="lm", model="gpt-narrow", batch_size=16, optimizer="muon", stages=4)
    assert (best["method"], study["studied_stages"]) == ("xpipe", 8)
    assert said[2] == ("xpipe (M = 2) is recommended by the study's N = 8 (no study at N = 4; the nearest studied "
                       "depth): no run measured it at N = 4; to see it on your task before relying on it: pipeoptim "
                       "compare --task lm --model gpt-narrow --stages 4 --optimizer muon --methods xpipe,zb-h1")
    study, best, said = plan(cands, task="lm", model="gpt-narrow", batch_size=16, optimizer="muon", stages=8)
    assert best["method"] == "xpipe" and not any("no run measured it" in line for line in said)


def test_not_stable_says_what_was_measured_and_what_to_do():
    from pipeoptim.lab.planner import measurement_lines

    measured = {"rounds": 15, "stable": False, "halves_disagree": 0.31, "tolerance": 0.05,
                "spread": {"[4, 4] x 64 rows": 0.2, "[8] x 64 rows": 0.1}}
    text = " ".join(" ".join(measurement_lines(measured, verbose=False)).split())
    assert text == ("timed 2 splits and the reference in turns, 15 rounds, not stable: a split timed over the first "
                    "half of the rounds and over the second half still differs by 31% (the plan stops at 5%, or "
                    "after --max-rounds): other work on this machine slowed some of the timed runs, so candidates "
                    "closer than that to each other may be ranked in the wrong order. Plan again on a quieter "
                    "machine, or with more rounds (--max-rounds 30)")
    steady = " ".join(" ".join(measurement_lines(dict(measured, stable=True, rounds=5))).split())
    assert "5 rounds, stable (each split's first and second halves of rounds within 5%); the largest spread" in steady


@needs_data
def test_plan_says_the_task_and_where_it_wrote(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "mlp", "--limit", "256", "--batch-size", "32", "--warmup", "0", "--repeats", "1",
                 "--batches", "4", "--threads", "1", "--stages", "2", "--micro-batches", "1",
                 "--methods", "gpipe,zb-h1", "--stage-timing", "profile", "--scaling", "linear"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "task: image (the default; --task image|lm|sentiment|translation)"
    assert lines[-1] == (f"wrote the plan to {tmp_path / 'plan.json'} (--out FILE: another)  "
                         "(run it: pipeoptim train --plan plan.json)")
    assert json.loads((tmp_path / "plan.json").read_text())["task"] == "image"


# -- schedule -------------------------------------------------------------------------------------

def test_schedule_says_what_its_weight_versions_are(capsys):
    assert main(["schedule", "pipeoptim"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "method pipeoptim: the async-1f1b schedule, weight versions per stage [2, 2, 2, 1] (the copies of its "
        "weights each stage holds, stage 0 first; the last runs each backward right after its forward, so it "
        "holds 1)")
    assert main(["schedule", "pipedream-2bw"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(
        "weight versions per stage [2, 2, 2, 2] (the copies of its weights each stage holds, stage 0 first)")
