"""A stage's backward in two halves: the input's gradient now, the weights' later.

``I`` (:func:`backward_input`) and ``W`` (:func:`backward_weight`) share the forward's graph
(docs/architecture.md, "Split backward"). A *boundary* node is one of the input path that also
leads to a weight (a matrix product whose other operand is a weight, a bias addition, ...); an
output that does not depend on the stage's input is its own boundary. Each weight gradient is the
same sum of the same products as a plain ``loss.backward()``, up to the order of the additions
where a weight is used twice.

The input half keeps only the outputs that seed a weight group, and each group's call frees what
it ran (keeping the whole graph made every weight gradient a fresh allocation while the
activations were still held). This is ``torch.distributed.pipelining``'s split backward on
torch's public autograd API, keeping the gradients of weights that hang only from outputs that
do not depend on the input (torch's version drops them).

Weights read at several depths. A group may hang from two boundaries one of which lies below the
other on the input path: T5's relative position bias, made once from a table and added to the
scores of every block; a learned table added in every block; a matrix applied, then another
layer, then the same matrix again. Started at both boundaries, the weight half's autograd call
would run every input-path node between them (they lead to the weights through the lower
boundary): the input gradient computed again, and, as the call frees what it runs, nodes other
groups still start from ("Trying to backward through the graph a second time"). Autograd runs
whatever leads to a requested gradient, so no call started at the upper boundary can skip them.
For such a *nested* group the input half also takes the gradients flowing into the group's nodes
just below its boundaries (off the input path), and the weight half starts there: the boundaries'
own weight-side products (an addition's pass-through for a bias or a table, but a read matrix's
products too) run with the input's, the rest of the group's chain (an embedding's backward, the
sum over the reads) in the weight half. Nothing runs twice, and every other group is untouched."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class WeightGroup:
    """Weights whose gradients come from the same seeds (one autograd call)."""

    weights: List[int]                             #: indices into the stage's weight list
    #: where the weight half starts: nodes on the input path (an ordered set); a nested group's
    #: are the nodes just below its boundaries instead (module docstring)
    boundaries: Dict[Node, None]
    outputs: Dict[int, None]                       #: outputs off the input path (indices)
    grads: Dict[Node, tuple] = field(default_factory=dict)  #: gradients arriving at each start
    #: the nodes off the input path between the seeds and the weights (only while grouping)
    crossed: Dict[Node, None] = field(default_factory=dict)


@dataclass
class PendingWeightGrads:
    """What :func:`backward_input` leaves for :func:`backward_weight`: the groups, with the graph
    alive through their nodes and the outputs they start from."""

    weights: List[torch.Tensor]
    outputs: List[Optional[torch.Tensor]]        #: those that seed a group (None: not needed)
    output_grads: List[Optional[torch.Tensor]]
    groups: List[WeightGroup]
    #: no input takes a gradient: the weight half is the whole backward (one autograd call,
    #: gradients accumulated by autograd itself)
    full: bool = False
    #: the weights' gradients, computed with the input's (:func:`backward_together`); the weight
    #: half only accumulates them
    computed: Optional[List[Optional[torch.Tensor]]] = None


def _node(tensor: torch.Tensor) -> Node:
    """The autograd node a gradient of ``tensor`` flows into (its grad_fn, or a leaf's
    accumulator)."""
    return tensor.grad_fn if tensor.grad_fn is not None else get_gradient_edge(tensor).node


def _parents(roots: Sequence[Node]) -> Dict[Node, List[Node]]:
    """For every node reachable from ``roots`` (roots included), the nodes that feed it a
    gradient (its consumers in the forward)."""
    parents: Dict[Node, List[Node]] = {root: [] for root in roots}
    queue = deque(parents)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                queue.append(child)
            parents[child].append(node)
    return parents


def _upward(starts: Sequence[Node], parents: Dict[Node, List[Node]], stop: Set[Node]):
    """Nodes reachable from ``starts`` towards the outputs, in the order found; nodes in ``stop``
    are reported and not crossed. Returns (nodes crossed, stop nodes met)."""
    seen: Dict[Node, None] = dict.fromkeys(starts)
    met: Dict[Node, None] = {}
    queue = deque(starts)
    while queue:
        for parent in parents[queue.popleft()]:
            if parent in stop:
                met[parent] = None
            elif parent not in seen:
                seen[parent] = None
                queue.append(parent)
    return seen, met


def _group_weights(weights: Sequence[torch.Tensor], roots: List[Node], parents: Dict[Node, List[Node]],
                   on_input_path: Set[Node]) -> List[WeightGroup]:
    """Each weight with the seeds of its gradient: the nodes of the input path it hangs from
    (where the input half leaves the gradient it needs), and the outputs off that path whose
    gradient reaches it. Weights sharing a seed share a group."""
    groups: List[WeightGroup] = []
    for index, weight in enumerate(weights):
        if not weight.requires_grad:
            continue
        node = _node(weight)
        if node not in parents:
            continue  # not used by this pass
        crossed, met = _upward([node], parents, on_input_path)
        outputs = {i: None for i, root in enumerate(roots) if root in crossed}
        group = WeightGroup([index], met, outputs, crossed=crossed)
        for other in [g for g in groups if g.boundaries.keys() & met or g.outputs.keys() & outputs]:
            group.weights = sorted(other.weights + group.weights)
            group.boundaries = {**other.boundaries, **group.boundaries}
            group.outputs = {**other.outputs, **group.outputs}
            group.crossed = {**other.crossed, **group.crossed}
            groups.remove(other)
        groups.append(group)
    return groups


def _nested(group: WeightGroup, on_input_path: Set[Node]) -> bool:
    """Whether a boundary of ``group`` reaches another of its boundaries (necessarily through
    input-path nodes: nothing off the path leads back onto it)."""
    if len(group.boundaries) < 2:
        return False
    seen: Set[Node] = set()
    queue = deque(c for b in group.boundaries for c, _ in b.next_functions if c in on_input_path)
    while queue:
        node = queue.popleft()
        if node in group.boundaries:
            return True
        if node not in seen:
            seen.add(node)
            queue.extend(c for c, _ in node.next_functions if c in on_input_path)
    return False


def _below_boundaries(group: WeightGroup, parents: Dict[Node, List[Node]]) -> Dict[Node, List[int]]:
    """The nodes a nested group's weight half starts from instead of its boundaries (module
    docstring): each boundary's children off the input path on the way to the group's weights,
    with the inputs of each that anything feeds. The input half's call runs every node that
    leads to one of them, so what it takes there is the whole gradient (an output's share too,
    where an output off the input path also leads there)."""
    below: Dict[Node, List[int]] = {}
    for boundary in group.boundaries:
        for child, _ in boundary.next_functions:
            if child in group.crossed and child not in below:
                below[child] = sorted({nr for p in parents[child]
                                       for c, nr in p.next_functions if c is child})
    return below


def backward_input(outputs: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]],
                   inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]
                   ) -> Tuple[List[Optional[torch.Tensor]], PendingWeightGrads]:
    """The input half: the gradients of ``inputs`` (leaves requiring grad; None where none flows)
    from ``outputs`` with ``grads`` (None: a scalar loss's 1), and what :func:`backward_weight`
    needs to give ``weights`` theirs."""
    grads = [torch.ones_like(o) if g is None else g for o, g in zip(outputs, grads)]
    if not inputs:  # a first stage: nothing to compute now, and no graph to walk
        return [], PendingWeightGrads(list(weights), list(outputs), grads, [], full=True)
    roots = [_node(o) for o in outputs]
    parents = _parents(roots)
    input_nodes = [n for n in map(_node, inputs) if n in parents]
    on_input_path, _ = _upward(input_nodes, parents, set())  # what the input half runs
    groups = _group_weights(weights, roots, parents, on_input_path)
    # a nested group starts below its boundaries: what flows in there is taken with the input's
    below = {id(g): _below_boundaries(g, parents) for g in groups if _nested(g, on_input_path)}
    taken = [GradientEdge(node, nr) for starts in below.values() for node, slots in starts.items()
             for nr in slots]
    handles = [b.register_prehook(_recorder(group, b)) for group in groups if id(group) not in below
               for b in group.boundaries]
    try:
        wanted = [i for i, t in enumerate(inputs) if _node(t) in on_input_path]
        found = torch.autograd.grad(outputs, [*(inputs[i] for i in wanted), *taken], grads,
                                    retain_graph=True, allow_unused=True) if wanted or taken else ()
    finally:
        for handle in handles:
            handle.remove()
    input_grads: List[Optional[torch.Tensor]] = [None] * len(inputs)
    for i, grad in zip(wanted, found):
        input_grads[i] = grad
    by_edge = dict(zip(((e.node, e.output_nr) for e in taken), found[len(wanted):]))
    for group in groups:
        group.crossed = {}
        if id(group) in below:  # the taken nodes stand for the boundaries (whose work is done)
            group.boundaries = dict.fromkeys(below[id(group)])
            group.grads = {node: tuple(by_edge.get((node, nr)) for nr in range(max(slots) + 1))
                           for node, slots in below[id(group)].items() if slots}
    # only the outputs that seed a group stay: the graph above the boundaries goes with the rest
    seeds = {i for group in groups for i in group.outputs}
    kept = [o if i in seeds else None for i, o in enumerate(outputs)]
    kept_grads = [g if i in seeds else None for i, g in enumerate(grads)]
    return input_grads, PendingWeightGrads(list(weights), kept, kept_grads, groups)


def backward_together(outputs: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]],
                      inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]
                      ) -> Tuple[List[Optional[torch.Tensor]], PendingWeightGrads]:
    """Both halves in one autograd call, for a graph that cannot be cut between them (a compiled
    forward is one node, whose backward computes every gradient at once): the inputs' gradients
    now, the weights' kept for :func:`backward_weight` to accumulate, as :func:`backward_input`
    leaves them. Without inputs (a first stage) the whole backward waits for the weight half."""
    if not inputs:
        return backward_input(outputs, grads, inputs, weights)
    grads = [torch.ones_like(o) if g is None else g for o, g in zip(outputs, grads)]
    wanted = [w for w in weights if w.requires_grad]
    found = torch.autograd.grad(outputs, [*inputs, *wanted], grads, allow_unused=True)
    by_weight = iter(found[len(inputs):])
    computed = [next(by_weight) if w.requires_grad else None for w in weights]
    return list(found[:len(inputs)]), PendingWeightGrads(list(weights), [], [], [], computed=computed)


def _recorder(group: WeightGroup, node: Node):
    def record(grad_outputs):
        group.grads[node] = grad_outputs
    return record


def _pinned(recorded: tuple, grad_outputs: tuple) -> tuple:
    """A start's gradients replaced by those recorded in the input half (an input no gradient
    reached in it: None), as many as the node takes."""
    return tuple(recorded[i] if i < len(recorded) else None for i in range(len(grad_outputs)))


def _accumulate(weights: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]]) -> List[torch.Tensor]:
    """Each gradient into its weight's ``.grad``, as autograd accumulates; the weights that got one."""
    got = []
    for weight, grad in zip(weights, grads):
        if grad is not None:
            weight.grad = grad if weight.grad is None else weight.grad.add_(grad)
            got.append(weight)
    return got


def backward_weight(pending: PendingWeightGrads,
                    on_group: Optional[Callable[[List[torch.Tensor]], None]] = None) -> None:
    """The weight half: accumulate each weight's gradient into its ``.grad``, as autograd does;
    ``on_group(weights)`` after each group's are accumulated (their gradients are final then:
    a data-parallel stage sends them to its replicas while the next group runs). The full
    backward of a first stage accumulates in autograd, whose own hooks see it instead.

    Each group's call frees what it ran (no ``retain_graph``): no node runs in two groups. A call
    runs its seeds and the nodes between them and its weights, off the input path; a node off the
    path that leads to the weights of two groups would be crossed by the upward search from both
    weights, which would then meet the same seeds, and share a group. An input-path node would
    run only if it led from one of the group's boundaries to another: a nested group, which
    starts below its boundaries instead (module docstring)."""
    if pending.computed is not None:  # computed with the input half (backward_together)
        got = _accumulate(pending.weights, pending.computed)
        if on_group is not None:
            on_group(got)
        pending.computed = None
        return
    if pending.full:  # no input half: the plain backward, into the leaves' .grad (as Stage.backward)
        outputs, grads = pending.outputs, pending.output_grads
        pending.outputs, pending.output_grads = [], []
        if outputs:
            torch.autograd.backward(outputs, grads)
        return
    for group in pending.groups:
        edges, values = [], []
        for b in group.boundaries:
            for i, g in enumerate(group.grads.get(b, ())):
                if g is not None:
                    edges.append(GradientEdge(b, i))
                    values.append(g)
        for i in group.outputs:
            edges.append(get_gradient_edge(pending.outputs[i]))
            values.append(pending.output_grads[i])
        if not edges:
            continue  # no gradient reached this group's weights
        handles = []
        # pin each start's gradient to the one recorded or taken in the input half: nothing is
        # counted twice where a start is also reached from another (an output's chain, say)
        if len(edges) > 1:
            handles = [b.register_prehook(partial(_pinned, group.grads[b]))
                       for b in group.boundaries if b in group.grads]
        weights = [pending.weights[i] for i in group.weights]
        try:
            found = torch.autograd.grad(edges, [get_gradient_edge(w) for w in weights], values,
                                        allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        got = _accumulate(weights, found)
        if on_group is not None:
            on_group(got)
    pending.groups, pending.outputs, pending.output_grads = [], [], []  # the graph may go
