"""pipeoptim: pipeline-parallel training with optimizer-dependent weight prediction (PipeOptim)
and the methods it is compared with, on one runtime, for any PyTorch 2.x, CPU or GPU."""
from .methods import METHODS, get_method, method_names
from .errors import NonFiniteLoss
from .pipeline import Pipeline, TrainResult
from .train import train

__version__ = "0.1.0"
__all__ = ["Pipeline", "train", "TrainResult", "NonFiniteLoss", "METHODS", "get_method", "method_names"]
