"""The layers a tensor-parallel run splits (``tensor_parallel``): the user's ``tensor_plan`` or the
model's own, as torch's parallel styles, checked against T before anything is built.

A plan maps module names of the whole model (patterns as ``fnmatch`` reads them) to torch's
parallel styles (``ColwiseParallel``, ``RowwiseParallel``, ...) or to transformers' names of them.
A model without a plan of the user's may carry its own: a transformers model's ``_tp_plan``,
built from its config's ``base_model_tp_plan``; these are the conventions of a library model,
read here (by attribute, since a plain ``nn.Module`` has none of them) and nowhere in the runtime,
which runs the resolved styles (``runtime/tensor_parallel.py``)."""
from __future__ import annotations

import copy
import fnmatch
from typing import Any, Dict, Optional

from torch import nn

from .errors import option
from .runtime.tensor_parallel import weight_placements


def _styles():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        # the token ids whole on every rank, the vocabulary split (torch's RowwiseParallel alone
        # takes its input sharded on the last dimension)
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": SequenceParallel,
    }


#: transformers' names of a plan entry that mean one of torch's styles (the others are refused)
STYLE_NAMES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "rowwise_split_input",
               "rowwise_rep", "embedding_rowwise", "sequence_parallel")


def style_of(value: Any, pattern: str) -> Any:
    """A plan entry as one of torch's parallel styles (a copy: a style serves one module)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    if isinstance(value, ParallelStyle):
        return copy.deepcopy(value)
    if isinstance(value, str) and value in STYLE_NAMES:
        return _styles()[value]()
    raise ValueError(f"tensor_plan[{pattern!r}] = {value!r}: give one of torch's parallel styles "
                     f"(ColwiseParallel(), RowwiseParallel(), ...) or a name: {', '.join(STYLE_NAMES)}")


def model_plan(model: nn.Module) -> Dict[str, Any]:
    """The model's own plan, by module names of the whole model: a transformers model's
    ``_tp_plan`` (its head's entries and its base model's, prefixed), else its config's
    ``base_model_tp_plan`` under the base model's prefix; empty where it carries none."""
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, dict) and own:
        return dict(own)
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    wrapped = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    return {f"{prefix}.{k}" if wrapped else k: v for k, v in base.items()}


def resolve_plan(model: nn.Module, plan: Optional[Dict[str, Any]], tensor: int) -> Dict[str, Any]:
    """{module name of ``model``: torch's style} for every layer the plan (the user's, else the
    model's own) splits; refused, with the fix, where there is no plan, a pattern matches no
    layer or one that is neither ``nn.Linear`` nor ``nn.Embedding``, or a transformers config's
    attention heads do not divide by T."""
    given = plan if plan is not None else model_plan(model)
    name = type(model).__name__
    if not given:
        raise ValueError(f"{option('tensor_parallel', tensor)} splits the layers a plan names, and {name} carries no "
                         f"plan (a transformers model's config.base_model_tp_plan): give tensor_plan={{'layer name "
                         f"pattern': ColwiseParallel() or RowwiseParallel(), ...}} (e.g. the first of two Linear "
                         f"layers column-wise, the second row-wise), or drop {option('tensor_parallel')}")
    if not isinstance(given, dict):
        raise ValueError(f"tensor_plan must be a dict of layer-name patterns to styles, got {type(given).__name__}")
    modules = dict(model.named_modules())
    chosen: Dict[str, Any] = {}
    for pattern, value in given.items():
        matched = [n for n in modules if n and (n == pattern or fnmatch.fnmatchcase(n, pattern))]
        if not matched:
            raise ValueError(f"tensor_plan entry {pattern!r} names no layer of {name} (its layers are named as "
                             f"model.named_modules() names them, e.g. {next(iter(n for n in modules if n), '')!r}): "
                             f"fix the pattern or drop the entry")
        for module_name in matched:
            module = modules[module_name]
            if not isinstance(module, (nn.Linear, nn.Embedding)):
                raise ValueError(f"tensor_plan entry {pattern!r} matches {module_name}, a {type(module).__name__}: "
                                 f"only nn.Linear and nn.Embedding layers are split (GPT-2's Conv1D is neither); "
                                 f"name Linear or Embedding layers, or drop the entry")
            style = chosen.setdefault(module_name, style_of(value, pattern))
            _check_divides(module_name, module, style, tensor)
    _check_heads(model, tensor)
    return chosen


def _check_divides(name: str, module: nn.Module, style: Any, tensor: int) -> None:
    """The dimension ``style`` splits ``module``'s weight along must divide by T (torch would
    fail deep inside a sharded operation)."""
    kind = "embedding" if isinstance(module, nn.Embedding) else "linear"
    try:
        dim = weight_placements(style, kind)["weight"].dim
    except ValueError:
        return  # a style that splits no weight (SequenceParallel)
    size = module.weight.shape[dim]
    if size % tensor:
        what = {("linear", 0): "out_features", ("linear", 1): "in_features",
                ("embedding", 0): "num_embeddings", ("embedding", 1): "embedding_dim"}[kind, dim]
        raise ValueError(f"tensor_plan splits {name} ({type(module).__name__}) along its {what} = {size}, which "
                         f"{option('tensor_parallel', tensor)} does not divide: choose T dividing {size}, or leave "
                         f"{name} out")


def _check_heads(model: nn.Module, tensor: int) -> None:
    """A transformers config's attention heads (query and key/value) must divide by T: each
    tensor rank computes its own heads. Grouped-query attention is refused: the traced graph
    repeats each key/value head by counts fixed at trace time, for the whole model's heads."""
    config = getattr(model, "config", None)
    heads, groups = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(groups, int) and groups != heads:
        raise ValueError(f"{type(model).__name__}'s config has {groups} key/value heads for {heads} query heads "
                         f"(grouped-query attention), which {option('tensor_parallel')} does not split yet: the "
                         f"traced graph repeats the key/value heads by the whole model's counts. Use a config with "
                         f"num_key_value_heads = num_attention_heads, or drop {option('tensor_parallel')}")
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % tensor:
            raise ValueError(f"{type(model).__name__}'s config has {field}={heads}, which "
                             f"{option('tensor_parallel', tensor)} does not divide (each tensor rank computes its "
                             f"own heads): choose T dividing {heads}")
