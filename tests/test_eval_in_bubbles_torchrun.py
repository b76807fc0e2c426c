"""Evaluation in the bubbles under torchrun (issue 39 item 2, step 4): the E actions' activations
cross the processes on the same links as training's, after the first mini-batch's, and the
evaluations equal the drained ones and the one-process run's, to the bit (gloo, one compute
thread per process; a model with batch norm, no dropout: each process draws its own)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchrun_jobs import run_here

SCRIPT = Path(__file__).resolve().parent / "torchrun_eval_in_bubbles.py"


def rows(lines) -> dict:
    return {(r["method"], r["bubbles"]): r for r in map(json.loads, lines)}


@pytest.mark.parametrize("stages", [2, 4])
def test_under_torchrun_the_bubbles_give_the_drained_evaluations_and_one_process_the_same(stages, request):
    """On 2 processes (the "eval-2" script of tests/conftest.py's 2-process job) and on 4 (the
    4-process job's "eval-4": two middle stages, which take the E actions' activations from one
    process and send them on to the next); one process: the same script, here."""
    job = request.getfixturevalue(f"torchrun_{stages}")
    alone, spread = rows(run_here(SCRIPT, stages).strip().splitlines()), rows(job.lines(f"eval-{stages}"))
    assert set(spread) == {(m, b) for m in ("gpipe", "1f1b-flush", "zb-h1") for b in (False, True)} | \
        {("forward_in_bubbles", True)}
    user = spread.pop(("forward_in_bubbles", True))  # a user's forward-only work, on the last stage's process
    assert user == alone[("forward_in_bubbles", True)] and len(user["outputs"]) == 3
    for (method, bubbles), row in spread.items():
        assert row == alone[(method, bubbles)], (method, bubbles)
        assert row["evaluations"] == spread[(method, False)]["evaluations"], method
        assert [e[0] for e in row["evaluations"]] == [2, 4, 5, 7, 9, 10]
        assert row["losses"] == spread[(method, False)]["losses"]
    assert len({e[2] for e in spread[("gpipe", True)]["evaluations"]}) == 6  # each evaluation saw new weights
