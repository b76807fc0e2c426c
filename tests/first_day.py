"""A transformers user's first day (issue 49): real library models built from their configs as
the library gives them (``use_cache`` on, the library's tying, its loss from ``labels``), only
smaller, fed dict batches as a training script writes them (a causal LM's ``labels`` is the
very ``input_ids`` tensor), with no ``loss_fn``: the model computes its loss. Shared by
tests/test_first_day.py (one process) and tests/torchrun_first_day.py (the torchrun job).

Dropout is set to 0 where a config has it: a pipeline draws its dropout masks in another order
than the plain loop (stage by stage), so with it no run could equal the plain loop's; every
other field is the library's default.

:func:`plain_loop` is what the user would write without pipeoptim: ``model(**batch).loss``,
``backward`` on each of M micro-batches divided by M, one optimizer step per mini-batch (under
``torch.autocast`` for bf16, with ``clip_grad_norm_`` over the whole model when clipping)."""
from __future__ import annotations

import contextlib
import copy
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

import transformers as T

VOCAB, LENGTH, CLASSES, SIDE = 64, 8, 3, 16
_QUIET = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)  # ids within the small vocabulary
_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=32, vocab_size=VOCAB, **_QUIET)


def gpt2() -> nn.Module:
    """GPT-2, its head tied to the token embedding (the library's default)."""
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_QUIET))


def llama() -> nn.Module:
    """Llama (rotary positions, RMSNorm, its own head: the library's default)."""
    return T.LlamaForCausalLM(T.LlamaConfig(**_DECODER))


def qwen2() -> nn.Module:
    """Qwen2 with its head tied to the embedding (as its small checkpoints ship)."""
    return T.Qwen2ForCausalLM(T.Qwen2Config(tie_word_embeddings=True, **_DECODER))


def bert() -> nn.Module:
    """A BERT encoder with a sequence-classification head (labels are class ids)."""
    return T.BertForSequenceClassification(T.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=CLASSES, pad_token_id=0))


def vit() -> nn.Module:
    """A ViT image classifier (patches, a class token, its head on it)."""
    return T.ViTForImageClassification(T.ViTConfig(
        image_size=SIDE, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=4,
        num_attention_heads=2, intermediate_size=64, num_labels=CLASSES))


def t5() -> nn.Module:
    """T5, an encoder-decoder: it shifts ``labels`` right into its decoder's input itself, and its
    blocks read the encoder's output and a position bias made once per stack."""
    return T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def bart() -> nn.Module:
    """BART, an encoder-decoder whose encoder, decoder and head share one embedding (tied across
    the stages)."""
    return T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2))


#: family -> the model as the library builds it
MODELS: Dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "llama": llama, "qwen2": qwen2, "bert": bert, "vit": vit}
CAUSAL = ("gpt2", "llama", "qwen2")
#: encoder-decoders, fed ``{input_ids, attention_mask, labels}`` as they come (no decoder_input_ids)
SEQ2SEQ: Dict[str, Callable[[], nn.Module]] = {"t5": t5, "bart": bart}
#: where each encoder-decoder may be cut into 2 stages: between encoder and decoder, inside the
#: encoder, inside the decoder
SEQ2SEQ_SPLITS = {"t5": (["decoder.block.0"], ["encoder.block.1"], ["decoder.block.1"]),
                  "bart": (["model.decoder.layers.0"], ["model.encoder.layers.1"], ["model.decoder.layers.1"])}


def model(family: str) -> nn.Module:
    torch.manual_seed(0)
    return {**MODELS, **SEQ2SEQ}[family]()


def padded_batches(family: str, count: int = 3, size: int = 4, seed: int = 3) -> List[Dict[str, torch.Tensor]]:
    """Dict mini-batches of rows of unequal length, as a collator pads them: the padding's
    ``labels`` are -100 and its ``attention_mask`` 0, so that the two halves of a mini-batch
    (M = 2) hold different numbers of real tokens; one row of the second half has a single
    label, which a causal LM never predicts (its loss drops each row's first), so that with
    M = 4 one micro-batch of a causal LM holds no real token at all."""
    g = torch.Generator().manual_seed(seed)
    lengths = [LENGTH, LENGTH - 2, 1, LENGTH - 5][:size]
    out = []
    for _ in range(count):
        ids = torch.randint(3, VOCAB, (size, LENGTH), generator=g)
        mask = torch.zeros_like(ids)
        for row, n in enumerate(lengths):
            mask[row, :n] = 1
        if family in SEQ2SEQ:
            labels = torch.randint(3, VOCAB, (size, LENGTH - 2), generator=g)
            labels[mask[:, :LENGTH - 2] == 0] = -100
            pad = 1 if family == "bart" else 0  # the config's pad_token_id
            out.append({"input_ids": ids.masked_fill(mask == 0, pad), "attention_mask": mask, "labels": labels})
        else:
            out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def whole_batch_loop(net: nn.Module, data: List[Dict[str, torch.Tensor]], optimizer=None, precision: str = "fp32"):
    """(losses, trained copy) of the step on each whole mini-batch, ``model(**batch).loss``: what a
    synchronous pipeline equals whatever its micro-batches (every real token weighed once). bf16
    and fp16 under ``torch.autocast``, fp16 with torch's ``GradScaler``."""
    net = copy.deepcopy(net)
    net.train()
    opt = (optimizer or sgd)(net.parameters())
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    losses = []
    for batch in data:
        with torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext():
            loss = net(**batch).loss
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, net


def sgd(params) -> torch.optim.Optimizer:
    """Plain SGD: its weights follow the gradients linearly, so that two runs whose gradients are
    a rounding apart stay a rounding apart (AdamW's step magnifies a gradient that is all rounding)."""
    return torch.optim.SGD(params, lr=0.5)


def batches(family: str, count: int = 3, size: int = 4, seed: int = 1) -> List[Dict[str, torch.Tensor]]:
    """Dict mini-batches as a training script writes them for ``family`` (an encoder-decoder's
    padded as a seq2seq collator pads them: :func:`padded_batches`)."""
    if family in SEQ2SEQ:
        return padded_batches(family, count, size, seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        if family == "vit":
            out.append({"pixel_values": torch.randn(size, 3, SIDE, SIDE, generator=g),
                        "labels": torch.randint(0, CLASSES, (size,), generator=g)})
            continue
        ids = torch.randint(1, VOCAB, (size, LENGTH), generator=g)
        mask = torch.ones_like(ids)
        mask[0, -2:] = 0  # one padded row: the mask matters
        if family in CAUSAL:
            out.append({"input_ids": ids, "attention_mask": mask, "labels": ids})  # the same tensor
        else:
            out.append({"input_ids": ids, "attention_mask": mask,
                        "labels": torch.randint(0, CLASSES, (size,), generator=g)})
    return out


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def plain_loop(net: nn.Module, data: List[Dict[str, torch.Tensor]], micro: int, precision: str = "fp32",
               clip: Optional[float] = None):
    """(losses, trained copy) of the loop a user writes without pipeoptim (module docstring)."""
    net = copy.deepcopy(net)
    net.train()
    opt = adamw(net.parameters())
    losses = []
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    for batch in data:
        total = 0.0
        for i in range(micro):
            piece = {k: torch.tensor_split(v, micro)[i] for k, v in batch.items()}
            with autocast:
                loss = net(**piece).loss / micro
            loss.backward()
            total += float(loss.detach())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, net


def fed(pipe, data: List[Dict[str, torch.Tensor]]) -> List[float]:
    """Every mini-batch's loss of ``data`` fed to ``pipe`` by hand, then drained."""
    return [loss for batch in data for loss in pipe.step(batch)] + pipe.flush()


def same_weights(a: nn.Module, b: nn.Module, rel: float = 1e-5, atol: float = 1e-4) -> bool:
    """Every entry of the two state dicts, by the library's names, close (atol: AdamW moves a weight
    whose gradient is all rounding, a key bias, by up to its lr, so a rounding apart shows there)."""
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.allclose(sa[k].float(), sb[k].float(), rtol=rel, atol=atol)
                                        for k in sa)
