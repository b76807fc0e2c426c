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


#: family -> the model as the library builds it
MODELS: Dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "llama": llama, "qwen2": qwen2, "bert": bert, "vit": vit}
CAUSAL = ("gpt2", "llama", "qwen2")


def model(family: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[family]()


def batches(family: str, count: int = 3, size: int = 4, seed: int = 1) -> List[Dict[str, torch.Tensor]]:
    """Dict mini-batches as a training script writes them for ``family``."""
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
