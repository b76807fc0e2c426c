"""Bad options, models and data end with exit code 2 and one line that says what is wrong,
before any work starts; no traceback. Table-driven: each row is (arguments, expected text)."""
from __future__ import annotations

import json

import pytest

from conftest import roll_back_to_older_checkpoint
from pipeoptim.cli import main

QUICK = ["--task", "image", "--model", "mlp", "--limit", "640", "--no-progress"]

CASES = [
    (["train", "--stages", "0"], "--stages must be at least 1, got 0"),
    (["train", "--stages", "-3"], "--stages must be at least 1, got -3"),
    (["train", "--stages", "9", *QUICK], "9 stages need at least 9 layers with parameters"),
    (["train", "--partition", "3,3", *QUICK], "covers 6 layers but the model has"),
    (["train", "--partition", "0,8", *QUICK], "every stage needs at least one layer"),
    (["train", "--partition", "1,x"], "expected comma-separated integers"),
    (["train", "--micro-batches", "0"], "--micro-batches must be at least 1, got 0"),
    (["train", "--method", "gpipe", "--micro-batches", "1000", "--stages", "2", *QUICK],
     "cannot split a mini-batch of 64 samples into 1000 micro-batches"),
    (["train", "--method", "pipedream-2bw", "--stages", "4", "--micro-batches", "2", *QUICK],
     "needs micro-batches >= stages"),
    (["train", "--method", "nope"], "invalid choice: 'nope'"),
    (["train", "--optimizer", "lion"], "invalid choice: 'lion'"),
    (["train", "--task", "speech"], "invalid choice: 'speech'"),
    (["train", "--lr", "0"], "--lr must be positive, got 0.0"),
    (["train", "--lr", "-0.1"], "--lr must be positive, got -0.1"),
    (["train", "--epochs", "0"], "--epochs must be at least 1, got 0"),
    (["train", "--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["train", "--limit", "0"], "--limit must be at least 1, got 0"),
    (["train", "--task", "image", "--limit", "10", "--no-progress"], "10"),
    (["train", "--model", "alexnet", *QUICK[:2], "--limit", "640"], "task image has no model 'alexnet'"),
    (["train", "--method", "gpipe", "--steps", "code"], "--steps applies to pipeoptim, not gpipe"),
    (["train", "--method", "pipeoptim", "--vertical-sync"], "--vertical-sync applies to pipedream, not pipeoptim"),
    (["train", "--method", "gpipe", "--continuous"], "--continuous applies to asynchronous methods"),
    (["train", "--optimizer", "adam", "--momentum", "0.9", *QUICK], "--momentum applies to momentum, nesterov, rmsprop and muon"),
    (["train", "--weight-decay", "-1", *QUICK], "weight decay must be >= 0"),
    (["train", "--optimizer", "sgd", "--beta1", "0.9"], "--beta1 applies to adam, adamw, adamax, nadam, radam, muon, delay-nadamw, not sgd"),
    (["train", "--optimizer", "nadam", "--beta1", "1"], "--beta1 must lie in [0, 1), got 1.0"),
    (["train", "--optimizer", "adam", "--adamw-lr", "0.01"], "--adamw-lr applies to muon (its AdamW part), not adam"),
    (["train", "--optimizer", "muon", "--adamw-lr", "0"], "--adamw-lr must be positive, got 0.0"),
    (["train", "--checkpoint-every", "0"], "--checkpoint-every must be at least 1"),
    (["train", "--shard-replicas", *QUICK], "--data-parallel and --shard-replicas run the replicas as processes: "
                                             "add --runtime distributed"),
    (["train", "--runtime", "distributed", "--stages", "2", "--shard-replicas", *QUICK],
     "--shard-replicas shards each stage over its replicas: give --data-parallel D with D >= 2"),
    (["train", "--runtime", "distributed", "--stages", "2", "--data-parallel", "3", "--batch-size", "64", *QUICK],
     "a mini-batch of 64 samples does not split into 3 equal replica shards"),
    (["train", "--diagnose-every", "-1"], "--diagnose-every must be 0 (off) or more, got -1"),
    (["train", "--method", "pipeoptim", "--continuous", "--checkpoint-every", "2", *QUICK], "continuous run never drains"),
    (["train", "--resume", "/nonexistent/run"], "/nonexistent/run is not a run folder"),
    (["train", "--resume"], "--resume without RUN_DIR continues the run in --out: give --out RUN_DIR"),
    (["train", "--runtime", "distributed", "--resume", "/nonexistent/run"], "/nonexistent/run is not a run folder"),
    (["train", "--runtime", "distributed", "--stages", "9", *QUICK], "9 stages need at least 9 layers with parameters"),
    (["train", "--clip-grad", "0", *QUICK], "--clip-grad must be a positive max norm (or none), got 0.0"),
    (["train", "--clip-grad", "lots", *QUICK], "expected a max norm or none, got 'lots'"),
    (["train", "--clip-grad", "none", "--clip-scope", "stage", *QUICK], "--clip-scope applies with clipping: drop --clip-grad none"),
    (["train", "--lr-schedule", "cosine"], "invalid choice: 'cosine'"),
    (["train", "--lr-schedule", "constant", "--warmup-steps", "5", *QUICK],
     "--warmup-steps needs --lr-schedule warmup-cosine or step"),
    (["train", "--lr-schedule", "warmup-cosine", "--warmup-steps", "500", "--epochs", "1", *QUICK],
     "--warmup-steps 500 leaves no update after the warm-up (10 updates in the run)"),
    (["train", "--precision", "fp8"], "invalid choice: 'fp8'"),
    (["train", "--device", "cuda:7", *QUICK], "device cuda:7 does not exist"),
    (["train", "--device", "cpu,cpu,cpu", "--stages", "4", *QUICK], "--device lists 3 devices for 4 stages"),
    (["train", "--runtime", "distributed", "--lr-schedule", "warmup-cosine", "--warmup-steps", "500", "--epochs", "1",
      *QUICK],
     "--warmup-steps 500 leaves no update after the warm-up (10 updates in the run)"),
    (["train", "--lr-correction", "pipemare"], "invalid choice: 'pipemare'"),
    (["train", "--clip-scope", "global"],
     "--clip-scope applies with clipping, and the image recipe does not clip: give --clip-grad MAX_NORM"),
    (["train", "--method", "pipeoptim", "--clip-grad", "1", "--clip-scope", "global"],
     "--clip-scope global needs every stage to update the same mini-batch at once"),
    (["train", "--horizon", "future"], "invalid choice: 'future'"),
    (["train", "--delta", "adam"], "invalid choice: 'adam'"),
    (["train", "--method", "pipeoptim", "--lr-correction", "delay", "--lr-correction-steps", "0"],
     "--lr-correction-steps must be a number of updates >= 1, got 0"),
    (["train", "--method", "pipeoptim", "--lr-correction-steps", "10"], "--lr-correction-steps applies with --lr-correction 'delay'"),
    (["train", "--method", "pipeoptim", "--delta", "ema", "--ema-decay", "1.0"], "--ema-decay must lie strictly between 0 and 1"),
    (["train", "--method", "pipeoptim", "--ema-decay", "0.5"], "--ema-decay applies with --delta 'ema'"),
    (["train", "--method", "pipeoptim", "--prediction-warmup", "-2"], "--prediction-warmup must be 0 (off)"),
    (["train", "--method", "pipeoptim", "--sync-warmup", "-1"], "--sync-warmup must be 0 (off)"),
    (["train", "--method", "gpipe", "--sync-warmup", "3"],
     "--sync-warmup applies to async-naive, pipedream, spectrain, xpipe, pipeoptim, not gpipe"),
    (["train", "--method", "pipedream", "--delta", "ema"], "--delta applies to spectrain, xpipe, pipeoptim, not pipedream"),
    (["train", "--eval-every", "0"], "--eval-every must be at least 1, got 0"),
    (["train", "--holdout", "-5"], "--holdout must be at least 1, got -5"),
    (["train", "--holdout", "60000", *QUICK],
     "holdout must be between 1 and 59999 (the 60000 training images, one left to train on), got 60000"),
    (["train", "--task", "translation", "--holdout", "100000", "--limit", "64"],
     "holdout must be between 1 and 702 (pairs of the fixed validation split), got 100000"),
    (["train", "--continuous", "--eval-every", "2", *QUICK], "--continuous never drains, so it cannot evaluate"),
    (["train", "--runtime", "distributed", "--continuous", "--eval-every", "2", *QUICK],
     "--continuous never drains, so it cannot evaluate"),
    (["train", "--runtime", "distributed", "--holdout", "60000", *QUICK],
     "holdout must be between 1 and 59999 (the 60000 training images, one left to train on), got 60000"),
    (["compare", "--eval-every", "-1"], "--eval-every must be at least 1, got -1"),
    (["compare", "--methods", "gpipe,pipeoptim", "--continuous", "--eval-every", "2", *QUICK],
     "--continuous never drains, so it cannot evaluate"),
    (["train", "--task", "lm", "--model", "gpt-tied-small", "--stages", "9", "--limit", "64", "--no-progress"],
     "9 stages need 9 candidate points; TiedGPT has 7 (tok, pos, drop, blocks.0, blocks.1, norm, head)"),
    (["bench", "--task", "lm", "--model", "gpt-tied-small", "--stages", "2"], "bench one of gpt, gpt-small, "
                                                                               "gpt-narrow, or train gpt-tied-small"),
    # bench's --compile takes a backend as train's does; with and without is --ablate compile
    (["bench", "--compile", "both"], "argument --compile: invalid choice: 'both'"),
    (["bench", "--ablate", "compile,recompute,sharded"], "--ablate takes comma-separated settings of compile, "
                                                        "recompute, shard-replicas, tensor-parallel, got 'compile,recompute,sharded'"),
    (["compare", "--methods", "pipeoptim,warp"], "unknown method warp"),
    (["compare", "--methods", "gpipe,sequential", "--steps", "code"], "--steps applies to none of gpipe, sequential"),
    (["schedule", "nope"], "unknown schedule or method"),
    (["schedule", "gpipe", "--stages", "0"], "must be"),
    (["schedule", "interleaved-1f1b", "--stages", "4", "--micro-batches", "6"], "multiple of the ranks"),
    (["schedule", "2bw", "--stages", "4", "--micro-batches", "2"], "m >= stages N"),
]


def exit_code(argv):
    """main()'s return value, or the code argparse exits with for options it rejects itself."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("argv,expected", CASES, ids=[" ".join(c[0][:3]) for c in CASES])
def test_bad_input_exits_2_with_one_line(argv, expected, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a default run folder (runs/...) would go
    code = exit_code(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert not (tmp_path / "runs").exists(), "bad input must be refused before a run folder is made"
    assert expected in err, err
    assert "Traceback" not in err
    message_lines = [l for l in err.splitlines() if "error:" in l]  # (not the usage line's --error-feedback)
    assert len(message_lines) == 1, err


def test_missing_data_set_names_the_install_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIPEOPTIM_FASHION_MNIST_DIR", str(tmp_path))
    from pipeoptim.lab.tasks import image
    image._load_arrays_cached.cache_clear()
    assert main(["train", *QUICK]) == 2
    err = capsys.readouterr().err
    assert "apt-get install --no-install-recommends dataset-fashion-mnist" in err
    assert "Traceback" not in err


def test_output_folder_of_another_run_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "summary.json").write_text("{}")
    assert main(["train", *QUICK, "--out", str(tmp_path)]) == 2
    assert "already holds a run; choose another --out or pass --overwrite" in capsys.readouterr().err


def test_resume_continues_a_cli_run_to_the_same_losses(tmp_path, capsys):
    common = ["train", *QUICK, "--method", "pipeoptim", "--stages", "2", "--epochs", "2",
              "--checkpoint-every", "3", "--json"]
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    full = json.loads(capsys.readouterr().out)["losses"]
    assert main([*common, "--out", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    roll_back_to_older_checkpoint(tmp_path / "b")  # as if the run had died after its first one
    assert main(["train", "--resume", str(tmp_path / "b"), "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["losses"] == full


def test_resume_without_a_folder_starts_the_run_in_out_and_continues_it_there(tmp_path, capsys):
    """One command line for the first start and every restart: ``--resume --out RUN`` trains from the
    beginning where RUN has no checkpoint, and continues from its newest one where it has."""
    again = ["train", *QUICK, "--method", "pipeoptim", "--stages", "2", "--epochs", "2", "--checkpoint-every", "3",
             "--json", "--out", str(tmp_path / "run"), "--resume"]
    assert main(again) == 0
    captured = capsys.readouterr()
    full = json.loads(captured.out)["losses"]
    assert f"pipeoptim: no checkpoint in {tmp_path / 'run' / 'checkpoints'} yet: training from the beginning" \
        in captured.err
    roll_back_to_older_checkpoint(tmp_path / "run")  # as if the run had died after its first one
    older = json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())["checkpoint"]
    assert main(again) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["losses"] == full
    assert older == "epoch0001-batch000009"  # (the two newest are kept)
    assert f"pipeoptim: resumed from {tmp_path / 'run' / 'checkpoints' / older} (epoch 1, mini-batch 9) (2 stages on 1 " \
           f"process)\n" in captured.err
