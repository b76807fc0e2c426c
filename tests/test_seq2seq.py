"""Encoder-decoders as they come (issue 60): transformers' T5 and BART fed
``{input_ids, attention_mask, labels}`` with padded rows (tests/first_day.py's ``padded_batches``),
no ``decoder_input_ids`` and no loss_fn: the model shifts the labels into its decoder's input in
the first stage and computes its loss from them in the last, so the labels reach both.

The matrix (feature -> test): any cut (between the stacks, inside the encoder, inside the decoder)
under 1f1b-flush; the default method (zb-h1, whose split backward meets T5's position bias read by
every decoder block) with a checkpoint that T5's and BART's classes load strictly, and
save_pretrained; bf16 and fp16; each asynchronous weight family trains; evaluation through the pipeline;
torchrun (tests/test_first_day.py's job: T5 under zb-h1, BART under pipeoptim). The references are
``whole_batch_loop`` (the step on each whole mini-batch) with SGD; AdamW magnifies a gradient that
is all rounding (an entry of T5's feed-forward) past any tolerance."""
from __future__ import annotations

import pytest
import torch

import pipeoptim
from first_day import SEQ2SEQ, SEQ2SEQ_SPLITS, fed, model, padded_batches, sgd, whole_batch_loop
from test_first_day import torchrun_first_day_rows  # noqa: F401 (the job's fixture, shared)
from test_whole_batch import close_weights

#: the default cut of each into 2 stages (the uniform partitioner's)
DEFAULT_SPLIT = {"t5": ["decoder.block.0"], "bart": ["model.decoder.embed_positions"]}


@pytest.mark.parametrize("family,cut", [("t5", 1), ("t5", 2), ("bart", 0)])
def test_an_encoder_decoder_as_it_comes_trains_at_any_cut(family, cut):
    """Inside the encoder, inside the decoder, between the stacks (T5's default cut is there too,
    in the next test): 1f1b-flush against the whole mini-batch's step."""
    net, data = model(family), padded_batches(family)
    expected, trained = whole_batch_loop(net, data)
    points = SEQ2SEQ_SPLITS[family][cut]
    pipe = pipeoptim.Pipeline(net, method="1f1b-flush", optimizer=sgd, stages=2, micro_batches=2,
                              split_points=points)
    assert fed(pipe, data) == pytest.approx(expected, rel=1e-5)
    assert pipe.split_points == points
    assert close_weights(pipe.model(), trained)


@pytest.mark.parametrize("family", list(SEQ2SEQ))
def test_the_default_method_equals_the_whole_batch_and_exports(family, tmp_path):
    """zb-h1 (the default) at the default cut, through fit with checkpoints: the losses and
    weights of the step on each whole mini-batch; the checkpoint converts to a state dict the
    class loads with strict=True (no constant the trace lifted, T5's ``lifted_tensor_0``), the
    tied embedding under each of its names; save_pretrained and from_pretrained."""
    from test_first_day import export

    net, data = model(family), padded_batches(family)
    expected, trained = whole_batch_loop(net, data)
    pipe = pipeoptim.Pipeline(net, optimizer=sgd, stages=2)
    result = pipe.fit(data, checkpoint_dir=tmp_path / "ckpt")
    assert (pipe.method.name, pipe.split_points) == ("zb-h1", DEFAULT_SPLIT[family])
    assert result.losses == pytest.approx(expected, rel=1e-5)
    assert close_weights(pipe.model(), trained)
    fresh = type(net)(net.config)
    fresh.load_state_dict(export(tmp_path / "ckpt", tmp_path / "model.pt"), strict=True)
    assert close_weights(fresh, trained)
    assert fresh.get_output_embeddings().weight is fresh.get_input_embeddings().weight
    pipe.model().save_pretrained(tmp_path / "hf")
    assert close_weights(type(net).from_pretrained(tmp_path / "hf"), trained)


@pytest.mark.parametrize("family,precision,rel", [("t5", "bf16", 2e-3), ("bart", "fp16", 1e-4)])
def test_half_precision_follows_the_whole_batch_under_autocast(family, precision, rel):
    """bf16 and fp16 (with torch's GradScaler in the reference, one loss scale over the stages in
    the pipeline) on padded rows: the whole mini-batch's step under torch.autocast, to the
    precision's tolerance (the micro-batches round apart from the whole batch)."""
    net, data = model(family), padded_batches(family)
    expected, _ = whole_batch_loop(net, data, precision=precision)
    fp32, _ = whole_batch_loop(net, data)
    pipe = pipeoptim.Pipeline(net, optimizer=sgd, stages=2, precision=precision)
    losses = fed(pipe, data)
    assert losses == pytest.approx(expected, rel=rel)
    assert losses != pytest.approx(fp32, rel=1e-6)  # it ran in half precision


@pytest.mark.parametrize("family,method", [("t5", "pipedream"), ("bart", "pipeoptim-2bw"), ("t5", "pipeoptim")])
def test_asynchronous_weight_families_train_an_encoder_decoder(family, method):
    """Weight stashing, 2BW's buffers, PipeOptim's prediction (each family's weights): the first
    mini-batch runs on the initial weights (the whole batch's loss), and one mini-batch fed again
    and again is learned. BART's embedding, read by both stages, stays one tensor."""
    net, data = model(family), padded_batches(family, count=1) * 6
    expected, _ = whole_batch_loop(net, data[:1])
    pipe = pipeoptim.Pipeline(net, method=method, optimizer=lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9),
                              stages=2)
    losses = fed(pipe, data)
    assert losses[0] == pytest.approx(expected[0], rel=1e-5)
    assert losses[-1] < losses[0] - 0.1
    trained = pipe.model()
    assert trained.get_output_embeddings().weight is trained.get_input_embeddings().weight


def test_under_torchrun_encoder_decoders_equal_one_process(torchrun_first_day_rows):
    """tests/test_first_day.py's torchrun job (2 processes, one stage each): T5 under the default
    method equals the whole mini-batch's step (AdamW: losses only), BART under PipeOptim (its
    embedding tied across the two processes) the same feeds in one process."""
    from first_day import adamw, batches
    from test_first_day import one_process_asynchronous

    rows = torchrun_first_day_rows
    t5 = rows["t5:zb-h1:fp32"]
    assert t5["points"] == DEFAULT_SPLIT["t5"] and t5["tied"]
    assert t5["losses"] == pytest.approx(whole_batch_loop(model("t5"), batches("t5"), adamw)[0], rel=1e-5)
    bart = rows["bart:pipeoptim:fp32"]
    assert bart["points"] == DEFAULT_SPLIT["bart"] and bart["tied"]
    assert bart["losses"] == pytest.approx(one_process_asynchronous("bart", "pipeoptim")[0], rel=1e-5)
