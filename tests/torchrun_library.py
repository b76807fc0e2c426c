"""Run under torchrun by tests/test_library_models.py: library models (tests/library_models.py)
split over the processes (one stage each, cut by the uniform partitioner), each trained with the
method given; rank 0 prints one JSON line per entry with the losses. Arguments: entries
``FAMILY:METHOD`` separated by commas (``gpt2:1f1b-flush,resnet:pipeoptim``)."""
import json
import sys

import torch

import pipeoptim
from library_models import case
from test_library_models import micro_batches

for entry in sys.argv[1].split(","):
    family, method = entry.split(":")
    model, loss_fn, data = case(family)
    pipe = pipeoptim.Pipeline(model, method=method, stages=2, partitioner="uniform", loss_fn=loss_fn,
                              micro_batches=micro_batches(method),
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    losses = [loss for x, y in data for loss in pipe.step(x, y)] + pipe.flush()
    trained = pipe.model()
    if pipe.rank == 0:
        embeddings = trained.get_output_embeddings() if hasattr(trained, "get_output_embeddings") else None
        print(json.dumps({"entry": entry, "losses": losses, "points": pipe.split_points,
                          "tied": embeddings is not None and embeddings.weight is trained.get_input_embeddings().weight}),
              flush=True)
