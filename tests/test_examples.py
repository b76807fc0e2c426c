"""The examples a user copies run as they are: the Fashion-MNIST script on a few hundred images,
and the transformers GPT-2 script on a tiny config, in one process and under torchrun (2 stages x
2 replicas, sharded: in the job of tests/test_sharding.py), to the same losses, its exports loading
back into GPT-2's own class; and the README's quickstart, run as a newcomer runs it, prints what
the README shows, to the digits shown."""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from conftest import load_script
from torchrun_jobs import run_here

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
EXAMPLE = EXAMPLES / "fashion_mnist_pipeline.py"
GPT2 = EXAMPLES / "transformers_causal_lm.py"

#: the GPT-2 example's tiny config: dropout off, so that every launcher draws the same losses
TINY = ["--layers", "2", "--width", "32", "--heads", "4", "--vocab", "64", "--seq", "16", "--sequences", "64",
        "--batch-size", "8", "--epochs", "1", "--dropout", "0"]


def test_the_fashion_mnist_example_trains_and_reports_test_accuracy():
    lines = run_here(EXAMPLE, "--limit", "384", "--epochs", "2").strip().splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["epoch 1", "epoch 2"]
    final = re.match(r"test accuracy (\d\.\d+) after 12 updates, \d+ samples/s, "
                     r"weight copies per stage \[2\.0, 2\.0, 2\.0, 1\.0\]", lines[-1])
    assert final, lines[-1]
    assert 0.1 < float(final.group(1)) <= 1.0  # ten classes: above chance after 12 updates


def gpt2_run(out: Path, *extra: str) -> Dict[str, object]:
    """Run the GPT-2 example on the tiny config in one process (the pytest process: no start of
    its own) and read what it printed."""
    return printed(run_here(GPT2, *TINY, "--out", out, *extra))


def printed(stdout: str) -> Dict[str, object]:
    """The epoch losses, the summary line's fields and the export line the GPT-2 example printed."""
    lines = stdout.strip().splitlines()
    epochs: List[float] = [float(m.group(1)) for line in lines if (m := re.match(r"epoch \d+: loss (\S+)$", line))]
    summary = [m for line in lines if (m := re.match(
        r"(\S+) on (\d+) stages x (\d+) replica\(s\): (\d+) updates, final loss (\S+)$", line))]
    assert len(summary) == 1, stdout
    method, stages, replicas, updates, final = summary[0].groups()
    return {"epochs": epochs, "method": method, "stages": int(stages), "replicas": int(replicas),
            "updates": int(updates), "final": float(final), "export": lines[-1]}




def test_the_readme_shows_what_its_quickstart_prints(tmp_path):
    """The README's quickstart command (its first run of this example, with the example's own
    defaults) as a newcomer runs it: in a terminal (the progress bars drawn, stdout and stderr in
    the order they come), the newcomer's plain environment (no thread count, which the tests
    otherwise set: torch's own), from a folder of its own (its runs/ there). Every line the README
    shows is the terminal's, to the digits shown (timings and bars by pattern: the script's
    VOLATILE), and nothing else appeared."""
    newcomer = load_script("newcomer")  # its README reader, terminal and comparison
    command = next(c for c in newcomer.commands((ROOT / "README.md").read_text())
                   if c.argv()[:2] == ["python", "examples/transformers_causal_lm.py"])
    assert command.shown and "..." not in command.shown  # every line shown: the whole output
    env = newcomer.plain_env()
    env["PYTHONPATH"] = str(ROOT / "src")  # this checkout's package (the environment's editable one is the same)
    status, raw = newcomer.run_in_terminal([sys.executable, str(ROOT / command.argv()[1]), *command.argv()[2:]],
                                           tmp_path, env, timeout=300)
    seen = newcomer.screen(raw)
    assert status == 0, raw[-4000:]
    problem = newcomer.difference(command.shown, seen)
    assert problem is None, f"README.md:{command.line}: {problem}\n--- the terminal showed ---\n" + "\n".join(seen)
    assert (tmp_path / "runs" / "gpt2-example" / "model.pt").exists()  # its own folder, under the run's


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt2-one") / "run"
    return out, gpt2_run(out)


def test_the_gpt2_example_trains_and_its_checkpoint_loads_strictly_into_gpt2(one_process):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    out, run = one_process
    assert (run["stages"], run["replicas"], run["updates"]) == (2, 1, 8)  # 64 sequences, 8 a mini-batch
    assert len(run["epochs"]) == 1 and run["final"] < 4.2  # log(64) = 4.16 at the start: it learns
    assert run["export"].endswith("loaded with strict=True; save_pretrained -> "
                                  f"{out / 'hf'}; the same logits from all three: True"), run["export"]
    # what the script exported, loaded here again with nothing but torch and transformers
    config = GPT2Config.from_pretrained(out / "hf")
    fresh = GPT2LMHeadModel(config)
    fresh.load_state_dict(torch.load(out / "model.pt", weights_only=False)["model"], strict=True)
    loaded = GPT2LMHeadModel.from_pretrained(out / "hf")
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[name]), name


def test_the_synchronous_default_trains_as_plain_training(one_process, tmp_path):
    """The default method is a synchronous pipeline: its losses are those of the model trained in
    one piece (``sequential``, one stage) on the same mini-batches."""
    _, run = one_process
    plain = gpt2_run(tmp_path / "run", "--method", "sequential", "--stages", "1")
    assert plain["method"] == "sequential"
    assert run["epochs"] == pytest.approx(plain["epochs"], rel=1e-5, abs=2e-6)
    assert run["final"] == pytest.approx(plain["final"], rel=1e-5, abs=2e-6)


def test_the_gpt2_example_under_torchrun_sharded_2x2_gives_the_one_process_losses(one_process, torchrun_4):
    """`torchrun --nproc-per-node 4 ... --shard-replicas`: 2 stages x 2 replicas, each stage
    sharded over its replicas (FSDP2), each replica reading half of every mini-batch. The script
    runs as its `__main__` in the 4 processes of tests/test_sharding.py's script, itself a script of
    the session's 4-process job (a job of its own would cost more to start than its training),
    which returns what rank 0 printed."""
    from test_sharding import sharded_job

    _, run = one_process
    row = sharded_job(torchrun_4)["gpt2-example"]
    assert "error" not in row, row.get("error")
    sharded = printed(row["stdout"])
    assert (sharded["method"], sharded["stages"], sharded["replicas"], sharded["updates"]) == \
        (run["method"], 2, 2, run["updates"])
    assert sharded["epochs"] == pytest.approx(run["epochs"], rel=1e-5, abs=2e-6)
    assert sharded["final"] == pytest.approx(run["final"], rel=1e-5, abs=2e-6)
    assert sharded["export"].endswith("the same logits from all three: True"), sharded["export"]


SEQ2SEQ = EXAMPLES / "transformers_seq2seq.py"
#: the BART example's small run: 8 updates, a validation loss every 4, dropout off (so that the one-piece
#: model draws the same)
SEQ2SEQ_SMALL = ["--pairs", "128", "--epochs", "1", "--eval-every", "4", "--width", "32", "--heads", "2",
                 "--dropout", "0"]


def seq2seq_run(out: Path, *extra: str) -> List[str]:
    """The BART example's small run in the pytest process; the lines it printed."""
    return run_here(SEQ2SEQ, *SEQ2SEQ_SMALL, "--out", out, *extra).strip().splitlines()


def test_the_seq2seq_example_trains_on_padded_batches_as_the_whole_model_does(tmp_path):
    """The encoder-decoder example (BART) as it comes (labels only, padded rows): the default method on 2
    stages reports the validation loss before training and every 4 mini-batches, its losses are
    those of the model trained in one piece on the same mini-batches (every token weighed once,
    whatever the micro-batches hold), and its checkpoint loads strictly into BART's class."""
    lines = seq2seq_run(tmp_path / "pipe")
    plain = seq2seq_run(tmp_path / "plain", "--method", "sequential", "--stages", "1")
    validation = [line for line in lines if "validation loss" in line]
    assert [line.split(":")[0] for line in validation] == ["before training", "mini-batch 4", "mini-batch 8"]
    summary = re.match(r"zb-h1 on 2 stages, cut at \['model.decoder.embed_positions'\]: 8 updates, "
                       r"final loss (\S+)$", lines[-2])
    assert summary, lines[-2]
    plain_final = re.search(r"final loss (\S+)$", plain[-2])
    assert float(summary.group(1)) == pytest.approx(float(plain_final.group(1)), rel=1e-5)
    values = lambda out: [float(line.rsplit(" ", 1)[1]) for line in out if "validation loss" in line]  # noqa: E731
    assert values(lines) == pytest.approx(values(plain), rel=1e-5)
    assert lines[-1].endswith("loaded with strict=True, the same logits from both: True"), lines[-1]
