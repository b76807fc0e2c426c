"""Tests for pipeoptim.weights.predict (optimizer-aware weight prediction)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from pipeoptim.delay_nadamw import DelayNAdamW
from pipeoptim.muon_adamw import MuonWithAdamW
from pipeoptim.weights.predict import Predictor, optimizer_direction_supported

O = torch.optim
LRS = (0.1, 0.03)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(3, 4, generator=gen, dtype=torch.float64)),
        torch.nn.Parameter(torch.randn(5, generator=gen, dtype=torch.float64)),
    ]


def _groups(params: list[torch.nn.Parameter]) -> list[dict]:
    """Two param groups with different learning rates."""
    return [{"params": [params[0]], "lr": LRS[0]}, {"params": [params[1]], "lr": LRS[1]}]


def _set_grads(params, gen: torch.Generator) -> None:
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)


# (id, optimizer factory taking param groups, number of steps)
CASES = [
    ("sgd", lambda g: O.SGD(g), 4),
    ("sgd-momentum", lambda g: O.SGD(g, momentum=0.9), 4),
    ("sgd-nesterov", lambda g: O.SGD(g, momentum=0.9, nesterov=True), 4),
    ("sgd-dampening", lambda g: O.SGD(g, momentum=0.9, dampening=0.3), 4),
    ("sgd-wd", lambda g: O.SGD(g, weight_decay=0.1), 4),
    ("sgd-momentum-wd", lambda g: O.SGD(g, momentum=0.8, weight_decay=0.1), 4),
    ("sgd-nesterov-wd-max",
     lambda g: O.SGD(g, momentum=0.9, nesterov=True, weight_decay=0.05, maximize=True), 4),
    ("sgd-maximize", lambda g: O.SGD(g, maximize=True), 4),
    ("sgd-foreach", lambda g: O.SGD(g, momentum=0.9, weight_decay=0.1, foreach=True), 4),
    ("sgd-fused", lambda g: O.SGD(g, momentum=0.9, nesterov=True, fused=True), 4),
    ("adam", lambda g: O.Adam(g), 4),
    ("adam-amsgrad", lambda g: O.Adam(g, amsgrad=True, eps=1e-3), 6),
    ("adam-maximize", lambda g: O.Adam(g, maximize=True), 4),
    ("adam-wd", lambda g: O.Adam(g, weight_decay=0.1), 4),
    ("adam-foreach", lambda g: O.Adam(g, weight_decay=0.1, amsgrad=True, foreach=True), 4),
    ("adam-fused", lambda g: O.Adam(g, fused=True), 4),
    ("adam-tensor-lr", lambda g: O.Adam([dict(x, lr=torch.tensor(x["lr"])) for x in g]), 4),
    ("adamw", lambda g: O.AdamW(g, weight_decay=0.5), 4),
    ("adamw-amsgrad", lambda g: O.AdamW(g, weight_decay=0.5, amsgrad=True), 6),
    ("adamw-foreach", lambda g: O.AdamW(g, weight_decay=0.5, foreach=True), 4),
    ("adamw-fused", lambda g: O.AdamW(g, weight_decay=0.5, fused=True), 4),
    ("adamax", lambda g: O.Adamax(g), 4),
    ("adamax-wd-max", lambda g: O.Adamax(g, weight_decay=0.1, maximize=True), 4),
    ("adamax-foreach", lambda g: O.Adamax(g, foreach=True), 4),
    ("nadam", lambda g: O.NAdam(g), 4),
    ("nadam-wd", lambda g: O.NAdam(g, weight_decay=0.1), 4),
    ("nadam-decoupled", lambda g: O.NAdam(g, weight_decay=0.5, decoupled_weight_decay=True), 4),
    ("nadam-foreach", lambda g: O.NAdam(g, weight_decay=0.1, foreach=True), 4),
    ("nadam-beta1", lambda g: O.NAdam(g, betas=(0.99, 0.999)), 4),
    ("nadam-beta1-decoupled", lambda g: O.NAdam(g, betas=(0.99, 0.999), weight_decay=0.5,
                                                decoupled_weight_decay=True), 4),
    # Muon on the 2-D parameter, AdamW on the 1-D one: one optimizer (--optimizer muon)
    ("muon+adamw", lambda g: MuonWithAdamW([g[0]], [g[1]]), 4),
    ("muon-plain-nodecay", lambda g: MuonWithAdamW([g[0]], [g[1]], nesterov=False, weight_decay=0.0), 4),
    ("muon-match-rms", lambda g: MuonWithAdamW([g[0]], [g[1]], adjust_lr_fn="match_rms_adamw",
                                               weight_decay=0.3, momentum=0.8), 4),
    ("radam", lambda g: O.RAdam(g), 9),
    ("radam-wd", lambda g: O.RAdam(g, weight_decay=0.1), 9),
    ("radam-decoupled", lambda g: O.RAdam(g, weight_decay=0.5, decoupled_weight_decay=True), 9),
    ("radam-foreach", lambda g: O.RAdam(g, foreach=True), 9),
    ("rmsprop", lambda g: O.RMSprop(g), 4),
    ("rmsprop-momentum", lambda g: O.RMSprop(g, momentum=0.9), 4),
    ("rmsprop-centered", lambda g: O.RMSprop(g, centered=True, momentum=0.5), 4),
    ("rmsprop-centered-plain", lambda g: O.RMSprop(g, centered=True), 4),
    ("rmsprop-wd-max", lambda g: O.RMSprop(g, weight_decay=0.1, maximize=True), 4),
    ("rmsprop-foreach", lambda g: O.RMSprop(g, centered=True, foreach=True), 4),
    ("adagrad", lambda g: O.Adagrad(g), 4),
    ("adagrad-decay-wd", lambda g: O.Adagrad(g, lr_decay=0.3, weight_decay=0.1), 4),
    ("adagrad-foreach", lambda g: O.Adagrad(g, lr_decay=0.3, foreach=True), 4),
    ("adagrad-fused", lambda g: O.Adagrad(g, lr_decay=0.3, weight_decay=0.1, fused=True), 4),
    ("adadelta", lambda g: O.Adadelta(g), 4),
    ("adadelta-wd", lambda g: O.Adadelta(g, weight_decay=0.1, rho=0.5), 4),
    ("adadelta-foreach", lambda g: O.Adadelta(g, weight_decay=0.1, foreach=True), 4),
    # pipeoptim's own: the delay-aware Nesterov step (tests/test_delay_nadamw.py has its rule)
    ("delay-nadamw", lambda g: DelayNAdamW(g), 4),
    ("delay-nadamw-wd-delay", lambda g: DelayNAdamW(g, weight_decay=0.5, delay=2), 4),
    ("delay-nadamw-max", lambda g: DelayNAdamW(g, maximize=True, delay=1), 4),
]


def _check_property(opt: torch.optim.Optimizer, pred: Predictor, params, n_steps: int) -> None:
    """After every real step, direction(p) == (W_before - W_after) / lr of that step."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(n_steps):
        _set_grads(params, gen)
        before = [p.detach().clone() for p in params]
        opt.step()
        opt.zero_grad(set_to_none=True)  # the predictor must not rely on p.grad afterwards
        for p, w0, lr in zip(params, before, LRS):
            applied = (w0 - p.detach()) / lr
            assert applied.abs().max() > 1e-3  # the step moved the weights
            delta = pred.direction(p)
            assert delta is not None
            torch.testing.assert_close(delta, applied, rtol=1e-5, atol=1e-10)


@pytest.mark.parametrize("factory,n_steps", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_direction_equals_applied_step(factory, n_steps):
    params = _params()
    opt = factory(_groups(params))
    assert optimizer_direction_supported(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning for known optimizers
        pred = Predictor(opt)
    assert not pred.uses_fallback
    assert pred.direction(params[0]) is None
    _check_property(opt, pred, params, n_steps)
    assert pred.steps_taken == n_steps


def test_muon_alone_and_a_tall_matrix():
    """torch's Muon on its own (no composite), on a tall matrix (the ratio sqrt(A/B) > 1) and a
    wide one, with decay: Delta = r * NS(nesterov update) + wd * W_before, exactly the step."""
    gen = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(8, 3, generator=gen, dtype=torch.float64)),
              torch.nn.Parameter(torch.randn(3, 5, generator=gen, dtype=torch.float64))]
    opt = O.Muon(_groups(params), weight_decay=0.2)
    assert optimizer_direction_supported(opt)
    pred = Predictor(opt)
    assert not pred.uses_fallback
    _check_property(opt, pred, params, 4)


def test_delay_nadamw_has_an_exact_formula_that_follows_the_pipeline_delay():
    """DelayNAdamW needs no fallback; a delay the pipeline sets between steps is the next
    step's, and Delta follows it."""
    params = _params()
    opt = DelayNAdamW(_groups(params), weight_decay=0.2)
    assert optimizer_direction_supported(opt)
    assert optimizer_direction_supported(DelayNAdamW(_params(), delay=4))
    pred = Predictor(opt)
    assert not pred.uses_fallback
    _check_property(opt, pred, params, 2)
    opt.set_pipeline_delay(5)
    assert [g["delay"] for g in opt.param_groups] == [5, 5]
    _check_property(opt, pred, params, 2)


def test_nadam_beta1_is_read_from_the_group():
    """beta1 0.99 and 0.9 give different directions, each the step's own."""
    deltas = []
    for beta1 in (0.99, 0.9):
        params = _params()
        opt = O.NAdam(_groups(params), betas=(beta1, 0.999))
        pred = Predictor(opt)
        _check_property(opt, pred, params, 3)
        deltas.append(pred.direction(params[0]))
    assert (deltas[0] - deltas[1]).abs().max() > 1e-2


def test_radam_cases_cover_both_branches():
    # rho_t > 5 first happens at step 6 with beta2 = 0.999; the RAdam cases run 9 steps.
    b2 = 0.999
    rho_inf = 2 / (1 - b2) - 1
    rho = [rho_inf - 2 * t * b2**t / (1 - b2**t) for t in range(1, 10)]
    assert [r > 5 for r in rho] == [False] * 5 + [True] * 4


class SignSGD(torch.optim.Optimizer):
    """A user optimizer without an exact formula: W <- W - lr * sign(g)."""

    def __init__(self, params, lr: float = 0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


class OverridingSGD(torch.optim.SGD):
    """Subclass of a known optimizer whose step differs: must use the fallback."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-2 * group["lr"])


class PlainSubclassSGD(torch.optim.SGD):
    """Subclass that does not override step: the exact SGD formula applies."""


def _fallback_warnings(record) -> list:
    return [w for w in record if "last applied update" in str(w.message)]


@pytest.mark.parametrize(
    "factory",
    [lambda g: SignSGD(g), lambda g: OverridingSGD(g, momentum=0.9), lambda g: O.Rprop(g)],
    ids=["sign-sgd", "sgd-subclass-overriding-step", "rprop"],
)
def test_fallback_matches_applied_step_and_warns_once(factory):
    params = _params()
    opt = factory(_groups(params))
    assert not optimizer_direction_supported(opt)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pred = Predictor(opt)
        assert pred.uses_fallback
        assert pred.direction(params[0]) is None
        _check_property(opt, pred, params, 3)
        pred.predict(2.0)
        pred.predict_into(params[1], 1.0, torch.empty_like(params[1]))
    assert len(_fallback_warnings(record)) == 1


def test_exact_formula_chosen_by_step_function_not_isinstance():
    p = _params()
    assert optimizer_direction_supported(PlainSubclassSGD(p, lr=0.1))
    assert not optimizer_direction_supported(OverridingSGD(p, lr=0.1))
    assert optimizer_direction_supported(O.AdamW(p))
    assert not optimizer_direction_supported(O.LBFGS(p))
    assert not optimizer_direction_supported(O.ASGD(p))


def test_sgd_constant_gradient_predicts_future_steps():
    params = _params()
    opt = O.SGD(_groups(params))
    pred = Predictor(opt)
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]

    def step():
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        opt.zero_grad()

    step()
    predicted = {s: pred.predict(s) for s in (1, 2, 3)}
    for s in (1, 2, 3):
        step()
        for p in params:
            torch.testing.assert_close(predicted[s][p], p.detach(), rtol=0, atol=1e-12)


def test_adam_one_step_prediction_equals_step_just_taken():
    params = _params()
    opt = O.Adam(_groups(params))
    pred = Predictor(opt)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        _set_grads(params, gen)
        before = [p.detach().clone() for p in params]
        opt.step()
    out = pred.predict(1)
    for p, w0 in zip(params, before):
        torch.testing.assert_close(out[p] - p.detach(), p.detach() - w0, rtol=1e-7, atol=1e-12)
        buf = torch.empty_like(p)
        assert pred.predict_into(p, 1, buf)
        torch.testing.assert_close(buf, out[p], rtol=0, atol=1e-14)


def _two_sgd_steps(sgd_momentum: str, **kw) -> tuple[list[torch.Tensor], torch.Tensor]:
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    opt = O.SGD([p], lr=0.1, momentum=0.9, **kw)
    pred = Predictor(opt, sgd_momentum=sgd_momentum)
    deltas = []
    for g in ([1.0, 2.0], [0.5, -1.0]):
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        p.grad = None
        deltas.append(pred.direction(p))
    return deltas, p.detach()


def test_sgd_code_variant_hand_values():
    # mu = 0.9, dampening = 0: step 1: m1 = g1 = [1, 2];  Delta = 0.9*m1 + g1 = [1.9, 3.8]
    # step 2: m2 = 0.9*[1, 2] + [0.5, -1] = [1.4, 0.8]; Delta = 0.9*m2 + g2 = [1.76, -0.28]
    deltas, _ = _two_sgd_steps("code")
    torch.testing.assert_close(deltas[0], torch.tensor([1.9, 3.8], dtype=torch.float64))
    torch.testing.assert_close(deltas[1], torch.tensor([1.76, -0.28], dtype=torch.float64))
    # The paper variant is the buffer itself: [1, 2] then [1.4, 0.8].
    deltas, _ = _two_sgd_steps("paper")
    torch.testing.assert_close(deltas[0], torch.tensor([1.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(deltas[1], torch.tensor([1.4, 0.8], dtype=torch.float64))


def test_sgd_code_variant_hand_values_with_decay_and_dampening():
    # lr 0.1, mu 0.9, dampening 0.5, wd 0.1, W0 = [1, -2]
    # step 1: g = [1, 2] + 0.1*W0 = [1.1, 1.8]; m1 = g (first buffer, no dampening)
    #         W1 = W0 - 0.1*m1 = [0.89, -2.18]; Delta = 0.9*m1 + 0.5*g = [1.54, 2.52]
    # step 2: g = [0.5, -1] + 0.1*W1 = [0.589, -1.218]
    #         m2 = 0.9*m1 + 0.5*g = [1.2845, 1.011]; Delta = 0.9*m2 + 0.5*g = [1.45055, 0.3009]
    deltas, w = _two_sgd_steps("code", dampening=0.5, weight_decay=0.1)
    torch.testing.assert_close(deltas[0], torch.tensor([1.54, 2.52], dtype=torch.float64))
    torch.testing.assert_close(deltas[1], torch.tensor([1.45055, 0.3009], dtype=torch.float64))
    w2 = torch.tensor([0.89 - 0.12845, -2.18 - 0.1011], dtype=torch.float64)  # W1 - 0.1*m2
    torch.testing.assert_close(w, w2)


def test_invalid_sgd_momentum_variant():
    with pytest.raises(ValueError):
        Predictor(O.SGD(_params(), lr=0.1), sgd_momentum="nope")


def test_before_first_step():
    params = _params()
    opt = O.SGD(_groups(params), momentum=0.9)
    pred = Predictor(opt)
    assert not pred.has_direction and pred.steps_taken == 0
    assert all(pred.direction(p) is None for p in params)
    out = pred.predict(3)
    for p in params:
        assert torch.equal(out[p], p.detach()) and out[p].data_ptr() != p.data_ptr()
        buf = torch.full_like(p, 7.0)
        assert pred.predict_into(p, 3, buf) is False
        assert torch.equal(buf, torch.full_like(p, 7.0))


@pytest.mark.parametrize(
    "make",
    [lambda g: O.SGD(g, momentum=0.9), lambda g: O.AdamW(g, weight_decay=0.5)],
    ids=["sgd-momentum", "adamw"],
)
def test_scheduler_lr_is_read_at_prediction_time_and_live_params_untouched(make):
    params = _params()
    opt = make(_groups(params))
    sched = O.lr_scheduler.StepLR(opt, step_size=1, gamma=0.25)
    pred = Predictor(opt)
    gen = torch.Generator().manual_seed(4)
    _set_grads(params, gen)
    opt.step()
    deltas = [pred.direction(p) for p in params]
    sched.step()  # lr -> lr/4 for both groups
    assert pred.lr(params[0]) == pytest.approx(LRS[0] / 4)
    assert pred.lr(params[1]) == pytest.approx(LRS[1] / 4)
    live = [p.detach().clone() for p in params]
    out = pred.predict(2.0)
    for p, d, lr, w in zip(params, deltas, LRS, live):
        torch.testing.assert_close(pred.direction(p), d, rtol=1e-12, atol=0)  # Delta unaffected
        torch.testing.assert_close(out[p], w - (lr / 4) * 2.0 * d, rtol=1e-12, atol=1e-14)
        assert (out[p] - (w - lr * 2.0 * d)).abs().max() > 1e-3  # old lr would differ
        buf = torch.empty_like(p)
        assert pred.predict_into(p, 2.0, buf)
        torch.testing.assert_close(buf, out[p], rtol=0, atol=1e-14)
        assert torch.equal(p.detach(), w)  # neither predict nor predict_into touched W


def test_predict_into_param_itself_and_detach():
    params = _params()
    opt = O.Adam(_groups(params))
    pred = Predictor(opt)
    gen = torch.Generator().manual_seed(5)
    _set_grads(params, gen)
    opt.step()
    expected = pred.predict(1.5)[params[0]]
    assert pred.predict_into(params[0], 1.5, params[0].data)  # in place, aliasing the param
    torch.testing.assert_close(params[0].detach(), expected, rtol=0, atol=1e-14)
    pred.detach()
    _set_grads(params, gen)
    opt.step()
    assert pred.steps_taken == 1


def test_float32_adamw_direction_close():
    # Default dtype path: the decoupled-decay recovery stays accurate in float32.
    p = torch.nn.Parameter(torch.randn(64, generator=torch.Generator().manual_seed(6)))
    opt = O.AdamW([p], lr=1e-3, weight_decay=0.01)
    pred = Predictor(opt)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        p.grad = torch.randn(64, generator=gen)
        w0 = p.detach().clone().double()
        opt.step()
    applied = (w0 - p.detach().double()) / 1e-3
    err = float((pred.direction(p).double() - applied).abs().max())
    assert math.isclose(err, 0.0, abs_tol=2e-3)  # omitting the 0.01*W decay term gives ~1e-2


@pytest.mark.parametrize("name", ["adam", "adamw", "adamax", "nadam", "radam", "adagrad-decay-wd", "delay-nadamw"])
def test_the_step_counts_are_read_in_one_copy_not_one_per_parameter(name, monkeypatch):
    """Issue 62: a capturable or fused optimizer keeps each parameter's ``step`` (and NAdam's
    ``mu_product``) on the device, where a ``float()`` per parameter waits for the device once per
    parameter. The prediction reads them all in one copy (``formulas._host``): with
    ``Tensor.__float__`` and ``Tensor.item`` refused, it still gives the applied step."""
    factory, n_steps = next(c[1:] for c in CASES if c[0] == name)
    params = _params()
    opt = factory([{"params": params, "lr": LRS[0]}])  # one group: one read for its two parameters
    pred = Predictor(opt)

    def refused(self, *args):
        raise AssertionError("a per-parameter host read of a state scalar")

    gen = torch.Generator().manual_seed(1)
    for _ in range(n_steps):
        _set_grads(params, gen)
        before = [p.detach().clone() for p in params]
        opt.step()
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "__float__", refused)
            patch.setattr(torch.Tensor, "item", refused)
            deltas = [pred.direction(p) for p in params]
        for p, w0, delta in zip(params, before, deltas):
            torch.testing.assert_close(delta, (w0 - p.detach()) / LRS[0], rtol=1e-5, atol=1e-10)


def test_step_counts_on_a_device_are_copied_to_the_host_once(monkeypatch):
    """formulas._host's device branch (no GPU here: CPU tensors taken for device ones): one stack,
    one copy, the same floats as float() per tensor, python numbers as they are."""
    from pipeoptim.weights import formulas

    states = [{"step": torch.tensor(3.0)}, {"step": torch.tensor(7.0)}, {"step": 5}, {"step": torch.tensor(2.0 ** 24)}]
    stacks = []
    real = torch.stack
    monkeypatch.setattr(torch, "stack", lambda tensors, *a, **k: stacks.append(len(tensors)) or real(tensors, *a, **k))
    assert formulas._host(states, range(4), on_host=lambda t: False) == {0: 3.0, 1: 7.0, 2: 5.0, 3: 2.0 ** 24}
    assert stacks == [3]
    assert formulas._host(states, [0, 2]) == {0: 3.0, 2: 5.0} and stacks == [3]  # on the CPU: no copy
