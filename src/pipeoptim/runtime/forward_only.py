"""Forward-only work: an evaluation, or a user's forward passes, as the ``E`` actions of a
schedule that the one executor walks (``runtime/executor.py``).

In the bubbles of a training schedule (docs/architecture.md, "Evaluation in the bubbles"), or
alone on a drained pipeline (``schedules/fill.forward_alone``: the drained evaluation, in one
process or pipelined over the processes of a torchrun job, and :class:`PipelinedModel`, which
runs a user's evaluation function there, each call of the model through the stages): the same
passes, to the bit. In the bubbles a stage is in eval mode only for the span of each pass
(dropout then draws no random numbers from the training forwards' streams), on the buffers it
held when the evaluation was asked for."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

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


#: where a user's evaluation reads the model's inputs and outputs (a tensor, a tuple, a dict or a
#: ``transformers`` model output, its own class kept): every process reads host tensors alike
HOST = torch.device("cpu")

#: ``fn(inputs, target) -> int``: how much a mini-batch's value weighs in an evaluation's mean
Weight = Callable[[Any, Any], int]


class PipelinedModel(torch.nn.Module):
    """The trained model as one module under torchrun, for ``Pipeline.evaluate_model``: a call
    on the process of the model's last stage (``source``, a pipeline rank) hands its inputs to
    every process of the pipeline, whose executor (``executor_for(work)``: forward-only work
    alone) runs them through its stages on their devices, the activations over the links, and
    returns the output on the CPU (as ``world.OnStageDevices`` returns it). The other processes
    :meth:`serve` those calls meanwhile: nothing of the model is copied anywhere. The stages run
    as the caller has put them (the Pipeline: in eval mode, a traced model's eval-mode graph),
    whatever this module's ``training`` flag, without autocast (as the model whole runs). A
    model that computes its own loss is called with its labels among its keyword inputs
    (``model(**batch)``): they go to its last stage."""

    def __init__(self, comm: PipeComm, stages: List[Stage], source: int,
                 executor_for: Callable[["ForwardOnly"], Any]) -> None:
        super().__init__()
        self._comm, self._source = comm, source
        self._takes_target = any(s.takes_target for s in stages)  # (a last stage)
        self._outputs: Dict[int, Any] = {}
        self._executor = executor_for(ForwardOnly(on_output=self._outputs.__setitem__, autocast=False))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._comm.rank != self._source:
            raise RuntimeError(f"the evaluation runs on pipeline rank {self._source}; the others serve it")
        inputs = kwargs if kwargs else args[0] if len(args) == 1 else args
        inputs = to_device(inputs, HOST)  # (every process reads them: host tensors pickle alike everywhere)
        if self._takes_target and (not isinstance(inputs, dict) or LABELS not in inputs):
            raise ValueError(f"this model computes its loss from labels (no loss_fn): call it as "
                             f"model(**batch) with batch['{LABELS}'] in evaluate_model's function, "
                             f"or give the Pipeline loss_fn=fn(output, target)")
        broadcast(("forward", inputs), self._comm, self._source, "handing the evaluation's inputs on")
        self._through(inputs)
        return to_device(self._outputs.popitem()[1], HOST)

    def run(self, evaluate: Callable[[torch.nn.Module], float]) -> float:
        """``evaluate(self)`` on the source process; its value (or its failure) reaches the others."""
        try:
            value = float(evaluate(self))
        except BaseException as error:
            broadcast(("failed", f"{type(error).__name__}: {error}"), self._comm, self._source,
                      "reporting the evaluation's failure")
            raise
        broadcast(("done", value), self._comm, self._source, "sharing the evaluation")
        self._executor.finish()
        return value

    def serve(self) -> float:
        """Run every call the source makes until its evaluation ends; its value."""
        while True:
            kind, payload = broadcast(None, self._comm, self._source, "waiting for the evaluation's next call")
            if kind == "done":
                self._executor.finish()
                return float(payload)
            if kind == "failed":
                raise RuntimeError(f"evaluate_model's function failed on pipeline rank {self._source}: {payload}")
            self._through(payload)

    def _through(self, inputs: Any) -> None:
        target = inputs[LABELS] if self._takes_target else None  # (only the last stage reads it)
        self._executor.feed_forward_only(inputs, target)


#: the refusal of an evaluation (or forward-only work) given nothing to run
NO_BATCHES = "the evaluation loader yielded no mini-batches"


class Scores:
    """An evaluation's scores per micro-batch; :meth:`mean` is the mean over the samples, summed in
    micro-batch order (values read back only then: an accelerator is not waited for meanwhile)."""

    def __init__(self) -> None:
        self._values: Dict[int, Tuple[Any, int]] = {}

    def add(self, index: int, value: Any, samples: int) -> None:
        self._values[index] = (value, samples)

    def __len__(self) -> int:
        return len(self._values)

    def sums(self) -> Tuple[float, int]:
        """(the sum over the samples, the samples), summed in micro-batch order."""
        total, count = 0.0, 0
        for index in sorted(self._values):
            value, samples = self._values[index]
            total += float(value) * samples
            count += samples
        return total, count

    def mean(self) -> float:
        total, count = self.sums()
        if count == 0:
            raise ValueError(NO_BATCHES)
        return total / count


class ForwardOnly:
    """The ``E`` micro-batches of an evaluation, or of a user's forward-only work: micro-batch j
    is ``items[j]``, an ``(inputs, target)`` pair run whole (with ``autocast``: each stage's, as
    training runs it; without: as the model whole runs), or, given none, the pairs :meth:`add`
    brings as they come (work alone, on a drained pipeline). At the last stage ``on_output(j,
    output)`` receives the output (a user's work), or else ``score(output, target)`` gives the
    mini-batch's value, weighing ``weight(inputs, target)`` samples.

    In the bubbles of a training schedule, each pass runs in ``eval_mode(stage)`` on the buffers
    ``stages`` (the model's) held when the work was built, the pipeline drained (a synchronous
    stage's weights do not change before its next update, which the schedule runs after its
    E's); ``on_done(value)`` is called once the last stage has run every micro-batch, or,
    ``at_drain``, when :meth:`deliver` gives it at the segment's drain (every rank at once,
    under torchrun)."""

    def __init__(self, items: Sequence[Tuple[Any, Any]] = (),
                 eval_mode: Optional[Callable[[Stage], ContextManager[Any]]] = None, stages: Sequence[Stage] = (),
                 *, score: Optional[Callable[[Any, Any], Any]] = None,
                 on_output: Optional[Callable[[int, Any], None]] = None,
                 on_done: Optional[Callable[[Optional[float]], None]] = None, at_drain: bool = False,
                 weight: Weight = samples, autocast: bool = True) -> None:
        self.items: List[Optional[Tuple[Any, Any]]] = list(items)
        if stages and not self.items:  # (in the bubbles: given whole)
            raise ValueError(NO_BATCHES if on_output is None else "no inputs to run forward in the bubbles")
        self.score = score
        self.weight = weight  #: a mini-batch's weight in the mean
        self.on_output = on_output
        self.eval_mode = eval_mode or (lambda stage: contextlib.nullcontext())
        self.on_done = on_done
        self.autocast = autocast
        self.scores = Scores()
        self.value: Optional[float] = None  #: the evaluation's mean, once every micro-batch is scored
        self.at_drain = at_drain
        self._given = len(self.items)  # (work alone: none; it is never complete before its end)
        self._outputs = 0
        self._reported = False
        self._buffers = {}
        for stage in stages:
            with torch.no_grad(), self.eval_mode(stage):
                self._buffers[stage.index] = [b.detach().clone() for b in _frozen(stage)]

    def __len__(self) -> int:
        return len(self.items)

    def add(self, inputs: Any, target: Any) -> int:
        """One more micro-batch of work alone; its number."""
        self.items.append((inputs, target))
        return len(self.items) - 1

    def spent(self, index: int) -> None:
        """Micro-batch ``index`` has run through every stage of this process: dropped."""
        self.items[index] = None

    def key(self, index: int) -> Any:
        """The key of micro-batch ``index``'s messages (``wire.signature``; their layouts differ
        without autocast)."""
        inputs, target = self.items[index]
        key = signature((inputs, target, 1.0))
        return key if self.autocast else ("without autocast", *key)

    def inputs(self, index: int) -> Any:
        """Micro-batch ``index``'s inputs (what the first stage's E reads)."""
        return self.items[index][0]

    def forward(self, stage: Stage, index: int, inputs: Any) -> Optional[Any]:
        """``stage``'s forward of micro-batch ``index``: the output to hand to the next stage,
        or, at the last stage, None once the micro-batch is scored."""
        with torch.no_grad(), self.eval_mode(stage), self._eval_point_buffers(stage):
            inputs_of, target = self.items[index]
            with stage.autocast() if self.autocast else contextlib.nullcontext():
                value = to_device(inputs, stage.device)  # (a model computing its own loss: with its labels)
                output = stage.module(value, to_device(target, stage.device)) if stage.takes_target \
                    else stage.module(value)
            if not stage.is_last:
                return output
            if self.on_output is not None:
                self.on_output(index, output)
                self._outputs += 1
            else:
                with stage.autocast():
                    value = self.score(output, to_device(target, stage.device))
                self.scores.add(index, value, self.weight(inputs_of, target))
        if max(self._outputs, len(self.scores)) == self._given:
            self.value = self.scores.mean() if self.on_output is None else None
            if not self.at_drain:
                self.deliver(self.value)
        return None

    def run_drained(self, world: Any, stages: Sequence[Stage],
                    evaluating: Callable[[], ContextManager[Any]]) -> None:
        """The work no schedule came to hold, now, on the drained pipeline: an evaluation as
        ``world.evaluate`` runs one (pipelined under torchrun, every rank), in ``evaluating()``;
        a user's work through ``stages`` (every stage in this process) as work alone."""
        if self.on_output is None:
            with torch.no_grad(), evaluating():
                self.deliver(world.evaluate(stages, self.items, self.score, self.weight))
            return
        if world.processes > 1:
            raise RuntimeError("under torchrun forward_in_bubbles runs in the next mini-batch's bubbles: "
                               "step() once before flush()")
        items, self.items = self.items, []
        world.run_alone(stages, self, items)
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
