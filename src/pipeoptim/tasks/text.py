"""Shared helpers of the two text tasks (sentiment, translation): tokenisation, vocabulary,
padding, batching, masks and a per-user cache folder.

Conventions used by both tasks:

* token id 0 is padding (``PAD_ID``), 1 is the unknown token (``UNK_ID``);
* a *pad mask* is an ``int64`` tensor of the same shape as the token ids that is 1 at padding
  positions and 0 at real tokens. Masks travel between pipeline stages as integer tensors (they
  get no gradient); a block turns them into ``bool`` where PyTorch wants that
  (``key_padding_mask`` semantics: ``True`` = ignore);
* sequences are padded (at the end) or truncated to a fixed length, so that every batch of a
  task has the same shape apart from the batch dimension.

``cache_dir`` and ``seeded_permutation`` come from :mod:`pipeoptim.tasks.common`.
"""
from __future__ import annotations

import collections
import os
import re
import tempfile
from pathlib import Path
from typing import Iterable, List, Sequence, Tuple

import torch

from .common import cache_dir, seeded_permutation  # noqa: F401  (re-exported for the text tasks)

PAD_ID = 0  #: id of the padding token in every vocabulary of these tasks
UNK_ID = 1  #: id of the unknown-word token

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
# order and batches


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
