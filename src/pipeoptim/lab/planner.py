"""Plan a pipeline run from a profile: partition, method and micro-batch count (BaPipe-style).

:func:`make_plan` does what ``pipeoptim plan --help`` says (:mod:`pipeoptim.cli.plan`) for a
task's model; :func:`plan_model` the same for any ``nn.Sequential`` with one mini-batch of its
data. The profile (:mod:`pipeoptim.profile`), three splits (``time``: :func:`pipeoptim.partition.
time_partition`), the predictions per method and micro-batch count (:mod:`pipeoptim.prediction`),
each one's predicted time to a model as good as synchronous training's and the recommendation
(:mod:`pipeoptim.lab.plan_targets`: the equal-time study's ratios of updates to the target and its
advice, the tables ``pipeoptim compare`` and the README read). ``scaling="linear"`` is cheaper,
optimistic for small micro-batches whose fixed per-call costs do not shrink. Measured stage times
(:func:`pipeoptim.profile.measure_stages`) replace the sums of the layers' times, since layers
timed alone add up to less than their stage (caches, the runtime's work per pass); the
partitioners still use the per-layer profile. Each link is a resource too: the makespan is at
least micro-batches x the slowest cut's ``2 * bytes / bandwidth``. A chunked method is skipped,
with the reason, where the model has too few layers. With the ``time`` partitioner the split is
recomputed on each micro-batch count's profile; ``partitions`` in the plan reports the three
splits of the whole mini-batch. ``pipeoptim train --plan FILE`` reads it (:func:`load_plan`)."""
from __future__ import annotations

import json
import math
import re
import textwrap
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..methods import get_method, method_names
from ..plan_defaults import DEFAULT_METHODS, DEFAULT_MICROBATCHES, PARTITIONERS
from ..prediction import (candidate_problem, describe_partition, head_rows, microbatch_size, partition_for, predict,
                          profile_sizes)
from ..profile import measure_stages
from .plan_targets import RULE, annotate, notes, recommend  # noqa: F401 (recommend: the planner's rule)

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


def check_options(stages: int, methods: Sequence[str], microbatches: Any, speeds: Optional[Sequence[float]],
                  bandwidth: Optional[float], memory_limit: Optional[float], partitioner: str, tie: float,
                  stage_timing: str) -> Any:
    """(methods, micro-batch counts, speeds) as lists, checked; a one-line ValueError naming the
    option otherwise (before any data is loaded or layer profiled)."""
    methods = list(methods)
    for m in methods:
        get_method(m)
    microbatches = parse_int_list(microbatches, "--microbatches")
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"--stages must be at least 1, got {stages}")
    if speeds is not None:
        speeds = [float(s) for s in speeds]
        if len(speeds) != stages:
            raise ValueError(f"--speeds has {len(speeds)} values but --stages is {stages} (give one per stage)")
        if any(not (s > 0 and math.isfinite(s)) for s in speeds):
            raise ValueError(f"--speeds must all be positive, got {speeds}")
    if bandwidth is not None and not (bandwidth > 0 and math.isfinite(bandwidth)):
        raise ValueError(f"--bandwidth must be positive (bytes per second), got {bandwidth}")
    if memory_limit is not None and not memory_limit > 0:
        raise ValueError(f"--memory-limit must be positive, got {memory_limit}")
    if partitioner not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {partitioner!r}; choose one of: {', '.join(PARTITIONERS)}")
    if not 0 <= tie < 1:
        raise ValueError(f"--tie must be in [0, 1), got {tie}")
    if stage_timing not in ("measured", "profile"):
        raise ValueError(f"stage timing must be measured or profile, got {stage_timing!r}")
    return methods, microbatches, speeds


# -- the whole plan --------------------------------------------------------------------------------

def make_plan(*, task: str, model: Optional[str] = None, stages: int, device: str = "cpu",
              speeds: Optional[Sequence[float]] = None, bandwidth: Optional[float] = None,
              batch_size: Optional[int] = None, methods: Sequence[str] = DEFAULT_METHODS,
              microbatches: Sequence[int] = DEFAULT_MICROBATCHES, memory_limit: Optional[float] = None,
              partitioner: str = "time", scaling: str = "measure", batches: Optional[int] = None,
              limit: Optional[int] = None, seed: int = 0, optimizer: str = "momentum",
              warmup: int = 2, repeats: int = 5, statistic: str = "median", stage_timing: str = "measured",
              tie: float = 0.02, log=None) -> Dict[str, Any]:
    """Profile ``task``'s ``model``, partition it, predict every (method, micro-batches) and
    recommend one (see the module docstring). Returns the plan as a JSON-ready dict.

    ``batches``: mini-batches per predicted run (default: one epoch of the loaded data).
    ``speeds``: one relative speed per stage (device k runs stage k). ``bandwidth``: bytes per
    second of each link (None: free transfers). ``memory_limit``: bytes per stage."""
    from .tasks import get_task

    check_options(stages, methods, microbatches, speeds, bandwidth, memory_limit, partitioner, tie, stage_timing)
    for name, value in (("batch-size", batch_size), ("batches", batches), ("limit", limit)):
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be at least 1, got {value}")
    the_task = get_task(task)
    model_name = model or the_task.default_model
    if model_name not in the_task.model_names():
        raise ValueError(f"task {task} has no model {model_name!r}; choose one of: "
                         f"{', '.join(the_task.model_names())}")
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
                      statistic=statistic, stage_timing=stage_timing, tie=tie, log=log, task=task,
                      model_name=model_name)
    plan["settings"]["limit"] = limit
    return plan


def plan_model(net: torch.nn.Sequential, batch: Sequence[Any], loss: Callable[[Any, Any], torch.Tensor], *,
               stages: int, batch_size: Optional[int] = None, batches: int = 100, device: str = "cpu",
               speeds: Optional[Sequence[float]] = None, bandwidth: Optional[float] = None,
               methods: Sequence[str] = DEFAULT_METHODS, microbatches: Sequence[int] = DEFAULT_MICROBATCHES,
               memory_limit: Optional[float] = None, partitioner: str = "time", scaling: str = "measure",
               seed: int = 0, optimizer: str = "momentum", lr: float = 1e-3, warmup: int = 2, repeats: int = 5,
               statistic: str = "median", stage_timing: str = "measured", tie: float = 0.02, log=None,
               task: Optional[str] = None, model_name: Optional[str] = None) -> Dict[str, Any]:
    """The plan (as :func:`make_plan`'s) of any ``nn.Sequential``: ``batch`` is one mini-batch
    ``(inputs, target)`` of its data, ``loss(output, target)`` its loss, ``batch_size`` its rows
    (default: the inputs' first dimension), ``batches`` the mini-batches per predicted run,
    ``optimizer`` and ``lr`` the optimizer whose update time and state are profiled. ``task`` and
    ``model_name``: the lab's task and model the net is (what says whether the equal-time study
    covers it); without them the net is a model of the user's own, for which the study has no
    ratio of updates to the target: the fastest synchronous candidate is recommended, and the
    fastest asynchronous one named as the one to try."""
    from .optimizers import make_optimizer

    log = log or (lambda *a, **k: None)
    methods, microbatches, speeds = check_options(stages, methods, microbatches, speeds, bandwidth, memory_limit,
                                                  partitioner, tie, stage_timing)
    if not isinstance(net, torch.nn.Sequential):
        raise ValueError(f"the planner profiles an nn.Sequential layer by layer, got {type(net).__name__}; "
                         "write the model as nn.Sequential(layer, layer, ...)")
    sample, target = batch
    first = sample[0] if isinstance(sample, tuple) else sample
    batch_size = batch_size or (len(first) if torch.is_tensor(first) else None)
    if not batch_size or batch_size < 1:
        raise ValueError("give batch_size: the rows of one mini-batch (the inputs are not a tensor to count)")
    if batches < 1:
        raise ValueError(f"--batches must be at least 1, got {batches}")
    layers = len(net)
    shown = model_name or type(net).__name__
    if stages > layers:
        raise ValueError(f"--stages {stages} is more than the {layers} layers of {shown}")
    opt_factory = make_optimizer(optimizer, lr)
    log(f"profiling {task + '/' if task else ''}{shown} ({layers} layers) on {device}, batch {batch_size}, "
        f"micro-batch counts {microbatches} ({scaling})")
    profiles = profile_sizes(net, sample, target, loss, batch_size=batch_size, microbatches=microbatches,
                             scaling=scaling, device=device, warmup=warmup, repeats=repeats,
                             statistic=statistic, optimizer=opt_factory, optimizer_name=optimizer, seed=seed)
    full = profiles[1]
    timings: Dict[Any, Dict[str, List[float]]] = {}

    def timing(sizes: List[int], m: int) -> Optional[Dict[str, List[float]]]:
        """Measured stage times of one micro-batch of ``M = m`` on the split ``sizes``."""
        if stage_timing != "measured":
            return None
        rows = microbatch_size(batch_size, m) if scaling == "measure" else batch_size
        key = (tuple(sizes), rows)
        if key not in timings:
            timings[key] = measure_stages(net, list(sizes), head_rows(sample, rows), target[:rows], loss,
                                          device=device, optimizer=opt_factory, warmup=warmup, repeats=repeats,
                                          statistic=statistic)
        times = timings[key]
        if rows != microbatch_size(batch_size, m):  # linear scaling of the mini-batch's times
            factor = microbatch_size(batch_size, m) / rows
            times = {"forward": [t * factor for t in times["forward"]],
                     "backward": [t * factor for t in times["backward"]], "update": list(times["update"])}
        return times

    if stage_timing == "measured":
        log("timing the stages of each split as the runtime runs them")
    partitions = {}
    for how in PARTITIONERS:
        sizes = partition_for(how, net, full, stages, speeds, bandwidth)
        partitions[how] = describe_partition(full, sizes, speeds, bandwidth)
        measured = timing(sizes, 1)
        if measured is not None:
            speed = speeds or [1.0] * stages
            per_stage = [(f + b) / v for f, b, v in zip(measured["forward"], measured["backward"], speed)]
            partitions[how]["measured_stage_seconds"] = per_stage
            partitions[how]["measured_slowest_stage_seconds"] = max(per_stage)
    reference = predict("sequential", full, [layers], microbatches=1, batches=batches, batch_size=batch_size,
                        measured=timing([layers], 1))

    weighted = sum(1 for layer in net if any(True for _ in layer.parameters()))  # what chunks split
    candidates, skipped = [], []
    for m in microbatches:
        prof = profiles[m]
        sizes = partition_for(partitioner, net, prof, stages, speeds, bandwidth)
        pieces: Dict[Any, List[int]] = {}  # the split of a chunked method, by its placement
        for method in methods:
            n = 1 if method == "sequential" else stages
            if method == "sequential" and m != 1:
                continue
            problem = candidate_problem(method, n, m, batch_size, weighted)
            if problem:
                skipped.append({"method": method, "microbatches": m, "reason": problem})
                continue
            split_sizes = sizes if n == stages else [layers]
            meth = get_method(method)
            if n == stages and meth.chunks > 1:  # stages x pieces per rank, each on its rank's device
                # (a mirrored method's stages past its pieces are their replicas: not split again)
                placement = tuple(meth.stage_ranks(stages, meth.chunks)[:stages * meth.pieces_per_rank(meth.chunks)])
                if placement not in pieces:
                    pieces[placement] = partition_for(partitioner, net, prof, len(placement),
                                                      None if speeds is None else [speeds[r] for r in placement],
                                                      bandwidth)
                split_sizes = pieces[placement]
            row = predict(method, prof, split_sizes, microbatches=m, batches=batches, batch_size=batch_size,
                          speeds=speeds if n == stages else None, bandwidth=bandwidth,
                          measured=timing(split_sizes, m))
            row["speedup"] = row["samples_per_second"] / reference["samples_per_second"]
            row["fits"] = memory_limit is None or row["max_stage_memory"] <= memory_limit
            candidates.append(row)
    study = annotate(candidates, task=task, model=model_name, batch_size=batch_size, optimizer=optimizer,
                     stages=stages)
    best = recommend(candidates, memory_limit, tie, order=methods, prefer=study["advised_method"])
    said = notes(study, candidates, best, task=task, model=model_name, stages=stages, optimizer=optimizer)
    n_best = 1 if best["method"] == "sequential" else stages
    return {
        "format": PLAN_FORMAT, "version": PLAN_VERSION,
        "task": task, "model": model_name, "batch_size": batch_size, "stages": n_best,
        "partition": best["partition"], "partitioner": partitioner if n_best == stages else "uniform",
        "method": best["method"], "microbatches": best["microbatches"],
        "predicted": {k: best[k] for k in ("samples_per_second", "makespan_seconds", "batches", "bubble_fraction",
                                            "speedup", "stage_forward_seconds", "stage_backward_seconds",
                                            "update_seconds", "comm_seconds", "limited_by_link",
                                            "seconds_per_batch", "updates_ratio", "time_to_target_seconds")},
        "memory": {"per_stage": best["memory"], "max_stage": best["max_stage_memory"], "limit": memory_limit},
        "recommendation": {"method": best["method"], "microbatches": best["microbatches"],
                           "synchronous": best["synchronous"], "rule": RECOMMENDATION_RULE.format(tie=tie),
                           "notes": said},
        "study": study,
        "settings": {"device": device, "speeds": speeds, "bandwidth": bandwidth, "methods": methods,
                     "microbatch_counts": microbatches, "scaling": scaling, "batches": batches, "limit": None,
                     "seed": seed, "optimizer": optimizer, "lr": lr, "warmup": warmup, "repeats": repeats,
                     "statistic": statistic, "stage_timing": stage_timing, "threads": torch.get_num_threads(),
                     "tie": tie, "stages": stages},
        "partitions": partitions,
        "reference": {"method": "sequential", "samples_per_second": reference["samples_per_second"]},
        "candidates": candidates, "skipped": skipped,
        "profile": full.to_dict(),
        "microbatch_profiles": {str(m): profiles[m].to_dict() for m in microbatches if m != 1},
    }


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
    ``micro_batches`` (--micro-batches). Every problem is a one-line ValueError."""
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
    return {dest: plan[key] for key, dest in TRAIN_FIELDS.items()}


def format_plan(plan: Dict[str, Any]) -> str:
    """The plan as text: partitions, candidates, recommendation."""
    lines = [f"{plan['task'] or 'your model'} / {plan['model'] or 'nn.Sequential'}: {plan['stages']} stages, "
             f"batch {plan['batch_size']}, {plan['settings']['device']}, {plan['settings']['threads']} thread(s)"]
    lines.append("")
    lines.append("partition   layers per stage        slowest stage ms   cycle ms   slowest/mean   "
                 "measured slowest stage ms")
    for how, p in plan["partitions"].items():
        measured = p.get("measured_slowest_stage_seconds")
        lines.append(f"{how:<11} {str(p['sizes']):<23} {p['slowest_stage_seconds'] * 1e3:>16.2f}   "
                     f"{p['cycle_seconds'] * 1e3:>8.2f}   {p['imbalance']:>12.2f}   "
                     f"{(f'{measured * 1e3:.2f}' if measured is not None else '-'):>25}")
    lines.append("")
    ref = plan["reference"]["samples_per_second"]
    lines.append(f"predicted ({plan['partitioner']} partition; sequential reference {ref:.0f} samples/s):")
    lines.append("method          M  partition             samples/s  speedup  bubble  max stage MB  fits  "
                 "activations MB (recompute)")
    for c in plan["candidates"]:
        act = max(r["activations"] for r in c["memory"]) / 2 ** 20
        light = max(r.get("activations_recompute", 0) for r in c["memory"]) / 2 ** 20
        lines.append(f"{c['method']:<14} {c['microbatches']:>2}  {str(c['partition']):<20} "
                     f"{c['samples_per_second']:>10.0f}  {c['speedup']:>7.2f}  {c['bubble_fraction']:>6.2f}  "
                     f"{c['max_stage_memory'] / 2 ** 20:>12.2f}  {'yes' if c['fits'] else 'no ':<4}  "
                     f"{act:.3f} ({light:.3f})")
    for s in plan["skipped"]:
        lines.append(f"{s['method']:<14} {s['microbatches']:>2}  skipped: {s['reason']}")
    lines.append("")
    lines += target_table(plan)
    lines.append("")
    lines += [textwrap.fill(note, 100, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
              for note in plan["recommendation"]["notes"]]
    to_target = plan["predicted"].get("time_to_target_seconds")
    lines.append(f"recommended: {plan['method']} with {plan['microbatches']} micro-batch(es), partition "
                 f"{plan['partition']}: {plan['predicted']['samples_per_second']:.0f} samples/s"
                 + (f", {to_target:.1f} s to target" if to_target is not None else "") + " predicted")
    lines.append(textwrap.fill(f"rule: {plan['recommendation']['rule']}", 100, subsequent_indent="  ",
                               break_long_words=False, break_on_hyphens=False))
    lines.append("activations: the largest stage's peak of in-flight activations (simulated micro-batches in "
                 "flight x bytes per micro-batch), without and (in brackets) with --recompute")
    return "\n".join(lines)


def target_table(plan: Dict[str, Any]) -> List[str]:
    """The candidates by predicted time to target (unknown ones last, by throughput): samples/s,
    the ratio of updates to the target and where it comes from, whether it may be recommended."""
    study = plan["study"]
    head = (f"by predicted time to target ({study['setting']} of the equal-time study: "
            f"{study['target_updates']:.0f} updates of the synchronous pipeline to the target):" if study["covered"]
            else "by predicted time to target (no study covers this case: ratios unknown but the synchronous 1):")
    lines = [head, "method          M   samples/s  updates x  to target s  may recommend  ratio from"]
    ranked = sorted(plan["candidates"], key=lambda c: (c.get("time_to_target_seconds") is None,
                                                       c.get("time_to_target_seconds") or 0.0,
                                                       -c["samples_per_second"]))
    for c in ranked:
        ratio, to_target = c.get("updates_ratio"), c.get("time_to_target_seconds")
        lines.append(f"{c['method']:<14} {c['microbatches']:>2}  {c['samples_per_second']:>10.0f}  "
                     f"{(f'{ratio:.2f}' if ratio is not None else '-'):>9}  "
                     f"{(f'{to_target:.1f}' if to_target is not None else '-'):>11}  "
                     f"{'yes' if c.get('eligible', True) else 'no':<13}  {c.get('ratio_source', '')}")
    return lines
