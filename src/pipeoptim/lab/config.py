"""The lab's options and the configuration of one run, as the command line takes them.

The engine's options (the Pipeline's, fit's and the methods') are defined in
:mod:`pipeoptim.options`; the lab adds its own here, defined the same way: the task and its
data, the optimizer and learning-rate schedule by name, and what only the command line has (the
run folder, the output). :class:`RunConfig` holds one run's settings, every field named after
its option (or the ``config`` name the option's flag gives); ``tests/test_options.py`` holds the
fields, the flags and the two tables to each other.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from ..options import NOT_GIVEN, Flag, Option
from ..runtime.defaults import DEFAULT_METHOD
from .lr_schedules import LR_SCHEDULES
from .optimizers import optimizer_names
from .tasks import task_names
from .tasks.recipes import RECIPES

if TYPE_CHECKING:
    from .tasks import Task

#: the recipes' optimizers, as --optimizer's help says them (pipeoptim bench and plan default to adamw)
RECIPE_OPTIMIZERS = ("adamw for every task" if {r.optimizer for r in RECIPES.values()} == {"adamw"} else
                     ", ".join(f"{task}: {r.optimizer}" for task, r in RECIPES.items()))

TASK = "task and data"  # the --help groups of the lab's flags
OPTIMIZER = "optimizer"
OUTPUT = "output"

#: the lab's options: what a run of a task needs beyond the engine's
LAB_OPTIONS: Tuple[Option, ...] = (
    Option("task", "image", "the data set and its models", "lab", Flag(group=TASK, choices=tuple(task_names()))),
    Option("model", None, "a model of the task (default: the task's recipe; `pipeoptim train --task T "
           "--model list` lists them)", "lab", Flag(group=TASK)),
    Option("batch_size", None, "mini-batch size (default: the task's recipe)", "lab", Flag("int", group=TASK)),
    Option("limit", None, "use at most this many training examples (quick runs)", "lab", Flag("int", group=TASK)),
    Option("seed", 0, "seed of the data order and the initial weights", "lab", Flag("int", group=TASK)),
    Option("holdout", None, "hold N training examples out as a validation split, evaluated during training "
           "instead of the test split, which is evaluated once at the end (summary: validation_metric and "
           "the test final_metric). image: the last N images of the training file; lm: N blocks of further "
           "training chapters; sentiment: the first N of its fixed validation split. Default: no "
           "validation split", "lab", Flag("int", metavar="N", group="evaluation during training")),
    Option("optimizer", "momentum", "the optimizer by name (momentum is SGD with 0.9). muon: torch.optim.Muon "
           "on the hidden weight matrices (the 2-D weights of the linear layers except the model's output "
           "layer), AdamW on the rest (embeddings, norms, biases, the output layer), one optimizer per "
           "stage; --lr is Muon's, --adamw-lr AdamW's", "lab",
           Flag(group=OPTIMIZER, choices=tuple(optimizer_names()), default=NOT_GIVEN,
                note=f"default: the task's recipe's, which sets the lr and schedule with it ({RECIPE_OPTIMIZERS})")),
    Option("lr", None, "peak learning rate (default: the one the study tuned for this method, task and "
           "optimizer, else the recipe's; the run prints which)", "lab", Flag("float", group=OPTIMIZER)),
    Option("weight_decay", 0.0, "weight decay (0, i.e. none, except that adamw and muon keep torch's own: "
           "AdamW 0.01, Muon 0.1)", "lab", Flag("float", group=OPTIMIZER)),
    Option("momentum", None, "momentum coefficient (momentum, nesterov, rmsprop; muon: Muon's, default "
           "0.95)", "lab", Flag("float", group=OPTIMIZER)),
    Option("beta1", None, "first-moment decay beta1 of adam, adamw, adamax, nadam, radam, muon's AdamW "
           "part (default 0.9) and delay-nadamw (default 0.99); beta2 stays 0.999; e.g. --optimizer nadam --beta1 0.99", "lab",
           Flag("float", metavar="B", group=OPTIMIZER)),
    Option("adamw_lr", None, "muon: the learning rate of its AdamW part (default: lr / 10); the lr schedule "
           "scales it as it scales lr", "lab", Flag("float", metavar="LR", group=OPTIMIZER)),
    Option("lr_schedule", "constant", "constant; warmup-cosine: linear warm-up, then cosine decay to 10% of "
           "lr; step: x0.1 at half of the updates, x0.01 at three quarters", "lab",
           Flag(group=OPTIMIZER, choices=tuple(LR_SCHEDULES), default=NOT_GIVEN,
                note="default: the task's recipe (warmup-cosine)")),
    Option("warmup_steps", None, "updates of linear warm-up (default: 5% of the updates for warmup-cosine, "
           "0 for step)", "lab", Flag("int", metavar="W", group=OPTIMIZER)),
    Option("runtime", "local", "local: all stages in this process; distributed: one process per stage "
           "(started with torchrun for you, or run under torchrun)", "lab",
           Flag(choices=("local", "distributed"), group="method", only="train", in_config=False)),
    Option("methods", "sequential,gpipe,async-naive,pipedream,pipeoptim", "comma-separated method names", "cli",
           Flag(group="method", only="compare")),
    # -- what the command line alone has (scope "cli": no field of the run's configuration) --
    Option("recipe", False, "print the --task's recipe and the lrs tuned per method, then exit", "cli",
           Flag("switch", group="", only="train")),
    Option("plan", None, "a plan from `pipeoptim plan`: sets --task, --model, --batch-size, --stages, "
           "--partition, --method and --micro-batches (the plan's values win)", "cli",
           Flag("path", metavar="FILE", group="", only="train")),
    Option("out", None, "run folder (default: runs/<task>-<method>-<time>)", "cli", Flag("path", group=OUTPUT)),
    Option("overwrite", False, "allow writing into a folder that holds a run", "cli",
           Flag("switch", group=OUTPUT)),
    Option("json", False, "print the summary as JSON on stdout, nothing else", "cli", Flag("switch", group=OUTPUT)),
    Option("no_progress", False, "no progress bar", "cli", Flag("switch", group=OUTPUT)),
)

#: RunConfig fields the run fills itself (no option): where the lr came from
DERIVED_FIELDS = ("lr_source",)


@dataclass
class RunConfig:
    """Every setting of a run, as the command line takes them: one field per option of
    :data:`LAB_OPTIONS` and of the engine's that the command line takes (named as
    :func:`config_field` says; the method's own options in ``method_options``). What each means
    is said once, in the option tables."""

    task: str = "image"
    model: Optional[str] = None
    method: str = DEFAULT_METHOD
    stages: int = 4
    micro_batches: Optional[int] = None
    chunks: Optional[int] = None
    partition: Optional[List[int]] = None
    partitioner: str = "uniform"
    optimizer: str = "momentum"
    lr: Optional[float] = None
    #: where ``lr`` came from, as the run prints it (the command line says: --lr, tuned for the
    #: method by a study, or the recipe's); None: given by the caller
    lr_source: Optional[str] = None
    weight_decay: float = 0.0
    momentum: Optional[float] = None
    beta1: Optional[float] = None
    adamw_lr: Optional[float] = None
    epochs: int = 1
    batch_size: Optional[int] = None
    limit: Optional[int] = None
    seed: int = 0
    continuous: bool = False
    checkpoint_every: Optional[int] = None
    async_checkpoint: bool = False
    method_options: Dict[str, Any] = field(default_factory=dict)
    lr_schedule: str = "constant"
    warmup_steps: Optional[int] = None
    clip_grad: Optional[float] = None
    clip_scope: str = "auto"
    precision: str = "fp32"
    recompute: bool = False
    compile: Optional[str] = None
    data_parallel: Optional[int] = None
    shard_replicas: bool = False
    device: str = "auto"
    eval_every: Optional[int] = None
    eval_in_bubbles: bool = False
    holdout: Optional[int] = None

    def devices(self) -> Any:
        """``device`` as Pipeline takes it: a name, or a list with one per stage."""
        return self.device.split(",") if "," in self.device else self.device

    @property
    def eval_split(self) -> str:
        """The split evaluated during training: ``validation`` with ``holdout``, else ``test``."""
        return "validation" if self.holdout is not None else "test"

    def resolved(self, task: Task) -> "RunConfig":
        """Fill the task's defaults (model, batch size, learning rate)."""
        cfg = RunConfig(**asdict(self))
        cfg.model = cfg.model or task.default_model
        if cfg.model not in task.model_names():
            raise ValueError(f"task {task.name} has no model {cfg.model!r}; choose one of: "
                             f"{', '.join(task.model_names())}")
        cfg.batch_size = cfg.batch_size or task.default_batch_size
        if cfg.lr is None:
            cfg.lr = task.default_lr.get(cfg.optimizer, 1e-3)
            cfg.lr_source = cfg.lr_source or f"the {task.name} task's usual lr for {cfg.optimizer}"
        return cfg


def config_field(option: Option) -> str:
    """The RunConfig field of an option (its name, or the name its flag gives)."""
    return option.flag.config if option.flag is not None and option.flag.config else option.name
