"""The names of a model's ``state_dict`` for a state gathered from its stages: a tied weight under
every name, no buffer the model does not save (:class:`StateNames`), so
that a checkpoint and ``Pipeline.model()`` under torchrun load into the model's class with
``strict=True``."""
from __future__ import annotations

from typing import Any, Dict, List

from torch import nn


class StateNames:
    """The names of ``model``'s ``state_dict``, for a state gathered from a traced model's stage
    modules: there a tied tensor appears under the one name the trace read it by, and a
    non-persistent buffer of the model (Llama's rotary ``inv_freq``) as a buffer of their own."""

    def __init__(self, model: nn.Module) -> None:
        own = model.state_dict(keep_vars=True)
        #: buffers the model does not save (each stage module holds them as its own)
        self.transient = {name for name, _ in model.named_buffers(remove_duplicate=False)} - set(own)
        #: every name of the model's state with more than one: all the names of its tensor
        self.aliases: Dict[str, List[str]] = {}
        by_tensor: Dict[int, List[str]] = {}
        for name, tensor in own.items():
            by_tensor.setdefault(id(tensor), []).append(name)
        for names in by_tensor.values():
            if len(names) > 1:
                self.aliases.update({name: names for name in names})

    def persistent(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """``state`` without the model's non-persistent buffers."""
        return {k: v for k, v in state.items() if k not in self.transient}

    def complete(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """``state`` as ``model.state_dict()`` names it: without the non-persistent buffers, a tied
        tensor under every name the model gives it, so that it loads into the model strictly."""
        full = self.persistent(state)
        for name, value in list(full.items()):
            full.update({alias: value for alias in self.aliases.get(name, ()) if alias not in full})
        return full

