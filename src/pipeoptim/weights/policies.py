"""Weight policies by name: which weights each pass of each micro-batch uses, one class per
method family (docs/architecture.md, "Weight versions per method").

The classes live in :mod:`.base` (interface, no copies), :mod:`.stash`, :mod:`.predicting` and
:mod:`.predicted_2bw`; this module names them for the method registry (``Method.policy``).
"""
from __future__ import annotations

import torch
from torch import nn

from .base import LatestPolicy, SynchronousPolicy, WeightPolicy, WeightUse, alias, nbytes
from .predicted_2bw import PipeOptim2BWPolicy
from .predicting import CAN_SWAP_STORAGE, PipeOptimPolicy, PredictingPolicy, SpecTrainPolicy, XPipePolicy
from .stash import DoubleBufferPolicy, StashingPolicy, VersionStore

__all__ = ["POLICIES", "SCHEDULE_OPTIONS", "make_policy", "WeightPolicy", "WeightUse", "alias", "nbytes",
           "SynchronousPolicy", "LatestPolicy", "VersionStore", "StashingPolicy", "DoubleBufferPolicy",
           "PredictingPolicy", "PipeOptimPolicy", "XPipePolicy", "SpecTrainPolicy", "PipeOptim2BWPolicy",
           "CAN_SWAP_STORAGE"]

POLICIES = {cls.__name__: cls for cls in (SynchronousPolicy, LatestPolicy, StashingPolicy,
                                          DoubleBufferPolicy, PipeOptimPolicy, XPipePolicy,
                                          SpecTrainPolicy, PipeOptim2BWPolicy)}


#: Method options that shape the schedule, not a policy (:meth:`pipeoptim.methods.Method.build_schedule`).
SCHEDULE_OPTIONS = ("sync_warmup",)


def make_policy(name: str, module: nn.Module, optimizer: torch.optim.Optimizer, *, stage: int,
                num_stages: int, **options) -> WeightPolicy:
    """Instantiate the policy class called ``name`` for one stage (options that shape the
    schedule instead are left out)."""
    options = {k: v for k, v in options.items() if k not in SCHEDULE_OPTIONS}
    return POLICIES[name](module, optimizer, stage=stage, num_stages=num_stages, **options)
