"""``pipeoptim.train(model, batches, method=..., ...)``: the one-call form of
:class:`~pipeoptim.pipeline.Pipeline`.

``train(model, batches, **settings)`` is ``Pipeline(model, **settings).fit(batches, ...)``: it
builds the Pipeline from the Pipeline's arguments among ``settings``, calls ``fit`` with
``fit``'s, and returns the same :class:`TrainResult`; there is no second road to training behind
it. What it adds is the convenience of one call and one argument, ``runtime``, which must be
``"local"`` (the command line's ``--runtime distributed`` starts torchrun itself; a script
started under torchrun runs one stage per process, as the Pipeline does). It leaves out the
Pipeline's ``timeout``, ``threads`` and ``data_parallel`` and ``fit``'s ``eval_loader`` and
``metric`` (``evaluate(model)`` takes their place); scripts that need them, or that feed
mini-batches by hand (``step`` / ``flush``) or read the model between mini-batches, use the
Pipeline. The caller's model is never modified; the trained copy comes back in the result.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional, Sequence

import torch
from torch import nn

from .errors import NonFiniteLoss
from .pipeline import Batch, Pipeline, TrainResult
from .runtime.build import OptimizerFactory, SchedulerFactory

__all__ = ["train", "TrainResult", "NonFiniteLoss"]


def train(model: nn.Module, batches: Iterable[Batch], *, method: str, optimizer: OptimizerFactory,
          loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], stages: Optional[int] = None,
          partition: Optional[Sequence[int]] = None, partitioner: Optional[str] = None, epochs: int = 1,
          micro_batches: Optional[int] = None, runtime: str = "local", continuous: bool = False,
          evaluate: Optional[Callable[[nn.Module], float]] = None, eval_every: Optional[int] = None,
          on_batch: Optional[Callable[[int, float], None]] = None,
          on_epoch: Optional[Callable[[int, Dict[str, Any]], None]] = None,
          on_eval: Optional[Callable[[Dict[str, Any]], None]] = None,
          checkpoint_dir: Optional[str | Path] = None, checkpoint_every: Optional[int] = None,
          resume: bool = False, diagnose_every: int = 0,
          lr_scheduler: Optional[SchedulerFactory] = None, clip_grad_norm: Optional[float] = None,
          clip_scope: str = "stage", precision: str = "fp32", recompute: Any = False, devices: Any = "auto",
          split_points: Optional[Sequence[str]] = None, example_input: Any = None,
          **method_options: Any) -> TrainResult:
    """Train a copy of ``model`` on ``batches`` with a pipeline method.

    ``batches`` is one epoch of (input, target) mini-batches (any iterable, iterated once per
    epoch). Every other argument is :class:`~pipeoptim.pipeline.Pipeline`'s (``method``,
    ``optimizer``, ``loss_fn``, ``stages``/``partition``/``partitioner``, ``split_points``,
    ``example_input``, ``micro_batches``, ``lr_scheduler``, ``clip_grad_norm``, ``clip_scope``,
    ``precision``, ``recompute``, ``devices``,
    ``diagnose_every``, the method's options) or :meth:`~pipeoptim.pipeline.Pipeline.fit`'s
    (``epochs``, ``evaluate(model)``, ``eval_every``, ``on_batch``, ``on_epoch``, ``on_eval``,
    ``checkpoint_dir``, ``checkpoint_every``, ``resume``, ``continuous``). With ``eval_every``
    the result's ``metrics["evaluations"]`` holds the curve of ``evaluate`` against mini-batches,
    updates and training time (an asynchronous method drains at each evaluation, so its numbers
    depend on ``eval_every``; see :meth:`~pipeoptim.pipeline.Pipeline.fit`).
    """
    if runtime != "local":
        raise ValueError(f"runtime {runtime!r} is started from the command line "
                         f"(pipeoptim train --runtime distributed); the Python API runs 'local'")
    pipe = Pipeline(model, method=method, loss_fn=loss_fn, optimizer=optimizer, stages=stages,
                    partition=partition, partitioner=partitioner, micro_batches=micro_batches,
                    lr_scheduler=lr_scheduler, clip_grad_norm=clip_grad_norm, clip_scope=clip_scope,
                    precision=precision, recompute=recompute, devices=devices, diagnose_every=diagnose_every,
                    split_points=split_points, example_input=example_input, **method_options)
    return pipe.fit(batches, epochs, evaluate=evaluate, eval_every=eval_every, on_batch=on_batch,
                    on_epoch=on_epoch, on_eval=on_eval, checkpoint_dir=checkpoint_dir,
                    checkpoint_every=checkpoint_every, resume=resume, continuous=continuous)
