"""Error feedback (``error_feedback=True``, weights/error_feedback.py): PipeDream-2BW with it
equals a plain loop that writes the delay out, for torch's AdamW and the library's Muon.

The loop: update t's gradient is computed on the weights of version ``v(t) = max(t - 1, 0)``
(2BW's steady state, every stage: window t's forwards and backwards run on W^(t-1); window 0
on W^0), the optimizer applies its step ``u_t`` to W^t, and from the first update whose
gradient is stale on, ``W^(t+1) = W^t - u_t - (u_t - u_(t-1))``. A model of two stages,
two micro-batches a window.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipeoptim
from conftest import Crash, crash_at
from pipeoptim.muon_adamw import MuonWithAdamW, split_for_muon
from pipeoptim.runtime.build import StageParameters
from pipeoptim.weights.error_feedback import UpdateFeedback

T, M = 7, 2


def _model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def _data():
    gen = torch.Generator().manual_seed(11)
    return [(torch.randn(4, 5, generator=gen, dtype=torch.float64),
             torch.randn(4, 3, generator=gen, dtype=torch.float64)) for _ in range(T)]


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.02, weight_decay=0.1),
    "muon": lambda ps: MuonWithAdamW(*split_for_muon(ps), lr=0.05, adamw_lr=0.01),
}
PARTITION = [2, 3]  # stage 0: Linear, Tanh; stage 1: Linear, Tanh, Linear


def hand_loop(model: nn.Sequential, data, make_optimizer, feedback: bool):
    """The per-mini-batch losses and the final model of 2BW's delayed updates, written out."""
    model = copy.deepcopy(model)
    stages = [model[:PARTITION[0]], model[PARTITION[0]:]]
    # one optimizer per stage, as the pipeline makes them (Muon's split reads each stage)
    optimizers = [make_optimizer(StageParameters(list(s.parameters()), s, k == 1))
                  for k, s in enumerate(stages)]
    params = [p for s in stages for p in s.parameters()]
    versions = [[p.detach().clone() for p in params]]          # W^0, W^1, ...
    previous, losses = None, []
    for t, (x, y) in enumerate(data):
        stale = max(t - 1, 0)
        live = [p.detach().clone() for p in params]
        with torch.no_grad():  # the gradient of the stale version
            for p, w in zip(params, versions[stale]):
                p.copy_(w)
        for opt in optimizers:
            opt.zero_grad()
        loss = sum(nn.functional.mse_loss(model(x[j * 2:j * 2 + 2]), y[j * 2:j * 2 + 2]) / M for j in range(M))
        loss.backward()
        losses.append(float(loss.detach()))
        with torch.no_grad():  # ... applied to the live one
            for p, w in zip(params, live):
                p.copy_(w)
            for opt in optimizers:
                opt.step()
            step = [w - p.detach() for p, w in zip(params, live)]
            if feedback and previous is not None and t - stale >= 1:
                for p, u, u_before in zip(params, step, previous):
                    p.sub_(u - u_before)
            previous = step
        versions.append([p.detach().clone() for p in params])
    return losses, model


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_pipedream_2bw_with_error_feedback_equals_the_delay_written_out(name):
    model, data = _model(), _data()
    expected, expected_model = hand_loop(model, data, OPTIMIZERS[name], feedback=True)
    result = pipeoptim.train(model, data, method="pipedream-2bw", partition=PARTITION, micro_batches=M,
                             optimizer=OPTIMIZERS[name], loss_fn=nn.functional.mse_loss, error_feedback=True)
    assert result.losses == pytest.approx(expected, rel=1e-10, abs=1e-12)
    for got, want in zip(result.model.parameters(), expected_model.parameters()):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    # without it, the loop is 2BW itself; and the correction changes the run
    plain, _ = hand_loop(model, data, OPTIMIZERS[name], feedback=False)
    stale = pipeoptim.train(model, data, method="pipedream-2bw", partition=PARTITION, micro_batches=M,
                            optimizer=OPTIMIZERS[name], loss_fn=nn.functional.mse_loss)
    assert stale.losses == pytest.approx(plain, rel=1e-10, abs=1e-12)
    assert max(abs(a - b) for a, b in zip(plain, expected)) > 1e-6


def test_memory_and_versions_count_the_two_buffers():
    model, data = _model(), _data()
    pipe = pipeoptim.Pipeline(model, stages=2, method="pipedream-2bw", partition=PARTITION, micro_batches=M,
                              optimizer=OPTIMIZERS["adamw"], loss_fn=nn.functional.mse_loss, error_feedback=True)
    pipe.fit(data)
    # every update but the first (no previous one)
    assert [s.policy.feedback.corrected for s in pipe.stages] == [T - 1] * 2
    assert pipe.method.weight_versions(2, error_feedback=True) == [4, 4]
    assert [round(s.policy.versions_peak, 6) for s in pipe.stages] == [4.0, 4.0]


def test_update_feedback_corrects_stale_updates_after_the_first():
    w = nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
    feedback = UpdateFeedback([("w", w)])
    steps = [torch.tensor([0.5, -1.0]), torch.tensor([0.25, 0.5]), torch.tensor([1.0, 1.0])]
    delays = [1, 0, 1]
    expected = w.detach().clone()
    previous = None
    for step, delay in zip(steps, delays):
        feedback.before_step()
        with torch.no_grad():
            w.sub_(step.double())  # the optimizer's step
        corrected = feedback.after_step(delay)
        expected -= step.double()
        assert corrected == (previous is not None and delay >= 1)
        if corrected:
            expected -= step.double() - previous
        previous = step.double()
        assert torch.equal(w.detach(), expected)
    state = feedback.state_dict()
    again = UpdateFeedback([("w", w)])
    again.load_state_dict(state)
    assert again.updates == 3 and again.corrected == 1 and torch.equal(again.previous["w"], steps[-1].double())


def test_error_feedback_is_refused_where_the_delay_is_not_one_update():
    with pytest.raises(ValueError, match="error_feedback applies to pipedream-2bw, pipeoptim-2bw"):
        pipeoptim.Pipeline(_model(), stages=2, method="pipeoptim", optimizer=OPTIMIZERS["adamw"],
                           loss_fn=nn.functional.mse_loss, error_feedback=True)


def test_a_run_resumed_mid_epoch_keeps_the_previous_update(tmp_path):
    def run(folder, **kwargs):
        return pipeoptim.train(_model(), _data() * 2, method="pipeoptim-2bw", partition=PARTITION,
                               micro_batches=M, optimizer=OPTIMIZERS["adamw"], loss_fn=nn.functional.mse_loss,
                               error_feedback=True, checkpoint_dir=folder, checkpoint_every=5, **kwargs)

    expected = run(tmp_path / "full").losses

    with pytest.raises(Crash):
        run(tmp_path / "cut", on_batch=crash_at(12))
    assert run(tmp_path / "cut", resume=True).losses == expected
    # and a resume that drops the option is refused, naming it
    with pytest.raises(pipeoptim.errors.CheckpointError, match="error_feedback"):
        pipeoptim.train(_model(), _data() * 2, method="pipeoptim-2bw", partition=PARTITION, micro_batches=M,
                        optimizer=OPTIMIZERS["adamw"], loss_fn=nn.functional.mse_loss,
                        checkpoint_dir=tmp_path / "cut", checkpoint_every=5, resume=True)
