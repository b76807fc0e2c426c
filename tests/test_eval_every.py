"""Evaluation during training (``fit(..., eval_every=K)``): where the pipeline drains, what the
evaluations record, that synchronous methods train exactly as without it, and resume."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeoptim
from pipeoptim import Pipeline
from pipeoptim.checkpoint import CheckpointError
from pipeoptim.runtime.spec import next_drain
from conftest import batches, mlp

LOSS = nn.functional.cross_entropy
ADAM = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
HELD_OUT = batches(3, seed=7)


def held_out_loss(model: nn.Module) -> float:
    """The mean loss on a few fixed mini-batches: a metric that changes with every update."""
    with torch.no_grad():
        return sum(float(LOSS(model(x), y)) for x, y in HELD_OUT) / len(HELD_OUT)


def run(method: str, **kwargs):
    stages = {} if method == "sequential" else {"stages": 4}
    return pipeoptim.train(mlp(), batches(10), method=method, optimizer=ADAM, loss_fn=LOSS, epochs=2,
                           **stages, **kwargs)


def test_segments_end_at_every_checkpoint_and_every_evaluation():
    """fit cuts an epoch where next_drain says: after every checkpoint interval, every
    evaluation interval, and at the epoch's end."""
    def cuts(num_batches, intervals):
        ends, b = [], 0
        while b < num_batches:
            b = next_drain(b, num_batches, intervals)
            ends.append(b)
        return ends
    assert cuts(10, (3, 4)) == [3, 4, 6, 8, 9, 10]
    assert cuts(5, (5, 2)) == [2, 4, 5]
    assert cuts(10, (3, None)) == [3, 6, 9, 10]
    assert next_drain(4, 10, (3, 4)) == 6
    assert next_drain(8, 10, (None, 4)) == 10
    assert next_drain(3, None, (None, None)) is None


@pytest.mark.parametrize("method", ["sequential", "gpipe", "1f1b-flush"])
def test_a_synchronous_run_with_eval_every_equals_the_run_without(method):
    plain = run(method, evaluate=held_out_loss)
    evaluated = run(method, evaluate=held_out_loss, eval_every=4)
    assert evaluated.losses == plain.losses
    evaluations = evaluated.metrics["evaluations"]
    assert [e["batch"] for e in evaluations] == [4, 8, 10, 14, 18, 20]
    assert [e["epoch"] for e in evaluations] == [0, 0, 0, 1, 1, 1]
    assert [e["updates"] for e in evaluations] == [4, 8, 10, 14, 18, 20]  # one update per mini-batch
    # the epoch-end evaluations are the epochs' metrics, and the same as without eval_every
    assert [evaluations[2]["metric"], evaluations[5]["metric"]] == \
        [e["metric"] for e in evaluated.metrics["epochs"]] == [e["metric"] for e in plain.metrics["epochs"]]
    seconds = [e["seconds"] for e in evaluations]
    assert seconds == sorted(seconds) and seconds[0] > 0
    assert [e["batch"] for e in plain.metrics["evaluations"]] == [10, 20]  # the epoch ends only


def test_an_asynchronous_run_drains_at_each_evaluation_as_at_a_checkpoint():
    """eval_every=K cuts the same segments as checkpoint_every=K: the same losses, which differ
    from a run that drains only at the epochs' ends (the warm-up restarts after each drain)."""
    evaluated = run("pipeoptim", evaluate=held_out_loss, eval_every=4)
    checkpointed = run("pipeoptim", checkpoint_every=4)
    once_per_epoch = run("pipeoptim")
    assert evaluated.losses == checkpointed.losses
    assert evaluated.losses != once_per_epoch.losses
    assert [e["batch"] for e in evaluated.metrics["evaluations"]] == [4, 8, 10, 14, 18, 20]
    assert [e["updates"] for e in evaluated.metrics["evaluations"]] == [4, 8, 10, 14, 18, 20]


def test_checkpoints_and_evaluations_together_drain_at_both_kinds_of_points(tmp_path):
    """The losses of a run drained by hand after mini-batches 3, 4, 6, 8, 9 and 10."""
    by_hand = Pipeline(mlp(), method="pipeoptim", stages=4, loss_fn=LOSS, optimizer=ADAM)
    for index, (x, y) in enumerate(batches(10), start=1):
        by_hand.step(x, y)
        if index in (3, 4, 6, 8, 9, 10):
            by_hand.flush()
    pipe = Pipeline(mlp(), method="pipeoptim", stages=4, loss_fn=LOSS, optimizer=ADAM)
    seen = []
    result = pipe.fit(batches(10), evaluate=held_out_loss, eval_every=4, on_eval=seen.append,
                      checkpoint_dir=tmp_path, checkpoint_every=3)
    assert result.losses == by_hand.losses
    assert seen == result.metrics["evaluations"]
    assert [e["batch"] for e in seen] == [4, 8, 10]


def test_a_loader_without_len_is_evaluated_once_at_an_epoch_end_that_is_a_multiple_of_k():
    pipe = Pipeline(mlp(), method="gpipe", stages=2, loss_fn=LOSS, optimizer=ADAM)
    result = pipe.fit((b for b in batches(8)), evaluate=held_out_loss, eval_every=4)
    assert [e["batch"] for e in result.metrics["evaluations"]] == [4, 8]
    assert result.metrics["epochs"][0]["metric"] == result.metrics["evaluations"][-1]["metric"]


class Crash(Exception):
    pass


def resumable(tmp, on_batch=None, eval_every=4, resume=False):
    torch.manual_seed(123)
    return pipeoptim.train(mlp(), batches(8), method="pipeoptim", stages=3, optimizer=ADAM, loss_fn=LOSS,
                           epochs=2, evaluate=held_out_loss, eval_every=eval_every, checkpoint_dir=tmp,
                           checkpoint_every=3, on_batch=on_batch, resume=resume)


def test_a_run_with_eval_every_resumes_to_the_same_losses_and_evaluations(tmp_path):
    full = resumable(tmp_path / "full")

    def crash_at_13(index, loss):
        if index == 13:
            raise Crash()
    with pytest.raises(Crash):
        resumable(tmp_path / "cut", on_batch=crash_at_13)
    # drains at 3, 4, 6, 8 (epoch end), then 11, 12, 14, 16; checkpoints at 3, 6, 8, 11, 14, 16:
    # the run resumes from mini-batch 11, after the evaluations at 4, 8 and (not yet) 12
    resumed = resumable(tmp_path / "cut", resume=True)
    assert resumed.losses == full.losses
    strip = lambda evals: [{k: v for k, v in e.items() if k != "seconds"} for e in evals]  # noqa: E731
    assert strip(resumed.metrics["evaluations"]) == strip(full.metrics["evaluations"])
    assert [e["batch"] for e in resumed.metrics["evaluations"]] == [4, 8, 12, 16]
    with pytest.raises(CheckpointError, match="eval_every is 4 but this run has 2"):
        resumable(tmp_path / "cut", eval_every=2, resume=True)


@pytest.mark.parametrize("kwargs,message", [
    (dict(eval_every=0, evaluate=held_out_loss), "eval_every must be at least 1, got 0"),
    (dict(eval_every=3), "eval_every needs something to evaluate"),
    (dict(eval_every=3, evaluate=held_out_loss, continuous=True), "cannot evaluate every K batches"),
])
def test_bad_eval_every_is_refused_naming_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        run("pipeoptim", **kwargs)
