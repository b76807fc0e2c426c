"""Shared helpers of the text tasks (sentiment, translation, lm): tokenisation, vocabulary,
sentencepiece models, padding, batching, masks, hashed splits and a per-user cache folder.

Conventions used by the tasks:

* token id 0 is padding (``PAD_ID``), 1 is the unknown token (``UNK_ID``); sentencepiece models
  add 2 = beginning (``BOS_ID``) and 3 = end of a sequence (``EOS_ID``);
* a *pad mask* is an ``int64`` tensor of the same shape as the token ids that is 1 at padding
  positions and 0 at real tokens. Masks travel between pipeline stages as integer tensors (they
  get no gradient); a block turns them into ``bool`` where PyTorch wants that
  (``key_padding_mask`` semantics: ``True`` = ignore);
* sequences are padded (at the end) or truncated to a fixed length, so that every batch of a
  task has the same shape apart from the batch dimension.
"""
from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Iterable, List, Sequence, Tuple

import torch

from .base import MissingDataError
from .common import cache_dir, seeded_permutation

PAD_ID = 0  #: id of the padding token in every vocabulary of these tasks
UNK_ID = 1  #: id of the unknown-word token
BOS_ID = 2  #: id of the beginning-of-sequence piece (sentencepiece models)
EOS_ID = 3  #: id of the end-of-sequence piece (sentencepiece models)
SPM_HINT = "pip install sentencepiece   (or: make setup)"

_WORD_RE = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|[^\sa-z0-9]")


# --------------------------------------------------------------------------------------------
# files


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------------------------
# tokens and vocabulary


def tokenize_words(text: str) -> List[str]:
    """Lower-cased word tokens: runs of letters/digits (with an English clitic such as ``'s``
    attached) and single punctuation marks. ``"It's GREAT!"`` -> ``["it's", "great", "!"]``."""
    return _WORD_RE.findall(text.lower())


class Vocab:
    """A word vocabulary: ``<pad>`` = 0, ``<unk>`` = 1, then words by falling frequency.

    Built from tokenised training texts only; words seen fewer than ``min_count`` times, or
    beyond the ``max_size`` most frequent ones, map to ``<unk>``. Ties in frequency are broken
    alphabetically so that the vocabulary does not depend on the order of the texts.
    """

    PAD = "<pad>"
    UNK = "<unk>"

    def __init__(self, words: Sequence[str]):
        self.itos: List[str] = [self.PAD, self.UNK] + [w for w in words if w not in (self.PAD, self.UNK)]
        self.stoi = {w: i for i, w in enumerate(self.itos)}

    @classmethod
    def build(cls, token_lists: Iterable[Sequence[str]], max_size: int = 10_000, min_count: int = 2) -> "Vocab":
        """``max_size`` counts the two special tokens."""
        counts = collections.Counter(t for tokens in token_lists for t in tokens)
        ranked = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
        return cls(ranked[: max(0, max_size - 2)])

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, tokens: Sequence[str]) -> List[int]:
        return [self.stoi.get(t, UNK_ID) for t in tokens]

    def decode(self, ids: Sequence[int]) -> List[str]:
        return [self.itos[i] for i in ids if i != PAD_ID]


def pad_to(ids: Sequence[int], length: int, pad_id: int = PAD_ID) -> List[int]:
    """``ids`` cut to ``length`` or padded at the end with ``pad_id`` up to ``length``."""
    ids = list(ids[:length])
    return ids + [pad_id] * (length - len(ids))


def pad_batch(seqs: Sequence[Sequence[int]], length: int, pad_id: int = PAD_ID) -> torch.Tensor:
    """An ``int64`` tensor (len(seqs), length) of the padded/truncated sequences."""
    return torch.tensor([pad_to(s, length, pad_id) for s in seqs], dtype=torch.long).view(len(seqs), length)


def pad_mask(ids: torch.Tensor, pad_id: int = PAD_ID) -> torch.Tensor:
    """The ``int64`` pad mask of ``ids``: 1 where ``ids == pad_id``, else 0."""
    return ids.eq(pad_id).long()


# --------------------------------------------------------------------------------------------
# subword vocabulary (sentencepiece)


def _import_sentencepiece():
    try:
        import sentencepiece as spm
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise MissingDataError(f"subword tokenisation needs sentencepiece: {SPM_HINT}") from e
    return spm


def train_sentencepiece(sentences: Sequence[str], vocab_size: int = 4000, cache: Path | None = None) -> Path:
    """Train (or reuse) a BPE model on ``sentences``; returns the ``.model`` path.

    The file name is keyed by the parameters and an MD5 of the sentences, so a change of data
    or settings never reuses a stale model. ``cache`` defaults to ``cache_dir()/sentencepiece``.
    """
    spm = _import_sentencepiece()
    params = dict(vocab_size=vocab_size, model_type="bpe", character_coverage=1.0,
                  pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID)
    digest = hashlib.md5(json.dumps(params, sort_keys=True).encode())
    for s in sentences:
        digest.update(s.encode("utf-8") + b"\n")
    path = (cache or cache_dir("sentencepiece")) / f"spm_bpe{vocab_size}_{digest.hexdigest()[:12]}.model"
    if not path.exists():
        buf = io.BytesIO()
        spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=buf,
                                       num_threads=1, minloglevel=2, **params)
        atomic_write_bytes(path, buf.getvalue())
    return path


def load_sentencepiece(path: str | Path):
    return _import_sentencepiece().SentencePieceProcessor(model_file=str(path))


# --------------------------------------------------------------------------------------------
# order, splits and batches


def hash_bucket(key: str, buckets: int = 100) -> int:
    """A bucket in ``0 .. buckets-1`` from an MD5 hash of ``key``: the same on every run, machine
    and Python version (unlike the salted ``hash()``), so a hashed split never moves an item."""
    return int(hashlib.md5(key.encode("utf-8")).hexdigest()[:8], 16) % buckets


def batch_indices(n: int, batch_size: int, *, seed: int | None = None, drop_last: bool = False) -> List[List[int]]:
    """Indices ``0..n-1`` cut into batches of ``batch_size``, shuffled with ``seed`` if given.

    With ``drop_last`` a final incomplete batch is dropped, unless it is the only batch, so that
    all training batches have the same size (micro-batch splitting then stays even).
    """
    order = seeded_permutation(n, seed) if seed is not None else list(range(n))
    out = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    if drop_last and len(out) > 1 and len(out[-1]) < batch_size:
        out.pop()
    return out


def split_counts(n: int, fractions: Tuple[float, ...]) -> List[int]:
    """Sizes of consecutive parts of ``n`` items for the given fractions (the last part takes
    the rest). ``split_counts(10, (0.8, 0.1, 0.1)) == [8, 1, 1]``."""
    sizes = [int(round(n * f)) for f in fractions[:-1]]
    return sizes + [n - sum(sizes)]
