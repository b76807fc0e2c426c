"""`pipeoptim compare`: several methods on the same data, seed and weights.

They start from the same initial weights; one table and one plot of them all."""
from __future__ import annotations

import argparse
import json
import textwrap

from ..methods import get_method, variant_name
from ..lab.tasks import get_task
from ..lab.tasks.advice import advice
from .flags import add_run_options
from .common import check_numbers, known_methods, log_for, output_dir, print_json, run_config, say_default_task


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="compare methods on one task",
                       description="Run each method on the same data, seed and initial weights; print "
                                   "one table and write compare.png with all the curves.")
    add_run_options(p, "compare")
    p.set_defaults(func=run)


#: what the table's throughputs count (python -m pydoc pipeoptim.lab.experiment: the summary's keys)
COLUMNS_KEY = ["samples/s: each run's samples over its whole training in this one process, the stages taking turns "
               "on its cores (epoch-end evaluations and checkpoints included)",
               "predicted samples/s: the schedule simulated with one device per stage, from the stages' measured "
               "times (no transfer cost)"]


def format_table(rows, metric: str, higher_is_better: bool = True) -> str:
    """One line per run, named as ``pipeoptim plan`` names it (``pipeoptim-2bw+ef`` where a run had
    error feedback). With a validation split (``--holdout``) the final test metric, the final
    validation metric and the best validation metric; else the final and best test metric. Under
    it, what the throughput columns count (:data:`COLUMNS_KEY`)."""
    validated = any(r.get("validation_metric") is not None for r in rows)
    best = f"best {'validation ' if validated else ''}{metric}" + ("" if higher_is_better else " (lowest)")
    head = ["method", f"final {'test ' if validated else ''}{metric}"]
    head += [f"validation {metric}"] if validated else []
    head += [best, "final loss", "peak lr", "weight copies", "samples/s", "predicted samples/s"]
    lines = []
    for r in rows:
        copies = ",".join(f"{c:g}" for c in r["weight_copies"])
        pred = r.get("predicted_samples_per_second")
        cells = [variant_name(r["method"], r.get("options") or {}), f"{r['final_metric']:.4f}"]  # pipeoptim-2bw+ef
        cells += [f"{r['validation_metric']:.4f}"] if validated else []
        tuned = "*" if (r.get("lr_source") or "").startswith("tuned") else ""
        lines.append(cells + [f"{r['best_metric']:.4f}", f"{r['final_loss']:.4f}", f"{r['lr']:g}{tuned}" if r.get("lr") is not None else "-", copies,
                              f"{r['samples_per_second']:.0f}", f"{pred:.0f}" if pred else "-"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    table = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(l) for l in lines]
    table += COLUMNS_KEY
    if any((r.get("lr_source") or "").startswith("tuned") for r in rows):
        table.append("* each method at its own peak lr, as the study tuned it (--lr: one lr for all)")
    return "\n".join(table)


def warm_up(task, cfg, data) -> None:
    """One untimed forward and backward, so that the first method measured does not pay for the
    process's first kernels and allocations (which made it look up to 5x slower)."""
    model = task.build_model(cfg.model, data, seed=cfg.seed)
    inputs, target = data.train[0]
    task.loss(model(inputs), target).backward()


def run(args: argparse.Namespace) -> int:
    from ..lab.experiment import load_data, run_experiment
    from ..lab.plots import plot_runs

    check_numbers(args)
    methods = known_methods(args.methods)
    configs = [run_config(args, m, strict=False) for m in methods]  # validates before any work
    for option in ("steps", "backward", "sgd_momentum", "vertical_sync"):
        if getattr(args, option) and not any(option in get_method(m).options for m in methods):
            raise ValueError(f"--{option.replace('_', '-')} applies to none of {', '.join(methods)}")
    out = output_dir(args, "compare")
    log = log_for(args)
    say_default_task(args, log)
    task = get_task(args.task)
    first = configs[0].resolved(task)
    data = load_data(task, first)
    lrs = "lr " + (f"{first.lr:g}" if args.lr is not None else "per method (" + ", ".join(
        f"{c.pipeline.method} {c.lr if c.lr is not None else 'the task default'}" for c in configs) + ")")
    log(f"{args.task}: {len(data.train)} mini-batches of {first.batch_size} per epoch, model {first.model}, "
        f"{first.pipeline.stages} stages, {first.optimizer_name} {lrs}, {first.lr_schedule}, "
        f"{first.fit.epochs} epochs")
    warm_up(task, first, data)
    rows = []
    for cfg in configs:
        rows.append(run_experiment(cfg, out_dir=out / cfg.pipeline.method, show_progress=not args.no_progress,
                                   log=log, task=task, data=data))
    plot = plot_runs({r["method"]: {"losses": r["losses"], "epochs": r["epochs_detail"]} for r in rows},
                     out / "compare.png", metric=task.metric, higher_is_better=task.higher_is_better,
                     split=first.eval_split,
                     title=f"{args.task} / {first.model}, {first.stages} stages, {first.optimizer}")
    recommended, advice_text = advice(args.task, first.stages)
    report = {"task": args.task, "model": first.model, "stages": first.stages, "metric": task.metric,
              "runs": rows, "plot": str(plot), "advice": advice_text,
              "recommended": None if recommended is None else recommended.method,
              # the method with its options as pipeoptim plan names it (pipeoptim-2bw+ef: with error feedback)
              "recommended_variant": None if recommended is None else recommended.variant()}
    (out / "compare.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print_json(report)
    else:
        print()
        print(format_table(rows, task.metric, task.higher_is_better))
        print(f"\nplot: {plot}\nrun folders: {out}/<method>/")
        print("\n" + textwrap.fill(f"which method to use: {advice_text}", width=100, subsequent_indent="  ",
                                  break_long_words=False, break_on_hyphens=False))
    return 0
