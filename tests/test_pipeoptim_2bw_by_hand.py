"""pipeoptim-2bw on a tiny model equals a three-stage pipeline written out by hand, with no autograd.

Each stage is one linear layer (tanh on the first two); every mini-batch is split into M = 3
micro-batches and each stage updates once per window of 3 (2BW's schedule: asynchronous 1F1B
over micro-batches). The test keeps its own weights, momentum buffers and orders. At the first
forward of window t a stage fixes the window's weights, forward and backward, for all its
micro-batches: W - lr * s * m (m the momentum buffer: SGD's direction) with s = 1 at stages
0 and 1 from window 1 on, once the stage has stepped; else the weights as they are then, kept
through a later update. The last stage never predicts (s = 0). These are the semantics of
docs/architecture.md, "Weight versions per method" (row pipeoptim-2bw), computed by hand.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeoptim

N, M, T, LR, MU = 3, 3, 8, 0.1, 0.9
DIMS = [(5, 7), (7, 6), (6, 3)]


def order(k):
    """Stage k's actions: warm-up forwards, then F, B and an update after every third backward."""
    total, w = T * M, N - 1 - k
    seq = [("F", i) for i in range(w)]
    for j in range(total):
        if w + j < total:
            seq.append(("F", w + j))
        seq.append(("B", j))
        if (j + 1) % M == 0:
            seq.append(("U", j // M))
    return seq


def hand_pipeline(weights, biases, data, feedback=False):
    """The per-mini-batch losses and final weights; ``feedback``: error feedback after each
    update whose window ran on an older version than the live one,
    ``W -= u_t - u_(t-1)`` (u = LR * momentum, the step SGD applied)."""
    W = [w.clone() for w in weights]
    b = [x.clone() for x in biases]
    mom = [[None, None] for _ in range(N)]
    grad_sum = [[torch.zeros_like(W[k]), torch.zeros_like(b[k])] for k in range(N)]
    window = [dict() for _ in range(N)]   # stage -> window -> (W, b) it runs on
    saved = [dict() for _ in range(N)]
    acts, grads, losses = {}, {}, {}
    updates = [0] * N
    previous = [None] * N                 # stage -> the step it applied at its last update
    used = [[] for _ in range(N)]         # stage -> versions of the windows since its last update
    orders = [order(k) for k in range(N)]
    pointer = [0] * N
    micro = [(x[2 * j:2 * j + 2], y[2 * j:2 * j + 2]) for x, y in data for j in range(M)]
    while any(pointer[k] < len(orders[k]) for k in range(N)):
        for k in range(N):
            while pointer[k] < len(orders[k]):
                kind, i = orders[k][pointer[k]]
                if kind == "F":
                    x = micro[i][0] if k == 0 else acts.get((k, i))
                    if x is None:
                        break
                    t = i // M
                    if t not in window[k]:
                        s = 1 if (k < N - 1 and t >= 1 and updates[k] > 0) else 0
                        if s:
                            window[k][t] = (W[k] - LR * s * mom[k][0], b[k] - LR * s * mom[k][1], updates[k])
                        else:  # this version, kept even if the stage updates during the window
                            window[k][t] = (W[k].clone(), b[k].clone(), updates[k])
                    Wf, bf, _ = window[k][t]
                    z = x @ Wf.T + bf
                    a = torch.tanh(z) if k < N - 1 else z
                    saved[k][i] = (x, a)
                    if k < N - 1:
                        acts[(k + 1, i)] = a
                    else:  # the mean squared error of the micro-batch, scaled by its share (1/3)
                        losses[i] = float(((a - micro[i][1]) ** 2).mean()) / M
                elif kind == "B":
                    x, a = saved[k][i]
                    if k == N - 1:
                        gz = 2 * (a - micro[i][1]) / a.numel() / M
                    else:
                        if (k, i) not in grads:
                            break
                        gz = grads.pop((k, i)) * (1 - a ** 2)
                    Wb, _, version = window[k][i // M]    # the window's weights, as at its forward
                    used[k].append(version)
                    grad_sum[k][0] += gz.T @ x
                    grad_sum[k][1] += gz.sum(0)
                    if k > 0:
                        grads[(k - 1, i)] = gz @ Wb
                else:  # U: torch's SGD with momentum; the first buffer is the gradient itself
                    for j, g in enumerate(grad_sum[k]):
                        mom[k][j] = g.clone() if mom[k][j] is None else MU * mom[k][j] + g
                    step = (LR * mom[k][0], LR * mom[k][1])
                    W[k], b[k] = W[k] - step[0], b[k] - step[1]
                    if feedback and previous[k] is not None and updates[k] - min(used[k]) >= 1:
                        W[k] = W[k] - (step[0] - previous[k][0])
                        b[k] = b[k] - (step[1] - previous[k][1])
                    previous[k], used[k] = step, []
                    grad_sum[k] = [torch.zeros_like(W[k]), torch.zeros_like(b[k])]
                    updates[k] += 1
                pointer[k] += 1
    per_minibatch = [sum(losses[t * M + j] for j in range(M)) for t in range(T)]
    return per_minibatch, W, b


@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "error-feedback"])
def test_pipeoptim_2bw_equals_hand_written_three_stage_loop(feedback):
    torch.manual_seed(5)
    layers = [nn.Linear(i, o).double() for i, o in DIMS]
    model = nn.Sequential(layers[0], nn.Tanh(), layers[1], nn.Tanh(), layers[2])
    data = [(torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)) for _ in range(T)]
    expected, final_w, final_b = hand_pipeline([l.weight.detach() for l in layers],
                                               [l.bias.detach() for l in layers], data, feedback)
    sgdm = lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MU)  # noqa: E731
    options = {"error_feedback": True} if feedback else {}
    result = pipeoptim.train(model, data, method="pipeoptim-2bw", partition=[2, 2, 1], micro_batches=M,
                             optimizer=sgdm, loss_fn=nn.functional.mse_loss, **options)
    assert result.losses == pytest.approx(expected, rel=1e-12, abs=1e-14)
    trained = [m for m in result.model if isinstance(m, nn.Linear)]
    for layer, w, bias in zip(trained, final_w, final_b):
        assert torch.allclose(layer.weight, w, rtol=1e-12, atol=1e-14)
        assert torch.allclose(layer.bias, bias, rtol=1e-12, atol=1e-14)
    # and the prediction mattered: 2BW's stale windows give other losses
    stale = pipeoptim.train(model, data, method="pipedream-2bw", partition=[2, 2, 1], micro_batches=M,
                            optimizer=sgdm, loss_fn=nn.functional.mse_loss)
    assert max(abs(a - b) for a, b in zip(stale.losses, expected)) > 1e-6
    if feedback:  # and the feedback mattered too
        plain, _, _ = hand_pipeline([l.weight.detach() for l in layers], [l.bias.detach() for l in layers], data)
        assert max(abs(a - b) for a, b in zip(plain, expected)) > 1e-6
