"""Batches as model libraries give them (issue 35, item 8): a dict of keyword tensors
(``input_ids``, ``attention_mask``, ``labels``) passed as ``model(**batch)``, a ``ModelOutput``
returned, and with no ``loss_fn`` the model's own ``output.loss``. GPT-2 and Llama from
``transformers`` (tiny configs, tests/library_models.py) under ``1f1b-flush`` with two stages
equal their plain loop, ``model(**batch).loss.backward()`` with gradient accumulation over the
same micro-batches, in one process and under torchrun (tests/torchrun_dict_batches.py); the
labels reach only the last stage, as a target does."""
from __future__ import annotations

import copy
from typing import Dict, List, Tuple

import pytest
import torch
from torch import nn

import pipeoptim
from library_models import case, lm_batches, lm_loss
from pipeoptim.runtime.microbatch import split_batch

SGDM = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
Batch = Dict[str, torch.Tensor]


def dict_batches(count: int = 3) -> List[Batch]:
    """Seeded token mini-batches as a library's collator gives them: the ids, an attention mask
    with some padding on the left of two rows (so the mask matters), and labels (the ids: the
    model shifts them itself)."""
    batches = []
    for ids, _ in lm_batches(count=count):
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        mask[3, :1] = 0
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.clone()})
    return batches


def micro_pieces(batch: Batch, micro: int) -> List[Batch]:
    """``batch`` cut into ``micro`` micro-batches along dim 0, every tensor alike."""
    cut = {k: torch.tensor_split(v, micro) for k, v in batch.items()}
    return [{k: pieces[j] for k, pieces in cut.items()} for j in range(micro)]


def plain_dict_loop(model: nn.Module, data: List[Batch], micro: int, loss_fn=None) -> Tuple[List[float], nn.Module]:
    """The untouched model trained by ``model(**batch).loss.backward()`` (or with ``loss_fn``:
    ``loss_fn(model(**rest), labels)``), accumulating over ``micro`` micro-batches, each loss
    scaled by its share of the mini-batch; SGD with momentum."""
    model = copy.deepcopy(model)
    opt = SGDM(model.parameters())
    losses = []
    for batch in data:
        total = 0.0
        for piece in micro_pieces(batch, micro):
            share = piece["input_ids"].shape[0] / batch["input_ids"].shape[0]
            if loss_fn is None:
                loss = model(**piece).loss * share
            else:
                rest = {k: v for k, v in piece.items() if k != "labels"}
                loss = loss_fn(model(**rest), piece["labels"]) * share
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model


def assert_same_weights(result: nn.Module, trained: nn.Module) -> None:
    assert list(result.state_dict()) == list(trained.state_dict())
    for (name, a), b in zip(result.state_dict().items(), trained.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name


def pipeline(model: nn.Module, **options) -> pipeoptim.Pipeline:
    return pipeoptim.Pipeline(model, method="1f1b-flush", stages=2, partitioner="uniform", optimizer=SGDM,
                              micro_batches=2, **options)


def first_stage_keys(pipe: pipeoptim.Pipeline) -> List[str]:
    """The keyword inputs the first stage module reads from its dict."""
    graph = pipe.stages[0].module.graph
    return [n.args[1] for n in graph.nodes if n.op == "call_function" and n.target.__name__ == "_item"]


@pytest.mark.parametrize("family, drive", [("gpt2", "step"), ("llama", "step"), ("gpt2", "fit")])
def test_a_library_lm_from_dict_batches_with_no_loss_fn_equals_its_plain_loop(family, drive):
    model = case(family)[0]
    data = dict_batches()
    expected, trained = plain_dict_loop(model, data, micro=2)
    pipe = pipeline(model)  # no loss_fn: the model's own loss
    if drive == "step":
        losses = [loss for batch in data for loss in pipe.step(batch)] + pipe.flush()
    else:
        losses = pipe.fit(data).losses
    assert len(pipe.split_points) == 1
    assert losses == pytest.approx(expected, rel=1e-6)
    assert expected[-1] != pytest.approx(expected[0], rel=1e-3)  # it trains: not constants
    # the labels travel as a target does: only the last stage takes them, into its module
    assert sorted(first_stage_keys(pipe)) == ["attention_mask", "input_ids"]
    assert [s.takes_target for s in pipe.stages] == [False, True]
    initial = model.state_dict()
    assert not all(torch.equal(v, initial[k]) for k, v in trained.state_dict().items())
    assert_same_weights(pipe.model(), trained)


def test_a_loss_fn_receives_the_model_output_from_a_dict_batch():
    """With a loss_fn, a dict batch's labels are its target (not passed to the model), and the
    loss_fn gets the ModelOutput as the model returns it."""
    model = case("gpt2")[0]
    data = [{**batch, "labels": torch.roll(batch["input_ids"], -1, dims=1)} for batch in dict_batches()]
    seen = []

    def loss_fn(output, target):
        seen.append((type(output).__name__, output.loss))
        return lm_loss(output, target)

    expected, trained = plain_dict_loop(model, data, micro=2, loss_fn=lm_loss)
    pipe = pipeline(model, loss_fn=loss_fn)
    losses = [loss for batch in data for loss in pipe.step(batch)] + pipe.flush()
    assert losses == pytest.approx(expected, rel=1e-6)
    assert seen and all(kind == "CausalLMOutputWithCrossAttentions" and loss is None for kind, loss in seen)
    assert_same_weights(pipe.model(), trained)
    # the same, given as (inputs, target) pairs whose inputs are the keyword dict
    pairs = [({k: v for k, v in b.items() if k != "labels"}, b["labels"]) for b in data]
    again = pipeline(model, loss_fn=lm_loss)
    assert again.fit(pairs).losses == pytest.approx(expected, rel=1e-6)


def test_a_dict_mini_batch_is_split_along_dim_0_in_every_tensor():
    batch = {"input_ids": torch.arange(10).reshape(5, 2), "attention_mask": torch.ones(5, 2)}
    pieces = split_batch(batch, torch.arange(5), 2)
    assert [list(p["input_ids"][:, 0]) for p, _, _ in pieces] == [[0, 2, 4], [6, 8]]
    assert [p["attention_mask"].shape[0] for p, _, _ in pieces] == [3, 2]
    assert [share for _, _, share in pieces] == pytest.approx([0.6, 0.4], rel=1e-12)


def test_the_forms_that_cannot_work_are_refused_with_the_fix():
    model = case("gpt2")[0]
    batch = dict_batches(1)[0]
    unlabelled = {k: v for k, v in batch.items() if k != "labels"}
    pipe = pipeline(model)
    with pytest.raises(ValueError, match=r"has no 'labels'.*add the labels as batch\['labels'\].*loss_fn="):
        pipe.step(unlabelled)
    with pytest.raises(ValueError, match=r"no loss_fn.*dict of its keyword tensors with 'labels'"):
        pipe.step(batch["input_ids"], batch["labels"])
    with pytest.raises(ValueError, match=r"an nn.Sequential returns no loss of its own.*loss_fn="):
        pipeoptim.Pipeline(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), method="1f1b-flush", stages=2,
                           optimizer=SGDM)
    pipe.step(batch)
    pipe.flush()
    with pytest.raises(ValueError, match=r"keys \['input_ids', 'labels'\].*same keys"):
        pipe.step({"input_ids": batch["input_ids"], "labels": batch["labels"]})
    with pytest.raises(ValueError, match=r"forward runs the stages on inputs alone.*evaluate\(loader\)"):
        pipe.forward({k: v for k, v in batch.items() if k != "labels"})
    assert pipe.evaluate([batch]) > 0  # a model computing its own loss evaluates with its labels (issue 60)


class NoLoss(nn.Module):
    """A model that takes labels and returns a dict with no loss in it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(24, 8), nn.Linear(8, 24)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"logits": self.head(self.embed(input_ids)) + 0 * labels.unsqueeze(-1)}


def test_a_model_that_returns_no_loss_is_refused_before_training():
    ids = torch.randint(0, 24, (4, 8), generator=torch.Generator().manual_seed(0))
    pipe = pipeline(NoLoss())
    with pytest.raises(ValueError, match=r"the model returned no loss.*give loss_fn="):
        pipe.step({"input_ids": ids, "labels": ids})
    assert not pipe.prepared and pipe.losses == []


#: the entries of the torchrun test: FAMILY:DRIVE[:METHOD] (step/flush by hand, or fit; 1f1b-flush,
#: or a method with several pieces per process: the tie between processes, or inside one for a V)
UNDER_TORCHRUN = ["gpt2:step", "llama:step", "llama:fit", "gpt2:step:interleaved", "gpt2:step:zb-v",
                  "gpt2:step:dualpipev", "gpt2:step:bidirectional", "gpt2:step:bitpipe", "llama:step:bitpipe"]

#: which stages take the labels (the last of each pipeline), by method
LAST_STAGES = {"1f1b-flush": [False, True], "bidirectional": [False, True, False, True],
               "bitpipe": [False, False, False, True] * 2}


def test_dict_batches_under_torchrun_equal_the_plain_loop(torchrun_2):
    """Two processes, one stage each under 1f1b-flush, several under the chunked and mirrored
    methods (issue 62: GPT-2's tie between processes, or inside one in a V; each mirrored
    pipeline's tie summed before the replicas): the labels only on each pipeline's last stage.
    Losses and the gathered trained weights equal the plain loop's. (tests/torchrun_dict_batches.py,
    the "dict" script of tests/conftest.py's 2-process job.)"""
    rows = {row["entry"]: row for row in torchrun_2.rows("dict")}
    assert list(rows) == UNDER_TORCHRUN
    for entry, row in rows.items():
        family, _, *method = entry.split(":")
        expected, trained = plain_dict_loop(case(family)[0], dict_batches(), micro=2)
        assert row["losses"] == pytest.approx(expected, rel=1e-6), entry
        method = method[0] if method else "1f1b-flush"
        assert row["takes_target"] == LAST_STAGES.get(method, [False, False, False, True]), entry
        result = case(family)[0]
        result.load_state_dict(torch.load(torchrun_2.folder / "dict" / f"{entry.replace(':', '-')}.pt"))
        assert_same_weights(result, trained)
