"""The weights' arithmetic as multi-tensor operations (issue 37, item 2; src/pipeoptim/weights/
fused.py): every fused path gives the bits of a plain per-parameter loop written out here, the
one the library ran before (torch.equal, not a tolerance): the prediction's W_hat on both of its
paths and for held predictions, Delta of every optimizer with an exact formula, the hooks'
fallback, the average of updates, the stash copies and the diagnostic's distances."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pipeoptim.delay_nadamw import delay_of, lookahead_coefficients
from pipeoptim.runtime.probes import norm_of, relative_distance
from pipeoptim.schedules import build_schedule
from pipeoptim.weights import PipeOptimPolicy, StashingPolicy
from pipeoptim.weights import fused
from pipeoptim.weights import policies as policies_module
from pipeoptim.weights.corrections import UpdateAverage
from pipeoptim.weights.predict import Predictor
from test_predict import CASES
from test_predict_kernels import StorageCreations

O = torch.optim
LRS = (0.05, 0.013)


def equal_lists(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(params=["fused", "one-pass"])
def regime(request, monkeypatch):
    """Both ways ``fused.Into`` writes a result: every tensor fused (a GPU's way), or every
    tensor in one ``out=`` pass of its own (the CPU's way for large tensors)."""
    monkeypatch.setattr(fused, "ONE_PASS_NUMEL", {} if request.param == "fused" else {"cpu": 0})
    return request.param


# ---------------------------------------------------------------------------- fused.Into
def test_into_is_the_per_tensor_out_call_bit_for_bit(regime):
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (7,), (2, 5, 3), ()]
    first = [torch.rand(s, generator=gen) + 0.5 for s in shapes]
    other = [torch.randn(s, generator=gen) for s in shapes]
    cases = [("add", (other,), {"alpha": -0.037}, lambda i: torch.add(first[i], other[i], alpha=-0.037)),
             ("sqrt", (), {}, lambda i: torch.sqrt(first[i])), ("neg", (), {}, lambda i: torch.neg(first[i])),
             ("div", (other,), {}, lambda i: torch.div(first[i], other[i])),
             ("div", (0.3,), {}, lambda i: torch.div(first[i], 0.3))]
    for op, others, kwargs, reference in cases:
        outs = [torch.full_like(t, float("nan")) for t in first]
        fused.Into(outs, first, *others)(op, **kwargs)
        assert equal_lists(outs, [reference(i) for i in range(len(first))]), op


def test_on_the_cpu_large_tensors_take_one_pass_and_small_ones_are_fused():
    small, large = torch.zeros(8191), torch.zeros(8192)
    assert not fused.one_pass(small) and fused.one_pass(large)
    outs = [torch.empty(8191), torch.empty(8192), torch.empty(5)]
    into = fused.Into(outs, [small, large, torch.zeros(5)])
    assert [o is outs[1] for o, _, _ in into.single] == [True] and len(into.outs) == 2


def test_clone_all_is_clone_new_memory_same_layout():
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(4, 3, generator=gen).t(), torch.randn(5, generator=gen), torch.randn(0)]
    copies = fused.clone_all(tensors)
    for t, c in zip(tensors, copies):
        assert torch.equal(c, t) and c.stride() == t.clone().stride()
        assert t.numel() == 0 or c.data_ptr() != t.data_ptr()
    assert fused.clone_all([]) == []


# ---------------------------------------------------------------------------- W_hat
def mixed_module(seed: int = 0) -> nn.Module:
    """A stage whose parameters lie on both sides of the CPU's one-pass size (128 x 128 = 16384
    elements; the rest far below), in float32 and float64 within one group."""
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.LayerNorm(128), nn.Linear(128, 6))
    module[3].double()
    return module


def two_groups(module: nn.Module, factory) -> torch.optim.Optimizer:
    params = list(module.parameters())
    return factory([{"params": params[::2], "lr": LRS[0]}, {"params": params[1::2], "lr": LRS[1]}])


def stage_step(module, opt, policy, seed):
    """One backward on the live weights and one update (``policy``: told of it, if any)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 128, generator=g)
    out = module[3](module[2](module[1](module[0](x))).double())
    out.square().mean().backward()
    if policy is not None:
        policy.before_update()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if policy is not None:
        policy.after_update()


@pytest.mark.parametrize("swap", [True, False], ids=["swap", "write-restore"])
@pytest.mark.parametrize("backward", ["latest", "predicted"])
def test_w_hat_is_the_per_parameter_add_bit_for_bit(swap, backward, monkeypatch):
    # (fused.ONE_PASS_NUMEL as it is: the 128 x 128 weight in a pass of its own, the rest fused)
    monkeypatch.setattr(policies_module.PredictingPolicy, "_swap_storage", swap)
    module = mixed_module()
    opt = two_groups(module, lambda g: O.AdamW(g, weight_decay=0.1))
    policy = PipeOptimPolicy(module, opt, stage=0, num_stages=3, steps="paper", backward=backward)
    policy.begin_epoch(build_schedule("async-1f1b", 3, 1, 40).orders[0])
    for update in range(3):
        stage_step(module, opt, policy, seed=update)
        live = [p.detach().clone() for _, p in policy.named]
        by_param = policy.predictor._directions_by_param()
        deltas = [by_param[p].clone() for _, p in policy.named]
        expected = [torch.add(w, d, alpha=-LRS[i % 2] * 2) for i, (w, d) in enumerate(zip(live, deltas))]
        with StorageCreations() as mode:
            use = policy.forward_weights(10 + update)
        assert use.steps == 2 and policy._swap is (swap and backward == "latest")
        assert equal_lists([use.weights[n].detach() for n, _ in policy.named], expected)
        assert backward == "predicted" or update == 0 or mode.created == []
        use.done()
        with policy.backward_pass(10 + update, use):
            pass
        assert equal_lists([p.detach() for _, p in policy.named], live)


def test_predictor_predict_is_the_per_parameter_add_bit_for_bit():
    module = mixed_module()
    opt = two_groups(module, lambda g: O.SGD(g, momentum=0.9))
    pred = Predictor(opt)
    stage_step(module, opt, None, seed=3)
    out = pred.predict(1.5)
    for i, group in enumerate(opt.param_groups):
        for p in group["params"]:
            assert torch.equal(out[p], torch.add(p.detach(), opt.state[p]["momentum_buffer"], alpha=-LRS[i] * 1.5))


# ---------------------------------------------------------------------------- Delta
class ReferenceDelta:
    """Delta per parameter, as the library computed it one parameter at a time before the
    multi-tensor formulas (the Predictor's own dispatch: which formula, whether it needs the
    gradient), kept by step hooks of its own on the same optimizer."""

    def __init__(self, opt: torch.optim.Optimizer, pred: Predictor) -> None:
        self.opt, self.pred, self.kept, self.lrs = opt, pred, {}, {}
        opt.register_step_pre_hook(self.before)
        opt.register_step_post_hook(self.after)

    @torch.no_grad()
    def before(self, opt, args, kwargs) -> None:
        self.pending = []
        for group in opt.param_groups:
            self.lrs[id(group)] = float(group["lr"])
            if self.pred._needs_grad(group):
                for p in group["params"]:
                    if p.grad is not None:
                        self.kept[p] = self.capture(group, p)
                        self.pending.append((group, p))

    def capture(self, group, p):
        buf = torch.neg(p.grad) if group.get("maximize", False) else p.grad.clone()
        wd = self.pred._l2(group)
        if wd != 0.0:
            buf.add_(p.detach(), alpha=wd)
        if self.pred._kind_of(group) == "adadelta":
            acc = self.opt.state.get(p, {}).get("acc_delta")
            buf.mul_(math.sqrt(group["eps"]) if acc is None else acc.add(group["eps"]).sqrt_())
        return buf

    @torch.no_grad()
    def after(self, opt, args, kwargs) -> None:
        from pipeoptim.weights.formulas import muon_direction
        for group, p in self.pending:
            g, state, kind = self.kept[p], opt.state[p], self.pred._kind_of(group)
            if kind == "sgd" and group["momentum"]:
                if group["nesterov"]:
                    g.add_(state["momentum_buffer"], alpha=group["momentum"])
                else:
                    g.mul_(1 - group["dampening"]).add_(state["momentum_buffer"], alpha=group["momentum"])
            elif kind == "nadam":
                b1, b2 = group["betas"]
                step, decay, prod = float(state["step"]), group["momentum_decay"], float(state["mu_product"])
                mu = b1 * (1.0 - 0.5 * 0.96 ** (step * decay))
                mu_next = b1 * (1.0 - 0.5 * 0.96 ** ((step + 1) * decay))
                denom = state["exp_avg_sq"].div(1 - b2**step).sqrt_().add_(group["eps"])
                g.mul_((1 - mu) / (1 - prod))
                g.add_(state["exp_avg"], alpha=mu_next / (1 - prod * mu_next)).div_(denom)
                self.decoupled(group, p, g)
            elif kind == "delay-nadamw":
                b1, b2 = group["betas"]
                step = float(state["step"])
                a, b = lookahead_coefficients(b1, step, delay_of(group))
                denom = state["exp_avg_sq"].div(1 - b2**step).sqrt_().add_(group["eps"])
                g.mul_(b).add_(state["exp_avg"], alpha=a).div_(denom)
                self.decoupled(group, p, g)
            elif kind == "rmsprop":
                sq = state["square_avg"]
                avg = (torch.addcmul(sq, state["grad_avg"], state["grad_avg"], value=-1).sqrt_()
                       if group["centered"] else sq.sqrt())
                g.div_(avg.add_(group["eps"]))
            elif kind == "adagrad":
                g.div_(state["sum"].sqrt().add_(group["eps"]))
                g.div_(1 + (float(state["step"]) - 1) * group["lr_decay"])
            elif kind == "adadelta":
                g.div_(state["square_avg"].add(group["eps"]).sqrt_())
            elif kind == "muon":
                muon_direction(group, p, state["momentum_buffer"], g)
                self.decoupled(group, p, g)

    def decoupled(self, group, p, delta):
        wd = float(group.get("weight_decay", 0.0))
        if wd and (group.get("decoupled_weight_decay", False) or self.pred._kind_of(group) in ("muon", "delay-nadamw")):
            delta.add_(p.detach(), alpha=wd).div_(1 - self.lrs[id(group)] * wd)

    def delta(self, group, p):
        state, kind = self.opt.state.get(p), self.pred._kind_of(group)
        if self.pred._needs_grad(group):
            return self.kept.get(p)
        if not state:
            return None
        if kind in ("sgd", "rmsprop"):
            return state["momentum_buffer"]
        step = float(state["step"])
        b1, b2 = group["betas"]
        bc1 = 1 - b1**step
        out = torch.empty_like(p)
        if kind == "adam":
            v = state["max_exp_avg_sq"] if group["amsgrad"] else state["exp_avg_sq"]
            torch.sqrt(v, out=out).div_(math.sqrt(1 - b2**step)).add_(group["eps"])
            torch.div(state["exp_avg"], out, out=out).div_(bc1)
        elif kind == "adamax":
            torch.div(state["exp_avg"], state["exp_inf"], out=out).div_(bc1)
        elif kind == "radam":
            bc2 = 1 - b2**step
            rho_inf = 2 / (1 - b2) - 1
            rho_t = rho_inf - 2 * step * b2**step / bc2
            if rho_t > 5.0:
                rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
                torch.sqrt(state["exp_avg_sq"], out=out).add_(group["eps"])
                torch.div(state["exp_avg"], out, out=out).mul_(rect * math.sqrt(bc2) / bc1)
            else:
                torch.div(state["exp_avg"], bc1, out=out)
        self.decoupled(group, p, out)
        return out


def several_per_group(seed: int = 0) -> list[nn.Parameter]:
    """Three parameters per group (two groups), of other shapes and sizes; the last one gets no
    gradient at the first step, so its step count lags the others' (its own scalars)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3, 4), (5,), (4, 6), (2, 3), (7,), (5, 2)]
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


@pytest.mark.parametrize("name,factory,n_steps", CASES, ids=[c[0] for c in CASES])
def test_every_delta_formula_is_the_per_parameter_one_bit_for_bit(name, factory, n_steps, regime):
    params = several_per_group()
    # Muon's cases put their first group under Muon: the matrices there
    first = [0, 2, 5] if name.startswith("muon") else [0, 1, 2]
    groups = [{"params": [params[i] for i in first], "lr": LRS[0]},
              {"params": [p for i, p in enumerate(params) if i not in first], "lr": LRS[1]}]
    opt = factory(groups)
    pred = Predictor(opt)
    reference = ReferenceDelta(opt, pred)
    gen = torch.Generator().manual_seed(1)
    lag = "fused" not in name  # (torch's fused SGD fails on a buffer that starts late)
    for step in range(n_steps):
        for i, p in enumerate(params):
            p.grad = None if (lag and step == 0 and i == 5) else torch.randn(p.shape, generator=gen)
        opt.step()
        opt.zero_grad(set_to_none=True)
        by_param = pred._directions_by_param()
        for group in opt.param_groups:
            for p in group["params"]:
                expected = reference.delta(group, p)
                assert (expected is None) == (p not in by_param)
                assert expected is None or torch.equal(by_param[p], expected), (step, p.shape)
    if lag and "step" in opt.state[params[5]]:  # the lagging one took a step count of its own
        assert float(opt.state[params[5]]["step"]) == n_steps - 1 == float(opt.state[params[4]]["step"]) - 1


def test_the_fallback_is_the_applied_update_per_parameter_bit_for_bit():
    params = several_per_group()
    opt = O.Rprop([{"params": params[:3], "lr": LRS[0]}, {"params": params[3:], "lr": 0.0}])
    with pytest.warns(RuntimeWarning):
        pred = Predictor(opt)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        before = [p.detach().clone() for p in params]
        opt.step()
        by_param = pred._directions_by_param()
        for i, (p, w) in enumerate(zip(params, before)):
            applied = w.sub_(p.detach())
            assert torch.equal(by_param[p], applied.div_(LRS[0]) if i < 3 else applied)


# ---------------------------------------------------------------------------- the average
def test_the_average_of_updates_is_the_per_parameter_one_bit_for_bit(regime):
    params = several_per_group()
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    opt = O.SGD([{"params": params[:3], "lr": LRS[0]}, {"params": params[3:], "lr": LRS[1]}], momentum=0.9)
    average = UpdateAverage(opt, named, 0.8)
    expected: dict = {}
    gen = torch.Generator().manual_seed(3)
    lrs_of = [LRS, LRS, (0.0, LRS[1]), LRS]  # the third update: group 0 at lr 0, skipped
    for lrs in lrs_of:
        for group, lr in zip(opt.param_groups, lrs):
            group["lr"] = lr
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        before = [p.detach().clone() for p in params]
        opt.step()
        for i, (name, p) in enumerate(named):
            lr = lrs[0 if i < 3 else 1]
            if lr == 0.0:
                continue
            d = before[i].clone().sub_(p.detach()).div_(lr)
            expected[name] = d.clone() if name not in expected else expected[name].mul_(0.8).add_(d, alpha=0.2)
        average.observe(before, lrs)
        assert set(average.average) == set(expected)
        assert all(torch.equal(average.average[n], expected[n]) for n in expected)


# ---------------------------------------------------------------------------- stash, diagnostic
def test_a_stash_keeps_the_old_storage_and_moves_the_parameters_to_an_equal_copy():
    module = mixed_module()
    opt = two_groups(module, lambda g: O.SGD(g, lr=0.1))
    policy = StashingPolicy(module, opt, stage=0, num_stages=3)
    policy.begin_epoch(build_schedule("async-1f1b", 3, 1, 8).orders[0])
    use = policy.forward_weights(0)
    homes = [p.data_ptr() for _, p in policy.named]
    values = [p.detach().clone() for _, p in policy.named]
    policy.before_update()
    kept = policy.kept[0]
    assert [t.data_ptr() for t in kept] == homes and equal_lists(kept, values)
    assert equal_lists([p.detach() for _, p in policy.named], values)
    assert all(p.data_ptr() != home for (_, p), home in zip(policy.named, homes))
    assert all(use.weights[n].data_ptr() == home for (n, _), home in zip(policy.named, homes))


def test_the_diagnostic_distance_is_the_per_parameter_norm_bit_for_bit():
    gen = torch.Generator().manual_seed(4)
    live = [torch.randn(s, generator=gen) for s in [(16, 8), (8,), (3, 3)]] + [torch.randn(5, dtype=torch.float64)]
    near = [w + 1e-3 * torch.randn(w.shape, generator=gen, dtype=w.dtype) for w in live]
    per_parameter = lambda ts: torch.linalg.vector_norm(torch.stack(  # noqa: E731
        [torch.linalg.vector_norm(t, dtype=torch.float64) for t in ts]))
    norm = norm_of(live)
    assert torch.equal(norm, per_parameter(live))
    expected = float(per_parameter([x - w for x, w in zip(near, live)]) / norm)
    assert relative_distance([x.clone() for x in near], live, norm) == expected
    # the formula before (differences and sums in float64): the same to far below what it reports
    old = math.sqrt(sum(float(((x.double() - w.double()) ** 2).sum()) for x, w in zip(near, live)))
    old /= math.sqrt(sum(float((w.double() ** 2).sum()) for w in live))
    assert expected == pytest.approx(old, rel=1e-9)
    assert relative_distance([w.clone() for w in live], live, norm) == 0.0
