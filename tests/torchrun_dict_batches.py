"""Run under torchrun by tests/test_dict_batches.py: a library LM (tests/library_models.py)
trained from dict batches with no loss_fn (its own ``output.loss``) on two processes, under
1f1b-flush (one stage per process) or a chunked method (several pieces per process). Arguments:
entries ``FAMILY:DRIVE[:METHOD]`` separated by commas (DRIVE ``step``: step/flush by hand,
``fit``: ``Pipeline.fit``; METHOD default 1f1b-flush), and a folder where rank 0 saves each
trained model's state dict as ``FAMILY-DRIVE[-METHOD].pt``; rank 0 prints one JSON line per entry
with the losses and which stage takes the labels (gathered from every rank)."""
import json
import sys
from pathlib import Path

import torch

import pipeoptim
from library_models import case
from test_dict_batches import dict_batches

out = Path(sys.argv[2])
for entry in sys.argv[1].split(","):
    family, drive, *method = entry.split(":")
    data = dict_batches()
    pipe = pipeoptim.Pipeline(case(family)[0], method=method[0] if method else "1f1b-flush", stages=2,
                              partitioner="uniform",
                              micro_batches=2, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    if drive == "step":
        losses = [loss for batch in data for loss in pipe.step(batch)] + pipe.flush()
    else:
        losses = pipe.fit(data).losses
    takes_target = pipe.world.all_stages([s.takes_target for s in pipe.stages], "which stage takes the labels")
    trained = pipe.model()
    if pipe.rank == 0:
        torch.save(trained.state_dict(), out / f"{entry.replace(':', '-')}.pt")
        print(json.dumps({"entry": entry, "drive": drive, "losses": losses, "takes_target": takes_target}),
              flush=True)
