"""Evaluation in the bubbles (``fit(eval_every=K, eval_in_bubbles=True)``, issue 39 item 2): the
evaluation's forward-only micro-batches run in the idle time of the mini-batch after the K-th,
and give the drained evaluation's metrics to the bit, for a model with dropout and batch norm;
the training is untouched; methods it does not apply to are refused with the fix."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeoptim
from pipeoptim import Pipeline
from conftest import batches

LOSS = nn.functional.cross_entropy
ADAM = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
EVAL = batches(3, size=5, seed=7)  # three evaluation mini-batches of 5 (training micro-batches: 4)


def noisy_model() -> nn.Sequential:
    """Dropout (random in training, not in eval mode) and batch norm (running statistics that
    every training forward updates in place): what an evaluation between training forwards must
    not disturb, nor be disturbed by."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(16, 16), nn.Dropout(0.2), nn.ReLU(), nn.BatchNorm1d(16),
                         nn.Linear(16, 4)).double()


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(-1) == target).double().mean()


def run(method: str, bubbles: bool, stages: int = 2, metric=None):
    """Two epochs of 10 mini-batches, evaluated every 3; each evaluation with the number of
    mini-batches fed when its value became known."""
    torch.manual_seed(3)  # the dropout masks
    pipe = Pipeline(noisy_model(), method=method, stages=stages, optimizer=ADAM, loss_fn=LOSS)
    known_at = []
    result = pipe.fit(batches(10), epochs=2, eval_loader=EVAL, metric=metric, eval_every=3,
                      eval_in_bubbles=bubbles, on_eval=lambda entry: known_at.append(pipe.batches_done))
    return result, known_at


@pytest.mark.parametrize("method", ["gpipe", "1f1b-flush", "zb-h1"])
def test_evaluation_in_the_bubbles_equals_the_drained_evaluation(method):
    drained, drained_at = run(method, bubbles=False)
    filled, filled_at = run(method, bubbles=True)
    assert filled.losses == drained.losses  # training untouched: dropout's draws and batch norm's statistics
    keys = ("epoch", "batch", "updates", "metric")
    assert [[e[k] for k in keys] for e in filled.metrics["evaluations"]] == \
        [[e[k] for k in keys] for e in drained.metrics["evaluations"]]
    assert [e["batch"] for e in filled.metrics["evaluations"]] == [3, 6, 9, 10, 13, 16, 19, 20]
    # the mid-epoch ones became known during the next mini-batch, the epoch-end ones drained
    assert drained_at == [3, 6, 9, 10, 13, 16, 19, 20]
    assert filled_at == [4, 7, 10, 10, 14, 17, 20, 20]
    assert len({e["metric"] for e in filled.metrics["evaluations"]}) == 8  # every update moved it


def test_three_stages_and_a_metric_of_its_own():
    drained, _ = run("1f1b-flush", bubbles=False, stages=3, metric=accuracy)
    filled, _ = run("1f1b-flush", bubbles=True, stages=3, metric=accuracy)
    assert filled.losses == drained.losses
    assert [e["metric"] for e in filled.metrics["evaluations"]] == \
        [e["metric"] for e in drained.metrics["evaluations"]]


def test_by_hand_it_runs_in_the_next_step_or_drained_at_the_flush():
    """evaluate_in_bubbles on a drained pipeline: the value is evaluate()'s now, delivered during
    the next step; with no step before the flush, the flush runs it drained."""
    torch.manual_seed(3)
    pipe = Pipeline(noisy_model(), method="gpipe", stages=2, optimizer=ADAM, loss_fn=LOSS)
    data = batches(4)
    for x, y in data[:2]:
        pipe.step(x, y)
    pipe.flush()
    expected = pipe.evaluate(EVAL)
    got = []
    pipe.evaluate_in_bubbles(EVAL, on_done=got.append)
    with pytest.raises(RuntimeError, match="already waiting"):
        pipe.evaluate_in_bubbles(EVAL)
    assert got == []
    pipe.step(*data[2])
    assert got == [expected]
    pipe.flush()
    expected = pipe.evaluate(EVAL)
    pipe.evaluate_in_bubbles(EVAL, on_done=got.append)
    pipe.flush()
    assert got[1] == expected != got[0]


@pytest.mark.parametrize("method, stages, words", [
    ("pipeoptim", 2, "asynchronous"),
    ("interleaved", 2, "several stages per rank"),
])
def test_methods_without_one_update_per_stretch_are_refused_with_the_fix(method, stages, words):
    with pytest.raises(ValueError, match=f"{words}.*eval_in_bubbles=False"):
        pipeoptim.train(noisy_model(), batches(4), method=method, stages=stages, optimizer=ADAM, loss_fn=LOSS,
                        eval_loader=EVAL, eval_every=2, eval_in_bubbles=True)


def test_it_needs_eval_every_and_an_eval_loader():
    for options, missing in (({"eval_loader": EVAL}, r"give eval_every=K$"),
                             ({"evaluate": lambda model: 0.0, "eval_every": 2}, r"give eval_loader= \(evaluate"),
                             ({}, r"give eval_every=K and eval_loader= \(evaluate")):
        with pytest.raises(ValueError, match=missing):
            pipeoptim.train(noisy_model(), batches(4), method="gpipe", stages=2, optimizer=ADAM, loss_fn=LOSS,
                            eval_in_bubbles=True, **options)


def test_a_traced_model_runs_its_eval_mode_graph_in_the_bubbles():
    """A traced graph keeps the mode it was traced in: each E runs the eval-mode trace (batch
    norm's running statistics as at the drain, no dropout), as the drained evaluation does."""
    from traced_models import SmallCNN

    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(6, 1, 5, 5, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(5)]
    metrics, losses = [], []
    for bubbles in (False, True):
        torch.manual_seed(0)
        pipe = Pipeline(SmallCNN(), method="gpipe", split_points=["body.0"], micro_batches=2, loss_fn=LOSS,
                        optimizer=ADAM)
        result = pipe.fit(data, eval_loader=data[:2], eval_every=2, eval_in_bubbles=bubbles)
        metrics.append([e["metric"] for e in result.metrics["evaluations"]])
        losses.append(result.losses)
    assert metrics[0] == metrics[1] and len(set(metrics[0])) == 3 and losses[0] == losses[1]


def test_a_loader_without_len_global_clipping_and_one_stage():
    """The segment's orders grow with the data (no len(): a horizon), the updates wait for each
    other (clip_scope=global), or nothing idles (sequential: every E runs before the update)."""
    for method, stages, extra in (("1f1b-flush", 2, {"clip_grad_norm": 0.5, "clip_scope": "global"}),
                                  ("sequential", None, {})):
        values = []
        for bubbles in (False, True):
            torch.manual_seed(3)
            pipe = Pipeline(noisy_model(), method=method, stages=stages, optimizer=ADAM, loss_fn=LOSS, **extra)
            result = pipe.fit((b for b in batches(7)), eval_loader=EVAL, eval_every=2, eval_in_bubbles=bubbles)
            values.append((result.losses, [(e["batch"], e["metric"]) for e in result.metrics["evaluations"]]))
        assert values[0] == values[1] and [b for b, _ in values[1][1]] == [2, 4, 6, 7], method


def test_where_a_checkpoint_is_written_the_evaluation_stays_drained(tmp_path):
    """The checkpoint records the evaluations so far, this one among them: drained there."""
    torch.manual_seed(3)
    pipe = Pipeline(noisy_model(), method="gpipe", stages=2, optimizer=ADAM, loss_fn=LOSS)
    known_at = []
    result = pipe.fit(batches(6), eval_loader=EVAL, eval_every=2, eval_in_bubbles=True, checkpoint_dir=tmp_path,
                      checkpoint_every=4, on_eval=lambda entry: known_at.append(pipe.batches_done))
    assert [e["batch"] for e in result.metrics["evaluations"]] == [2, 4, 6]
    assert known_at == [3, 4, 6]


def test_a_users_forward_only_work_fills_the_bubbles_the_same_way():
    """forward_in_bubbles: the model's eval-mode outputs for the user's inputs on the drained
    weights, delivered during the next step, equal to a forward of the drained model in eval
    mode; with no step before the flush, at the flush."""
    torch.manual_seed(3)
    pipe = Pipeline(noisy_model(), method="1f1b-flush", stages=3, optimizer=ADAM, loss_fn=LOSS)
    data = batches(4)
    for x, y in data[:2]:
        pipe.step(x, y)
    pipe.flush()
    inputs = [x for x, _ in EVAL]
    pipe.model().eval()
    expected = [pipe.forward(x) for x in inputs]
    pipe.model().train()
    got = {}
    pipe.forward_in_bubbles(inputs, lambda j, out: got.setdefault(j, out))
    assert got == {}
    pipe.step(*data[2])
    assert sorted(got) == [0, 1, 2] and all(torch.equal(got[j], expected[j]) for j in range(3))
    assert not got[0].requires_grad
    pipe.flush()
    later = {}
    pipe.forward_in_bubbles(inputs[:1], lambda j, out: later.setdefault(j, out))
    pipe.flush()
    pipe.model().eval()
    assert torch.equal(later[0], pipe.forward(inputs[0])) and not torch.equal(later[0], got[0])
