"""Optimizers by name (pipeoptim.lab.optimizers): `muon` (torch's Muon on hidden matrices, AdamW on
the rest, one optimizer per stage) and `--beta1`; how a stage's parameters are split; the
combined optimizer under schedulers, step hooks, state by name and the predicting methods."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeoptim
from pipeoptim import Pipeline
from pipeoptim.muon_adamw import MuonWithAdamW, split_for_muon
from pipeoptim.lab.optimizers import make_optimizer
from pipeoptim.runtime.build import StageParameters
from pipeoptim.lab.tasks.lm import build_gpt

LOSS = nn.functional.cross_entropy


def gpt(seed=0):
    torch.manual_seed(seed)
    return build_gpt(vocab_size=11, seq_len=6, d_model=8, layers=2, nhead=2, d_ff=16, dropout=0.0)


def lm_data(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 11, (4, 6), generator=g), torch.randint(0, 11, (4, 6), generator=g))
            for _ in range(n)]


def lm_loss(logits, target):
    return LOSS(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def names_of(model, params):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for p in params]


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = gpt()
    # two stages as build_stages makes them: [embedding, block 1] and [block 2, head]
    first = StageParameters(list(model[:2].parameters()), model[:2], holds_output=False)
    last = StageParameters(list(model[2:].parameters()), model[2:], holds_output=True)
    muon, adamw = split_for_muon(first)
    assert names_of(model, muon) == ["1.attn.qkv.weight", "1.attn.proj.weight", "1.mlp.0.weight", "1.mlp.2.weight"]
    assert names_of(model, adamw) == ["0.tok.weight", "0.pos.weight", "1.ln1.weight", "1.ln1.bias",
                                      "1.attn.qkv.bias", "1.attn.proj.bias", "1.ln2.weight", "1.ln2.bias",
                                      "1.mlp.0.bias", "1.mlp.2.bias"]
    muon, adamw = split_for_muon(last)
    assert names_of(model, muon) == ["2.attn.qkv.weight", "2.attn.proj.weight", "2.mlp.0.weight", "2.mlp.2.weight"]
    assert "3.proj.weight" in names_of(model, adamw)     # the output layer
    assert all(p.ndim == 2 for p in muon) and len(muon) + len(adamw) == len(list(last))
    # a plain list (no module to read): every 2-D parameter goes to Muon
    muon, _ = split_for_muon(list(model[3].parameters()))
    assert names_of(model, muon) == ["3.proj.weight"]


def test_the_factories_build_what_the_options_say():
    model = gpt()
    params = StageParameters(list(model.parameters()), model, holds_output=True)
    opt = make_optimizer("muon", 0.02, momentum=0.9, beta1=0.8)(params)
    assert isinstance(opt, MuonWithAdamW)
    muon, adamw = opt.parts
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert [g["lr"] for g in opt.param_groups] == [0.02, 0.002]           # AdamW: lr / 10
    assert (muon.defaults["momentum"], muon.defaults["weight_decay"]) == (0.9, 0.1)  # torch's decay
    assert (adamw.defaults["betas"], adamw.defaults["weight_decay"]) == ((0.8, 0.999), 0.01)
    opt = make_optimizer("muon", 0.02, weight_decay=0.05, adamw_lr=0.003)(params)
    assert [g["lr"] for g in opt.param_groups] == [0.02, 0.003]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.05]
    nadam = make_optimizer("nadam", 1e-3, beta1=0.99)(list(model.parameters()))
    assert isinstance(nadam, torch.optim.NAdam) and nadam.defaults["betas"] == (0.99, 0.999)
    for args, message in [(("sgd", 0.1), dict(beta1=0.9)), (("nadam", 0.1), dict(beta1=1.0)),
                          (("adam", 0.1), dict(adamw_lr=0.1))]:
        with pytest.raises(ValueError, match="beta1|adamw-lr"):
            make_optimizer(*args, **message)


def test_the_combined_optimizer_under_a_scheduler_a_load_and_a_step_hook():
    model = gpt()
    opt = make_optimizer("muon", 0.02)(StageParameters(list(model.parameters()), model, True))
    seen = []
    opt.register_step_post_hook(lambda o, a, k: seen.append([g["lr"] for g in o.param_groups]))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))
    x, y = lm_data(1)[0]
    for _ in range(2):
        lm_loss(model(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert seen == [[0.02, 0.002], [0.01, 0.001]]  # the scheduler sets both parts' lrs
    state = opt.state_dict()
    assert len(state["state"]) == len(list(model.parameters()))  # both parts' state, one dict
    other = make_optimizer("muon", 0.02)(StageParameters(list(model.parameters()), model, True))
    other.load_state_dict(state)
    assert other.parts[0].param_groups[0] is other.param_groups[0] and other.parts[1].state is other.state
    assert other.param_groups[0]["lr"] == pytest.approx(0.02 / 3)
    p = next(iter(other.parts[0].param_groups[0]["params"]))
    assert torch.equal(other.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])


def test_muon_one_stage_equals_sequential_and_predicting_methods_run():
    factory = make_optimizer("muon", 0.02)
    reference = pipeoptim.train(gpt(), lm_data(), method="sequential", optimizer=factory, loss_fn=lm_loss)
    alone = pipeoptim.train(gpt(), lm_data(), method="pipeoptim", stages=1, optimizer=factory, loss_fn=lm_loss)
    assert alone.losses == reference.losses
    for method in ("pipeoptim", "pipeoptim-2bw", "xpipe", "spectrain"):
        result = pipeoptim.train(gpt(), lm_data(), method=method, stages=2, optimizer=factory, loss_fn=lm_loss)
        assert len(result.losses) == 6 and all(loss == loss for loss in result.losses)
        assert result.version_trace and max(e.steps for e in result.version_trace) >= 1  # it predicted


def test_a_muon_state_resumes_by_name_in_another_partition():
    make = dict(method="pipeoptim", loss_fn=lm_loss, optimizer=make_optimizer("muon", 0.02))
    first = Pipeline(gpt(), partition=[1, 3], **make)
    first.fit(lm_data(4))
    state = first.state_dict()
    second = Pipeline(gpt(seed=5), partition=[2, 2], **make)
    second.load_state_dict(state)
    buffers = {n: s.optimizer.state[p]["momentum_buffer"] for s in first.stages
               for n, p in s.module.named_parameters() if "momentum_buffer" in s.optimizer.state[p]}
    assert len(buffers) == 8  # the 2 blocks' 4 hidden matrices
    for stage in second.stages:
        assert stage.policy.predictor.has_direction and not stage.policy.predictor.uses_fallback
        for name, p in stage.module.named_parameters():
            if name in buffers:
                assert torch.equal(stage.optimizer.state[p]["momentum_buffer"], buffers[name])
                assert any(p is q for q in stage.optimizer.parts[0].param_groups[0]["params"])
    assert len(second.fit(lm_data(2)).losses) == 6  # the run's losses: 4 before the load, 2 after
