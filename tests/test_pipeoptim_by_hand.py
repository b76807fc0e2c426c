"""PipeOptim on a tiny model equals a three-stage pipeline written out by hand, with no autograd.

Each stage is one linear layer (tanh on the first two). The test keeps its own weights, momentum
buffers and 1F1B orders, predicts W_hat = W - lr * s * m with s = min(t, 2 - k) (the `exact`
policy) for the forward, and back-propagates with the weights that are live at backward time,
on the activations saved by the forward: the semantics of docs/architecture.md, "Weight versions per
method" and "The prediction per optimizer", computed by hand.
"""
from __future__ import annotations

import torch
from torch import nn

import pipeoptim

N, T, LR, MU = 3, 10, 0.1, 0.9
DIMS = [(5, 7), (7, 6), (6, 3)]


def hand_pipeline(weights, biases, data):
    W = [w.clone() for w in weights]
    b = [x.clone() for x in biases]
    mom_w = [None] * N
    mom_b = [None] * N
    saved = [dict() for _ in range(N)]
    acts = {}
    grads = {}
    losses = {}

    def order(k):
        w = N - 1 - k
        seq = [("F", t) for t in range(w)]
        for j in range(T - w):
            seq += [("F", w + j), ("B", j)]
        seq += [("B", j) for j in range(T - w, T)]
        return seq

    orders = [order(k) for k in range(N)]
    updates = [0] * N
    pointer = [0] * N
    while any(pointer[k] < len(orders[k]) for k in range(N)):
        for k in range(N):
            while pointer[k] < len(orders[k]):
                kind, t = orders[k][pointer[k]]
                if kind == "F":
                    x = data[t][0] if k == 0 else acts.get((k, t))
                    if x is None:
                        break
                    s = min(t, N - 1 - k) if updates[k] > 0 else 0
                    Wf = W[k] - LR * s * mom_w[k] if s else W[k]
                    bf = b[k] - LR * s * mom_b[k] if s else b[k]
                    z = x @ Wf.T + bf
                    a = torch.tanh(z) if k < N - 1 else z
                    saved[k][t] = (x, a)
                    if k < N - 1:
                        acts[(k + 1, t)] = a
                    else:
                        losses[t] = float(((a - data[t][1]) ** 2).mean())
                else:
                    if k == N - 1:
                        x, a = saved[k][t]
                        gz = 2 * (a - data[t][1]) / a.numel()
                    else:
                        if (k, t) not in grads:
                            break
                        x, a = saved[k][t]
                        gz = grads.pop((k, t)) * (1 - a ** 2)
                    gW, gb = gz.T @ x, gz.sum(0)
                    if k > 0:
                        grads[(k - 1, t)] = gz @ W[k]  # latest weights, not the predicted ones
                    # torch's SGD: the first momentum buffer is the gradient itself
                    mom_w[k] = gW.clone() if mom_w[k] is None else MU * mom_w[k] + gW
                    mom_b[k] = gb.clone() if mom_b[k] is None else MU * mom_b[k] + gb
                    W[k] = W[k] - LR * mom_w[k]
                    b[k] = b[k] - LR * mom_b[k]
                    updates[k] += 1
                pointer[k] += 1
    return [losses[t] for t in range(T)], W


def test_pipeoptim_equals_hand_written_three_stage_loop():
    torch.manual_seed(3)
    layers = [nn.Linear(i, o).double() for i, o in DIMS]
    model = nn.Sequential(layers[0], nn.Tanh(), layers[1], nn.Tanh(), layers[2])
    data = [(torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)) for _ in range(T)]
    expected, final_weights = hand_pipeline([l.weight.detach() for l in layers],
                                            [l.bias.detach() for l in layers], data)
    result = pipeoptim.train(model, data, method="pipeoptim", partition=[2, 2, 1],
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MU),
                             loss_fn=nn.functional.mse_loss)
    assert result.losses == __import__("pytest").approx(expected, rel=1e-12, abs=1e-14)
    trained = [m for m in result.model if isinstance(m, nn.Linear)]
    for layer, w in zip(trained, final_weights):
        assert torch.allclose(layer.weight, w, rtol=1e-12, atol=1e-14)
    # and the prediction mattered: async-naive (no prediction) gives other losses
    naive = pipeoptim.train(model, data, method="async-naive", partition=[2, 2, 1],
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MU),
                            loss_fn=nn.functional.mse_loss)
    assert max(abs(a - b) for a, b in zip(naive.losses, expected)) > 1e-6
