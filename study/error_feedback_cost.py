"""What error feedback (``error_feedback=True``) costs per update on the equal-time study's LM
model (gpt-narrow, vocabulary 2,000, 16 sequences of 64 tokens): pipedream-2bw at N = 8 on the
local runtime, fits of 40 mini-batches with and without it, alternating, CPU time on one thread;
and the feedback's two passes alone over the whole model's parameters.

    .venv/bin/python -m study.error_feedback_cost [--rounds 3]

Writes ``study/results/error_feedback_cost.json``."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Optional, Sequence

import torch
from torch import nn

import pipeoptim
from study.common import RESULTS
from pipeoptim.lab.tasks.lm import MODELS, build_gpt
from pipeoptim.weights.error_feedback import UpdateFeedback

VOCAB, SEQ, BATCH, BATCHES = 2000, 64, 16, 40


def model() -> nn.Module:
    settings = {k: v for k, v in MODELS["gpt-narrow"].items() if k != "tied"}
    torch.manual_seed(0)
    return build_gpt(VOCAB, SEQ, **settings)


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))
            for _ in range(BATCHES)]
    fits = {False: [], True: []}
    for _ in range(args.rounds):
        for feedback in (False, True):
            pipe = pipeoptim.Pipeline(model(), stages=8, method="pipedream-2bw", loss_fn=loss,
                                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), error_feedback=feedback)
            start = time.process_time()
            pipe.fit(data)
            fits[feedback].append(time.process_time() - start)
    named = list(model().named_parameters())
    passes = UpdateFeedback(named)
    seconds = []
    for _ in range(50):
        start = time.perf_counter()
        passes.before_step()
        passes.after_step(1)
        seconds.append(time.perf_counter() - start)
    plain, with_feedback = statistics.median(fits[False]), statistics.median(fits[True])
    result = {"parameters": sum(p.numel() for _, p in named), "rounds": args.rounds, "batches": BATCHES,
              "fit_cpu_seconds": {"plain": plain, "error_feedback": with_feedback},
              "ratio": with_feedback / plain, "passes_ms_per_update": statistics.median(seconds) * 1e3,
              "update_ms": plain / BATCHES * 1e3}
    (RESULTS / "error_feedback_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['parameters']} parameters; CPU s per fit of {BATCHES}: plain {plain:.3f}, error feedback "
          f"{with_feedback:.3f} ({result['ratio']:.3f}x); the two passes {result['passes_ms_per_update']:.2f} ms "
          f"per update of {result['update_ms']:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
