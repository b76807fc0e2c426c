"""Language modelling: next-token prediction on the World English Bible (perplexity).

Data: the SWORD module ``engWEB2015eb`` (World English Bible, public domain, Debian
``sword-text-web``), dumped with ``mod2imp`` and cleaned as for the translation task
(:mod:`pipeoptim.lab.tasks.bible`): 37,457 verses in 1,388 chapters of 80 books (the deuterocanon
included), about 0.9 M words.

Split: by chapter, from an MD5 hash of the chapter key ``"Book C"`` (:func:`split_of_chapter`):
about 95 % of the chapters train, 5 % validate, whatever the data size or the seed. (Parallel
passages such as Kings and Chronicles share sentences across chapters; that is the text, not a
leak of the split.) ``holdout=N`` holds out whole training chapters, in the order of their hash
(:func:`chapter_hash_order`, :func:`holdout_count`), until they make N blocks: the same for every
``limit`` and ``seed``. The tokenizer stays the one trained on all training chapters (so the
vocabulary, and a model's size, do not change with N): it has seen the held-out chapters' piece
statistics, not their next-token targets.

Tokens: a sentencepiece BPE model of 2,000 pieces (pad = 0, unk = 1, bos = 2, eos = 3; the
helper of :mod:`pipeoptim.lab.tasks.text`) trained on the training chapters only and cached under
``cache_dir()/lm/``. Each split becomes one stream: the chapters in canonical order, each the
pieces of its verses followed by ``eos``, cut into blocks (:func:`make_blocks`): inputs and
targets (B, 64) int64, no padding. An example is a block.

Loss: mean token cross-entropy; every example has the same number of tokens, so micro-batches
accumulate exactly. Metric: validation perplexity, ``exp`` of the mean token negative
log-likelihood over all validation blocks (lower is better); :func:`unigram_perplexity` gives the
baseline of a model that ignores the context.

Models (pre-LayerNorm GPT; ``nn.Sequential`` but the ``gpt-tied`` ones): ``Embedding`` (token +
learned position) | L x ``TransformerBlock`` (causal self-attention and a GELU MLP, each behind a
LayerNorm, each added to the residual stream) | ``Head`` (final LayerNorm + linear to the
vocabulary); blocks pass one (B, T, d) tensor. GPT-2 initialisation (normal 0.02; the residual
projections scaled by 1/sqrt(2L)); the output projection is not tied to the embedding.

* ``gpt`` (default): d 128, 4 heads, MLP 512, 8 layers, dropout 0.1: 10 blocks, enough for 8
  stages; 2.1 M parameters (0.5 M of them in the embedding and the head).
* ``gpt-small``: d 64, 2 heads, MLP 256, 2 layers, no dropout: 4 blocks, 0.36 M parameters.
* ``gpt-narrow``: ``gpt-small`` with 8 layers and dropout 0.1: 10 blocks, about 0.66 M
  parameters, for studies that need thousands of updates per run on a CPU.
* ``gpt-tied``: ``gpt``'s sizes as a :class:`TiedGPT`: 13 candidate points (11 with parameters
  of their own), 1.8 M parameters.
* ``gpt-tied-small``: ``gpt-small``'s sizes as a :class:`TiedGPT`."""
from __future__ import annotations

import hashlib
import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn
import torch.nn.functional as F

from .base import Task, TaskData, check_holdout
from .bible import EN_MODULE, read_verses
from .common import batchify, cache_dir, evaluation_mode, seeded, seeded_permutation
from .text import EOS_ID, hash_bucket, load_sentencepiece, train_sentencepiece

VALID_PERCENT = 5  #: chapters whose hash bucket (0..99) is at least 100 - VALID_PERCENT validate


# --------------------------------------------------------------------------------------------
# data


def chapter_of(verse_key: str) -> str:
    """``"Genesis 1:3"`` -> ``"Genesis 1"``."""
    return verse_key.rsplit(":", 1)[0]


def split_of_chapter(chapter_key: str) -> str:
    """``"train"`` (about 95 % of chapters) or ``"valid"`` from an MD5 hash of ``"Book C"``."""
    return "valid" if hash_bucket(chapter_key) >= 100 - VALID_PERCENT else "train"


Chapter = Tuple[str, List[str]]  #: ("Book C", the texts of its verses in order)


def chapters_by_split(verses: Dict[str, str]) -> Dict[str, List[Chapter]]:
    """``{"train": [...], "valid": [...]}``: the verses grouped by chapter, in canonical order."""
    chapters: Dict[str, List[str]] = {}
    for key, text in verses.items():
        chapters.setdefault(chapter_of(key), []).append(text)
    out: Dict[str, List[Chapter]] = {"train": [], "valid": []}
    for key, texts in chapters.items():
        out[split_of_chapter(key)].append((key, texts))
    return out


def holdout_count(lengths: Sequence[int], blocks: int, seq_len: int) -> int:
    """How many chapters, taken in order, to hold out for ``blocks`` validation blocks: the
    fewest whose ``lengths`` (tokens, ``eos`` included) make a stream of at least ``blocks``
    blocks of ``seq_len`` (L tokens make ``(L - 1) // seq_len``). One chapter at least must be
    left to train on: otherwise a ValueError names the most blocks there can be."""
    tokens = 0
    for count, length in enumerate(lengths[:-1], start=1):
        tokens += length
        if (tokens - 1) // seq_len >= blocks:
            return count
    raise ValueError(f"holdout {blocks} blocks would take every training chapter; hold out at most "
                     f"{max(0, (tokens - 1) // seq_len)}")


def chapter_hash_order(keys: Sequence[str]) -> List[int]:
    """The indices of ``keys`` sorted by the MD5 hash of ``"holdout " + key``: a fixed order,
    independent of the seed, the data size and the canonical order of the books."""
    return sorted(range(len(keys)), key=lambda i: hashlib.md5(f"holdout {keys[i]}".encode("utf-8")).hexdigest())


def token_stream(sp: Any, chapters: Sequence[Chapter]) -> torch.Tensor:
    """One int64 stream: per chapter, the pieces of its verses, then ``eos``."""
    ids: List[int] = []
    for _, texts in chapters:
        for pieces in sp.encode(list(texts)):
            ids += pieces
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def make_blocks(stream: torch.Tensor, seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)``, both (n, seq_len): blocks of ``seq_len + 1`` tokens starting every
    ``seq_len`` tokens, inputs = block[:-1], targets = block[1:]. A last incomplete block is
    dropped; every other token after the first is a target exactly once."""
    n = (stream.numel() - 1) // seq_len
    blocks = stream[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)  # (n, seq_len + 1)
    return blocks[:, :-1].contiguous(), blocks[:, 1:].contiguous()


def unigram_perplexity(train_tokens: torch.Tensor, eval_tokens: torch.Tensor, vocab_size: int,
                       smoothing: float = 1.0) -> float:
    """Perplexity of ``eval_tokens`` under the unigram distribution of ``train_tokens``
    (add-``smoothing`` over ``vocab_size`` pieces): ``exp(-mean log p(token))``."""
    counts = torch.bincount(train_tokens.flatten(), minlength=vocab_size).double() + smoothing
    log_p = counts.log() - counts.sum().log()
    return math.exp(-float(log_p[eval_tokens.flatten()].mean()))


def shuffled_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Mini-batches of the rows of ``(x, y)`` in a seeded order, an incomplete last one dropped."""
    order = torch.tensor(seeded_permutation(x.shape[0], seed), dtype=torch.long)
    return batchify(x[order], y[order], batch_size, drop_last=True)


# --------------------------------------------------------------------------------------------
# model


class Embedding(nn.Module):
    """ids (B, T) -> token plus learned position embeddings (B, T, d), with dropout."""

    def __init__(self, vocab_size: int, d_model: int, max_len: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.pos.num_embeddings:
            raise ValueError(f"sequence of {t} tokens, but the model has {self.pos.num_embeddings} positions")
        return self.drop(self.tok(ids) + self.pos(torch.arange(t, device=ids.device)))


class CausalSelfAttention(nn.Module):
    """(B, T, d) -> (B, T, d): multi-head self-attention in which position t sees 0..t only."""

    def __init__(self, d_model: int, nhead: int, dropout: float):
        super().__init__()
        if d_model % nhead:
            raise ValueError(f"d_model {d_model} is not a multiple of nhead {nhead}")
        self.nhead = nhead
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_dropout = dropout
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.nhead, d // self.nhead).transpose(1, 2) for z in self.qkv(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.attn_dropout if self.training else 0.0)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))


class TransformerBlock(nn.Module):
    """(B, T, d) -> (B, T, d): x + attn(LN(x)), then x + MLP(LN(x)) (pre-LayerNorm)."""

    def __init__(self, d_model: int, nhead: int, d_ff: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, nhead, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """(B, T, d) -> logits (B, T, vocab): the final LayerNorm and the output projection."""

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.proj = nn.Linear(d_model, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def build_gpt(vocab_size: int, seq_len: int, d_model: int = 128, layers: int = 8, nhead: int = 4,
              d_ff: int = 512, dropout: float = 0.1) -> nn.Sequential:
    """``Embedding | layers x TransformerBlock | Head`` with GPT-2's initialisation."""
    blocks: List[nn.Module] = [Embedding(vocab_size, d_model, seq_len, dropout)]
    blocks += [TransformerBlock(d_model, nhead, d_ff, dropout) for _ in range(layers)]
    blocks.append(Head(d_model, vocab_size))
    model = nn.Sequential(*blocks)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    for block in model[1:-1]:  # the projections that add to the residual stream
        for proj in (block.attn.proj, block.mlp[2]):
            nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * layers))
    model._tp_plan = gpt_plan(layers)
    return model


def gpt_plan(layers: int) -> Dict[str, str]:
    """:func:`build_gpt`'s tensor-parallel plan (``Pipeline(tensor_parallel=T)`` reads a model's
    ``_tp_plan``): the token embedding split over the vocabulary, each MLP's first Linear
    column-wise and its second row-wise (the hidden features split, one all-reduce of the block's
    output), the head column-wise with its logits gathered. The attention stays whole on every
    tensor rank: its fused ``qkv`` output is split into q, k and v by ``d`` and viewed as
    ``nhead`` heads, which a column-wise shard of ``qkv`` does not hold."""
    return {"0.tok": "embedding_rowwise", "*.mlp.0": "colwise", "*.mlp.2": "rowwise",
            f"{layers + 1}.proj": "colwise_gather_output"}


class TiedGPT(nn.Module):
    """A GPT written as people write it, not as an ``nn.Sequential``: token and position
    embeddings, a ``ModuleList`` of :class:`TransformerBlock` called in a loop, a final LayerNorm,
    and a head (no bias) whose weight *is* the token embedding's, as in GPT-2. The Pipeline
    traces it (torch.export) and cuts it at its candidate points (``tok``, ``pos``, ``drop``,
    ``blocks.0`` ..., ``norm``, ``head``); the tied weight is trained by the embedding's stage
    (docs/architecture.md, "Splitting any module", "Tied weights"). ids (B, T) -> logits
    (B, T, vocab); initialised as :func:`build_gpt`."""

    #: the tensor-parallel plan (:func:`gpt_plan`'s; the head split as the embedding it is tied to)
    _tp_plan = {"tok": "embedding_rowwise", "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise",
                "head": "colwise_gather_output"}

    def __init__(self, vocab_size: int, seq_len: int, d_model: int = 128, layers: int = 8, nhead: int = 4,
                 d_ff: int = 512, dropout: float = 0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, nhead, d_ff, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:  # the projections that add to the residual stream
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


#: the models by name: build_gpt's settings, or TiedGPT's with ``tied=True``. The studies' rows
#: name these models: a model's settings never change (a new one gets a new name).
MODELS: Dict[str, Dict[str, Any]] = {
    "gpt": dict(d_model=128, layers=8, nhead=4, d_ff=512, dropout=0.1),
    "gpt-small": dict(d_model=64, layers=2, nhead=2, d_ff=256, dropout=0.0),
    "gpt-narrow": dict(d_model=64, layers=8, nhead=2, d_ff=256, dropout=0.1),
    "gpt-tied": dict(tied=True, d_model=128, layers=8, nhead=4, d_ff=512, dropout=0.1),
    "gpt-tied-small": dict(tied=True, d_model=64, layers=2, nhead=2, d_ff=256, dropout=0.0),
}


# --------------------------------------------------------------------------------------------
# evaluation


def perplexity(model: nn.Module, batches: Iterable[Tuple[torch.Tensor, torch.Tensor]]) -> float:
    """``exp`` of the mean token negative log-likelihood of ``model`` over ``batches`` (eval mode,
    no gradients; the training flags are restored). ``nan`` for no tokens."""
    total, count = 0.0, 0
    with evaluation_mode(model):
        for x, y in batches:
            logits = model(x)
            total += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
            count += y.numel()
    return math.exp(total / count) if count else float("nan")


# --------------------------------------------------------------------------------------------
# task


class LanguageModelTask(Task):
    """Next-token prediction on the World English Bible (perplexity). See the module docstring."""

    name = "lm"
    metric = "perplexity"
    higher_is_better = False
    default_model = "gpt"
    default_batch_size = 32
    #: Learning rates for batch 32, checked on gpt (120 steps from the same start, no warm-up):
    #: adam 5e-4 / 1e-3 / 2e-3: validation perplexity 191 / 161 / 312 (2e-3 stalls); momentum
    #: 0.03 / 0.1: 378 / 370 (about the unigram baseline: slow), 0.3 diverges. Prefer Adam for
    #: this task. The others are the usual defaults, not tuned.
    default_lr: Dict[str, float] = {
        "sgd": 0.5,
        "momentum": 0.05,
        "nesterov": 0.05,
        "adam": 1e-3,
        "adamw": 1e-3,
        "rmsprop": 3e-4,
        "adagrad": 0.02,
        "adamax": 2e-3,
        "nadam": 1e-3,
        "radam": 1e-3,
        "adadelta": 1.0,
        "muon": 0.02,  # Muon's usual lr on the hidden matrices (AdamW: --adamw-lr, 0.002); one seed
    }
    vocab_size = 2000
    seq_len = 64

    def model_names(self) -> Sequence[str]:
        return tuple(MODELS)

    def load(self, *, batch_size: int, limit: int | None, seed: int, holdout: Optional[int] = None) -> TaskData:
        """Training blocks shuffled with ``seed`` (an incomplete last batch is dropped); ``limit``
        keeps that many training blocks, a fixed random subset; the tokenizer is always trained
        on all training chapters. ``test`` holds every block of the held-out (``valid``)
        chapters, in text order. ``holdout=N``: ``validation`` holds N blocks of further
        training chapters, which then do not train (module docstring)."""
        check_holdout(holdout, None, "blocks of held-out training chapters")
        chapters = chapters_by_split(read_verses(EN_MODULE))
        sp_path = train_sentencepiece([t for _, texts in chapters["train"] for t in texts], self.vocab_size,
                                      cache=cache_dir("lm"))
        sp = load_sentencepiece(sp_path)
        n_train_chapters = len(chapters["train"])
        validation: List[Tuple[torch.Tensor, torch.Tensor]] = []
        if holdout is not None:
            per_chapter = [token_stream(sp, [chapter]) for chapter in chapters["train"]]
            order = chapter_hash_order([key for key, _ in chapters["train"]])
            count = holdout_count([per_chapter[i].numel() for i in order], holdout, self.seq_len)
            held = sorted(order[:count])  # in canonical order
            held_set = set(held)
            x_held, y_held = make_blocks(torch.cat([per_chapter[i] for i in held]), self.seq_len)
            validation = batchify(x_held[:holdout], y_held[:holdout], batch_size, drop_last=False)
            chapters["train"] = [c for i, c in enumerate(chapters["train"]) if i not in held_set]
        streams = {name: token_stream(sp, chs) for name, chs in chapters.items()}
        x_train, y_train = make_blocks(streams["train"], self.seq_len)
        x_valid, y_valid = make_blocks(streams["valid"], self.seq_len)
        if limit:
            keep = torch.tensor(seeded_permutation(x_train.shape[0], 0)[:limit], dtype=torch.long)
            x_train, y_train = x_train[keep], y_train[keep]
        vocab_size = sp.get_piece_size()
        info: Dict[str, Any] = {
            "source": f"SWORD {EN_MODULE} (World English Bible) via mod2imp",
            "spm_model": str(sp_path),
            "vocab_size": vocab_size,
            "seq_len": self.seq_len,
            "sizes": {"chapters_train": len(chapters["train"]), "chapters_valid": len(chapters["valid"]),
                      "tokens_train": streams["train"].numel(), "tokens_valid": streams["valid"].numel(),
                      "train": x_train.shape[0], "valid": x_valid.shape[0]},
            "unigram_perplexity": unigram_perplexity(streams["train"], y_valid, vocab_size),
        }
        if holdout is not None:
            info["sizes"]["chapters_holdout"] = n_train_chapters - len(chapters["train"])
            info["sizes"]["holdout"] = holdout
        return TaskData(train=shuffled_batches(x_train, y_train, batch_size, seed),
                        test=batchify(x_valid, y_valid, batch_size, drop_last=False), info=info,
                        validation=validation)

    def traced_model_names(self) -> Sequence[str]:
        return tuple(name for name, settings in MODELS.items() if settings.get("tied"))

    def build_model(self, name: str, data: TaskData, *, seed: int) -> nn.Module:
        if name not in MODELS:
            raise ValueError(f"unknown lm model {name!r}; choose one of: {', '.join(MODELS)}")
        settings = dict(MODELS[name])
        build = TiedGPT if settings.pop("tied", False) else build_gpt
        with seeded(seed):
            return build(int(data.info["vocab_size"]), int(data.info.get("seq_len", self.seq_len)), **settings)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy of logits (B, T, V) against targets (B, T)."""
        return F.cross_entropy(output.flatten(0, 1), target.flatten())

    def evaluate(self, model: nn.Module, data: TaskData, split: str = "test") -> float:
        """Perplexity (lower is better) over all of ``data.test`` (the held-out chapters), or of
        ``data.validation`` with ``split="validation"``."""
        return perplexity(model, data.split(split, f"task {self.name}"))
