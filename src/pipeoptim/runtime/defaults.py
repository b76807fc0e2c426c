"""Defaults and choices of the runtime that the command line shows in its options; imports nothing, so that
`pipeoptim --help` does not import torch."""
from __future__ import annotations

DEFAULT_TIMEOUT = 300.0  #: seconds a rank waits for a peer before the run fails
PRECISIONS = ("fp32", "bf16")       #: the precisions a stage runs its passes in
CLIP_SCOPES = ("stage", "global")   #: clipping by each stage's norm, or by the norm over all stages
#: the torch.compile backends the command line offers (runtime/compiled.py; the API takes any)
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
