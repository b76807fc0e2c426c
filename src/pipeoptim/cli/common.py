"""Options shared by `train`, `compare` and `bench`, and turning them into a RunConfig.

Like every module of the command line, this one imports no torch: building the parsers (and so
`pipeoptim --help`) needs only names and defaults; what trains is imported when a command runs.
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from ..methods import get_method, method_names
from ..optimizers import check_options, optimizer_names
from ..lr_schedules import LR_SCHEDULES
from ..runtime.defaults import DEFAULT_TIMEOUT
from ..tasks import task_names

if TYPE_CHECKING:
    from ..experiment import RunConfig


def refuse_traced_model(task_name: str, model: Optional[str], command: str) -> None:
    """``pipeoptim plan`` and ``bench`` profile and split an ``nn.Sequential`` layer by layer; a
    model the Pipeline traces (``Task.traced_model_names``) is refused with the fix (imports the
    task, so torch: call it when the command runs)."""
    from ..tasks import get_task

    task = get_task(task_name)
    traced = task.traced_model_names()
    if model in traced:
        others = ", ".join(m for m in task.model_names() if m not in traced)
        raise ValueError(f"pipeoptim {command} profiles an nn.Sequential layer by layer, and {task_name}'s "
                         f"model {model} is traced by torch.export instead, which {command} cannot profile "
                         f"yet: {command} one of {others}, or train {model} with `pipeoptim train --task "
                         f"{task_name} --model {model}` (split by --partitioner uniform or params)")


def int_list(text: str) -> List[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def clip_norm(text: str) -> Any:
    """--clip-grad: a max norm, or ``none`` (no clipping where the task's recipe clips)."""
    if text.strip().lower() == "none":
        return NO_CLIPPING
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a max norm or none, got {text!r}") from None


#: ``--clip-grad none``: told apart from a flag not given (which takes the recipe's clipping)
NO_CLIPPING = "none"


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The task, model, data, optimizer and pipeline options of a training run."""
    g = parser.add_argument_group("task and data")
    g.add_argument("--task", default="image", choices=task_names(), help="data set and models (default: image)")
    g.add_argument("--model", help="model of the task (default: the task's recipe, see --recipe; "
                   "`pipeoptim train --task T --model list` lists them)")
    g.add_argument("--batch-size", type=int, help="mini-batch size (default: the task's recipe)")
    g.add_argument("--limit", type=int, help="use at most this many training examples (quick runs)")
    g.add_argument("--epochs", type=int, help="passes over the training data (default: the task's recipe)")
    g.add_argument("--seed", type=int, default=0, help="seed of the data order and the initial weights")
    g = parser.add_argument_group("evaluation during training")
    g.add_argument("--eval-every", type=int, metavar="K",
                   help="also evaluate every K mini-batches of an epoch (default: at each epoch's end "
                        "only), for curves of the metric against updates and time (metrics.jsonl lines "
                        "of type eval; evaluations in the summary). The pipeline drains there, as at a "
                        "checkpoint: synchronous methods train the same whatever K, asynchronous ones "
                        "restart their warm-up after each drain, so their results depend on K")
    g.add_argument("--holdout", type=int, metavar="N",
                   help="hold N training examples out as a validation split, evaluated during training "
                        "instead of the test split, which is evaluated once at the end (summary: "
                        "validation_metric and the test final_metric). image: the last N images of the "
                        "training file; lm: N blocks of further training chapters; sentiment: the first "
                        "N of its fixed validation split. Default: no validation split")
    g = parser.add_argument_group("pipeline")
    g.add_argument("--stages", type=int, help="pipeline stages (default: the --partition's, else 4; "
                   "sequential uses 1)")
    g.add_argument("--micro-batches", type=int, help="micro-batches per mini-batch (gpipe, 1f1b-flush, zb-h1, interleaved, zb-v, "
                   "pipedream-2bw, pipeoptim-2bw, xpipe, pipeoptim; default: the method's)")
    g.add_argument("--chunks", type=int, help="model chunks per stage (interleaved; default 2): the model is cut "
                   "into stages x V pieces, stage k holding pieces k, k + N, ...; --partition then lists "
                   "every piece")
    g.add_argument("--partition", type=int_list, help="layers per stage, e.g. 3,3,2 (default: --partitioner)")
    g.add_argument("--partitioner", default="uniform", choices=["uniform", "params"],
                   help="how to split layers when --partition is not given (default: uniform)")
    g.add_argument("--continuous", action="store_true", help="no drain between epochs (async methods)")
    g.add_argument("--steps", choices=["exact", "paper", "code"],
                   help="pipeoptim: prediction steps s (exact: updates before the backward; paper: "
                        "N-1-k; code: N-k as the authors' code). Default exact")
    g.add_argument("--backward", choices=["latest", "predicted"],
                   help="pipeoptim: weights of the backward pass (default latest, as the paper)")
    g.add_argument("--sgd-momentum", choices=["paper", "code"],
                   help="pipeoptim with SGD momentum: Delta = m (paper) or mu*m + (1-dampening)*g (code)")
    g.add_argument("--vertical-sync", action="store_true", help="pipedream: every stage uses stage 0's version")
    g = parser.add_argument_group(
        "delay corrections (asynchronous methods; all off by default)",
        "Options of async-naive, pipedream, spectrain, xpipe and pipeoptim; the last four also "
        "shape the prediction of spectrain, xpipe and pipeoptim. Formulas and costs: "
        "`python -m pydoc pipeoptim.weights.corrections`.")
    g.add_argument("--lr-correction", choices=["none", "delay"],
                   help="delay (PipeMare): stage k with delay tau = N-1-k applies lr(t) / tau^(1 - min(t/T, 1)); "
                        "no weight copy")
    g.add_argument("--lr-correction-steps", type=int, metavar="T",
                   help="updates over which the delay correction anneals to the scheduled lr "
                        "(default: 30%% of the run's updates)")
    g.add_argument("--horizon", choices=["constant", "scheduled"],
                   help="scheduled: the prediction spans the scheduler's lrs of the next s updates, "
                        "not s * lr(t) (equal under a constant lr); no weight copy")
    g.add_argument("--delta", choices=["optimizer", "ema"],
                   help="ema: Delta is a moving average of the updates applied, per unit lr (sees weight "
                        "decay, clipping, schedules; any optimizer); one more weight copy per stage")
    g.add_argument("--ema-decay", type=float, metavar="G", help="decay of --delta ema (default 0.9)")
    g.add_argument("--prediction-warmup", type=int, metavar="T",
                   help="the prediction's step count ramps as s * min(1, t/T) over the first T updates")
    g.add_argument("--sync-warmup", type=int, metavar="K",
                   help="the first K mini-batches run 1F1B with a flush (no staleness), then the "
                        "asynchronous schedule")
    g = parser.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=optimizer_names(),
                   help="default: the task's recipe (momentum is SGD with 0.9). muon: torch.optim.Muon "
                        "on the hidden weight matrices (the 2-D weights of nn.Linear layers except the "
                        "model's output layer), AdamW on the rest (embeddings, norms, biases, the output "
                        "layer), one optimizer per stage; --lr is Muon's, --adamw-lr AdamW's")
    g.add_argument("--lr", type=float, help="peak learning rate (default: the one the study tuned for this "
                   "method, task and optimizer, else the recipe's; the run prints which)")
    g.add_argument("--weight-decay", type=float, default=0.0,
                   help="weight decay (default: 0, i.e. none, except that adamw and muon keep torch's "
                        "own: AdamW 0.01, Muon 0.1)")
    g.add_argument("--momentum", type=float, help="momentum coefficient (momentum, nesterov, rmsprop; "
                   "muon: Muon's, default 0.95)")
    g.add_argument("--beta1", type=float, metavar="B",
                   help="first-moment decay beta1 of adam, adamw, adamax, nadam, radam and muon's AdamW "
                        "part (default 0.9; beta2 stays 0.999), e.g. --optimizer nadam --beta1 0.99")
    g.add_argument("--adamw-lr", type=float, metavar="LR",
                   help="muon: the learning rate of its AdamW part (default: --lr / 10); the lr "
                        "schedule scales it as it scales --lr")
    g.add_argument("--lr-schedule", choices=LR_SCHEDULES,
                   help="default: the task's recipe (warmup-cosine); constant; warmup-cosine: linear "
                        "warm-up, then cosine decay to 10%% "
                        "of --lr; step: x0.1 at half of the updates, x0.01 at three quarters")
    g.add_argument("--warmup-steps", type=int, metavar="W",
                   help="updates of linear warm-up (default: 5%% of the updates for warmup-cosine, 0 for step)")
    g.add_argument("--clip-grad", type=clip_norm, metavar="MAX_NORM",
                   help="clip the gradient norm to MAX_NORM before each update (see --clip-scope); "
                        "none: no clipping (default: the task's recipe)")
    g.add_argument("--clip-scope", choices=["stage", "global"],
                   help="stage: each stage clips its own gradient; global: by the norm over all stages, "
                        "as a plain loop clips the whole model (synchronous methods only). Default: "
                        "global for the synchronous methods (equal to sequential), stage for the others")
    g = parser.add_argument_group("precision and devices")
    g.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: forwards and backwards under torch.autocast; weights, optimizer state "
                        "and prediction stay fp32 (default: fp32)")
    g.add_argument("--recompute", action="store_true",
                   help="activation recomputation: each stage keeps only its input per micro-batch in "
                        "flight and runs its forward again in the backward (same losses; less memory, "
                        "one more forward)")
    g.add_argument("--device", default="auto", metavar="DEV",
                   help="auto (default: one GPU per stage when there are enough, else the CPU), one "
                        "device for all stages (cpu, cuda, cuda:1), or one per stage: cuda:0,cuda:1")
    g = parser.add_argument_group("output")
    g.add_argument("--out", type=Path, help="run folder (default: runs/<task>-<method>-<time>)")
    g.add_argument("--overwrite", action="store_true", help="allow writing into a folder that holds a run")
    g.add_argument("--json", action="store_true", help="print the summary as JSON on stdout, nothing else")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_distributed_options(parser: argparse.ArgumentParser) -> None:
    """The options of the distributed runtime, read by :mod:`pipeoptim.launcher`
    (idempotent: a parser that has them is left as is)."""
    existing = {s for a in parser._actions for s in a.option_strings}
    if "--timeout" in existing:
        return
    g = parser.add_argument_group(
        "distributed runtime (--runtime distributed)",
        "One process per stage. Without torchrun, torchrun is started for you on this machine; "
        "under torchrun (torchrun --nproc-per-node N -m pipeoptim train --runtime distributed ...) "
        "the world size is the number of stages. Several machines: run torchrun on each with "
        "--nnodes, --node-rank, --master-addr/--master-port (or --rdzv-backend c10d "
        "--rdzv-endpoint HOST:PORT). See `python -m pydoc pipeoptim.launcher`.")
    g.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help="seconds a stage waits for a peer before the run fails (default: %(default)g)")
    if "--device" not in existing:  # `train` and `compare` have it among the run options
        g.add_argument("--device", default="cpu", help="cpu: gloo; cuda: NCCL, one GPU per stage "
                       "(cuda:LOCAL_RANK). Default cpu")
    g.add_argument("--threads", type=int, default=1,
                   help="compute threads per stage process on CPU (default: 1)")


#: The delay-correction flags, by option name (pipeoptim.methods.DELAY_OPTIONS, PREDICTION_OPTIONS).
CORRECTION_FLAGS = ("lr_correction", "lr_correction_steps", "horizon", "delta", "ema_decay",
                    "prediction_warmup", "sync_warmup")


def method_options(args: argparse.Namespace, method: str, strict: bool = True) -> Dict[str, Any]:
    """The method-specific options the user set; one the method does not take is an error
    (``strict``, for one method) or is left out (for a comparison of several)."""
    from ..methods import get_method

    given = {"steps": args.steps, "backward": args.backward, "sgd_momentum": args.sgd_momentum,
             "vertical_sync": True if args.vertical_sync else None}
    given.update({key: getattr(args, key, None) for key in CORRECTION_FLAGS})
    given = {k: v for k, v in given.items() if v is not None}
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
    try:
        meth.resolve_options(check)
    except ValueError as error:  # name the flag, not the option
        message = str(error)
        for key in sorted(CORRECTION_FLAGS, key=len, reverse=True):
            message = re.sub(rf"\b{key}\b(=)?", lambda m, key=key: "--" + key.replace("_", "-") + (" " if m.group(1) else ""), message)
        raise ValueError(message) from None
    return given


def run_config(args: argparse.Namespace, method: str, strict: bool = True) -> RunConfig:
    """The RunConfig of ``method`` from the parsed options (see :func:`method_options`), every
    setting the command line leaves out taken from the task's recipe (pipeoptim.tasks.recipes),
    the peak lr from the study's tuning for ``method`` where there is one (``lr_source`` says)."""
    from ..experiment import RunConfig
    from ..tasks.recipes import default_lr, recipe

    base = recipe(args.task)
    optimizer = args.optimizer or base.optimizer
    lr, lr_source = (args.lr, "--lr") if args.lr is not None else default_lr(args.task, optimizer, method)
    clip = base.clip_grad if args.clip_grad is None else None if args.clip_grad == NO_CLIPPING else args.clip_grad
    options = method_options(args, method, strict)
    continuous = args.continuous and not get_method(method).synchronous
    chunks = getattr(args, "chunks", None)
    return RunConfig(task=args.task, model=args.model or base.model, method=method,
                     stages=stages_of(args, chunks or get_method(method).chunks), chunks=chunks,
                     micro_batches=args.micro_batches, partition=args.partition, partitioner=args.partitioner,
                     optimizer=optimizer, lr=lr, lr_source=lr_source, weight_decay=args.weight_decay,
                     momentum=args.momentum, beta1=args.beta1, adamw_lr=args.adamw_lr,
                     epochs=args.epochs or base.epochs,
                     batch_size=args.batch_size or base.batch_size, limit=args.limit, seed=args.seed,
                     continuous=continuous, method_options=options,
                     lr_schedule=args.lr_schedule or base.lr_schedule, warmup_steps=args.warmup_steps,
                     clip_grad=clip, clip_scope=clip_scope_of(args, method, strict, clip),
                     precision=args.precision, recompute=args.recompute, device=args.device,
                     eval_every=args.eval_every,
                     holdout=args.holdout)


def clip_scope_of(args: argparse.Namespace, method: str, strict: bool, clip: Optional[float]) -> str:
    """--clip-scope for ``method``: global clipping needs a synchronous method (an error for one
    method; per stage for the asynchronous ones of a comparison). Without --clip-scope, a
    synchronous method clips as a plain loop does (by the whole model's norm: the same numbers as
    sequential), an asynchronous one per stage (no stage holds a mini-batch's whole gradient)."""
    scope = getattr(args, "clip_scope", None)
    synchronous = get_method(method).synchronous
    if scope is None:
        return "global" if synchronous and clip is not None else "stage"
    if clip is None:
        raise ValueError(f"--clip-scope applies with clipping, and the {args.task} recipe does not clip: "
                         f"give --clip-grad MAX_NORM")
    if scope == "global" and not synchronous:
        if strict:
            raise ValueError(f"--clip-scope global needs every stage to update the same mini-batch at "
                             f"once, which only synchronous methods do; {method} updates each stage at "
                             f"its own time: use --clip-scope stage")
        return "stage"
    return scope


def stages_of(args: argparse.Namespace, chunks: int = 1) -> int:
    """--stages, else the partition's length (over ``chunks`` pieces per stage), else 4."""
    if args.stages is not None:
        return args.stages
    return max(1, len(args.partition) // chunks) if args.partition else 4


def check_numbers(args: argparse.Namespace) -> None:
    """Reject impossible numbers before loading anything."""
    for name in ("stages", "epochs", "batch_size", "limit", "micro_batches", "eval_every", "holdout", "chunks"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if getattr(args, "continuous", False) and getattr(args, "eval_every", None):
        raise ValueError("--continuous never drains, so it cannot evaluate every K mini-batches; "
                         "drop --continuous or --eval-every")
    if args.lr is not None and not args.lr > 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    optimizer = getattr(args, "optimizer", None)
    if optimizer is None and getattr(args, "task", None) is not None:  # the recipe's, as run_config takes it
        from ..tasks.recipes import recipe

        optimizer = recipe(args.task).optimizer
    if optimizer is not None:  # --momentum, --beta1, --adamw-lr fit the optimizer
        check_options(optimizer, None, getattr(args, "weight_decay", 0.0), getattr(args, "momentum", None),
                      getattr(args, "beta1", None), getattr(args, "adamw_lr", None))
    clip = getattr(args, "clip_grad", None)
    if clip not in (None, NO_CLIPPING) and not clip > 0:
        raise ValueError(f"--clip-grad must be a positive max norm (or none), got {clip}")
    if getattr(args, "clip_scope", None) is not None and clip == NO_CLIPPING:
        raise ValueError("--clip-scope applies with clipping: drop --clip-grad none")
    if getattr(args, "warmup_steps", None) is not None and args.warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be 0 or more, got {args.warmup_steps}")


def output_dir(args: argparse.Namespace, label: str) -> Path:
    out = args.out or Path("runs") / f"{args.task}-{label}-{time.strftime('%Y%m%d-%H%M%S')}"
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        if (out / "summary.json").exists() or (out / "compare.json").exists():
            raise ValueError(f"{out} already holds a run; choose another --out or pass --overwrite")
    return out


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


def known_methods(text: str) -> List[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in method_names()]
    if unknown:
        raise ValueError(f"unknown method {', '.join(unknown)}; choose from: {', '.join(method_names())}")
    if not names:
        raise ValueError("--methods is empty")
    return names
