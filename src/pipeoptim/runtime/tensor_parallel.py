"""Each stage split over T processes with torch's tensor parallelism (``tensor_parallel``).

Under torchrun with N stages x D replicas x T tensor ranks, stage k of replica d lives on T
processes, the "tp" dimension of the job's ``DeviceMesh``; each holds its part of the planned
layers' weights as DTensors (docs/architecture.md, "Tensor parallelism in a stage"). The plan
(``pipeoptim/tensor_plan.py``) maps module names of the whole model to torch's parallel styles
(``ColwiseParallel``, ``RowwiseParallel``, ...); only ``nn.Linear`` and ``nn.Embedding`` layers are
split, everything else is replicated on the T processes.

A stage whose modules run as modules (an ``nn.Sequential``'s layers) is parallelized by torch's
``parallelize_module``, whose hooks move the layouts. A traced stage runs aten operations on its
parameters, no module calls: there each ``linear`` and ``embedding`` that reads a planned weight
becomes :func:`linear` or :func:`embedding` here, which do what the style's hooks do (the input
taken in the style's layout, the output left in its layout as a local tensor) around torch's own
operation on DTensors. Either way what flows between layers, and across a cut, is a plain tensor:
tensor rank t of stage k sends to tensor rank t of stage k + 1 (each holds the same replicated
activation, or its own shard where a cut falls after a column-wise layer).

The weight policies see DTensor parameters and work on their local shards (``weights/fused.py``),
as on a sharded stage's; they keep versions by copying, never by moving a parameter's storage (a
DTensor keeps its local tensor), and the backward's version is written into the live storage the
forward's aliases share for its span (:meth:`StageTensors.hold`)."""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..compat import collective_result, is_dtensor, waited_collectives
from .sharding import StageCopy


# -- the layouts of a style, and the operations of a traced stage ------------------------------
def _name(placement: Any) -> str:
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Shard):
        return f"S{placement.dim}"
    raise ValueError(f"a traced stage keeps Replicate and Shard layouts only, got {placement}")


def _placement(name: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if name == "R" else Shard(int(name[1:]))


def weight_placements(style: Any, kind: str) -> Dict[str, Any]:
    """Where torch's style puts a layer's parameters (its ``_partition_*_fn``): column-wise, a
    Linear's rows (and bias), an Embedding's columns; row-wise, a Linear's columns (the bias
    whole), an Embedding's rows (the vocabulary)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(style, ColwiseParallel):
        return {"weight": Shard(0) if kind == "linear" else Shard(1), "bias": Shard(0)}
    if isinstance(style, RowwiseParallel):
        return {"weight": Shard(1) if kind == "linear" else Shard(0), "bias": Replicate()}
    raise ValueError(f"a traced stage splits its Linear and Embedding weights column-wise or row-wise; "
                     f"{type(style).__name__} is for modules that run as modules (an nn.Sequential's layers)")


def layouts(style: Any, kind: str) -> Tuple[str, str, str]:
    """(input layout, the layout the operation takes it in, output layout) of ``style`` on a
    layer of ``kind``, as :func:`linear` and :func:`embedding` read them."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    if not style.use_local_output:
        raise ValueError("a traced stage passes local tensors between its operations: give the style "
                         "use_local_output=True (torch's default)")
    given = _name(style.input_layouts[0])
    if isinstance(style, RowwiseParallel):
        desired = "R" if kind == "embedding" else "S-1"
    else:
        desired = _name(style.desired_input_layouts[0])
    return given, desired, _name(style.output_layouts[0])


def _as_dtensor(x: torch.Tensor, weight: Any, given: str, desired: str) -> Any:
    from torch.distributed.tensor import DTensor

    value = DTensor.from_local(x, weight.device_mesh, [_placement(given)], run_check=False)
    return value if given == desired else value.redistribute(placements=[_placement(desired)])


def _local(y: Any, out: str) -> torch.Tensor:
    if tuple(y.placements) != (_placement(out),):
        y = y.redistribute(placements=[_placement(out)])
    return y.to_local()


class _GradInLayout(torch.autograd.Function):
    """The identity, whose backward gives the gradient in the weight's own layout: torch's
    rule for an operation's weight gradient may leave it in another (an embedding's split over
    the vocabulary comes back partial), and a parameter's gradients must add up, and be reduced
    over replicas and tied holders, shard by shard."""

    @staticmethod
    def forward(ctx: Any, weight: Any) -> Any:
        ctx.placements = weight.placements
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        if tuple(grad.placements) != tuple(ctx.placements):
            grad = grad.redistribute(placements=ctx.placements)
        return grad


def linear(x: torch.Tensor, weight: Any, bias: Any, given: str, desired: str, out: str) -> torch.Tensor:
    """``aten.linear`` of a traced stage on a split weight, as torch's style runs the layer."""
    weight = _GradInLayout.apply(weight)
    return _local(torch.ops.aten.linear.default(_as_dtensor(x, weight, given, desired), weight, bias), out)


def embedding(weight: Any, ids: torch.Tensor, padding_idx: int, given: str, desired: str, out: str) -> torch.Tensor:
    """``aten.embedding`` of a traced stage on a split weight, as torch's style runs the layer."""
    weight = _GradInLayout.apply(weight)
    return _local(torch.ops.aten.embedding.default(weight, _as_dtensor(ids, weight, given, desired), padding_idx), out)


def plain(value: Any) -> Any:
    """``value`` (a stage's output, nested) with every tensor a collective still owes (what a
    style's all-reduce leaves) made a plain one, waited for: what is sent on, or kept for the
    backward, must have storage of its own (``compat.waited_collectives``)."""
    return waited_collectives(value)


def in_layout(param: torch.Tensor) -> Optional[torch.Tensor]:
    """``param``'s gradient in ``param``'s own layout (set there too): torch's row-wise split
    of an ``nn.Embedding`` leaves it whole on every tensor rank, which the sums over replicas and
    tied holders, shard by shard, cannot take."""
    grad = param.grad
    if is_dtensor(grad) and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad = grad.redistribute(placements=param.placements)
    return grad


def storage_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``tensor``'s values on this process: a DTensor's local
    part, an ``AsyncCollectiveTensor``'s own result."""
    return collective_result(tensor.to_local() if is_dtensor(tensor) else tensor)


class StageTensors(StageCopy):
    """One stage module split over its T tensor ranks by the run's plan, and what its passes,
    clipping and checkpoints need of it. ``plan``: {module name of the whole model: style};
    ``kinds``: {module name: "linear" or "embedding"}; ``names``: {id of a parameter of the
    whole model: every name it has there} (a tied one has several)."""

    def __init__(self, mesh: Any, plan: Dict[str, Any], kinds: Dict[str, str], names: Dict[int, List[str]]) -> None:
        super().__init__()
        self.mesh, self.plan, self.kinds, self.names = mesh, plan, kinds, names
        self.device_type: str = mesh.device_type

    def parallelize(self, module: nn.Module) -> nn.Module:
        """A copy of ``module`` with its planned layers split (``module`` keeps its parameters
        until :meth:`release_original`)."""
        part = copy.deepcopy(module)
        self.original, self.module = module, part
        if isinstance(part, torch.fx.GraphModule):
            self._rewrite(module, part)
        else:
            from torch.distributed.tensor.parallel import parallelize_module

            planned = {name: copy.deepcopy(style) for name, _ in part.named_modules()
                       for style in [self.plan.get(name)] if style is not None}
            if planned:
                parallelize_module(part, self.mesh, planned)
        self._named = dict(part.named_parameters())
        return part

    def _plan_of(self, param: nn.Parameter) -> Optional[Tuple[str, Any]]:
        """(module name, style) of the planned layer that holds ``param`` (an original), None if
        none; a tied weight planned twice must be split alike."""
        found = []
        for name in self.names.get(id(param), []):
            module, _, attr = name.rpartition(".")
            if module in self.plan:
                found.append((module, attr, self.plan[module]))
        if not found:
            return None
        placements = {str(weight_placements(style, self.kinds[m])[a]) for m, a, style in found}
        if len(placements) > 1:
            raise ValueError(f"tensor_plan splits the tied weight {' = '.join(self.names[id(param)])} two ways "
                             f"({', '.join(f'{m}: {type(s).__name__}' for m, _, s in found)}): split its layers "
                             f"alike (an embedding row-wise with its head column-wise) or leave both out")
        return found[0][0], found[0][2]

    def _rewrite(self, original: nn.Module, part: torch.fx.GraphModule) -> None:
        """Split the planned weights of a traced stage and route the operations that read them
        through :func:`linear` and :func:`embedding` with their style's layouts."""
        from torch.distributed.tensor import distribute_tensor

        originals = dict(original.named_parameters())
        split: Dict[str, Tuple[str, Any, Any]] = {}  # parameter path in the stage -> (kind, style, placement)
        for path, param in list(part.named_parameters()):
            planned = self._plan_of(originals[path])
            if planned is None:
                continue
            module_name, style = planned
            kind = self.kinds[module_name]
            holder_path, _, attr = path.rpartition(".")
            placement = weight_placements(style, kind)[attr]
            holder = part.get_submodule(holder_path)
            setattr(holder, attr, nn.Parameter(distribute_tensor(param.detach(), self.mesh, [placement]),
                                               requires_grad=param.requires_grad))
            split[path] = (kind, style, placement)
        graph = part.graph
        for node in list(graph.nodes):
            if node.op != "get_attr" or node.target not in split:
                continue
            kind, style, placement = split[node.target]
            for user in list(node.users):
                self._route(graph, user, node, kind, style)
        part.recompile()

    def _route(self, graph: Any, user: Any, weight: Any, kind: str, style: Any) -> None:
        """One operation reading a split weight, routed through this module's own with the
        layouts of the layer's style (an operation of the other kind, a tied head or embedding:
        replicated input and output)."""
        aten = torch.ops.aten
        if user.target is aten.linear.default and user.args[1] is weight:
            given, desired, out = layouts(style, "linear") if kind == "linear" else ("R", "R", "R")
            x, _, *rest = user.args
            bias = rest[0] if rest else user.kwargs.get("bias")
            user.target, user.args, user.kwargs = linear, (x, weight, bias, given, desired, out), {}
        elif user.target is aten.embedding.default and user.args[0] is weight:
            given, desired, out = layouts(style, "embedding") if kind == "embedding" else ("R", "R", "R")
            padding = user.args[2] if len(user.args) > 2 else user.kwargs.get("padding_idx", -1)
            user.target, user.args, user.kwargs = embedding, (weight, user.args[1], padding, given, desired, out), {}
        elif user.target in (linear, embedding) or (user.target is aten.linear.default and weight in user.args[2:]):
            return  # a bias (routed with its weight), or already routed
        else:
            raise ValueError(f"the split weight {weight.target} is read by {user.target} in a traced stage; only "
                             f"linear and embedding operations read a split weight: leave its layer out of "
                             f"tensor_plan")

    # -- what the stage asks of it ------------------------------------------------------------
    def wrap(self, values: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """``values`` (a tied weight's from its owner, this tensor rank's part as it travelled)
        as DTensors laid out as the parameters they stand for; a gradient reaches each plain
        tensor as its part."""
        from torch.distributed.tensor import DTensor

        wrapped = {}
        for name, value in values.items():
            param = self._named.get(name)
            if is_dtensor(param) and not is_dtensor(value):
                value = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                           shape=param.shape, stride=param.stride())
            wrapped[name] = value
        return wrapped
