"""A model that is not an nn.Sequential, traced and split (docs/architecture.md, "Splitting any
module", "Tied weights"): a GPT written as people write it, with its head tied to its embedding,
under 1f1b-flush equals the untouched model trained sequentially and keeps one tied tensor; a
model with two inputs and a skip connection trains with every method; bad input is refused
before anything runs."""
from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from torch import nn

import pipeoptim
from pipeoptim.methods import get_method
from conftest import Crash, crash_at
from traced_models import SkipNet, SmallCNN, TinyGPT, as_sequential, lm_batches, lm_loss, skip_batches

SGDM = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731


def plain_loop(model, data, make_opt, loss_fn, micro):
    """The untouched model, trained with gradient accumulation over ``micro`` micro-batches."""
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    losses = []
    for x, y in data:
        total = 0.0
        pieces = zip(*(torch.tensor_split(t, micro) for t in x)) if isinstance(x, tuple) else torch.tensor_split(x, micro)
        for xm, ym in zip(pieces, torch.tensor_split(y, micro)):
            loss = loss_fn(model(*xm) if isinstance(xm, tuple) else model(xm), ym) * (ym.shape[0] / y.shape[0])
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model


def run(pipe, data):
    losses = [loss for x, y in data for loss in pipe.step(x, y)]
    return losses + pipe.flush()


@pytest.mark.parametrize("method", ["1f1b-flush", "gpipe"])
def test_tied_gpt_equals_the_model_trained_sequentially(method):
    torch.manual_seed(0)
    model = TinyGPT()
    data = lm_batches(count=4)
    data[-1] = (data[-1][0][:3], data[-1][1][:3])  # a short last mini-batch: sizes are not baked in
    before = copy.deepcopy(model.state_dict())
    expected, trained = plain_loop(model, data, SGDM, lm_loss, micro=2)
    pipe = pipeoptim.Pipeline(model, method=method, split_points=["layers.1", "layers.2"], loss_fn=lm_loss,
                              optimizer=SGDM, micro_batches=2)
    losses = run(pipe, data)  # traced on the first mini-batch
    assert pipe.split_points == ["layers.1", "layers.2"] and pipe.spec.partition == [3, 1, 3]
    assert losses == pytest.approx(expected, rel=1e-6)
    assert expected[-1] < expected[0] - 0.5  # it learns: the comparison is not of constants
    result = pipe.model()
    assert type(result) is TinyGPT and result.head.weight is result.embed.weight  # one tied tensor
    assert list(result.state_dict()) == list(model.state_dict())  # the user's names
    for (name, a), b in zip(result.state_dict().items(), trained.state_dict().values()):
        assert torch.allclose(a, b, atol=2e-6), name
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the caller's is untouched
    state = pipe.state_dict()
    assert set(state["model"]) == set(model.state_dict())


@pytest.mark.parametrize("method", ["1f1b-flush", "pipeoptim"])
def test_the_tied_weight_is_updated_once_by_its_owner(method):
    """Also with an asynchronous method (no longer refused): the other holder reads the owner's
    values per micro-batch (tests/test_tied_async.py)."""
    torch.manual_seed(0)
    pipe = pipeoptim.Pipeline(TinyGPT(layers=1), method=method, stages=2, loss_fn=lm_loss, optimizer=SGDM,
                              example_input=lm_batches(1)[0][0])
    tied = pipe.model().embed.weight
    holders = [s.index for s in pipe.stages if any(p is tied for p in s.module.parameters())]
    owners = [s.index for s in pipe.stages if any(p is tied for group in s.optimizer.param_groups
                                                  for p in group["params"])]
    assert holders == [0, 1] and owners == [0]
    assert all(p is not tied for p in pipe.stages[1].parameters())  # nor clipped, nor stashed there


#: the methods that place one stage per process (the chunked ones need an nn.Sequential for now)
ONE_CHUNK = [m for m in pipeoptim.method_names() if get_method(m).chunks == 1]


@pytest.mark.parametrize("method", ONE_CHUNK)
def test_every_method_trains_a_model_with_two_inputs_and_a_skip(method):
    torch.manual_seed(0)
    model, data = SkipNet(), skip_batches()
    micro = {"gpipe": 2, "1f1b-flush": 2, "pipedream-2bw": 3, "pipeoptim-2bw": 3}.get(method)
    points = None if method == "sequential" else ["blocks.0", "blocks.2"]
    pipe = pipeoptim.Pipeline(model, method=method, split_points=points, loss_fn=nn.functional.cross_entropy,
                              optimizer=SGDM, micro_batches=micro)
    losses = run(pipe, data)
    assert len(losses) == len(data) and all(math.isfinite(v) for v in losses)
    expected, _ = plain_loop(model, data, SGDM, nn.functional.cross_entropy, micro=micro or 1)
    if pipe.method.synchronous:
        assert losses == pytest.approx(expected, rel=1e-6)
    else:  # stale or predicted weights: the first mini-batch runs on the initial weights everywhere
        assert losses[0] == pytest.approx(expected[0], rel=1e-6) and losses != pytest.approx(expected, rel=1e-6)


def test_stages_n_chooses_points_among_the_candidates():
    torch.manual_seed(0)
    pipe = pipeoptim.Pipeline(TinyGPT(layers=4), method="1f1b-flush", stages=3, loss_fn=lm_loss, optimizer=SGDM,
                              example_input=lm_batches(1)[0][0], partitioner="uniform")
    # eight units (embed, position, four blocks, norm, head), seven with parameters of their own
    # (the head reads the embedding's): 3, 2, 2 of them, the head with the last
    assert pipe.spec.partition == [3, 2, 3] and pipe.split_points == ["layers.1", "layers.3"]
    (x, _), = skip_batches(1)
    timed = pipeoptim.Pipeline(SkipNet(), method="1f1b-flush", stages=2, loss_fn=nn.functional.cross_entropy,
                               optimizer=SGDM, example_input=x, partitioner="time")
    assert len(timed.split_points) == 1 and sum(timed.spec.partition) == 5  # inp, 3 blocks, out


def test_the_first_mini_batch_is_the_example():
    torch.manual_seed(0)
    data = lm_batches(2)
    pipe = pipeoptim.Pipeline(TinyGPT(layers=1), method="1f1b-flush", stages=2, loss_fn=lm_loss, optimizer=SGDM)
    assert not pipe.prepared and pipe.stages == []
    with pytest.raises(RuntimeError, match="example_input"):
        pipe.state_dict()
    result = pipe.fit(data)  # fit reads the first mini-batch ahead, torch's random state put back
    assert pipe.prepared and len(result.losses) == 2


# -- bad input: a ValueError naming the fix, before anything runs ------------------------------

class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.export cannot trace it
            x = -x
        return self.b(self.a(x))


def test_an_untraceable_forward_is_refused_naming_the_line():
    with pytest.raises(ValueError, match=r"(?s)Branchy\.forward.*x\.sum\(\) > 0.*nn\.Sequential"):
        pipeoptim.Pipeline(Branchy(), method="1f1b-flush", stages=2, loss_fn=nn.functional.cross_entropy,
                           optimizer=SGDM, example_input=torch.randn(4, 4))


def test_bad_split_points_are_refused_naming_the_candidates():
    (x, _), = skip_batches(1)

    def skipnet(**settings):
        return pipeoptim.Pipeline(SkipNet(), method="1f1b-flush", loss_fn=nn.functional.cross_entropy,
                                  optimizer=SGDM, example_input=x, **settings)
    with pytest.raises(ValueError, match=r"'blocks'.*in call order: blocks\.0, blocks\.1, blocks\.2, out$"):
        skipnet(split_points=["blocks"])  # a submodule, but no stage can begin at the ModuleList itself
    with pytest.raises(ValueError, match=r"not in the order.*\['blocks\.0', 'blocks\.2'\]"):
        skipnet(split_points=["blocks.2", "blocks.0"])
    with pytest.raises(ValueError, match=r"6 stages need 6 candidate points; SkipNet has 5 \(inp, blocks\.0, .*stages=5"):
        skipnet(stages=6)


def test_a_cut_that_needs_no_trace_to_be_wrong_is_refused_when_the_pipeline_is_built():
    """No example_input, so the model would be traced at the first mini-batch: a split point
    that names no submodule, or that disagrees with ``stages``, is refused by the constructor."""
    def skipnet(**settings):
        return pipeoptim.Pipeline(SkipNet(), method="1f1b-flush", loss_fn=nn.functional.cross_entropy,
                                  optimizer=SGDM, **settings)
    with pytest.raises(ValueError, match=r"split point 'blocks\.7' names no submodule of the model; "
                                         r"did you mean 'blocks\.2', 'blocks\.1', 'blocks\.0'\?"):
        skipnet(split_points=["blocks.7"])
    with pytest.raises(ValueError, match=r"names no submodule.*give qualified names from model\.named_modules"):
        skipnet(split_points=["decoder"])
    with pytest.raises(ValueError, match=r"stages=3 but 1 split points make 2 stages"):
        skipnet(split_points=["blocks.1"], stages=3)
    with pytest.raises(ValueError, match=r"give split_points= or partition=, not both"):
        skipnet(split_points=["blocks.1"], partition=[2, 3])
    pipe = skipnet(split_points=["blocks.1"])  # a right cut waits for the first mini-batch
    assert not pipe.prepared


@pytest.mark.parametrize("method", sorted(set(pipeoptim.method_names()) - set(ONE_CHUNK)))
def test_a_chunked_method_cuts_stages_x_pieces_and_refuses_a_cut_that_does_not_fit(method):
    """A chunked or mirrored method cuts a traced model into stages x its pieces per stage, each
    at a candidate point (SkipNet has 5: inp, blocks.0..2, out). Split points name every piece's
    start; too few of them, or too few candidate points, are refused naming the fix."""
    pieces = pipeoptim.get_method(method).pieces_per_rank(pipeoptim.get_method(method).chunks)

    def skipnet(**kw):
        return pipeoptim.Pipeline(SkipNet(), method=method, loss_fn=nn.functional.cross_entropy, optimizer=SGDM,
                                  example_input=skip_batches()[0][0], **kw)
    if pieces > 1:
        with pytest.raises(ValueError, match=rf"stages=3 x 2 chunks are 6 pieces, but 1 split points make 2; give 5 "
                                             rf"split points or stages=1"):
            skipnet(stages=3, split_points=["blocks.1"])
        with pytest.raises(ValueError, match=rf"{method} cuts stages x 2 chunks pieces; 2 split points make 3 pieces, "
                                             rf"not a multiple of 2: give 1 or 3 split points"):
            skipnet(split_points=["blocks.0", "blocks.1"])
    too_many = 5 // pieces + 1
    says = (f"{method} cuts 3 stages x 2 chunks = 6 pieces, each at a candidate point; SkipNet has 5" if pieces > 1
            else "6 stages need 6 candidate points; SkipNet has 5")
    with pytest.raises(ValueError, match=re.escape(f"{says} (inp, blocks.0, blocks.1, blocks.2, out): use "
                                                   f"stages={5 // pieces} or fewer")):
        skipnet(stages=too_many)
    points = ["blocks.0", "blocks.1", "blocks.2", "out"][4 - (2 * pieces - 1):]
    pipe = skipnet(split_points=points)
    assert (pipe.spec.ranks, pipe.split_points) == (2, points)


def test_a_tied_gpt_under_torchrun_equals_the_model_trained_sequentially(traced_under_torchrun):
    """Two processes, the embedding on rank 0 and the tied head on rank 1 (cut where rank 0's
    profile says, both ranks agreeing): the head's gradient joins the embedding's before rank 0's
    update, and rank 1 takes the updated weight."""
    rows = traced_under_torchrun["tied-gpt"]  # "1f1b-flush,1f1b-flush:0.5", split points "-"
    got, clipped = [r for r in rows if "losses" in r]
    points = [r["points"] for r in rows if "points" in r]
    assert len(points) == 4 and all(p == points[0] for p in points) and len(points[0]) == 1
    torch.manual_seed(0)
    expected, trained = plain_loop(TinyGPT(layers=2), lm_batches(count=4), SGDM, lm_loss, micro=2)
    assert got["losses"] == pytest.approx(expected, rel=1e-6) and got["tied"]
    for name, value in trained.state_dict().items():
        assert torch.allclose(torch.tensor(got["weights"][name]), value, atol=2e-6), name
    # the global norm counts the tied weight's summed gradient once, as in one process
    torch.manual_seed(0)
    pipe = pipeoptim.Pipeline(TinyGPT(layers=2), method="1f1b-flush", split_points=points[0], loss_fn=lm_loss,
                              optimizer=SGDM, micro_batches=2, clip_grad_norm=0.5, clip_scope="global")
    local = run(pipe, lm_batches(count=4))
    assert clipped["losses"] == pytest.approx(local, rel=1e-6) and local != pytest.approx(expected, rel=1e-3)


def test_several_tensors_cross_between_processes_with_equal_losses(traced_under_torchrun):
    """SkipNet split after its first block sends (hidden, skip, mask) across: every method's
    losses under torchrun equal the same Pipeline's in one process."""
    rows = traced_under_torchrun["skip"]  # 1f1b-flush, pipedream, pipeoptim, split at blocks.1
    assert [got["method"] for got in rows] == ["1f1b-flush", "pipedream", "pipeoptim"]
    for got in rows:
        torch.manual_seed(0)
        pipe = pipeoptim.Pipeline(SkipNet(), method=got["method"], split_points=["blocks.1"], loss_fn=nn.functional.cross_entropy,
                                  optimizer=SGDM, micro_batches=2 if got["method"] == "1f1b-flush" else None)
        assert got["losses"] == pytest.approx(run(pipe, skip_batches()), rel=1e-6), got["method"]


def test_state_dict_of_a_traced_model_loads_into_another_split():
    """The state is keyed by the model's own names: taken from one split, it loads into another,
    and training goes on as if the split had never changed (a synchronous method: exactly)."""
    torch.manual_seed(0)
    model, data = TinyGPT(layers=2), lm_batches(count=4)
    settings = dict(method="1f1b-flush", loss_fn=lm_loss, micro_batches=2, example_input=data[0][0],
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    whole = pipeoptim.Pipeline(model, split_points=["layers.1"], **settings)
    expected = run(whole, data)
    first = pipeoptim.Pipeline(model, split_points=["layers.1"], **settings)
    run(first, data[:2])
    state = first.state_dict()
    assert {"embed.weight", "head.weight", "layers.0.attn.qkv.weight"} <= set(state["model"])
    second = pipeoptim.Pipeline(model, split_points=["layers.0", "norm"], **settings)
    second.load_state_dict(state)
    assert second.losses == expected[:2]
    assert run(second, data[2:]) == pytest.approx(expected[2:], rel=1e-6)


def test_evaluate_runs_a_traced_model_in_eval_mode():
    """A traced graph keeps its mode: evaluate() runs the eval-mode trace (batch norm's running
    statistics, no dropout), which leaves the statistics as they were."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(6, 1, 5, 5, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(3)]
    pipe = pipeoptim.Pipeline(SmallCNN(), method="gpipe", split_points=["body.0"], micro_batches=2,
                              loss_fn=nn.functional.cross_entropy, optimizer=SGDM)
    run(pipe, data)
    stats = {k: v.clone() for k, v in pipe.model().state_dict().items() if "running" in k}
    value = pipe.evaluate(data)
    model = copy.deepcopy(pipe.model()).eval()
    with torch.no_grad():
        expected = sum(float(nn.functional.cross_entropy(model(x), y)) * len(y) for x, y in data) / 18
    assert value == pytest.approx(expected, rel=1e-6)
    assert all(torch.equal(pipe.model().state_dict()[k], v) for k, v in stats.items())
    pipe.model().eval()  # forward() follows the model's mode
    assert torch.allclose(pipe.forward(data[0][0]), model(data[0][0]), atol=1e-6)
    pipe.model().train()
    assert len(run(pipe, data)) == 3  # back to training, on the training graph


@pytest.mark.parametrize("method,micro", [("1f1b-flush", 2), ("pipeoptim", 1)])
def test_a_tied_traced_model_resumes_from_its_checkpoint_to_the_same_losses(tmp_path, method, micro):
    """Checkpoints drain the pipeline, so nothing of the tie is in flight there (with an
    asynchronous method too): a resumed run gives the uninterrupted run's losses."""
    data = lm_batches(count=4)

    def fit(folder, **kwargs):
        torch.manual_seed(0)
        pipe = pipeoptim.Pipeline(TinyGPT(layers=1), method=method, split_points=["layers.0"], loss_fn=lm_loss,
                                  micro_batches=micro, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
        return pipe.fit(data, epochs=2, checkpoint_dir=folder, checkpoint_every=3, **kwargs)

    expected = fit(tmp_path / "full").losses

    with pytest.raises(Crash):
        fit(tmp_path / "cut", on_batch=crash_at(6))
    assert fit(tmp_path / "cut", resume=True).losses == expected


@pytest.mark.parametrize("method", ["1f1b-flush", "pipeoptim"])
def test_a_traced_model_and_its_nn_sequential_form_train_alike(method):
    """The untied GPT traced and cut at ``layers.1``, and its layers as an ``nn.Sequential`` cut at
    the same place: the same stages, so the same losses and trained weights, with a synchronous
    method and an asynchronous one."""
    data = lm_batches(count=4)

    def train(form):
        torch.manual_seed(0)
        gpt = TinyGPT(layers=2, tied=False)
        model, cut = (gpt, {"split_points": ["layers.1"]}) if form == "traced" else \
            (as_sequential(gpt), {"partition": [2, 3]})  # Embed, block 0 | block 1, norm, head
        pipe = pipeoptim.Pipeline(model, method=method, loss_fn=lm_loss,
                                  optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), **cut)
        return pipe.fit(data, epochs=2).losses, [p.detach().clone() for p in pipe.model().parameters()]

    (traced, traced_weights), (sequential, sequential_weights) = train("traced"), train("sequential")
    assert len(traced) == 8 and traced == pytest.approx(sequential, rel=1e-5)
    assert len(traced_weights) == len(sequential_weights)
    for a, b in zip(traced_weights, sequential_weights):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_candidate_points_reach_blocks_inside_a_wrapper():
    """A library's model wraps its blocks (``transformer.h.0``); the candidates go inside a child
    that holds a container, and not inside the blocks themselves."""
    from pipeoptim.graph_split import candidate_names

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = TinyGPT(layers=2)

    assert candidate_names(TinyGPT(layers=2)) == ["embed", "position", "layers.0", "layers.1", "norm", "head"]
    assert candidate_names(Wrapper()) == ["m.embed", "m.position", "m.layers.0", "m.layers.1", "m.norm", "m.head"]
    assert candidate_names(SmallCNN()) == ["stem.0", "stem.1", "stem.2", "body.0", "body.1", "body.2", "drop", "fc"]


def test_inputs_that_are_not_tensors_are_refused():
    with pytest.raises(ValueError, match=r"a tensor, a tuple of tensors.*or a dict of tensors.*got \(list\)"):
        pipeoptim.Pipeline(SkipNet(), method="1f1b-flush", stages=2, loss_fn=nn.functional.cross_entropy,
                           optimizer=SGDM, example_input=[torch.randn(4, 8)])


def test_split_points_names_where_an_nn_sequentials_stages_begin():
    """``pipe.split_points`` of an nn.Sequential: its children's names where stages 2.. begin (its
    layer indices, or the names an OrderedDict gave), a chunked method's every piece, a mirrored
    method's first pipeline, none for one stage; the same form as a traced model's."""
    from collections import OrderedDict

    layers = [nn.Linear(4, 4) for _ in range(6)]
    cut = lambda **kw: pipeoptim.Pipeline(nn.Sequential(*layers), optimizer=SGDM,  # noqa: E731
                                          loss_fn=nn.functional.mse_loss, **kw).split_points
    assert cut(stages=2, partition=[2, 4]) == ["2"]
    assert cut(stages=3) == ["2", "4"]
    assert cut(method="interleaved", stages=2, chunks=3) == ["1", "2", "3", "4", "5"]
    assert cut(method="bidirectional", stages=2, partition=[1, 5]) == ["1"]
    assert cut(method="sequential") == []
    named = nn.Sequential(OrderedDict((f"block{k}", layer) for k, layer in enumerate(layers)))
    assert pipeoptim.Pipeline(named, optimizer=SGDM, loss_fn=nn.functional.mse_loss, stages=2).split_points == ["block3"]

def test_an_nn_sequential_can_be_cut_by_profiled_time_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8), nn.Linear(8, 3))
    data = [(torch.randn(6, 8), torch.randint(0, 3, (6,))) for _ in range(2)]
    pipe = pipeoptim.Pipeline(model, method="1f1b-flush", stages=2, partitioner="time", micro_batches=2,
                              loss_fn=nn.functional.cross_entropy, optimizer=SGDM)
    assert not pipe.prepared  # the profile needs an input: the first mini-batch
    losses = run(pipe, data)
    assert sum(pipe.spec.partition) == 6 and len(pipe.spec.partition) == 2
    assert pipe.split_points == [str(pipe.spec.partition[0])]  # the layer the profile's second stage begins at
    assert losses == pytest.approx(plain_loop(model, data, SGDM, nn.functional.cross_entropy, micro=2)[0], rel=1e-6)
