"""scripts/gpu_check.sh: one line and exit 0 without CUDA; the table's torchrun half on the CPU,
small (the tests' 2-process job runs scripts/gpu_check_worker.py: gloo under the strict
transport, NCCL's rules), judged by the script's own rules and held here row by row; and the
script's rules for the rows a machine cannot run (too few GPUs), on a GPU count and jobs made up."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import load_script

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "scripts" / "gpu_check_worker.py"
UPDATES = 3
#: the CPU half's rows, every one on 2 processes: synchronous flushed (stopped and resumed from a
#: DCP checkpoint, against its uninterrupted run), split backward in bf16, asynchronous with the
#: tie (compiled with aot_eager, and 2BW), chunked (zb-v: the tie inside a process) and mirrored
#: (bitpipe: each pipeline's tie between the processes). Sharded replicas need 4 processes: the
#: check's own 4-process job runs them; interleaved and bidirectional on a tied GPT-2 run in the
#: job's "dict" script (tests/test_dict_batches.py)
CPU_ROWS = ["1f1b-flush+checkpoint", "zb-h1+bf16", "pipeoptim+compiled", "pipedream-2bw", "zb-v", "bitpipe"]
CHUNKED = ["interleaved", "zb-v", "bidirectional", "bitpipe"]
SYNCHRONOUS_FP32 = [r for r in ["1f1b-flush+checkpoint", *CHUNKED] if r in CPU_ROWS]


def worker_args(scratch: Path) -> list:
    """The worker's arguments in the 2-process job (tests/conftest.py's ``gpu-check``)."""
    return ["--device", "cpu", "--size", "tiny", "--updates", UPDATES, "--compile", "aot_eager",
            "--rows", ",".join(CPU_ROWS), "--scratch", scratch]


def driver():
    """scripts/gpu_check.py as a module."""
    return load_script("gpu_check")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the whole check")
def test_without_cuda_it_says_so_in_one_line_and_exits_0():
    import subprocess

    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == [
        f"gpu_check: no CUDA device here (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
        "nothing to check"]


@pytest.fixture(scope="module")
def judged(torchrun_2):
    """The ``gpu-check`` rows of the 2-process job, judged: {(row, processes): row}, the table."""
    gpu_check = driver()
    rows = gpu_check.judge(gpu_check.merge(torchrun_2.rows("gpu-check")), backend="gloo")
    table = gpu_check.table(rows, UPDATES)
    print("\n".join(table) + f"\n(the job's CPU seconds for it, every rank: {torchrun_2.cpu.get('gpu-check')})")
    return {(r["row"], r["processes"]): r for r in rows}, table


def test_the_cpu_half_of_the_table_holds_row_by_row(judged):
    rows, table = judged
    ran = CPU_ROWS
    assert set(rows) == {(r, 2) for r in ran} | {(r, 1) for r in ("pipeoptim+compiled", "pipedream-2bw",
                                                                  "sequential", "sequential+bf16")}
    assert [r for r in rows.values() if not r["holds"]] == []
    sequential, sequential_bf16 = rows["sequential", 1], rows["sequential+bf16", 1]
    assert sequential["initial"] == sequential_bf16["initial"]  # the same untrained model
    assert sequential["loss"] < sequential["initial"] - 0.2  # it trains: the comparisons are not of constants
    assert sequential_bf16["loss"] != sequential["loss"]  # bf16 ran
    for name in ran:
        row = rows[name, 2]
        assert (row["backend"], row["tied"], len(row["losses"])) == ("gloo", True, UPDATES), name
    for name in SYNCHRONOUS_FP32:  # mini-batch by mini-batch; the suite's 1e-6 on the CPU, the check's 1e-5
        row = rows[name, 2]
        assert (row["precision"], row["against"], row["bound"]) == ("fp32", pytest.approx(0, abs=1e-6), 1e-5), name

    resumed = rows["1f1b-flush+checkpoint", 2]
    assert resumed["latest"] == "epoch0000-batch000001"  # a checkpoint every mini-batch, stopped after 2
    assert (resumed["partner"], resumed["same"]) == ("uninterrupted", "equal")
    whole = resumed["uninterrupted"]
    assert (resumed["losses"], resumed["loss"]) == (whole["losses"], whole["loss"])

    bf16 = rows["zb-h1+bf16", 2]
    assert bf16["precision"] == "bf16" and bf16["against"] <= 2e-3 and bf16["loss"] != resumed["loss"]

    bound = 0.5 * (sequential["initial"] - sequential["loss"]) / sequential["loss"]
    for name in ("pipeoptim+compiled", "pipedream-2bw"):  # to the bit against one process
        row = rows[name, 2]
        assert (row["partner"], row["same"], row["bound"]) == ("1 process", "equal", pytest.approx(bound)), name
        assert 1e-4 < row["against"] <= bound, name  # not sequential: stale or predicted weights
    compiled = rows["pipeoptim+compiled", 2]
    assert compiled["compiled"] == "aot_eager" and compiled["compilations"] == [1, 1]
    assert rows["pipeoptim+compiled", 1]["losses"] == compiled["losses"]

    assert table[0].split() == ["row", "launcher", "precision", "compiled", "loss", "after", str(UPDATES),
                                "sequential", "rel", "diff", "bound", "same", "run", "holds"]
    lines = {line.split()[0]: line for line in table[1:] if "torchrun 2 gloo" in line}
    assert sorted(lines) == sorted(ran) and all(line.endswith("yes") for line in lines.values())


def made_up_job(rows: str, processes: int, args, scratch: str):
    """A job's lines as the worker prints them, made up: every row equal to sequential."""
    lines = [{"row": "sequential", "method": "sequential", "processes": 1, "precision": "fp32", "compiled": False,
              "losses": [4.0, 3.5], "loss": 3.0, "initial": 4.0, "tied": True}]
    for row in rows.split(","):
        method = row.split("+")[0]
        lines.append({**lines[0], "row": method, "method": method})
        if processes > 1:
            lines.append({**lines[0], "row": row, "method": method, "processes": processes, "backend": "nccl",
                          "sharded": "sharded" in row})
    return lines, ""


def test_rows_a_machine_cannot_run_are_named_and_fail_only_with_require_all(monkeypatch, tmp_path, capsys):
    """Two GPUs: the 2-process job runs, the sharded row (4 processes) is not run, for the reason
    given; exit 0 unless --require-all. One GPU: the one-process runs alone."""
    gpu_check = driver()
    launched = []
    monkeypatch.setattr(gpu_check, "launch", lambda rows, processes, args, scratch: (
        launched.append((rows, processes)) or made_up_job(",".join(rows), processes, args, scratch)))
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check.torch.cuda, "get_device_name", lambda i: "a made-up GPU")
    monkeypatch.setattr(gpu_check.torch.cuda, "device_count", lambda: 2)
    argv = ["--rows", "1f1b-flush,1f1b-flush+sharded", "--no-tests", "--out", str(tmp_path / "rows.json")]
    assert gpu_check.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert launched == [(["1f1b-flush"], 2)]
    reason = "needs 4 GPUs, this machine has 2 (NCCL refuses two ranks on one GPU)"
    assert [line for line in out if "1f1b-flush+sharded" in line] == [
        f"{'1f1b-flush+sharded':<24}{'torchrun 4':<17}{'fp32':<10}{'-':<10}  not run: {reason}"]
    assert out[-1] == f"gpu_check: every row that ran holds; 1 not run ({reason})"
    saved = json.loads((tmp_path / "rows.json").read_text())
    assert (saved["holds"], saved["failed"], saved["not_run"]) == (True, [], ["1f1b-flush+sharded"])
    assert gpu_check.main(argv + ["--require-all"]) == 1
    assert capsys.readouterr().out.splitlines()[-1].endswith(f"({reason}), which --require-all counts")

    monkeypatch.setattr(gpu_check.torch.cuda, "device_count", lambda: 1)
    launched.clear()
    assert gpu_check.main(argv[:2] + ["--no-tests", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert launched == [(["1f1b-flush", "1f1b-flush+sharded"], 1)]
    assert summary["not_run"] == ["1f1b-flush", "1f1b-flush+sharded"]
    assert [(r["row"], r["processes"], r["holds"]) for r in summary["rows"]] == [
        ("1f1b-flush", 2, None), ("1f1b-flush+sharded", 4, None), ("sequential", 1, True), ("1f1b-flush", 1, True)]


def test_a_row_that_differs_from_one_process_fails_the_check():
    gpu_check = driver()
    lines, _ = made_up_job("pipeoptim,1f1b-flush", 2, None, "")
    for line in lines:
        if line["processes"] == 2 and line["method"] == "pipeoptim":
            line["losses"] = [4.0, 3.5000001]  # an asynchronous method: to the bit
        if line["processes"] == 2 and line["method"] == "1f1b-flush":
            line["loss"] = 3.0 * (1 + 2e-5)  # a synchronous one in fp32: within 1e-5
    rows = {(r["row"], r["processes"]): r for r in gpu_check.judge(lines, backend="nccl")}
    assert rows["pipeoptim", 2]["why"] == "differs from the 1 process run from mini-batch 1's loss on"
    assert rows["1f1b-flush", 2]["why"] == "fp32: 2.00e-05 from sequential (the loss after K), over 1e-05"
    assert [k for k, r in rows.items() if not r["holds"]] == [("pipeoptim", 2), ("1f1b-flush", 2)]
    lines, _ = made_up_job("pipeoptim", 2, None, "")
    assert gpu_check.judge([{**lines[2], "backend": "gloo"}, *lines[:2]], backend="nccl")[0]["why"] == (
        "the process group's backend is gloo, not nccl")
    failed = [{**lines[2], "rank": rank, "error": f"Error{rank}"} for rank in (1, 0)]  # as the ranks print them
    merged = gpu_check.merge([lines[0], *failed, lines[1]])
    assert [(r["row"], r["processes"], r.get("error")) for r in merged] == [
        ("sequential", 1, None), ("pipeoptim", 2, "rank 0: Error0; rank 1: Error1"), ("pipeoptim", 1, None)]
    assert gpu_check.judge(merged, backend="nccl")[1]["why"] == "rank 0: Error0; rank 1: Error1"
