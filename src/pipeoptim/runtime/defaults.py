"""Defaults and choices of the runtime that the command line shows in its options; imports nothing, so that
`pipeoptim --help` does not import torch."""
from __future__ import annotations

DEFAULT_TIMEOUT = 300.0  #: seconds a rank waits for a peer before the run fails
PRECISIONS = ("fp32", "bf16", "fp16")  #: the precisions a stage runs its passes in
#: clipping by the norm over all stages where the method allows it (auto), by it (global), or by each
#: stage's own norm (stage)
CLIP_SCOPES = ("auto", "global", "stage")
#: the method the study recommends: a synchronous zero-bubble pipeline (README, "Which method")
DEFAULT_METHOD = "zb-h1"
#: the torch.compile backends the command line offers (runtime/compiled.py; the API takes any)
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
