"""The command line speaks one dialect (issue 49, finding 10): every subcommand's parser is built
as `pipeoptim` builds it, and an option that several subcommands take has one spelling, one kind
of flag (a switch, a flag that takes a value, or one of a set of choices; a value that may be left
out) and one default in all of them, except where :data:`DIFFERENCES` lists the subcommand's
flag and its ``--help`` says why; ``--help`` speaks in what one types, never in Python's words.
"""
from __future__ import annotations

import argparse
import re
from typing import Dict, Tuple

from pipeoptim.cli import build_parser
from pipeoptim.lab.config import LAB_OPTIONS
from pipeoptim.options import OPTIONS

#: (flag, subcommand) -> words its --help must hold, which say why its kind or default differs
#: from the other subcommands'. Each entry is a documented difference; one whose flag agrees with
#: the others, or that a subcommand no longer has, fails (the list does not outlive its reason).
DIFFERENCES: Dict[Tuple[str, str], str] = {
    # train and compare: the --partition decides the stages, and without it 4, as plan and schedule
    ("--stages", "train"): "the --partition's",
    ("--stages", "compare"): "the --partition's",
    # bench: one process per stage, each on a core of its own
    ("--stages", "bench"): "a core of its own",
    # schedule: with --from-csv the file's ranks (a --stages given must agree with them), else 4
    ("--stages", "schedule"): "the file's",
    # bench times the same number of mini-batches in every run; plan predicts an epoch, schedule
    # shows a number that depends on the schedule
    ("--batches", "bench"): "not an epoch",
    # plan profiles on one device; train and compare place every stage (auto)
    ("--device", "plan"): "where to profile",
    # bench measures speed, which the learning rate does not change: no recipe, no tuned lr
    ("--lr", "bench"): "does not depend on it",
    # each command's own set: compare trains (a few methods, the reference), bench times every
    # pipelined method, plan considers those it can predict
    ("--methods", "bench"): "methods to time",
    ("--methods", "plan"): "methods to consider",
    # plan searches several micro-batch counts; the others run one (the method's own by default)
    ("--micro-batches", "plan"): "micro-batch counts to consider",
    # train and compare take the optimizer with the recipe's lr and schedule (adamw for every task)
    ("--optimizer", "train"): "the task's recipe",
    ("--optimizer", "compare"): "the task's recipe",
    # plan writes the file that `pipeoptim train --plan FILE` reads; the others a run folder or none
    ("--out", "plan"): "plan file",
    # plan profiles in this process; train's --threads are each stage process's under torchrun
    ("--threads", "plan"): "while profiling",
}

#: Python's words, which a command line never types (a backquoted command is left out)
API_WORDS = re.compile(r"\bTrue\b|\bFalse\b|\bNone\b|\blist\b|\bDataLoader\b|\bbool\b|\bnn\.")
#: the options' API names with an underscore: their flags are spelled with dashes
API_NAMES = re.compile(r"\b(" + "|".join(sorted((o.name for o in (*OPTIONS, *LAB_OPTIONS) if "_" in o.name),
                                                key=len, reverse=True)) + r")\b")


def subcommands() -> Dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return dict(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices)


def kind(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "switch"
    return ("choices" if action.choices else "value") + (", optional" if action.nargs == "?" else "")


def default(action: argparse.Action):
    """The default as one would type it (schedule parses its own numbers: its "4" is 4)."""
    return None if action.default is None else str(action.default)


def help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return " ".join(parser._get_formatter()._expand_help(action).split()) if action.help else ""


def flags() -> Dict[str, Dict[str, Tuple[str, object, str]]]:
    """flag -> subcommand -> (kind, default, help), every flag but --help."""
    out: Dict[str, Dict[str, Tuple[str, object, str]]] = {}
    for command, parser in subcommands().items():
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    out.setdefault(flag, {})[command] = (kind(action), default(action), help_text(parser, action))
    return out


def test_an_option_has_one_kind_and_one_default_in_every_subcommand():
    table = flags()
    wrong = []
    for flag, by_command in sorted(table.items()):
        plain = {(k, d) for c, (k, d, _) in by_command.items() if (flag, c) not in DIFFERENCES}
        if len(plain) > 1:
            wrong.append(f"{flag}: " + "; ".join(f"{c} {k}, default {d!r}" for c, (k, d, _) in by_command.items()))
    assert not wrong, "one option, several kinds or defaults:\n" + "\n".join(wrong)


def test_each_documented_difference_differs_and_its_help_says_why():
    table = flags()
    for (flag, command), why in DIFFERENCES.items():
        has = command in table.get(flag, {})
        assert has, f"{command} has no {flag}: drop it from DIFFERENCES"
        k, d, text = table[flag][command]
        others = {(ok, od) for c, (ok, od, _) in table[flag].items() if (flag, c) not in DIFFERENCES}
        assert others and others != {(k, d)}, f"{command} {flag} agrees with the others now: drop it from DIFFERENCES"
        assert why in text, f"{command} {flag}: its help should say why it differs ({why!r}): {text!r}"


def test_no_two_flags_spell_one_option():
    table = flags()
    spellings: Dict[str, set] = {}
    for flag in table:
        if flag.startswith("--"):
            spellings.setdefault(re.sub(r"[-_]", "", flag.lower()), set()).add(flag)
    assert not [s for s in spellings.values() if len(s) > 1], [sorted(s) for s in spellings.values() if len(s) > 1]
    long_of: Dict[str, set] = {}  # an option (its dest) has one long flag across the subcommands
    for command, parser in subcommands().items():
        for action in parser._actions:
            long = [f for f in action.option_strings if f.startswith("--") and f != "--help"]
            if long:
                long_of.setdefault(action.dest, set()).update(long)
    assert not {d: f for d, f in long_of.items() if len(f) > 1}


def test_help_speaks_in_what_one_types():
    wrong = []
    for command, parser in subcommands().items():
        for action in parser._actions:
            text = re.sub(r"`[^`]*`", "", help_text(parser, action))  # a command, as one types it
            for pattern in (API_WORDS, API_NAMES):
                found = pattern.findall(text)
                if found:
                    wrong.append(f"{command} {'/'.join(action.option_strings) or action.dest}: {found}")
    assert not wrong, "help in Python's words:\n" + "\n".join(sorted(set(wrong)))
