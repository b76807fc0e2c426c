"""A transformers user's first day (issue 49): real library models as they come
(tests/first_day.py: GPT-2, Llama, Qwen2, a BERT classifier, a ViT), dict batches with
``labels`` = ``input_ids``, no loss_fn, the Pipeline's defaults. Each finding of the issue has
its test here; tests/torchrun_first_day.py runs the same models under torchrun.

The matrix (model x feature -> test):
- synchronous (the default method, zb-h1) equal to the plain loop with accumulation, fp32, one
  process, and a checkpoint that a fresh model loads strictly: ``test_..._equals_the_plain_loop``
- bf16 against the plain loop under autocast: ``test_bf16_...``
- asynchronous methods train: ``test_asynchronous_methods_train``
- compiled stages: ``test_compiled_stages_...`` (GPT-2)
- torchrun 2 processes (every model; bf16 and an asynchronous method on some), with a checkpoint
  (GPT-2): ``test_under_torchrun_every_model_equals_one_process``, the one torchrun script of the
  library models (tests/test_library_models.py's ResNet in it too), run in the session's
  2-process job (tests/conftest.py's ``torchrun_2``)
- sharded replicas (2 stages x 2 replicas under torchrun, FSDP2) with a strict checkpoint: GPT-2
  as it comes, in tests/test_examples.py (the transformers example)"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch

import pipeoptim
from first_day import CAUSAL, MODELS, adamw, batches, fed, model, plain_loop, same_weights


#: the default cut of each model into 2 stages: the uniform partitioner's, a function of the model
#: (and tests/library_models.py's ResNet's, cut by partitioner="uniform" in the torchrun job)
DEFAULT_SPLIT = {"gpt2": ["transformer.h.2"], "llama": ["model.layers.3"], "qwen2": ["model.layers.2"],
                 "bert": ["bert.encoder.layer.3"], "vit": ["vit.layers.3"], "resnet": ["resnet.encoder.stages.2"]}
#: the families whose head is tied to the input embedding (as the library builds them)
TIED = ("gpt2", "qwen2")


def export(checkpoint_dir: Path, out: Path) -> dict:
    """The newest checkpoint of a run as one torch.save file, with torch alone (README,
    "Checkpoints"): its ``model`` entry is the model's state dict."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    latest = json.loads((checkpoint_dir / "latest.json").read_text())["checkpoint"]
    dcp_to_torch_save(str(checkpoint_dir / latest), str(out))
    return torch.load(out, weights_only=True)["model"]


@pytest.mark.parametrize("family", list(MODELS))
def test_the_default_pipeline_equals_the_plain_loop_and_its_checkpoint_loads_strictly(family, tmp_path,
                                                                                      monkeypatch):
    """Findings 1-2, 4-6: the model as it comes (use_cache on) traces; ``labels`` that is
    ``input_ids`` trains; the default method is synchronous (zb-h1, M = 2), equal to the plain
    loop; the default cut is the uniform one and profiles nothing (finding 5: so it is the same in
    any launcher and run); the checkpoint converts into a state dict that a fresh model of the
    class loads with strict=True, tied names included; save_pretrained works."""
    import pipeoptim.prepare as prepare

    monkeypatch.setattr(prepare, "profile_model", lambda *a, **k: pytest.fail("the default cut profiled"))
    net, data = model(family), batches(family)
    expected, trained = plain_loop(net, data, micro=2)
    pipe = pipeoptim.Pipeline(net, optimizer=adamw, stages=2)
    result = pipe.fit(data, checkpoint_dir=tmp_path / "ckpt")
    assert pipe.method.name == "zb-h1" and pipe.microbatches == 2
    assert pipe.split_points == DEFAULT_SPLIT[family]
    assert result.losses == pytest.approx(expected, rel=1e-5)
    assert same_weights(pipe.model(), trained)
    fresh = type(net)(net.config)
    fresh.load_state_dict(export(tmp_path / "ckpt", tmp_path / "model.pt"), strict=True)
    assert same_weights(fresh, trained)
    if family in ("gpt2", "qwen2"):  # tied: one tensor in the loaded model and in the trained copy
        assert fresh.get_output_embeddings().weight is fresh.get_input_embeddings().weight
        assert pipe.model().get_output_embeddings().weight is pipe.model().get_input_embeddings().weight
    pipe.model().save_pretrained(tmp_path / "pretrained")
    again = type(net).from_pretrained(tmp_path / "pretrained")
    assert same_weights(again, trained)


@pytest.mark.parametrize("family", list(MODELS))
def test_bf16_equals_the_plain_loop_under_autocast(family):
    """Finding 3: bf16 on the traced library models, as the plain loop under torch.autocast (bf16's
    tolerance), with fp32 master weights."""
    net, data = model(family), batches(family)
    expected, _ = plain_loop(net, data, micro=2, precision="bf16")
    fp32, _ = plain_loop(net, data, micro=2)
    pipe = pipeoptim.Pipeline(net, optimizer=adamw, stages=2, precision="bf16")
    losses = fed(pipe, data)
    assert losses == pytest.approx(expected, rel=2e-3)
    assert losses != fp32  # it ran in bf16
    assert all(p.dtype == torch.float32 for s in pipe.stages for p in s.module.parameters())


@functools.lru_cache(maxsize=None)
def one_process_asynchronous(family: str, method: str):
    """(losses, whether the trained head is still the embedding) of ``method`` fed one mini-batch
    six times in one process; the torchrun job's asynchronous entry is fed the same."""
    pipe = pipeoptim.Pipeline(model(family), method=method, optimizer=adamw, stages=2)
    losses = fed(pipe, batches(family, count=1) * 6)
    trained = pipe.model()
    return losses, trained.get_output_embeddings() is not None and \
        trained.get_output_embeddings().weight is trained.get_input_embeddings().weight


@pytest.mark.parametrize("family,method", [("gpt2", "pipeoptim"), ("llama", "pipeoptim-2bw"),
                                           ("qwen2", "pipeoptim"), ("bert", "pipeoptim-2bw"),
                                           ("vit", "pipeoptim")])
def test_asynchronous_methods_train(family, method):
    """Asynchronous, so not equal to the plain loop; the first mini-batch runs on the initial
    weights (as the loop's), and trained on one mini-batch again and again the loss falls. A tied
    head (GPT-2, Qwen2: on the other stage than the embedding, reading the owner's version) stays
    the embedding's tensor."""
    expected, _ = plain_loop(model(family), batches(family, count=1), micro=1)
    losses, tied = one_process_asynchronous(family, method)
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    assert losses[0] == pytest.approx(expected[0], rel=1e-5)
    assert losses[-1] < losses[0] - 0.1
    assert tied == (family in TIED)


def test_compiled_stages_equal_the_plain_loop():
    """Compiled stages (torch.compile, aot_eager: the compiled path, compiled in seconds) on GPT-2
    as it comes."""
    net, data = model("gpt2"), batches("gpt2")
    expected, _ = plain_loop(net, data, micro=2)
    pipe = pipeoptim.Pipeline(net, optimizer=adamw, stages=2, compile="aot_eager")
    assert fed(pipe, data) == pytest.approx(expected, rel=1e-5)
    assert all(c >= 1 for c in pipe.compilations)


def test_a_global_clip_by_default_clips_as_the_plain_loop():
    """Finding 6: clip_grad_norm with the default clip_scope clips a synchronous method by the
    whole model's norm, as the plain loop's clip_grad_norm_ does (0.05 clips every update here)."""
    net, data = model("llama"), batches("llama")
    expected, trained = plain_loop(net, data, micro=2, clip=0.05)
    unclipped, _ = plain_loop(net, data, micro=2)
    pipe = pipeoptim.Pipeline(net, method="1f1b-flush", optimizer=adamw, stages=2, clip_grad_norm=0.05)
    losses = fed(pipe, data)
    assert losses == pytest.approx(expected, rel=1e-5) and losses != pytest.approx(unclipped, rel=1e-5)
    assert same_weights(pipe.model(), trained)


def test_train_runs_with_its_documented_default_method():
    """Finding 6: ``pipeoptim.train`` takes no method, as its docstring says (the Pipeline's)."""
    net, data = model("bert"), batches("bert", count=2)
    expected, _ = plain_loop(net, data, micro=2)
    result = pipeoptim.train(net, data, optimizer=adamw, stages=2)
    assert result.losses == pytest.approx(expected, rel=1e-5)


def test_the_default_cut_depends_on_the_model_alone(capsys):
    """Finding 5: the default cut profiles nothing, so it is the same in any launcher and run (held
    for every model by test_the_default_pipeline_equals_the_plain_loop_...); the time partitioner
    is opt-in and prints the cut it chose, which given again is the same."""
    net, data = model("gpt2"), batches("gpt2", count=1)
    timed = pipeoptim.Pipeline(net, optimizer=adamw, stages=2, partitioner="time", example_input=data[0])
    said = capsys.readouterr().err
    assert f"split_points={timed.split_points}" in said and "partitioner='time'" in said
    pipeoptim.Pipeline(net, optimizer=adamw, partitioner="time", split_points=timed.split_points,
                       example_input=data[0])
    assert "partitioner='time'" not in capsys.readouterr().err  # a cut given is no cut chosen


def test_a_model_whose_output_holds_no_tensor_is_refused_naming_the_option():
    """Finding 1: what the trace cannot carry (a cache object in the output) is refused with the
    option to turn off."""
    import transformers as T

    class WithCache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

        def forward(self, x):
            return self.layers[1](self.layers[0](x)), T.DynamicCache()

    pipe = pipeoptim.Pipeline(WithCache(), optimizer=adamw, stages=2, loss_fn=lambda out, y: out[0].sum())
    with pytest.raises(ValueError, match="output holds a DynamicCache.*turn off the option"):
        pipe.step(torch.randn(4, 4), torch.zeros(4))


#: the script's entries: FAMILY:METHOD:PRECISION (tests/test_seq2seq.py reads the encoder-decoders')
JOB_ENTRIES = [f"{family}:zb-h1:fp32" for family in MODELS] + ["gpt2:zb-h1:bf16", "gpt2:pipeoptim:fp32",
                                                              "resnet:1f1b-flush:fp32", "t5:zb-h1:fp32",
                                                              "bart:pipeoptim:fp32"]


@pytest.fixture(scope="module")
def torchrun_first_day_rows(torchrun_2):
    """{entry: rank 0's row} of tests/torchrun_first_day.py in the session's 2-process job
    (tests/conftest.py's ``torchrun_2``, which preloads transformers: no job of its own to start,
    nor two more processes importing it), and ``"folder"``: where its checkpoints are."""
    rows = {row["entry"]: row for row in torchrun_2.rows("first-day")}
    return {**rows, "folder": torchrun_2.folder / "first-day"}


def test_under_torchrun_every_model_equals_one_process(torchrun_first_day_rows):
    """Two processes, one stage each: the default method's losses equal the plain loop's (and so
    one process's), the default cut is the one process's, bf16 equals the plain loop under
    autocast, an asynchronous method (PipeOptim, GPT-2's tied head on the other process than its
    embedding) equals the same feeds in one process, a tied head is still the embedding's tensor
    after model() gathers the stages, and GPT-2's checkpoint loads strictly.

    The one torchrun script of the library models: tests/test_library_models.py's ResNet (batch norm,
    4-D activations across the processes, the user's loss_fn) under 1f1b-flush equals its plain
    sequential training here. What test_library_models.py's own job held is here too: GPT-2 under
    a synchronous method, its tied head across the processes (the default method's GPT-2 entry;
    under 1f1b-flush, tests/test_dict_batches.py's job); GPT-2 under PipeOptim equal to one
    process (the asynchronous entry); a head of its own (the untied control) by Llama's, BERT's and
    ViT's entries; ResNet under PipeOptim: the asynchronous path of GPT-2's entry and of
    tests/test_torchrun.py's jobs (every method, one process against two)."""
    from test_library_models import sequential

    rows = {k: v for k, v in torchrun_first_day_rows.items() if k != "folder"}
    tmp_path = torchrun_first_day_rows["folder"]
    assert sorted(rows) == sorted(JOB_ENTRIES)
    trained = {}
    for entry, row in rows.items():
        family, method, precision = entry.split(":")
        if family not in MODELS and family != "resnet":
            continue  # an encoder-decoder: tests/test_seq2seq.py
        assert row["points"] == DEFAULT_SPLIT[family], entry
        assert row["tied"] == (family in TIED), entry
        if family not in MODELS:  # tests/library_models.py's
            assert row["losses"] == pytest.approx(sequential(family, micro=2)[0], rel=1e-5), entry
        elif method == "zb-h1":
            expected, trained[entry] = plain_loop(model(family), batches(family), micro=2, precision=precision)
            assert row["losses"] == pytest.approx(expected, rel=1e-5 if precision == "fp32" else 2e-3), entry
        else:
            assert row["losses"] == pytest.approx(one_process_asynchronous(family, method)[0], rel=1e-5), entry
    gpt2 = trained["gpt2:zb-h1:fp32"]
    fresh = type(gpt2)(gpt2.config)
    fresh.load_state_dict(export(tmp_path / "gpt2-zb-h1-fp32", tmp_path / "model.pt"), strict=True)
    assert same_weights(fresh, gpt2)
