"""Weight prediction and weight policies: which weights each pass of each micro-batch uses."""
from .policies import (POLICIES, DoubleBufferPolicy, LatestPolicy, PipeOptim2BWPolicy, PipeOptimPolicy,
                       SpecTrainPolicy, StashingPolicy, SynchronousPolicy, WeightPolicy, WeightUse, XPipePolicy,
                       make_policy)
from .predict import Predictor, optimizer_direction_supported

__all__ = ["Predictor", "optimizer_direction_supported", "POLICIES", "WeightPolicy", "WeightUse",
           "SynchronousPolicy", "LatestPolicy", "StashingPolicy", "DoubleBufferPolicy",
           "PipeOptimPolicy", "XPipePolicy", "SpecTrainPolicy", "PipeOptim2BWPolicy", "make_policy"]
