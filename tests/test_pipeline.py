"""pipeoptim.Pipeline: streaming, schedulers, clipping, bf16, devices, state by name, bad input."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

import pipeoptim
from pipeoptim import Pipeline
from pipeoptim.checks import check_method_options
from pipeoptim.methods import get_method, method_names
from pipeoptim.runtime.build import build_stages
from pipeoptim.runtime.local import run_schedule
from pipeoptim.runtime.microbatch import split_batch
from pipeoptim.schedules import build_schedule
from pipeoptim.schedules.actions import Kind

LOSS = nn.functional.cross_entropy


def mlp(seed: int = 0, width: int = 16) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3))


def data(n: int = 12, size: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 8, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]


def sgdm(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def stages_for(method: str) -> dict:
    """4 pieces of the model: 4 stages, or 2 stages x 2 pieces for a chunked method and bitpipe;
    bidirectional's 4 ranks hold 4 pieces (each rank with another's replica too)."""
    meth = get_method(method)
    return {} if method == "sequential" else {"stages": 4 // meth.pieces_per_rank(meth.chunks)}


# -- the streaming property of every runnable schedule -----------------------------------------

@pytest.mark.parametrize("name", ["gpipe", "1f1b-flush", "async-1f1b", "2bw", "zb-h1", "interleaved-1f1b", "zb-v"])
def test_schedule_over_more_batches_starts_like_the_shorter_one(name):
    """What the streaming executor relies on: the orders for T mini-batches and for H > T agree
    at every stage up to its first forward of a micro-batch beyond T."""
    checked = 0
    for n, m in itertools.product(range(1, 6), range(1, 4)):
        if (name == "2bw" and m < n) or (name == "interleaved-1f1b" and m % n):
            continue
        for t in range(1, 7):
            short = build_schedule(name, n, m, t)
            for h in range(t + 1, t + 5):
                long = build_schedule(name, n, m, h)
                for k in range(n):
                    order = long.orders[k]
                    cut = next((p for p, a in enumerate(order) if a.kind is Kind.F and a.index >= t * m),
                               len(order))
                    assert short.orders[k][:cut] == order[:cut], (name, n, m, t, h, k)
                    checked += 1
    assert checked > 100


# -- fit and step equal the whole-schedule executor ---------------------------------------------

def whole_schedule_losses(method: str, batches, optimizer=sgdm, **options):
    """The pre-streaming way: every micro-batch of the epoch split up front, one schedule."""
    meth = get_method(method)
    n = 1 if method == "sequential" else 4 // meth.pieces_per_rank(meth.chunks)  # ranks
    sizes = [7] if n == 1 else [2, 2, 2, 1] * (2 if meth.mirrored else 1)
    m = meth.microbatches(n, None)
    model = copy.deepcopy(mlp())
    stages = build_stages(model, sizes, meth, check_method_options(meth, options), optimizer, LOSS)
    micro = [mb for x, y in batches for mb in split_batch(x, y, m)]
    losses = run_schedule(stages, meth.build_schedule(n, m, len(batches)), micro)
    return [losses[w] for w in range(len(batches))], sorted((e for s in stages for e in s.record.trace), key=str)


@pytest.mark.parametrize("method", method_names())
def test_step_by_step_from_a_generator_equals_the_whole_schedule(method):
    batches = data(9)
    expected, expected_trace = whole_schedule_losses(method, batches)
    pipe = Pipeline(mlp(), method=method, loss_fn=LOSS, optimizer=sgdm, **stages_for(method))
    got = []
    for x, y in (b for b in batches):  # a generator: no len(), the horizon grows as data comes
        got += pipe.step(x, y)
    got += pipe.flush()
    assert got == expected
    assert sorted((e for s in pipe.stages for e in s.record.trace), key=str) == expected_trace
    listed = pipeoptim.train(mlp(), batches, method=method, loss_fn=LOSS, optimizer=sgdm, **stages_for(method))
    assert listed.losses == expected


@pytest.mark.parametrize("method", ["pipedream", "pipedream-2bw"])
def test_streaming_keeps_the_same_weight_copies(method):
    """Orders built past the data must not make a stash keep versions no forward will use."""
    batches = data(10)
    known = pipeoptim.train(mlp(), batches, method=method, stages=4, loss_fn=LOSS, optimizer=sgdm,
                            **({"vertical_sync": True} if method == "pipedream" else {}))
    pipe = Pipeline(mlp(), method=method, stages=4, loss_fn=LOSS, optimizer=sgdm,
                    **({"vertical_sync": True} if method == "pipedream" else {}))
    streamed = pipe.fit((b for b in batches))
    assert streamed.losses == known.losses
    assert streamed.metrics["weight_versions"] == known.metrics["weight_versions"]


def test_a_short_last_mini_batch_trains_with_uneven_micro_batches():
    batches = data(5) + [(torch.randn(5, 8), torch.randint(0, 3, (5,)))]
    result = pipeoptim.train(mlp(), batches, method="gpipe", stages=4, loss_fn=LOSS, optimizer=sgdm)
    seq = pipeoptim.train(mlp(), batches, method="sequential", loss_fn=LOSS, optimizer=sgdm)
    assert result.losses == pytest.approx(seq.losses, rel=1e-5)
    with pytest.raises(ValueError, match="cannot split a mini-batch of 3 samples into 4"):
        pipeoptim.train(mlp(), data(2) + [(torch.randn(3, 8), torch.randint(0, 3, (3,)))],
                        method="gpipe", stages=4, loss_fn=LOSS, optimizer=sgdm)


class CountingLoader:
    """An iterable without len() that records how many mini-batches were read."""

    def __init__(self, batches):
        self.batches, self.read = batches, 0

    def __iter__(self):
        for b in self.batches:
            self.read += 1
            yield b


@pytest.mark.parametrize("method,n", [("pipeoptim", 4), ("pipedream-2bw", 4), ("gpipe", 4), ("xpipe", 3)])
def test_the_loader_is_never_read_further_ahead_than_the_pipeline_holds(method, n):
    loader = CountingLoader(data(16))
    completed, ahead = [], []
    pipe = Pipeline(mlp(), method=method, stages=n, loss_fn=LOSS, optimizer=sgdm)
    pipe.fit(loader, on_batch=lambda i, loss: completed.append(i))
    # the bound: the N in flight plus the micro-batches of one mini-batch
    loader2 = CountingLoader(data(16))
    pipe2 = Pipeline(mlp(), method=method, stages=n, loss_fn=LOSS, optimizer=sgdm)
    done = 0
    for x, y in loader2:
        ahead.append(loader2.read - done)
        done += len(pipe2.step(x, y))
    pipe2.flush()
    assert loader.read == 16 and len(completed) == 16
    assert max(ahead) <= n + pipe2.microbatches
    assert max(ahead) == 1  # one process: each mini-batch's loss is in before the next is read


# -- schedulers ----------------------------------------------------------------------------------

def warmup(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))


@pytest.mark.parametrize("method", ["pipeoptim", "pipedream", "gpipe", "xpipe", "pipedream-2bw"])
def test_every_stage_applies_update_j_with_the_same_lr(method):
    pipe = Pipeline(mlp(), method=method, stages=4, loss_fn=LOSS, optimizer=sgdm, lr_scheduler=warmup)
    result = pipe.fit(data(12))
    by_update = {}
    for entry in result.update_trace:
        by_update.setdefault(entry.update, set()).add(entry.lrs)
    assert sorted(by_update) == list(range(len(by_update)))
    assert all(len(lrs) == 1 for lrs in by_update.values())
    assert [next(iter(by_update[j]))[0] for j in range(4)] == pytest.approx([0.0125, 0.025, 0.0375, 0.05])
    assert len(by_update) == 12


def test_a_scheduled_sequential_run_equals_the_plain_pytorch_loop():
    batches = data(10)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    expected = []
    for x, y in batches:
        loss = LOSS(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        opt.zero_grad()
        expected.append(loss.item())
    result = pipeoptim.train(
        mlp(), batches, method="sequential", loss_fn=LOSS, clip_grad_norm=0.5,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=10))
    assert result.losses == expected
    for a, b in zip(result.model.parameters(), model.parameters()):
        assert torch.equal(a, b)


# -- clipping ------------------------------------------------------------------------------------

def hand_clipped_gpipe(batches, max_norm, scope, sizes=(2, 2, 2, 1), m=4):
    """Plain PyTorch: gradient accumulation over m micro-batches, clipped per stage or globally."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    groups = [[p for layer in list(model)[a:b] for p in layer.parameters()] for a, b in zip(bounds, bounds[1:])]
    losses = []
    for x, y in batches:
        total = 0.0
        for xs, ys, share in split_batch(x, y, m):
            loss = LOSS(model(xs), ys) * share
            loss.backward()
            total += float(loss.detach())
        if scope == "stage":
            for group in groups:
                torch.nn.utils.clip_grad_norm_(group, max_norm)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model


@pytest.mark.parametrize("scope", ["stage", "global"])
def test_clipping_equals_clipping_by_hand(scope):
    batches = data(8)
    expected, model = hand_clipped_gpipe(batches, 0.3, scope)
    result = pipeoptim.train(mlp(), batches, method="gpipe", partition=[2, 2, 2, 1], loss_fn=LOSS,
                             optimizer=sgdm, clip_grad_norm=0.3, clip_scope=scope)
    assert result.losses == pytest.approx(expected, rel=1e-6, abs=1e-7)
    for a, b in zip(result.model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    unclipped = pipeoptim.train(mlp(), batches, method="gpipe", partition=[2, 2, 2, 1], loss_fn=LOSS,
                                optimizer=sgdm)
    assert unclipped.losses[3:] != pytest.approx(result.losses[3:], rel=1e-3)  # clipping acted


@pytest.mark.parametrize("method", ["sequential", "gpipe"])
def test_global_clipping_of_one_stage_clips_as_the_stage_does(method):
    """With one stage the model's norm is the stage's: both scopes clip alike (global clipping of
    a one-stage run once skipped the clipping altogether)."""
    batches = data(8)
    run = lambda **kw: pipeoptim.train(mlp(), batches, method=method, stages=None if method == "sequential" else 1,  # noqa: E731
                                       loss_fn=LOSS, optimizer=sgdm, **kw)
    stage, global_ = run(clip_grad_norm=0.3, clip_scope="stage"), run(clip_grad_norm=0.3, clip_scope="global")
    assert global_.losses == stage.losses
    assert run().losses[3:] != pytest.approx(stage.losses[3:], rel=1e-3)  # clipping acted


def test_per_stage_clipping_in_an_asynchronous_pipeline_clips_every_stage():
    result = pipeoptim.train(mlp(), data(8), method="pipeoptim", stages=4, loss_fn=LOSS,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.05), clip_grad_norm=1e-3)
    # plain SGD with every stage's gradient clipped to 1e-3: no weight moves more than 8 * 0.05e-3
    for a, b in zip(result.model.parameters(), mlp().parameters()):
        assert (a - b).norm() <= 8 * 0.05 * 1e-3 + 1e-7


# -- bf16 ----------------------------------------------------------------------------------------

def test_bf16_trains_within_a_stated_tolerance_of_fp32():
    batches = data(20, size=16)
    fp32 = pipeoptim.train(mlp(), batches, method="pipeoptim", stages=2, loss_fn=LOSS, optimizer=adam)
    bf16 = pipeoptim.train(mlp(), batches, method="pipeoptim", stages=2, loss_fn=LOSS, optimizer=adam,
                           precision="bf16")
    assert bf16.losses != fp32.losses                    # autocast did act
    diffs = [abs(a - b) for a, b in zip(fp32.losses, bf16.losses)]
    assert max(diffs) < 0.03                              # the tolerance: 0.03 in a loss near 1
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())


# -- devices -------------------------------------------------------------------------------------

class WhereAmI(nn.Module):
    """Records the device of every input it sees (an activation crossing into a stage)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(x.device)
        return x


def probed_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), WhereAmI(), nn.Linear(8, 8), WhereAmI(), nn.Linear(8, 3))


def check_placement(devices):
    pipe = Pipeline(probed_model(), method="pipeoptim", partition=[2, 2, 1], loss_fn=LOSS,
                    optimizer=sgdm, devices=devices)
    pipe.fit(data(4))
    model = pipe.model()
    for k, (layers, device) in enumerate(zip(([0, 1], [2, 3], [4]), devices)):
        for i in layers:
            for p in model[i].parameters():
                assert p.device == torch.device(device)
            for state in pipe.stages[k].optimizer.state.values():
                assert state["momentum_buffer"].device == torch.device(device)
    assert set(model[1].seen) == {torch.device(devices[0])}
    assert set(model[3].seen) == {torch.device(devices[1])}
    assert pipe.evaluate(data(2), lambda out, y: (out.argmax(-1) == y).float().mean()) >= 0


def test_each_stage_and_its_activations_live_on_its_device():
    check_placement(["cpu", "cpu", "cpu"])
    assert [str(d) for d in Pipeline(mlp(), method="gpipe", stages=2, loss_fn=LOSS, optimizer=sgdm,
                                     devices="cpu").devices] == ["cpu", "cpu"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stages_split_between_cpu_and_cuda():
    check_placement(["cpu", "cuda:0", "cpu"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pipeline_equals_cpu_pipeline():
    cpu = pipeoptim.train(mlp(), data(6), method="pipeoptim", stages=2, loss_fn=LOSS, optimizer=sgdm,
                          devices="cpu")
    gpu = pipeoptim.train(mlp(), data(6), method="pipeoptim", stages=2, loss_fn=LOSS, optimizer=sgdm,
                          devices="cuda")
    assert gpu.losses == pytest.approx(cpu.losses, rel=1e-4)
    assert gpu.metrics["devices"] == ["cuda:0", "cuda:0"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_steps_on_cuda_never_wait_for_the_device():
    """No host synchronisation on the hot path: the losses come back through pinned memory."""
    pipe = Pipeline(mlp(), method="pipeoptim", stages=2, loss_fn=LOSS, optimizer=adam, devices="cuda",
                    clip_grad_norm=1.0, precision="bf16")
    batches = [(x.pin_memory(), y.pin_memory()) for x, y in data(10)]
    losses = [loss for x, y in batches[:3] for loss in pipe.step(x, y)]  # optimizer state is made
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses += [loss for x, y in batches[3:] for loss in pipe.step(x, y)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    losses += pipe.flush()
    assert len(losses) == 10 and losses == pipe.losses


def test_a_copy_to_the_host_is_made_at_once_and_one_to_a_device_is_queued(monkeypatch):
    """Issue 62: evaluation's outputs come to the CPU through to_device and are read right after;
    a non-blocking copy to the host could be read before its values arrive. A copy to a device
    may be queued (the device's next work waits for it). Checked on the copies to_device asks
    for, since this machine has no GPU (a meta tensor stands for one on another device)."""
    from pipeoptim.runtime.values import to_device

    asked = {}
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device, non_blocking=False:
                        asked.setdefault(torch.device(device).type, non_blocking) and None)
    value = torch.empty(2, device="meta")
    to_device((value, {"x": value}), torch.device("cpu"))
    to_device(value, torch.device("cuda", 0))
    assert asked == {"cpu": False, "cuda": True}


# -- state by name -------------------------------------------------------------------------------

def test_a_state_taken_with_one_partition_resumes_with_another():
    batches = data(10)
    make = dict(method="1f1b-flush", loss_fn=LOSS, optimizer=adam, lr_scheduler=warmup)
    straight = Pipeline(mlp(), partition=[4, 3], **make)
    expected = [loss for x, y in batches for loss in straight.step(x, y)] + straight.flush()
    first = Pipeline(mlp(), partition=[4, 3], **make)
    losses = [loss for x, y in batches[:5] for loss in first.step(x, y)] + first.flush()
    state = first.state_dict()
    assert set(state["model"]) == set(mlp().state_dict())   # the model's own parameter names
    second = Pipeline(mlp(seed=7), partition=[2, 5], **make)
    second.load_state_dict(state)
    losses += [loss for x, y in batches[5:] for loss in second.step(x, y)] + second.flush()
    assert losses == pytest.approx(expected, rel=1e-6, abs=1e-7)
    for a, b in zip(second.model().parameters(), straight.model().parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert second.stages[0].scheduler.last_epoch == straight.stages[0].scheduler.last_epoch


def test_an_asynchronous_state_carries_optimizer_and_predictor_state_by_name():
    first = Pipeline(mlp(), method="pipeoptim", partition=[2, 2, 3], loss_fn=LOSS, optimizer=adam)
    first.fit(data(6))
    state = first.state_dict()
    second = Pipeline(mlp(seed=3), method="pipeoptim", partition=[4, 3], loss_fn=LOSS, optimizer=adam)
    second.load_state_dict(state)
    names = dict(first.model().named_parameters())
    for stage in second.stages:
        assert stage.policy.version == 6 and stage.policy.predictor.has_direction
        for name, p in stage.module.named_parameters():
            torch.testing.assert_close(stage.optimizer.state[p]["exp_avg"],
                                       next(s.optimizer.state[q]["exp_avg"] for s in first.stages
                                            for n, q in s.module.named_parameters() if n == name))
            assert torch.equal(p, names[name])
    assert len(second.fit(data(3)).losses) == 9


def test_state_dict_needs_a_drained_pipeline():
    pipe = Pipeline(mlp(), method="pipeoptim", stages=4, loss_fn=LOSS, optimizer=sgdm)
    x, y = data(1)[0]
    pipe.step(x, y)
    with pytest.raises(RuntimeError, match="flush"):
        pipe.state_dict()
    pipe.flush()
    assert pipe.state_dict()["batches_done"] == 1


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(model=lambda x: x), "model must be an nn.Module"),  # any module: see tests/test_traced.py
    (dict(lr_scheduler=lambda opt: "cosine"), "lr_scheduler must be a factory"),
    (dict(lr_scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt)), "ReduceLROnPlateau"),
    (dict(optimizer=lambda params: None), "optimizer must be a factory"),
    (dict(clip_grad_norm=1.0, clip_scope="global"), "clip_scope='global' needs every stage"),
    (dict(clip_grad_norm=1.0, clip_scope="layer"), "clip_scope must be"),
    (dict(clip_grad_norm=-1.0), "clip_grad_norm must be a positive"),
    (dict(precision="fp8"), "precision must be one of fp32, bf16"),
    (dict(devices=["cpu", "cpu"]), "devices lists 2 devices for 4 stages"),
    (dict(devices=["cuda:0"] * 4 if not torch.cuda.is_available() else [f"cuda:{torch.cuda.device_count()}"] * 4),
     "does not exist"),
])
def test_bad_settings_raise_a_value_error_naming_the_fix(kwargs, message):
    settings = dict(model=mlp(), method="pipeoptim", stages=4, loss_fn=LOSS, optimizer=sgdm)
    settings.update(kwargs)
    with pytest.raises(ValueError, match=message):
        Pipeline(settings.pop("model"), **settings)


def test_a_loss_that_is_not_a_scalar_is_refused(tmp_path):
    pipe = Pipeline(mlp(), method="gpipe", stages=2, optimizer=sgdm,
                    loss_fn=lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"))
    with pytest.raises(ValueError, match="loss_fn must return a scalar tensor.*reduction='mean'"):
        pipe.fit(data(2), checkpoint_dir=tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_an_empty_loader_is_refused_and_nothing_is_written(tmp_path):
    pipe = Pipeline(mlp(), method="pipeoptim", stages=2, loss_fn=LOSS, optimizer=sgdm)
    with pytest.raises(ValueError, match="yields no mini-batches"):
        pipe.fit([], checkpoint_dir=tmp_path / "ck")
    with pytest.raises(ValueError, match="yielded no mini-batches"):
        pipe.fit((b for b in []), checkpoint_dir=tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_resume_with_a_shuffling_dataloader_gives_the_uninterrupted_losses(tmp_path):
    """The loader's shuffle comes from torch's global generator: a resumed run re-creates the
    epoch's order from the state saved with the checkpoint, then skips what was trained."""
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(3)
    dataset = TensorDataset(torch.randn(40, 8, generator=g), torch.randint(0, 3, (40,), generator=g))

    def fit(store, stop_at=None, resume=False, seed=5):
        pipe = Pipeline(mlp(), method="pipeoptim", stages=2, loss_fn=LOSS, optimizer=sgdm)
        torch.manual_seed(seed)

        def on_batch(index, loss):
            if index == stop_at:
                raise KeyboardInterrupt
        return pipe.fit(DataLoader(dataset, batch_size=4, shuffle=True), epochs=2, checkpoint_dir=store,
                        checkpoint_every=3, resume=resume, on_batch=on_batch)

    full = fit(tmp_path / "a").losses
    with pytest.raises(KeyboardInterrupt):
        fit(tmp_path / "b", stop_at=14)              # dies in epoch 1, after the checkpoint at batch 3
    resumed = fit(tmp_path / "b", resume=True, seed=99)  # another RNG state, as in a new process
    assert resumed.losses == full
    assert len(full) == 20


@pytest.mark.parametrize("method", ["gpipe", "1f1b-flush", "pipeoptim", "pipedream-2bw", "xpipe"])
def test_after_each_mini_batch_every_stage_has_run_all_it_can(method):
    """After a feed, each stage stands at its first forward of a micro-batch not fed yet: what it
    ran needs nothing beyond the data fed, so one process per stage can stream without waiting
    on a peer that has not been fed."""
    from pipeoptim.runtime.executor import Executor
    from pipeoptim.runtime.local import Mailbox

    pipe = Pipeline(mlp(), method=method, stages=4, loss_fn=LOSS, optimizer=sgdm)
    m = pipe.microbatches
    executor = Executor(pipe.stages, Mailbox(), pipe._schedule_for)
    for t, (x, y) in enumerate(data(7)):
        executor.feed(split_batch(x, y, m))
        for k, order in enumerate(executor.schedule.orders):
            action = order[executor._pointer[k]]
            assert action.kind is Kind.F and action.index == (t + 1) * m, (t, k, action)
    executor.finish()


def test_an_interrupted_scheduled_run_resumes_with_its_scheduler_where_it_was(tmp_path):
    step = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5)  # noqa: E731
    settings = dict(method="pipeoptim", stages=2, loss_fn=LOSS, optimizer=adam, lr_scheduler=step)
    whole = pipeoptim.train(mlp(), data(12), checkpoint_dir=tmp_path / "a", checkpoint_every=3, **settings)

    def stop(index, loss):
        if index == 7:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        pipeoptim.train(mlp(), data(12), checkpoint_dir=tmp_path / "b", checkpoint_every=3, on_batch=stop, **settings)
    resumed = pipeoptim.train(mlp(), data(12), checkpoint_dir=tmp_path / "b", checkpoint_every=3, resume=True,
                              **settings)
    assert resumed.losses == whole.losses
    lrs = [u.lrs[0] for u in resumed.update_trace if u.stage == 0]
    assert lrs == [0.005, 0.005, 0.0025, 0.0025, 0.0025, 0.0025]   # updates 6..11, after the resume


def test_a_state_dict_is_a_snapshot_that_later_training_does_not_change():
    """torch's optimizer state_dict hands out its live tensors (momentum buffers); the Pipeline's
    state must be a copy, or a Pipeline loaded from it trains on the saver's later buffers."""
    kw = dict(method="1f1b-flush", stages=3, loss_fn=LOSS, optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    batches = data(8)
    first = pipeoptim.Pipeline(mlp(), **kw)
    for x, y in batches[:4]:
        first.step(x, y)
    first.flush()
    state = first.state_dict()
    for x, y in batches[4:]:
        first.step(x, y)
    first.flush()
    second = pipeoptim.Pipeline(mlp(), **kw)
    second.load_state_dict(state)
    for x, y in batches[4:]:
        second.step(x, y)
    second.flush()
    assert second.losses[4:] == first.losses[4:]


class CountingWorld:
    """A LocalWorld that counts what the Pipeline asks of it (the world interface)."""

    def __init__(self) -> None:
        from pipeoptim.world import LocalWorld

        self.inner, self.asked = LocalWorld(), []

    def __getattr__(self, name):
        value = getattr(self.inner, name)
        if callable(value):
            self.asked.append(name)
        return value


def test_the_pipeline_runs_through_the_world_it_is_given(monkeypatch, tmp_path):
    """world=LocalWorld() keeps every stage in this process even where WORLD_SIZE says torchrun
    (the one-process baseline that `pipeoptim bench` runs on rank 0 of its job), and the
    Pipeline does all its placing, executing, evaluating and checkpointing through it."""
    expected = Pipeline(mlp(), method="pipeoptim", stages=2, loss_fn=LOSS, optimizer=sgdm).fit(
        data(6), 2, eval_loader=data(2), checkpoint_dir=tmp_path / "a", checkpoint_every=2)
    monkeypatch.setenv("WORLD_SIZE", "2")  # a Pipeline made without a world would join that job
    world = CountingWorld()
    got = Pipeline(mlp(), method="pipeoptim", stages=2, loss_fn=LOSS, optimizer=sgdm, world=world).fit(
        data(6), 2, eval_loader=data(2), checkpoint_dir=tmp_path / "b", checkpoint_every=2)
    assert got.losses == expected.losses
    assert [e["metric"] for e in got.metrics["evaluations"]] == \
        [e["metric"] for e in expected.metrics["evaluations"]]
    assert got.metrics["processes"] == 1
    assert {"layout", "place", "own_rank", "connect", "executor", "evaluate", "all_stages", "everyone",
            "checkpoint_group"} <= \
        set(world.asked)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == \
        sorted(p.name for p in (tmp_path / "a").iterdir())


def test_reporting_calls_back_per_loss_and_names_the_mini_batch_in_errors():
    from pipeoptim.errors import NonFiniteLoss

    pipe = Pipeline(mlp(), method="pipeoptim", stages=2, loss_fn=LOSS, optimizer=sgdm)
    batches, seen = data(4), []
    with pipe.reporting(lambda index, loss: seen.append((index, loss)), label=lambda index: f"step {index + 10}"):
        for x, y in batches:
            pipe.step(x, y, segment_length=len(batches))
        pipe.flush()
        assert seen == list(enumerate(pipe.losses)) and len(seen) == 4
        x, y = batches[0]
        with pytest.raises(NonFiniteLoss, match="loss became nan at step 14$"):
            pipe.step(torch.full_like(x, float("nan")), y)
            pipe.flush()
    pipe = Pipeline(mlp(), method="pipeoptim", stages=2, loss_fn=LOSS, optimizer=sgdm)
    with pipe.reporting(lambda index, loss: seen.append((index, loss))):
        pass
    for x, y in batches:  # outside the block: no callback, the default name
        pipe.step(x, y)
    pipe.flush()
    assert len(seen) == 4
    with pytest.raises(NonFiniteLoss, match="loss became nan at mini-batch 4$"):
        pipe.step(torch.full_like(batches[0][0], float("nan")), batches[0][1])
        pipe.flush()
