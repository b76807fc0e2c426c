"""The `pipeoptim` command: one subcommand per module in this package.

Every subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func`` to a function taking the parsed arguments and returning the exit code. Errors the user
can fix (a bad option, a missing data set, a package of the lab extra not installed) print
one line and exit with code 2.

Building the parsers imports neither torch nor matplotlib (schedules are pure data, and
``--help`` needs only names and defaults): the subcommand modules import what trains, profiles
or plots inside their ``run`` functions.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Dict, List, Optional

from ..errors import CheckpointError, Interrupted, MissingDataError, NonFiniteLoss, command_line_words, signals_handled
from ..lab.config import LAB_OPTIONS
from ..options import OPTIONS
from . import bench as _bench
from . import compare as _compare
from . import plan as _plan
from . import schedule as _schedule
from . import train as _train
from .common import missing_lab_package

SUBCOMMANDS = [_train, _compare, _schedule, _bench, _plan]


class UserError(Exception):
    """A mistake the user can fix: reported as one line, exit code 2, no traceback."""


def own_flags(parser: argparse.ArgumentParser, command: str) -> Dict[str, str]:
    """Subcommand ``command``'s flags by their destination (``memory_limit``: ``--memory-limit``),
    so that a refusal of an option in neither option table names the flag too."""
    found: Dict[str, str] = {}
    for action in parser._actions:  # (argparse keeps a parser's actions there)
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            for own in action.choices[command]._actions:
                if own.option_strings and own.dest != "help":
                    found[own.dest] = max(own.option_strings, key=len)
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeoptim",
        description="Pipeline-parallel training with optimizer-dependent weight prediction "
                    "(PipeOptim) and its baselines.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in SUBCOMMANDS:
        module.register(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what was given (a default is not)
    try:
        with command_line_words((*OPTIONS, *LAB_OPTIONS), own_flags(parser, args.command)):  # flags, not keywords
            return int(args.func(args) or 0)
    except (UserError, ValueError, MissingDataError, CheckpointError) as error:
        if os.environ.get("PIPEOPTIM_DEBUG"):
            raise
        print(f"pipeoptim {args.command}: error: {error}", file=sys.stderr)
        return 2
    except ImportError as error:  # the engine alone installed: the lab's packages are missing
        missing = missing_lab_package(error)
        if missing is None or os.environ.get("PIPEOPTIM_DEBUG"):
            raise
        print(f"pipeoptim {args.command}: error: {missing}", file=sys.stderr)
        return 2
    except NonFiniteLoss as error:
        print(f"pipeoptim {args.command}: stopped: {error}; the last good checkpoint is kept "
              f"(continue with --resume RUN_DIR after lowering --lr)", file=sys.stderr)
        return 1
    except KeyboardInterrupt as error:  # Ctrl-C; Interrupted: also SIGTERM, SIGHUP, with what to resume
        signum = error.signum if isinstance(error, Interrupted) else signal.SIGINT
        text = str(error) or f"interrupted by {signal.Signals(signum).name}"
        with signals_handled(signal.SIG_IGN):  # a second Ctrl-C while this is said: no traceback
            print(f"pipeoptim {args.command}: {text}", file=sys.stderr)
            if argv is None:  # the program itself, not a call from Python: end now, as its stages
                sys.stdout.flush()  # do, rather than spend a second or more tearing down
                sys.stderr.flush()
                os._exit(128 + signum)
        return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
