"""Split a model that is not an ``nn.Sequential`` into stage modules, by torch's own tracing.

Tracing, candidate points, units, what crosses a cut, late inputs and the refusals:
(docs/architecture.md, "Splitting any module" and "Batches as a model library gives them").
:func:`trace` keeps the flat graph of ``ExportedProgram.module()`` (aten operations in call
order, tagged with the modules they ran in); a partition counts units per stage, as an
``nn.Sequential``'s counts layers. Each stage module takes one argument and returns one value
(:meth:`TracedModel.stage_modules`)."""
from __future__ import annotations

import bisect
import contextlib
import functools
import inspect
import itertools
import re
import traceback
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import fx, nn

from .compat import ASSERTION_OPS, EXPORT_GUARD_MODULE, tree_leaves, tree_unflatten

#: containers whose items are candidate points of their own (called in order by the forward)
CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)

#: the keyword a forward takes to return a cache for generation (``transformers``' ``use_cache``,
#: on by default there): a training step never reads the cache, which is no tensor, so a model whose
#: forward takes it is traced with it off unless the mini-batch gives it
CACHE_OPTION = "use_cache"


class TraceError(ValueError):
    """The model's forward cannot be exported; the message names the call and the fix."""


def as_call(inputs: Any) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The forward's (positional, keyword) arguments for a mini-batch's inputs: a dict is the
    keyword arguments (``model(**batch)``), anything else the positional ones."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    return (inputs if isinstance(inputs, tuple) else (inputs,)), {}


def _dynamic(value: Any) -> Any:
    """Every dimension of a tensor input dynamic, but those of size 0 or 1, which torch
    specializes anyway (and warns about)."""
    if torch.is_tensor(value):
        return {d: torch.export.Dim.AUTO for d, size in enumerate(value.shape) if size > 1} or None
    return None


def _first_user_frame(error: BaseException) -> str:
    """The innermost frame of the user's code in the traceback (not torch's), as 'file:line in f'."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if "/torch/" not in f.filename and not f.filename.startswith("<")]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {f.line}"


def trace(model: nn.Module, inputs: Any, late: Optional[str] = None) -> "TracedModel":
    """Export ``model`` on the example ``inputs`` (a mini-batch, or a micro-batch: a tensor, a
    tuple of positional arguments or a dict of keyword ones); the model's parameters stay its own
    objects. ``late``: the keyword input the last stage takes as its second argument (the labels
    of a model that computes its own loss). A forward torch cannot export (data-dependent control flow, an
    unsupported operation) raises :class:`TraceError` naming the call."""
    args, kwargs = as_call(inputs)
    values = list(args) + list(kwargs.values())
    if not all(torch.is_tensor(a) for a in values):
        kinds = ", ".join(type(a).__name__ for a in values)
        raise TraceError(f"a traced model's inputs must be a tensor, a tuple of tensors (the "
                         f"forward's positional arguments) or a dict of tensors (its keyword "
                         f"arguments), got ({kinds}); give the mini-batches, or example_input=, in that form")
    if late is not None and late not in kwargs:
        raise ValueError(f"the model's inputs {sorted(kwargs)} hold no {late!r} for the last stage")
    args, kwargs = _distinct(args, kwargs)
    dynamic = {k: _dynamic(v) for k, v in kwargs.items()} if kwargs else tuple(_dynamic(a) for a in args)
    try:
        with _without_cache(model, kwargs):
            program = torch.export.export(model, args, kwargs=kwargs or None, dynamic_shapes=dynamic,
                                          strict=False)
    except Exception as error:  # torch raises many kinds; all mean "this forward does not export"
        raise _trace_error(model, error) from error
    traced = TracedModel(model, program.module(), program.call_spec.out_spec, inputs if kwargs else args)
    if kwargs:
        traced.use_keywords(program.call_spec.in_spec, late)
    return traced


def _distinct(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The inputs with a tensor given twice (``labels`` that is ``input_ids``, as causal-LM scripts
    write it) copied for the trace: the export would read both names as one input, while each
    travels on its own (the labels to the last stage, the ids to the first)."""
    seen: set = set()

    def once(value: Any) -> Any:
        if torch.is_tensor(value):
            if value.untyped_storage().data_ptr() in seen:
                return value.clone()
            seen.add(value.untyped_storage().data_ptr())
        return value

    return tuple(once(a) for a in args), {k: once(v) for k, v in kwargs.items()}


@contextlib.contextmanager
def _without_cache(model: nn.Module, kwargs: Dict[str, Any]) -> Iterator[None]:
    """``model``'s forward with :data:`CACHE_OPTION` off while it is traced, where it takes it
    and the mini-batch does not give it; the model itself is left as it was."""
    try:
        takes = CACHE_OPTION in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes = False
    if not takes or CACHE_OPTION in kwargs or "forward" in vars(model):
        yield
        return
    model.forward = functools.partial(model.forward, **{CACHE_OPTION: False})  # this instance only
    try:
        yield
    finally:
        del model.forward


def _trace_error(model: nn.Module, error: BaseException) -> TraceError:
    """The :class:`TraceError` for an export that failed: where, why, and the fix."""
    where = _first_user_frame(error)
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    found = re.search(r"Found <class '([^']+)'> in output", str(error))
    if found:
        kind = found.group(1).rsplit(".", 1)[-1]
        return TraceError(
            f"{type(model).__name__}'s output holds a {kind}, which is no tensor, so the stages cannot "
            f"pass it on: turn off the option of the model that returns it (for a transformers model a "
            f"config flag, e.g. config.output_attentions = False or config.output_hidden_states = False; "
            f"pipeoptim already traces with {CACHE_OPTION}=False where forward takes it), or return "
            f"tensors only")
    return TraceError(
        f"torch.export cannot trace {type(model).__name__}.forward"
        + (f" at {where}" if where else "") + f" ({type(error).__name__}: {first[:300]}). "
        f"Make forward exportable: no data-dependent control flow (an `if` on a tensor's "
        f"value, .item()), inputs and outputs tensors or tuples, lists and dicts of them; or "
        f"give the model as an nn.Sequential of blocks that each take and return tensors")


def _module_paths(node: fx.Node) -> List[str]:
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else str(value)
        paths.append(path.split("@")[0])  # "layers.0@1": the module's second call
    return paths


def candidate_names(model: nn.Module, prefix: str = "") -> List[str]:
    """Qualified names of the submodules a stage may begin at, in definition order: each child,
    the items of a child that is a ``ModuleList``/``Sequential``/``ModuleDict``, and the
    candidates inside a child that holds such a container deeper down (a library's model wraps
    its blocks: ``transformer.h.0``), so that the blocks are reached whatever wraps them."""
    names = []
    for name, child in model.named_children():
        if isinstance(child, CONTAINERS) and len(child) > 0:
            names.extend(f"{prefix}{name}.{item}" for item, _ in child.named_children())
        elif any(isinstance(m, CONTAINERS) and len(m) > 1 for m in child.modules()):
            names.extend(candidate_names(child, f"{prefix}{name}."))
        else:
            names.append(prefix + name)
    return names


def _is_size(value: Any) -> bool:
    return isinstance(value, (torch.SymInt, int, float, bool, torch.SymFloat, torch.SymBool))


class TracedModel:
    """A model exported to one flat graph, cut at candidate points (see the module docstring)."""

    def __init__(self, model: nn.Module, graph_module: fx.GraphModule, out_spec: Any,
                 example: Tuple[Any, ...]) -> None:
        self.model = model
        self.example = example  #: the positional arguments (a tuple) or keyword ones (a dict) it was traced on
        #: per input of a model called with keyword arguments, its name (None: positional)
        self.names: Optional[Dict[fx.Node, str]] = None
        self.late: Optional[str] = None  #: the keyword input the last stage takes (trace's ``late``)
        self.graph_module = graph_module
        self.out_spec = out_spec
        nodes = list(graph_module.graph.nodes)
        self.inputs = [n for n in nodes if n.op == "placeholder"]
        self.output = next(n for n in nodes if n.op == "output")
        graph_module.add_module(OUTPUT_BUILDER, OutputBuilder(out_spec))
        # the export's input guard (a compiled check of the traced input shapes) is left out: the
        # stages are called with micro-batches, and a copy of it fails outside its program; so are
        # its dtype assertions (a library's `.to(dtype)`), which bf16's autocast would trip
        self.compute = [n for n in nodes if n.op not in ("placeholder", "output", "get_attr")
                        and not (n.op == "call_module" and n.target == EXPORT_GUARD_MODULE)
                        and n.target not in ASSERTION_OPS]
        first: Dict[str, int] = {}
        for position, node in enumerate(self.compute):
            for path in _module_paths(node):
                first.setdefault(path, position)
        #: the candidate points the forward calls, in call order
        self.candidates: List[str] = sorted((c for c in candidate_names(model) if c in first),
                                            key=lambda c: first[c])
        starts = [first[c] for c in self.candidates]
        #: unit of each compute node: the last candidate whose first call is at or before it
        self.unit: Dict[fx.Node, int] = {node: max(0, bisect.bisect_right(starts, position) - 1)
                                         for position, node in enumerate(self.compute)}

    def use_keywords(self, in_spec: Any, late: Optional[str]) -> None:
        """The model was called with keyword arguments: name each input by its keyword (from the
        export's input spec, ``((), {name: leaf})``), so that the first stage reads them from a
        dict; ``late`` is the one the last stage takes instead."""
        _, positions = tree_unflatten(list(range(len(self.inputs))), in_spec)
        self.names = {self.inputs[index]: name for name, index in positions.items()}
        self.late = late

    def _late_node(self) -> Optional[fx.Node]:
        return next((n for n, name in (self.names or {}).items() if name == self.late), None)

    def output_example(self) -> Any:
        """The model's output on the example, of its own type, its tensors fake (their shapes)."""
        leaves = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in tree_leaves(self.output.args[0])]
        return tree_unflatten(leaves, self.out_spec)

    @property
    def units(self) -> int:
        return max(1, len(self.candidates))

    # -- from split points to units per stage ---------------------------------------------------
    def sizes_for_points(self, points: Sequence[str]) -> List[int]:
        """Units per stage for ``points`` (qualified names where stages 1..N-1 begin)."""
        allowed = self.candidates[1:]
        starts = []
        for point in points:
            if point not in allowed:
                listed = ", ".join(allowed) if allowed else "(none: the forward calls one candidate)"
                raise ValueError(f"split point {point!r} is not a submodule a stage can begin at; "
                                 f"choose among, in call order: {listed}")
            starts.append(self.candidates.index(point))
        if any(b <= a for a, b in zip(starts, starts[1:])):
            order = sorted(points, key=self.candidates.index)
            raise ValueError(f"split points {list(points)} are not in the order the forward calls "
                             f"them, or repeat one; give them as {order}")
        bounds = [0] + starts + [self.units]
        return [b - a for a, b in zip(bounds, bounds[1:])]

    def points_for_sizes(self, sizes: Sequence[int]) -> List[str]:
        """The split points of a partition in units per stage (the inverse of :meth:`sizes_for_points`)."""
        return [self.candidates[start] for start in itertools.accumulate(list(sizes)[:-1])]

    # -- the stage modules ------------------------------------------------------------------------
    def stage_modules(self, sizes: Sequence[int], late: bool = True) -> List[fx.GraphModule]:
        """One module per stage over ``sizes`` (units per stage), each taking one argument and
        returning one value: the first stage the model's input, the others what the stage before
        returned; a stage that needs a size reads it off a tensor it holds, and a late input is
        the last stage's second argument, and reaches an earlier stage that reads it too (an
        encoder-decoder shifts its labels into the decoder's input) from the first stage's
        inputs, across the cuts between, as any input does. ``late=False``: a late input is one
        of the first stage's like any other, and crosses the cuts to the stages that read it (the
        unit chain of the partitioners and the profile)."""
        if sum(sizes) != self.units or any(s < 1 for s in sizes):
            raise ValueError(f"a partition of this model needs stages of at least one unit covering "
                             f"{self.units} units, got {list(sizes)}")
        ends = list(itertools.accumulate(sizes))
        stage_of = {node: next(k for k, end in enumerate(ends) if self.unit[node] < end)
                    for node in self.compute}
        last_input = self._late_node() if late else None
        if last_input is not None:
            # a size read off the late input (the batch dimension the export found equal to an
            # input's) is read again, where it is needed, off a tensor the stage holds
            stage_of = {n: k for n, k in stage_of.items()
                        if not (n.target is torch.ops.aten.sym_size.int and n.args[0] is last_input)}
        early = self._early_readers(last_input, stage_of, len(sizes))
        boundaries = self._boundaries(stage_of, len(sizes), last_input, early)
        parts = []
        for k in range(len(sizes)):
            incoming = [n for n in self.inputs if n is not last_input or early] if k == 0 else boundaries[k - 1]
            outgoing = None if k == len(sizes) - 1 else boundaries[k]
            own = [n for n in self.compute if stage_of.get(n) == k]
            graph = self._stage_graph(own, incoming, outgoing, self.names if k == 0 else None,
                                      last_input if outgoing is None else None)
            parts.append(fx.GraphModule(self.graph_module, graph, class_name=f"Stage{k}"))
        return parts

    def unit_modules(self) -> nn.Sequential:
        """Every unit as a stage of its own, chained: the model as an ``nn.Sequential`` of its
        units, for the partitioners and the profile (each unit takes what the one before returns)."""
        return nn.Sequential(*self.stage_modules([1] * self.units, late=False))

    def _early_readers(self, node: Optional[fx.Node], stage_of: Dict[fx.Node, int], stages: int) -> List[int]:
        """The stages before the last that read the late input ``node`` (none: it goes to the
        last stage alone, as a target does)."""
        if node is None:
            return []
        return sorted({stage_of[n] for n in node.users if stage_of.get(n, stages - 1) < stages - 1})

    def _boundaries(self, stage_of: Dict[fx.Node, int], stages: int, last_input: Optional[fx.Node] = None,
                    early: Sequence[int] = ()) -> List[List[fx.Node]]:
        """For each cut k -> k+1, the tensors defined at or before stage k and read after it, in
        the order they travel (``last_input`` is the last stage's own: it crosses the cuts up to
        the last of its ``early`` readers, none to the last stage, which has it already)."""
        last_use: Dict[fx.Node, int] = {}
        for node in self.compute + [self.output]:
            reader = stage_of.get(node, stages - 1)
            for arg in node.all_input_nodes:
                last_use[arg] = max(last_use.get(arg, -1), reader)
        defined = {n: -1 for n in self.inputs}
        defined.update(stage_of)
        if last_input is not None:
            defined[last_input] = -1 if early else stages - 1
            last_use[last_input] = max(early, default=-1)
        crossing = []
        for k in range(stages - 1):
            values = [n for n in self.inputs + self.compute
                      if defined.get(n, stages) <= k < last_use.get(n, -1) and not _is_size(n.meta.get("val"))]
            for n in values:
                if not torch.is_tensor(n.meta.get("val")):
                    raise ValueError(f"{n.format_node()} crosses a stage boundary but is not a tensor "
                                     f"({type(n.meta.get('val')).__name__}); choose split points "
                                     f"where only tensors cross")
            crossing.append(values)
        return crossing

    def _stage_graph(self, own: List[fx.Node], incoming: List[fx.Node], outgoing: Optional[List[fx.Node]],
                     names: Optional[Dict[fx.Node, str]] = None, late: Optional[fx.Node] = None) -> fx.Graph:
        """The graph of one stage: ``own`` nodes over what comes in (``names``: a first stage's
        keyword inputs, read from a dict by name; ``late``: the last stage's second argument)."""
        graph = fx.Graph()
        env: Dict[fx.Node, fx.Node] = {}
        packed = graph.placeholder("inputs")
        if late is not None:
            env[late] = graph.placeholder("target")
            env[late].meta = dict(late.meta)
        if names is None and len(incoming) == 1:  # one value travels as itself, several as a tuple
            env[incoming[0]] = packed
            packed.meta = dict(incoming[0].meta)
        else:
            for i, node in enumerate(incoming):
                env[node] = graph.call_function(_item, (packed, i if names is None else names[node]))
                env[node].meta = dict(node.meta)

        def value(arg: fx.Node) -> fx.Node:
            if arg in env:
                return env[arg]
            if arg.op == "get_attr":
                env[arg] = graph.node_copy(arg)
                return env[arg]
            if _is_size(arg.meta.get("val")):
                env[arg] = self._size_here(graph, env, arg, value)
                return env[arg]
            raise AssertionError(f"{arg.format_node()} is neither computed here nor received")

        for node in own:
            env[node] = graph.node_copy(node, value)
        if outgoing is None:
            flat = [value(a) if isinstance(a, fx.Node) else a for a in tree_leaves(self.output.args[0])]
            if self.out_spec.is_leaf():
                graph.output(flat[0])
            else:  # the forward's own output type (a library's ModelOutput, a namedtuple, a dict)
                graph.output(graph.call_module(OUTPUT_BUILDER, tuple(flat)))
        else:
            sent = [value(n) for n in outgoing]
            graph.output(sent[0] if len(sent) == 1 else tuple(sent))
        graph.lint()
        return graph

    @staticmethod
    def _size_here(graph: fx.Graph, env: Dict[fx.Node, fx.Node], node: fx.Node, value) -> fx.Node:
        """A size (a dynamic dimension, or arithmetic on them) computed in another stage, read
        here again from a tensor this stage holds whose shape has it, or recomputed from its
        operands."""
        wanted = node.meta["val"]
        if isinstance(wanted, torch.SymInt):
            expr = wanted.node.expr
            for original, here in list(env.items()):
                val = original.meta.get("val")
                if torch.is_tensor(val):
                    for dim, size in enumerate(val.shape):
                        if isinstance(size, torch.SymInt) and size.node.expr == expr:
                            read = graph.call_function(torch.ops.aten.sym_size.int, (here, dim))
                            read.meta = dict(node.meta)
                            return read
        if not isinstance(wanted, torch.SymInt) or (node.op == "call_function"
                                                    and node.target is not torch.ops.aten.sym_size.int):
            return graph.node_copy(node, value)  # e.g. s0 * 8 from s0, read as above
        raise ValueError(f"stage needs the size {wanted} ({node.format_node()}) but holds no tensor "
                         f"with that dimension; choose other split points")

    def shared_parameters(self, parts: Sequence[nn.Module]) -> Dict[nn.Parameter, List[int]]:
        """Parameters read by more than one stage module: each with the stages that hold it."""
        holders: Dict[int, Tuple[nn.Parameter, List[int]]] = {}
        for k, part in enumerate(parts):
            for _, p in part.named_parameters():
                holders.setdefault(id(p), (p, []))[1].append(k)
        return {p: ks for p, ks in holders.values() if len(ks) > 1}


#: the last stage's submodule that builds the model's output from the graph's flat values
OUTPUT_BUILDER = "pipeoptim_output"


class OutputBuilder(nn.Module):
    """The model's output, of the type its forward returns, from the graph's flat values."""

    def __init__(self, spec: Any) -> None:
        super().__init__()
        self.spec = spec

    def forward(self, *leaves: Any) -> Any:
        return tree_unflatten(list(leaves), self.spec)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "OutputBuilder":
        """A copy (a mirrored method's second pipeline copies the pieces) shares the spec, which
        holds no state (and torch's pytree warns when one is copied)."""
        made = memo[id(self)] = OutputBuilder(self.spec)
        return made


def _item(values: Any, index: Any) -> Any:
    """``values[index]``: one of the values a stage receives (an fx call, so that it is named),
    by position in a tuple or by name in a dict of keyword inputs."""
    return values[index]
