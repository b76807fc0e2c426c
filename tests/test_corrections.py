"""The delay corrections (weights/corrections.py): off, each equals today's numbers; on, each
does what its formula says, read from the traces the runtime records."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import pipeoptim
from conftest import batches, mlp
from pipeoptim.checks import check_method_options
from pipeoptim.methods import get_method
from pipeoptim.schedules import simulate
from pipeoptim.weights.corrections import LrLookahead, delay_divisor, horizon_rate

LOSS = nn.functional.cross_entropy
ASYNC = ["async-naive", "pipedream", "spectrain", "xpipe", "pipeoptim"]
PREDICTING = ["spectrain", "xpipe", "pipeoptim"]


def sgdm(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def warmup_lambda(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 4) * 0.9 ** max(0, t - 4))


def run(method="pipeoptim", stages=4, count=10, optimizer=sgdm, **kw):
    return pipeoptim.train(mlp(), batches(count), method=method, stages=stages, optimizer=optimizer,
                           loss_fn=LOSS, **kw)


# -- off: today's numbers ---------------------------------------------------------------------

OFF = {"lr_correction": "none", "sync_warmup": 0, "horizon": "constant", "delta": "optimizer",
       "prediction_warmup": 0}


@pytest.mark.parametrize("method", ASYNC)
def test_every_option_at_its_default_value_equals_the_method_without_options(method):
    options = {k: v for k, v in OFF.items() if k in get_method(method).options}
    plain = run(method, optimizer=adamw, lr_scheduler=warmup_lambda)
    explicit = run(method, optimizer=adamw, lr_scheduler=warmup_lambda, **options)
    assert explicit.losses == plain.losses
    assert explicit.version_trace == plain.version_trace


@pytest.mark.parametrize("method", PREDICTING)
def test_a_scheduled_horizon_under_a_constant_lr_is_the_paper_prediction_bit_for_bit(method):
    plain = run(method)
    assert run(method, horizon="scheduled").losses == plain.losses  # no scheduler: constant lr
    constant = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0)  # noqa: E731
    assert run(method, horizon="scheduled", lr_scheduler=constant).losses == \
        run(method, lr_scheduler=constant).losses


# -- lr_correction="delay" --------------------------------------------------------------------

@pytest.mark.parametrize("scheduler", [None, warmup_lambda])
def test_the_delay_correction_applies_the_formulas_lr_per_stage_and_update(scheduler):
    n, steps = 4, 5
    corrected = run(lr_correction="delay", lr_correction_steps=steps, lr_scheduler=scheduler)
    plain = run(lr_scheduler=scheduler)
    scheduled = {(e.stage, e.update): e.lrs[0] for e in plain.update_trace}
    assert len(corrected.update_trace) == n * 10
    for entry in corrected.update_trace:
        tau = n - 1 - entry.stage
        lr = scheduled[(entry.stage, entry.update)]
        expected = lr / tau ** (1 - min(entry.update / steps, 1)) if tau >= 1 else lr
        assert entry.lrs[0] == expected, entry
    last = [e.lrs for e in corrected.update_trace if e.stage == n - 1]
    assert last == [e.lrs for e in plain.update_trace if e.stage == n - 1]  # the last stage untouched
    first = [e.lrs[0] for e in corrected.update_trace if e.stage == 0]
    assert first[0] == pytest.approx(scheduled[(0, 0)] / 3) and first[steps:] == \
        [scheduled[(0, t)] for t in range(steps, 10)]


def test_the_prediction_uses_the_corrected_lr():
    pipe = pipeoptim.Pipeline(mlp(), method="pipeoptim", stages=3, loss_fn=LOSS, optimizer=sgdm,
                              lr_correction="delay", lr_correction_steps=100)
    for x, y in batches(4):
        pipe.step(x, y)
    policy = pipe.stages[0].policy
    group = policy.optimizer.param_groups[0]
    divisor = delay_divisor(2, policy.version, 100)
    assert divisor == 2 ** (1 - policy.version / 100)
    assert policy.horizon_lr(0, group, 2) == group["lr"] / divisor * 2
    assert policy.horizon_lr(0, group, 2, disable=["lr_correction"]) == group["lr"] * 2


# -- horizon="scheduled" ----------------------------------------------------------------------

def one_cycle(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=40, pct_start=0.3)


@pytest.mark.parametrize("scheduler", [one_cycle, warmup_lambda], ids=["OneCycleLR", "warmup-LambdaLR"])
def test_a_scheduled_horizon_sums_the_schedulers_own_future_lrs(scheduler):
    """Every prediction's lr mass equals the sum of the lrs that the real scheduler then gave the
    updates it spanned (read from the update trace of the same run)."""
    pipe = pipeoptim.Pipeline(mlp(), method="pipeoptim", stages=4, loss_fn=LOSS, optimizer=sgdm,
                              lr_scheduler=scheduler, horizon="scheduled")
    seen = []
    for stage in pipe.stages:
        policy = stage.policy
        original = policy.horizon_lr

        def spy(index, group, steps, disable=(), policy=policy, original=original):
            value = original(index, group, steps, disable)
            seen.append((policy.stage, policy.version, steps, value))
            return value
        policy.horizon_lr = spy
    for x, y in batches(16):
        pipe.step(x, y)
    pipe.flush()
    applied = {(e.stage, e.update): e.lrs[0] for s in pipe.stages for e in s.record.updates}
    checked = 0
    for stage, version, steps, value in seen:
        lrs = [applied[(stage, version + j)] for j in range(int(steps))]
        assert value == pytest.approx(sum(lrs), rel=1e-12)
        checked += 1
        if len(set(lrs)) > 1:
            assert value != pytest.approx(steps * lrs[0], rel=1e-6)  # not the constant-lr prediction
    assert checked >= 30


def test_the_lookahead_restarts_when_an_earlier_state_is_loaded():
    opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    ahead = LrLookahead(opt, warmup_lambda)
    later = ahead.rates(0, 6, 3)
    assert ahead.rates(0, 1, 2) == [0.1 * 0.5, 0.1 * 0.75]
    assert ahead.rates(0, 6, 3) == later == [0.1 * 0.9 ** t for t in (2, 3, 4)]


def test_a_fractional_horizon_counts_its_share_of_the_last_lr():
    assert horizon_rate([0.1, 0.2, 0.4], 2.5) == pytest.approx(0.1 + 0.2 + 0.5 * 0.4)
    assert horizon_rate([0.3, 0.3], 1.5) == 0.3 * 1.5


# -- delta="ema" --------------------------------------------------------------------------------

def test_the_ema_direction_equals_an_average_computed_by_hand():
    decay = 0.8
    pipe = pipeoptim.Pipeline(mlp(), method="pipeoptim", stages=2, loss_fn=LOSS, optimizer=adamw,
                              lr_scheduler=warmup_lambda, delta="ema", ema_decay=decay)
    stage = pipe.stages[0]
    history = []  # (W before, W after, lr applied) of each update of stage 0
    update = stage.update

    def recording(*args, **kwargs):
        before = [p.detach().clone() for p in stage.parameters()]
        lr = float(stage.optimizer.param_groups[0]["lr"])
        update(*args, **kwargs)
        history.append((before, [p.detach().clone() for p in stage.parameters()], lr))
    stage.update = recording
    for x, y in batches(5):
        pipe.step(x, y)
    pipe.flush()
    assert len(history) == 5
    by_hand = None
    for before, after, lr in history:
        d = [(b - a) / lr for b, a in zip(before, after)]
        by_hand = d if by_hand is None else [decay * u + (1 - decay) * x for u, x in zip(by_hand, d)]
    average = stage.policy.average
    assert average.updates == 5
    for (name, _), expected in zip(stage.policy.named, by_hand):
        torch.testing.assert_close(average.average[name], expected, rtol=1e-12, atol=1e-14)


def test_the_ema_prediction_moves_the_weights_along_the_average():
    pipe = pipeoptim.Pipeline(mlp(), method="pipeoptim", stages=3, loss_fn=LOSS, optimizer=sgdm, delta="ema")
    for x, y in batches(3):
        pipe.step(x, y)
    policy = pipe.stages[0].policy
    live = [p.detach().clone() for _, p in policy.named]
    predicted = policy.predicted(2)
    lr = policy.optimizer.param_groups[0]["lr"]
    for (name, _), w, w_hat in zip(policy.named, live, predicted):
        torch.testing.assert_close(w_hat, w - lr * 2 * policy.average.average[name])
    assert pipe.stages[-1].policy.average is None  # the last stage never predicts: no buffer


def test_ema_costs_one_more_weight_copy_where_the_stage_predicts():
    result = run(delta="ema")
    assert result.metrics["weight_versions"] == [3.0, 3.0, 3.0, 1.0]
    assert get_method("pipeoptim").weight_versions(4, delta="ema") == [3, 3, 3, 1]  # as measured


def test_a_decay_outside_the_open_interval_is_rejected():
    for decay in (0.0, 1.0, 1.5):  # checked once, before any UpdateAverage is made
        with pytest.raises(ValueError, match="strictly between 0 and 1"):
            check_method_options(get_method("pipeoptim"), {"delta": "ema", "ema_decay": decay})


# -- prediction_warmup ------------------------------------------------------------------------

def test_the_prediction_ramps_over_the_warmup_updates():
    ramp = 6
    plain = run()
    ramped = run(prediction_warmup=ramp)
    plain_steps = {(e.stage, e.microbatch): (e.version, e.steps) for e in plain.version_trace if e.kind == "F"}
    checked = 0
    for e in ramped.version_trace:
        if e.kind != "F":
            continue
        version, steps = plain_steps[(e.stage, e.microbatch)]
        assert e.version == version
        expected = steps * min(1.0, version / ramp) if version else 0
        assert e.steps == pytest.approx(expected, rel=1e-15)
        checked += 0 < version < ramp and steps > 0
    assert checked >= 3


# -- sync_warmup --------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ASYNC)
def test_a_synchronous_warmup_has_no_staleness_then_the_asynchronous_tables(method):
    """The first K mini-batches: every pass on the version of its mini-batch, no prediction. Then
    the method's own version table, as a run starting afresh at version K has it."""
    n, k_sync, count = 4, 3, 9
    result = run(method, stages=n, count=count, sync_warmup=k_sync)
    plain = run(method, stages=n, count=count - k_sync)
    m = get_method(method).microbatches(n, None)
    shift = k_sync * m
    versions = {(e.stage, e.microbatch, e.kind): (e.version, e.steps) for e in result.version_trace}
    assert len(versions) == 2 * n * count * m
    for stage in range(n):
        for micro in range(shift):
            forward, f_steps = versions[(stage, micro, "F")]
            backward, b_steps = versions[(stage, micro, "B")]
            assert forward == backward == micro // m and f_steps == b_steps == 0, (stage, micro)
    for e in plain.version_trace:
        version, steps = versions[(e.stage, e.microbatch + shift, e.kind)]
        assert version == e.version + k_sync, e
        if method == "pipeoptim" and e.kind == "F":  # exact steps: the updates before the backward
            assert steps == versions[(e.stage, e.microbatch + shift, "B")][0] - version
    assert any(versions[(0, t, "F")][1] > 0 for t in range(shift, count * m)) or method in ("async-naive", "pipedream")


def test_a_synchronous_warmup_happens_once_per_run_not_per_epoch():
    result = pipeoptim.train(mlp(), batches(5), method="pipeoptim", stages=3, optimizer=sgdm, loss_fn=LOSS,
                             epochs=2, sync_warmup=2)
    stale = {e.microbatch for e in result.version_trace if e.kind == "F" and e.stage == 0 and e.steps > 0}
    assert not stale & {0, 1} and {6, 7} <= stale  # the second epoch's first mini-batches are stale


def test_the_warmup_schedule_is_valid_and_streams():
    meth = get_method("pipeoptim")
    whole = meth.build_schedule(4, 1, 9, options={"sync_warmup": 3})
    assert whole.options["synchronous_updates"] == 3 and whole.num_updates == 9
    simulate(whole)  # dependencies and deadlock freedom
    for short in range(1, 9):  # the streaming property: a prefix up to the first forward beyond T
        part = meth.build_schedule(4, 1, short, options={"sync_warmup": 3})
        for k, order in enumerate(part.orders):
            cut = next((i for i, a in enumerate(whole.orders[k]) if a.kind.value == "F" and a.index >= short),
                       len(whole.orders[k]))
            assert whole.orders[k][:cut] == order[:cut]
    later = meth.build_schedule(4, 1, 5, first_batch=3, options={"sync_warmup": 3})
    assert "synchronous_updates" not in later.options and later.name == "async-1f1b"


def test_streaming_with_a_synchronous_warmup_equals_the_whole_run():
    data = batches(8)
    whole = run(count=8, sync_warmup=3, lr_correction="delay", lr_correction_steps=4, delta="ema")
    pipe = pipeoptim.Pipeline(mlp(), method="pipeoptim", stages=4, loss_fn=LOSS, optimizer=sgdm,
                              sync_warmup=3, lr_correction="delay", lr_correction_steps=4, delta="ema")
    losses = []
    for x, y in data:
        losses += pipe.step(x, y)
    losses += pipe.flush()
    assert losses == whole.losses


# -- state --------------------------------------------------------------------------------------

def test_a_saved_ema_state_resumes_exactly():
    kw = dict(method="pipeoptim", stages=3, loss_fn=LOSS, optimizer=sgdm, delta="ema",
              lr_correction="delay", lr_correction_steps=6)
    data = batches(8)
    straight = pipeoptim.Pipeline(mlp(), **kw)
    for x, y in data[:4]:
        straight.step(x, y)
    straight.flush()
    state = straight.state_dict()
    for x, y in data[4:]:
        straight.step(x, y)
    straight.flush()
    resumed = pipeoptim.Pipeline(mlp(), **kw)
    resumed.load_state_dict(state)
    for x, y in data[4:]:
        resumed.step(x, y)
    resumed.flush()
    assert resumed.losses[4:] == straight.losses[4:]
    # into another split, every stage finds its parameters' averages by name
    saved = {name: t for stage in state["stages"] for name, t in stage["policy"].get("ema", {"average": {}})["average"].items()}
    other = pipeoptim.Pipeline(mlp(), **{**kw, "stages": None, "partition": [2, 3, 3]})
    other.load_state_dict(state)
    for stage in other.stages[:2]:
        assert set(stage.policy.average.average) == {name for name, _ in stage.policy.named}
        for name, value in stage.policy.average.average.items():
            assert torch.equal(value, saved[name])


# -- the diagnostic -----------------------------------------------------------------------------

def test_the_diagnostic_reports_what_each_correction_changed():
    result = run(count=12, delta="ema", horizon="scheduled", lr_scheduler=warmup_lambda, diagnose_every=1)
    first = result.metrics["prediction_error"][0]
    assert set(first["variants"]) == {"no correction", "without horizon", "without delta"}
    assert first["variants"]["no correction"] != first["prediction_error"]
    single = run(count=12, delta="ema", diagnose_every=1).metrics["prediction_error"][0]
    assert set(single["variants"]) == {"no correction"}
    plain = run(count=12, diagnose_every=1).metrics["prediction_error"][0]
    assert "variants" not in plain
    # "no correction" is the plain method's prediction on the same weights: its ratio to the
    # staleness error lies where the plain run's does
    assert single["variants"]["no correction"] / single["staleness_error"] == pytest.approx(
        plain["prediction_error"] / plain["staleness_error"], rel=0.5)


# -- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("options, message", [
    ({"lr_correction": "pipemare"}, "lr_correction must be one of none, delay"),
    ({"lr_correction": "delay"}, "needs lr_correction_steps"),
    ({"lr_correction": "delay", "lr_correction_steps": 0}, "lr_correction_steps must be"),
    ({"lr_correction_steps": 5}, "applies with lr_correction='delay'"),
    ({"horizon": "future"}, "horizon must be one of constant, scheduled"),
    ({"delta": "ema", "ema_decay": 1.0}, "strictly between 0 and 1"),
    ({"delta": "ema", "ema_decay": 0}, "strictly between 0 and 1"),
    ({"ema_decay": 0.5}, "applies with delta='ema'"),
    ({"prediction_warmup": -1}, "prediction_warmup must be 0"),
    ({"sync_warmup": 2.5}, "sync_warmup must be 0"),
])
def test_bad_correction_options_name_the_fix(options, message):
    with pytest.raises(ValueError, match=message):
        pipeoptim.Pipeline(mlp(), method="pipeoptim", stages=2, loss_fn=LOSS, optimizer=sgdm, **options)


@pytest.mark.parametrize("method, option", [("gpipe", {"sync_warmup": 2}), ("async-naive", {"delta": "ema"}),
                                            ("pipedream", {"horizon": "scheduled"}),
                                            ("pipedream-2bw", {"lr_correction": "delay"})])
def test_an_option_on_a_method_it_does_not_apply_to_is_refused(method, option):
    with pytest.raises(ValueError, match="takes no option"):
        pipeoptim.Pipeline(mlp(), method=method, stages=2, loss_fn=LOSS, optimizer=sgdm, **option)


def test_delay_divisor_is_one_without_delay_and_anneals_to_one():
    assert delay_divisor(0, 0, 10) == 1.0
    assert delay_divisor(3, 0, 10) == 3.0
    assert delay_divisor(3, 5, 10) == math.sqrt(3)
    assert delay_divisor(3, 10, 10) == delay_divisor(3, 50, 10) == 1.0
