"""The forms a Pipeline's mini-batches come in, and the loss of a model that computes its own.

The three forms and what is refused: docs/architecture.md, "Batches as a model library gives
them". :class:`BatchForm` turns each into the ``(inputs, target)`` pair the runtime carries and
names the fix of a combination that cannot work."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional, Tuple, Union

import torch
from torch import nn

#: the key of a dict batch that holds the target (the name ``transformers`` models take it by)
LABELS = "labels"

#: the label of an item no loss counts (torch's cross-entropy ``ignore_index`` default, and
#: ``transformers``' padding label)
IGNORED = -100

#: how a mini-batch's loss weighs its micro-batches (the ``loss_normalization`` option)
NORMALIZATIONS = ("items", "rows")


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


def items_in(target: Any, shifted: bool = False) -> int:
    """The real items of a target, as a mean-reduced loss counts them: an integer target's
    entries other than :data:`IGNORED` (tokens, or one class per sample), after dropping each
    row's first where the loss predicts the next token (``shifted``); any other target's rows."""
    if not torch.is_tensor(target):
        raise ValueError(f"cannot count the items of a {type(target).__name__} target; give "
                         f"loss_normalization=fn(target) -> count, or 'rows'")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        return int(target.shape[0]) if target.dim() else 1
    if shifted and target.dim() >= 2:
        target = target[..., 1:]
    return int(target.ne(IGNORED).sum())


def shifts_labels(model: nn.Module) -> bool:
    """Whether ``model`` computes its own loss by predicting each label from the positions before
    it (a ``transformers`` causal LM: its loss function drops every row's first label), so that a
    row's first label is no item. An encoder-decoder's labels are its decoder's targets as they
    are (its decoder reads them shifted right), every one an item."""
    loss_function = getattr(type(model), "loss_function", None)
    if loss_function is None:
        return False
    try:
        function = model.loss_function
    except Exception:  # a library property that needs more than the model has: not a causal LM
        return False
    config = getattr(model, "config", None)
    return getattr(function, "__name__", "") == "ForCausalLMLoss" and \
        not getattr(config, "is_encoder_decoder", False)


#: what ``loss_normalization`` may be: a name of :data:`NORMALIZATIONS`, or ``fn(target) -> count``
Normalization = Union[str, Callable[[Any], int]]


def item_counter(normalization: Normalization, model: Optional[nn.Module] = None,
                 own_loss: bool = False) -> Optional[Callable[[Any], int]]:
    """What a mini-batch's micro-batches are weighed by (see ``loss_normalization`` in
    :mod:`pipeoptim.options`): ``fn(target) -> count`` of the real items of a target, or None
    for ``rows`` (each micro-batch by its samples: the mean of the micro-batch means)."""
    if callable(normalization):
        return lambda target: int(normalization(target))
    if normalization == "rows":
        return None
    if normalization != "items":
        raise ValueError(f"loss_normalization must be one of {', '.join(map(repr, NORMALIZATIONS))} or "
                         f"fn(target) -> count, got {normalization!r}")
    shifted = own_loss and model is not None and shifts_labels(model)
    return lambda target: items_in(target, shifted)


class BatchForm:
    """How a Pipeline reads its mini-batches: ``model_loss`` (no ``loss_fn``) means the model
    computes its own loss from ``labels``, handed to its forward at the last stage (and, among
    the first stage's inputs, to any earlier stage that reads them)."""

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
        if self.model_loss:  # the labels stay among the inputs too: a stage before the last may read them
            return dict(self._remember(batch)), batch[LABELS]
        inputs = {k: v for k, v in self._remember(batch).items() if k != LABELS}
        return inputs, batch[LABELS]

    def example(self, inputs: Any, target: Any) -> Any:
        """What the model is called with (and traced on) for the pair ``(inputs, target)``: the
        inputs, with the labels among the keyword arguments when the model computes the loss."""
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
        """A model that computes its own loss needs its labels at the last stage, which a forward
        of inputs alone does not give it: ``what`` is refused."""
        if self.model_loss:
            raise ValueError(f"{what} runs the stages on inputs alone, and this model computes its loss "
                             f"from labels (no loss_fn): evaluate(loader) runs it on dict batches with "
                             f"'{LABELS}' and returns its mean loss; model() is the whole model; or give "
                             f"the Pipeline loss_fn=fn(output, target)")

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
