"""The command line starts without torch and matplotlib: `--help` of every subcommand and
`pipeoptim schedule` (text and --json) only build parsers and simulate schedules, which are pure
data. Each case runs in a fresh interpreter, since this one has imported torch already."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")

# Runs main(ARGV) and prints, as the last line of stdout, which heavy modules it imported.
PROBE = """
import json, sys
from pipeoptim.cli import main
try:
    code = main(json.loads(sys.argv[1]))
except SystemExit as exit:  # --help exits 0 through argparse
    code = exit.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules,
                  "matplotlib": "matplotlib" in sys.modules}))
"""

CASES = [
    ["--help"],
    ["train", "--help"],
    ["compare", "--help"],
    ["schedule", "--help"],
    ["bench", "--help"],
    ["plan", "--help"],
    ["schedule", "pipeoptim", "--stages", "4", "--batches", "8"],
    ["schedule", "pipeoptim", "--stages", "4", "--batches", "8", "--json"],
    ["train", "--task", "lm", "--recipe"],
    ["train", "--task", "image", "--recipe", "--json"],
]


def probe(argv, cwd: Path, *, code: str = PROBE) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code, json.dumps(argv)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=120)


@pytest.mark.parametrize("argv", CASES, ids=" ".join)
def test_command_line_starts_without_torch_or_matplotlib(argv, tmp_path):
    proc = probe(argv, tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    assert report == {"code": 0, "torch": False, "matplotlib": False}
    if argv[-1] == "--help":
        assert lines[0].startswith("usage: pipeoptim")
    elif "--recipe" in argv:  # the recipe and the tuned lrs, without loading a task
        text = "\n".join(lines[:-1])
        if "--json" in argv:
            out = json.loads(text)
            assert (out["recipe"]["optimizer"], out["tuned_lrs"]["adamw"]["pipeoptim"]) == ("adamw", 0.001)
        else:
            assert lines[0].startswith("lm: model gpt-narrow, adamw peak lr 0.004, warmup-cosine")
            assert "adamw: async-naive 0.002, pipedream 0.004, pipedream-2bw 0.001, pipeoptim 0.002" in text
    elif argv[-1] == "--json":
        out = json.loads(lines[0])
        assert (out["schedule"], out["method"], out["stages"], out["batches"]) == ("async-1f1b", "pipeoptim", 4, 8)
    else:
        assert lines[0].startswith("method pipeoptim: the async-1f1b schedule, weight versions per stage [2, 2, 2, 1]")


def test_the_probe_would_see_torch(tmp_path):
    """The check can fail: a command that trains imports torch, and the probe reports it."""
    code = PROBE.replace("code = main(json.loads(sys.argv[1]))", "import pipeoptim; pipeoptim.train; code = 0")
    report = json.loads(probe([], tmp_path, code=code).stdout.strip().splitlines()[-1])
    assert report["torch"] is True


def test_package_attributes_are_served_lazily(tmp_path):
    """`import pipeoptim` stays torch-free, `pipeoptim.train` is the function (also after the
    submodule that defines it, `pipeoptim.training`, was imported), and the old homes of the errors
    re-export the torch-free classes."""
    code = """
import sys
import pipeoptim, pipeoptim.cli
assert "torch" not in sys.modules
import pipeoptim.lab.experiment
import pipeoptim.training  # the submodule that defines the function: it does not hide it
from pipeoptim import NonFiniteLoss, Pipeline, TrainResult, train
from pipeoptim.pipeline import Pipeline as P2
assert Pipeline is P2
from pipeoptim.training import train as train_function
assert pipeoptim.train is train is train_function and callable(pipeoptim.train)
assert NonFiniteLoss is sys.modules["pipeoptim.training"].NonFiniteLoss
from pipeoptim.errors import CheckpointError, MissingDataError
from pipeoptim.checkpoint import CheckpointError as C2
from pipeoptim.lab.tasks import MissingDataError as M2
from pipeoptim.lab.tasks.base import MissingDataError as M3
assert C2 is CheckpointError and M2 is MissingDataError and M3 is MissingDataError
from pipeoptim.runtime.defaults import DEFAULT_TIMEOUT
from pipeoptim.cli import build_parser
assert build_parser().parse_args(["train"]).timeout == DEFAULT_TIMEOUT == 300.0
print(sorted(pipeoptim.__all__))
"""
    proc = probe([], tmp_path, code=code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(sorted(["Pipeline", "train", "plan", "TrainResult", "NonFiniteLoss",
                                              "METHODS", "get_method", "method_names"]))


def test_python_dash_m_pipeoptim_still_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "pipeoptim", "schedule", "gpipe", "--stages", "2", "--json"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["schedule"], out["stages"], out["microbatches"], out["makespan"]) == ("gpipe", 2, 2, 6.0)


def test_main_reports_a_diverged_run_and_lets_other_runtime_errors_through(monkeypatch, capsys):
    """main() catches NonFiniteLoss (looked up lazily) with exit code 1 and one line; any other
    RuntimeError is not the user's to fix and keeps its traceback."""
    import pipeoptim
    import pipeoptim.cli.train as cli_train
    from pipeoptim.cli import main

    def diverge(args):
        raise pipeoptim.NonFiniteLoss("loss became nan at mini-batch 3")

    monkeypatch.setattr(cli_train, "run", diverge)
    assert main(["train"]) == 1
    assert capsys.readouterr().err == ("pipeoptim train: stopped: loss became nan at mini-batch 3; the last good "
                                       "checkpoint is kept (continue with --resume RUN_DIR after lowering --lr)\n")

    def crash(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli_train, "run", crash)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["train"])
