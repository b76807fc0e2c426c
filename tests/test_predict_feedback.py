"""``predict_feedback=True``: pipeoptim-2bw with error feedback, each window on the weights its
update will be applied to when every update is corrected, ``W - (lr*s + beta*lr) * Delta + beta *
u_prev`` (weights/predicted_2bw.py, ``feedback_prediction``), equals a pipeline written out by
hand, bit for bit (float64, ``torch.equal``), with momentum SGD and AdamW, on one and on three
stages.

The loop keeps each stage's weights, the optimizer's state and the previous update itself; it
runs 2BW's orders (written out: N-1-k warm-up forwards, then a forward and a backward in turn,
an update after every M-th backward) stage by stage while their inputs exist. Each pass calls
the stage's module on the window's tensors with autograd, as the pipeline's stages do (so the
gradients are the same bits), and only that: the versions, the step counts, the prediction, the
error feedback and the delays are the loop's own. Delta, the optimizer's direction, is read with
:class:`pipeoptim.weights.predict.Predictor` on the loop's own optimizer (tests/test_predict.py
pins its formulas); the updates are torch's optimizers' own steps.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

import pipeoptim
from pipeoptim.schedules import build_schedule
from pipeoptim.weights.predict import Predictor

M, T, BETA = 3, 6, 1.0

OPTIMIZERS = {
    "momentum": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), 0.05),
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=0.02, weight_decay=0.1), 0.02),
}


def _model() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _data():
    gen = torch.Generator().manual_seed(13)
    return [(torch.randn(6, 5, generator=gen, dtype=torch.float64),
             torch.randn(6, 3, generator=gen, dtype=torch.float64)) for _ in range(T)]


def order(k: int, n: int):
    """Stage k's actions under 2BW with M micro-batches per update."""
    total, warm = T * M, n - 1 - k
    seq = [("F", i) for i in range(min(warm, total))]
    for j in range(total):
        if warm + j < total:
            seq.append(("F", warm + j))
        seq.append(("B", j))
        if (j + 1) % M == 0:
            seq.append(("U", j // M))
    return seq


def hand_pipeline(model, data, partition, make_optimizer, lr, aware):
    """Per-mini-batch losses and the final stage modules of pipeoptim-2bw with error feedback."""
    n = len(partition)
    cuts = [sum(partition[:k]) for k in range(n + 1)]
    stages = [copy.deepcopy(model[cuts[k]:cuts[k + 1]]) for k in range(n)]
    named = [[(name, p) for name, p in s.named_parameters()] for s in stages]
    optimizers = [make_optimizer(list(s.parameters())) for s in stages]
    predictors = [Predictor(opt) for opt in optimizers]
    orders = [order(k, n) for k in range(n)]
    # per stage: the updates between window t's first forward and its last backward
    steps = [{} for _ in range(n)]
    for k in range(n):
        count, first = 0, {}
        for kind, i in orders[k]:
            if kind == "U":
                count += 1
            elif kind == "F" and i % M == 0:
                first[i // M] = count
            elif kind == "B" and i % M == M - 1:
                steps[k][i // M] = count - first[i // M]
    updates, previous = [0] * n, [None] * n
    windows = [dict() for _ in range(n)]   # stage -> window -> (its tensors by name, its version)
    oldest = [None] * n                    # the oldest version the backwards since the last update ran on
    grads = [dict() for _ in range(n)]
    saved, acts, back, losses = {}, {}, {}, {}
    micro = [(x[2 * j:2 * j + 2], y[2 * j:2 * j + 2]) for x, y in data for j in range(M)]
    pointer = [0] * n
    while any(pointer[k] < len(orders[k]) for k in range(n)):
        for k in range(n):
            while pointer[k] < len(orders[k]):
                kind, i = orders[k][pointer[k]]
                t = i // M
                if kind == "F":
                    if k > 0 and (k, i) not in acts:
                        break
                    if t not in windows[k]:
                        s = steps[k][t] if updates[k] > 0 else 0
                        with torch.no_grad():
                            if s:
                                rate = lr * s + BETA * lr if aware else lr * s
                                tensors = {}
                                for name, p in named[k]:
                                    w = torch.add(p.detach(), predictors[k].direction(p), alpha=-rate)
                                    tensors[name] = torch.add(w, previous[k][name], alpha=BETA) if aware else w
                            else:  # this version, kept through an update during the window
                                tensors = {name: p.detach().clone() for name, p in named[k]}
                        windows[k][t] = (tensors, updates[k])
                    tensors, _ = windows[k][t]
                    leaves = {name: w.detach().requires_grad_(True) for name, w in tensors.items()}
                    x = micro[i][0] if k == 0 else acts.pop((k, i)).detach().requires_grad_(True)
                    with torch.enable_grad():
                        out = functional_call(stages[k], leaves, (x,))
                        if k == n - 1:
                            out = nn.functional.mse_loss(out, micro[i][1]) * (2 / 6)
                            losses[i] = float(out.detach())
                    saved[(k, i)] = (x, out, leaves)
                    if k < n - 1:
                        acts[(k + 1, i)] = out.detach()
                elif kind == "B":
                    if k < n - 1 and (k, i) not in back:
                        break
                    x, out, leaves = saved.pop((k, i))
                    torch.autograd.backward([out], [None] if k == n - 1 else [back.pop((k, i))])
                    for name, leaf in leaves.items():
                        g = grads[k].get(name)
                        grads[k][name] = leaf.grad if g is None else g.add_(leaf.grad)
                    if k > 0:
                        back[(k - 1, i)] = x.grad
                    version = windows[k][t][1]
                    oldest[k] = version if oldest[k] is None else min(oldest[k], version)
                    if i % M == M - 1:
                        del windows[k][t]
                else:  # U: the optimizer's step, then the feedback on a stale update
                    for name, p in named[k]:
                        p.grad = grads[k].pop(name)
                    before = {name: p.detach().clone() for name, p in named[k]}
                    optimizers[k].step()
                    with torch.no_grad():
                        step = {name: before[name] - p.detach() for name, p in named[k]}
                        if updates[k] - oldest[k] >= 1 and previous[k] is not None:
                            for name, p in named[k]:
                                p.sub_(step[name] - previous[k][name], alpha=BETA)
                    optimizers[k].zero_grad(set_to_none=True)
                    previous[k], oldest[k] = step, None
                    updates[k] += 1
                pointer[k] += 1
    return [sum(losses[t * M + j] for j in range(M)) for t in range(T)], stages


def test_the_hand_orders_are_2bws():
    for n in (1, 3):
        library = build_schedule("2bw", n, M, T).orders
        assert [order(k, n) for k in range(n)] == [[(a.kind.name, a.index) for a in o] for o in library]


@pytest.mark.parametrize("partition", [[5], [2, 2, 1]], ids=["one-stage", "three-stages"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_feedback_aware_prediction_equals_the_hand_written_pipeline_bit_for_bit(name, partition):
    make_optimizer, lr = OPTIMIZERS[name]
    model, data = _model(), _data()
    expected, stages = hand_pipeline(model, data, partition, make_optimizer, lr, aware=True)
    result = pipeoptim.train(model, data, method="pipeoptim-2bw", partition=partition, micro_batches=M,
                             optimizer=make_optimizer, loss_fn=nn.functional.mse_loss, error_feedback=True,
                             predict_feedback=True)
    assert result.losses == expected
    want = [p for s in stages for p in s.parameters()]
    got = list(result.model.parameters())
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    if len(partition) > 1:  # and the loop's plain prediction is pipeoptim-2bw+ef's, bit for bit too
        plain, _ = hand_pipeline(model, data, partition, make_optimizer, lr, aware=False)
        unaware = pipeoptim.train(model, data, method="pipeoptim-2bw", partition=partition, micro_batches=M,
                                  optimizer=make_optimizer, loss_fn=nn.functional.mse_loss, error_feedback=True)
        assert unaware.losses == plain
        # the first two mini-batches run unpredicted at every stage (stage 0's third window is the
        # first predicted with a previous update). The term the option adds, beta * (lr*Delta -
        # u_prev), vanishes where lr*Delta is the step just applied: momentum SGD's lr*m, always
        # (the same losses to rounding); AdamW's too, but for its decay, read from the weights
        # after the feedback moved them: from the second corrected update on (the fourth
        # mini-batch) the losses move, a little
        assert plain[:2] == expected[:2]
        if name == "adamw":
            assert all(a != b for a, b in zip(plain[3:], expected[3:]))
            assert plain == pytest.approx(expected, rel=1e-3)
        else:
            assert plain == pytest.approx(expected, rel=1e-12, abs=0)


def _stage0(**options):
    pipe = pipeoptim.Pipeline(_model(), stages=3, method="pipeoptim-2bw", partition=[2, 2, 1], micro_batches=M,
                              optimizer=OPTIMIZERS["adamw"][0], loss_fn=nn.functional.mse_loss,
                              error_feedback=True, **options)
    return pipe, pipe.stages[0].policy


def test_a_window_runs_on_the_feedback_term_added_to_the_plain_prediction():
    """After two updates (the second corrected) the stage's next window runs on the plain
    prediction moved by ``beta * (u_prev - lr*Delta)``: what the option adds, and nothing else."""
    pipe, policy = _stage0(predict_feedback=True)
    pipe.fit(_data()[:2])
    assert policy.feedback.corrected == 1 and policy.version == 2
    lr = OPTIMIZERS["adamw"][1]
    aware, plain = policy.feedback_prediction(1), policy.predicted(1)
    for (name, p), a, b in zip(policy.named, aware, plain):
        delta = policy.predictor.direction(p)
        expected = torch.add(torch.add(p.detach(), delta, alpha=-(lr * 1 + BETA * lr)), policy.feedback.previous[name],
                             alpha=BETA)
        assert torch.equal(a, expected)
        assert not torch.equal(a, b)
        # the two differ by beta * (u_prev - lr*Delta): for AdamW the decay's share of a step
        torch.testing.assert_close(a - b, BETA * (policy.feedback.previous[name] - lr * delta), rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("aware", [False, True], ids=["plain", "aware"])
def test_the_diagnostic_reports_the_other_prediction(aware):
    result = pipeoptim.train(_model(), _data(), method="pipeoptim-2bw", partition=[2, 2, 1], micro_batches=M,
                             optimizer=OPTIMIZERS["adamw"][0], loss_fn=nn.functional.mse_loss, error_feedback=True,
                             predict_feedback=aware, diagnose_every=1)
    stage0 = result.metrics["prediction_error"][0]
    name = "without predict_feedback" if aware else "with predict_feedback"
    assert stage0["probes"] > 0 and set(stage0["variants"]) == {name}
    # the same probes: the other prediction's error is near, not equal (the option changes the weights)
    assert stage0["variants"][name] != stage0["prediction_error"]
    assert stage0["variants"][name] == pytest.approx(stage0["prediction_error"], rel=0.2)
    # the last stage never predicts: its variant is its version itself, the error the same
    last = result.metrics["prediction_error"][2]
    assert last["probes"] == 0 or last["variants"][name] == last["prediction_error"]


def test_predict_feedback_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="predict_feedback extrapolates .* needs error_feedback on"):
        pipeoptim.Pipeline(_model(), stages=3, method="pipeoptim-2bw", partition=[2, 2, 1], optimizer=OPTIMIZERS["adamw"][0],
                           loss_fn=nn.functional.mse_loss, predict_feedback=True)
    for method in ("pipedream-2bw", "pipeoptim"):  # no prediction, or no error feedback
        with pytest.raises(ValueError, match="predict_feedback applies to pipeoptim-2bw"):
            pipeoptim.Pipeline(_model(), stages=3, method=method, partition=[2, 2, 1], optimizer=OPTIMIZERS["adamw"][0],
                               loss_fn=nn.functional.mse_loss, error_feedback=True, predict_feedback=True)


def test_the_option_adds_no_weight_copy():
    from pipeoptim.methods import get_method
    assert get_method("pipeoptim-2bw").weight_versions(3, error_feedback=True,
                                                                         predict_feedback=True) == [5, 5, 3]
