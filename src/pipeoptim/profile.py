"""Per-layer profile of an ``nn.Sequential``: what the ``time`` partitioner and the planner need.

:func:`profile_model` measures every layer (every element of the ``nn.Sequential``, as
:func:`pipeoptim.partition.split` sees them) on a real sample batch and on the chosen device, a
layer receiving its predecessor's output as its one argument (:class:`LayerProfile` lists what).
A layer's ``backward`` is timed alone: its forward runs on a detached leaf copy of its input, then
``torch.autograd.backward`` with a random gradient of the output's shape, so that input and weight
gradients are both computed, as a pipeline stage does (the first layer gets the data itself, whose
gradient no stage computes). ``saved_bytes`` counts each storage autograd keeps once, parameters
excluded: what one in-flight micro-batch holds. On CUDA the device is synchronised around each
measured call. Whole stages, as the runtime runs them: :mod:`pipeoptim.stage_timing`.
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from .compat import tensor_leaves, tree_map_tensors
from .partition import slices
from .runtime.build import StageParameters

Activation = Any  #: a tensor or a tuple of tensors
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class LayerProfile:
    """One layer's measured costs (seconds, bytes)."""

    index: int
    name: str                     #: the layer's class name
    forward: float                #: seconds, median
    backward: float               #: seconds, median (0 for a layer with nothing to differentiate)
    output_bytes: int             #: bytes of the output (sent to the next stage after this layer)
    saved_bytes: int              #: bytes autograd saves for the backward (parameters excluded)
    saved_input_bytes: int        #: of those, bytes sharing storage with the layer's input
    saved_output_bytes: int       #: of those, bytes sharing storage with the layer's output
    parameter_bytes: int          #: sum of numel * element_size over the parameters
    parameters: int               #: sum of numel over the parameters
    update: float = 0.0           #: seconds of one optimizer step (0 when not measured)
    optimizer_bytes: int = 0      #: optimizer state bytes (0 when not measured)

    @property
    def compute(self) -> float:
        """Forward + backward seconds: the cost the ``time`` partitioner balances."""
        return self.forward + self.backward


@dataclass
class ModelProfile:
    """A whole model's profile: one :class:`LayerProfile` per layer, plus how it was measured."""

    layers: List[LayerProfile]
    device: str
    batch_size: int               #: samples in the profiled batch
    input_bytes: int              #: bytes of the model's input batch
    warmup: int
    repeats: int
    threads: int                  #: torch intra-op threads during the measurement
    loss_forward: float = 0.0     #: seconds of the loss on the last layer's output (if measured)
    loss_backward: float = 0.0
    optimizer: Optional[str] = None
    statistic: str = "median"     #: how the repeats were summarised: median or min
    extra: Dict[str, Any] = field(default_factory=dict)

    # -- totals --------------------------------------------------------------------------------
    @property
    def forward(self) -> float:
        return sum(layer.forward for layer in self.layers) + self.loss_forward

    @property
    def backward(self) -> float:
        return sum(layer.backward for layer in self.layers) + self.loss_backward

    @property
    def update(self) -> float:
        return sum(layer.update for layer in self.layers)

    @property
    def parameter_bytes(self) -> int:
        return sum(layer.parameter_bytes for layer in self.layers)

    @property
    def parameters(self) -> int:
        return sum(layer.parameters for layer in self.layers)

    def layer_costs(self, include_loss: bool = True) -> List[float]:
        """Forward + backward seconds per layer; the loss's cost is added to the last layer (it
        always runs on the last stage)."""
        costs = [layer.compute for layer in self.layers]
        if include_loss and costs:
            costs[-1] += self.loss_forward + self.loss_backward
        return costs

    def boundary_bytes(self) -> List[int]:
        """Bytes sent across a cut after layer i, for i = 0 .. L-2."""
        return [layer.output_bytes for layer in self.layers[:-1]]

    def totals(self) -> Dict[str, float]:
        return {"forward": self.forward, "backward": self.backward, "update": self.update,
                "parameter_bytes": self.parameter_bytes, "parameters": self.parameters,
                "saved_bytes": sum(layer.saved_bytes for layer in self.layers),
                "optimizer_bytes": sum(layer.optimizer_bytes for layer in self.layers)}

    # -- per stage -----------------------------------------------------------------------------
    def stage_slices(self, sizes: List[int]) -> List[Tuple[int, int]]:
        if sum(sizes) != len(self.layers):
            raise ValueError(f"partition {sizes} covers {sum(sizes)} layers but the profile has {len(self.layers)}")
        return slices(sizes)

    def held_bytes(self, first: int, end: int, recompute: bool = False) -> int:
        """Bytes one in-flight micro-batch holds on a stage of layers ``[first, end)`` (what
        ``runtime/held.py`` measures): the layers' saved tensors, a tensor shared by consecutive
        layers (one's saved output, the next one's saved input) counted once, plus the stage's
        received input where its first layer does not save it and its output where its last
        layer does not (the runtime keeps both until the backward; the last stage's output is
        the loss, and what the loss saves is not profiled). With ``recompute`` the stage keeps
        only its input (the model's input on the first stage) and its output (not on the last)."""
        layers = self.layers[first:end]
        last = end == len(self.layers)
        output = 0 if last else layers[-1].output_bytes
        if recompute:
            return (self.layers[first - 1].output_bytes if first > 0 else self.input_bytes) + output
        held = sum(layer.saved_bytes for layer in layers)
        for a, b in zip(layers, layers[1:]):
            held -= min(a.saved_output_bytes, b.saved_input_bytes)
        if first > 0:
            received = self.layers[first - 1].output_bytes
            held += max(0, received - layers[0].saved_input_bytes)
        return held + max(0, output - layers[-1].saved_output_bytes)

    # -- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["totals"] = self.totals()
        return out

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "ModelProfile":
        names = {f.name for f in fields(LayerProfile)}
        layers = [LayerProfile(**{k: v for k, v in layer.items() if k in names}) for layer in data["layers"]]
        own = {f.name for f in fields(cls)} - {"layers"}
        return cls(layers=layers, **{k: v for k, v in data.items() if k in own})


# -- helpers ---------------------------------------------------------------------------------------

def nbytes(value: Activation) -> int:
    """Bytes of the tensors of an activation: ``sum(numel * element_size)``."""
    return sum(t.numel() * t.element_size() for t in tensor_leaves(value))


def on_device(value: Activation, device: torch.device) -> Activation:
    """A copy on ``device`` with storage of its own (a slice of a bigger tensor would make the
    saved-bytes count see the whole storage)."""
    return tree_map_tensors(lambda t: t.detach().to(device).clone(), value)


def _leaf(value: Activation) -> Activation:
    """A detached copy of the activation whose floating tensors collect gradients."""
    return tree_map_tensors(lambda t: t.detach().requires_grad_(t.is_floating_point()), value)


def detached(value: Activation) -> Activation:
    return tree_map_tensors(lambda t: t.detach(), value)


def _storage_key(t: torch.Tensor) -> Tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class Clock:
    """Wall-clock timing that waits for the device (CUDA) before reading the clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def now(self) -> float:
        """The clock's seconds once the device's queued work is done."""
        self.sync()
        return time.perf_counter()

    def time(self, fn: Callable[[], Any]) -> Tuple[float, Any]:
        self.sync()
        start = time.perf_counter()
        result = fn()
        self.sync()
        return time.perf_counter() - start, result


def _saved_tensor_bytes(layer: nn.Module, inputs: Activation) -> Tuple[int, int, int, Activation]:
    """Run ``layer`` on ``inputs`` recording what autograd saves; returns (saved bytes, bytes
    shared with the input, bytes shared with the output, output). Parameters are excluded and
    each storage is counted once (its full size: a saved view keeps its whole storage)."""
    params = {_storage_key(p) for p in layer.parameters()}
    saved: Dict[Tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            key = _storage_key(t)
            if key not in params and key[1] > 0:
                saved[key] = key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.enable_grad():
            output = layer(inputs)
    in_keys = {_storage_key(t) for t in tensor_leaves(inputs)}
    out_keys = {_storage_key(t) for t in tensor_leaves(output)}
    total = sum(saved.values())
    shared_in = sum(b for k, b in saved.items() if k in in_keys)
    shared_out = sum(b for k, b in saved.items() if k in out_keys)
    return total, shared_in, shared_out, output


STATISTICS = ("median", "min")


def check_statistic(statistic: str) -> None:
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {', '.join(STATISTICS)}, got {statistic!r}")


def _summary(times: List[float], statistic: str = "median") -> float:
    if not times:
        return 0.0
    return float(min(times)) if statistic == "min" else float(statistics.median(times))


def _timed_runs(once: Callable[[], Any], runs: int, warmup: int) -> List[Any]:
    """What ``once()`` returns (seconds) in each of ``runs`` calls, but the first ``warmup``."""
    return [once() for _ in range(runs)][warmup:]


# -- the profiler ----------------------------------------------------------------------------------

def profile_model(model: nn.Sequential, sample: Activation, *, device: str = "cpu", warmup: int = 2,
                  repeats: int = 5, optimizer: Optional[OptimizerFactory] = None,
                  optimizer_name: Optional[str] = None,
                  loss_fn: Optional[Callable[[Any, torch.Tensor], torch.Tensor]] = None,
                  target: Optional[torch.Tensor] = None, seed: int = 0,
                  statistic: str = "median") -> ModelProfile:
    """Profile every layer of ``model`` on the input batch ``sample`` (a tensor or a tuple of
    tensors), on ``device`` (``cpu``, ``cuda``, ``cuda:1``, ...).

    ``optimizer`` (a factory ``params -> torch.optim.Optimizer``) adds each layer's update time
    and optimizer state bytes; ``loss_fn`` with ``target`` adds the loss's forward and backward
    time (charged to the last layer by :meth:`ModelProfile.layer_costs`). Times are medians of
    ``repeats`` runs after ``warmup`` runs (``statistic="min"``: the fastest run, which on a
    machine shared with other jobs is closer to what the device can do). The model is copied;
    the caller's is not touched.
    """
    if not isinstance(model, nn.Sequential) or len(model) == 0:
        raise ValueError("profile_model needs a non-empty nn.Sequential")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    check_statistic(statistic)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for but CUDA is not available")
    clock = Clock(dev)
    generator = torch.Generator().manual_seed(seed)
    work = copy.deepcopy(model).to(dev)
    work.train()
    x = on_device(sample, dev)
    first = tensor_leaves(x)
    if not first:
        raise ValueError("the sample batch holds no tensor")
    batch = int(first[0].shape[0]) if first[0].dim() > 0 else 1
    layers: List[LayerProfile] = []
    runs = warmup + repeats
    for index, layer in enumerate(work):
        # the model's input needs no gradient (a first stage computes none for its data); every
        # later layer's input is a leaf that collects one, as inside a stage or at its boundary
        _leaf_or_data = _leaf if index > 0 else (lambda v: v)
        leaf = _leaf_or_data(x)
        saved, saved_in, saved_out, output = _saved_tensor_bytes(layer, leaf)

        def forward() -> float:
            inp = _leaf_or_data(x)
            with torch.enable_grad():
                return clock.time(lambda: layer(inp))[0]

        def backward() -> float:
            with torch.enable_grad():
                fresh = layer(_leaf_or_data(x))
            fresh_outs = [t for t in tensor_leaves(fresh) if t.requires_grad]
            return clock.time(lambda: torch.autograd.backward(fresh_outs, grads))[0]

        forward_times = _timed_runs(forward, runs, warmup)
        outs = [t for t in tensor_leaves(output) if t.requires_grad]  # a random gradient for each
        grads = [torch.randn(t.shape, generator=generator, dtype=t.dtype).to(t.device) for t in outs]
        backward_times = _timed_runs(backward, runs, warmup) if outs else []

        update_seconds, state_bytes = 0.0, 0
        params = [p for p in layer.parameters() if p.requires_grad]
        if optimizer is not None and params:
            # as a stage's factory is called: the layer, and whether it is the model's last
            opt = optimizer(StageParameters(params, layer, index == len(work) - 1))
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            update_seconds = _summary(_timed_runs(lambda: clock.time(opt.step)[0], runs, warmup), statistic)
            state_bytes = sum(v.numel() * v.element_size() for state in opt.state.values()
                              for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        for p in layer.parameters():
            p.grad = None

        layers.append(LayerProfile(
            index=index, name=type(layer).__name__, forward=_summary(forward_times, statistic),
            backward=_summary(backward_times, statistic), output_bytes=nbytes(output), saved_bytes=saved,
            saved_input_bytes=saved_in, saved_output_bytes=saved_out,
            parameter_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
            parameters=sum(p.numel() for p in layer.parameters()),
            update=update_seconds, optimizer_bytes=state_bytes))
        x = detached(output)

    loss_forward = loss_backward = 0.0
    if loss_fn is not None and target is not None:
        tgt = on_device(target, dev)

        def loss_once() -> Tuple[float, float]:
            out = _leaf(x)
            with torch.enable_grad():
                seconds, loss = clock.time(lambda: loss_fn(out, tgt))
            return seconds, clock.time(lambda: loss.backward())[0]

        pairs = _timed_runs(loss_once, runs, warmup)
        loss_forward, loss_backward = (_summary([p[i] for p in pairs], statistic) for i in (0, 1))

    return ModelProfile(layers=layers, device=str(dev), batch_size=batch, input_bytes=nbytes(sample),
                        warmup=warmup, repeats=repeats, threads=torch.get_num_threads(),
                        loss_forward=loss_forward, loss_backward=loss_backward, optimizer=optimizer_name,
                        statistic=statistic)


def format_profile(profile: ModelProfile) -> str:
    """A small text table of a profile (milliseconds and kilobytes)."""
    head = ["layer", "name", "fwd ms", "bwd ms", "upd ms", "out KB", "saved KB", "params KB"]
    rows = [[str(l.index), l.name, f"{l.forward * 1e3:.3f}", f"{l.backward * 1e3:.3f}",
             f"{l.update * 1e3:.3f}", f"{l.output_bytes / 1024:.1f}", f"{l.saved_bytes / 1024:.1f}",
             f"{l.parameter_bytes / 1024:.1f}"] for l in profile.layers]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])
