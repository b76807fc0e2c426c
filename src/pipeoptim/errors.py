"""Exceptions a user of pipeoptim may catch. A leaf module: it imports neither torch nor any
other part of pipeoptim, so the command line can catch them without loading torch."""
from __future__ import annotations


class NonFiniteLoss(RuntimeError):
    """Training produced a NaN or infinite loss."""
