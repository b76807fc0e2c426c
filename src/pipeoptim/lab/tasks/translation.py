"""Translation: English -> Spanish Bible verses (BLEU; chrF reported beside it).

Data: the SWORD modules ``engWEB2015eb`` (World English Bible) and ``spaRV1909eb`` (Reina-Valera
1909), dumped and cleaned by :mod:`pipeoptim.lab.tasks.bible` (shared with the lm task; where
they come from and what parsing drops is said there). The parsed verse pairs and the
sentencepiece model are cached under ``cache_dir()/translation/``. Verses present and non-empty
in both Bibles are aligned by key: 31,077 pairs.

Split: by an MD5 hash of the verse key (:func:`split_of`), about 90/5/5 train/valid/test, so a
verse never moves between splits whatever the data size or seed. Valid/test pairs whose English
text also occurs in the training split (repeated verses such as Numbers 7) are dropped.

Vocabulary: one joint sentencepiece BPE model (4k pieces; pad = 0, unk = 1, bos = 2, eos = 3)
trained on the training split only (:func:`~pipeoptim.lab.tasks.text.train_sentencepiece`).
Pairs with more than ``max_tokens`` (32) pieces on either side are dropped. Shapes: ``src_ids``
(B, 32), ``tgt_in_ids = [bos] + pieces`` and ``tgt_out_ids = pieces + [eos]`` (B, 33), padded
with 0.

Models (``nn.Sequential``; every block takes one tuple and returns one tuple or tensor):

* ``transformer`` (default, pre-LayerNorm, d_model 128, 4 heads, ff 512):
  ``SrcEmbed``: (src_ids, tgt_in_ids) -> (src_states, src_pad, tgt_in_ids)
  | 2 x ``EncoderLayerBlock``: same tuple
  | ``TgtEmbed``: -> (memory, src_pad, tgt_states, tgt_pad)
  | 2 x ``DecoderLayerBlock``: same tuple (the last one returns ``tgt_states`` only)
  | ``Generator``: -> logits (B, T, V).
* ``transformer-deep``: 3 encoder and 3 decoder layers of width 64 (ff 256), 9 blocks: enough
  for 8 stages.
* ``gnmt`` (GNMT scaled down to 256 units): ``GNMTEmbed`` | ``BiLSTMBlock`` | ``EncLSTMBlock``
  | ``EncLSTMBlock`` (residual) | ``AttentionDecoderBlock`` (target embedding, bottom decoder
  LSTM, attention over the encoder states) -> (h, context) | ``DecLSTMBlock`` |
  ``DecLSTMBlock`` (residual; returns ``h`` only) | ``Generator``.

Evaluation: greedy decoding (:func:`greedy_decode`) of the first ``eval_limit`` (500) sentences
of the test split, scored against the original Spanish verse text with ``sacrebleu``'s corpus
BLEU and chrF. The validation split (for tuning: ``split="validation"``) is the fixed valid split
(all of it, or its first ``holdout`` pairs), scored the same way on its first ``eval_limit``
sentences."""
from __future__ import annotations

import json
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import nn
import torch.nn.functional as F

from .base import MissingDataError, Task, TaskData, check_holdout
from .bible import EN_MODULE, ES_MODULE, PARSER_VERSION, dump_module, parse_mod2imp
from .common import cache_dir, evaluation_mode, seeded, seeded_permutation
from .translation_models import build_gnmt, build_transformer
from .text import (BOS_ID, EOS_ID, PAD_ID, atomic_write_bytes, batch_indices, hash_bucket, load_sentencepiece,
                   pad_batch, train_sentencepiece)

PIP_HINT = "pip install sentencepiece sacrebleu   (or: make setup)"

Pair = Tuple[str, str, str]  #: (verse key, English text, Spanish text)

# --------------------------------------------------------------------------------------------
# verse pairs (reading and cleaning the Bibles: :mod:`pipeoptim.lab.tasks.bible`)


def align(en: Dict[str, str], es: Dict[str, str]) -> List[Pair]:
    """``(key, en, es)`` for every key in both, in the order of ``en``."""
    return [(k, v, es[k]) for k, v in en.items() if es.get(k)]


def split_of(key: str) -> str:
    """``"train"`` (90 %), ``"valid"`` (5 %) or ``"test"`` (5 %) from an MD5 hash of the key:
    stable across runs, machines and Python versions."""
    bucket = hash_bucket(key)
    return "train" if bucket < 90 else "valid" if bucket < 95 else "test"


def read_pairs() -> List[Pair]:
    """All aligned verse pairs (cached as JSON next to the dumps)."""
    path = cache_dir() / "translation" / f"pairs_{EN_MODULE}_{ES_MODULE}_v{PARSER_VERSION}.json"
    if path.exists():
        return [tuple(p) for p in json.loads(path.read_text(encoding="utf-8"))]  # type: ignore[misc]
    pairs = align(parse_mod2imp(dump_module(EN_MODULE)), parse_mod2imp(dump_module(ES_MODULE)))
    atomic_write_bytes(path, json.dumps(pairs, ensure_ascii=False).encode("utf-8"))
    return pairs


# --------------------------------------------------------------------------------------------
# decoding


@torch.no_grad()
def greedy_decode(model: nn.Module, src_ids: torch.Tensor, max_len: int,
                  bos_id: int = BOS_ID, eos_id: int = EOS_ID, pad_id: int = PAD_ID) -> torch.Tensor:
    """Greedy translations (B, <= max_len) int64 of ``src_ids`` (B, S): tokens after ``bos``,
    ``eos`` excluded, ``pad_id`` after a sentence's end.

    Runs the whole model on ``(src_ids, prefix)`` for every new token (no caching: simple and
    correct, affordable for a few hundred sentences). The caller sets ``model.eval()``.
    """
    b = src_ids.shape[0]
    prefix = torch.full((b, 1), bos_id, dtype=torch.long, device=src_ids.device)
    done = torch.zeros(b, dtype=torch.bool, device=src_ids.device)
    for _ in range(max_len):
        logits = model((src_ids, prefix))
        nxt = logits[:, -1].argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        done |= nxt.eq(eos_id)
        prefix = torch.cat([prefix, nxt.unsqueeze(1)], dim=1)
        if bool(done.all()):
            break
    out = prefix[:, 1:]
    return out.masked_fill(out.eq(eos_id), pad_id)


def ids_to_text(sp: Any, ids: torch.Tensor) -> List[str]:
    """Detokenised strings of rows of piece ids (pad, bos and eos ignored)."""
    return [sp.decode([i for i in row if i > EOS_ID]) for row in ids.tolist()]


def bleu_chrf(hypotheses: Sequence[str], references: Sequence[str]) -> Dict[str, float]:
    """Corpus BLEU and chrF (sacrebleu defaults: 13a tokenisation, chrF with n = 6, beta = 2)."""
    try:
        import sacrebleu
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise MissingDataError(f"the translation task needs sacrebleu: {PIP_HINT}") from e
    return {"bleu": float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score),
            "chrf": float(sacrebleu.corpus_chrf(list(hypotheses), [list(references)]).score)}


# --------------------------------------------------------------------------------------------
# task


def encode_pairs(sp: Any, pairs: Sequence[Pair], max_tokens: int) -> List[Tuple[Pair, List[int], List[int]]]:
    """``(pair, en pieces, es pieces)`` for the pairs with at most ``max_tokens`` pieces per side."""
    out = []
    for pair, en, es in zip(pairs, sp.encode([p[1] for p in pairs]), sp.encode([p[2] for p in pairs])):
        if 0 < len(en) <= max_tokens and 0 < len(es) <= max_tokens:
            out.append((pair, en, es))
    return out


def make_batches(encoded: Sequence[Tuple[Pair, List[int], List[int]]], max_tokens: int, batch_size: int, *,
                 seed: int | None = None, drop_last: bool = False) -> List[Tuple[Tuple[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """Batches ``((src_ids (B, L), tgt_in_ids (B, L+1)), tgt_out_ids (B, L+1))``, L = max_tokens."""
    src = pad_batch([en for _, en, _ in encoded], max_tokens)
    tgt_in = pad_batch([[BOS_ID] + es for _, _, es in encoded], max_tokens + 1)
    tgt_out = pad_batch([es + [EOS_ID] for _, _, es in encoded], max_tokens + 1)
    batches = []
    for idx in batch_indices(len(encoded), batch_size, seed=seed, drop_last=drop_last):
        i = torch.tensor(idx, dtype=torch.long)
        batches.append(((src[i], tgt_in[i]), tgt_out[i]))
    return batches


class TranslationTask(Task):
    """WEB -> Reina-Valera 1909 verse translation (BLEU). See the module docstring."""

    name = "translation"
    metric = "bleu"
    higher_is_better = True
    default_model = "transformer"
    default_batch_size = 64
    #: Learning rates for batch 64, checked on the transformer (full data, plain loop):
    #: adam 1e-3: BLEU 7.8 / 14.4 / 16.8 / 18.1 after 2 / 4 / 6 / 8 epochs; momentum 0.2:
    #: BLEU 4.6 after 2 epochs (0.05: 1.3, too slow). The gnmt model with adam 1e-3: BLEU 1.8
    #: after 2 epochs (it learns more slowly). The others are the usual defaults, not tuned.
    default_lr: Dict[str, float] = {
        "sgd": 1.0,
        "momentum": 0.2,
        "nesterov": 0.2,
        "adam": 1e-3,
        "adamw": 1e-3,
        "rmsprop": 3e-4,
        "adagrad": 0.05,
        "adamax": 2e-3,
        "nadam": 1e-3,
        "radam": 1e-3,
        "adadelta": 1.0,
        "muon": 0.02,  # Muon's usual lr on the hidden matrices (AdamW part: lr / 10); not tuned here
    }
    vocab_size = 4000
    max_tokens = 32     #: pieces per side; longer pairs are dropped
    eval_limit = 500    #: test sentences decoded by :meth:`evaluate`
    eval_batch_size = 100

    def __init__(self) -> None:
        self._sp_cache: Dict[str, Any] = {}

    def model_names(self) -> Sequence[str]:
        # transformer-deep: 3 + 3 layers (9 blocks in all), deep enough for 8 stages
        return ("transformer", "transformer-deep", "gnmt")

    def sentencepiece(self, data: TaskData) -> Any:
        path = str(data.info["spm_model"])
        if path not in self._sp_cache:
            self._sp_cache[path] = load_sentencepiece(path)
        return self._sp_cache[path]

    def load(self, *, batch_size: int, limit: int | None, seed: int, holdout: int | None = None) -> TaskData:
        """Training batches shuffled with ``seed`` (an incomplete last batch is dropped).
        ``limit`` keeps the first ``limit`` filtered training pairs in a fixed (seed-0) order,
        the same subset for every seed; the vocabulary is always trained on the full training
        split. Test (and ``extra['valid']``) pairs are in a fixed shuffled order, so the first
        ``eval_limit`` test sentences are a random sample of the test split. ``extra`` also
        holds, in the order of the test (validation) batches, the test source sentences
        (``test_src``), their references (``test_refs``, which :meth:`scores` reads) and verse
        keys (``test_keys``), and the validation sources and references (``valid_src``,
        ``valid_refs``). The validation split (``validation``, also ``extra['valid']``) is the
        fixed valid split, or its first ``holdout`` pairs (at most its size; the training data is
        the same either way)."""
        check_holdout(holdout, None, "pairs of the fixed validation split")
        pairs = read_pairs()
        by_split: Dict[str, List[Pair]] = {"train": [], "valid": [], "test": []}
        for p in pairs:
            by_split[split_of(p[0])].append(p)
        train_sources = {p[1] for p in by_split["train"]}
        for name in ("valid", "test"):
            by_split[name] = [p for p in by_split[name] if p[1] not in train_sources]
        sp_path = train_sentencepiece([s for p in by_split["train"] for s in (p[1], p[2])], self.vocab_size,
                                      cache=cache_dir("translation"))
        sp = load_sentencepiece(sp_path)
        self._sp_cache[str(sp_path)] = sp

        enc = {name: encode_pairs(sp, ps, self.max_tokens) for name, ps in by_split.items()}
        for name in enc:  # a fixed order, independent of the training seed
            enc[name] = [enc[name][i] for i in seeded_permutation(len(enc[name]), 0)]
        train = enc["train"][:limit] if limit else enc["train"]
        test = enc["test"]
        check_holdout(holdout, len(enc["valid"]), "pairs of the fixed validation split")
        valid = enc["valid"][:holdout] if holdout is not None else enc["valid"]
        info: Dict[str, Any] = {
            "source": f"SWORD {EN_MODULE} -> {ES_MODULE} via mod2imp",
            "spm_model": str(sp_path),
            "vocab_size": sp.get_piece_size(),
            "max_tokens": self.max_tokens,
            "pad_id": PAD_ID, "bos_id": BOS_ID, "eos_id": EOS_ID,
            "sizes": {"pairs": len(pairs), "train": len(train), "train_filtered_all": len(enc["train"]),
                      "valid": len(enc["valid"]), "test": len(test)},
            "eval_limit": self.eval_limit,
        }
        if holdout is not None:
            info["n_validation"] = holdout
        validation = make_batches(valid, self.max_tokens, batch_size)
        extra: Dict[str, Any] = {
            "valid": validation,
            "valid_src": [p[1] for p, _, _ in valid],
            "valid_refs": [p[2] for p, _, _ in valid],
            "test_src": [p[1] for p, _, _ in test],
            "test_refs": [p[2] for p, _, _ in test],
            "test_keys": [p[0] for p, _, _ in test],
        }
        return TaskData(
            train=make_batches(train, self.max_tokens, batch_size, seed=seed, drop_last=True),
            test=make_batches(test, self.max_tokens, batch_size),
            validation=validation,
            info=info,
            extra=extra,
        )

    def build_model(self, name: str, data: TaskData, *, seed: int) -> nn.Sequential:
        vocab_size = int(data.info["vocab_size"])
        with seeded(seed):
            if name == "transformer":
                return build_transformer(vocab_size)
            if name == "transformer-deep":
                # narrower, so that its 9 blocks cost about what 2 + 2 of width 128 do
                return build_transformer(vocab_size, d_model=64, d_ff=256, enc_layers=3, dec_layers=3)
            if name == "gnmt":
                return build_gnmt(vocab_size)
        raise ValueError(f"unknown translation model {name!r}; choose one of: {', '.join(self.model_names())}")

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of logits (B, T, V) against ``tgt_out_ids`` (B, T), pad ignored: the mean
        over a sentence's tokens, then the mean over sentences.

        Averaging per sentence first (rather than over all tokens of the batch) makes the loss a
        plain mean over examples, so micro-batches weighted by their share of the examples
        accumulate exactly the mini-batch's gradient.
        """
        tokens = F.cross_entropy(output.transpose(1, 2), target, ignore_index=PAD_ID, reduction="none")  # (B, T)
        counts = target.ne(PAD_ID).sum(1).clamp_min(1)
        return (tokens.sum(1) / counts).mean()

    def translate(self, model: nn.Module, data: TaskData, src_ids: torch.Tensor, max_len: int | None = None) -> List[str]:
        """Greedy translations of a batch of source ids, as strings (the model's training flags
        are restored afterwards)."""
        with evaluation_mode(model):
            out = greedy_decode(model, src_ids, max_len or self.max_tokens + 1)
        return ids_to_text(self.sentencepiece(data), out)

    def scores(self, model: nn.Module, data: TaskData, limit: int | None = None,
               split: str = "test") -> Dict[str, float]:
        """``{"bleu", "chrf", "sentences"}`` on the first ``limit`` (default ``eval_limit``) pairs
        of ``split`` ("test" or "validation")."""
        batches = data.split(split, f"task {self.name}")  # names the fix for a split it does not have
        refs = data.extra["test_refs" if split == "test" else "valid_refs"]
        n = min(limit or int(data.info.get("eval_limit", self.eval_limit)), len(refs))
        src = torch.cat([x[0] for x, _ in batches])[:n]
        hyps: List[str] = []
        for i in range(0, n, self.eval_batch_size):
            hyps += self.translate(model, data, src[i : i + self.eval_batch_size])
        result = bleu_chrf(hyps, refs[:n])
        result["sentences"] = float(n)
        return result

    def evaluate(self, model: nn.Module, data: TaskData, split: str = "test") -> float:
        """Corpus BLEU (0-100) of greedy translations of the first ``eval_limit`` sentences of
        ``split`` (the test split, or the validation split for tuning)."""
        return self.scores(model, data, split=split)["bleu"]
