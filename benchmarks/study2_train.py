"""Training one run of the second study (benchmarks/study2.py; the equal-time study's runner
shares it): a run to its end or its first part (to a checkpoint, resumed), its row, and the
checkpoints the halving no longer needs."""
from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence, Tuple

BENCHMARKS = Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from pipeoptim.checkpoint import checkpoint_name, latest_checkpoint, read_manifest  # noqa: E402
from pipeoptim.errors import NonFiniteLoss  # noqa: E402
from pipeoptim.experiment import RunConfig, load_data, run_experiment  # noqa: E402
from pipeoptim.lr_schedules import default_warmup  # noqa: E402
from pipeoptim.methods import get_method  # noqa: E402
from pipeoptim.tasks import get_task  # noqa: E402
from study2_plan import (LR_SCHEDULE, LR_WARMUP, SYNCHRONOUS, Run, batches_per_epoch,  # noqa: E402
                         halving_winners, stop_point, sweep_lrs, sweep_run)


class ReachedStop(Exception):
    """A sweep run trained its first part and checkpointed the evaluation it stops at."""


class UntilCheckpoint:
    """One epoch of training mini-batches that ends the run once the checkpoint ``manifest``
    exists: Pipeline.fit drains, evaluates and checkpoints at the stop point, then asks for the
    next mini-batch (or the next epoch's first), and gets :class:`ReachedStop` instead. The
    checkpoint is the one an uninterrupted run writes there, so resuming from it continues the
    same run (same lr schedule over the whole run, same data order, same drains)."""

    def __init__(self, batches: Sequence[Any], manifest: Path) -> None:
        self.batches = batches
        self.manifest = manifest

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches:
            if self.manifest.exists():
                raise ReachedStop
            yield batch


def has_checkpoint(folder: Path) -> bool:
    return latest_checkpoint(folder / "checkpoints") is not None


def train_until(cfg: RunConfig, folder: Path, data: Any, manifest: Path, label: str,
                options: Dict[str, Any]) -> Tuple[bool, Dict[str, Any]]:
    """Train a run's first part, resuming from its folder's last checkpoint if it has one, until
    the checkpoint ``manifest`` is written (at once if it already was: a call stopped between
    the checkpoint and the row). Returns (resumed, the checkpoint's manifest); ``options`` are
    run_experiment's (quiet output, the task, the diagnostic)."""
    resumed = has_checkpoint(folder)
    if not manifest.exists():
        try:
            run_experiment(cfg, out_dir=folder, resume=resumed,
                           data=dataclasses.replace(data, train=UntilCheckpoint(data.train, manifest)), **options)
        except ReachedStop:
            pass
        else:
            raise RuntimeError(f"{label}: trained to the end without reaching its stop point ({manifest.parent.name})")
    return resumed, read_manifest(manifest.parent)


def drop_checkpoints(folder: Path) -> None:
    """Free the disk once a run's checkpoints will never be resumed (the run folder's summary,
    metrics.jsonl and curves stay)."""
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)


def run_config(run: Run, spec: Dict[str, Any]) -> RunConfig:
    """The run's settings: the recipe, identical for every method (checkpoints at the
    evaluations, so that they add no drain of their own)."""
    return RunConfig(task=run.task, model=spec["model"], method=run.method, stages=run.stages,
                     optimizer=run.optimizer, lr=run.lr, epochs=spec["epochs"], batch_size=spec["batch_size"],
                     limit=spec["limit"], seed=run.seed, holdout=spec["holdout"], eval_every=spec["eval_every"],
                     checkpoint_every=spec["eval_every"], lr_schedule=LR_SCHEDULE, clip_grad=spec["clip_grad"],
                     # synchronous methods clip by the whole model's norm, as sequential does (equal runs);
                     # an asynchronous stage never holds one mini-batch's whole gradient: per stage
                     clip_scope="global" if get_method(run.method).synchronous and spec["clip_grad"] else "stage",
                     method_options=resolve_options(run.options, batches_per_epoch(spec) * spec["epochs"]))


def resolve_options(options: Dict[str, Any], updates: int) -> Dict[str, Any]:
    """A variant's method options for a run of ``updates`` updates: LR_WARMUP becomes the lr
    schedule's own warm-up length."""
    return {k: default_warmup(LR_SCHEDULE, updates, None) if v == LR_WARMUP else v for k, v in options.items()}


def curve(evaluations: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The evaluations as time to target reads them: updates, metric, training seconds."""
    return [{"updates": e["updates"], "metric": e["metric"], "seconds": round(e["seconds"], 2)} for e in evaluations]


def cached_data(data_cache: Dict[Any, Any], task_name: str, seed: int, task: Any, resolved: Any) -> Any:
    """The task's data for a run's settings, loaded once for consecutive runs that share them
    (task, seed, batch size, limit, holdout); the cache keeps one entry."""
    key = (task_name, seed, resolved.batch_size, resolved.limit, resolved.holdout)
    if key not in data_cache:
        data_cache.clear()
        data_cache[key] = load_data(task, resolved)
    return data_cache[key]


def quiet_options(task: Any, method: str, diagnose_every: int) -> Dict[str, Any]:
    """run_experiment's settings for a study run: no progress bar or log, the diagnostic every
    ``diagnose_every`` mini-batches for the asynchronous methods (the synchronous ones have none)."""
    return dict(show_progress=False, log=lambda *a, **k: None, task=task,
                diagnose_every=0 if method in SYNCHRONOUS else diagnose_every)


def execute(run: Run, suite: Dict[str, Any], study: Path, data_cache: Dict[Any, Any]) -> Dict[str, Any]:
    """Train ``run`` (a first third, the rest of one, or a whole run) and return its row."""
    spec = suite["tasks"][run.task]
    task = get_task(run.task)
    cfg = run_config(run, spec)
    resolved = cfg.resolved(task)
    data = cached_data(data_cache, run.task, run.seed, task, resolved)
    per_epoch = len(data.train)
    if per_epoch != batches_per_epoch(spec):
        print(f"note: {run.task} has {per_epoch} mini-batches per epoch, the plan counted "
              f"{batches_per_epoch(spec)} (train_examples); the stop point follows the data", flush=True)
    total = per_epoch * spec["epochs"]
    folder = study / "runs" / run.folder_name()
    row: Dict[str, Any] = {**run.key_fields(), "variant": run.variant, "model": spec["model"],
                           "epochs": spec["epochs"], "batch_size": resolved.batch_size, "limit": spec["limit"],
                           "holdout": spec["holdout"], "eval_every": spec["eval_every"],
                           "clip_grad": spec["clip_grad"], "lr_schedule": LR_SCHEDULE, "updates": total,
                           "metric": task.metric, "higher_is_better": task.higher_is_better,
                           "folder": str(folder.relative_to(study))}
    quiet = quiet_options(task, run.method, suite["diagnose_every"])
    started = time.time()
    try:
        if run.until == "third":
            stop = stop_point(per_epoch, spec["epochs"], spec["eval_every"], suite["halving"]["share"])
            manifest = folder / "checkpoints" / checkpoint_name(*divmod(stop, per_epoch)) / "manifest.json"
            row["resumed"], state = train_until(cfg, folder, data, manifest, run.label(), quiet)
            evaluations = state["evaluations"]
            if not evaluations or evaluations[-1]["batch"] != stop:
                raise RuntimeError(f"{manifest}: the last evaluation is not at mini-batch {stop}")
            row.update(diverged=None, stopped_at=stop, final_metric=None,
                       validation_metric=evaluations[-1]["metric"], evaluations=curve(evaluations),
                       train_seconds=round(state["train_seconds"], 1),
                       epoch_losses=[e["loss"] for e in state["epoch_metrics"]],
                       prediction_error=[e.get("prediction_error") for e in state["epoch_metrics"]])
        else:
            row["resumed"] = has_checkpoint(folder)
            summary = run_experiment(cfg, out_dir=folder, resume=row["resumed"], data=data, **quiet)
            evaluations = summary["evaluations"]
            row.update(diverged=None, final_metric=summary["final_metric"],
                       validation_metric=summary["validation_metric"], best_validation=summary["best_metric"],
                       evaluations=curve(evaluations),
                       train_seconds=round(evaluations[-1]["seconds"], 1) if evaluations else None,
                       final_loss=summary["final_loss"], epoch_losses=[e["loss"] for e in summary["epochs_detail"]],
                       # per epoch, each epoch's probes: a resume carries the epochs before it over
                       # (the summary's run-wide value covers only the part since the resume)
                       prediction_error=[e.get("prediction_error") for e in summary["epochs_detail"]],
                       weight_copies=summary["weight_copies"], weight_copies_design=summary["weight_copies_design"],
                       microbatches=summary["microbatches"], resolved_options=summary["options"],
                       samples_per_second=summary["samples_per_second"],
                       predicted_samples_per_second=summary["predicted_samples_per_second"])
    except NonFiniteLoss as error:  # a diverged run is a result of the study, not a failure
        row.update(diverged=str(error), final_metric=None, validation_metric=None)
    row["seconds"] = round(time.time() - started, 1)
    return row


def finished(row: Dict[str, Any]) -> bool:
    """Whether the row's run folder will never be resumed again."""
    return bool(row.get("diverged")) or row.get("until") != "third"


def drop_halved(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]], study: Path) -> None:
    """Delete the checkpoints of the first thirds the halving did not keep."""
    for task, optimizer in suite["cells"]:
        for variant in ["sequential", *suite["methods"]]:
            winners, _ = halving_winners(suite, rows, task, optimizer, variant)
            if winners is None:
                continue
            for lr in sweep_lrs(suite, task, optimizer):
                if lr not in winners:
                    run = sweep_run(suite, task, optimizer, variant, lr, "third")
                    drop_checkpoints(study / "runs" / run.folder_name())


def missing_models(suite: Dict[str, Any]) -> Dict[str, str]:
    """Tasks whose model is not (yet) one of the task's models -> what to say about it."""
    missing = {}
    for name, spec in suite["tasks"].items():
        models = get_task(name).model_names()
        if spec["model"] not in models:
            missing[name] = f"task {name} has no model {spec['model']!r} (it has {', '.join(models)})"
    return missing
