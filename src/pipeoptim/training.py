"""``pipeoptim.train(model, batches, method=..., ...)``: the one-call form of
:class:`~pipeoptim.pipeline.Pipeline`, ``Pipeline(model, **options).fit(batches, ...)`` and
nothing else (a script started under torchrun runs one pipeline rank per process, as the Pipeline
does). The caller's model is never modified; the trained copy comes back in the result.
"""
from __future__ import annotations

import inspect
from typing import Any, Iterable

from torch import nn

from .errors import NonFiniteLoss
from .config import PipelineConfig, keyword_parameters, missing_required
from .options import describe, of_scope
from .pipeline import Batch, Pipeline, TrainResult
from .runtime.defaults import DEFAULT_METHOD

__all__ = ["train", "TrainResult", "NonFiniteLoss"]

_FIT = {o.name for o in of_scope("fit")}


def train(model: nn.Module, batches: Iterable[Batch], *, method: str = DEFAULT_METHOD, runtime: str = "local",
          **options: Any) -> TrainResult:
    """Train a copy of ``model`` on ``batches`` (one epoch of mini-batches, any iterable, iterated
    once per epoch) with a pipeline method (default: the Pipeline's, zb-h1): ``Pipeline(model,
    method=method, ...).fit(batches, ...)``, each option given to the one that takes it.
    ``runtime`` must be ``"local"`` (the command line's ``--runtime distributed`` starts torchrun).

    Options (:mod:`pipeoptim.options`):
{options}
    """
    if runtime != "local":
        raise ValueError(f"runtime {runtime!r} is started from the command line "
                         f"(pipeoptim train --runtime distributed); the Python API runs 'local'")
    pipeline_options = {k: v for k, v in options.items() if k not in _FIT}
    missing_required(("pipeline",), pipeline_options, "train()")
    pipe = Pipeline.from_config(model, PipelineConfig.of(method=method, **pipeline_options))
    return pipe.fit(batches, **{k: v for k, v in options.items() if k in _FIT})


def _signature() -> inspect.Signature:
    """train's signature as ``help()`` and IDEs that read ``__signature__`` show it: every
    option of the tables, keyword-only, with its type and default."""
    P = inspect.Parameter
    return inspect.Signature([P("model", P.POSITIONAL_OR_KEYWORD, annotation=nn.Module),
                              P("batches", P.POSITIONAL_OR_KEYWORD),
                              *keyword_parameters("pipeline", "fit"),
                              P("runtime", P.KEYWORD_ONLY, default="local", annotation=str),
                              P("method_options", P.VAR_KEYWORD)], return_annotation=TrainResult)


train.__signature__ = _signature()  # type: ignore[attr-defined]
train.__doc__ = train.__doc__.format(options=describe(of_scope("pipeline", "method", "fit")))
