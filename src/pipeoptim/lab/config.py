"""The lab's options and the command line's configuration of a run.

The engine's options (the Pipeline's, fit's and the methods') are defined in
:mod:`pipeoptim.options`; the lab adds its own here, defined the same way: the task and its
data, the optimizer and learning-rate schedule by name, and what only the command line has (the
run folder, the output). :class:`RunConfig` holds one run's settings: a field per lab option,
and the engine's options as they are, embedded whole (``pipeline``: a
:class:`~pipeoptim.config.PipelineConfig`, ``fit``: a :class:`~pipeoptim.config.FitConfig`).
Its *record*, the run folder's ``config.json``, is flat, under the names the command line's
flags parse into (:func:`record_name`); ``tests/test_options.py`` holds the fields, the flags
and the tables to each other.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from ..config import FitConfig, PipelineConfig
from ..options import NOT_GIVEN, OPTIONS, Flag, Option
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
    Option("task", "str", "image", "the data set and its models", "lab", Flag(group=TASK, choices=tuple(task_names()))),
    Option("model", "Optional[str]", None, "a model of the task (default: the task's recipe; `pipeoptim train --task T "
           "--model list` lists them)", "lab", Flag(group=TASK)),
    Option("batch_size", "Optional[int]", None, "mini-batch size (default: the task's recipe)", "lab", Flag("int", group=TASK)),
    Option("limit", "Optional[int]", None, "use at most this many training examples (quick runs)", "lab", Flag("int", group=TASK)),
    Option("seed", "int", 0, "seed of the data order and the initial weights", "lab", Flag("int", group=TASK)),
    Option("holdout", "Optional[int]", None, "hold N training examples out as a validation split, evaluated during training "
           "instead of the test split, which is evaluated once at the end (summary: validation_metric and "
           "the test final_metric). image: the last N images of the training file; lm: N blocks of further "
           "training chapters; sentiment: the first N of its fixed validation split. Default: no "
           "validation split", "lab", Flag("int", metavar="N", group="evaluation during training")),
    # the optimizer by name: the engine's optimizer is the factory the run builds from it
    Option("optimizer_name", "str", "momentum",
           "the optimizer by name (momentum is SGD with 0.9). muon: torch.optim.Muon "
           "on the hidden weight matrices (the 2-D weights of the linear layers except the model's output "
           "layer), AdamW on the rest (embeddings, norms, biases, the output layer), one optimizer per "
           "stage; --lr is Muon's, --adamw-lr AdamW's", "lab",
           Flag(group=OPTIMIZER, name="--optimizer", config="optimizer", choices=tuple(optimizer_names()),
                default=NOT_GIVEN,
                note=f"default: the task's recipe's, which sets the lr and schedule with it ({RECIPE_OPTIMIZERS})")),
    Option("lr", "Optional[float]", None, "peak learning rate (default: the advice's where the run is the equal-time study's "
           "advised setting, else the one the study tuned for this method, task and optimizer, else the recipe's; "
           "the run prints which)", "lab", Flag("float", group=OPTIMIZER)),
    Option("weight_decay", "float", 0.0, "weight decay (0, i.e. none, except that adamw and muon keep torch's own: "
           "AdamW 0.01, Muon 0.1)", "lab", Flag("float", group=OPTIMIZER)),
    Option("momentum", "Optional[float]", None, "momentum coefficient (momentum, nesterov, rmsprop; muon: Muon's, default "
           "0.95)", "lab", Flag("float", group=OPTIMIZER)),
    Option("beta1", "Optional[float]", None, "first-moment decay beta1 of adam, adamw, adamax, nadam, radam, muon's AdamW "
           "part (default 0.9) and delay-nadamw (default 0.99); beta2 stays 0.999; e.g. --optimizer nadam --beta1 0.99", "lab",
           Flag("float", metavar="B", group=OPTIMIZER)),
    Option("adamw_lr", "Optional[float]", None, "muon: the learning rate of its AdamW part (default: lr / 10); the lr schedule "
           "scales it as it scales lr", "lab", Flag("float", metavar="LR", group=OPTIMIZER)),
    Option("lr_schedule", "str", "constant", "constant; warmup-cosine: linear warm-up, then cosine decay to 10% of "
           "lr; step: x0.1 at half of the updates, x0.01 at three quarters", "lab",
           Flag(group=OPTIMIZER, choices=tuple(LR_SCHEDULES), default=NOT_GIVEN,
                note="default: the task's recipe (warmup-cosine)")),
    Option("warmup_steps", "Optional[int]", None, "updates of linear warm-up (default: 5% of the updates for warmup-cosine, "
           "at least 1, at most a third of them: none in a run of 1 or 2 updates; 0 for step)", "lab",
           Flag("int", metavar="W", group=OPTIMIZER)),
    Option("runtime", "str", "local", "local: all stages in this process; distributed: one process per pipeline rank "
           "(started with torchrun for you, or run under torchrun)", "lab",
           Flag(choices=("local", "distributed"), group="method", only="train", in_config=False)),
    Option("methods", "str", "sequential,gpipe,async-naive,pipedream,pipeoptim", "comma-separated method names", "cli",
           Flag(group="method", only="compare")),
    # -- what the command line alone has (scope "cli": no field of the run's configuration) --
    Option("recipe", "bool", False, "print the --task's recipe and the lrs tuned per method, then exit", "cli",
           Flag("switch", group="", only="train")),
    Option("plan", "Any", None, "a plan from `pipeoptim plan`: sets --task, --model, --batch-size, --stages, "
           "--partition, --method and --micro-batches (the plan's values win)", "cli",
           Flag("path", metavar="FILE", group="", only="train")),
    Option("out", "Any", None, "run folder (default: runs/<task>-<method>-<time>)", "cli", Flag("path", group=OUTPUT)),
    Option("overwrite", "bool", False, "allow writing into a folder that holds a run", "cli",
           Flag("switch", group=OUTPUT)),
    Option("json", "bool", False, "print the summary as JSON on stdout, nothing else (what its throughputs count: "
           "python -m pydoc pipeoptim.lab.experiment)", "cli", Flag("switch", group=OUTPUT)),
    Option("no_progress", "bool", False, "no progress bar", "cli", Flag("switch", group=OUTPUT)),
)

#: RunConfig fields the run fills itself (no option): where the lr came from
DERIVED_FIELDS = ("lr_source",)


def record_name(option: Option) -> str:
    """The name of an option in a run's record and in the parsed flags (its own, or the one its
    flag gives)."""
    return option.flag.config if option.flag is not None and option.flag.config else option.name


#: the record's names that differ from the options' (``clip_grad``: ``clip_grad_norm``)
RECORD_ALIASES: Dict[str, str] = {record_name(o): o.name for o in (*OPTIONS, *LAB_OPTIONS) if record_name(o) != o.name}
#: the engine's options the record holds: those the command line takes, in the tables' order
RECORDED: Tuple[Option, ...] = tuple(o for o in OPTIONS if o.flag is not None and o.flag.in_config
                                     and o.scope in ("pipeline", "fit"))
_PIPELINE = {f.name for f in dataclasses.fields(PipelineConfig)}
_FIT = {f.name for f in dataclasses.fields(FitConfig)}


def _devices(value: Any) -> Any:
    """``--device``'s value as the Pipeline takes it: a name, or one per stage (``a,b``: a list)."""
    return value.split(",") if isinstance(value, str) and "," in value else value


@dataclass(init=False)
class RunConfig:
    """Every setting of a run, as the command line takes them: one field per option of
    :data:`LAB_OPTIONS` that the record holds, and the engine's options whole, in ``pipeline``
    (the Pipeline's and the method's own) and ``fit``. What each means is said once, in the
    option tables.

    It is made from the record's flat names too, ``RunConfig(task="image", stages=2,
    optimizer="adamw", clip_grad=1.0)`` (as :meth:`record` writes them; an engine option goes
    into ``pipeline`` or ``fit``), and reads and sets them by those names
    (``cfg.stages`` is ``cfg.pipeline.stages``): one value, in one place."""

    task: str = "image"
    model: Optional[str] = None
    batch_size: Optional[int] = None
    limit: Optional[int] = None
    seed: int = 0
    holdout: Optional[int] = None
    optimizer_name: str = "momentum"
    lr: Optional[float] = None
    #: where ``lr`` came from, as the run prints it (the command line says: --lr, tuned for the
    #: method by a study, or the recipe's); None: given by the caller
    lr_source: Optional[str] = None
    weight_decay: float = 0.0
    momentum: Optional[float] = None
    beta1: Optional[float] = None
    adamw_lr: Optional[float] = None
    lr_schedule: str = "constant"
    warmup_steps: Optional[int] = None
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    fit: FitConfig = field(default_factory=FitConfig)

    def __init__(self, pipeline: Any = None, fit: Any = None, **settings: Any) -> None:
        engine: Dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name not in ("pipeline", "fit"):
                object.__setattr__(self, f.name, f.default)
        self.pipeline = PipelineConfig(**pipeline) if isinstance(pipeline, dict) else pipeline or PipelineConfig()
        self.fit = FitConfig(**fit) if isinstance(fit, dict) else fit or FitConfig()
        for key, value in settings.items():
            name = RECORD_ALIASES.get(key, key)
            if name in _PIPELINE or name in _FIT:
                engine[name] = value
            elif name in self.__dataclass_fields__:
                object.__setattr__(self, name, value)
            else:
                raise TypeError(f"RunConfig got an unexpected keyword argument {key!r}")
        self._set_engine(engine)

    def _set_engine(self, values: Dict[str, Any]) -> None:
        if "devices" in values:
            values["devices"] = _devices(values["devices"])
        pipeline = {k: v for k, v in values.items() if k in _PIPELINE}
        if pipeline:
            object.__setattr__(self, "pipeline", self.pipeline.replace(**pipeline))
        if len(pipeline) < len(values):
            object.__setattr__(self, "fit", self.fit.replace(**{k: v for k, v in values.items() if k not in pipeline}))

    def __getattr__(self, name: str) -> Any:  # only for names that are no attribute: the record's
        if name.startswith("__") or "fit" not in self.__dict__:
            raise AttributeError(name)
        name = RECORD_ALIASES.get(name, name)
        if name == "optimizer_name":
            return self.optimizer_name
        for part in (self.pipeline, self.fit):
            if name in part.__dataclass_fields__:
                return getattr(part, name)
        raise AttributeError(f"RunConfig has no setting {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        name = RECORD_ALIASES.get(name, name)
        if name not in self.__dataclass_fields__ and (name in _PIPELINE or name in _FIT):
            self._set_engine({name: value})
        else:
            object.__setattr__(self, name, value)

    def record(self) -> Dict[str, Any]:
        """The run's record (``config.json``): every field of this configuration and every engine
        option the command line takes, flat, under the names the flags parse into."""
        record = {record_name(o) if o.name == "optimizer_name" else o.name: getattr(self, o.name)
                  for o in LAB_OPTIONS if o.scope == "lab" and o.flag.in_config}
        record["lr_source"] = self.lr_source
        for option in RECORDED:
            value = getattr(self.pipeline if option.name in _PIPELINE else self.fit, option.name)
            record[record_name(option)] = ",".join(map(str, value)) if option.name == "devices" and \
                isinstance(value, (list, tuple)) else value
        record["method_options"] = dict(self.pipeline.method_options)
        return record

    @property
    def eval_split(self) -> str:
        """The split evaluated during training: ``validation`` with ``holdout``, else ``test``."""
        return "validation" if self.holdout is not None else "test"

    def resolved(self, task: Task) -> "RunConfig":
        """Fill the task's defaults (model, batch size, learning rate)."""
        cfg = dataclasses.replace(self)
        cfg.model = cfg.model or task.default_model
        if cfg.model not in task.model_names():
            raise ValueError(f"task {task.name} has no model {cfg.model!r}; choose one of: "
                             f"{', '.join(task.model_names())}")
        cfg.batch_size = cfg.batch_size or task.default_batch_size
        if cfg.lr is None:
            cfg.lr = task.default_lr.get(cfg.optimizer_name, 1e-3)
            cfg.lr_source = cfg.lr_source or f"the {task.name} task's usual lr for {cfg.optimizer_name}"
        return cfg


def flag_given(args: Any, flag: str) -> bool:
    """Whether the command line gave ``flag`` (``args.argv``: the words ``pipeoptim.cli.main`` was
    called with; an abbreviation argparse took counts, ``--stage`` for ``--stages``); without
    ``args.argv`` (parsed outside ``main``): True."""
    words = getattr(args, "argv", None)
    return words is None or any(len(w.split("=")[0]) > 2 and flag.startswith(w.split("=")[0]) for w in words)
