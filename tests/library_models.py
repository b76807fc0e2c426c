"""Models of a well-known model library (Hugging Face ``transformers``), each built from a tiny
config with random weights (nothing downloaded), for tests/test_library_models.py and the
torchrun job of tests/torchrun_first_day.py: decoder-only language models and convolutional image
classifiers.
Nothing here tells pipeoptim which family a model is: each is given to the Pipeline as it is.

``transformers`` is a test dependency (the ``test`` extra of pyproject.toml), which ``make
setup`` (and so ``make test``) installs; it does not depend on torch, so it leaves the pinned
CPU torch alone."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn
from torch.nn import functional as F

try:
    import transformers as T
except ImportError as error:  # a test dependency: make setup installs it
    raise ImportError("the library-model tests need transformers, a test dependency (pyproject.toml's "
                      "`test` extra): run `make setup`, which installs it (or `pip install -e '.[test]'`)") from error

VOCAB, LENGTH, CLASSES, SIDE = 24, 8, 3, 16
_LM = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)  # use_cache as the library sets it (on)
_SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
              max_position_embeddings=16)


def gpt2(tied: bool = True) -> nn.Module:
    """GPT-2 (learned positions, the head tied to the token embedding unless ``tied=False``)."""
    return T.GPT2LMHeadModel(T.GPT2Config(n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                                          embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied, **_LM))


#: decoder-only LMs by family: (ids (B, T) -> ModelOutput with .logits (B, T, VOCAB))
LANGUAGE_MODELS: Dict[str, Callable[[], nn.Module]] = {
    "gpt2": gpt2,
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(num_key_value_heads=1, tie_word_embeddings=True,
                                                      pad_token_id=0, **_SMALL, **_LM)),
    "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(num_key_value_heads=1, tie_word_embeddings=True,
                                                      **_SMALL, **_LM)),
    "gpt-neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**_SMALL, **_LM)),
    "opt": lambda: T.OPTForCausalLM(T.OPTConfig(hidden_size=16, ffn_dim=32, num_hidden_layers=2,
                                                num_attention_heads=2, max_position_embeddings=16,
                                                word_embed_proj_dim=16, pad_token_id=1, dropout=0.0, **_LM)),
}


def resnet() -> nn.Module:
    """ResNet (basic blocks, batch norm, one block per stage)."""
    return T.ResNetForImageClassification(T.ResNetConfig(
        num_channels=1, embedding_size=8, hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1], layer_type="basic",
        num_labels=CLASSES))


#: convolutional image classifiers by family: (images (B, 1, SIDE, SIDE) -> ModelOutput with .logits)
IMAGE_MODELS: Dict[str, Callable[[], nn.Module]] = {
    "resnet": resnet,
    "convnext": lambda: T.ConvNextForImageClassification(T.ConvNextConfig(
        num_channels=1, hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1], patch_size=2, num_labels=CLASSES)),
    "regnet": lambda: T.RegNetForImageClassification(T.RegNetConfig(
        num_channels=1, embedding_size=8, hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1], groups_width=8,
        num_labels=CLASSES)),
    "mobilenet-v2": lambda: T.MobileNetV2ForImageClassification(T.MobileNetV2Config(
        num_channels=1, image_size=SIDE, depth_multiplier=0.25, classifier_dropout_prob=0.0,
        num_labels=CLASSES)),
}


def lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of a library LM's output (its ``.logits``) against the next ids."""
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def image_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a library classifier's ``.logits`` against the classes."""
    return F.cross_entropy(output.logits, target)


def lm_batches(count: int = 3, size: int = 4, seed: int = 1) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Random token mini-batches: (ids (size, LENGTH), the next ids)."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, VOCAB, (size, LENGTH + 1), generator=g) for _ in range(count)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def image_batches(count: int = 3, size: int = 4, seed: int = 2) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Random image mini-batches: (images (size, 1, SIDE, SIDE), classes (size,))."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 1, SIDE, SIDE, generator=g), torch.randint(0, CLASSES, (size,), generator=g))
            for _ in range(count)]


def case(name: str) -> Tuple[nn.Module, Callable, List[Tuple[torch.Tensor, torch.Tensor]]]:
    """(a freshly seeded model, its loss, its mini-batches) for a family name; ``gpt2-untied``
    is GPT-2 with a head of its own."""
    torch.manual_seed(0)
    if name == "gpt2-untied":
        return gpt2(tied=False), lm_loss, lm_batches()
    if name in LANGUAGE_MODELS:
        return LANGUAGE_MODELS[name](), lm_loss, lm_batches()
    return IMAGE_MODELS[name](), image_loss, image_batches()
