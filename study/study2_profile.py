"""The second study's time axis, measured once per cell (study/study2_times.py; the
equal-time study's budget reuses it, study/study3_times.py): profile the model's layers at
every micro-batch size the study's methods use, then predict each method's seconds per mini-batch
at each N with the schedule simulator, over the study's uniform split."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from pipeoptim.methods import get_method
from pipeoptim.throughput import candidate_problem, microbatch_size, partition_for, predict, profile_sizes, stage_costs
from pipeoptim.profile import ModelProfile
from pipeoptim.stage_timing import measure_stages
from pipeoptim.runtime.microbatch import split_batch

PARTITIONER = "uniform"  #: the study's split (RunConfig's default)


def study_microbatches(method: str, stages: int) -> int:
    """Micro-batches per mini-batch the study's runs use: the method's default (the study sets
    none), as ``checks.check_run`` resolves it (``RunSpec.microbatches``)."""
    return get_method(method).microbatches(1 if method == "sequential" else stages, None)


@dataclasses.dataclass(frozen=True)
class ProfileSettings:
    """How a model is profiled (the options of ``pipeoptim plan`` of the same names)."""

    threads: int = 1            #: torch threads (one: as each stage process of the runtime)
    warmup: int = 3             #: unmeasured runs per layer (and per stage)
    repeats: int = 20           #: measured runs per layer (and per stage)
    statistic: str = "min"      #: min (what the device can do, on a machine shared with other jobs) or median
    stage_timing: str = "measured"  #: measured (whole stages, as the runtime runs them) or profile (sum of layers)
    device: str = "cpu"

    def to_dict(self) -> Dict[str, Any]:
        return {**dataclasses.asdict(self), "scaling": "measure", "partitioner": PARTITIONER}


@dataclasses.dataclass
class ProfiledModel:
    """One model of the study profiled once, for every N and method.

    ``profiles[M]`` is the profile of one micro-batch of ``ceil(batch_size / M)`` samples (M = 1:
    the mini-batch); ``sample``/``target`` a mini-batch of the data, from which the stages are
    timed at each micro-batch size (``stage_times``, with ``measured`` stage timing)."""

    net: nn.Sequential
    batch_size: int
    profiles: Dict[int, ModelProfile]
    settings: ProfileSettings
    sample: Any = None
    target: Optional[torch.Tensor] = None
    loss_fn: Optional[Callable[..., torch.Tensor]] = None
    optimizer: Optional[Callable[..., torch.optim.Optimizer]] = None
    timings: Dict[Tuple[Tuple[int, ...], int], Dict[str, List[float]]] = dataclasses.field(default_factory=dict)

    @property
    def layers(self) -> int:
        return len(self.net)

    def stage_times(self, sizes: Sequence[int], microbatches: int) -> Optional[Dict[str, List[float]]]:
        """Measured forward/backward/update seconds per stage of the split ``sizes`` for one
        micro-batch of ``M = microbatches`` (cached), or None with ``profile`` stage timing (the
        planner then adds up the profiled layers)."""
        if self.settings.stage_timing != "measured":
            return None
        key = (tuple(sizes), microbatch_size(self.batch_size, microbatches))
        if key not in self.timings:
            x, y, _ = split_batch(self.sample, self.target, microbatches)[0]  # the first micro-batch, as profiled
            s = self.settings
            self.timings[key] = measure_stages(self.net, list(sizes), x, y, self.loss_fn, device=s.device,
                                               optimizer=self.optimizer, warmup=s.warmup, repeats=s.repeats,
                                               statistic=s.statistic)
        return self.timings[key]


def load_cell(task: str, spec: Dict[str, Any]) -> Tuple[nn.Sequential, Any, torch.Tensor, int, Any]:
    """The study's model of ``task`` and its data as a study run loads them (seed 0): (model,
    a mini-batch's inputs, its targets, mini-batches per epoch, the task)."""
    from pipeoptim.lab.tasks import get_task

    the_task = get_task(task)
    data = the_task.load(batch_size=spec["batch_size"], limit=spec["limit"], seed=0, holdout=spec["holdout"])
    net = the_task.build_model(spec["model"], data, seed=0)  # (a text model's vocabulary comes from the data)
    sample, target = data.train[0]
    return net, sample, target, len(data.train), the_task


def profile_cell(task: str, spec: Dict[str, Any], optimizer: str, counts: Sequence[int],
                 settings: ProfileSettings) -> Tuple[ProfiledModel, int]:
    """Profile the study's model of ``task`` with ``optimizer`` at the micro-batch ``counts``;
    returns it and the study's mini-batches per epoch."""
    from pipeoptim.lab.optimizers import make_optimizer

    net, sample, target, batches, the_task = load_cell(task, spec)
    factory = make_optimizer(optimizer, the_task.default_lr.get(optimizer, 1e-3))  # (the lr costs nothing)
    profiles = profile_sizes(net, sample, target, the_task.loss, batch_size=spec["batch_size"], microbatches=counts,
                             scaling="measure", device=settings.device, warmup=settings.warmup,
                             repeats=settings.repeats, statistic=settings.statistic, optimizer=factory,
                             optimizer_name=optimizer, seed=0)
    return ProfiledModel(net, spec["batch_size"], profiles, settings, sample, target, the_task.loss, factory), batches


def split_of(model: ProfiledModel, method: str, stages: int) -> List[int]:
    """Layers per stage: the whole model for sequential, else the uniform split."""
    if method == "sequential":
        return [model.layers]
    return partition_for(PARTITIONER, model.net, model.profiles[1], stages)


def predict_method(model: ProfiledModel, method: str, stages: int, batches: int) -> Dict[str, Any]:
    """The simulator's seconds per mini-batch of ``method`` on ``stages`` devices over ``batches``
    mini-batches (one fill and drain), with the study's micro-batches."""
    m = study_microbatches(method, stages)
    sizes = split_of(model, method, stages)
    problem = candidate_problem(method, len(sizes), m, model.batch_size)
    if problem:
        raise ValueError(f"{method} at N = {stages}: {problem}")
    row = predict(method, model.profiles[m], sizes, microbatches=m, batches=batches, batch_size=model.batch_size,
                  measured=model.stage_times(sizes, m))
    return {"seconds_per_batch": row["makespan_seconds"] / batches, "microbatches": m,
            "microbatch_size": row["microbatch_size"], "bubble_fraction": row["bubble_fraction"]}


def stage_summary(model: ProfiledModel, sizes: Sequence[int]) -> Dict[str, Any]:
    """The split ``sizes`` and its stages' seconds for one mini-batch: forward + backward per
    stage, and the slowest stage's update (the costs the asynchronous 1F1B methods run at; with
    one stage, sequential's). The stages' seconds add up to about sequential's."""
    costs = stage_costs(model.profiles[1], sizes, measured=model.stage_times(sizes, 1))
    return {"partition": list(sizes), "stage_seconds": [f + b for f, b in zip(costs.forward, costs.backward)],
            "update_seconds": costs.update}


def cell_table(model: ProfiledModel, stage_counts: Sequence[int], methods: Sequence[str],
               batches: int) -> Dict[str, Any]:
    """Seconds per mini-batch of every method at every N (and sequential's) for one profiled
    model, over ``batches`` mini-batches."""
    sequential = {**predict_method(model, "sequential", 1, batches),
                  **stage_summary(model, split_of(model, "sequential", 1))}
    table: Dict[str, Any] = {"batches": batches, "layers": model.layers, "sequential": sequential, "stages": {}}
    for n in stage_counts:
        table["stages"][str(n)] = {
            **stage_summary(model, split_of(model, "async-naive", n)),
            "methods": {m: predict_method(model, m, n, batches) for m in methods if m != "sequential"}}
    return table
