"""Weight policies: step counts pinned by hand for N = 4, and the weight copies each one really
holds, measured in bytes (not read from the design table)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeoptim
from pipeoptim.schedules import build_schedule
from pipeoptim.methods import get_method
from pipeoptim.weights import PipeOptim2BWPolicy, PipeOptimPolicy, SpecTrainPolicy, StashingPolicy
from conftest import batches, mlp

LOSS = nn.functional.cross_entropy
SGDM = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731


def equal_width_model(n):
    """Every stage the same parameter bytes, so a version is the same number of bytes everywhere."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(n)]).double()


def data(count=20):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(12, 6, generator=g, dtype=torch.float64), torch.randint(0, 6, (12,), generator=g))
            for _ in range(count)]


def policy_for(cls, k, n=4, **options):
    module = nn.Linear(2, 2)
    policy = cls(module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9), stage=k,
                 num_stages=n, **options)
    policy.begin_epoch(build_schedule("async-1f1b", n, 1, 10).orders[k])
    return policy


def test_step_counts_for_four_stages_by_hand():
    # steady state (mini-batch 6): exact = paper = N-1-k; code = N-k
    assert [policy_for(PipeOptimPolicy, k, steps="exact").forward_steps(6) for k in range(4)] == [3, 2, 1, 0]
    assert [policy_for(PipeOptimPolicy, k, steps="paper").forward_steps(6) for k in range(4)] == [3, 2, 1, 0]
    assert [policy_for(PipeOptimPolicy, k, steps="code").forward_steps(6) for k in range(4)] == [4, 3, 2, 1]
    # warm-up: exact is min(t, N-1-k); at stage 0, mini-batches 0..4
    assert [policy_for(PipeOptimPolicy, 0).forward_steps(t) for t in range(5)] == [0, 1, 2, 3, 3]
    # SpecTrain: s_f = floor(k/2) + N-k-1, s_b = floor(k/2)
    assert [policy_for(SpecTrainPolicy, k).forward_steps(6) for k in range(4)] == [3, 2, 2, 1]
    assert [policy_for(SpecTrainPolicy, k).backward_steps for k in range(4)] == [0, 0, 1, 1]


def test_pipeoptim_2bw_window_steps_for_four_stages_by_hand():
    # 2bw, m = 4: window t's steps are the updates between its first forward and its last backward
    def steps(k):
        policy = PipeOptim2BWPolicy(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
                                    stage=k, num_stages=4)
        policy.begin_epoch(build_schedule("2bw", 4, 4, 6).orders[k])
        return [policy.base_forward_steps(4 * t + j) for t in range(6) for j in (0, 3)]
    assert [steps(k) for k in range(3)] == [[0, 0] + [1, 1] * 5] * 3
    assert steps(3) == [0] * 12


def measured_versions(method, n, **options):
    result = pipeoptim.train(equal_width_model(n), data(), method=method, stages=n, optimizer=SGDM,
                             loss_fn=LOSS, **options)
    return result.metrics["weight_versions"]


@pytest.mark.parametrize("n", [2, 4, 6])
def test_measured_weight_copies(n):
    assert measured_versions("pipedream", n) == [n - k for k in range(n)]
    assert measured_versions("pipedream-2bw", n) == [2] * n
    # PipeOptim on 2BW: two windows' predicted values beside the live weights at stages 0..N-2,
    # the live weights alone at the last stage; the registry says the same
    assert measured_versions("pipeoptim-2bw", n) == [3] * (n - 1) + [1]
    assert get_method("pipeoptim-2bw").weight_versions(n) == [3] * (n - 1) + [1]
    assert measured_versions("async-naive", n) == [1] * n
    assert measured_versions("gpipe", n) == [1] * n
    # PipeOptim: the live weights and one cache where it predicts (s > 0), whatever N
    assert measured_versions("pipeoptim", n) == [2] * (n - 1) + [1] == get_method("pipeoptim").weight_versions(n)
    assert measured_versions("pipeoptim", n, steps="code") == [2] * n == \
        get_method("pipeoptim").weight_versions(n, steps="code")
    # SpecTrain predicts wherever s_f or s_b is positive: all stages but the last of a 2-stage pipe
    assert measured_versions("spectrain", n) == [2] * (n - 1) + [1 if n == 2 else 2]
    # predicted backward weights: each in-flight mini-batch keeps its predicted copy
    assert measured_versions("pipeoptim", n, backward="predicted") == [1 + (n - k) for k in range(n - 1)] + [1]


def test_prediction_is_written_and_restored_bit_for_bit():
    module = nn.Linear(3, 3).double()
    opt = torch.optim.Adam(module.parameters(), lr=0.1)
    policy = PipeOptimPolicy(module, opt, stage=0, num_stages=3, steps="paper")
    policy.begin_epoch(build_schedule("async-1f1b", 3, 1, 6).orders[0])
    module(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
    opt.step()
    opt.zero_grad()
    policy.after_update()
    before = [p.detach().clone() for p in module.parameters()]
    predicted = policy.predictor.predict(2)
    use = policy.forward_weights(3)
    for p, w in zip(module.parameters(), use.weights.values()):
        assert torch.equal(w.detach(), predicted[p])   # the forward sees W - lr*2*Delta
    use.done()
    for p, b in zip(module.parameters(), before):
        assert torch.equal(p.detach(), b)              # and W comes back exactly


def test_stashing_copies_only_versions_still_needed():
    policy = policy_for(StashingPolicy, 3)               # last stage: F(t), B(t), U(t)
    module_bytes = policy.param_bytes
    for t in range(3):
        use = policy.forward_weights(t)
        with policy.backward_pass(t, use):
            pass
        policy.before_update()
        policy.after_update()
    assert policy.copy_bytes_peak == 0 and module_bytes > 0


@pytest.mark.parametrize("optimizer", [
    SGDM,
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
    lambda ps: torch.optim.NAdam(ps, lr=1e-2, betas=(0.99, 0.999)),
], ids=["momentum", "adamw", "nadam"])
def test_xpipe_is_pipeoptim_at_two_micro_batches_bit_for_bit(optimizer):
    # XPipe predicts along the stage optimizer's own direction with exact steps and runs its
    # backward on the latest weights, which is PipeOptim's default at M = 2: the study runs one
    # of the two (a second would spend its minutes on the same numbers), and this pins why
    def run(method, micro_batches):
        return pipeoptim.train(mlp(), batches(16), method=method, stages=4, micro_batches=micro_batches,
                               optimizer=optimizer, loss_fn=LOSS)

    xpipe, pipeoptim_m2 = run("xpipe", None), run("pipeoptim", 2)
    assert xpipe.losses == pipeoptim_m2.losses
    assert xpipe.version_trace == pipeoptim_m2.version_trace
    for a, b in zip(xpipe.model.parameters(), pipeoptim_m2.model.parameters()):
        assert torch.equal(a, b)
    # and M matters: at one micro-batch PipeOptim's numbers differ
    assert run("pipeoptim", None).losses != xpipe.losses
