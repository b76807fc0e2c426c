"""What a traced model costs in `pipeoptim.Pipeline`, against the same model as an `nn.Sequential`
(issue 25's benchmark): the Pipeline's per-step overhead over a plain PyTorch loop, for a GPT-like
model given (a) as people write it (an embedding, a `ModuleList` of blocks called in a loop, a
norm, a head; traced by torch.export and run as its aten graph) and (b) as an `nn.Sequential` of
the same layers. Each is timed as a plain loop over the model and as `Pipeline(method=
"sequential")` and `Pipeline(method="1f1b-flush", stages=2)` on it; rounds interleaved, one compute
thread, each Pipeline's time divided by its own model's plain loop in the same round; the medians
over rounds are reported (after one unmeasured pass of each). Target: the traced model's overhead within 5 % of the `nn.Sequential`'s
(the ratios' difference at most 0.05). The head is left untied here, so that both forms hold
the same parameters and do the same work.

    .venv/bin/python benchmarks/traced_overhead.py [--rounds 5] [--steps 40]

Writes benchmarks/results/traced_overhead.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import pipeoptim

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from traced_models import TinyGPT, lm_batches, lm_loss  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "traced_overhead.json"


class Embed(nn.Module):
    """The GPT's first step as a layer of an ``nn.Sequential``: token and position embeddings."""

    def __init__(self, gpt: TinyGPT) -> None:
        super().__init__()
        self.embed, self.position = gpt.embed, gpt.position

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))


def as_sequential(gpt: TinyGPT) -> nn.Sequential:
    return nn.Sequential(Embed(gpt), *gpt.layers, gpt.norm, gpt.head)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def plain(model: nn.Module, data) -> float:
    model = model.train()
    opt = optimizer(model.parameters())
    start = time.perf_counter()
    for x, y in data:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    return time.perf_counter() - start


def pipelined(model: nn.Module, data, method: str) -> float:
    pipe = pipeoptim.Pipeline(model, method=method, stages=None if method == "sequential" else 2,
                              loss_fn=lm_loss, optimizer=optimizer, example_input=data[0][0],
                              partitioner="uniform")  # tracing and splitting are not timed
    start = time.perf_counter()
    for x, y in data:
        pipe.step(x, y)
    pipe.flush()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gpt = TinyGPT(vocab=512, width=args.width, layers=args.layers, context=64, tied=False)
    forms = {"traced": gpt, "sequential": as_sequential(gpt)}
    data = lm_batches(count=args.steps, size=16, length=64, vocab=512)
    ratios = {(form, method): [] for form in forms for method in ("sequential", "1f1b-flush")}
    for model in forms.values():  # one unmeasured pass of each: first calls, allocator warm-up
        plain(model, data[:2])
        pipelined(model, data[:2], "sequential")
    for _ in range(args.rounds):
        for form, model in forms.items():
            base = plain(model, data)
            for method in ("sequential", "1f1b-flush"):
                ratios[form, method].append(pipelined(model, data, method) / base)
    report = {"layers": args.layers, "width": args.width, "steps": args.steps, "rounds": args.rounds,
              "threads": 1, "host": os.uname().nodename,
              "ratio_to_plain_loop": {f"{form}/{method}": {"median": statistics.median(v), "min": min(v), "max": max(v)}
                                      for (form, method), v in ratios.items()}}
    report["traced_minus_sequential"] = {
        method: report["ratio_to_plain_loop"][f"traced/{method}"]["median"]
        - report["ratio_to_plain_loop"][f"sequential/{method}"]["median"] for method in ("sequential", "1f1b-flush")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
