"""Models written as people write them (not an nn.Sequential), for tests/test_traced.py and
tests/torchrun_traced.py."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape  # sizes the traced stages read again from their inputs
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(width, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Embedding, a ModuleList of blocks called in a loop, a final norm, and a head whose weight
    is the embedding's (GPT-2's tying) unless ``tied=False``."""

    def __init__(self, vocab: int = 24, width: int = 16, layers: int = 3, context: int = 8,
                 tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class Embed(nn.Module):
    """The GPT's first step as a layer of an ``nn.Sequential``: token and position embeddings."""

    def __init__(self, gpt: TinyGPT) -> None:
        super().__init__()
        self.embed, self.position = gpt.embed, gpt.position

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))


def as_sequential(gpt: TinyGPT) -> nn.Sequential:
    """The same layers (shared, not copied) as an ``nn.Sequential``: Embed, the blocks, norm, head."""
    return nn.Sequential(Embed(gpt), *gpt.layers, gpt.norm, gpt.head)


class SkipNet(nn.Module):
    """Two inputs (features and a mask), a value that skips two stages, a tuple inside: several
    tensors cross every cut."""

    def __init__(self, width: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        skip = h
        for block in self.blocks:
            h = torch.tanh(block(h)) * mask
        return self.out(torch.cat([h, skip], dim=1))


class SmallCNN(nn.Module):
    """Batch norm and dropout: a forward that differs in eval mode."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(self.body(self.stem(x)).mean((2, 3))))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def lm_batches(count: int = 4, size: int = 4, length: int = 8, vocab: int = 24, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (size, length + 1), generator=g)
        data.append((tokens[:, :-1], tokens[:, 1:]))
    return data


def skip_batches(count: int = 4, size: int = 6, seed: int = 2):
    """SkipNet's mini-batches: ((features, mask), class)."""
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(size, 8, generator=g), (torch.rand(size, 8, generator=g) > 0.2).float()),
             torch.randint(0, 3, (size,), generator=g)) for _ in range(count)]


class ToComplex(nn.Module):
    """A layer whose output holds dtypes NCCL lacks: a complex activation (as a complex rotary
    table makes) and an int16 mask."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.real, self.imag = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor):
        return torch.complex(self.real(x), self.imag(x)), (x > 0).to(torch.int16)


class FromComplex(nn.Module):
    """Reads what :class:`ToComplex` made: a phase-mixed complex product back to real values."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.turn = nn.Parameter(torch.randn(width, dtype=torch.complex64) / width ** 0.5)
        self.out = nn.Linear(2 * width, 3)

    def forward(self, pair) -> torch.Tensor:
        z, mask = pair
        z = z * self.turn
        return self.out(torch.cat([z.real + mask, z.imag], -1))


def odd_dtypes_model() -> nn.Sequential:
    """An nn.Sequential cut by partition=[2, 1]: a complex64 and an int16 tensor cross the cut
    (and a complex64 gradient crosses back)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), ToComplex(), FromComplex())

