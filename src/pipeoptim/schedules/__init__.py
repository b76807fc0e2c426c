"""Pipeline schedules as data: generators, a simulator, lowering and renderers."""
from .actions import Action, Kind, Schedule
from .registry import DESCRIPTIONS, build_schedule, schedule_names
from .simulate import Costs, DeadlockError, SimResult, analytic_bubble_fraction, peak_activations, simulate

__all__ = ["Action", "Kind", "Schedule", "DESCRIPTIONS", "build_schedule", "schedule_names",
           "Costs", "DeadlockError", "SimResult", "analytic_bubble_fraction", "peak_activations",
           "simulate"]
