"""Tensor parallelism inside each stage (issue 63): ``tensor_parallel=T`` splits each stage's
planned Linear and Embedding layers over T processes with torch's styles, composed with the
pipeline (docs/architecture.md, "Tensor parallelism in a stage").

Under torchrun (tests/torchrun_tensor_parallel.py, the ``tensor-parallel`` script of the 4-process
job: N = 2 stages x T = 2): an nn.Sequential with our plan under one method of each family
(flushed, split backward, chunked, V-shaped, mirrored, asynchronous with prediction, 2BW; by hand
every one of the 15 holds likewise), a transformers Llama with
its own plan, and one with its head tied to its embedding on the other stage, each equal to the
same run with T = 1 in one process (losses and the gathered weights; the reductions' order differs,
so to float tolerance), and one stage in 2 replicas x 2 tensor ranks equal to one process on the
replicas' micro-batches side by side; 2 stages x 2 replicas x 2 tensor ranks (8 processes), each
split stage sharded over its replicas, equal to one process likewise. Checkpoints move from T = 1 to T = 2 and back. Without torchrun: the plan's resolution and its refusals, the layout's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import pipeoptim
from pipeoptim.runtime.layout import plan_layout
from pipeoptim.methods import get_method
from pipeoptim.tensor_plan import model_plan, resolve_plan

HERE = Path(__file__).resolve().parent

#: tests/torchrun_tensor_parallel.py's entries in the 4-process job
UNDER_TORCHRUN = ["mlp:1f1b-flush", "mlp:zb-h1", "mlp:interleaved", "mlp:zb-v", "mlp:bidirectional",
                  "mlp:pipeoptim", "mlp:pipedream-2bw", "llama:1f1b-flush", "llama-tied:pipeoptim", "mlp-1:1f1b-flush"]
#: the entries that run 2 replicas under torchrun (1 stage x 2 replicas x 2 tensor ranks)
REPLICATED = ["mlp-1:1f1b-flush"]
#: the 8-process job's: 2 stages x 2 replicas x 2 tensor ranks, each split stage sharded over its replicas
SHARDED = ["mlp:1f1b-flush:sharded", "mlp:pipeoptim:sharded"]


def test_every_family_split_over_two_tensor_ranks_equals_one_process(torchrun_4):
    """N = 2 x T = 2 (4 processes) against T = 1 in one process, global clipping and AdamW: the
    losses to 3e-7, the gathered weights to 2e-5 (AdamW divides by the gradients' root mean
    square, which magnifies the last bits of a sum in another order)."""
    from torchrun_jobs import run_here

    rows = torchrun_4.rows("tensor-parallel")
    assert [row["entry"] for row in rows] == UNDER_TORCHRUN
    script = HERE / "torchrun_tensor_parallel.py"
    alone = [e for e in UNDER_TORCHRUN if e not in REPLICATED]
    expected = {row["entry"]: row for row in map(json.loads, [
        *run_here(script, ",".join(alone)).splitlines(), *run_here(script, ",".join(REPLICATED), 2).splitlines()])}
    for row in rows:
        entry, ref = row["entry"], expected[row["entry"]]
        assert row["tensor"] == 2 and ref["tensor"] == 1, entry
        assert row["replicas"] == (2 if entry in REPLICATED else 1) and ref["replicas"] == 1, entry
        assert row["losses"] == pytest.approx(ref["losses"], abs=3e-7), entry
        assert row["stepped"] == row["losses"], entry
        assert row["evaluated"] == pytest.approx(ref["evaluated"], abs=1e-6), entry
        assert list(row["weights"]) == list(ref["weights"]), entry  # the model's own names, whole
        for name, value in row["weights"].items():
            torch.testing.assert_close(torch.tensor(value), torch.tensor(ref["weights"][name]), rtol=1e-4,
                                       atol=2e-5, msg=f"{entry}: {name}")
        assert len(set(row["losses"])) == len(row["losses"]), entry  # it trains


def test_split_stages_sharded_over_their_replicas_equal_one_process(torchrun_8):
    """N = 2 x D = 2 x T = 2 (8 processes), FSDP2 over each split stage's replicas (a ("dp", "tp")
    mesh, torch's order: tensor parallelism, then fully_shard), one synchronous and one
    asynchronous method with global clipping: one process on the replicas' micro-batches side by
    side, to the tolerance of the 4-process runs."""
    from torchrun_jobs import run_here

    rows = torchrun_8.rows("tensor-parallel-8")
    assert [row["entry"] for row in rows] == SHARDED
    plain = [entry.rsplit(":", 1)[0] for entry in SHARDED]  # in one process: nothing to shard
    expected = dict(zip(SHARDED, map(json.loads, run_here(HERE / "torchrun_tensor_parallel.py", ",".join(plain),
                                                          2).splitlines())))
    for row in rows:
        entry, ref = row["entry"], expected[row["entry"]]
        assert row["tensor"] == 2 and row["replicas"] == 2 and ref["replicas"] == 1, entry
        assert row["losses"] == pytest.approx(ref["losses"], abs=3e-7), entry
        assert row["evaluated"] == pytest.approx(ref["evaluated"], abs=1e-6), entry
        for name, value in row["weights"].items():
            torch.testing.assert_close(torch.tensor(value), torch.tensor(ref["weights"][name]), rtol=1e-4,
                                       atol=2e-5, msg=f"{entry}: {name}")


def llama(**config):
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        "vocab_size": 24, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 16, **config}))


def test_a_transformers_model_brings_its_own_plan():
    """Llama's plan, whole-model names: the attention's and the MLP's projections, the embedding
    split over the vocabulary and the head column-wise with its output gathered."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = llama()
    plan = model_plan(model)
    assert plan["lm_head"] == "colwise_gather_output" and plan["model.embed_tokens"] == "embedding_rowwise"
    styles = resolve_plan(model, None, 2)
    assert sorted(styles) == sorted(["lm_head", "model.embed_tokens", *(f"model.layers.0.{m}" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"))])
    assert type(styles["model.layers.0.self_attn.o_proj"]) is RowwiseParallel
    head, embed = styles["lm_head"], styles["model.embed_tokens"]
    assert type(head) is ColwiseParallel and head.output_layouts == (Replicate(),)
    assert type(embed) is RowwiseParallel and embed.input_layouts == (Replicate(),)
    assert styles["model.layers.0.mlp.up_proj"].output_layouts == (Shard(-1),)


def test_plans_that_cannot_split_are_refused_with_the_fix():
    from torch.distributed.tensor.parallel import ColwiseParallel

    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"carries no plan.*give tensor_plan="):
        resolve_plan(mlp, None, 2)
    with pytest.raises(ValueError, match=r"'5' names no layer.*fix the pattern"):
        resolve_plan(mlp, {"5": ColwiseParallel()}, 2)
    with pytest.raises(ValueError, match=r"matches 1, a ReLU: only nn.Linear and nn.Embedding"):
        resolve_plan(mlp, {"1": ColwiseParallel()}, 2)
    with pytest.raises(ValueError, match=r"'packed_colwise'.*give one of torch's parallel styles"):
        resolve_plan(mlp, {"0": "packed_colwise"}, 2)
    with pytest.raises(ValueError, match=r"num_attention_heads=3, which tensor_parallel=2 does not divide"):
        resolve_plan(llama(num_attention_heads=3, num_key_value_heads=3, hidden_size=18), None, 2)
    with pytest.raises(ValueError, match=r"1 key/value heads for 2 query heads \(grouped-query attention\)"):
        resolve_plan(llama(num_key_value_heads=1), None, 2)
    with pytest.raises(ValueError, match=r"splits 0 \(Linear\) along its out_features = 8, which tensor_parallel=3"):
        resolve_plan(mlp, {"0": "colwise"}, 3)
    with pytest.raises(ValueError, match=r"splits 2 \(Linear\) along its in_features = 8, which tensor_parallel=3"):
        resolve_plan(mlp, {"2": "rowwise"}, 3)
    assert list(resolve_plan(mlp, {"0": "colwise", "2": "rowwise"}, 2)) == ["0", "2"]


def test_the_layout_counts_tensor_ranks():
    """WORLD_SIZE = N x D x T; a world that T does not divide, or one process, is refused."""
    method = get_method("1f1b-flush")
    layout = plan_layout(method, stages=2, processes=8, tensor_parallel=2)
    assert (layout.ranks, layout.replicas, layout.tensor, layout.processes) == (2, 2, 2, 8)
    assert plan_layout(method, processes=4, tensor_parallel=2).ranks == 2  # one rank per pair by default
    with pytest.raises(ValueError, match=r"WORLD_SIZE 6 is not a multiple of tensor_parallel=4"):
        plan_layout(method, stages=2, processes=6, tensor_parallel=4)
    with pytest.raises(ValueError, match=r"tensor_parallel=2 splits each stage over 2 processes: launch with torchrun"):
        pipeoptim.Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), stages=2, tensor_parallel=2,
                           loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(ValueError, match=r"tensor_plan splits layers over tensor_parallel=T processes"):
        pipeoptim.Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), stages=2, tensor_plan={"0": "colwise"},
                           loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def test_a_checkpoint_resumes_across_tensor_ranks(torchrun_4, tmp_path):
    """The mlp under 1f1b-flush checkpointed every 2 mini-batches, cut after 4: written by one
    process (T = 1) and resumed on 2 stages x 2 tensor ranks, and written with T = 2 and resumed in
    one process, each ends as the uncut run of one process does (DCP reshards the weights, the
    optimizer's moments and the scheduler's state by name)."""
    from torchrun_tensor_parallel import checkpointed

    whole = checkpointed(tmp_path / "whole")
    (row,) = torchrun_4.rows("tensor-checkpoints")
    back = checkpointed(torchrun_4.folder / "two-to-one")  # resumed here, in one process
    for entry, result in (("one-to-two", row), ("two-to-one", back)):
        assert len(result["losses"]) == len(whole["losses"]) == 6, entry
        assert result["losses"] == pytest.approx(whole["losses"], abs=3e-7), entry
        for name, value in result["weights"].items():
            torch.testing.assert_close(torch.tensor(value), torch.tensor(whole["weights"][name]), rtol=1e-4,
                                       atol=1e-6, msg=f"{entry}: {name}")
