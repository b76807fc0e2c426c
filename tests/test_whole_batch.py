"""Every token weighed once (issue 60): a synchronous pipeline equals the step on the whole
mini-batch, ``model(**batch).loss``, when its micro-batches hold different numbers of real tokens
(padded rows, labels -100), and evaluation of a model that computes its own loss
(tests/test_seq2seq.py: the encoder-decoders).

The references are tests/first_day.py's ``whole_batch_loop`` with plain SGD (its weights follow
the gradients linearly, so a rounding stays a rounding). Under torchrun with replicas the same
holds across replicas whose mini-batches hold different numbers of tokens:
tests/torchrun_first_day.py's padded entries, checked in tests/test_first_day.py."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

import pipeoptim
from first_day import (fed, model, padded_batches, plain_loop, sgd,
                       whole_batch_loop)


def close_weights(a: torch.nn.Module, b: torch.nn.Module, rel: float = 1e-5, atol: float = 1e-4) -> bool:
    """Every entry close. atol: SGD at lr 0.5 carries a rounding of the model's own between a
    whole batch and its halves (Qwen2's attention over padded rows: 6e-6 after 3 steps without
    any pipeline) into the weights; weighing the micro-batch means instead moves them by 7e-2."""
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.allclose(sa[k], sb[k], rtol=rel, atol=atol) for k in sa)


@pytest.mark.parametrize("family,method,micro", [("gpt2", "zb-h1", 2), ("llama", "1f1b-flush", 2),
                                                 ("qwen2", "gpipe", 4)])  # (encoder-decoders: test_seq2seq.py)
def test_padded_tokens_weigh_as_in_the_whole_mini_batch(family, method, micro):
    """The default loss_normalization ('items'): each micro-batch's mean by its share of the
    mini-batch's real tokens; the losses and weights are the whole mini-batch's step's. With
    M = 4 one causal micro-batch holds no real token (padded_batches): it weighs nothing."""
    net, data = model(family), padded_batches(family)
    expected, trained = whole_batch_loop(net, data)
    pipe = pipeoptim.Pipeline(net, method=method, optimizer=sgd, stages=2, micro_batches=micro)
    assert fed(pipe, data) == pytest.approx(expected, rel=1e-5)
    assert close_weights(pipe.model(), trained)


def test_rows_weighs_the_micro_batch_means_as_before():
    """loss_normalization='rows' is gradient accumulation of the micro-batch means (the plain loop
    that divides each micro-batch's loss by M), which the whole batch's step is not here."""
    net, data = model("gpt2"), padded_batches("gpt2")
    accumulated, trained = plain_loop(net, data, micro=2)
    whole, _ = whole_batch_loop(net, data)
    pipe = pipeoptim.Pipeline(net, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), stages=2,
                              loss_normalization="rows")
    losses = fed(pipe, data)
    assert losses == pytest.approx(accumulated, rel=1e-5)
    assert abs(losses[0] - whole[0]) > 1e-3  # the two weighings differ on these batches


def _lm_case():
    """A tiny LM as an nn.Sequential with a loss_fn that ignores -100, fed (ids, target) pairs whose
    targets are padded unequally (the first row of every mini-batch holds 7 real tokens, the last 1)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                              torch.nn.Linear(8, 16))
    g = torch.Generator().manual_seed(5)
    data = []
    for _ in range(3):
        ids = torch.randint(0, 16, (4, 8), generator=g)
        target = torch.randint(0, 16, (4, 8), generator=g)
        for row, n in enumerate((7, 5, 3, 1)):
            target[row, n:] = -100
        data.append((ids, target))
    return net, data


def _token_mean(output, target):
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def _whole(net, data, loss=_token_mean):
    net = copy.deepcopy(net)
    opt = sgd(net.parameters())
    losses = []
    for x, y in data:
        value = loss(net(x), y)
        value.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(value))
    return losses, net


def test_a_loss_fn_is_weighed_by_its_targets_real_items_or_by_a_count_it_gives():
    """A loss_fn's target counts its entries other than -100 by default; loss_normalization=fn
    counts another way (here: a loss that ignores 0, and counts so)."""
    net, data = _lm_case()
    expected, trained = _whole(net, data)
    pipe = pipeoptim.Pipeline(net, method="1f1b-flush", loss_fn=_token_mean, optimizer=sgd, stages=2,
                              micro_batches=2)
    assert fed_pairs(pipe, data) == pytest.approx(expected, rel=1e-5)
    assert close_weights(pipe.model(), trained)

    # the same targets with the padding as 0 and the classes from 1: a loss that ignores 0
    shifted = [(x, torch.where(y < 0, torch.zeros_like(y), y + 1)) for x, y in data]

    def ignore_zero(output, target):
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1) - 1, ignore_index=-1)

    net2 = copy.deepcopy(net)
    expected, trained = _whole(net2, shifted, loss=ignore_zero)
    pipe = pipeoptim.Pipeline(net2, method="gpipe", loss_fn=ignore_zero, optimizer=sgd, stages=2,
                              micro_batches=2, loss_normalization=lambda target: int(target.ne(0).sum()))
    assert fed_pairs(pipe, shifted) == pytest.approx(expected, rel=1e-5)
    assert close_weights(pipe.model(), trained)


def fed_pairs(pipe, data):
    return [loss for x, y in data for loss in pipe.step(x, y)] + pipe.flush()


def test_an_unknown_normalization_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="loss_normalization must be one of 'items', 'rows'"):
        pipeoptim.Pipeline(model("gpt2"), optimizer=sgd, stages=2, loss_normalization="tokens")


def test_asynchronous_methods_weigh_tokens_per_mini_batch():
    """pipeoptim-2bw (M = 4 micro-batches per update) runs its first mini-batch on the initial
    weights: its loss is the whole first mini-batch's, every token weighed once."""
    net, data = model("llama"), padded_batches("llama")
    expected, _ = whole_batch_loop(net, data[:1])
    pipe = pipeoptim.Pipeline(net, method="pipeoptim-2bw", optimizer=sgd, stages=2, micro_batches=4)
    assert fed(pipe, data)[0] == pytest.approx(expected[0], rel=1e-5)


def _token_weighted_loss(net, data) -> float:
    """The whole model's loss over ``data`` in eval mode, each batch weighed by its real items."""
    net.eval()
    with torch.no_grad():
        items = [int(b["labels"][..., 1:].ne(-100).sum()) if type(net).__name__.endswith("CausalLM") or
                 type(net).__name__ == "GPT2LMHeadModel" else int(b["labels"].ne(-100).sum()) for b in data]
        value = sum(float(net(**b).loss) * n for b, n in zip(data, items)) / sum(items)
    net.train()
    return value


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_evaluate_runs_a_model_that_computes_its_own_loss_with_its_labels(family):
    """Before the first step (the model is split on the evaluation's first batch), after training
    (equal to the trained whole model's), and by fit(eval_loader=..., eval_every=...): the mean of
    the model's loss over every real token."""
    net, data = model(family), padded_batches(family)
    pipe = pipeoptim.Pipeline(net, optimizer=sgd, stages=2, method="1f1b-flush")
    assert not pipe.prepared
    assert pipe.evaluate(data) == pytest.approx(_token_weighted_loss(net, data), rel=1e-6)
    result = pipe.fit(data, eval_loader=data[:2], eval_every=2)
    trained = pipe.model()
    assert pipe.evaluate(data) == pytest.approx(_token_weighted_loss(trained, data), rel=1e-6)
    evaluations = {e["batch"]: e["metric"] for e in result.metrics["evaluations"]}
    _, after_two = whole_batch_loop(net, data[:2])
    assert evaluations[2] == pytest.approx(_token_weighted_loss(after_two, data[:2]), rel=1e-5)
    assert evaluations[3] == pytest.approx(_token_weighted_loss(trained, data[:2]), rel=1e-6)


def test_evaluation_in_the_bubbles_of_a_model_that_computes_its_own_loss():
    """evaluate_in_bubbles gives what evaluate gives, to the bit."""
    net, data = model("gpt2"), padded_batches("gpt2")
    pipe = pipeoptim.Pipeline(net, optimizer=sgd, stages=2, method="1f1b-flush")
    drained = pipe.evaluate(data)
    got = []
    pipe.evaluate_in_bubbles(data, on_done=got.append)
    fed(pipe, data[:1])
    assert got == [drained]


def test_a_forward_of_inputs_alone_names_evaluate():
    pipe = pipeoptim.Pipeline(model("gpt2"), optimizer=sgd, stages=2)
    fed(pipe, padded_batches("gpt2", count=1))
    with pytest.raises(ValueError, match=r"evaluate\(loader\) runs it on dict batches"):
        pipe.forward({"input_ids": torch.ones(2, 4, dtype=torch.long)})


def test_a_causal_lm_counts_its_labels_after_the_shift():
    """The count a causal LM's loss divides by drops each row's first label (transformers'
    ForCausalLMLoss predicts label t from the tokens before it); an encoder-decoder's does not."""
    from pipeoptim.batches import item_counter

    labels = torch.tensor([[5, 6, -100], [7, -100, -100]])
    assert item_counter("items", model("gpt2"), own_loss=True)(labels) == 1
    assert item_counter("items", model("t5"), own_loss=True)(labels) == 3
    assert item_counter("items", model("gpt2"), own_loss=False)(labels) == 3  # a loss_fn's target
    assert item_counter("rows") is None
