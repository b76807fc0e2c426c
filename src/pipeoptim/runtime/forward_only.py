"""Forward-only work: the drained evaluation and the micro-batches of a schedule's E actions.

:func:`scored_forward` evaluates in one process or pipelined over the processes of a torchrun
job (docs/architecture.md, "The Pipeline under torchrun"), and :class:`PipelinedModel` runs a
user's evaluation function there, each call of the model through the stages. A schedule's ``E``
actions run an evaluation in the bubbles (docs/architecture.md, "Evaluation in the bubbles") or a
user's forward-only work (``Pipeline.forward_in_bubbles``), as the drained evaluation runs it, to
the bit. A stage is in eval mode only for the span of each pass (dropout then draws no random
numbers from the training forwards' streams), on the buffers it held when the evaluation was
asked for."""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, ContextManager, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from ..schedules.actions import Schedule
from ..schedules.fill import FillPlan, check_fillable, plan_fill
from ..schedules.simulate import Costs
from ..batches import LABELS
from .control import broadcast
from .microbatch import batch_size, samples
from .stage import Stage
from .transport import PipeComm
from .values import to_device
from .wire import signature


def run_stage(stage: Stage, value: Any, target: Any = None, autocast: bool = True) -> Any:
    """``stage``'s module on ``value`` (moved to its device), in its autocast (unless not
    ``autocast``: as the model runs whole); a last stage that takes the target (a model computing
    its own loss from its labels) takes ``target`` too."""
    with stage.autocast() if autocast else contextlib.nullcontext():
        if stage.takes_target:
            return stage.module(to_device(value, stage.device), to_device(target, stage.device))
        return stage.module(to_device(value, stage.device))


#: ``fn(inputs, target) -> int``: how much a mini-batch's value weighs in an evaluation's mean
Weight = Callable[[Any, Any], int]


@torch.no_grad()
def scored_forward(comm: Optional[PipeComm], stages: List[Stage], loader: Iterable, score: Callable, last: int,
                   first_chain: bool = False, weight: Weight = samples) -> Tuple[float, int]:
    """(the sum over samples of ``score(output, target)``, on the process of stage ``last``, 0.0
    elsewhere; the samples: ``weight(inputs, target)`` of each mini-batch, the real items of a
    loss that is a mean over them) of ``loader``'s mini-batches through this process's ``stages``, in
    chain order, the activations going to the other processes' stages over ``comm`` (None: every
    stage is here). ``first_chain``: a bidirectional run's stages 0 .. ``last`` are the model once.
    Summed in mini-batch order, as :class:`Scores` sums an evaluation in the bubbles: the same bits."""
    count, values = 0, []
    final = next((stage for stage in stages if stage.index == last), None)  # None: on another process
    for j, (inputs, target) in enumerate(loader):
        output = forward_through(comm, stages, -1 - j, inputs, target, last, first_chain)
        if final is not None:
            with final.autocast():
                values.append((score(output, to_device(target, final.device)), weight(inputs, target)))
        count += weight(inputs, target)
    if comm is not None:
        comm.flush()
    if count == 0:
        raise ValueError("the evaluation loader yielded no mini-batches")
    return sum(float(v) * n for v, n in values), count


def forward_through(comm: Optional[PipeComm], stages: List[Stage], ident: int, inputs: Any, target: Any,
                    last: int, first_chain: bool = False, autocast: bool = True) -> Optional[Any]:
    """One forward of ``inputs`` through this process's ``stages`` (in chain order, the other
    processes' stages between them over ``comm``, as message ``ident``: an evaluation's own
    numbers on the links, below 0): stage ``last``'s output on its process, None elsewhere
    (``target``: the last stage's labels, for a model that computes its own loss; ``autocast``:
    :func:`run_stage`'s; without it the messages' layouts are agreed apart: their dtypes are not
    those of the training's messages of the same input shapes)."""
    held = {stage.index for stage in stages}
    key = None
    if comm is not None:
        travels = (lambda boundary, microbatch: boundary < last) if first_chain else None
        key = signature((inputs, target, 1.0))
        key = key if autocast else ("without autocast", *key)
        comm.expect_more([(ident, key)], [], travels)  # on each link into this process's stages
    value, output = inputs, None
    for stage in stages:  # this process's chunks in chain order; the others between them
        k = stage.index
        if k > 0 and (k - 1) not in held:
            value = comm.recv("activation", ident, key, stage=k)
        value = run_stage(stage, value, target if k == last else None, autocast)
        if k == last:
            output = value
        if k < last and (k + 1) not in held:
            comm.send("activation", ident, key, value, stage=k)
    if comm is not None:
        comm.poll()
    return output


class PipelinedModel(torch.nn.Module):
    """The trained model as one module under torchrun, for ``Pipeline.evaluate_model``: a call
    on the process of the model's last stage (``source``, a pipeline rank) hands its inputs to
    every process of the pipeline, which runs them through its stages on their devices as
    training does (:func:`forward_through`, the activations over the links), and returns the
    output on the CPU (as ``world.OnStageDevices`` returns it). The other processes
    :meth:`serve` those calls meanwhile: nothing of the model is copied anywhere. The stages run
    as the caller has put them (the Pipeline: in eval mode, a traced model's eval-mode graph),
    whatever this module's ``training`` flag. A model that computes its own loss is called with
    its labels among its keyword inputs (``model(**batch)``): they go to its last stage."""

    def __init__(self, comm: PipeComm, stages: List[Stage], last: int, source: int,
                 first_chain: bool = False) -> None:
        super().__init__()
        self._comm, self._stages, self._last, self._source = comm, stages, last, source
        self._first_chain = first_chain
        self._takes_target = any(s.takes_target for s in stages if s.index == last)
        self._calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._comm.rank != self._source:
            raise RuntimeError(f"the evaluation runs on pipeline rank {self._source}; the others serve it")
        inputs = kwargs if kwargs else args[0] if len(args) == 1 else args
        inputs = on_host(inputs)  # (every process reads them: host tensors pickle alike everywhere)
        if self._takes_target and (not isinstance(inputs, dict) or LABELS not in inputs):
            raise ValueError(f"this model computes its loss from labels (no loss_fn): call it as "
                             f"model(**batch) with batch['{LABELS}'] in evaluate_model's function, "
                             f"or give the Pipeline loss_fn=fn(output, target)")
        broadcast(("forward", inputs), self._comm, self._source, "handing the evaluation's inputs on")
        return on_host(self._through(inputs))

    def run(self, evaluate: Callable[[torch.nn.Module], float]) -> float:
        """``evaluate(self)`` on the source process; its value (or its failure) reaches the others."""
        try:
            value = float(evaluate(self))
        except BaseException as error:
            broadcast(("failed", f"{type(error).__name__}: {error}"), self._comm, self._source,
                      "reporting the evaluation's failure")
            raise
        broadcast(("done", value), self._comm, self._source, "sharing the evaluation")
        self._comm.flush()
        return value

    def serve(self) -> float:
        """Run every call the source makes until its evaluation ends; its value."""
        while True:
            kind, payload = broadcast(None, self._comm, self._source, "waiting for the evaluation's next call")
            if kind == "done":
                self._comm.flush()
                return float(payload)
            if kind == "failed":
                raise RuntimeError(f"evaluate_model's function failed on pipeline rank {self._source}: {payload}")
            self._through(payload)

    def _through(self, inputs: Any) -> Any:
        target = inputs[LABELS] if self._takes_target else None  # (only the last stage reads it)
        self._calls += 1
        return forward_through(self._comm, self._stages, -self._calls, inputs, target, self._last,
                               self._first_chain, autocast=False)  # (the model whole runs without it)


def on_host(value: Any) -> Any:
    """``value`` with its tensors on the CPU: a tensor, a tuple, or a dict (its own class kept,
    such as a ``transformers`` model output)."""
    if isinstance(value, dict):
        moved = copy.copy(value)
        for key, item in value.items():
            moved[key] = on_host(item)
        return moved
    if isinstance(value, tuple):
        return tuple(on_host(item) for item in value)
    return to_device(value, torch.device("cpu"))


class Scores:
    """An evaluation's scores per micro-batch; :meth:`mean` is the mean over the samples, summed in
    micro-batch order (values read back only then: an accelerator is not waited for meanwhile)."""

    def __init__(self) -> None:
        self._values: Dict[int, Tuple[Any, int]] = {}

    def add(self, index: int, value: Any, samples: int) -> None:
        self._values[index] = (value, samples)

    def __len__(self) -> int:
        return len(self._values)

    def mean(self) -> float:
        total, count = 0.0, 0
        for index in sorted(self._values):
            value, samples = self._values[index]
            total += float(value) * samples
            count += samples
        if count == 0:
            raise ValueError("the evaluation loader yielded no mini-batches")
        return total / count


class ForwardOnly:
    """The ``E`` micro-batches of an evaluation, or of a user's forward-only work, over
    ``stages`` (the model's, in chain order): micro-batch j is ``items[j]``, an
    ``(inputs, target)`` pair run whole, in ``eval_mode(stage)``. At the last stage
    ``on_output(j, output)`` receives the output (a user's work), or else ``score(output,
    target)`` gives the mini-batch's value. ``on_done(value)`` is called once the last stage has
    run every micro-batch, or, ``at_drain``, when :meth:`deliver` gives it at the segment's drain
    (every rank at once, under torchrun). Built while the pipeline is drained: the stages'
    buffers are copied then (a synchronous stage's weights do not change before its next update,
    which the schedule runs after its E's)."""

    def __init__(self, items: Sequence[Tuple[Any, Any]], eval_mode: Callable[[Stage], ContextManager[Any]],
                 stages: Sequence[Stage], *, score: Optional[Callable[[Any, Any], Any]] = None,
                 on_output: Optional[Callable[[int, Any], None]] = None,
                 on_done: Optional[Callable[[Optional[float]], None]] = None, at_drain: bool = False,
                 weight: Weight = samples) -> None:
        if not items:
            raise ValueError("the evaluation loader yielded no mini-batches" if on_output is None
                             else "no inputs to run forward in the bubbles")
        self.items = list(items)
        self.score = score
        self.weight = weight  #: a mini-batch's weight in the mean (scored_forward's)
        self.on_output = on_output
        self.eval_mode = eval_mode
        self.on_done = on_done
        self.scores = Scores()
        self.value: Optional[float] = None  #: the evaluation's mean, once every micro-batch is scored
        self.done = False                   #: the last stage has run every micro-batch
        self.at_drain = at_drain
        self._outputs = 0
        self._reported = False
        self._buffers = {}
        for stage in stages:
            with torch.no_grad(), eval_mode(stage):
                self._buffers[stage.index] = [b.detach().clone() for b in _frozen(stage)]

    def __len__(self) -> int:
        return len(self.items)

    def inputs(self, index: int) -> Any:
        """Micro-batch ``index``'s inputs (what the first stage's E reads)."""
        return self.items[index][0]

    def forward(self, stage: Stage, index: int, inputs: Any) -> Optional[Any]:
        """``stage``'s forward of micro-batch ``index``: the output to hand to the next stage,
        or, at the last stage, None once the micro-batch is scored."""
        with torch.no_grad(), self.eval_mode(stage), self._eval_point_buffers(stage):
            inputs_of, target = self.items[index]
            output = run_stage(stage, inputs, target if stage.is_last else None)
            if not stage.is_last:
                return output
            if self.on_output is not None:
                self.on_output(index, output)
                self._outputs += 1
            else:
                with stage.autocast():
                    value = self.score(output, to_device(target, stage.device))
                self.scores.add(index, value, self.weight(inputs_of, target))
        if max(self._outputs, len(self.scores)) == len(self.items):
            self.done = True
            self.value = self.scores.mean() if self.on_output is None else None
            if not self.at_drain:
                self.deliver(self.value)
        return None

    def run_drained(self, world: Any, stages: Sequence[Stage],
                    evaluating: Callable[[], ContextManager[Any]]) -> None:
        """The work no schedule came to hold, now, on the drained pipeline: an evaluation as
        ``world.evaluate`` runs one (pipelined under torchrun, every rank), in ``evaluating()``;
        a user's work through ``stages``, every stage in this process."""
        if self.on_output is None:
            with torch.no_grad(), evaluating():
                self.deliver(world.evaluate(stages, self.items, self.score, self.weight))
            return
        if world.processes > 1:
            raise RuntimeError("under torchrun forward_in_bubbles runs in the next mini-batch's bubbles: "
                               "step() once before flush()")
        for index in range(len(self.items)):
            value = self.inputs(index)
            for stage in stages:
                value = self.forward(stage, index, value)
        self.deliver(self.value)

    def plan(self, schedule: Schedule, samples_per_micro: float) -> FillPlan:
        """Where ``schedule`` (a segment's first two mini-batches: all a plan reads) runs these
        micro-batches, planned against nominal costs: a backward twice a forward, an evaluation
        forward in proportion to its samples against a training micro-batch's
        ``samples_per_micro`` (deterministic: the same plan whatever the machine's timing)."""
        costs = Costs.uniform(schedule.num_stages, forward=1.0, backward=2.0, weight=1.0)
        mean_samples = sum(batch_size(inputs) for inputs, _ in self.items) / len(self.items)
        costs.evaluation = [mean_samples / samples_per_micro] * schedule.num_stages
        return plan_fill(schedule, len(self.items), costs)

    def deliver(self, value: Optional[float]) -> None:
        """The evaluation's value, as the drain shares it (under torchrun only the last stage's
        process scored it) or as a drained evaluation found it: recorded and reported, once."""
        self.value = value
        if not self._reported:
            self._reported = True
            if self.on_done is not None:
                self.on_done(value)

    @contextlib.contextmanager
    def _eval_point_buffers(self, stage: Stage) -> Iterator[None]:
        """The stage's buffers (and the tied weights it reads and another stage owns) as they
        were when the evaluation was asked for, for one pass. ``.data`` is swapped, not copied
        into: a copy would bump the version counters that a pending training backward checks."""
        saved = self._buffers.get(stage.index)
        if not saved:
            yield
            return
        live = _frozen(stage)
        if len(live) != len(saved):
            raise RuntimeError(f"stage {stage.index}'s module has {len(live)} buffers, "
                               f"{len(saved)} when the evaluation began")
        held: List[torch.Tensor] = [b.data for b in live]
        for buffer, copy in zip(live, saved):
            buffer.data = copy
        try:
            yield
        finally:
            for buffer, data in zip(live, held):
                buffer.data = data


def _frozen(stage: Stage) -> List[torch.Tensor]:
    """What an evaluation in the bubbles keeps as it was when asked for, beside the weights the
    stage's own update waits for: its buffers, and a tied weight another stage owns (in one
    process the owner's very tensor, which the owner's update changes before this stage's)."""
    tied = stage.tied.read_not_owned() if stage.tied is not None else []
    return list(stage.module.buffers()) + list(tied)


class BubbleWork:
    """The forward-only work a Pipeline hands its segments: at most one piece waiting (asked for
    while drained) and the one the open segment's schedule carries, with its plan."""

    def __init__(self) -> None:
        self.waiting: Optional[ForwardOnly] = None
        self.running: Optional[ForwardOnly] = None
        self.plan: Optional[FillPlan] = None  #: where the open segment's schedule runs ``running``

    def queue(self, make: Callable[[], ForwardOnly]) -> None:
        """``make()``'s work waits for the next segment (one piece at a time)."""
        if self.waiting is not None:
            raise RuntimeError("forward-only work is already waiting for the next mini-batch's bubbles; "
                               "feed one (step) or flush() first")
        self.waiting = make()

    def open(self, first_two: Callable[[], Schedule], samples_per_micro: float) -> Dict[str, Any]:
        """A segment opens: the waiting work goes into its schedule (planned on ``first_two()``,
        its first two mini-batches); what to give the executor."""
        if self.waiting is None:
            return {}
        self.running, self.waiting = self.waiting, None
        self.plan = self.running.plan(first_two(), samples_per_micro)
        return {"forward_only": self.running}

    def carried(self, schedule: Schedule) -> Schedule:
        """The open segment's ``schedule`` with the work it carries."""
        return self.plan.apply(schedule) if self.plan is not None else schedule

    def drained(self, share: Optional[Callable[[Optional[float]], Optional[float]]]) -> None:
        """The segment has ended: where only the last stage's process has the value (torchrun),
        ``share(value)`` gives it to every rank (None: a segment cut off by an error); the next
        segment carries nothing of it."""
        work, self.running, self.plan = self.running, None, None
        if work is not None and work.at_drain and share is not None:
            work.deliver(share(work.value))


class StageEvalMode:
    """``mode(stage)``: a context in which ``stage``'s module is in eval mode, its modes put back
    after. Each module's flag is set directly, except where a class overrides ``train``: the E
    actions switch modes twice per stage and mini-batch, and ``train()``'s recursion costs more
    than a small stage's forward."""

    def __init__(self) -> None:
        self._modules: Dict[int, List[Tuple[Any, bool]]] = {}  # stage -> (module, overrides train)

    @contextlib.contextmanager
    def __call__(self, stage: Stage) -> Iterator[None]:
        modules = self._modules.get(stage.index)
        if modules is None or (modules and modules[0][0] is not stage.module):
            modules = self._modules[stage.index] = [
                (m, type(m).train is not torch.nn.Module.train) for m in stage.module.modules()]
        modes = [m.training for m, _ in modules]
        for m, own in modules:
            if own:
                m.train(False)
            else:
                m.training = False
        try:
            yield
        finally:
            for (m, own), mode in zip(modules, modes):
                if own:
                    m.train(mode)
                else:
                    m.training = mode


def check_fills(fills_bubbles: bool, method: str, synchronous: bool, schedule: Schedule) -> None:
    """Raise ValueError, naming the fix, unless forward-only work can fill ``schedule``'s bubbles
    (``method``'s, in a world that ``fills_bubbles``)."""
    if not fills_bubbles:
        raise ValueError("evaluation in the bubbles runs on one replica of the pipeline (its last stage's "
                         "value is the evaluation's); with data_parallel replicas evaluate drained "
                         "(eval_in_bubbles=False)")
    if not synchronous:
        raise ValueError(f"{method} is asynchronous: no stretch of its schedule holds one update's "
                         f"weights on every stage; evaluate drained (eval_in_bubbles=False)")
    check_fillable(schedule)
