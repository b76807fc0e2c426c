"""fp16 with dynamic loss scaling (issue 60, item 5; src/pipeoptim/runtime/loss_scaling.py): a
synchronous pipeline in fp16 equals the plain loop a user writes with ``torch.autocast(float16)``
and ``torch.amp.GradScaler`` (scale, unscale_, clip_grad_norm_, step, update), an overflowing
step included (skipped on every stage, the scale halved, the scheduler not stepped); an
asynchronous method's skipped update is no update (versions and the trace stay); the scale is
checkpointed; what cannot hold is refused. The torchrun side: tests/test_torchrun.py's
``zb-h1+fp16=20+clip=0.05`` entry and its refusals' ``fp16`` case."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import pipeoptim
from pipeoptim import checks
from pipeoptim.errors import command_line_words
from pipeoptim.lab.config import LAB_OPTIONS
from pipeoptim.methods import METHODS, get_method
from pipeoptim.options import OPTIONS
from pipeoptim.runtime.loss_scaling import LossScaler
from pipeoptim.runtime.segment import stage_orders
from pipeoptim.schedules.actions import Kind
from conftest import Crash, crash_at

LOSS = nn.functional.cross_entropy
#: the mini-batch whose inputs are blown up: its scaled gradients overflow fp16 at the default scale
HUGE = 2


def relu_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def data(count: int = 6):
    """Seeded mini-batches of 8; mini-batch HUGE's inputs times 100 (its loss stays finite, its
    gradients times 2**16 do not fit fp16)."""
    g = torch.Generator().manual_seed(1)
    out = [(torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(count)]
    out[HUGE] = (out[HUGE][0] * 100, out[HUGE][1])
    return out


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def decay(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 0.8 ** t)


def plain_fp16_loop(net, batches, micro, clip=None, cut=None, scheduler=True):
    """The loop without pipeoptim: autocast fp16, GradScaler's scale / unscale_ / clip / step /
    update, M micro-batches of equal size (each loss over M); the scheduler stepped only where the
    optimizer stepped (the scale did not back off). ``cut``: clip the layers before it and those
    from it by their own norms (per-stage clipping); else the whole model's. Returns (losses,
    trained copy, scales after each update, the updates skipped)."""
    net = copy.deepcopy(net)
    layers = list(net)
    groups = [[p for m in part for p in m.parameters()] for part in (layers[:cut], layers[cut:])] if cut else None
    opt = sgd(net.parameters())
    sched = decay(opt) if scheduler else None
    scaler = torch.amp.GradScaler("cpu")
    losses, scales, skipped = [], [], []
    for t, (x, y) in enumerate(batches):
        total = 0.0
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = LOSS(net(xs), ys) * (1.0 / micro)
            scaler.scale(loss).backward()
            total += float(loss.detach())
        scaler.unscale_(opt)
        if clip is not None:
            for params in groups or [list(net.parameters())]:
                torch.nn.utils.clip_grad_norm_(params, clip)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < before:
            skipped.append(t)
        elif sched is not None:
            sched.step()
        opt.zero_grad()
        losses.append(total)
        scales.append(scaler.get_scale())
    return losses, net, scales, skipped


def fed(pipe, batches):
    return [loss for x, y in batches for loss in pipe.step(x, y)] + pipe.flush()


def close(a: nn.Module, b: nn.Module, atol: float = 1e-6) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.allclose(sa[k], sb[k], rtol=1e-5, atol=atol) for k in sa)


def test_the_loss_scaler_moves_as_torchs_grad_scaler():
    """LossScaler.update is GradScaler.update: back off by half at an inf or nan, grow by two
    after growth_interval clean updates in a row (3 here; torch's default 2000 is the
    pipeline's), the tracker reset by an overflow."""
    flags = [False, False, True, False, False, False, False, False, False, True, True, False]
    ours = LossScaler(init_scale=2.0 ** 10, growth_interval=3)
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    for found in flags:
        theirs.scale(torch.ones(()))
        p.grad = torch.full((3,), float("inf") if found else 1.0)
        theirs.unscale_(opt)
        theirs.step(opt)
        theirs.update()
        ours.update(found)
        assert (ours.scale, ours.growth_tracker) == (theirs.get_scale(), theirs._growth_tracker.item())
    assert ours.scale != 2.0 ** 10


@pytest.mark.parametrize("method,scope", [("gpipe", "global"), ("zb-h1", "stage")])
def test_fp16_equals_the_grad_scaler_loop_and_an_overflow_skips_every_stage(method, scope):
    """Two stages, M = 2, clipped (by the whole model's norm, or by each stage's: on the unscaled
    gradients either way), an lr scheduler: the losses (unscaled), the weights and the scale equal
    the plain loop's; mini-batch HUGE's update is skipped on every stage (no step, no scheduler
    step, the version stays) and the scale halves, as GradScaler does."""
    net, batches = relu_net(), data()
    pipe = pipeoptim.Pipeline(net, method=method, stages=2, micro_batches=2, loss_fn=LOSS, optimizer=sgd,
                              lr_scheduler=decay, clip_grad_norm=0.5, clip_scope=scope, precision="fp16")
    cut = pipe.spec.partition[0] if scope == "stage" else None
    expected, trained, scales, skipped = plain_fp16_loop(net, batches, micro=2, clip=0.5, cut=cut)
    losses = fed(pipe, batches)
    assert skipped == [HUGE] and scales[HUGE] == 2.0 ** 15 and scales[-1] == 2.0 ** 15
    assert losses == pytest.approx(expected, rel=1e-6)
    assert expected[HUGE + 2:] != plain_fp16_loop(net, batches, micro=2)[0][HUGE + 2:]  # the clipping bites
    assert losses[HUGE] > 2 * losses[0]  # the loss reported is the unscaled one (finite, large)
    trained_here = pipe.model()
    ours = {name: model.state_dict() for name, model in (("pipe", trained_here), ("loop", trained))}
    assert all(torch.allclose(ours["pipe"][k], ours["loop"][k], rtol=1e-5, atol=1e-6) for k in ours["loop"])
    for stage in pipe.stages:
        assert stage.loss_scaling.scale == 2.0 ** 15 and stage.loss_scaling.growth_tracker == 3
        assert stage.record.skips == [HUGE]                        # the version at the skipped update
        assert [u.update for u in stage.record.updates] == [0, 1, 2, 3, 4]  # five applied, numbered by version
        assert stage.policy.version == 5 and stage.scheduler.last_epoch == 5
        assert all(p.dtype == torch.float32 for p in stage.module.parameters())
    assert pipe.stages[0].loss_scaling is pipe.stages[1].loss_scaling  # one scale in the process


@pytest.mark.parametrize("method,stages,micro", [("bidirectional", 1, 2), ("interleaved", 2, 2), ("dualpipev", 2, 4)])
def test_mirrored_and_chunked_methods_in_fp16_equal_the_grad_scaler_loop(method, stages, micro):
    """Two replicas of each piece (their gradients summed after the agreement, each unscaled by
    the same power of two), chunks (several stages per rank: one agreement per update number), a
    forward paired with a backward: the plain loop's numbers, the overflow skipped everywhere."""
    net, batches = relu_net(), data()
    pipe = pipeoptim.Pipeline(net, method=method, stages=stages, micro_batches=micro, loss_fn=LOSS, optimizer=sgd,
                              lr_scheduler=decay, precision="fp16")
    expected, trained, _, skipped = plain_fp16_loop(net, batches, micro=micro)
    assert skipped == [HUGE] and fed(pipe, batches) == pytest.approx(expected, rel=1e-6)
    assert close(pipe.model(), trained)
    assert len(pipe.stages) == (2 if method == "bidirectional" else 4)
    assert all(stage.record.skips == [HUGE] for stage in pipe.stages)


def test_without_an_overflow_fp16_differs_from_fp32_and_keeps_its_scale():
    net, batches = relu_net(), data()[:HUGE]
    fp32 = fed(pipeoptim.Pipeline(net, stages=2, loss_fn=LOSS, optimizer=sgd), batches)
    pipe = pipeoptim.Pipeline(net, stages=2, loss_fn=LOSS, optimizer=sgd, precision="fp16")
    losses = fed(pipe, batches)
    assert losses != fp32 and losses == pytest.approx(fp32, rel=1e-2)  # it ran in fp16
    assert pipe.stages[0].loss_scaling.scale == 2.0 ** 16 and not pipe.stages[0].record.skips


@pytest.mark.parametrize("method,options", [("pipedream", {"vertical_sync": True}), ("pipeoptim", {}),
                                            ("pipeoptim-2bw", {}), ("xpipe", {}), ("async-naive", {})])
def test_an_asynchronous_skipped_update_is_no_update(method, options):
    """Three stages in one process: mini-batch HUGE's update is skipped on every stage at once;
    every pass after it runs on one version less than the same schedule in fp32 runs on (the
    versions a policy reads from the schedule, vertical sync's and 2BW's, included), the versions
    before it are the same; the lr of each applied update is the scheduler's for its version (the
    scheduler did not step at the skip). PipeOptim predicts over the same step counts."""
    net, batches = relu_net(), data()

    def run(precision):
        pipe = pipeoptim.Pipeline(net, method=method, stages=3, loss_fn=LOSS, optimizer=sgd, lr_scheduler=decay,
                                  precision=precision, **options)
        return pipe, fed(pipe, batches)

    (ref, _), (pipe, losses) = run("fp32"), run("fp16")
    assert all(math.isfinite(v) for v in losses)
    skipped = pipe.stages[0].record.skips
    assert len(skipped) == 1
    updates = len(ref.stages[0].record.updates)
    for stage, plain in zip(pipe.stages, ref.stages):
        assert stage.record.skips == skipped and stage.policy.version == updates - 1
        assert [u.update for u in stage.record.updates] == list(range(updates - 1))
        assert [u.lrs for u in stage.record.updates] == [u.lrs for u in plain.record.updates[:-1]]  # version v's lr
        assert len(stage.record.trace) == len(plain.record.trace)
        for entry, was in zip(stage.record.trace, plain.record.trace):
            assert (entry.microbatch, entry.kind) == (was.microbatch, was.kind)
            assert entry.version == was.version - (was.version > skipped[0]), (stage.index, entry, was)
            if method == "pipeoptim":
                assert entry.steps == was.steps
    assert ref.stages[0].policy.version == updates


def test_every_update_skipped_leaves_the_weights_optimizer_and_scheduler_as_they_were():
    """A scale no gradient fits (2**40): every update of every stage is skipped, the scale halves
    each time, and nothing moves: weights, optimizer state, scheduler, versions."""
    net, batches = relu_net(), data()[:4]
    pipe = pipeoptim.Pipeline(net, method="pipeoptim", stages=2, loss_fn=LOSS, optimizer=sgd, lr_scheduler=decay,
                              precision="fp16")
    pipe.stages[0].loss_scaling.scale = 2.0 ** 40
    losses = fed(pipe, batches)
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    assert pipe.stages[0].loss_scaling.scale == 2.0 ** 36
    for stage in pipe.stages:
        assert stage.record.skips == [0, 0, 0, 0] and not stage.record.updates and stage.policy.version == 0
        assert not stage.optimizer.state and stage.scheduler.last_epoch == 0
        assert all(e.version == 0 and e.steps == 0 for e in stage.record.trace)  # nothing to predict from
    assert close(pipe.model(), net, atol=0)


def test_the_scale_is_checkpointed_and_a_resumed_run_continues_it(tmp_path):
    """fit's checkpoints hold the scale and its growth tracker (each stage's state, by the
    checkpoint's one writer and reader); a run killed after its checkpoint resumes to the
    uninterrupted run's losses, scale and tracker; state_dict() carries them too."""
    batches = data()

    def run(folder, **kwargs):
        pipe = pipeoptim.Pipeline(relu_net(), stages=2, loss_fn=LOSS, optimizer=sgd, precision="fp16")
        result = pipe.fit(batches, checkpoint_dir=folder, checkpoint_every=HUGE + 1, **kwargs)
        return pipe, result.losses

    full, expected = run(tmp_path / "full")
    with pytest.raises(Crash):
        run(tmp_path / "cut", on_batch=crash_at(HUGE + 2))
    resumed, losses = run(tmp_path / "cut", resume=True)
    assert losses == expected
    for stage, was in zip(resumed.stages, full.stages):
        assert stage.loss_scaling.state_dict() == was.loss_scaling.state_dict() == \
            {"scale": 2.0 ** 15, "growth_tracker": len(batches) - HUGE - 1}
    fresh = pipeoptim.Pipeline(relu_net(), stages=2, loss_fn=LOSS, optimizer=sgd, precision="fp16")
    fresh.load_state_dict(full.state_dict())
    assert fresh.stages[1].loss_scaling.state_dict() == full.stages[1].loss_scaling.state_dict()


def test_asynchronous_methods_under_torchrun_are_refused_naming_the_fix():
    """One found-inf flag per update number would stall an asynchronous method's stages at every
    update under torchrun: refused there (the API's words and the command line's), run in one
    process; the synchronous methods run under torchrun (tests/test_torchrun.py)."""
    for name, method in METHODS.items():
        refuse = not method.synchronous
        for processes in (1, 2):
            try:
                checks.check_precision(method, "fp16", processes)
                refused = None
            except ValueError as error:
                refused = str(error)
            assert (refused is not None) == (refuse and processes > 1), name
    with pytest.raises(ValueError, match=r"precision='fp16' with pipeoptim under torchrun is not supported: .* "
                                         r"Use precision='bf16' \(no loss scale needed\), a synchronous method "
                                         r"\(zb-h1\), or run pipeoptim in one process"):
        checks.check_precision(get_method("pipeoptim"), "fp16", 4)
    with pytest.raises(ValueError, match="--precision fp16 with xpipe under torchrun .* Use --precision bf16"):
        with command_line_words((*OPTIONS, *LAB_OPTIONS)):
            checks.check_precision(get_method("xpipe"), "fp16", 2)
    checks.check_precision(get_method("pipeoptim"), "bf16", 2)
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, fp16, got 'fp8'"):
        pipeoptim.Pipeline(relu_net(), stages=2, loss_fn=LOSS, optimizer=sgd, precision="fp8")


def test_every_schedule_runs_a_windows_last_stage_forwards_after_the_update_before_it():
    """What one scale per update rests on (runtime/loss_scaling.py): a micro-batch's loss is
    scaled at the last stage's forward by the scale its gradients are unscaled by at its update,
    so every last stage runs window u's forwards after its update u - 1, before its update u."""
    for name, method in METHODS.items():
        for ranks in (2, 3):
            if name == "sequential":
                continue
            schedule = method.build_schedule(ranks, method.microbatches(ranks, None), 4)
            m, orders = schedule.microbatches_per_update, stage_orders(schedule)
            for chain in schedule.pipelines:
                last, done = chain[-1], 0
                for action in orders[last]:
                    if action.stage != last:
                        continue
                    if action.kind is Kind.U:
                        done += 1
                    elif action.kind is Kind.F:
                        assert done == action.index // m, (name, ranks, action)


def test_gpt2_in_fp16_equals_its_plain_loop():
    """A transformers GPT-2 as it comes (tests/first_day.py; traced, its head tied across the two
    stages, its own loss from labels) in fp16, zb-h1's M = 2: the plain loop under autocast(float16)
    with GradScaler, AdamW."""
    from first_day import adamw, batches as lm_batches, fed as fed_dicts, model

    net, feeds = model("gpt2"), lm_batches("gpt2")
    loop = copy.deepcopy(net)
    opt, scaler, expected = adamw(loop.parameters()), torch.amp.GradScaler("cpu"), []
    for batch in feeds:
        total = 0.0
        for i in range(2):
            piece = {k: torch.tensor_split(v, 2)[i] for k, v in batch.items()}
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loop(**piece).loss / 2
            scaler.scale(loss).backward()
            total += float(loss.detach())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        expected.append(total)
    pipe = pipeoptim.Pipeline(net, optimizer=adamw, stages=2, precision="fp16")
    losses = fed_dicts(pipe, feeds)
    assert losses == pytest.approx(expected, rel=1e-4)
    assert losses[0] != fed_dicts(pipeoptim.Pipeline(net, optimizer=adamw, stages=2), feeds[:1])[0]  # in fp16
    assert pipe.stages[0].loss_scaling.scale == scaler.get_scale()
    assert all(p.dtype == torch.float32 for s in pipe.stages for p in s.module.parameters())
