"""The planner's choices that `pipeoptim plan` lists in its options, importable without torch
(:mod:`pipeoptim.lab.planner`, which profiles models, imports it)."""
from __future__ import annotations

PARTITIONERS = ("uniform", "params", "time")  #: the splits a plan compares (see pipeoptim.partition)
#: methods predicted; a name with ``+ef`` is that method with error feedback (pipeoptim.methods.split_variant).
#: Every variant the equal-time study's advice names is among them (tests/test_plan_feedback.py)
DEFAULT_METHODS = ("gpipe", "1f1b-flush", "zb-h1", "interleaved", "zb-v", "dualpipev", "bidirectional", "bitpipe",
                   "pipedream", "pipedream-2bw", "xpipe", "pipeoptim", "pipeoptim-2bw", "pipeoptim-2bw+ef")
DEFAULT_MICROBATCHES = (1, 2, 4, 8)  #: micro-batch counts predicted
