"""The command line's flags of a training run, built from the option tables.

Every flag of ``pipeoptim train`` and ``compare`` that sets an option is made here from that
option's one definition (:mod:`pipeoptim.options` for the engine's, :mod:`pipeoptim.lab.config`
for the lab's): its flag name, type, choices, default and the meaning ``--help`` prints. Which
methods take a method's own option, and the values it allows, are read from the method registry.
Imports no torch, so that ``pipeoptim --help`` starts fast.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional

from ..lab.config import LAB_OPTIONS
from ..methods import METHODS
from ..options import CORRECTIONS, NOT_GIVEN, OPTIONS, Option, takers

#: ``--clip-grad none``: told apart from a flag not given (which takes the recipe's clipping)
NO_CLIPPING = "none"

#: the ``--help`` groups, in the order they are shown, with the descriptions some of them carry
GROUPS: Dict[str, Optional[str]] = {
    "": None,
    "method": None,
    "task and data": None,
    "evaluation during training": None,
    "pipeline": None,
    CORRECTIONS: "Options of async-naive, pipedream, spectrain, xpipe and pipeoptim; horizon, delta, "
                 "ema_decay and prediction_warmup shape the prediction of spectrain, xpipe and pipeoptim. "
                 "Formulas and costs: `python -m pydoc pipeoptim.weights.corrections`.",
    "optimizer": None,
    "precision and devices": None,
    "output": None,
    "distributed runtime": "One process per pipeline rank of each replica (--runtime distributed). Without torchrun, "
                           "torchrun is started for you on this machine; under torchrun (torchrun "
                           "--nproc-per-node N -m pipeoptim train --runtime distributed ...) the world size is "
                           "the number of stages, times D with --data-parallel D. Several machines: run torchrun on each with --nnodes, --node-rank, "
                           "--master-addr/--master-port (or --rdzv-backend c10d --rdzv-endpoint HOST:PORT). "
                           "See `python -m pydoc pipeoptim.lab.launcher`.",
}


def int_list(text: str) -> List[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def clip_norm(text: str) -> Any:
    """--clip-grad: a max norm, or ``none`` (no clipping where the task's recipe clips)."""
    if text.strip().lower() == NO_CLIPPING:
        return NO_CLIPPING
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a max norm or none, got {text!r}") from None


#: a flag's ``type`` name -> the parser of its value
TYPES: Dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str, "ints": int_list,
                                          "norm": clip_norm, "path": Path}


def run_options(command: str) -> List[Option]:
    """The options ``command`` (``train``, ``compare`` or ``distributed``) takes as flags."""
    return [o for o in (*LAB_OPTIONS, *OPTIONS)
            if o.flag is not None and (o.flag.only == command or (o.flag.only is None and command != "distributed"))]


def cli_default(option: Option) -> Any:
    """The flag's default: the flag's own (None where the recipe, the method or the run decides),
    None for a method's option (one not given is not passed on), else the option's."""
    flag = option.flag
    if flag.default is NOT_GIVEN:
        return None
    if flag.default is not None:
        return flag.default
    if flag.type == "switch":
        return False
    return None if option.scope == "method" else option.default


def flag_help(option: Option, note: str = "") -> str:
    """What ``--help`` says of the flag: the option's meaning (in the command line's words where
    the flag has its own), the methods that take a method's option, the command line's note and
    the command's own ``note``, the default."""
    text = option.flag.help or option.help
    if option.scope == "method" and option.flag.group != CORRECTIONS:
        text = f"{', '.join(takers(option.name, METHODS))}: {text}"
    for extra in (option.flag.note, note):
        if extra:
            text += f"; {extra}"
    text = text.replace("%", "%%")
    default = cli_default(option)
    if default not in (None, False) and "default:" not in text:
        text += " (default: %(default)s)"
    return text


def add_flag(group: Any, option: Option, note: str = "") -> None:
    """The option's flag in ``group``: its name, parser, choices (the flag's, else the option's),
    default and ``--help`` text (with the command's ``note``), stored under
    the RunConfig field's name; a flag with a ``const`` takes its value optionally."""
    flag = option.flag
    dest = flag.config if flag.config and option.scope != "method" else option.name  # the RunConfig field
    kwargs: Dict[str, Any] = {"dest": dest, "help": flag_help(option, note), "default": cli_default(option)}
    if flag.type == "switch":
        kwargs["action"] = "store_true"
    else:
        kwargs["type"] = TYPES[flag.type]
        if flag.const is not None:
            kwargs.update(nargs="?", const=flag.const)
        choices = flag.choices or option.choices
        if choices:
            kwargs["choices"] = list(choices)
        if flag.metavar:
            kwargs["metavar"] = flag.metavar
    group.add_argument(flag.flag_name(option.name), **kwargs)


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option]) -> None:
    """Each option's flag, in its ``--help`` group (made in :data:`GROUPS` order)."""
    options = list(options)
    used = {o.flag.group for o in options}
    groups: Dict[str, Any] = {}
    for name, description in GROUPS.items():
        if name in used:
            groups[name] = parser if name == "" else parser.add_argument_group(name, description)
    for option in options:
        add_flag(groups[option.flag.group], option)


def add_table_flags(group: Any, *names: str, notes: Optional[Dict[str, str]] = None) -> None:
    """The flags of the options ``names`` as the tables define them, in ``group``; ``notes``:
    what the command adds to an option's ``--help`` (by the option's name)."""
    for option in (o for o in (*LAB_OPTIONS, *OPTIONS) if o.name in names):
        add_flag(group, option, (notes or {}).get(option.name, ""))


def add_run_options(parser: argparse.ArgumentParser, command: str) -> None:
    """The options of a training run that ``command`` (``train`` or ``compare``) takes."""
    add_options(parser, run_options(command))


def add_distributed_options(parser: argparse.ArgumentParser) -> None:
    """The options of the distributed runtime (--timeout, --threads; --device where the parser
    has none), read by :mod:`pipeoptim.lab.launcher`; a parser that has them is left as is."""
    existing = {s for a in parser._actions for s in a.option_strings}
    if "--timeout" in existing:
        return
    add_options(parser, run_options("distributed"))
    if "--device" not in existing:  # `train` and `compare` have it among the run options
        group = next(g for g in parser._action_groups if g.title == "distributed runtime")
        group.add_argument("--device", default="cpu", help="cpu: gloo; cuda: NCCL, one GPU per stage "
                           "(cuda:LOCAL_RANK). Default cpu")
