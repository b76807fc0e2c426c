"""Plan a pipeline run from a profile: partition, method and micro-batch count (BaPipe-style),
with the equal-time study's advice.

:func:`make_plan` does what ``pipeoptim plan --help`` says (:mod:`pipeoptim.cli.plan`) for a
task's model; :func:`plan_model` the same for any model with one mini-batch of its data (an
``nn.Sequential``, a traced or ``transformers`` model: ``pipeoptim plan --model-fn``). The engine
(:mod:`pipeoptim.planning`) profiles, times the splits in turns and predicts every method and
micro-batch count (:mod:`pipeoptim.throughput`); this module adds each candidate's predicted
time to a model as good as synchronous training's and the recommendation
(:mod:`pipeoptim.lab.plan_targets`: the equal-time study's ratios of updates to the target and its
advice, the tables ``pipeoptim compare`` and the README read). Where no study covers the case
(another task, model, batch size or optimizer, a model of the user's own) the recommendation
follows the engine's rule for an unstudied model (:data:`pipeoptim.planning.RULE`). With the
``time`` partitioner the split is recomputed on each micro-batch count's profile; ``partitions``
in the plan reports the three splits of the whole mini-batch. ``pipeoptim train --plan FILE``
reads a task's plan (:func:`load_plan`)."""
from __future__ import annotations

import json
import math
import re
import textwrap
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..errors import option
from ..methods import get_method, method_names
from ..options import BY_NAME
from ..plan_defaults import DEFAULT_METHODS, DEFAULT_MICROBATCHES
from ..planning import assemble, check_options, model_units, survey
from ..recommendation import RULE as UNSTUDIED_RULE
from ..recommendation import candidate_name, recommend
from ..throughput import candidate_problem
from .plan_targets import RULE, annotate, name_width, notes, target_table

PLAN_FORMAT = "pipeoptim-plan"
PLAN_VERSION = 1
RECOMMENDATION_RULE = RULE

#: plan field -> the `pipeoptim train` option (argparse destination) it sets
TRAIN_FIELDS = {"task": "task", "model": "model", "batch_size": "batch_size", "stages": "stages",
                "partition": "partition", "method": "method", "microbatches": "micro_batches"}


# -- parsing ---------------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12,
          "tb": 1e12, "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4}


def parse_bytes(text: Any, what: str = "value") -> float:
    """``"2GiB"``, ``"500MB"``, ``"1e9"`` or a number -> bytes (float). Must be positive."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{what} must be a number of bytes such as 1e9, 500MB or 2GiB, got {text!r}")
        try:
            value = float(match.group(1)) * _UNITS[unit]
        except ValueError:
            raise ValueError(f"{what} must be a number of bytes such as 1e9, 500MB or 2GiB, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{what} must be positive, got {text}")
    return value


def parse_speeds(text: Optional[str], stages: int) -> Optional[List[float]]:
    """``"1,2"`` -> [1.0, 2.0], one positive factor per stage (None stays None)."""
    if text is None:
        return None
    try:
        speeds = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--speeds must be comma-separated numbers, got {text!r}") from None
    if len(speeds) != stages:
        raise ValueError(f"--speeds has {len(speeds)} values but --stages is {stages} (give one per stage)")
    if any(not (s > 0 and math.isfinite(s)) for s in speeds):
        raise ValueError(f"--speeds must all be positive, got {text!r}")
    return speeds


def parse_int_list(text: Any, what: str) -> List[int]:
    if isinstance(text, (list, tuple)):
        values = list(text)
    else:
        try:
            values = [int(x) for x in str(text).split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or any(not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"{what} must be positive integers, got {text!r}")
    return values


# -- the whole plan --------------------------------------------------------------------------------

def make_plan(*, task: str, model: Optional[str] = None, stages: int, device: str = "cpu",
              speeds: Optional[Sequence[float]] = None, bandwidth: Optional[float] = None,
              batch_size: Optional[int] = None, methods: Sequence[str] = DEFAULT_METHODS,
              microbatches: Sequence[int] = DEFAULT_MICROBATCHES, memory_limit: Optional[float] = None,
              partitioner: str = "uniform", scaling: str = "measure", batches: Optional[int] = None,
              limit: Optional[int] = None, seed: int = 0, optimizer: str = "adamw",
              warmup: int = 2, repeats: int = 5, max_rounds: Optional[int] = None, statistic: str = "min",
              stage_timing: str = "measured", tie: float = 0.02, tensor_parallel: int = 1, log=None) -> Dict[str, Any]:
    """Profile ``task``'s ``model``, partition it, predict every (method, micro-batches) and
    recommend one (see the module docstring). Returns the plan as a JSON-ready dict.
    ``tensor_parallel``: each stage on T processes, split by the model's plan (:func:`plan_model`).

    ``batches``: mini-batches per predicted run (default: one epoch of the loaded data).
    ``speeds``: one relative speed per stage (device k runs stage k). ``bandwidth``: bytes per
    second of each link (None: free transfers). ``memory_limit``: bytes per stage."""
    from .tasks import get_task

    check_options(stages, methods, microbatches, speeds, bandwidth, memory_limit, partitioner, tie, stage_timing)
    for name, value in (("batch_size", batch_size), ("batches", batches), ("limit", limit)):
        if value is not None and value < 1:
            raise ValueError(f"{option(name)} must be at least 1, got {value}")
    the_task = get_task(task)
    model_name = model or the_task.default_model
    if model_name not in the_task.model_names():
        raise ValueError(f"task {task} has no model {model_name!r}; choose one of: "
                         f"{', '.join(the_task.model_names())}")
    if tensor_parallel != 1:
        from .experiment import check_tensor_planned

        check_tensor_planned(task, model_name, tensor_parallel, "plan")
    batch_size = batch_size or the_task.default_batch_size
    data = the_task.load(batch_size=batch_size, limit=limit, seed=seed)
    if not data.train:
        raise ValueError("the task gave no training mini-batch")
    net = the_task.build_model(model_name, data, seed=seed)
    plan = plan_model(net, data.train[0], the_task.loss, stages=stages, device=device, speeds=speeds,
                      bandwidth=bandwidth, batch_size=batch_size, methods=methods, microbatches=microbatches,
                      memory_limit=memory_limit, partitioner=partitioner, scaling=scaling,
                      batches=batches or len(data.train), seed=seed, optimizer=optimizer,
                      lr=the_task.default_lr.get(optimizer, 1e-3), warmup=warmup, repeats=repeats,
                      max_rounds=max_rounds, statistic=statistic, stage_timing=stage_timing, tie=tie, log=log,
                      task=task, model_name=model_name, tensor_parallel=tensor_parallel)
    plan["settings"]["limit"] = limit
    return plan


def plan_model(net: torch.nn.Module, batch: Any, loss: Optional[Callable[[Any, Any], torch.Tensor]], *,
               stages: int, batch_size: Optional[int] = None, batches: int = 100, device: str = "cpu",
               speeds: Optional[Sequence[float]] = None, bandwidth: Optional[float] = None,
               methods: Sequence[str] = DEFAULT_METHODS, microbatches: Sequence[int] = DEFAULT_MICROBATCHES,
               memory_limit: Optional[float] = None, partitioner: str = "uniform", scaling: str = "measure",
               seed: int = 0, optimizer: str = "adamw", lr: float = 1e-3, warmup: int = 2, repeats: int = 5,
               max_rounds: Optional[int] = None, statistic: str = "min", stage_timing: str = "measured",
               tie: float = 0.02, log=None, task: Optional[str] = None,
               model_name: Optional[str] = None, tensor_parallel: int = 1) -> Dict[str, Any]:
    """The plan (as :func:`make_plan`'s) of any model: ``net`` an ``nn.Sequential`` or a module
    the Pipeline traces, ``batch`` one mini-batch of its data, ``(inputs, target)`` with
    ``loss(output, target)``, or a dict of keyword tensors with ``"labels"`` (``loss`` None: the
    model computes its own loss); ``batch_size`` its rows (default: the inputs' first dimension),
    ``batches`` the mini-batches per predicted run, ``optimizer`` and ``lr`` the optimizer whose
    update time and state are profiled. ``task`` and ``model_name``: the lab's task and model the
    net is (what says whether the equal-time study covers it); without them the net is a model of
    the user's own, for which the study has no ratio of updates to the target: the fastest
    synchronous candidate is recommended, and the fastest asynchronous one named as the one to try.
    ``tensor_parallel`` = T: every candidate with each stage on T processes, split by the model's
    own plan (its ``_tp_plan``), priced as :mod:`pipeoptim.throughput` says; ``plan["tensor"]``
    holds what was measured."""
    from .optimizers import make_optimizer

    methods, microbatches, speeds = check_options(stages, methods, microbatches, speeds, bandwidth, memory_limit,
                                                  partitioner, tie, stage_timing)
    if batches < 1:
        raise ValueError(f"{option('batches')} must be at least 1, got {batches}")
    units = model_units(net, batch, loss)
    if model_name is not None:
        units.name = model_name
    units.batch_size = batch_size or units.batch_size
    tensor = tensor_split(net, units, tensor_parallel, repeats) if tensor_parallel != 1 else None
    found = survey(units, stages=stages, batches=batches, device=device, speeds=speeds, bandwidth=bandwidth,
                   methods=methods, microbatches=microbatches, memory_limit=memory_limit, partitioner=partitioner,
                   scaling=scaling, seed=seed, optimizer=make_optimizer(optimizer, lr), optimizer_name=optimizer,
                   warmup=warmup, repeats=repeats, max_rounds=max_rounds, statistic=statistic,
                   stage_timing=stage_timing, log=log, tensor=tensor)
    candidates = found["candidates"]
    study = annotate(candidates, task=task, model=model_name, batch_size=units.batch_size, optimizer=optimizer,
                     stages=stages)
    best = recommend(candidates, memory_limit, tie, order=methods, prefer=study["advised_variant"])
    said = notes(study, candidates, best, task=task, model=model_name, stages=stages, optimizer=optimizer,
                 stable=(found["measurement"] or {}).get("stable", True))
    settings = {"device": device, "speeds": speeds, "bandwidth": bandwidth, "methods": methods,
                "microbatch_counts": microbatches, "scaling": scaling, "batches": batches, "limit": None,
                "seed": seed, "optimizer": optimizer, "lr": lr, "warmup": warmup, "repeats": repeats,
                "max_rounds": max_rounds, "statistic": statistic, "stage_timing": stage_timing, "tie": tie,
                "tensor_parallel": tensor_parallel}
    rule = (RECOMMENDATION_RULE if study["covered"] else UNSTUDIED_RULE).format(tie=tie)
    plan = assemble(units, found, best, stages=stages, partitioner=partitioner, memory_limit=memory_limit,
                    rule=rule, notes=said, settings=settings)
    if tensor is not None:
        plan["tensor"] = tensor.to_dict()
    return {"format": PLAN_FORMAT, "version": PLAN_VERSION, "task": task, "model": model_name,
            "model_class": type(net).__name__, **plan, "study": study}


def tensor_split(net: torch.nn.Module, units: Any, tensor: int, repeats: int = 3) -> Any:
    """What splitting ``net``'s planned layers over ``tensor`` processes does (its own plan,
    ``_tp_plan``), measured (:func:`pipeoptim.planning.tensor_layers`); refused, with the fix,
    where there is none."""
    from ..planning import tensor_layers
    from ..tensor_plan import resolve_plan

    if not isinstance(tensor, int) or tensor < 1:
        raise ValueError(f"--tensor-parallel must be at least 1, got {tensor}")
    try:
        plan = resolve_plan(net, None, tensor)
    except ValueError as error:
        if "carries no plan" not in str(error):
            raise
        raise ValueError(f"--tensor-parallel {tensor} prices the layers a model's plan names, and "
                         f"{type(net).__name__} carries none: give it one in your --model-fn function "
                         f"(model._tp_plan = {{'module name pattern': 'colwise' or 'rowwise', ...}}: the first of "
                         f"two Linear layers 'colwise', the second 'rowwise'), or drop --tensor-parallel") from None
    return tensor_layers(units, plan, tensor, repeats)


def write_plan(plan: Dict[str, Any], path: Path) -> Path:
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=2))
    return path


def load_plan(path: Any) -> Dict[str, Any]:
    """Read a plan file and return the fields ``pipeoptim train --plan FILE`` sets, validated,
    keyed by the train command's option names (argparse destinations):

    ``task`` (--task), ``model`` (--model), ``batch_size`` (--batch-size), ``stages``
    (--stages), ``partition`` (--partition, layers per stage), ``method`` (--method),
    ``micro_batches`` (--micro-batches); and the method's options the plan sets (``error_feedback``,
    --error-feedback, for a ``+ef`` recommendation). Every problem is a one-line ValueError."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"cannot read plan {path}: {error.strerror or error}") from None
    try:
        plan = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"plan {path} is not valid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT:
        raise ValueError(f"{path} is not a pipeoptim plan (no \"format\": \"{PLAN_FORMAT}\"); "
                         f"write one with `pipeoptim plan --out FILE`")
    if plan.get("version") != PLAN_VERSION:
        raise ValueError(f"plan {path} has version {plan.get('version')!r}; "
                         f"this pipeoptim reads version {PLAN_VERSION}")
    if plan.get("task", "") is None:
        raise ValueError(f"plan {path} is of a model of your own (pipeoptim plan --model-fn), which pipeoptim "
                         f"train does not build: run it with {pipeline_call(plan)}")
    missing = [k for k in TRAIN_FIELDS if k not in plan]
    if missing:
        raise ValueError(f"plan {path} lacks {', '.join(missing)}")

    def bad(field: str, why: str) -> ValueError:
        return ValueError(f"plan {path}: {field} {why}, got {plan.get(field)!r}")

    from .tasks import task_names

    if plan["task"] not in task_names():
        raise bad("task", f"must be one of {', '.join(task_names())}")
    if not isinstance(plan["model"], str) or not plan["model"]:
        raise bad("model", "must be a model name")
    for key in ("batch_size", "stages", "microbatches"):
        if not isinstance(plan[key], int) or isinstance(plan[key], bool) or plan[key] < 1:
            raise bad(key, "must be a positive integer")
    if plan["method"] not in method_names():
        raise bad("method", f"must be one of {', '.join(method_names())}")
    sizes = plan["partition"]
    if (not isinstance(sizes, list) or not sizes
            or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes)):
        raise bad("partition", "must be a list of positive layer counts")
    meth = get_method(plan["method"])
    pieces = meth.pieces_per_rank(meth.chunks)  # a mirrored method's other chunks are replicas
    if len(sizes) != plan["stages"] * pieces:
        raise ValueError(f"plan {path}: partition {sizes} has {len(sizes)} stages but stages is {plan['stages']}"
                         + (f" x {pieces} pieces" if pieces > 1 else ""))
    problem = candidate_problem(plan["method"], plan["stages"], plan["microbatches"], plan["batch_size"],
                                sum(sizes))
    if problem:
        raise ValueError(f"plan {path}: {problem}")
    options = plan.get("options") or {}
    choices = {k: BY_NAME[k].choices for k in meth.options if BY_NAME[k].choices is not None}
    if not isinstance(options, dict) or any(k not in choices or v not in choices[k] for k, v in options.items()):
        raise bad("options", f"must be options {plan['method']} takes, with their values "
                             f"({', '.join(f'{k}: {v}' for k, v in choices.items()) or 'none'})")
    tensor = plan.get("tensor_parallel", 1)
    if not isinstance(tensor, int) or isinstance(tensor, bool) or tensor < 1:
        raise bad("tensor_parallel", "must be a positive integer")
    return {**{dest: plan[key] for key, dest in TRAIN_FIELDS.items()}, **options,
            **({"tensor_parallel": tensor} if tensor > 1 else {})}


def pipeline_call(plan: Dict[str, Any]) -> str:
    """The ``pipeoptim.Pipeline`` call that runs a plan's recommendation (your optimizer, and your
    loss function unless the model computes its own from the batch's labels)."""
    run = plan["pipeline"]
    loss = "" if plan.get("units", {}).get("own_loss") else ", loss_fn=..."
    options = "".join(f", {k}={v!r}" for k, v in {**(plan.get("options") or {}),
                                                   **({"tensor_parallel": run["tensor_parallel"]}
                                                      if "tensor_parallel" in run else {})}.items())
    return (f"Pipeline(model, method={run['method']!r}, stages={run['stages']}, partition={run['partition']}, "
            f"micro_batches={run['micro_batches']}{options}, optimizer=...{loss})")


#: the candidates the command line's short plan lists (``--verbose``: all of them)
SHORT_ROWS = 8


def format_plan(plan: Dict[str, Any], verbose: bool = True) -> str:
    """The plan as text: how the timing went, the candidates by predicted time to target, what the
    study says, the recommendation; ``verbose`` (``pipeoptim plan --verbose``; not verbose: the
    first :data:`SHORT_ROWS` candidates) also the partitions, every candidate's throughput and
    memory, and the rule."""
    shown = plan["model"] or ("nn.Sequential" if plan.get("model_class", "Sequential") == "Sequential"
                              else plan["model_class"])
    units = plan.get("units") or {}
    what = "units" if units.get("traced") else "layers"
    lines = [f"{plan['task'] or 'your model'} / {shown}: {plan['stages']} stages, "
             f"batch {plan['batch_size']}, {plan['settings']['device']}, {plan['settings']['threads']} thread(s)"]
    if units.get("traced"):
        lines.append(f"traced into {units['count']} units, beginning at: {', '.join(units['cut_points'])}")
    lines.append("")
    if verbose:  # the three splits' slowest stages
        lines.append(f"partition   {what} per stage{' ' * (8 - len(what))}        slowest stage ms   cycle ms   "
                     f"slowest/mean   measured slowest stage ms")
        for how, p in plan["partitions"].items():
            measured = p.get("measured_slowest_stage_seconds")
            lines.append(f"{how:<11} {str(p['sizes']):<23} {p['slowest_stage_seconds'] * 1e3:>16.2f}   "
                         f"{p['cycle_seconds'] * 1e3:>8.2f}   {p['imbalance']:>12.2f}   "
                         f"{(f'{measured * 1e3:.2f}' if measured is not None else '-'):>25}")
        lines += ["(slowest stage ms: the profiled layers' sum; measured: the stages timed as a run runs them, "
                  "what the predictions use)", ""]
    lines += measurement_lines(plan.get("measurement"), verbose)
    if verbose:  # every candidate's throughput and memory, and the ones skipped
        ref, w = plan["reference"]["samples_per_second"], name_width(plan)
        lines.append(f"predicted ({plan['partitioner']} partition; sequential reference {ref:.0f} samples/s):")
        lines.append(f"{'method':<{w}} {'M':>2}  partition             samples/s  speedup  bubble  max stage MB  "
                     "fits  activations MB (recompute)")
        for c in plan["candidates"]:
            act = max(r["activations"] for r in c["memory"]) / 2 ** 20
            light = max(r.get("activations_recompute", 0) for r in c["memory"]) / 2 ** 20
            lines.append(f"{candidate_name(c):<{w}} {c['microbatches']:>2}  {str(c['partition']):<20} "
                         f"{c['samples_per_second']:>10.0f}  {c['speedup']:>7.2f}  {c['bubble_fraction']:>6.2f}  "
                         f"{c['max_stage_memory'] / 2 ** 20:>12.2f}  {'yes' if c['fits'] else 'no ':<4}  "
                         f"{act:.3f} ({light:.3f})" + ("" if c.get("reachable", True) else "  flagged: unreachable"))
        reasons: Dict[Any, List[int]] = {}  # one line per method and reason, its micro-batch counts together
        for s in plan["skipped"]:
            reasons.setdefault((s["method"], s["reason"]), []).append(s["microbatches"])
        for (method, reason), counts in reasons.items():
            lines.append(f"{method:<{w}} {','.join(map(str, counts)):>2}  skipped: {reason}")
    lines.append("")
    lines += target_table(plan, None if verbose else SHORT_ROWS)
    lines.append("")
    lines += [textwrap.fill(note, 100, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
              for note in plan["recommendation"]["notes"]]
    to_target = plan["predicted"].get("time_to_target_seconds")
    points = plan.get("split_points")
    lines.append(f"recommended: {plan.get('variant') or plan['method']} with {plan['microbatches']} micro-batch(es), "
                 f"partition "
                 f"{plan['partition']}" + (f" ({'pieces' if len(points) + 1 > plan['stages'] else 'stages'} begin at "
                                           f"{', '.join(points)})" if points else "")
                 + f": {plan['predicted']['samples_per_second']:.0f} samples/s"
                 + (f", {to_target:.1f} s to target" if to_target is not None else "") + " predicted")
    if verbose:
        lines.append(textwrap.fill(f"rule: {plan['recommendation']['rule']}", 100, subsequent_indent="  ",
                                   break_long_words=False, break_on_hyphens=False))
        lines.append("activations: the largest stage's peak of in-flight activations (simulated micro-batches in "
                     "flight x bytes per micro-batch), without and (in brackets) with pipeoptim train --recompute")
    lines += [textwrap.fill(line, 100, subsequent_indent="  ") for line in tensor_lines(plan)]
    return "\n".join(lines)


def tensor_lines(plan: Dict[str, Any]) -> List[str]:
    """What --tensor-parallel T does in the plan: memory per process, the compute split, the
    collectives' bytes and their price (none without it)."""
    split = plan.get("tensor")
    if not split:
        return []
    t, profile, bandwidth = split["tensor"], plan["profile"], plan["settings"]["bandwidth"]
    whole = sum(layer["parameter_bytes"] for layer in profile["layers"])
    forward = [layer["forward"] for layer in profile["layers"]]
    styles: Dict[str, int] = {}
    for style in split["planned"].values():
        styles[style] = styles.get(style, 0) + 1
    share = sum(s * f for s, f in zip(split["share"], forward)) / sum(forward) if sum(forward) > 0 else 0.0
    rows = -(-plan["batch_size"] // plan["microbatches"])  # the recommendation's micro-batch
    wire = [rows * sum(split[key]) for key in ("forward_wire", "backward_wire")]
    price = (f"{(wire[0] + wire[1]) / bandwidth * 1e3:.2f} ms per micro-batch at --bandwidth {bandwidth:g} B/s"
             if bandwidth else "free without --bandwidth (optimistic)")
    return [f"tensor parallel: every stage on {t} processes ({plan['stages']} x {t} in all; the memory above is per "
            f"process). The plan splits {', '.join(f'{n} {s}' for s, n in styles.items())} layers, "
            f"{sum(split['split_bytes']) / 2 ** 20:.2f} of the model's {whole / 2 ** 20:.2f} MB of parameters: each "
            f"process holds 1/{t} of them, of their gradients (a row-wise embedding's whole: torch's), optimizer state "
            f"and weight versions; activations as "
            f"at T = 1 (an upper bound). Time: the planned modules take {100 * share:.0f} % of the layers' forward "
            f"(timed module by module), run 1/{t}; per micro-batch of the recommendation each process sends "
            f"{wire[0] / 2 ** 10:.1f} KiB in the forward's collectives (a row-wise layer's output all-reduced, a "
            f"gathered one all-gathered) and {wire[1] / 2 ** 10:.1f} KiB in the backward's (a column-wise layer's "
            f"input gradient all-reduced): {price}"]


def measurement_lines(measurement: Optional[Dict[str, Any]], verbose: bool = True) -> List[str]:
    """How the splits were timed: rounds, and whether the timings settled; where they did not,
    what that means and what to do (``verbose``: also the largest spread, the splits raised)."""
    if not measurement:
        return []
    rounds, tolerance = measurement["rounds"], measurement["tolerance"]
    if measurement["stable"]:
        state = f"stable (each split's first and second halves of rounds within {tolerance:.0%})"
    else:
        state = (f"not stable: a split timed over the first half of the rounds and over the second half still "
                 f"differs by {measurement['halves_disagree']:.0%} (the plan stops at {tolerance:.0%}, or after "
                 f"--max-rounds): other work on this machine slowed some of the timed runs, so candidates closer "
                 f"than that to each other may be ranked in the wrong order. Plan again on a quieter machine, or "
                 f"with more rounds (--max-rounds {2 * rounds})")
    head = f"timed {len(measurement['spread'])} splits and the reference in turns, {rounds} rounds, {state}"
    if verbose:
        head += (f"; the largest spread of a split's rounds (interquartile range / median): "
                 f"{max(measurement['spread'].values()):.0%}")
    lines = [textwrap.fill(head, 100, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)]
    if not verbose:
        return lines
    raised = measurement.get("raised") or {}
    if raised:
        most = max(raised, key=raised.get)
        lines.append(f"{len(raised)} split(s) added up to less than the whole model timed the same way, and were "
                     f"raised to it (the most: {most}, x{raised[most]:.2f})")
    return lines
