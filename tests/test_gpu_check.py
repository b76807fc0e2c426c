"""scripts/gpu_check.sh: one line and exit 0 without CUDA; its table's path run on the CPU, where a
synchronous method ends at sequential's loss (scripts/gpu_check.py's main, called in this process:
the script as its own process is the first test's)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the whole check")
def test_without_cuda_it_says_so_in_one_line_and_exits_0():
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == [
        f"gpu_check: no CUDA device here (torch {torch.__version__}, CUDA build {torch.version.cuda}); nothing to check"]


def test_the_table_on_the_cpu(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "rows.json"
    code = gpu_check.main(["--device", "cpu", "--methods", "1f1b-flush", "--updates", "2", "--out", str(out),
                           "--backend", "aot_eager", "--precisions", "fp32"])
    stdout = capsys.readouterr().out
    assert code == 0, stdout[-3000:]
    rows = {(r["method"], r["precision"], r["compiled"]): r for r in json.loads(out.read_text())}
    assert set(rows) == {(m, "fp32", c) for m in ("sequential", "1f1b-flush") for c in (False, True)}
    for compiled in (False, True):
        assert rows["1f1b-flush", "fp32", compiled]["loss"] == pytest.approx(
            rows["sequential", "fp32", compiled]["loss"], rel=1e-5)
    assert rows["1f1b-flush", "fp32", True]["loss"] == rows["1f1b-flush", "fp32", False]["loss"]  # aot_eager: exact
    assert all(r["samples_per_second"] > 0 for r in rows.values())
    header = stdout.splitlines()[0]
    assert header.split() == ["method", "compiled", "precision", "loss", "sequential", "samples/s"]
