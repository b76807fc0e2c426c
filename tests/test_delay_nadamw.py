"""DelayNAdamW (src/pipeoptim/delay_nadamw.py): its step is the rule of its docstring, written here
by hand in float64; with no delay it is Dozat's constant-momentum NAdam (torch's NAdam when its
momentum schedule is pushed to beta1); the pipeline's delay overrides only the groups the user left
at None; bad settings are refused by name; its state round-trips; ``--optimizer delay-nadamw``
builds it; and the Predictor's Delta is its applied step, per parameter to the bit."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from pipeoptim.delay_nadamw import DelayNAdamW, lookahead_coefficients
from pipeoptim.lab.optimizers import make_optimizer, optimizer_names
from pipeoptim.weights import fused
from pipeoptim.weights.predict import Predictor, optimizer_direction_supported

#: (lr, weight decay) of the two parameter groups
GROUPS = ((0.05, 0.1), (0.02, 0.3))
STEPS = 6


def make_params(seed: int = 0) -> list[nn.Parameter]:
    """Two parameters for the first group, two for the second, float64."""
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in [(3, 4), (5,), (2, 3), (4,)]]


def grouped(params: list[nn.Parameter], **extra) -> list[dict]:
    return [{"params": params[:2], "lr": GROUPS[0][0], "weight_decay": GROUPS[0][1], **extra},
            {"params": params[2:], "lr": GROUPS[1][0], "weight_decay": GROUPS[1][1], **extra}]


def gradients(params: list[nn.Parameter], steps: int, seed: int = 1) -> list[list[torch.Tensor | None]]:
    """Seeded gradients per step; the last parameter has none at the first step (its step count
    then lags its group's other one)."""
    gen = torch.Generator().manual_seed(seed)
    return [[None if (t == 0 and i == len(params) - 1) else torch.randn(p.shape, generator=gen, dtype=p.dtype)
             for i, p in enumerate(params)] for t in range(steps)]


def run(opt: torch.optim.Optimizer, params: list[nn.Parameter], grads: list[list[torch.Tensor | None]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = None if g is None else g.clone()
        opt.step()


def by_hand(params: list[nn.Parameter], grads, b1: float, b2: float, eps: float, tau: int) -> list[torch.Tensor]:
    """The update rule of the module docstring, one parameter at a time."""
    weights = [p.detach().clone() for p in params]
    m = [torch.zeros_like(w) for w in weights]
    v = [torch.zeros_like(w) for w in weights]
    t = [0] * len(weights)
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            if g is None:
                continue
            lr, wd = GROUPS[0 if i < 2 else 1]
            t[i] += 1
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            k = tau + 1
            a = b1**k / (1 - b1 ** (t[i] + k))
            b = (1 - b1**k) / (1 - b1 ** t[i])
            d = (a * m[i] + b * g) / (torch.sqrt(v[i] / (1 - b2 ** t[i])) + eps)
            weights[i] = weights[i] * (1 - lr * wd) - lr * d
    return weights


def dozat_nadam(params: list[nn.Parameter], grads, mu: float, b2: float, eps: float) -> list[torch.Tensor]:
    """Dozat's NAdam with a constant momentum ``mu`` and decoupled decay, as he writes it: the
    products of the momenta so far and one step further bias-correct m and g."""
    weights = [p.detach().clone() for p in params]
    m = [torch.zeros_like(w) for w in weights]
    v = [torch.zeros_like(w) for w in weights]
    t, prod = [0] * len(weights), [1.0] * len(weights)
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            if g is None:
                continue
            lr, wd = GROUPS[0 if i < 2 else 1]
            t[i] += 1
            prod[i] *= mu
            m[i] = mu * m[i] + (1 - mu) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_bar = mu * m[i] / (1 - prod[i] * mu) + (1 - mu) * g / (1 - prod[i])
            weights[i] = weights[i] * (1 - lr * wd) - lr * m_bar / (torch.sqrt(v[i] / (1 - b2 ** t[i])) + eps)
    return weights


def assert_all_close(got, expected, atol: float = 1e-12) -> None:
    for x, y in zip(got, expected):
        torch.testing.assert_close(x.detach(), y, rtol=0, atol=atol)


# ---------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("tau", [0, 3])
def test_the_step_is_the_rule_written_by_hand(tau):
    params = make_params()
    grads = gradients(params, STEPS)
    expected = by_hand(params, grads, b1=0.9, b2=0.99, eps=1e-8, tau=tau)
    opt = DelayNAdamW(grouped(params), betas=(0.9, 0.99), delay=tau)
    run(opt, params, grads)
    assert_all_close(params, expected)
    assert [float(opt.state[p]["step"]) for p in params] == [STEPS, STEPS, STEPS, STEPS - 1]
    assert all(opt.state[p]["step"].dtype == torch.float32 for p in params)
    # the delay changes the step: tau = 3 is not tau = 0
    if tau:
        other = by_hand(make_params(), grads, b1=0.9, b2=0.99, eps=1e-8, tau=0)
        assert (expected[0] - other[0]).abs().max() > 1e-3


def ahead(b1: float, m: float, g: float, k: int) -> float:
    """The first moment ``k`` updates on from ``m``, were the gradient to stay ``g``."""
    for _ in range(k):
        m = b1 * m + (1 - b1) * g
    return m


def test_the_lookahead_is_the_moment_k_updates_ahead():
    """a * m is m's part of the moment k updates ahead, bias-corrected there; b * g is g's part,
    bias-corrected as the moment now (Dozat's choice at k = 1); far from the start both
    corrections are 1 and a * m + b * g is that moment itself."""
    b1, step, delay = 0.9, 2, 3
    a, b = lookahead_coefficients(b1, step, delay)
    assert a == pytest.approx(0.9**4 / (1 - 0.9**6), rel=1e-15) == pytest.approx(1.400250, rel=1e-6)
    assert b == pytest.approx(0.3439 / 0.19, rel=1e-15)
    m, g, k = 0.37, -1.3, delay + 1
    assert a * m == pytest.approx(ahead(b1, m, 0.0, k) / (1 - b1 ** (step + k)), rel=1e-14)
    assert b * g == pytest.approx(ahead(b1, 0.0, g, k) / (1 - b1**step), rel=1e-14)
    a, b = lookahead_coefficients(b1, 10_000, delay)
    assert a * m + b * g == pytest.approx(ahead(b1, m, g, k), rel=1e-14)
    assert lookahead_coefficients(b1, 5, 0) == (b1 / (1 - b1**6), (1 - b1) / (1 - b1**5))  # Dozat's
    assert lookahead_coefficients(0.0, 1, 0) == (0.0, 1.0)  # no momentum: d = g / denominator
    with pytest.raises(ValueError, match="step"):
        lookahead_coefficients(0.9, 0, 0)


def test_without_delay_it_is_dozats_nadam_with_a_constant_momentum():
    params = make_params()
    grads = gradients(params, STEPS)
    expected = dozat_nadam(params, grads, mu=0.95, b2=0.999, eps=1e-8)
    opt = DelayNAdamW(grouped(params), betas=(0.95, 0.999))  # delay None: 0
    run(opt, params, grads)
    assert_all_close(params, expected)


@pytest.fixture
def float64_default():
    """float64 as torch's default dtype (NAdam then keeps its product of momenta in float64)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def test_torchs_nadam_is_it_only_with_its_momentum_schedule_pushed_to_beta1(float64_default):
    """torch's mu_t = b1 * (1 - 0.5 * 0.96**(t * psi)) is b1 once 0.96**(t * psi) underflows (psi
    = 1e4); with its default psi = 0.004 the momentum is about b1 / 2 and the steps differ."""
    grads = gradients(make_params(), STEPS)
    ours = make_params()
    run(DelayNAdamW(grouped(ours), betas=(0.95, 0.999)), ours, grads)
    for decay, close in ((1e4, True), (0.004, False)):
        theirs = make_params()
        run(torch.optim.NAdam(grouped(theirs), betas=(0.95, 0.999), momentum_decay=decay,
                              decoupled_weight_decay=True), theirs, grads)
        gap = max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(ours, theirs))
        assert gap < 1e-12 if close else gap > 1e-2, (decay, gap)
    assert 1 - 0.5 * 0.96 ** (1 * 0.004) == pytest.approx(0.5, abs=1e-4)
    assert 1 - 0.5 * 0.96 ** (1000 * 0.004) == pytest.approx(0.575, abs=1e-3)


# ---------------------------------------------------------------------------- the delay
def test_the_pipeline_delay_overrides_only_the_groups_left_at_none():
    params = make_params()
    opt = DelayNAdamW([{"params": params[:2]}, {"params": params[2:3], "delay": 2},
                       {"params": params[3:], "delay": None}])
    assert [g["fixed_delay"] for g in opt.param_groups] == [False, True, False]
    opt.set_pipeline_delay(3)
    assert [g["delay"] for g in opt.param_groups] == [3, 2, 3]
    opt.set_pipeline_delay(0)
    assert [g["delay"] for g in opt.param_groups] == [0, 2, 0]
    fixed = DelayNAdamW([{"params": params[:2]}, {"params": params[2:], "delay": None}], delay=5)
    fixed.set_pipeline_delay(1)
    assert [g["delay"] for g in fixed.param_groups] == [5, 1]
    for bad in (-1, 1.5, None, True):
        with pytest.raises(ValueError, match="delay"):
            opt.set_pipeline_delay(bad)


def test_a_delay_set_by_the_pipeline_steps_as_one_given_at_construction():
    grads = gradients(make_params(), STEPS)
    set_later, given = make_params(), make_params()
    opt = DelayNAdamW(grouped(set_later))
    opt.set_pipeline_delay(2)
    run(opt, set_later, grads)
    run(DelayNAdamW(grouped(given), delay=2), given, grads)
    assert all(torch.equal(x, y) for x, y in zip(set_later, given))


# ---------------------------------------------------------------------------- the settings
@pytest.mark.parametrize("kwargs,name", [
    (dict(lr=0.0), "lr"), (dict(lr=-1e-3), "lr"), (dict(betas=(1.0, 0.999)), "beta1"),
    (dict(betas=(-0.1, 0.999)), "beta1"), (dict(betas=(0.9, 1.0)), "beta2"), (dict(eps=-1e-8), "eps"),
    (dict(weight_decay=-0.01), "weight_decay"), (dict(delay=-1), "delay"), (dict(delay=1.5), "delay"),
    (dict(delay=True), "delay"),
])
def test_bad_settings_raise_a_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DelayNAdamW(make_params(), **kwargs)
    # the same setting in one group's dict
    params = make_params()
    with pytest.raises(ValueError, match=name):
        DelayNAdamW([{"params": params[:2]}, {"params": params[2:], **kwargs}])


def test_the_state_round_trips_and_the_run_continues_as_without_a_break():
    grads = gradients(make_params(), STEPS)
    whole = make_params()
    opt = DelayNAdamW(grouped(whole))
    opt.set_pipeline_delay(2)
    run(opt, whole, grads)

    first = make_params()
    opt = DelayNAdamW(grouped(first))
    opt.set_pipeline_delay(2)
    run(opt, first, grads[:3])
    saved = copy.deepcopy(opt.state_dict())
    resumed = [nn.Parameter(p.detach().clone()) for p in first]
    again = DelayNAdamW(grouped(resumed))  # delay None until the state says 2
    again.load_state_dict(saved)
    assert [(g["delay"], g["fixed_delay"]) for g in again.param_groups] == [(2, False), (2, False)]
    assert again.state[resumed[0]]["step"].dtype == torch.float32
    run(again, resumed, grads[3:])
    assert all(torch.equal(x, y) for x, y in zip(resumed, whole))
    assert [float(again.state[p]["step"]) for p in resumed] == [STEPS, STEPS, STEPS, STEPS - 1]


# ---------------------------------------------------------------------------- --optimizer delay-nadamw
def test_the_command_line_name_builds_it():
    assert "delay-nadamw" in optimizer_names()
    params = make_params()
    factory = make_optimizer("delay-nadamw", lr=0.01, beta1=0.95)
    opt = pickle.loads(pickle.dumps(factory))(params)  # a distributed launch carries the factory
    assert isinstance(opt, DelayNAdamW)
    assert (opt.defaults["lr"], opt.defaults["betas"], opt.defaults["weight_decay"]) == (0.01, (0.95, 0.999), 0.01)
    assert opt.defaults["delay"] is None
    opt = make_optimizer("delay-nadamw", lr=0.01, weight_decay=0.2)(params)
    assert (opt.defaults["betas"], opt.defaults["weight_decay"]) == ((0.99, 0.999), 0.2)
    with pytest.raises(ValueError, match="momentum"):
        make_optimizer("delay-nadamw", lr=0.01, momentum=0.9)
    with pytest.raises(ValueError, match="beta1"):
        make_optimizer("delay-nadamw", lr=0.01, beta1=1.0)


# ---------------------------------------------------------------------------- the Predictor's Delta
@pytest.mark.parametrize("maximize", [False, True])
def test_delta_is_the_applied_step_for_every_delay(maximize):
    """In float64 Delta equals (W_before - W_after) / lr of each step, also after the pipeline's
    delay changes between steps."""
    params = make_params()
    opt = DelayNAdamW(grouped(params), maximize=maximize)
    assert optimizer_direction_supported(opt)
    pred = Predictor(opt)
    assert not pred.uses_fallback
    for delay, step_grads in zip([0, 0, 3, 3, 1, 7], gradients(params, STEPS)):
        opt.set_pipeline_delay(delay)
        for p, g in zip(params, step_grads):
            p.grad = g
        before = [p.detach().clone() for p in params]
        opt.step()
        for i, (p, w) in enumerate(zip(params, before)):
            if step_grads[i] is not None:
                torch.testing.assert_close(pred.direction(p), (w - p.detach()) / GROUPS[0 if i < 2 else 1][0],
                                           rtol=0, atol=1e-12)


@pytest.fixture(params=["fused", "one-pass"])
def regime(request, monkeypatch):
    """Both ways the formulas write a result (tests/test_fused_weights.py): every tensor fused, or
    every tensor in one pass of its own."""
    monkeypatch.setattr(fused, "ONE_PASS_NUMEL", {} if request.param == "fused" else {"cpu": 0})
    return request.param


def test_delta_is_the_per_parameter_formula_bit_for_bit(regime):
    """The multi-tensor formula gives the bits of d computed one parameter at a time with the
    step's operations, decoupled decay added, the lagging parameter at its own step count."""
    params = [nn.Parameter(p.detach().float()) for p in make_params()]
    opt = DelayNAdamW(grouped(params), delay=2, maximize=True)
    pred = Predictor(opt)
    for step_grads in gradients(params, 4):
        for p, g in zip(params, step_grads):
            p.grad = None if g is None else g.float()
        kept = [(i, p, torch.neg(p.grad)) for i, p in enumerate(params) if p.grad is not None]
        opt.step()
        for i, p, g in kept:
            state, (lr, wd) = opt.state[p], GROUPS[0 if i < 2 else 1]
            step = float(state["step"])
            a, b = lookahead_coefficients(0.99, step, 2)
            denom = state["exp_avg_sq"].div(1 - 0.999**step).sqrt_().add_(1e-8)
            g.mul_(b).add_(state["exp_avg"], alpha=a).div_(denom)
            g.add_(p.detach(), alpha=wd).div_(1 - lr * wd)
            assert torch.equal(pred.direction(p), g), (step, p.shape)


@pytest.mark.parametrize("method,delays", [("pipeoptim", [2, 1, 0]), ("pipedream-2bw", [1, 1, 1]),
                                           ("pipeoptim-2bw", [1, 1, 0]), ("1f1b-flush", [0, 0, 0])])
def test_a_pipeline_sets_each_stage_s_delay_before_every_step(method, delays):
    """The stage tells the optimizer the delay of each update's gradients (Stage.gradient_delay):
    here, the delays each stage's optimizer had at every step, against the method's."""
    import pipeoptim
    from torch import nn

    seen: dict = {}

    def recording(params):  # (a step hook, not a subclass: the Predictor keeps its exact formula)
        opt = DelayNAdamW(params, lr=1e-3)
        opt.register_step_pre_hook(
            lambda o, args, kwargs: seen.setdefault(id(o), []).append(o.param_groups[0]["delay"]))
        return opt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    data = [(torch.randn(6, 4), torch.randn(6, 2)) for _ in range(8)]
    pipe = pipeoptim.Pipeline(model, stages=3, method=method, optimizer=recording,
                              loss_fn=nn.functional.mse_loss)
    pipe.fit(data)
    steady = [seen[id(stage.optimizer)][-1] for stage in pipe.stages]
    assert steady == delays
    assert all(seen[id(stage.optimizer)][0] == 0 for stage in pipe.stages)  # the first update: no delay yet
    # a delay the user fixed stays
    fixed = pipeoptim.Pipeline(model, stages=3, method=method, optimizer=lambda ps: DelayNAdamW(ps, delay=5),
                               loss_fn=nn.functional.mse_loss)
    fixed.fit(data[:3])
    assert [stage.optimizer.param_groups[0]["delay"] for stage in fixed.stages] == [5, 5, 5]
