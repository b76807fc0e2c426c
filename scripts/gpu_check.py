"""What to run first on a machine with a GPU: the CUDA tests, then every method training a tied GPT
on one GPU (all stages on it) in fp32 and bf16, eager and compiled (``Pipeline(compile=...)``,
inductor unless ``--backend`` says another), printed as one table: method, compiled, precision, the loss after K updates against
``sequential``'s in the same precision, samples/s. Without CUDA it says so in one line and exits 0.

    scripts/gpu_check.sh [--updates 8] [--methods a,b] [--out results.json]
    python scripts/gpu_check.py --device cpu --methods 1f1b-flush --updates 2 --backend aot_eager
        (the table's path, on the CPU)

The model and the data are made here (synthetic tokens), so nothing but torch and this repository
is needed. Exit status: 0 when everything ran (the losses are reported, not judged), 1 when a run
or a CUDA test failed.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import pipeoptim  # noqa: E402

VOCAB, WIDTH, LENGTH = 64, 64, 32


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, 4, width // 4).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(width, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.ln2(x))


class TiedGPT(nn.Module):
    """Embedding, 4 blocks in a ModuleList, a norm, and a head whose weight is the embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(VOCAB, WIDTH), nn.Embedding(LENGTH, WIDTH)
        self.layers = nn.ModuleList(Block(WIDTH) for _ in range(4))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)  # (GPT-2's: the tied head's logits start small)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def batches(count: int, size: int = 16) -> List[Any]:
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, VOCAB, (size, LENGTH + 1), generator=g) for _ in range(count)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def run(method: str, precision: str, compiled: Optional[str], device: str, updates: int) -> Dict[str, Any]:
    """One method's K updates on the tied GPT (``compiled``: the torch.compile backend, None:
    eager): its last loss and samples/s (after one warm-up)."""
    torch.manual_seed(0)
    pipe = pipeoptim.Pipeline(TiedGPT(), method=method, stages=None if method == "sequential" else 2,
                              loss_fn=lm_loss, devices=device, precision=precision, compile=compiled or False,
                              partitioner="params",  # not by measured time: the same split every run
                              optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    data = batches(updates + 1)
    pipe.fit(data[:1])  # the warm-up: splitting, allocation (and compilation)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = pipe.fit(data[1:])
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"method": method, "compiled": compiled is not None, "precision": precision, "loss": result.losses[-1],
            "samples_per_second": sum(x.shape[0] for x, _ in data[1:]) / seconds}


def cuda_tests() -> Optional[int]:
    """The test suite's CUDA tests (pytest's exit status), or None without pytest."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        return None
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "tests/test_pipeline.py", "tests/test_profile.py", "-k", "cuda"], cwd=REPO)
    return done.returncode


def table(rows: List[Dict[str, Any]]) -> List[str]:
    """One line per run: method, compiled, precision, loss after K against sequential's, samples/s."""
    base = {(r["precision"], r["compiled"]): r["loss"] for r in rows if r["method"] == "sequential" and "loss" in r}
    lines = [f"{'method':<15}{'compiled':>9}{'precision':>10}{'loss':>10}{'sequential':>11}{'samples/s':>11}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['method']:<15}{str(r['compiled']):>9}{r['precision']:>10}  failed: {r['error']}")
            continue
        ref = base.get((r["precision"], r["compiled"]))
        lines.append(f"{r['method']:<15}{str(r['compiled']):>9}{r['precision']:>10}{r['loss']:>10.4f}"
                     f"{ref if ref is None else f'{ref:.4f}':>11}{r['samples_per_second']:>11.0f}")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default; without one: say so, exit 0) or cpu")
    parser.add_argument("--updates", type=int, default=8, help="updates K each method trains (default 8)")
    parser.add_argument("--methods", default=None, help="comma-separated (default: every method)")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated (default: fp32,bf16)")
    parser.add_argument("--backend", default="inductor", help="the compiled runs' torch.compile backend "
                        "(default inductor; aot_eager compiles in seconds, for a quick look)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
              f"nothing to check")
        return 0
    failed = False
    if args.device == "cuda":
        print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
        status = cuda_tests()
        print("gpu_check: the CUDA tests " + ("were not run (no pytest)" if status is None else
                                             "passed" if status == 0 else f"failed (pytest exit {status})"))
        failed = status not in (None, 0)
    methods = args.methods.split(",") if args.methods else pipeoptim.method_names()
    methods = ["sequential"] + [m for m in methods if m != "sequential"]
    modes = [None, args.backend]
    rows = []
    for compiled in modes:
        for precision in args.precisions.split(","):
            for method in methods:
                try:
                    rows.append(run(method, precision, compiled, args.device, args.updates))
                except Exception as error:  # noqa: BLE001 - report every method, then fail
                    rows.append({"method": method, "compiled": compiled is not None, "precision": precision,
                                 "error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"})
                    failed = True
    print("\n".join(table(rows)))
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
