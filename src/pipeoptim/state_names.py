"""The names of a model's ``state_dict`` for a state gathered from its stages: a tied weight under
every name, no buffer the model does not save and no constant the trace lifted (:class:`StateNames`), so
that a checkpoint and ``Pipeline.model()`` under torchrun load into the model's class with
``strict=True``."""
from __future__ import annotations

from typing import Any, Dict, List

from torch import nn


class StateNames:
    """The names of ``model``'s ``state_dict``, for a state gathered from a traced model's stage
    modules: there a tied tensor appears under the one name the trace read it by, and a
    non-persistent buffer of the model (Llama's rotary ``inv_freq``) or a constant the forward
    makes (``torch.export`` lifts it: T5's ``lifted_tensor_0``) as a buffer of their own."""

    def __init__(self, model: nn.Module) -> None:
        own = model.state_dict(keep_vars=True)
        #: the names the model saves (any other a stage module holds is its own: see the class)
        self.names = set(own)
        #: every name of the model's state with more than one: all the names of its tensor
        self.aliases: Dict[str, List[str]] = {}
        by_tensor: Dict[int, List[str]] = {}
        for name, tensor in own.items():
            by_tensor.setdefault(id(tensor), []).append(name)
        for names in by_tensor.values():
            if len(names) > 1:
                self.aliases.update({name: names for name in names})

    def persistent(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """``state`` with only the names the model saves (none of the stage modules' own)."""
        return {k: v for k, v in state.items() if k in self.names}

    def complete(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """``state`` as ``model.state_dict()`` names it: without the stage modules' own, a tied
        tensor under every name the model gives it, so that it loads into the model strictly."""
        full = self.persistent(state)
        for name, value in list(full.items()):
            full.update({alias: value for alias in self.aliases.get(name, ()) if alias not in full})
        return full

