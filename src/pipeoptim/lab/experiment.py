"""One task, one method, one run folder: what `pipeoptim train` and `compare` do.

Loads the task's data and a seeded model, trains it with a :class:`~pipeoptim.pipeline.Pipeline`
(:func:`build_pipeline`, the same for the local runtime and for each stage process of the
distributed one) behind a progress bar, evaluates after every epoch (and every ``eval_every``
mini-batches), and writes the run folder:

* ``metrics.jsonl``: one JSON object per mini-batch (``{"type": "batch", ...}``), per evaluation
  (``{"type": "eval", "epoch", "batch", "updates", "metric", "seconds"}``) and per epoch;
* ``summary.json``: the settings and results (what ``--json`` prints);
* ``curves.png``: training loss and the evaluated metric.

The run's throughputs, as the summary holds and the run prints them (:data:`THROUGHPUTS`):
``epochs_detail[i].samples_per_second``, each epoch's line, is *training* samples/s: the
epoch's samples over its training time, its evaluations and its end's checkpoint left out;
``samples_per_second``, the final line, is over the whole training: the epochs' training time
plus the evaluations and checkpoints at their ends (an evaluation within an epoch, with
``eval_every``, is left out of both); neither counts loading the data and building the model
before it. ``predicted_samples_per_second`` is what the schedule simulator predicts with one
device per stage from the stages' measured times (no transfer cost); ``seconds``, the wall time
from the start of training to the summary.

Which split is evaluated during training: the test split; with ``holdout`` the validation split
(what tuning may read), and then the test split once, on the final model. The summary's
``final_metric`` is always the test split's; ``validation_metric`` (with ``holdout``) is the final
validation value; ``best_metric``, the epochs' ``metric`` and ``evaluations`` are on the split
evaluated during training (``eval_split``).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from .. import checks
from ..fit_checks import check_drains
from ..methods import get_method
from ..pipeline import Pipeline, TrainResult, resolve_devices
from ..prepare import prepare
from ..runtime.defaults import DEFAULT_TIMEOUT
from ..runtime.layout import plan_layout
from ..runtime.microbatch import batch_size as samples_in, split_batch
from ..runtime.spec import RunSpec
from ..schedules import Costs, simulate
from .config import RunConfig
from .lr_schedules import make_lr_schedule, warmup_note
from .optimizers import make_optimizer
from .plots import plot_runs
from .tasks import Task, TaskData, get_task


#: how the run's text names its throughputs (the module's docstring says what each counts): an
#: epoch's, and the whole training's
THROUGHPUTS = {"epoch": "training samples/s",
               "run": "samples/s over the whole training (epoch-end evaluations and checkpoints included)"}

#: --lr-correction delay without --lr-correction-steps anneals over this share of the run's updates
DEFAULT_LR_CORRECTION_SHARE = 0.3


#: the command line's models that carry a tensor-parallel plan (their ``_tp_plan``), by task;
#: ``tests/test_tensor_parallel_cli.py`` holds it to the models themselves
TENSOR_PLANNED = {"image": ("mlp", "vgg", "vgg-bn"),
                  "lm": ("gpt", "gpt-small", "gpt-narrow", "gpt-tied", "gpt-tied-small")}


def planned_models() -> str:
    """The --task/--model pairs that carry a tensor-parallel plan, as a refusal lists them."""
    return "; ".join(f"--task {task} --model {'|'.join(models)}" for task, models in TENSOR_PLANNED.items())


def check_tensor_planned(task: str, model: str, tensor: int, command: str = "train") -> None:
    """Refuse, with the fix, ``--tensor-parallel T`` (T >= 2) for a model of the command line that
    carries no plan (the command line cannot take the API's ``tensor_plan`` dict)."""
    if tensor < 1:
        raise ValueError(f"--tensor-parallel must be at least 1, got {tensor}")
    if tensor > 1 and model not in TENSOR_PLANNED.get(task, ()):
        blocks = "the blocks model (the default), " if command == "bench" else ""
        raise ValueError(f"--tensor-parallel {tensor} splits the layers a model's plan names, and {task}'s model "
                         f"{model} carries none: choose a model with a plan ({blocks}{planned_models()}), or "
                         f"drop --tensor-parallel (in Python, Pipeline(tensor_plan=...) splits any model)")


def check_tensor_split(model: Any, tensor: int, name: str) -> None:
    """Refuse, with the fix, ``--tensor-parallel T`` where the plan of ``model`` (the command
    line's ``name``) cannot split over T, before any process starts: the Pipeline's own check
    (``tensor_plan.resolve_plan``: e.g. a T that does not divide a planned layer's
    split dimension)."""
    if tensor == 1:
        return
    from ..tensor_plan import resolve_plan

    try:
        resolve_plan(model, None, tensor)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


def load_data(task: Task, cfg: RunConfig) -> TaskData:
    """The task's data for ``cfg`` (resolved): its batch size, limit, seed and holdout."""
    held = {"holdout": cfg.holdout} if cfg.holdout is not None else {}
    return task.load(batch_size=cfg.batch_size, limit=cfg.limit, seed=cfg.seed, **held)


def check_run(cfg: RunConfig, model: torch.nn.Module, batches: List[Any]) -> None:
    """Refuse settings that cannot run (ValueError saying the fix) where no Pipeline is built
    yet: the launcher, before it starts the stage processes. Fills the defaults that depend on
    the run's length (:func:`fill_run_defaults`); the model is cut as the Pipeline will cut it (one
    that is not an ``nn.Sequential`` traced on the first mini-batch: :func:`cut_spec`)."""
    fill_run_defaults(cfg, batches)
    config = cfg.pipeline
    for inputs, _ in batches if config.data_parallel else ():
        check_shards(samples_in(inputs), config.data_parallel)
    method = get_method(config.method)
    layout = plan_layout(method, stages=config.stages, partition=config.partition, chunks=config.chunks,
                         data_parallel=config.data_parallel, tensor_parallel=config.tensor_parallel)
    checks.check_tensor_parallel(layout, config)
    spec = checks.check_run(config, model, method, layout)
    checks.check_precision(method, config.precision, layout.replicas * (layout.ranks or 2) * layout.tensor)
    check_spec(cfg, cut_spec(cfg, model, batches, spec), batches)


def fill_run_defaults(cfg: RunConfig, batches: List[Any]) -> None:
    """The defaults that depend on the run's length (``lr_correction_steps``), filled in ``cfg``;
    the run's length checked (at least one epoch, one mini-batch)."""
    if cfg.fit.epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {cfg.fit.epochs}")
    if not batches:
        raise ValueError("no mini-batches to train on")
    options = cfg.pipeline.method_options
    if options.get("lr_correction") == "delay" and options.get("lr_correction_steps") is None:
        steps = max(1, round(DEFAULT_LR_CORRECTION_SHARE * len(batches) * cfg.fit.epochs))
        cfg.pipeline = cfg.pipeline.replace(method_options={**options, "lr_correction_steps": steps})


def check_spec(cfg: RunConfig, spec: RunSpec, batches: List[Any]) -> None:
    """What the resolved run ``spec`` must still fit: the checkpoint and evaluation intervals,
    every mini-batch splitting into the micro-batches, the lr schedule, the devices, clipping."""
    run, config = cfg.fit, cfg.pipeline
    check_drains(run.checkpoint_every, run.eval_every, run.continuous)
    for inputs, target in batches:  # views only: cheap, and every mini-batch must split
        split_batch(inputs, target, spec.microbatches)
    make_lr_schedule(cfg.lr_schedule, len(batches) * run.epochs, cfg.warmup_steps)
    resolve_devices(config.devices, spec.stages)
    checks.check_clipping(get_method(config.method), config.clip_grad_norm, config.clip_scope)


def cut_spec(cfg: RunConfig, model: torch.nn.Module, batches: List[Any], spec: RunSpec) -> RunSpec:
    """The checked run ``spec`` with the model's cut, as the Pipeline will cut it: by ``cfg``'s
    partitioner over its layers, or, for a model it traces (docs/architecture.md, "Splitting any
    module"), over its units, traced on the first mini-batch's inputs; what the cut refuses (a
    partition that does not cover the model, more stages than candidate points, a chunked
    method, a weight tied across stages with a method that cannot keep it tied) is refused here,
    before anything is written. Torch's random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        return prepare(model, batches[0][0], cfg.pipeline, get_method(cfg.pipeline.method), spec).spec


def format_prediction_error(per_stage: List[Dict[str, float]]) -> str:
    """One line: per stage, how far the weights a forward used were from those its backward used
    (prediction error) against how far the stale weights were (staleness error), and the ratio:
    below 1, the prediction helps; 1, no prediction; above 1, it hurts. With delay corrections
    on, the ratio the same probes would have had with no correction, and without each one."""
    parts = []
    for k, d in enumerate(per_stage):
        if not d.get("probes"):
            parts.append(f"{k}: -")
            continue
        stale = d["staleness_error"]
        ratio = d["prediction_error"] / stale if stale > 0 else float("nan")
        text = f"{k}: {d['prediction_error']:.2e}/{stale:.2e} ({ratio:.2f}"
        for name, error in d.get("variants", {}).items():  # the same probes, other predictions
            text += f"; {name} {error / stale if stale > 0 else float('nan'):.2f}"
        parts.append(text + ")")
    return "prediction/staleness error per stage: " + " | ".join(parts)


def progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    # disable=None: tqdm draws only on a terminal (a log file would hold every refresh)
    return tqdm(total=total, desc=desc, unit="batch", disable=None if enabled else True, leave=False,
                dynamic_ncols=True, file=sys.stderr)


def predicted_throughput(result: TrainResult, batch_size: int, batches: int) -> Optional[float]:
    """Samples per second the schedule simulator predicts from the measured per-stage times
    (one device per stage, no transfer cost)."""
    times = result.metrics["stage_seconds"]
    method = get_method(result.metrics["method"])
    n = result.metrics["stages"]
    costs = Costs([t["F"] for t in times], [t["B"] for t in times], [0.0] * n,
                  update=max(t["U"] for t in times))
    chunks = result.metrics.get("chunks", 1)  # stages per rank: n / chunks ranks
    schedule = method.build_schedule(n // chunks, result.metrics["microbatches"], batches, chunks=chunks)
    makespan = simulate(schedule, costs).makespan
    return batch_size * batches / makespan if makespan > 0 else None


def build_pipeline(cfg: RunConfig, task: Task, data: TaskData, *, diagnose_every: int = 0,
                   devices: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT,
                   threads: Optional[int] = 1) -> Pipeline:
    """The Pipeline of a run (``cfg`` resolved): the one function both runtimes build it with,
    in one process or, started under torchrun, one pipeline rank per process (the Pipeline joins the
    job; ``devices`` then names the kind, ``cpu`` or ``cuda``, instead of ``cfg``'s, and
    ``timeout`` and ``threads`` are the stage processes' own). Seeds the model and the training's
    randomness; refuses settings that cannot run before anything is written: the Pipeline checks
    its own when it is built and splits the model on the first mini-batch then (a traced model is
    traced once), and :func:`check_spec` what the resolved run must still fit."""
    model = task.build_model(cfg.model, data, seed=cfg.seed)
    torch.manual_seed(cfg.seed)  # dropout and other randomness during training
    fill_run_defaults(cfg, data.train)
    updates = len(data.train) * cfg.fit.epochs
    # the run's options whole, with what the lab builds from its own (the task's loss, the
    # optimizer and schedule by name) and what the stage processes set apart
    config = cfg.pipeline.replace(
        loss_fn=task.loss, optimizer=make_optimizer(cfg.optimizer_name, cfg.lr, cfg.weight_decay, cfg.momentum,
                                                    cfg.beta1, cfg.adamw_lr),
        lr_scheduler=make_lr_schedule(cfg.lr_schedule, updates, cfg.warmup_steps),
        devices=devices if devices is not None else cfg.pipeline.devices, diagnose_every=diagnose_every,
        timeout=timeout, threads=threads)
    pipe = Pipeline.from_config(model, config)
    own = replica_batches(pipe, data.train)
    if not pipe.prepared:  # a traced model: split on the first mini-batch, as fit would (nothing draws randomness between)
        pipe.prepare(next(iter(own))[0])
    check_spec(cfg, pipe.spec, own)
    return pipe


def check_shards(samples: int, replicas: int) -> None:
    if samples % replicas:
        raise ValueError(f"a mini-batch of {samples} samples does not split into {replicas} equal replica "
                         f"shards: give a --batch-size (and --limit) that {replicas} divides")


def replica_batches(pipe: Pipeline, batches: List[Any]) -> List[Any]:
    """What ``pipe``'s replica trains on: its equal share of every mini-batch (all of them with
    one replica), so that the replicas' mean gradient is the whole mini-batch's."""
    replicas, d = pipe.data_parallel_size, pipe.data_parallel_rank
    if replicas == 1:
        return batches
    own = []
    for inputs, target in batches:
        check_shards(samples_in(inputs), replicas)
        piece, piece_target, _ = split_batch(inputs, target, replicas)[d]
        own.append((piece, piece_target))
    return own


def evaluation(pipe: Pipeline, task: Task, data: TaskData, split: str) -> Dict[str, Any]:
    """How ``fit`` evaluates a run on ``split``: the pipeline's own forward with the task's
    per-mini-batch metric where it has one (:meth:`Task.batch_metric`; pipelined under
    torchrun), else the task's evaluation of the whole model."""
    metric = task.batch_metric()
    if metric is not None:
        return {"eval_loader": data.split(split, f"task {task.name}"), "metric": metric}
    if split == "validation":
        return {"evaluate": lambda model: task.evaluate(model, data, split="validation")}
    return {"evaluate": lambda model: task.evaluate(model, data)}


def final_test_metric(pipe: Pipeline, task: Task, data: TaskData) -> float:
    """The test split's metric of the drained pipeline's weights (as :func:`evaluation`)."""
    metric = task.batch_metric()
    if metric is not None:
        return pipe.evaluate(data.test, metric)
    return pipe.evaluate_model(lambda model: task.evaluate(model, data))


def run_experiment(cfg: RunConfig, *, out_dir: Optional[Path], show_progress: bool = True,
                   log=print, task: Optional[Task] = None, data: Optional[TaskData] = None,
                   resume: bool = False, diagnose_every: int = 0,
                   processes: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Train one method on one task; write the run folder; return the summary.

    With a run folder, the settings go to ``config.json`` and every stage is checkpointed under
    ``checkpoints/`` at each epoch's end (and every ``cfg.fit.checkpoint_every`` mini-batches);
    ``resume`` continues the run in ``out_dir`` from its newest checkpoint. ``data``, if given,
    must have been loaded with ``cfg``'s holdout (see :func:`load_data`).

    ``processes``: the distributed runtime's settings (``device``: cpu or cuda, ``timeout``,
    ``threads``), given by each stage process of a run under torchrun. Every rank then calls
    this with the same arguments; rank 0 alone writes the run folder, shows the progress and
    logs; every rank returns the summary, whose ``runtime`` is ``distributed``."""
    task = task or get_task(cfg.task)
    cfg = cfg.resolved(task)
    if data is None:
        data = load_data(task, cfg)
    split = cfg.eval_split
    data.split(split, f"task {task.name}")  # the split exists, before anything is written
    settings = dict(processes or {})
    pipe = build_pipeline(cfg, task, data, diagnose_every=diagnose_every, devices=settings.get("device"),
                          timeout=settings.get("timeout", DEFAULT_TIMEOUT), threads=settings.get("threads", 1))
    writes = pipe.rank == 0  # rank 0 writes the run folder (every rank trains and evaluates)
    batches = replica_batches(pipe, data.train)
    if cfg.lr_source is not None and not resume and writes:
        short = warmup_note(cfg.lr_schedule, len(data.train) * cfg.fit.epochs, cfg.warmup_steps)
        log(f"{cfg.pipeline.method}: lr {cfg.lr:g}: {cfg.lr_source}" + (f"; {short}" if short else ""))
    log_file = None
    if out_dir is not None and writes:
        out_dir.mkdir(parents=True, exist_ok=True)
        if not resume:
            (out_dir / "config.json").write_text(json.dumps(cfg.record(), indent=2))
        log_file = open(out_dir / "metrics.jsonl", "a" if resume else "w")
    where = f"{pipe.world.processes} processes" if processes is not None else f"{pipe.spec.stages} stages"
    bar = progress_bar(len(batches) * cfg.fit.epochs, f"{cfg.pipeline.method} ({where})", show_progress and writes)
    log = log if writes else (lambda *a, **k: None)

    def on_batch(index: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        if log_file:
            log_file.write(json.dumps({"type": "batch", "batch": index, "loss": loss}) + "\n")

    def on_eval(entry: Dict[str, Any]) -> None:
        if log_file:
            log_file.write(json.dumps({"type": "eval", "split": split, **entry}) + "\n")
            log_file.flush()

    def on_epoch(epoch: int, entry: Dict[str, Any]) -> None:
        if log_file:
            log_file.write(json.dumps({"type": "epoch", **entry}) + "\n")
            log_file.flush()
        bar.clear()
        log(f"{cfg.pipeline.method:>14} epoch {epoch + 1}/{cfg.fit.epochs}: loss {entry['loss']:.4f}  "
            f"{'validation ' if split == 'validation' else ''}{task.metric} {entry.get('metric', float('nan')):.4f}  "
            f"{entry['samples_per_second']:.0f} {THROUGHPUTS['epoch']}")
        if any(d.get("probes") for d in entry.get("prediction_error") or []):
            log(f"{'':>14} {format_prediction_error(entry['prediction_error'])}")

    started = time.time()
    try:
        run = cfg.fit.replace(**evaluation(pipe, task, data, split), on_batch=on_batch, on_epoch=on_epoch,
                              on_eval=on_eval, resume=resume,
                              checkpoint_dir=out_dir / "checkpoints" if out_dir is not None else None)
        result = pipe.fit(batches, **run.keywords())
        final_test = None
        if split != "test":  # the test split, once, on the final weights
            final_test = final_test_metric(pipe, task, data)
            if log_file:
                log_file.write(json.dumps({"type": "test", "metric": final_test}) + "\n")
    finally:
        bar.close()
        if log_file:
            log_file.close()
        pipe.close()
    extra = {"runtime": "distributed", "device": result.metrics["devices"][0]} if processes is not None else {}
    return summarize_run(cfg, task, data, result, started=started, out_dir=out_dir if writes else None,
                         test_metric=final_test, extra=extra)


def final_line(summary: Dict[str, Any]) -> str:
    """The line a finished run ends with: its metrics, loss, throughput (:data:`THROUGHPUTS`) and
    weight copies (the local runtime's and, from rank 0, the distributed one's)."""
    speed = f"{summary['samples_per_second']:.0f} {THROUGHPUTS['run']}"
    if summary.get("validation_metric") is not None:
        return (f"final test {summary['metric']}: {summary['final_metric']:.4f}, validation "
                f"{summary['validation_metric']:.4f} (best {summary['best_metric']:.4f}), "
                f"final loss {summary['final_loss']:.4f}, {speed}, weight copies per stage {summary['weight_copies']}")
    return (f"final {summary['metric']}: {summary['final_metric']:.4f} (best {summary['best_metric']:.4f}), "
            f"final loss {summary['final_loss']:.4f}, {speed}, weight copies per stage {summary['weight_copies']}")


def summarize_run(cfg: RunConfig, task: Task, data: TaskData, result: TrainResult, *, started: float,
                  out_dir: Optional[Path], test_metric: Optional[float] = None,
                  extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The summary of a finished run (``cfg`` resolved); writes summary.json and curves.png
    into ``out_dir``. ``test_metric``: with ``cfg.holdout``, the final model's test metric (the
    epochs' metrics are then validation values, reported as ``validation_metric`` and
    ``best_metric``). ``extra``: more entries, as they are (the runtime of a distributed run)."""
    batches = data.train
    metrics = [e["metric"] for e in result.metrics["epochs"] if "metric" in e]
    best = (max if task.higher_is_better else min)(metrics) if metrics else None
    final = metrics[-1] if metrics else None
    summary = {
        "task": cfg.task, "model": cfg.model, "method": cfg.pipeline.method, "stages": result.metrics["stages"],
        "partition": result.metrics["partition"], "microbatches": result.metrics["microbatches"],
        "options": result.metrics["options"], "optimizer": cfg.optimizer_name, "lr": cfg.lr,
        "lr_source": cfg.lr_source,
        "batch_size": cfg.batch_size, "epochs": cfg.fit.epochs, "limit": cfg.limit, "seed": cfg.seed,
        "metric": task.metric, "higher_is_better": task.higher_is_better,
        "final_metric": final if cfg.holdout is None else test_metric, "best_metric": best,
        "eval_split": cfg.eval_split, "eval_every": cfg.fit.eval_every, "holdout": cfg.holdout,
        "evaluations": result.metrics.get("evaluations", []),
        "final_loss": result.metrics["epochs"][-1]["loss"], "losses": result.losses,
        "samples_per_second": result.metrics["samples_per_second"],
        "predicted_samples_per_second": predicted_throughput(result, cfg.batch_size, len(batches)),
        "weight_copies": result.metrics["weight_versions"],
        "weight_copies_design": result.metrics["weight_versions_design"],
        "stage_seconds": result.metrics["stage_seconds"], "epochs_detail": result.metrics["epochs"],
        "prediction_error": result.metrics.get("prediction_error"),
        "compilations": result.metrics.get("compilations"),
        "seconds": time.time() - started, "data": data.describe(),
    }
    if cfg.holdout is not None:
        summary["validation_metric"] = final
    summary.update(extra or {})
    if out_dir is not None:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        plot_runs({cfg.pipeline.method: {"losses": result.losses, "epochs": result.metrics["epochs"]}},
                  out_dir / "curves.png", metric=task.metric, higher_is_better=task.higher_is_better,
                  split=cfg.eval_split,
                  title=f"{cfg.task} / {cfg.model}: {cfg.pipeline.method}, {summary['stages']} stages")
        summary["out"] = str(out_dir)
    return summary
