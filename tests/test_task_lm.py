"""Language-model task: chapter split, token blocks, GPT blocks, perplexity, a pipelined run, the CLI."""
from __future__ import annotations

import importlib.util
import inspect
import json
import math
import shutil

import pytest
import torch
from torch import nn

from pipeoptim.lab.tasks import get_task
from pipeoptim.lab.tasks.base import TaskData
from pipeoptim.lab.tasks.lm import (
    LanguageModelTask,
    chapters_by_split,
    make_blocks,
    perplexity,
    split_of_chapter,
    token_stream,
    unigram_perplexity,
)
from pipeoptim.lab.tasks.text import EOS_ID

HAS_DATA = shutil.which("mod2imp") is not None and importlib.util.find_spec("sentencepiece") is not None
needs_data = pytest.mark.skipif(not HAS_DATA, reason="needs mod2imp + the WEB Bible (sudo apt-get install "
                                                     "--no-install-recommends sword-text-web libsword-utils) "
                                                     "and pip install sentencepiece")
V, T = 50, 12  # a tiny vocabulary and sequence length for model tests


# ---------------------------------------------------------------------------------------------
# data


def test_split_is_by_chapter_stable_and_about_five_percent():
    verses = {f"Book{b} {c}:{v}": f"Book{b} {c}:{v}" for b in range(20) for c in range(1, 51) for v in range(1, 4)}
    split = chapters_by_split(verses)
    keys = {name: [key for key, _ in chapters] for name, chapters in split.items()}
    assert not set(keys["train"]) & set(keys["valid"])
    assert len(keys["train"]) + len(keys["valid"]) == 1000
    assert 0.03 < len(keys["valid"]) / 1000 < 0.07
    for name, chapters in split.items():
        for key, texts in chapters:  # all verses of a chapter, in order, in the chapter's split
            assert texts == [f"{key}:{v}" for v in range(1, 4)] and split_of_chapter(key) == name
    # an MD5 of the key, not Python's salted hash(): the same values on every run and machine
    assert [c for c in range(1, 51) if split_of_chapter(f"Genesis {c}") == "valid"] == [5]
    assert [split_of_chapter(k) for k in ("Genesis 1", "Psalms 119", "John 3")] == ["train"] * 3


def test_token_stream_ends_each_chapter_with_eos():
    class Pieces:  # a stand-in for a sentencepiece processor: one piece per character
        @staticmethod
        def encode(texts):
            return [[10 + ord(ch) - ord("a") for ch in t] for t in texts]

    stream = token_stream(Pieces(), [("A 1", ["ab", "c"]), ("A 2", ["d"])])
    assert stream.dtype == torch.long
    assert stream.tolist() == [10, 11, 12, EOS_ID, 13, EOS_ID]


def test_blocks_are_shifted_by_one_and_cover_every_target_once():
    stream = torch.arange(23)
    x, y = make_blocks(stream, 5)
    assert x.shape == y.shape == (4, 5) and x.dtype == torch.long
    assert x[0].tolist() == [0, 1, 2, 3, 4] and y[0].tolist() == [1, 2, 3, 4, 5]
    assert x[1].tolist() == [5, 6, 7, 8, 9] and y[1].tolist() == [6, 7, 8, 9, 10]
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert y.flatten().tolist() == list(range(1, 21))  # the incomplete tail (21, 22) is dropped


def test_unigram_perplexity_by_hand():
    train, valid = torch.tensor([1, 1, 2]), torch.tensor([1, 2])
    # p(1) = 2/3, p(2) = 1/3: exp(-(ln 2/3 + ln 1/3) / 2) = sqrt(9/2)
    assert unigram_perplexity(train, valid, vocab_size=3, smoothing=0.0) == pytest.approx(math.sqrt(4.5))
    # add-one over 3 pieces: p(1) = 3/6, p(2) = 2/6: sqrt(6)
    assert unigram_perplexity(train, valid, vocab_size=3) == pytest.approx(math.sqrt(6.0))
    assert unigram_perplexity(train, torch.tensor([0]), vocab_size=3, smoothing=0.0) == math.inf
    # a uniform unigram model has the vocabulary size as its perplexity
    assert unigram_perplexity(torch.arange(4), torch.tensor([0, 3, 3]), vocab_size=4, smoothing=0.0) == \
        pytest.approx(4.0)


# ---------------------------------------------------------------------------------------------
# model, loss, metric


def _data(n: int = 8, seed: int = 0) -> TaskData:
    g = torch.Generator().manual_seed(seed)
    x, y = make_blocks(torch.randint(4, V, (n * T + 1,), generator=g), T)
    return TaskData(train=[(x, y)], test=[(x[: n // 2], y[: n // 2]), (x[n // 2 :], y[n // 2 :])],
                    info={"vocab_size": V, "seq_len": T})


def test_task_attributes():
    task = get_task("lm")
    assert isinstance(task, LanguageModelTask)
    assert task.metric == "perplexity" and task.higher_is_better is False
    assert task.default_model == "gpt" and set(task.model_names()) >= {"gpt", "gpt-small"}
    with pytest.raises(ValueError, match="gpt-small"):
        task.build_model("nope", _data(), seed=0)


@pytest.mark.parametrize("name,min_blocks", [("gpt", 9), ("gpt-small", 3), ("gpt-narrow", 9)])
def test_model_is_a_sequential_of_one_argument_blocks(name, min_blocks):
    task = LanguageModelTask()
    data = _data()
    model = task.build_model(name, data, seed=0)
    assert isinstance(model, nn.Sequential) and len(model) >= min_blocks
    for block in model:
        assert len(inspect.signature(block.forward).parameters) == 1
    x, y = data.train[0]
    h = x
    for block in model:
        h = block(h)
        assert isinstance(h, torch.Tensor)
    assert h.shape == (8, T, V)
    assert 3.0 < task.loss(h, y).item() < 4.8  # about ln(50) = 3.9 at initialisation
    same = task.build_model(name, data, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), same.state_dict().values()))


def test_gpt_tied_is_a_module_with_a_list_of_blocks_and_a_tied_head():
    """Not an nn.Sequential: the Pipeline traces it; the sequential models stay as they were."""
    task = LanguageModelTask()
    assert tuple(task.traced_model_names()) == ("gpt-tied", "gpt-tied-small")
    model = task.build_model("gpt-tied", _data(), seed=0)
    assert not isinstance(model, nn.Sequential) and isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == 8
    assert model.head.weight is model.tok.weight and model.head.bias is None
    x, y = _data().train[0]
    assert model(x).shape == (8, T, V) and 3.0 < task.loss(model(x), y).item() < 4.8
    same = task.build_model("gpt-tied", _data(), seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), same.state_dict().values()))
    # gpt's numbers: d 128, 8 blocks, its own head (with a bias)
    gpt = task.build_model("gpt", _data(), seed=0)
    assert sum(p.numel() for p in gpt.parameters()) - sum(p.numel() for p in model.parameters()) == 128 * V + V


def test_model_is_causal():
    model = LanguageModelTask().build_model("gpt", _data(), seed=0).eval()
    x = _data().train[0][0][:2]
    changed = x.clone()
    changed[:, 7:] = 5
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.allclose(a[:, :7], b[:, :7], atol=1e-5)
    assert not torch.allclose(a[:, 7:], b[:, 7:], atol=1e-3)


def test_loss_is_the_token_mean_and_splits_into_micro_batches():
    task = LanguageModelTask()
    torch.manual_seed(0)
    logits, target = torch.randn(4, T, V), torch.randint(0, V, (4, T))
    full = task.loss(logits, target)
    assert torch.allclose(full, nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1)))
    halves = 0.5 * task.loss(logits[:2], target[:2]) + 0.5 * task.loss(logits[2:], target[2:])
    assert torch.allclose(full, halves)


def test_perplexity_is_exp_of_the_mean_token_nll():
    class Fixed(nn.Module):
        """Log-probabilities ln(1/2) for token 1 and ln(1/4) for tokens 2 and 3, everywhere."""

        def forward(self, x):
            logits = torch.full((*x.shape, 4), -1e9)
            logits[..., 1] = math.log(0.5)
            logits[..., 2:] = math.log(0.25)
            return logits

    batches = [(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[1, 2]])),
               (torch.zeros(1, 2, dtype=torch.long), torch.tensor([[3, 3]]))]
    # NLL: ln 2, ln 4, ln 4, ln 4 -> mean (7/4) ln 2 -> perplexity 2 ** 1.75
    assert perplexity(Fixed(), batches) == pytest.approx(2 ** 1.75)
    assert math.isnan(perplexity(Fixed(), []))


def test_compare_table_names_the_direction():
    from pipeoptim.cli.compare import format_table

    row = {"method": "sequential", "final_metric": 80.0, "best_metric": 75.0, "final_loss": 4.4,
           "weight_copies": [1], "samples_per_second": 100.0}
    assert "best perplexity (lowest)" in format_table([row], "perplexity", higher_is_better=False)
    assert "best accuracy " in format_table([row], "accuracy") + " "


# ---------------------------------------------------------------------------------------------
# real data


@pytest.fixture(scope="module")
def real_data():
    if not HAS_DATA:
        pytest.skip("needs mod2imp, the WEB Bible and sentencepiece")
    return LanguageModelTask().load(batch_size=16, limit=256, seed=0)


@needs_data
def test_real_data_split_blocks_and_small_info(real_data):
    from pipeoptim.lab.tasks.bible import EN_MODULE, read_verses

    split = chapters_by_split(read_verses(EN_MODULE))
    train_keys = {k for k, _ in split["train"]}
    valid_keys = {k for k, _ in split["valid"]}
    assert not train_keys & valid_keys and len(train_keys) + len(valid_keys) == 1388
    info = real_data.info
    sizes = info["sizes"]
    assert sizes["chapters_train"] == len(train_keys) and sizes["chapters_valid"] == len(valid_keys)
    assert sizes["train"] == 256 and len(real_data.train) == 256 // 16
    assert sizes["valid"] == (sizes["tokens_valid"] - 1) // 64 and sum(y.shape[0] for _, y in real_data.test) == sizes["valid"]
    assert info["vocab_size"] == 2000 and info["seq_len"] == 64
    for x, y in real_data.train + real_data.test:
        assert x.dtype == y.dtype == torch.long and x.shape == y.shape and x.shape[1] == 64
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert all(x.shape[0] == 16 for x, _ in real_data.train)
    assert 200 < info["unigram_perplexity"] < 1000
    assert len(json.dumps(info)) < 1000  # sizes and source, never the text


@needs_data
def test_pipeoptim_two_stages_lowers_the_perplexity(real_data):
    from pipeoptim.lab.config import RunConfig
    from pipeoptim.lab.experiment import run_experiment

    task = LanguageModelTask()
    before = task.evaluate(task.build_model("gpt-small", real_data, seed=0), real_data)
    cfg = RunConfig(task="lm", model="gpt-small", method="pipeoptim", stages=2, optimizer="adam", lr=3e-3,
                    epochs=2, batch_size=16, limit=256, seed=0)
    summary = run_experiment(cfg, out_dir=None, show_progress=False, log=lambda *a, **k: None,
                             task=task, data=real_data)
    after = [e["metric"] for e in summary["epochs_detail"]]
    assert summary["stages"] == 2 and summary["metric"] == "perplexity"
    assert 1500 < before < 2500                    # about the vocabulary size at initialisation
    assert after[1] < after[0] < 0.5 * before      # falls in each epoch
    assert after[1] < 600                           # measured: 503 (unigram: 470)
    assert summary["best_metric"] == min(after)


def _train(tmp_path, capfd, *args: str) -> dict:
    """The summary of ``pipeoptim train --task lm --model gpt-tied-small ... --json ARGS`` on 64
    blocks in mini-batches of 16 (a distributed run's rank 0 prints it)."""
    from pipeoptim.cli import main

    out = tmp_path / "-".join(arg.strip("-") for arg in args)
    assert main(["train", "--task", "lm", "--model", "gpt-tied-small", "--limit", "64", "--batch-size", "16",
                 "--optimizer", "adam", "--json", "--no-progress", "--out", str(out), *args]) == 0
    return json.loads(capfd.readouterr().out)


@needs_data
def test_gpt_tied_trains_traced_under_1f1b_flush_equal_to_sequential():
    """The traced, tied GPT through the lab's run (run_experiment, as the command line runs it, on
    the same data): 1f1b-flush on 4 stages (the tied head on another stage than the embedding)
    equals sequential, losses and perplexity. (Under torchrun: the command line's distributed run
    of this model below, with the asynchronous method; the tied GPT under 1f1b-flush on 2
    processes, equal to its sequential training, in tests/test_traced.py's torchrun job.)"""
    from pipeoptim.lab.config import RunConfig
    from pipeoptim.lab.experiment import run_experiment

    task = LanguageModelTask()
    data = task.load(batch_size=16, limit=64, seed=0)

    def train(method, stages=None):
        cfg = RunConfig(task="lm", model="gpt-tied-small", method=method, stages=stages, optimizer="adam",
                        epochs=1, batch_size=16, limit=64, seed=0)
        return run_experiment(cfg, out_dir=None, show_progress=False, log=lambda *a, **k: None, task=task, data=data)

    expected, local = train("sequential"), train("1f1b-flush", 4)
    assert local["partition"] == [3, 1, 1, 2]  # units per stage
    assert len(expected["losses"]) == 4 and expected["losses"][-1] < expected["losses"][0]
    assert local["losses"] == pytest.approx(expected["losses"], rel=1e-5)
    assert local["final_metric"] == pytest.approx(expected["final_metric"], rel=1e-4)


@needs_data
def test_cli_trains_the_tied_gpt_with_pipeoptim_locally_as_on_two_processes(tmp_path, capfd):
    """`pipeoptim train --task lm --json`: the summary names the task, its metric (perplexity,
    lower is better) per epoch, and the run folder holds summary.json and curves.png. The tied GPT
    with the asynchronous headline method: the head (on the last stage) reads the embedding's
    predicted version from its owner, stage 0; one process and two (`--runtime distributed`, the
    traced model cut at the same point) give the same losses and metric, and it learns."""
    local = _train(tmp_path, capfd, "--method", "pipeoptim", "--stages", "2", "--epochs", "2")
    assert local["task"] == "lm" and local["metric"] == "perplexity" and local["higher_is_better"] is False
    metrics = [e["metric"] for e in local["epochs_detail"]]
    assert len(metrics) == 2 and all(math.isfinite(m) for m in metrics)
    assert local["best_metric"] == min(metrics) and local["final_metric"] == metrics[-1]
    run = tmp_path / "method-pipeoptim-stages-2-epochs-2"
    assert (run / "summary.json").exists() and (run / "curves.png").exists()
    assert len(local["losses"]) == 8 and local["losses"][-1] < local["losses"][0]
    distributed = _train(tmp_path, capfd, "--method", "pipeoptim", "--stages", "2", "--epochs", "2",
                         "--runtime", "distributed")
    assert distributed["runtime"] == "distributed" and distributed["partition"] == local["partition"] == [4, 3]
    assert distributed["losses"] == pytest.approx(local["losses"], rel=1e-5)
    assert distributed["final_metric"] == pytest.approx(local["final_metric"], rel=1e-4)
