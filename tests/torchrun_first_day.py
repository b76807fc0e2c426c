"""Run under torchrun by tests/test_first_day.py: the models of tests/first_day.py as they come,
one stage per process, each fitted with the method and precision given and checkpointed into
``FOLDER/FAMILY-METHOD-PRECISION``; rank 0 prints one JSON line per entry. Argument:
``FAMILY:METHOD:PRECISION,...@FOLDER``."""
import json
import sys
from pathlib import Path

import pipeoptim
from first_day import adamw, batches, model

entries, folder = sys.argv[1].split("@")
for entry in entries.split(","):
    family, method, precision = entry.split(":")
    pipe = pipeoptim.Pipeline(model(family), method=method, precision=precision, optimizer=adamw, stages=2)
    result = pipe.fit(batches(family), checkpoint_dir=Path(folder) / entry.replace(":", "-"))
    if pipe.rank == 0:
        print(json.dumps({"entry": entry, "losses": result.losses, "points": pipe.split_points}), flush=True)
