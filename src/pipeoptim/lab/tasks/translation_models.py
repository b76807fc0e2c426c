"""The translation task's models (:mod:`pipeoptim.lab.tasks.translation` describes them, the data
and the evaluation): a small pre-LayerNorm encoder-decoder transformer and a scaled-down GNMT,
each an ``nn.Sequential`` of blocks that pass one tuple along (source states, pad masks, target
states), so that any cut between blocks is a pipeline stage boundary. Pad masks are ``int64``
(1 = padding) and travel with the activations; every block builds what it needs (bool masks,
the causal mask) from its own inputs."""
from __future__ import annotations

import math
from typing import Any, List, Tuple

import torch
from torch import nn

from .text import PAD_ID, pad_mask


# --------------------------------------------------------------------------------------------
# blocks: transformer


def sinusoidal_positions(length: int, dim: int) -> torch.Tensor:
    """The (length, dim) sine/cosine position table of Vaswani et al."""
    pos = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table


class _TokenEmbedding(nn.Module):
    """ids (B, T) -> scaled embeddings plus sinusoidal positions, with dropout."""

    def __init__(self, vocab_size: int, d_model: int, dropout: float, max_len: int = 512):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d_model, padding_idx=PAD_ID)
        nn.init.normal_(self.emb.weight, std=d_model ** -0.5)
        with torch.no_grad():
            self.emb.weight[PAD_ID].zero_()
        self.register_buffer("pos", sinusoidal_positions(max_len, d_model), persistent=False)
        self.scale = math.sqrt(d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.emb(ids) * self.scale + self.pos[: ids.shape[1]])


class SrcEmbed(nn.Module):
    """(src_ids, tgt_in_ids) -> (src_states (B, S, d), src_pad (B, S) int64, tgt_in_ids)."""

    def __init__(self, vocab_size: int, d_model: int, dropout: float):
        super().__init__()
        self.embed = _TokenEmbedding(vocab_size, d_model, dropout)

    def forward(self, inp: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        src, tgt_in = inp
        return self.embed(src), pad_mask(src), tgt_in


class EncoderLayerBlock(nn.Module):
    """(src_states, src_pad, tgt_in_ids) -> same: one pre-LN encoder layer (the last one of the
    encoder also applies the final LayerNorm)."""

    def __init__(self, d_model: int, nhead: int, d_ff: int, dropout: float, final_norm: bool = False):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model, nhead, d_ff, dropout, batch_first=True, norm_first=True)
        self.norm = nn.LayerNorm(d_model) if final_norm else nn.Identity()

    def forward(self, inp: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, src_pad, tgt_in = inp
        return self.norm(self.layer(x, src_key_padding_mask=src_pad.bool())), src_pad, tgt_in


class TgtEmbed(nn.Module):
    """(memory, src_pad, tgt_in_ids) -> (memory, src_pad, tgt_states (B, T, d), tgt_pad (B, T) int64)."""

    def __init__(self, vocab_size: int, d_model: int, dropout: float):
        super().__init__()
        self.embed = _TokenEmbedding(vocab_size, d_model, dropout)

    def forward(self, inp: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, ...]:
        memory, src_pad, tgt_in = inp
        return memory, src_pad, self.embed(tgt_in), pad_mask(tgt_in)


class DecoderLayerBlock(nn.Module):
    """(memory, src_pad, tgt_states, tgt_pad) -> same tuple, or, for the ``last`` decoder layer,
    the final-LayerNormed ``tgt_states`` alone (nothing after it needs the memory)."""

    def __init__(self, d_model: int, nhead: int, d_ff: int, dropout: float, last: bool = False):
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(d_model, nhead, d_ff, dropout, batch_first=True, norm_first=True)
        self.last = last
        self.norm = nn.LayerNorm(d_model) if last else nn.Identity()

    def forward(self, inp: Tuple[torch.Tensor, ...]) -> Any:
        memory, src_pad, y, tgt_pad = inp
        t = y.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=y.device).triu(1)
        y = self.layer(y, memory, tgt_mask=causal, tgt_key_padding_mask=tgt_pad.bool(),
                       memory_key_padding_mask=src_pad.bool(), tgt_is_causal=True)
        if self.last:
            return self.norm(y)
        return memory, src_pad, y, tgt_pad


class Generator(nn.Module):
    """Decoder states (B, T, d) -> logits (B, T, vocab)."""

    def __init__(self, d: int, vocab_size: int, dropout: float = 0.0):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.proj = nn.Linear(d, vocab_size)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.proj(self.drop(y))


def build_transformer(vocab_size: int, d_model: int = 128, nhead: int = 4, d_ff: int = 512,
                      enc_layers: int = 2, dec_layers: int = 2, dropout: float = 0.1) -> nn.Sequential:
    blocks: List[nn.Module] = [SrcEmbed(vocab_size, d_model, dropout)]
    blocks += [EncoderLayerBlock(d_model, nhead, d_ff, dropout, final_norm=(i == enc_layers - 1)) for i in range(enc_layers)]
    blocks.append(TgtEmbed(vocab_size, d_model, dropout))
    blocks += [DecoderLayerBlock(d_model, nhead, d_ff, dropout, last=(i == dec_layers - 1)) for i in range(dec_layers)]
    blocks.append(Generator(d_model, vocab_size))
    return nn.Sequential(*blocks)


# --------------------------------------------------------------------------------------------
# blocks: GNMT-style LSTM encoder-decoder


class GNMTEmbed(nn.Module):
    """(src_ids, tgt_in_ids) -> (src embeddings (B, S, d), src_pad, tgt_in_ids)."""

    def __init__(self, vocab_size: int, d: int, dropout: float):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d, padding_idx=PAD_ID)
        self.drop = nn.Dropout(dropout)

    def forward(self, inp: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        src, tgt_in = inp
        return self.drop(self.emb(src)), pad_mask(src), tgt_in


class BiLSTMBlock(nn.Module):
    """(x, src_pad, tgt_in_ids) -> (states (B, S, hidden), src_pad, tgt_in_ids): the bidirectional
    bottom encoder layer (hidden/2 per direction). Sequences are packed by length so the backward
    direction starts at each sentence's last real token, not at the padding."""

    def __init__(self, d_in: int, hidden: int, dropout: float):
        super().__init__()
        self.lstm = nn.LSTM(d_in, hidden // 2, batch_first=True, bidirectional=True)
        self.drop = nn.Dropout(dropout)

    def forward(self, inp: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, ...]:
        x, src_pad, tgt_in = inp
        lengths = (1 - src_pad).sum(1).clamp_min(1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        y, _ = self.lstm(packed)
        y, _ = nn.utils.rnn.pad_packed_sequence(y, batch_first=True, total_length=x.shape[1])
        return self.drop(y), src_pad, tgt_in


class EncLSTMBlock(nn.Module):
    """(x, src_pad, tgt_in_ids) -> same: one unidirectional encoder LSTM layer, with a residual
    connection if ``residual`` (GNMT uses residuals from the third layer on)."""

    def __init__(self, hidden: int, dropout: float, residual: bool):
        super().__init__()
        self.lstm = nn.LSTM(hidden, hidden, batch_first=True)
        self.residual = residual
        self.drop = nn.Dropout(dropout)

    def forward(self, inp: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, ...]:
        x, src_pad, tgt_in = inp
        y, _ = self.lstm(x)
        y = self.drop(y)
        return (x + y if self.residual else y), src_pad, tgt_in


class AttentionDecoderBlock(nn.Module):
    """(memory (B, S, h), src_pad, tgt_in_ids) -> (h1 (B, T, h), context (B, T, h)).

    Embeds the target prefix, runs the bottom decoder LSTM, and attends from its outputs to
    the encoder states (scaled dot product after a linear map of the queries; pad positions
    masked). As in GNMT, the bottom layer's output gives the attention context that all higher
    decoder layers receive, so teacher-forced training runs over all positions at once.
    """

    def __init__(self, vocab_size: int, d: int, hidden: int, dropout: float):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d, padding_idx=PAD_ID)
        self.lstm = nn.LSTM(d, hidden, batch_first=True)
        self.query = nn.Linear(hidden, hidden, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, inp: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, torch.Tensor]:
        memory, src_pad, tgt_in = inp
        h, _ = self.lstm(self.drop(self.emb(tgt_in)))
        scores = self.query(h) @ memory.transpose(1, 2) / math.sqrt(memory.shape[-1])  # (B, T, S)
        scores = scores.masked_fill(src_pad.bool().unsqueeze(1), float("-inf"))
        context = torch.softmax(scores, dim=-1) @ memory
        return self.drop(h), context


class DecLSTMBlock(nn.Module):
    """(h, context) -> (h', context): a decoder LSTM layer fed [h; context]; residual if asked.
    The ``last`` layer returns ``h'`` alone."""

    def __init__(self, hidden: int, dropout: float, residual: bool, last: bool = False):
        super().__init__()
        self.lstm = nn.LSTM(2 * hidden, hidden, batch_first=True)
        self.residual = residual
        self.last = last
        self.drop = nn.Dropout(dropout)

    def forward(self, inp: Tuple[torch.Tensor, torch.Tensor]) -> Any:
        h, context = inp
        y, _ = self.lstm(torch.cat([h, context], dim=-1))
        y = self.drop(y)
        if self.residual:
            y = y + h
        return y if self.last else (y, context)


def build_gnmt(vocab_size: int, d: int = 256, hidden: int = 256, dropout: float = 0.1) -> nn.Sequential:
    """GNMT scaled down: 3 encoder layers (bi, uni, uni + residual), 3 decoder layers (the
    attention block, then uni, uni + residual), 256 units."""
    return nn.Sequential(
        GNMTEmbed(vocab_size, d, dropout),
        BiLSTMBlock(d, hidden, dropout),
        EncLSTMBlock(hidden, dropout, residual=False),
        EncLSTMBlock(hidden, dropout, residual=True),
        AttentionDecoderBlock(vocab_size, d, hidden, dropout),
        DecLSTMBlock(hidden, dropout, residual=False),
        DecLSTMBlock(hidden, dropout, residual=True, last=True),
        Generator(hidden, vocab_size),
    )
