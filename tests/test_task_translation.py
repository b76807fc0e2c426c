"""Translation task: mod2imp parsing, alignment, hashed split, models, decoding, BLEU, real data."""
from __future__ import annotations

import importlib.util
import inspect
import shutil

import pytest
import torch
from torch import nn

from pipeoptim.lab.tasks import get_task
from pipeoptim.lab.tasks.base import TaskData
from pipeoptim.lab.tasks.bible import clean_osis
from pipeoptim.lab.tasks.translation import (
    BOS_ID,
    EOS_ID,
    TranslationTask,
    align,
    bleu_chrf,
    greedy_decode,
    make_batches,
    parse_mod2imp,
    split_of,
    train_sentencepiece,
)

HAS_SPM = importlib.util.find_spec("sentencepiece") is not None
HAS_SACREBLEU = importlib.util.find_spec("sacrebleu") is not None
HAS_SWORD = shutil.which("mod2imp") is not None

EN_IMP = """$$$[ Module Heading ]

$$$[ Testament 1 Heading ]
<milestone type="x-importer" subType="x-osis2mod" n="$Rev: 3769 $ (SWORD: 1.9.0)"/>
$$$Genesis 0:0
<div sID="gen2" type="front"/> <title level="1" type="main">Preface</title> Introduction text.
$$$Genesis 1:0
<chapter n="1" osisID="Gen.1" sID="Gen.1"/> <title type="main">The Creation</title>
$$$Genesis 1:1
<w lemma="strong:H0430">In</w> <w lemma="strong:H0853">the</w> <w lemma="strong:H7225">beginning</w>, <w lemma="strong:H0430">God</w><note placement="foot"><reference type="annotateRef">1:1 </reference>The Hebrew word rendered “God” is “Elohim”.</note><w lemma="strong:H1254">created</w> the earth.
$$$Genesis 1:3
<div type="x-milestone" subType="x-preverse" sID="pv1"/><div sID="gen26" type="x-p"/><w>God</w> <w>said</w>, “<w>Let</w> <w>there</w> <w>be</w> <w>light</w>,” and there was light<note type="crossReference">2 Cor 4:6</note> .
$$$Psalms 3:1
<title canonical="true" type="psalm">A Psalm by David.</title> <lg sID="g1"/> <l level="1" sID="g2"/>Yahweh, how my adversaries have increased!<l eID="g2" level="1"/>
$$$Song of Solomon 1:2
<speaker>Beloved</speaker> <l level="1" sID="g3"/>Let him kiss me.
$$$Revelation of John 22:21
The grace of the Lord be with all. Amen. <chapter eID="Rev.22"/><div eID="g9" type="x-p"/> <div canonical="true" eID="g8" osisID="Rev" type="book"/> <title level="1" type="main">Glossary</title> Abba is a word.
$$$Tobit 1:1
Only in the English Bible.
"""

ES_IMP = """$$$Genesis 0:0
<title level="1" type="main">Génesis</title>
$$$Genesis 1:1
<w lemma="strong:H7225">EN el principio</w> <w lemma="strong:H1254">crió</w> <w>Dios</w> <transChange type="added">la</transChange> tierra.
$$$Genesis 1:3
<w>Y dijo</w> <w>Dios</w>: <w>Sea</w> <w>la luz</w>: <w>y fué</w> <w>la luz</w>.
$$$Psalms 3:1
<w>Salmo de David</w>. ¡<w>OH</w> <w>Jehová</w>, cuánto se han multiplicado mis enemigos!
$$$Song of Solomon 1:2
<w>Oh si él me besara</w>.
$$$Revelation of John 22:21
La gracia sea con todos. <w>Amén</w>.  <chapter eID="Rev.22"/>
$$$Genesis 2:1
<note placement="foot">only a note</note>
"""


def test_parse_mod2imp_en():
    en = parse_mod2imp(EN_IMP)
    assert en == {
        "Genesis 1:1": "In the beginning, God created the earth.",
        "Genesis 1:3": "God said, “Let there be light,” and there was light.",
        "Psalms 3:1": "A Psalm by David. Yahweh, how my adversaries have increased!",
        "Song of Solomon 1:2": "Let him kiss me.",
        "Revelation of John 22:21": "The grace of the Lord be with all. Amen.",
        "Tobit 1:1": "Only in the English Bible.",
    }


def test_parse_mod2imp_es_and_align():
    es = parse_mod2imp(ES_IMP)
    assert es["Genesis 1:1"] == "EN el principio crió Dios la tierra."
    assert es["Genesis 1:3"] == "Y dijo Dios: Sea la luz: y fué la luz."
    assert "Genesis 0:0" not in es and "Genesis 2:1" not in es  # verse 0; empty after cleaning
    pairs = align(parse_mod2imp(EN_IMP), es)
    assert [k for k, _, _ in pairs] == ["Genesis 1:1", "Genesis 1:3", "Psalms 3:1", "Song of Solomon 1:2",
                                        "Revelation of John 22:21"]
    assert pairs[-1] == ("Revelation of John 22:21", "The grace of the Lord be with all. Amen.",
                         "La gracia sea con todos. Amén.")


def test_clean_osis_rules():
    assert clean_osis("<w>word</w><note>n</note><w>next</w>") == "word next"
    assert clean_osis("a  <w>b</w> ,\n c ;  d ”") == "a b, c; d”"
    assert clean_osis('<title type="main">Heading</title> text') == "text"
    assert clean_osis('<title canonical="true" type="psalm">Title.</title> text') == "Title. text"


def test_split_is_stable_and_balanced():
    keys = [f"Book{b} {c}:{v}" for b in range(5) for c in range(1, 21) for v in range(1, 31)]  # 3,000 keys
    splits = [split_of(k) for k in keys]
    assert splits == [split_of(k) for k in keys]  # deterministic
    assert split_of("Genesis 1:1") == split_of("Genesis 1:1")
    # fixed values: md5 of the key, not Python's salted hash()
    assert [split_of(k) for k in ("Genesis 1:1", "Genesis 1:2", "Genesis 1:6", "John 3:16")] == \
        ["train", "test", "valid", "train"]
    counts = {s: splits.count(s) for s in ("train", "valid", "test")}
    assert sum(counts.values()) == 3000
    assert 0.87 < counts["train"] / 3000 < 0.93
    assert 0.03 < counts["valid"] / 3000 < 0.07 and 0.03 < counts["test"] / 3000 < 0.07
    # each key in exactly one split: no leak
    groups = {s: {k for k, t in zip(keys, splits) if t == s} for s in counts}
    assert not (groups["train"] & groups["valid"]) and not (groups["train"] & groups["test"])
    assert not (groups["valid"] & groups["test"])


# ---------------------------------------------------------------------------------------------
# models

V = 40  # a tiny vocabulary for model tests


def _toy_batches(n: int = 16, length: int = 6, seed: int = 0):
    """A copy task with a shift: target = source tokens + 10; (pair, src pieces, tgt pieces)."""
    g = torch.Generator().manual_seed(seed)
    encoded = []
    for i in range(n):
        k = int(torch.randint(2, length + 1, (1,), generator=g))
        src = torch.randint(4, 20, (k,), generator=g).tolist()
        encoded.append(((f"k{i}", "", ""), src, [t + 10 for t in src]))
    return make_batches(encoded, length, batch_size=n)


@pytest.mark.parametrize("name", ["transformer", "transformer-deep", "gnmt"])
def test_model_shapes_and_blocks(name):
    task = get_task("translation")
    data = TaskData(train=_toy_batches(), test=[], info={"vocab_size": V})
    model = task.build_model(name, data, seed=0)
    assert isinstance(model, nn.Sequential) and len(model) >= 4
    for block in model:
        assert len(inspect.signature(block.forward).parameters) == 1
    (src, tgt_in), tgt_out = data.train[0]
    assert src.shape == (16, 6) and tgt_in.shape == tgt_out.shape == (16, 7)
    assert torch.equal(tgt_in[:, 0], torch.full((16,), BOS_ID))
    assert int((tgt_out == EOS_ID).sum()) == 16
    h = (src, tgt_in)
    for block in model:
        h = block(h)
        parts = h if isinstance(h, tuple) else (h,)
        assert all(isinstance(p, torch.Tensor) and (p.is_floating_point() or p.dtype == torch.long) for p in parts)
    assert h.shape == (16, 7, V)
    loss = task.loss(h, tgt_out)
    assert loss.ndim == 0 and 2.5 < loss.item() < 5.5  # about ln(40) = 3.7 at initialisation


def test_loss_ignores_pad_and_splits_into_micro_batches():
    task = TranslationTask()
    torch.manual_seed(0)
    logits = torch.randn(4, 5, V)
    target = torch.tensor([[5, 6, EOS_ID, 0, 0], [7, EOS_ID, 0, 0, 0], [5, 6, 7, 8, EOS_ID], [9, EOS_ID, 0, 0, 0]])
    full = task.loss(logits, target)
    halves = 0.5 * task.loss(logits[:2], target[:2]) + 0.5 * task.loss(logits[2:], target[2:])
    assert torch.allclose(full, halves)
    # the logits at pad positions do not matter
    changed = logits.clone()
    changed[target == 0] = 100.0
    assert torch.allclose(task.loss(changed, target), full)
    # per sentence: the mean over its tokens
    one = torch.nn.functional.cross_entropy(logits[1, :2], target[1, :2])
    assert torch.allclose(task.loss(logits[1:2], target[1:2]), one)


@pytest.mark.parametrize("name", ["transformer", "gnmt"])
def test_causal_and_padding_independence(name):
    """The logits at position t depend neither on later target tokens nor on padding."""
    torch.manual_seed(0)
    task = TranslationTask()
    model = task.build_model(name, TaskData([], [], {"vocab_size": V}), seed=0).eval()
    src = torch.tensor([[5, 6, 7, 0]])
    tgt = torch.tensor([[BOS_ID, 15, 16, 17]])
    full = model((src, tgt))
    changed = model((src, torch.tensor([[BOS_ID, 15, 30, 31]])))
    assert torch.allclose(full[:, :2], changed[:, :2], atol=1e-5)
    padded = model((torch.tensor([[5, 6, 7, 0, 0, 0, 0]]), tgt))
    assert torch.allclose(full, padded, atol=1e-5)


@pytest.mark.parametrize("name,steps", [("transformer", 60), ("gnmt", 60)])
def test_few_steps_overfit_and_greedy_decode(name, steps):
    task = TranslationTask()
    batches = _toy_batches(n=8, length=4)
    model = task.build_model(name, TaskData(batches, [], {"vocab_size": V}), seed=0)
    optim = torch.optim.Adam(model.parameters(), lr=3e-3)
    (src, tgt_in), tgt_out = batches[0]
    model.train()
    first = task.loss(model((src, tgt_in)), tgt_out).item()
    for _ in range(steps):
        loss = task.loss(model((src, tgt_in)), tgt_out)
        optim.zero_grad()
        loss.backward()
        optim.step()
    assert loss.item() < 0.3 * first
    model.eval()
    out = greedy_decode(model, src, max_len=6)
    assert out.dtype == torch.long and out.shape[0] == 8 and out.shape[1] <= 6
    expected = [[t for t in row if t > EOS_ID] for row in tgt_out.tolist()]
    got = [[t for t in row if t > EOS_ID] for row in out.tolist()]
    assert sum(g == e for g, e in zip(got, expected)) >= 6  # memorised most of the batch


def test_greedy_decode_stops_and_pads():
    class Fixed(nn.Module):
        """Predicts 7, 8, then eos, whatever the input."""

        def forward(self, inp):
            src, prefix = inp
            t = prefix.shape[1]
            nxt = [7, 8, EOS_ID][min(t - 1, 2)]
            logits = torch.zeros(src.shape[0], t, 10)
            logits[:, -1, nxt] = 1.0
            return logits

    out = greedy_decode(Fixed(), torch.ones(2, 3, dtype=torch.long), max_len=10)
    assert out.tolist() == [[7, 8, 0], [7, 8, 0]]
    assert greedy_decode(Fixed(), torch.ones(1, 3, dtype=torch.long), max_len=1).tolist() == [[7]]


@pytest.mark.skipif(not (HAS_SPM and HAS_SACREBLEU), reason="needs sentencepiece and sacrebleu: pip install sentencepiece sacrebleu")
def test_sentencepiece_translate_returns_strings(tmp_path):
    sentences = ["the light was good", "la luz era buena", "god said let there be light", "y dijo dios sea la luz"] * 20
    path = train_sentencepiece(sentences, vocab_size=60, cache=tmp_path)
    assert path.exists() and train_sentencepiece(sentences, vocab_size=60, cache=tmp_path) == path  # cached
    task = TranslationTask()
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(path))
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2, 3)
    src = torch.tensor([sp.encode("the light was good") + [0]])
    data = TaskData([], [], {"vocab_size": sp.get_piece_size(), "spm_model": str(path)})
    model = task.build_model("transformer", data, seed=0)
    out = task.translate(model, data, src, max_len=5)
    assert isinstance(out, list) and len(out) == 1 and isinstance(out[0], str)


@pytest.mark.skipif(not HAS_SACREBLEU, reason="needs sacrebleu: pip install sacrebleu")
def test_bleu_of_identical_text_is_100():
    refs = ["Y dijo Dios: Sea la luz: y fué la luz.", "EN el principio crió Dios los cielos y la tierra."]
    assert bleu_chrf(refs, refs) == {"bleu": pytest.approx(100.0), "chrf": pytest.approx(100.0)}
    low = bleu_chrf(["la la la", "nada"], refs)
    assert low["bleu"] < 5 and low["chrf"] < 30


# ---------------------------------------------------------------------------------------------
# real data


@pytest.mark.skipif(not (HAS_SWORD and HAS_SPM and HAS_SACREBLEU),
                    reason="needs mod2imp + Bible modules (sudo apt-get install --no-install-recommends "
                           "sword-text-web sword-text-sparv libsword-utils) and pip install sentencepiece sacrebleu")
def test_real_data(tmp_path_factory):
    task = TranslationTask()
    data = task.load(batch_size=64, limit=1000, seed=0)
    sizes = data.info["sizes"]
    assert sizes["pairs"] == 31077
    assert sizes["train"] == 1000 and 12500 < sizes["train_filtered_all"] < 13500
    assert 600 < sizes["valid"] < 800 and 600 < sizes["test"] < 800
    assert data.info["vocab_size"] == 4000
    assert len(data.train) == 1000 // 64
    (src, tgt_in), tgt_out = data.train[0]
    assert src.shape == (64, 32) and tgt_in.shape == tgt_out.shape == (64, 33)
    # no verse in two splits; test keys really are test keys
    assert all(split_of(k) == "test" for k in data.extra["test_keys"])
    assert len(data.extra["test_refs"]) == sizes["test"]
    # evaluation of an untrained model on a few sentences runs and scores near zero
    model = task.build_model("transformer", data, seed=0)
    scores = task.scores(model, data, limit=8)
    assert scores["sentences"] == 8 and 0 <= scores["bleu"] < 5 and 0 <= scores["chrf"] < 30


def test_missing_mod2imp_names_the_fix(tmp_path, monkeypatch):
    import pipeoptim.lab.tasks.bible as bible
    import pipeoptim.lab.tasks.translation as tr
    from pipeoptim.lab.tasks.base import MissingDataError

    monkeypatch.setenv("PIPEOPTIM_CACHE", str(tmp_path))
    monkeypatch.setattr(bible.shutil, "which", lambda name: None)
    with pytest.raises(MissingDataError, match="apt-get install --no-install-recommends sword-text-web"):
        tr.dump_module("engWEB2015eb")


@pytest.mark.skipif(not HAS_SWORD, reason="mod2imp not installed (libsword-utils)")
def test_missing_module_names_the_fix(tmp_path, monkeypatch):
    import pipeoptim.lab.tasks.translation as tr
    from pipeoptim.lab.tasks.base import MissingDataError

    monkeypatch.setenv("PIPEOPTIM_CACHE", str(tmp_path))
    with pytest.raises(MissingDataError, match="NoSuchModule.*sword-text-sparv"):
        tr.dump_module("NoSuchModule")
    assert not (tmp_path / "sword" / "NoSuchModule.imp").exists()


@pytest.mark.parametrize("name", ["transformer", "gnmt"])
def test_pipeline_with_micro_batches_equals_sequential(name):
    """Cut into stages and split into micro-batches (gpipe), the model trains exactly as in one
    piece: tuples of float states and int64 ids/masks cross the stage boundaries, and the loss
    is a mean over sentences, so micro-batch gradients add up to the mini-batch's."""
    train = pytest.importorskip("pipeoptim.training").train
    task = TranslationTask()
    batches = _toy_batches(n=8, length=5, seed=1) + _toy_batches(n=8, length=5, seed=2)
    model = task.build_model(name, TaskData(batches, [], {"vocab_size": V}), seed=0)
    for m in model.modules():  # dropout draws differ between whole and micro-batches
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0
    opt = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731
    seq = train(model, batches, method="sequential", optimizer=opt, loss_fn=task.loss, stages=1)
    pipe = train(model, batches, method="gpipe", optimizer=opt, loss_fn=task.loss, stages=3, micro_batches=4)
    assert len(seq.losses) == 2
    assert seq.losses == pytest.approx(pipe.losses, abs=1e-5)
