"""The task interface: what the runtime and the command line need from a data set and its models.

A task turns a data source into mini-batches, builds models as ``nn.Sequential``s of stage-able
blocks (or, named by :meth:`Task.traced_model_names`, modules the Pipeline traces), and knows its loss and its evaluation metric. The runtime never imports a task; the
command line looks tasks up by name in :mod:`pipeoptim.lab.tasks`.

Activations between blocks may be a tensor or a tuple of tensors (a translation model passes
``(encoder_states, decoder_inputs)``); a block receives its predecessor's output as its single
argument. Targets are never sent through the pipe: the last stage's output and the batch's
target go to :meth:`Task.loss`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import MissingDataError  # defined there so that the command line can catch it without torch
from .common import batch_accuracy, classification_accuracy

Batch = Tuple[Any, torch.Tensor]  #: (input: tensor or tuple of tensors, target)

#: The evaluation splits: ``test`` (what a run reports) and ``validation`` (what tuning reads:
#: examples held out of the training data, never the test set; see :meth:`Task.load`).
SPLITS = ("test", "validation")


@dataclass
class TaskData:
    """One task's data, already batched.

    ``info`` describes the data and is what a run's summary reports (:meth:`describe`): where it
    comes from, its sizes, the vocabulary size and other settings, as short JSON values, never
    lists of examples or sentences. What the task keeps for its own use beside the batches
    (reference translations, the vocabulary itself) goes in ``extra``.
    """

    train: List[Batch]             #: training mini-batches for one epoch, in order
    test: List[Batch]              #: evaluation mini-batches
    info: Dict[str, Any] = field(default_factory=dict)   #: description: source, sizes, vocabulary size, ...
    extra: Dict[str, Any] = field(default_factory=dict)  #: bulky data the task reads back, not described
    #: validation mini-batches, for tuning (learning rates, corrections): examples that are in
    #: neither ``train`` nor ``test``; empty unless the task was loaded with ``holdout``
    validation: List[Batch] = field(default_factory=list)

    def describe(self) -> Dict[str, Any]:
        """The description of the data in a run's summary: the entries of ``info`` that are JSON
        values, and the number of training, test and (if any) validation mini-batches
        (``batches``)."""
        described = {k: v for k, v in self.info.items() if _jsonable(v)}
        described["batches"] = {"train": len(self.train), "test": len(self.test)}
        if self.validation:
            described["batches"]["validation"] = len(self.validation)
        return described

    def split(self, name: str, task: str = "this task") -> List[Batch]:
        """The evaluation batches of split ``name`` (one of :data:`SPLITS`); a ValueError that
        says the fix for an unknown split or an empty validation split."""
        if name not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {name!r}")
        if name == "test":
            return self.test
        if not self.validation:
            raise ValueError(f"the data of {task} has no validation split: load it with holdout=N "
                             f"(--holdout N) to hold N training examples out for validation")
        return self.validation


def check_holdout(holdout: Optional[int], most: Optional[int], what: str) -> None:
    """Refuse a ``holdout`` outside 1 .. ``most`` (None: no upper bound known yet), naming the
    range; ``what`` says what is held out."""
    if holdout is None:
        return
    if most is None and holdout < 1:
        raise ValueError(f"holdout must be at least 1 ({what}), got {holdout}")
    if most is not None and not 1 <= holdout <= most:
        raise ValueError(f"holdout must be between 1 and {most} ({what}), got {holdout}")


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


class Task:
    """Base class of a task. Subclasses set the class attributes and implement the methods."""

    name: str = ""
    metric: str = ""                   #: "accuracy", "bleu" or "perplexity"
    higher_is_better: bool = True      #: False for perplexity: the best value is the lowest
    default_model: str = ""
    default_batch_size: int = 64
    default_lr: Dict[str, float] = {}  #: per optimizer name, a learning rate that trains well

    def model_names(self) -> Sequence[str]:
        raise NotImplementedError

    def load(self, *, batch_size: int, limit: int | None, seed: int,
             holdout: Optional[int] = None) -> TaskData:
        """Read (and cache) the data set; ``limit`` caps the number of training examples.

        ``holdout=N`` fills :attr:`TaskData.validation` with N examples that are neither
        trained on nor in the test set, the same ones whatever ``limit`` and ``seed`` (each task
        says where they come from); without it (the default) the data is as it always was. A
        task that cannot hold examples out raises a ValueError."""
        raise NotImplementedError

    def build_model(self, name: str, data: TaskData, *, seed: int) -> nn.Module:
        """A freshly initialised model (seeded): an ``nn.Sequential`` of stage-able blocks, or for
        a name in :meth:`traced_model_names` a module the Pipeline traces and splits."""
        raise NotImplementedError

    def traced_model_names(self) -> Sequence[str]:
        """The models that are not an ``nn.Sequential``: the Pipeline traces and splits them
        (:mod:`pipeoptim.graph_split`), ``partition`` then counting units; ``pipeoptim plan``
        profiles them unit by unit, ``bench`` (which runs an ``nn.Sequential``'s layers) refuses them."""
        return ()

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model: nn.Module, data: TaskData, split: str = "test") -> float:
        """The task's metric of ``model`` on ``data.test``, or on ``data.validation`` with
        ``split="validation"`` (accuracy in [0, 1], BLEU in [0, 100], perplexity >= 1)."""
        raise NotImplementedError

    def batch_metric(self) -> Optional[Callable[[Any, torch.Tensor], torch.Tensor]]:
        """The metric as a function of one mini-batch's output and target whose mean over the
        samples is the metric (accuracy), so that a pipeline evaluates it with its own forward,
        stage by stage (``Pipeline.evaluate``; pipelined under torchrun); None where the metric
        is no such mean (perplexity over tokens, corpus BLEU): the whole model is then
        evaluated with :meth:`evaluate`."""
        return None

    @property
    def loss_fn(self) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        return self.loss


class ClassificationTask(Task):
    """A task whose models give class logits (image, sentiment): cross-entropy, accuracy."""

    metric = "accuracy"
    higher_is_better = True

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the logits, averaged over the batch."""
        return F.cross_entropy(output, target)

    def batch_metric(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Accuracy of one mini-batch (the metric is its mean over the samples)."""
        return batch_accuracy

    def evaluate(self, model: nn.Module, data: TaskData, split: str = "test",
                 batches: Optional[Sequence[Batch]] = None) -> float:
        """Accuracy in [0, 1] on ``data.test``, on ``data.validation`` with ``split="validation"``,
        or on ``batches`` if given (eval mode, no gradients; training flags restored)."""
        return classification_accuracy(model, data.split(split, f"task {self.name}") if batches is None else batches)
