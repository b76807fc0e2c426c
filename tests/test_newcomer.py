"""The cheap form of scripts/newcomer.py, which follows the README from a fresh clone (by hand:
minutes). Read with the script's own parser, every command of the README's blocks names a program
and flags that exist, checked without running them (the command line's parser, torchrun's, the
example scripts' argparse read from their source, the Makefile's targets); the pycon session
compiles; and the script's comparison and terminal fail where they must. The quickstart's output
itself is held to a real run in tests/test_examples.py, the short command lines' here."""
from __future__ import annotations

import contextlib
import doctest
import io
import re
import sys
from pathlib import Path
from typing import List

import pytest

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
newcomer = load_script("newcomer")
COMMANDS = newcomer.commands((ROOT / "README.md").read_text())


def where(command) -> str:
    return f"README.md:{command.line}: {command.text.splitlines()[0]}"


def test_the_readme_holds_what_a_newcomer_runs_in_order():
    """Setup and activation, the quickstart in one process and under torchrun, the checkpoint
    recipe after it, and at least three commands of the command line, in the README's order."""
    console = [c for c in COMMANDS if c.kind == "console"]
    words = [c.argv() for c in console]
    order = [" ".join(w[:2]) for w in words]
    assert order[:2] == ["make setup", ". .venv/bin/activate"], order
    quickstart = order.index("python examples/transformers_causal_lm.py")
    assert sum(w[0] == "torchrun" and "examples/transformers_causal_lm.py" in w for w in words) >= 2
    recipe = next(k for k, c in enumerate(COMMANDS) if c.kind == "pycon")
    assert COMMANDS.index(console[quickstart]) < recipe, "the recipe converts the quickstart's checkpoint"
    # it converts the checkpoint the quickstart's run says it wrote
    written = re.search(r"^exported: (\S+) -> ", "\n".join(console[quickstart].shown), flags=re.M).group(1)
    run, name = written.split("/checkpoints/")
    assert f'"{run}"' in COMMANDS[recipe].text and f"checkpoints/{name}" in COMMANDS[recipe].text
    assert sum(w[0] == "pipeoptim" for w in words) >= 3
    assert all(c.shown for c in console if c.argv()[0] in ("python", "torchrun", "pipeoptim")), \
        "a command the newcomer check runs shows what it prints"


def _script_flags(command, script: str, args: List[str]) -> None:
    path = ROOT / script
    assert path.is_file(), f"{where(command)}: no such script {script}"
    unknown = newcomer.unknown_flags(args, newcomer.script_flags(path))
    assert unknown == [], f"{where(command)}: {script} takes no {unknown}"


def _parses(parser, argv: List[str], command):
    """``parser``'s namespace of ``argv``; a flag it does not take fails the test, naming the line."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where(command)}: {said.getvalue().strip()}")


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.kind == "console"], ids=lambda c: f"line{c.line}")
def test_every_readme_command_names_a_program_and_flags_that_exist(command):
    words = command.argv()
    program, args = words[0], words[1:]
    if program == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M)
        assert set(args) <= set(targets), f"{where(command)}: the Makefile has no target {set(args) - set(targets)}"
    elif program in (".", "source"):
        assert args == [".venv/bin/activate"], where(command)
        assert ".venv" in (ROOT / "scripts" / "setup.sh").read_text()  # what make setup builds
    elif program == "python":
        assert not args[0].startswith("-"), f"{where(command)}: the check knows scripts, not {args[0]}"
        _script_flags(command, args[0], args[1:])
    elif program == "torchrun":
        from torch.distributed.run import get_args_parser

        launch = _parses(get_args_parser(), args, command)
        _script_flags(command, launch.training_script, launch.training_script_args)
    elif program == "pipeoptim":
        from pipeoptim.cli import build_parser

        _parses(build_parser(), args, command)
    else:
        pytest.fail(f"{where(command)}: the newcomer check does not know the program {program!r}: "
                    f"teach tests/test_newcomer.py to check its flags")


def test_the_readme_python_sessions_compile():
    sessions = [c for c in COMMANDS if c.kind == "pycon"]
    assert sessions
    for session in sessions:
        examples = doctest.DocTestParser().get_examples(session.text)
        assert examples and all(e.source.strip() for e in examples), where(session)
        compile("".join(e.source for e in examples), f"README.md:{session.line}", "exec")


# ---------------------------------------------------------------------------------------------
# the script's comparison and terminal


SHOWN = ["[notice] once", "epoch 1: loss 4.758657", "Writing: 100%|██████████| 1/1 [00:00<00:00, 374.52it/s]",
         "final loss 1.222418, 38 samples/s in 12.5 s", "epoch 1/1: 426 training samples/s",
         "run folder: runs/image-20261205-145002"]


def test_the_comparison_excepts_timings_and_bars_alone():
    seen = ["[notice] once", "epoch 1: loss 4.758657",
            "Writing: 100%|█████████████████████████████████| 1/1 [00:01<00:00,  0.91s/it]",
            "final loss 1.222418, 5120 samples/s in 3 s", "epoch 1/1: 12.5 training samples/s",
            "run folder: runs/image-20270101-000000"]
    assert newcomer.difference(SHOWN, seen) is None
    changed = list(seen)
    changed[1] = "epoch 1: loss 4.758658"  # the 6th decimal
    problem = newcomer.difference(SHOWN, changed)
    assert "epoch 1: loss 4.758657" in problem and "closest line" in problem and "4.758658" in problem
    assert newcomer.difference(SHOWN, seen[:-1]) is not None                      # a line missing
    assert newcomer.difference(SHOWN, seen + ["more"]) is not None               # one more at the end
    assert newcomer.difference(SHOWN, ["a warning"] + seen) is not None          # one more at the start
    assert newcomer.difference(SHOWN, seen[:2] + ["between"] + seen[2:]) is not None


def test_dots_stand_for_lines_left_out_anywhere():
    shown = ["...", "final loss 1.199699", "..."]
    assert newcomer.difference(shown, ["W1205 notice", "final loss 1.199699", "exported"]) is None
    assert newcomer.difference(shown, ["final loss 1.199699"]) is None
    assert newcomer.difference(shown, ["final loss 1.199698"]) is not None
    assert newcomer.difference(["a", "...", "c"], ["a", "b", "b", "c"]) is None
    assert newcomer.difference(["a", "...", "c"], ["a", "c", "d"]) is not None  # c must end it
    assert newcomer.difference(["...", "c", "d", "..."], ["c", "x", "d"]) is not None  # shown together: together


def test_the_terminal_shows_a_progress_bars_last_state_without_colours():
    raw = ("\x1b[33mwarn\x1b[0m\r\n\rWriting:   0%|    | 0/1 [00:00<?, ?it/s]"
           "\rWriting: 100%|████| 1/1 [00:00<00:00, 3.20it/s]\r\nend\r\n\r\n")
    assert newcomer.screen(raw) == ["warn", "Writing: 100%|████| 1/1 [00:00<00:00, 3.20it/s]", "end"]


def test_commands_are_read_from_console_blocks_with_what_they_show():
    readme = ("text\n```console\n$ make setup\n$ python x.py --a 1   # note\nout 1\n...\n```\n"
              "```\nnot run\n```\n```pycon\n>>> 1 + 1\n2\n```\n")
    found = newcomer.commands(readme)
    assert [(c.kind, c.text, c.shown) for c in found] == [
        ("console", "make setup", []), ("console", "python x.py --a 1   # note", ["out 1", "..."]),
        ("pycon", ">>> 1 + 1\n2", [])]
    assert found[1].argv() == ["python", "x.py", "--a", "1"] and found[1].line == 4
    with pytest.raises(ValueError, match="starts with output"):
        newcomer.commands("```console\noutput first\n```\n")


def test_a_command_runs_in_a_terminal_of_its_own_width(tmp_path):
    """The point is the terminal: a child sees a terminal of the script's width on stdout and stderr."""
    probe = "import os, sys; print(sys.stdout.isatty(), sys.stderr.isatty(), os.get_terminal_size().columns)"
    status, raw = newcomer.run_in_terminal([sys.executable, "-c", probe], tmp_path, newcomer.plain_env(), timeout=60)
    assert (status, newcomer.screen(raw)) == (0, [f"True True {newcomer.COLUMNS}"])


@pytest.mark.parametrize("text, wrong", [
    ("pipeoptim train --task image --stagez 2", "stagez"),
    ("torchrun --nprocs-per-node 2 examples/transformers_causal_lm.py", "nprocs-per-node"),
    ("torchrun --nproc-per-node 4 examples/transformers_causal_lm.py --shard-replica", "shard-replica"),
    ("python examples/fashion_mnist_pipeline.py --limits 8", "limits"),
    ("python examples/missing.py", "no such script"),
    ("make sertup", "sertup"),
])
def test_a_program_or_flag_that_does_not_exist_is_caught(text, wrong):
    with pytest.raises((AssertionError, pytest.fail.Exception), match=wrong):
        test_every_readme_command_names_a_program_and_flags_that_exist(newcomer.Command(text, [], 1))


def test_the_command_lines_the_readme_shows_print_what_it_shows(tmp_path, monkeypatch, capsys):
    """The README's short `pipeoptim` commands run in one process (the command line's `main`, in
    the pytest process, from a folder of its own): each prints, to the digits shown, the lines the
    README shows (timings and rates by pattern). The distributed one, which prints the same losses
    by its own test (tests/test_distributed.py), is left to the script run by hand."""
    from conftest import has_image_data
    from pipeoptim.cli import main

    shown = [c for c in COMMANDS if c.argv()[:1] == ["pipeoptim"] and c.shown and "--runtime" not in c.argv()]
    assert [c.argv()[1] for c in shown] == ["train", "schedule"], [c.text for c in shown]
    if not has_image_data():
        pytest.skip("Fashion-MNIST is not installed")
    monkeypatch.chdir(tmp_path)
    for command in shown:
        assert main(command.argv()[1:]) == 0, where(command)
        captured = capsys.readouterr()
        seen = [line.rstrip() for line in (captured.out + captured.err).splitlines()]
        problem = newcomer.difference(command.shown, seen)
        assert problem is None, f"{where(command)}: {problem}\n" + "\n".join(seen)
