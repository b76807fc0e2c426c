"""Defaults of the runtime that the command line shows in its options; imports nothing, so that
`pipeoptim --help` does not import torch."""
from __future__ import annotations

DEFAULT_TIMEOUT = 300.0  #: seconds a rank waits for a peer before the run fails
