"""Bring any model (issue 25): models of a well-known library (``transformers``, a test
dependency that ``make setup`` installs), built from tiny configs with random weights, given to
the Pipeline as they are (docs/architecture.md, "Splitting any module"). A decoder-only LM with
its head tied to its embedding (GPT-2, Llama) and a convolutional classifier (ResNet) under
``1f1b-flush`` equal their plain sequential training, losses and trained weights; ``pipeoptim``
trains them (its first mini-batch runs on the initial weights, as sequential's). More families of
each kind split and take a step exactly as the whole model does: nothing in the split knows a
family. Under torchrun with two processes (the one torchrun job of the library models, run by
tests/test_first_day.py's test_under_torchrun_every_model_equals_one_process): ResNet under
1f1b-flush equals its sequential training, and GPT-2, its tied head on the other process than its
embedding, under the default synchronous method equals its plain loop and under ``pipeoptim``
equals the same feeds in one process."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import pytest
import torch

import pipeoptim
from library_models import IMAGE_MODELS, LANGUAGE_MODELS, case
from test_traced import plain_loop

HERE = Path(__file__).resolve().parent
SGDM = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731


def micro_batches(method: str) -> Optional[int]:
    """Two micro-batches for the synchronous pipelines (so that they accumulate), the method's
    own count otherwise."""
    return 2 if method in ("gpipe", "1f1b-flush") else None


def pipeline(family: str, method: str, stages: int):
    model, loss_fn, data = case(family)
    pipe = pipeoptim.Pipeline(model, method=method, stages=stages, partitioner="uniform", loss_fn=loss_fn,
                              optimizer=SGDM, micro_batches=micro_batches(method))
    losses = [loss for x, y in data for loss in pipe.step(x, y)] + pipe.flush()
    return pipe, losses


def sequential(family: str, micro: int):
    """The untouched model trained with gradient accumulation: (losses, trained model)."""
    model, loss_fn, data = case(family)
    return plain_loop(model, data, SGDM, loss_fn, micro=micro)


def assert_same_weights(result: torch.nn.Module, trained: torch.nn.Module) -> None:
    assert list(result.state_dict()) == list(trained.state_dict())  # the library's names
    for (name, a), b in zip(result.state_dict().items(), trained.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), atol=1e-5), name  # batch norm's statistics included


@pytest.mark.parametrize("family", ["gpt2", "llama", "resnet"])
def test_a_library_model_under_1f1b_flush_equals_its_sequential_training(family):
    expected, trained = sequential(family, micro=2)
    pipe, losses = pipeline(family, "1f1b-flush", stages=3)
    assert len(pipe.split_points) == 2
    assert losses == pytest.approx(expected, rel=1e-5)
    initial = case(family)[0].state_dict()  # it trains: the comparison is not of constants
    assert not all(torch.equal(v, initial[k]) for k, v in trained.state_dict().items())
    result = pipe.model()
    assert type(result) is type(trained)
    if family != "resnet":  # GPT-2 and Llama tie the head to the embedding: still one tensor
        assert result.get_output_embeddings().weight is result.get_input_embeddings().weight
    assert_same_weights(result, trained)


@pytest.mark.parametrize("family", ["gpt2", "gpt2-untied", "resnet"])
def test_pipeoptim_trains_a_library_model(family):
    """Asynchronous, so not equal to sequential after the first mini-batch, which runs on the
    initial weights everywhere. GPT-2's tied head reads the embedding's owner's version
    (docs/architecture.md, "Tied weights with the asynchronous methods") and stays one tensor."""
    expected, _ = sequential(family, micro=1)
    pipe, losses = pipeline(family, "pipeoptim", stages=3)
    assert len(losses) == len(expected) and all(math.isfinite(v) for v in losses)
    assert losses[0] == pytest.approx(expected[0], rel=1e-5) and losses != pytest.approx(expected, rel=1e-5)
    if family == "gpt2":
        result = pipe.model()
        assert result.get_output_embeddings().weight is result.get_input_embeddings().weight


#: the methods that hold several model pieces per process (chunks, or two mirrored pipelines)
CHUNKED = ["interleaved", "zb-v", "dualpipev", "bidirectional", "bitpipe"]


@pytest.mark.parametrize("family, method", [("gpt2", m) for m in CHUNKED] + [("llama", "zb-v"), ("llama", "bitpipe")])
def test_chunked_methods_on_a_library_model_equal_its_sequential_training(family, method):
    """Issue 62: a traced model (the head tied to the embedding, as both configs set it) cut into
    2 stages x the method's pieces per stage, each piece at a candidate point; a mirrored
    method's second pipeline copies the pieces, its own tie between the copies. The losses are
    the plain loop's to the bit, the trained weights its own, the tie one tensor. (Llama: a V's
    tie inside one process, zb-v; and a mirrored one, bitpipe.)"""
    model, loss_fn, data = case(family)
    pipe = pipeoptim.Pipeline(model, method=method, stages=2, partitioner="uniform", loss_fn=loss_fn,
                              optimizer=SGDM, micro_batches=2)
    losses = [loss for x, y in data for loss in pipe.step(x, y)] + pipe.flush()
    pieces = 8 if method == "bitpipe" else 4
    assert len(pipe.stages) == pieces and len(pipe.split_points) == (3 if method != "bidirectional" else 1)
    expected, trained = sequential(family, micro=2)
    assert losses == expected
    result = pipe.model()
    assert result.get_output_embeddings().weight is result.get_input_embeddings().weight
    assert_same_weights(result, trained)


#: tests/torchrun_chunked_replicas.py's entries in the 4-process job: zb-v's tie inside each process,
#: each stage sharded (its own copy of the tie, summed with the other's there); interleaved's between
#: processes, the replicas averaged first
CHUNKED_REPLICAS = ["zb-v:sharded", "interleaved"]


def test_chunked_methods_with_replicas_equal_one_replica_on_the_concatenated_shards(torchrun_4):
    """A traced GPT tied as GPT-2 is (tests/traced_models.py's: GPT-2's import in 4 more processes
    would cost more than the training) on 2 stages x 2 replicas (4 processes): each tie summed
    over its holders once every stage's gradients are averaged over its replicas, the same losses
    and weights as one process on the replicas' micro-batches side by side (float sums in another
    order). Before the fix interleaved's losses left one process's after the first update."""
    from torchrun_jobs import run_here

    rows = torchrun_4.rows("chunked-replicas")
    assert [row["entry"] for row in rows] == CHUNKED_REPLICAS
    for row in rows:
        expected = json.loads(run_here(HERE / "torchrun_chunked_replicas.py", row["entry"].split(":")[0]))
        assert row["replicas"] == 2 and expected["replicas"] == 1 and row["tied"]
        assert row["losses"] == pytest.approx(expected["losses"], rel=1e-6), row["entry"]
        assert row["stepped"] == row["losses"], row["entry"]  # step() on the last stage's rank too
        for name, value in row["weights"].items():
            torch.testing.assert_close(torch.tensor(value), torch.tensor(expected["weights"][name]), rtol=1e-5,
                                       atol=1e-6, msg=f"{row['entry']}: {name}")


def test_a_chunked_method_refuses_a_model_with_too_few_candidate_points():
    """Two stages x 2 chunks are four pieces, each beginning at a candidate point: a traced model
    with fewer is refused before any work, naming how many stages it can hold."""
    model, loss_fn, data = case("gpt2")
    units = len(pipeoptim.graph_split.trace(model, data[0][0]).candidates)
    pipe = pipeoptim.Pipeline(model, method="interleaved", stages=units, loss_fn=loss_fn, optimizer=SGDM)
    with pytest.raises(ValueError, match=rf"interleaved cuts {units} stages x 2 chunks = {2 * units} pieces.*"
                                         rf"use stages={units // 2} or fewer"):
        pipe.step(*data[0])


OTHER_FAMILIES = sorted(set(LANGUAGE_MODELS) - {"gpt2", "llama"}) + sorted(set(IMAGE_MODELS) - {"resnet"})


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_other_families_split_and_step_as_the_whole_model(family):
    """Traced, cut into three stages, one mini-batch of two micro-batches: the loss and the
    updated weights are the whole model's."""
    model, loss_fn, data = case(family)
    expected, trained = plain_loop(model, data[:1], SGDM, loss_fn, micro=2)
    pipe = pipeoptim.Pipeline(model, method="1f1b-flush", stages=3, partitioner="uniform", loss_fn=loss_fn,
                              optimizer=SGDM, micro_batches=2)
    losses = pipe.step(*data[0]) + pipe.flush()
    assert len(pipe.split_points) == 2 and losses == pytest.approx(expected, rel=1e-5)
    assert_same_weights(pipe.model(), trained)
