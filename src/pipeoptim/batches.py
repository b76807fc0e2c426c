"""The forms a Pipeline's mini-batches come in, and the loss of a model that computes its own.

The three forms and what is refused: docs/architecture.md, "Batches as a model library gives
them". :class:`BatchForm` turns each into the ``(inputs, target)`` pair the runtime carries and
names the fix of a combination that cannot work."""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional, Tuple

import torch

#: the key of a dict batch that holds the target (the name ``transformers`` models take it by)
LABELS = "labels"


def loader_item(item: Any) -> Tuple[Any, Optional[torch.Tensor]]:
    """A loader's item as ``(inputs, target)``: a dict batch is its own inputs, with no target
    yet (:meth:`BatchForm.pair` finds it); anything else unpacks as ``(inputs, target)``."""
    if isinstance(item, dict):
        return item, None
    inputs, target = item
    return inputs, target


def model_loss(output: Any, labels: Any = None) -> torch.Tensor:
    """The loss a model computed itself from the labels it was given: ``output.loss``, or
    ``output["loss"]`` for a dict (the stage's loss function when the Pipeline has no
    ``loss_fn``; ``labels`` went into the forward, not here)."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if loss is None:
        raise ValueError(f"the model returned no loss ({type(output).__name__} has no `loss`, or it is None): "
                         f"with no loss_fn the model must compute its loss from batch['{LABELS}']; "
                         f"give loss_fn=fn(output, target) otherwise")
    return loss


class BatchForm:
    """How a Pipeline reads its mini-batches: ``model_loss`` (no ``loss_fn``) means the model
    computes its own loss from ``labels``, handed to its forward at the last stage."""

    def __init__(self, model_loss: bool) -> None:
        self.model_loss = model_loss
        #: the keys of the first dict batch: every later one must bring the same (the trace took them)
        self.keys: Optional[Tuple[str, ...]] = None

    def pair(self, batch: Any, target: Optional[torch.Tensor] = None) -> Tuple[Any, Any]:
        """``Pipeline.step``'s arguments as the ``(inputs, target)`` the runtime carries (see the
        module docstring); a ValueError naming the fix where they cannot work."""
        if not isinstance(batch, dict):
            if self.model_loss:
                raise ValueError(f"with no loss_fn the model computes its own loss: give each mini-batch "
                                 f"as a dict of its keyword tensors with '{LABELS}' (model(**batch).loss), "
                                 f"or give the Pipeline loss_fn=fn(output, target)")
            if target is None:
                raise ValueError("a mini-batch is (inputs, target), or a dict of keyword tensors with "
                                 f"'{LABELS}'; give step(inputs, target)")
            return batch, target
        self._check_keys(batch)
        if target is not None:
            if self.model_loss:
                raise ValueError(f"with no loss_fn the model's labels come from batch['{LABELS}']: "
                                 f"call step(batch) without a target, or give the Pipeline a loss_fn")
            return self._remember(batch), target
        if LABELS not in batch:
            fix = ("add the labels as batch['labels'] (the model then computes its loss), or give "
                   "loss_fn=fn(output, target) and step(batch, target)") if self.model_loss else \
                  "add batch['labels'], the target loss_fn is given, or call step(batch, target)"
            raise ValueError(f"a dict mini-batch with keys {sorted(batch)} has no '{LABELS}': {fix}")
        inputs = {k: v for k, v in self._remember(batch).items() if k != LABELS}
        return inputs, batch[LABELS]

    def example(self, inputs: Any, target: Any) -> Any:
        """What the model is called with (and traced on) for the pair ``(inputs, target)``: the
        inputs, with the labels back among the keyword arguments when the model computes the loss."""
        return {**inputs, LABELS: target} if self.model_loss else inputs

    def example_input(self, example: Any) -> Any:
        """A user's ``example_input`` (a tensor, a tuple, a dict of keyword inputs, or a dict
        batch as the loader gives it) as the model's full input to trace on: with a ``loss_fn``
        a dict's labels are the target, not an input; with none they must be there."""
        if self.model_loss:
            return self.example(*self.pair(example))  # a dict batch with labels, or refused
        if isinstance(example, dict):
            return {k: v for k, v in example.items() if k != LABELS}
        return example

    def refuse_model_loss(self, what: str) -> None:
        """A model that computes its own loss needs its labels at the last stage, which only
        training hands it: ``what`` (an evaluation, a forward) is refused."""
        if self.model_loss:
            raise ValueError(f"{what} runs the stages without the labels this model computes its loss "
                             f"from (no loss_fn): use evaluate_model(fn) on the whole model, or give the "
                             f"Pipeline loss_fn=fn(output, target)")

    def pairs(self, loader: Iterable) -> "Pairs":
        """``loader`` with every item as an ``(inputs, target)`` pair (for the evaluation loops)."""
        return Pairs(loader, self)

    def _check_keys(self, batch: dict) -> None:
        """Tensors only, and the keys of the first batch accepted (under torchrun a stage's
        KeyError would leave the other ranks waiting; this refuses on every rank at once)."""
        for key, value in batch.items():
            if not torch.is_tensor(value):
                raise ValueError(f"batch[{key!r}] is a {type(value).__name__}; a dict mini-batch holds "
                                 f"tensors (its batch along dimension 0)")
        keys = tuple(sorted(batch))
        if self.keys is not None and keys != self.keys:
            raise ValueError(f"a dict mini-batch with keys {list(keys)}; the model was traced on "
                             f"{list(self.keys)}: give every mini-batch the same keys")

    def _remember(self, batch: dict) -> dict:
        """The first accepted batch's keys are every later one's."""
        if self.keys is None:
            self.keys = tuple(sorted(batch))
        return batch


class Pairs:
    """A loader whose dict items are read as ``(inputs, target)`` pairs by :meth:`BatchForm.pair`
    (any other item as it comes; its ``len()`` is the loader's, when it has one)."""

    def __init__(self, loader: Iterable, form: BatchForm) -> None:
        self.loader, self.form = loader, form

    def __iter__(self) -> Iterator[Tuple[Any, Any]]:
        for item in self.loader:
            yield self.form.pair(item) if isinstance(item, dict) else item

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]
