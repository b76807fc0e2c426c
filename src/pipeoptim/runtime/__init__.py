"""Executing schedules: one stage implementation (stage.py), a local and a distributed executor."""
from .local import run_schedule
from .stage import Stage, TraceEntry

__all__ = ["Stage", "TraceEntry", "run_schedule"]
