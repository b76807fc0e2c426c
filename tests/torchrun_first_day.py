"""Run under torchrun for tests/test_first_day.py: the library models under torchrun, one stage per
process, in the session's 2-process job (tests/conftest.py's ``torchrun_2``). Argument:
``FAMILY:METHOD:PRECISION,...@FOLDER``; rank 0 prints one JSON line per entry: its losses, its
cut, and whether the trained model's head is still its input embedding (one tensor, after
``model()`` gathered it).

* A family of tests/first_day.py (the models as they come, dict batches, the model's own loss):
  a synchronous method fits the family's mini-batches, checkpointed into
  ``FOLDER/FAMILY-METHOD-PRECISION``; an asynchronous one is fed one mini-batch six times, by hand
  (``first_day.fed``), as test_first_day.py's test_asynchronous_methods_train feeds it in one process.
* A family of tests/library_models.py (``resnet``): the user's loss_fn, SGD with momentum, the
  uniform partitioner and two micro-batches, fed by hand (as tests/test_library_models.py does).

The job preloads what it imports (transformers and its models: tests/conftest.py's ``PRELOAD``) and
leaves it out of the garbage collections of each Pipeline's teardown (tests/torchrun_jobs.py)."""
import json
import sys
from pathlib import Path

import torch

import pipeoptim
from first_day import MODELS, SEQ2SEQ, adamw, batches, fed, model
from library_models import case

ASYNCHRONOUS_FEEDS = 6


def tied(trained: torch.nn.Module) -> bool:
    """Is the trained model's output embedding (its head) the very tensor of its input embedding?"""
    head = trained.get_output_embeddings() if hasattr(trained, "get_output_embeddings") else None
    return head is not None and head.weight is trained.get_input_embeddings().weight


def run(entry: str, folder: Path):
    family, method, precision = entry.split(":")
    if family not in MODELS and family not in SEQ2SEQ:  # a model of tests/library_models.py
        net, loss_fn, data = case(family)
        pipe = pipeoptim.Pipeline(net, method=method, stages=2, partitioner="uniform", loss_fn=loss_fn,
                                  micro_batches=2, precision=precision,
                                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
        return pipe, [loss for x, y in data for loss in pipe.step(x, y)] + pipe.flush()
    pipe = pipeoptim.Pipeline(model(family), method=method, precision=precision, optimizer=adamw, stages=2)
    if pipe.method.synchronous:
        return pipe, pipe.fit(batches(family), checkpoint_dir=folder / entry.replace(":", "-")).losses
    return pipe, fed(pipe, batches(family, count=1) * ASYNCHRONOUS_FEEDS)


entries, folder = sys.argv[1].split("@")
for entry in entries.split(","):
    pipe, losses = run(entry, Path(folder))
    trained = pipe.model()
    if pipe.rank == 0:
        print(json.dumps({"entry": entry, "losses": losses, "points": pipe.split_points, "tied": tied(trained)}),
              flush=True)
