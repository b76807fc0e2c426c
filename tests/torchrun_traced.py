"""Run under torchrun in tests/conftest.py's 2-process job (``traced_under_torchrun``, for
tests/test_traced.py and tests/test_tied_async.py): a traced model split over the processes, trained with each method given;
rank 0 prints one JSON line per method with the losses and the trained weights. Arguments: one or
more groups of three (one job runs them all; each line names its group by position): the model
(``gpt``: TinyGPT with its head tied to its embedding; ``skip``: SkipNet, two inputs and a skip
connection), the methods (``method:norm`` clips by the global norm) and the split points
(comma-separated; ``-``: none, the default partitioner chooses, and every rank prints the points it
uses)."""
import json
import sys

import torch
from torch import nn

import pipeoptim
from traced_models import SkipNet, TinyGPT, lm_batches, lm_loss, skip_batches

groups = [sys.argv[i:i + 3] for i in range(1, len(sys.argv), 3)]
rows = [(group, which, entry, points.split(",")) for group, (which, methods, points) in enumerate(groups)
        for entry in methods.split(",")]
for group, which, entry, points in rows:
    method, _, clip = entry.partition(":")  # "1f1b-flush:0.5": clipped to 0.5 by the global norm
    torch.manual_seed(0)
    model = TinyGPT(layers=2) if which == "gpt" else SkipNet()
    data = lm_batches(count=4) if which == "gpt" else skip_batches()
    pipe = pipeoptim.Pipeline(model, method=method, split_points=None if points == ["-"] else points,
                              micro_batches=2 if method in (
                                  "gpipe", "1f1b-flush", "pipedream-2bw", "pipeoptim-2bw") else None,
                              loss_fn=lm_loss if which == "gpt" else nn.functional.cross_entropy,
                              clip_grad_norm=float(clip) if clip else None, clip_scope="global" if clip else "stage",
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    losses = [loss for x, y in data for loss in pipe.step(x, y)] + pipe.flush()
    if points == ["-"]:
        # one write, the newline with it: both ranks print here, and an unbuffered print writes the
        # line and its newline apart, so two ranks' lines could join into one
        sys.stdout.write(json.dumps({"group": group, "rank": pipe.rank, "points": pipe.split_points}) + "\n")
        sys.stdout.flush()
    trained = pipe.model()
    elsewhere = pipe.model(device="meta")  # a copy, made on another device than the stages': the tie kept
    if pipe.rank == 0:
        print(json.dumps({"group": group, "method": entry, "losses": losses,
                          "tied": which == "gpt" and trained.head.weight is trained.embed.weight
                          and elsewhere.head.weight is elsewhere.embed.weight,
                          "weights": {k: v.tolist() for k, v in trained.state_dict().items()}}), flush=True)
