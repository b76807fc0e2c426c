"""What `train`, `compare` and `bench` share: the parsed options turned into a RunConfig, checked.

Like every module of the command line, this one imports no torch: building the parsers (and so
`pipeoptim --help`) needs only names and defaults; what trains is imported when a command runs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

from ..lab.config import flag_given
from ..lab.optimizers import check_options
from ..methods import clip_scope_for, get_method, method_names
from ..options import of_scope
from .flags import NO_CLIPPING

#: the methods' own options, by name (passed to the Pipeline as keywords)
METHOD_OPTIONS = [o.name for o in of_scope("method")]

#: the packages of the ``lab`` extra, as imported (pyproject.toml's, each imported under its own
#: name; ``pip install .`` leaves them out), and the command that installs them, as the README's
#: Install section gives it
LAB_EXTRA = ("matplotlib", "sentencepiece", "sacrebleu", "tensorboard")
LAB_INSTALL = "pip install '.[lab]' in the clone   (or: make setup)"

if TYPE_CHECKING:
    from ..lab.config import RunConfig


def refuse_traced_model(task_name: str, model: Optional[str], command: str) -> None:
    """``pipeoptim plan`` and ``bench`` profile and split an ``nn.Sequential`` layer by layer; a
    model the Pipeline traces (``Task.traced_model_names``) is refused with the fix (imports the
    task, so torch: call it when the command runs)."""
    from ..lab.tasks import get_task

    task = get_task(task_name)
    traced = task.traced_model_names()
    if model in traced:
        others = ", ".join(m for m in task.model_names() if m not in traced)
        raise ValueError(f"pipeoptim {command} profiles an nn.Sequential layer by layer, and {task_name}'s "
                         f"model {model} is traced by torch.export instead, which {command} cannot profile "
                         f"yet: {command} one of {others}, or train {model} with `pipeoptim train --task "
                         f"{task_name} --model {model}` (split by --partitioner uniform or params)")


def method_options(args: argparse.Namespace, method: str, strict: bool = True) -> Dict[str, Any]:
    """The method-specific options the user set; one the method does not take is an error
    (``strict``, for one method) or is left out (for a comparison of several)."""
    from ..methods import get_method

    given = {key: getattr(args, key, None) for key in METHOD_OPTIONS}
    given = {k: v for k, v in given.items() if v is not None and v is not False}  # a switch off: not given
    meth = get_method(method)
    if not strict:
        return {k: v for k, v in given.items() if k in meth.options}
    for key in given:
        if key not in meth.options:
            takers = [m for m in method_names() if key in get_method(m).options]
            raise ValueError(f"--{key.replace('_', '-')} applies to {', '.join(takers)}, not {method}")
    if getattr(args, "continuous", False) and meth.synchronous:
        raise ValueError(f"--continuous applies to asynchronous methods; {method} flushes before every update")
    check = dict(given)  # the values, checked now (the default T is only known with the data)
    if check.get("lr_correction") == "delay" and "lr_correction_steps" not in check:
        check["lr_correction_steps"] = 1
    from ..checks import check_method_options

    check_method_options(meth, check)
    return given


def run_config(args: argparse.Namespace, method: str, strict: bool = True) -> RunConfig:
    """The RunConfig of ``method`` from the parsed options (see :func:`method_options`): every
    option the record holds, read by its name; a setting the command line leaves out taken from
    the task's recipe (pipeoptim.lab.tasks.recipes), the peak lr the equal-time study's advice
    trains with where the run is the advised setting, else the study's tuning for ``method`` where
    there is one (``lr_source`` says). Then the command line's own rules: the
    stages (--partition's, else 4), clipping and its scope, --continuous for a synchronous method."""
    from ..lab.config import LAB_OPTIONS, RECORDED, RunConfig, record_name
    from ..lab.tasks.advice import advised_lr
    from ..lab.tasks.recipes import default_lr, recipe

    base = recipe(args.task)
    given = {record_name(o): getattr(args, record_name(o)) for o in (*LAB_OPTIONS, *RECORDED)
             if o.scope != "cli" and o.flag.in_config and hasattr(args, record_name(o))}
    for key, value in base.as_dict().items():  # the recipe's, where no flag says
        if given.get(key, 0) is None and key not in ("lr", "clip_grad"):
            given[key] = value
    chunks = getattr(args, "chunks", None)
    stages = stages_of(args, chunks or get_method(method).chunks)
    options = method_options(args, method, strict)
    lr, lr_source = (args.lr, "--lr") if args.lr is not None else (
        advised_lr(args.task, stages, given["optimizer"], method, options)
        or default_lr(args.task, given["optimizer"], method))
    clip = base.clip_grad if args.clip_grad is None else None if args.clip_grad == NO_CLIPPING else args.clip_grad
    return RunConfig(**{**given, "method": method, "lr": lr, "lr_source": lr_source, "clip_grad": clip,
                        "clip_scope": clip_scope_of(args, method, strict, clip),
                        "stages": stages,
                        "continuous": bool(given.get("continuous")) and not get_method(method).synchronous,
                        "method_options": options})


def clip_scope_of(args: argparse.Namespace, method: str, strict: bool, clip: Optional[float]) -> str:
    """--clip-scope for ``method``: global clipping needs a synchronous method (an error for one
    method; per stage for the asynchronous ones of a comparison). Without --clip-scope (or with
    auto), the engine's ``auto``: a synchronous method clips as a plain loop does (by the whole
    model's norm: the same numbers as sequential), an asynchronous one per stage (no stage holds a
    mini-batch's whole gradient); the run's record names the scope that ``auto`` chose."""
    scope = getattr(args, "clip_scope", None)
    meth = get_method(method)
    if scope in (None, "auto"):  # the engine's default: global where the method allows it
        return clip_scope_for(meth, "auto") if clip is not None else "stage"
    if clip is None:
        raise ValueError(f"--clip-scope applies with clipping, and the {args.task} recipe does not clip: "
                         f"give --clip-grad MAX_NORM")
    if not strict:  # a comparison: the asynchronous methods clip per stage
        return "stage" if scope == "global" and not meth.synchronous else scope
    from ..checks import check_clipping

    check_clipping(meth, clip, scope)
    return scope


def stages_of(args: argparse.Namespace, chunks: int = 1) -> int:
    """--stages, else the partition's length (over ``chunks`` pieces per stage), else 4."""
    if args.stages is not None:
        return args.stages
    return max(1, len(args.partition) // chunks) if args.partition else 4


def check_positive(args: argparse.Namespace, names: Sequence[str]) -> None:
    """Refuse a flag of ``names`` given below 1."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def check_numbers(args: argparse.Namespace) -> None:
    """Reject impossible numbers before loading anything."""
    check_positive(args, ("stages", "epochs", "batch_size", "limit", "micro_batches", "eval_every", "holdout", "chunks",
                          "data_parallel", "tensor_parallel"))
    if getattr(args, "continuous", False) and getattr(args, "eval_every", None):
        raise ValueError("--continuous never drains, so it cannot evaluate every K mini-batches; "
                         "drop --continuous or --eval-every")
    if args.lr is not None and not args.lr > 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    optimizer = getattr(args, "optimizer", None)
    if optimizer is None and getattr(args, "task", None) is not None:  # the recipe's, as run_config takes it
        from ..lab.tasks.recipes import recipe

        optimizer = recipe(args.task).optimizer
    if optimizer is not None:  # --momentum, --beta1, --adamw-lr fit the optimizer
        check_options(optimizer, None, getattr(args, "weight_decay", 0.0), getattr(args, "momentum", None),
                      getattr(args, "beta1", None), getattr(args, "adamw_lr", None))
    clip = getattr(args, "clip_grad", None)
    if clip not in (None, NO_CLIPPING) and not clip > 0:
        raise ValueError(f"--clip-grad must be a positive max norm (or none), got {clip}")
    if getattr(args, "clip_scope", None) not in (None, "auto") and clip == NO_CLIPPING:
        raise ValueError("--clip-scope applies with clipping: drop --clip-grad none")
    if getattr(args, "warmup_steps", None) is not None and args.warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be 0 or more, got {args.warmup_steps}")


def output_dir(args: argparse.Namespace, label: str) -> Path:
    out = args.out or Path("runs") / f"{args.task}-{label}-{time.strftime('%Y%m%d-%H%M%S')}"
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        if (out / "summary.json").exists() or (out / "compare.json").exists():
            raise ValueError(f"{out} already holds a run; choose another --out or pass --overwrite")
    return out


def missing_lab_package(error: ImportError) -> Optional[str]:
    """The one line that reports ``error`` where it is a package of the lab extra that is not
    installed (the engine alone, ``pip install .``, ships the command without them), naming the
    install command; None for any other ImportError. An ImportError raised from such a one with
    the fix in its own words (``schedule --format png``) keeps them."""
    for found in (error, error.__cause__):
        name = getattr(found, "name", None) if isinstance(found, ImportError) else None
        if name and name.split(".")[0] in LAB_EXTRA:
            if found is not error:
                return str(error)
            return f"the command line needs the lab extra (missing: {name.split('.')[0]}): {LAB_INSTALL}"
    return None


def say_default_task(args: argparse.Namespace, log: Callable[..., None]) -> None:
    """A run without --task (nor a --plan that sets it) takes the image task: say so first, naming
    the others (rank 0 alone under torchrun)."""
    import os

    from ..lab.tasks import task_names

    if not flag_given(args, "--task") and getattr(args, "plan", None) is None and os.environ.get("RANK", "0") == "0":
        log(f"task: {args.task} (the default; --task {'|'.join(task_names())})")


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


def log_for(args: argparse.Namespace) -> Callable[..., None]:
    """print, or to stderr with --json (stdout then holds the JSON alone)."""
    return (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print


def known_methods(text: str) -> List[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in method_names()]
    if unknown:
        raise ValueError(f"unknown method {', '.join(unknown)}; choose from: {', '.join(method_names())}")
    if not names:
        raise ValueError("--methods is empty")
    return names
