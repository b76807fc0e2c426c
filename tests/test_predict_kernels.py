"""The prediction's kernels (issue 14, item 1): the forward's weights are W - lr*s*Delta bit for
bit, nothing is allocated per forward after the first, Delta is computed once per update, and
the two ways of putting the prediction in the live storage (swapping the cache's memory with
the parameters', or writing and restoring) give the same numbers and leave W untouched."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import pipeoptim
from pipeoptim.runtime.stage import Stage
from pipeoptim.schedules import build_schedule
from pipeoptim.weights import PipeOptimPolicy, SpecTrainPolicy, XPipePolicy
from pipeoptim.muon_adamw import MuonWithAdamW
from pipeoptim.weights import policies as policies_module
from pipeoptim.weights.predict import Predictor

O = torch.optim
LRS = (0.05, 0.013)


class StorageCreations(TorchDispatchMode):
    """Records every op that returns a tensor on a storage none of its inputs has: an
    allocation, seen without torch.cuda (factories, empty_like, out-of-place results)."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0
                    and t.untyped_storage().data_ptr() not in inputs):
                self.created.append(str(func))
        return out


def test_allocation_counter_sees_allocations():
    # The counter itself must be able to fail: these allocate, in-place and out= ops do not.
    x = torch.randn(5)
    with StorageCreations() as mode:
        torch.empty_like(x)
        x + 1
        x.clone()
    assert len(mode.created) == 3
    with StorageCreations() as mode:
        x.add_(1)
        torch.mul(x, 2, out=x)
        x.detach().view(5, 1)
    assert mode.created == []


def two_groups(factory):
    def make(params):
        params = list(params)
        return factory([{"params": params[::2], "lr": LRS[0]}, {"params": params[1::2], "lr": LRS[1]}])
    return make


OPTIMIZERS = {
    "sgd-momentum": two_groups(lambda g: O.SGD(g, momentum=0.9)),
    "sgd-nesterov-wd": two_groups(lambda g: O.SGD(g, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adam": two_groups(lambda g: O.Adam(g)),
    "adam-amsgrad": two_groups(lambda g: O.Adam(g, amsgrad=True)),
    "adamw": two_groups(lambda g: O.AdamW(g, weight_decay=0.1)),
    "adamax": two_groups(lambda g: O.Adamax(g)),
    "radam-decoupled": two_groups(lambda g: O.RAdam(g, weight_decay=0.1, decoupled_weight_decay=True)),
    "nadam": two_groups(lambda g: O.NAdam(g)),
    "nadam-beta1": two_groups(lambda g: O.NAdam(g, betas=(0.99, 0.999))),
    "muon": lambda params: muon_two_groups(list(params)),
}


def muon_two_groups(params):
    """--optimizer muon's combination, with two_groups' lrs: Muon on the 2-D parameters among the
    even-numbered ones (lr LRS[0]), AdamW on the rest (LRS[0] and LRS[1] as two_groups)."""
    even, odd = params[::2], params[1::2]
    return MuonWithAdamW([{"params": [p for p in even if p.ndim == 2], "lr": LRS[0]}],
                         [{"params": [p for p in even if p.ndim != 2], "lr": LRS[0]},
                          {"params": odd, "lr": LRS[1]}], weight_decay=0.1)


def stage_module(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.LayerNorm(9), nn.Linear(9, 5))


def make_policy(cls, optimizer="adam", k=0, n=3, **options):
    module = stage_module()
    opt = OPTIMIZERS[optimizer](module.parameters())
    policy = cls(module, opt, stage=k, num_stages=n, **options)
    policy.begin_epoch(build_schedule("async-1f1b", n, 1, 40).orders[k])
    return module, opt, policy


def train_step(module, opt, policy, seed):
    """One backward on the live weights and one update, as a stage does between forwards."""
    g = torch.Generator().manual_seed(seed)
    module(torch.randn(4, 7, generator=g)).square().mean().backward()
    policy.before_update()
    opt.step()
    opt.zero_grad(set_to_none=True)
    policy.after_update()


def reference_delta(opt, p):
    """Delta written out from the optimizer's state, in the op order of the per-forward formula
    the prediction used before it was cached (docs/architecture.md, "The prediction per
    optimizer")."""
    group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
    state = opt.state[p]
    if isinstance(opt, O.SGD):
        return state["momentum_buffer"]
    step = float(state["step"])
    b1, b2 = group["betas"]
    v = state["max_exp_avg_sq"] if group["amsgrad"] else state["exp_avg_sq"]
    denom = torch.sqrt(v).div_(math.sqrt(1 - b2 ** step)).add_(group["eps"])
    delta = torch.div(state["exp_avg"], denom).div_(1 - b1 ** step)
    wd = group["weight_decay"]
    if isinstance(opt, O.AdamW) and wd:
        lr = group["lr"]
        delta.add_(p.detach(), alpha=wd).div_(1 - lr * wd)
    return delta


@pytest.mark.parametrize("swap", [True, False], ids=["swap", "write-restore"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_forward_weights_are_the_formula_bit_for_bit_and_w_comes_back(optimizer, swap, monkeypatch):
    monkeypatch.setattr(policies_module.PredictingPolicy, "_swap_storage", swap)
    module, opt, policy = make_policy(PipeOptimPolicy, optimizer, steps="paper")
    steps = policy.forward_steps(10)
    assert steps == 2
    for update in range(4):
        train_step(module, opt, policy, seed=update)
        live = [p.detach().clone() for _, p in policy.named]
        homes = [p.data_ptr() for _, p in policy.named]
        for repeat in range(2):  # two forwards of the same update
            if optimizer in ("sgd-momentum", "adam", "adam-amsgrad", "adamw"):
                deltas = [reference_delta(opt, p) for _, p in policy.named]
            else:  # the per-parameter formula, a fresh tensor each call, as before the cache
                deltas = [policy.predictor._delta(p, None) for _, p in policy.named]
            lrs = [LRS[i % 2] for i in range(len(policy.named))]
            use = policy.forward_weights(10 + 2 * update + repeat)
            assert use.steps == steps
            for (name, p), w, d, lr in zip(policy.named, live, deltas, lrs):
                seen = use.weights[name]
                assert torch.equal(seen.detach(), torch.add(w, d, alpha=-lr * steps)), name
                # the forward reads the live storage: its backward reads what is live then
                assert seen.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
                assert torch.equal(p.detach(), seen.detach())
            use.done()
            assert policy._swap is swap
            for (name, p), w, home in zip(policy.named, live, homes):
                assert torch.equal(p.detach(), w), name
                assert p.data_ptr() == home


def _forward_done(policy, microbatch):
    use = policy.forward_weights(microbatch)
    use.done()
    return use


@pytest.mark.parametrize("swap", [True, False], ids=["swap", "write-restore"])
@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adam", "adamw", "radam-decoupled", "adamax"])
@pytest.mark.parametrize("cls", [PipeOptimPolicy, XPipePolicy, SpecTrainPolicy])
def test_nothing_allocated_per_forward_after_the_first(cls, optimizer, swap, monkeypatch):
    monkeypatch.setattr(policies_module.PredictingPolicy, "_swap_storage", swap)
    options = {"steps": "paper"} if cls is PipeOptimPolicy else {}
    module, opt, policy = make_policy(cls, optimizer, k=0, n=4, **options)
    train_step(module, opt, policy, seed=0)
    assert _forward_done(policy, 10).steps > 0       # the first: the cache, Delta's tensors
    held = _held_storages(policy)
    for update in range(3):
        train_step(module, opt, policy, seed=1 + update)
        for repeat in range(2):
            mb = 20 + 2 * update + repeat
            with StorageCreations() as mode:
                use = policy.forward_weights(mb)
                use.done()
                if cls is SpecTrainPolicy:           # its backward predicts too (stage 0: s_b = 0)
                    with policy.backward_pass(mb, use):
                        pass
            assert use.steps > 0
            assert mode.created == [], mode.created
            assert _held_storages(policy) == held   # the same tensors, reused


def _held_storages(policy):
    """Storage of every tensor the policy and its predictor keep, and the parameters'."""
    pred = policy.predictor
    tensors = list(policy.cache) + list(pred._computed.values()) + list(pred._stored.values())
    tensors += [p for _, p in policy.named]
    return sorted(t.untyped_storage().data_ptr() for t in tensors)


def test_spectrain_backward_prediction_allocates_nothing():
    module, opt, policy = make_policy(SpecTrainPolicy, "adam", k=2, n=4)  # s_f = 2, s_b = 1
    train_step(module, opt, policy, seed=0)
    use = _forward_done(policy, 10)
    with policy.backward_pass(10, use) as used:
        assert used.steps == 1
    train_step(module, opt, policy, seed=1)
    use = _forward_done(policy, 11)
    live = [p.detach().clone() for _, p in policy.named]
    expected = [torch.add(w, reference_delta(opt, p), alpha=-LRS[i % 2] * 1)
                for i, ((_, p), w) in enumerate(zip(policy.named, live))]
    with StorageCreations() as mode:
        with policy.backward_pass(11, use) as used:
            same = [torch.equal(use.weights[name], e) for (name, _), e in zip(policy.named, expected)]
    assert used.steps == 1 and all(same)
    assert mode.created == []
    for (_, p), w in zip(policy.named, live):
        assert torch.equal(p.detach(), w)


def test_old_per_forward_delta_would_fail_the_allocation_test():
    # What the prediction did before: Delta of an adaptive formula into a fresh tensor per
    # forward. The counter catches it, so the test above can fail.
    module, opt, policy = make_policy(PipeOptimPolicy, "adam", steps="paper")
    train_step(module, opt, policy, seed=0)
    with StorageCreations() as mode:
        for _, p in policy.named:
            policy.predictor._delta(p, None)
    assert len(mode.created) == len(policy.named)


@pytest.mark.parametrize("swap", [True, False], ids=["swap", "write-restore"])
def test_delta_is_computed_once_per_update(swap, monkeypatch):
    monkeypatch.setattr(policies_module.PredictingPolicy, "_swap_storage", swap)
    module, opt, policy = make_policy(PipeOptimPolicy, "adamw", steps="paper")
    calls = []  # the parameters whose Delta is computed (per group, one call for its parameters)
    original = Predictor._deltas
    monkeypatch.setattr(Predictor, "_deltas",
                        lambda self, group, ps, outs: calls.extend(ps) or original(self, group, ps, outs))
    n = len(policy.named)
    for update in range(3):
        train_step(module, opt, policy, seed=update)
        calls.clear()
        for repeat in range(4):
            _forward_done(policy, 10 + 4 * update + repeat)
        assert len(calls) == n
    # a setting Delta reads changes between forwards: rebuilt (and predicted as before)
    calls.clear()
    opt.param_groups[0]["betas"] = (0.8, 0.99)
    _forward_done(policy, 30)
    assert len(calls) == n
    # the optimizer loads a state (new tensors): rebuilt
    calls.clear()
    opt.load_state_dict(opt.state_dict())
    _forward_done(policy, 31)
    assert len(calls) == n
    # a parameter changed in place outside a step (AdamW's Delta reads W): rebuilt
    calls.clear()
    with torch.no_grad():
        next(module.parameters()).mul_(1.0)
    _forward_done(policy, 32)
    assert len(calls) == n


def test_parameters_sharing_one_storage_use_write_and_restore():
    # Parameters that are views of one flat buffer cannot have their storage swapped one by one.
    module = stage_module()
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()] + [torch.full((3,), 7.0)])
    offset = 0
    for p in module.parameters():
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    opt = OPTIMIZERS["adam"](module.parameters())
    policy = PipeOptimPolicy(module, opt, stage=0, num_stages=3, steps="paper")
    policy.begin_epoch(build_schedule("async-1f1b", 3, 1, 40).orders[0])
    train_step(module, opt, policy, seed=0)
    live = flat.clone()
    expected = policy.predictor.predict(2)
    use = policy.forward_weights(10)
    assert policy._swap is False
    for name, p in policy.named:
        assert torch.equal(use.weights[name].detach(), expected[p])
    use.done()
    assert torch.equal(flat, live)                 # W back, the tail of the buffer untouched


def test_a_parameter_moved_to_other_memory_gets_a_new_cache():
    module, opt, policy = make_policy(PipeOptimPolicy, "sgd-momentum", steps="paper")
    train_step(module, opt, policy, seed=0)
    _forward_done(policy, 10)
    first = policy.cache[0]
    p = policy.named[0][1]
    p.data = p.data.clone()                        # e.g. a policy or a user re-homing it
    train_step(module, opt, policy, seed=1)
    live = [q.detach().clone() for _, q in policy.named]
    expected = policy.predictor.predict(2)
    use = policy.forward_weights(11)
    assert policy.cache[0] is not first
    for name, q in policy.named:
        assert torch.equal(use.weights[name].detach(), expected[q])
    use.done()
    for (_, q), w in zip(policy.named, live):
        assert torch.equal(q.detach(), w)


def test_backward_reads_the_live_weights_not_the_cache():
    # PipeOptim's backward runs on the weights live at backward time (docs/architecture.md,
    # "Weight versions per method"): with
    # the storage swap, the cache must not back the forward's saved tensors after the forward.
    module, opt, policy = make_policy(PipeOptimPolicy, "sgd-momentum", k=1, n=3, steps="paper")
    stage = Stage(1, 3, module, opt, policy)
    train_step(module, opt, policy, seed=0)
    w1 = {n: p.detach().clone() for n, p in policy.named}
    w_hat = {n: policy.predictor.predict(1)[p] for n, p in policy.named}
    w2 = {n: w * 0.5 for n, w in w1.items()}      # what an update before the backward leaves
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(9))
    out = stage.forward(10, x)
    assert policy._swap
    for buf in policy.cache:
        buf.fill_(float("nan"))                   # whatever the cache holds now is never read
    with torch.no_grad():
        for name, p in policy.named:
            p.copy_(w2[name])
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(10))
    grad_in = stage.backward(10, grad_out)

    # The same pass written out: a storage holding W_hat for the forward, then W2.
    storage = {n: w.clone() for n, w in w1.items()}
    for n in storage:
        storage[n].copy_(w_hat[n])
    weights = {n: t.data.requires_grad_(True) for n, t in storage.items()}
    leaf = x.detach().requires_grad_(True)
    ref_out = functional_call(module, weights, (leaf,))
    assert torch.equal(ref_out.detach(), out)
    with torch.no_grad():
        for n in storage:
            storage[n].copy_(w2[n])
    ref_out.backward(grad_out)
    assert torch.isfinite(grad_in).all()
    assert torch.equal(grad_in, leaf.grad)        # input gradient through the live W2
    for name, p in policy.named:
        assert torch.equal(p.grad, weights[name].grad), name


def test_stage_restores_w_when_the_forward_raises():
    module, opt, policy = make_policy(PipeOptimPolicy, "adam", k=2, n=3, steps="code")

    def bad_loss(output, target):
        raise RuntimeError("boom")

    stage = Stage(2, 3, module, opt, policy, loss_fn=bad_loss)
    train_step(module, opt, policy, seed=0)
    live = [p.detach().clone() for _, p in policy.named]
    homes = [p.data_ptr() for _, p in policy.named]
    with pytest.raises(RuntimeError, match="boom"):
        stage.forward(10, torch.randn(4, 7), torch.zeros(4))
    for (_, p), w, home in zip(policy.named, live, homes):
        assert torch.equal(p.detach(), w) and p.data_ptr() == home


def _data(count=12):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 7, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(count)]


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 9), nn.Tanh(), nn.LayerNorm(9),
                         nn.Linear(9, 5))


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adamw", "muon"])
@pytest.mark.parametrize("method", ["pipeoptim", "spectrain", "xpipe"])
def test_swap_and_write_restore_train_the_same_bits(method, optimizer, monkeypatch):
    runs = []
    for swap in (True, False):
        monkeypatch.setattr(policies_module.PredictingPolicy, "_swap_storage", swap)
        extra = {"micro_batches": 2} if method == "xpipe" else {}
        result = pipeoptim.train(_model(), _data(), method=method, stages=3,
                                 optimizer=OPTIMIZERS[optimizer], loss_fn=nn.functional.cross_entropy,
                                 diagnose_every=3, **extra)
        runs.append(result)
    a, b = runs
    assert a.losses == b.losses
    assert a.metrics["prediction_error"] == b.metrics["prediction_error"]
    assert any(e.steps > 0 for e in a.version_trace)
    for x, y in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(x, y)


def test_optimizer_state_loaded_into_a_running_predictor():
    # Loading replaces the optimizer's group dicts: the prediction follows the new groups (their
    # lr, the last step's lr for AdamW's decay) instead of the replaced ones.
    module, opt, policy = make_policy(PipeOptimPolicy, "adamw", steps="paper")
    for seed in range(2):
        train_step(module, opt, policy, seed=seed)
    _forward_done(policy, 10)
    state = opt.state_dict()
    state["param_groups"][0]["lr"] = 0.2
    opt.load_state_dict(state)
    assert opt.param_groups[0]["lr"] == 0.2
    p = opt.param_groups[0]["params"][0]
    assert policy.predictor.lr(p) == 0.2
    expected = torch.add(p.detach(), policy.predictor.direction(p), alpha=-0.2 * 2)
    use = policy.forward_weights(11)
    name = next(n for n, q in policy.named if q is p)
    assert torch.equal(use.weights[name].detach(), expected)
    use.done()
