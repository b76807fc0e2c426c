"""Errors a user can fix or catch, importable without torch.

The command line catches these to print one line instead of a traceback, and it parses its
options without importing torch; so they live here, in a module that imports nothing, and are
re-exported from the modules that raise them (:mod:`pipeoptim.checkpoint`,
:mod:`pipeoptim.tasks`, :mod:`pipeoptim.train`).
"""
from __future__ import annotations

__all__ = ["CheckpointError", "MissingDataError", "NonFiniteLoss"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and why."""


class MissingDataError(RuntimeError):
    """A data set or a package it comes from is not installed; the message names the fix."""


class NonFiniteLoss(RuntimeError):
    """Training produced a NaN or infinite loss."""
