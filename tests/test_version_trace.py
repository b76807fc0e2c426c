"""Every method's version trace equals docs/architecture.md, "Schedules as data" and "Weight
versions per method", for N = 2, 4, 8."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeoptim
from conftest import batches, mlp

T = 18  # mini-batches per epoch: long enough for an 8-stage steady state


def run(method, n, epochs=1, **options):
    model = mlp(depth=8)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    result = pipeoptim.train(model, batches(T), method=method, stages=n, optimizer=opt,
                             loss_fn=nn.functional.cross_entropy, epochs=epochs, **options)
    return {(e.stage, e.microbatch, e.kind): (e.version, e.steps) for e in result.version_trace}, result


def expected_async(n, t, k, epoch_start=0):
    """Within an epoch, forward of t at stage k sees min(t, w_k) fewer updates than its backward."""
    w = n - 1 - k
    return epoch_start + max(0, t - w), epoch_start + t


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("method", ["gpipe", "1f1b-flush"])
def test_synchronous_methods_use_one_version_per_minibatch(method, n):
    trace, result = run(method, n)
    m = result.metrics["microbatches"]
    assert m == n
    for k in range(n):
        for i in range(T * m):
            assert trace[(k, i, "F")] == (i // m, 0)
            assert trace[(k, i, "B")] == (i // m, 0)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zb_h1_runs_both_halves_of_each_backward_on_the_forwards_version(n):
    trace, result = run("zb-h1", n)
    m = result.metrics["microbatches"]
    assert m == n
    assert {kind for _, _, kind in trace} == {"F", "I", "W"}
    for k in range(n):
        for i in range(T * m):
            assert trace[(k, i, "F")] == trace[(k, i, "I")] == trace[(k, i, "W")] == (i // m, 0)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_async_naive_forward_stale_backward_latest(n):
    trace, _ = run("async-naive", n)
    for k in range(n):
        for t in range(T):
            fwd, bwd = expected_async(n, t, k)
            assert trace[(k, t, "F")] == (fwd, 0)
            assert trace[(k, t, "B")] == (bwd, 0)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_pipedream_stashes_the_forward_version(n):
    trace, result = run("pipedream", n)
    for k in range(n):
        for t in range(T):
            fwd, _ = expected_async(n, t, k)
            assert trace[(k, t, "F")] == (fwd, 0)
            assert trace[(k, t, "B")] == (fwd, 0)
    assert result.metrics["weight_versions"] == [n - k for k in range(n)]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_pipedream_vertical_sync_uses_stage0_version_everywhere(n):
    trace, result = run("pipedream", n, vertical_sync=True)
    for k in range(n):
        for t in range(T):
            stage0 = max(0, t - (n - 1))
            assert trace[(k, t, "F")] == (stage0, 0)
            assert trace[(k, t, "B")] == (stage0, 0)
    # stage k keeps the versions from the oldest in-flight batch's up to the live one
    assert max(result.metrics["weight_versions"]) <= n


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("steps", ["exact", "paper", "code"])
def test_pipeoptim_steps_policies(n, steps):
    trace, _ = run("pipeoptim", n, epochs=2, steps=steps)
    for epoch in range(2):
        for k in range(n):
            w = n - 1 - k
            for t in range(T):
                i = epoch * T + t
                fwd, bwd = expected_async(n, t, k, epoch * T)
                has_direction = fwd >= 1  # no prediction before the stage's first update
                s = {"exact": min(t, w), "paper": w, "code": w + 1}[steps] if has_direction else 0
                assert trace[(k, i, "F")] == (fwd, s), (k, i)
                assert trace[(k, i, "B")] == (bwd, 0)
                if steps == "exact" and has_direction:
                    assert fwd + s == bwd  # the prediction spans exactly the missing updates


def test_pipeoptim_exact_steps_in_warmup_of_later_epochs():
    """After the drain, warm-up forwards of epoch 2 predict only min(t, w) steps (not w)."""
    trace, _ = run("pipeoptim", 4, epochs=2)
    assert [trace[(0, T + t, "F")][1] for t in range(5)] == [0, 1, 2, 3, 3]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_spectrain_steps(n):
    trace, _ = run("spectrain", n)
    for k in range(n):
        for t in range(T):
            fwd, bwd = expected_async(n, t, k)
            s_f = k // 2 + n - k - 1 if fwd >= 1 else 0
            s_b = k // 2 if bwd >= 1 else 0
            assert trace[(k, t, "F")] == (fwd, s_f)
            assert trace[(k, t, "B")] == (bwd, s_b)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_2bw_window_uses_previous_version_at_every_stage(n):
    trace, result = run("pipedream-2bw", n)
    m = result.metrics["microbatches"]
    for k in range(n):
        for i in range(T * m):
            version = max(0, i // m - 1)
            assert trace[(k, i, "F")] == (version, 0)
            assert trace[(k, i, "B")] == (version, 0)
    assert result.metrics["weight_versions"] == [2.0] * n


@pytest.mark.parametrize("n", [2, 4, 8])
def test_pipeoptim_2bw_window_predicts_the_updates_it_misses(n):
    """Window t at stage k runs forward and backward on the live version v at its first forward,
    predicted s updates ahead: stages 0..N-2 v = t-1, s = 1 (2BW's version, one step on); the last
    stage v = t, s = 0 (already the weights update t is applied to). Window 0 and windows before
    the stage's first update run unpredicted; after a drain the warm-up starts again."""
    trace, result = run("pipeoptim-2bw", n, epochs=2)
    m = result.metrics["microbatches"]
    assert m == n
    for epoch in range(2):
        start = epoch * T
        for k in range(n):
            for i in range(T * m):
                t = i // m
                if k == n - 1:
                    expected = (start + t, 0)
                else:
                    version = start + max(0, t - 1)
                    expected = (version, 1 if t >= 1 and version >= 1 else 0)
                micro = start * m + i
                assert trace[(k, micro, "F")] == expected, (epoch, k, i)
                assert trace[(k, micro, "B")] == expected, (epoch, k, i)
    # the version plus the steps is the update each window's gradient joins, once predicting
    assert all(trace[(0, i, "F")][0] + trace[(0, i, "F")][1] == i // m for i in range(2 * m, T * m))
    assert result.metrics["weight_versions"] == [3.0] * (n - 1) + [1.0]


@pytest.mark.parametrize("n", [2, 4])
def test_xpipe_predicts_the_exact_updates_before_backward(n):
    trace, result = run("xpipe", n)
    m = result.metrics["microbatches"]
    for k in range(n):
        for i in range(T * m):
            fwd, s = trace[(k, i, "F")]
            bwd, _ = trace[(k, i, "B")]
            if fwd >= 1:
                assert fwd + s == bwd
            else:
                assert s == 0
    # the micro-batched pipeline makes the first stage's forwards stale by more than zero
    assert any(trace[(0, i, "F")][1] > 0 for i in range(T * m))
