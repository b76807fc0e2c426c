"""`--tensor-parallel T` on the command line and in the planner: the layout (N x D x T processes),
the launcher's process count and rank names, the flag on `train`, `bench` and `plan`, the lab
models' own plans, the refusals naming the fix, and the plan's memory and time for T = 2 against
numbers computed by hand. No torchrun launch here (tests/test_tensor_parallel.py runs the engine)."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from pipeoptim.cli import build_parser, main
from pipeoptim.methods import get_method
from pipeoptim.profile import LayerProfile, ModelProfile
from pipeoptim.runtime.layout import Layout, plan_layout
from pipeoptim.throughput import TensorLayers, predict, stage_memory, tensor_costs, stage_costs


# -- the layout and the launcher -------------------------------------------------------------------

def test_the_layout_holds_n_x_d_x_t_processes():
    method = get_method("1f1b-flush")
    assert plan_layout(method, stages=2, data_parallel=3, tensor_parallel=2).processes == 12
    assert plan_layout(method, stages=2, processes=8, tensor_parallel=2) == Layout(2, 1, 2, 2)
    assert plan_layout(method, processes=8, tensor_parallel=4) == Layout(2, 1, 1, 4)  # no stages: the world's


@pytest.mark.parametrize("kwargs, says", [
    (dict(stages=2, processes=6, tensor_parallel=4), "WORLD_SIZE 6 is not a multiple of tensor_parallel=4"),
    (dict(stages=3, processes=8, tensor_parallel=2), "WORLD_SIZE 8 is not a multiple of the 3 stages x 2"),
    (dict(stages=2, processes=8, data_parallel=1, tensor_parallel=2), "start 4 processes or drop data_parallel"),
    (dict(stages=2, tensor_parallel=0), "tensor_parallel must be a positive number of processes per stage"),
])
def test_a_layout_the_processes_cannot_hold_is_refused(kwargs, says):
    with pytest.raises(ValueError, match=says):
        plan_layout(get_method("1f1b-flush"), **kwargs)


def test_the_launcher_starts_t_processes_per_stage_and_a_users_job_keeps_its_stages():
    from pipeoptim.lab.config import RunConfig
    from pipeoptim.lab.launcher import job_stages, stage_count

    cfg = RunConfig(task="image", model="mlp", method="1f1b-flush", stages=2, data_parallel=2, tensor_parallel=2)
    assert stage_count(cfg) == 8
    assert stage_count(RunConfig(task="image", model="mlp", method="interleaved", stages=2, tensor_parallel=2)) == 4
    free = RunConfig(task="image", model="mlp", method="1f1b-flush", stages=2, tensor_parallel=2)
    assert [job_stages(free, world) for world in (4, 8)] == [2, 2]  # 1 and 2 replicas
    assert job_stages(free, 8, stages_given=False) == 4  # no --stages: the world over T
    with pytest.raises(ValueError, match=r"--stages 2 --tensor-parallel 2 runs 4 stage processes per replica but "
                                         r"the world size is 6: start a multiple of 4 processes, 2 per stage"):
        job_stages(free, 6)


def test_a_process_is_named_by_its_stage_replica_and_tensor_rank():
    from pipeoptim.lab.stage_worker import rank_name

    # rank r = (d*N + k)*T + t
    assert rank_name(5, 2, 2, 2) == "stage 0 of replica 1, tensor rank 1 (rank 5"
    assert rank_name(3, 2, 1, 2) == "stage 1, tensor rank 1 (rank 3"
    assert rank_name(3, 2, 2) == "stage 1 of replica 1 (rank 3"  # T = 1: as before
    assert rank_name(1) == "stage 1 (rank 1"


# -- the flag ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["train", "bench", "plan"])
def test_train_bench_and_plan_take_one_tensor_parallel_flag_with_one_default(command):
    parser = build_parser()
    assert parser.parse_args([command]).tensor_parallel == 1
    assert parser.parse_args([command, "--tensor-parallel", "2"]).tensor_parallel == 2
    sub = parser._subparsers._group_actions[0].choices[command]
    flag = next(a for a in sub._actions if "--tensor-parallel" in a.option_strings)
    assert flag.metavar == "T" and "1/T" in flag.help


@pytest.mark.parametrize("argv, says", [
    (["train", "--tensor-parallel", "2"], "--tensor-parallel 2 runs 2 processes per stage: add --runtime distributed"),
    (["train", "--tensor-parallel", "0"], "--tensor-parallel must be at least 1, got 0"),
    (["train", "--runtime", "distributed", "--tensor-parallel", "2", "--data-parallel", "2", "--shard-replicas"],
     "--tensor-parallel and --shard-replicas do not run together yet: drop one of them"),
    (["train", "--runtime", "distributed", "--tensor-parallel", "2", "--model", "resnet"],
     "--tensor-parallel 2 splits the layers a model's plan names, and image's model resnet carries none: choose a "
     "model with a plan (--task image --model mlp|vgg|vgg-bn; --task lm --model gpt|"),
    (["bench", "--synthetic", "--tensor-parallel", "2", "--model", "resnet"],
     "choose a model with a plan (the blocks model (the default), --task image --model mlp|vgg|vgg-bn;"),
    (["bench", "--synthetic", "--ablate", "tensor-parallel"],
     "--ablate tensor-parallel runs each method at T = 1 and at --tensor-parallel T: give --tensor-parallel T"),
    (["bench", "--synthetic", "--tensor-parallel", "2", "--ablate", "compile"],
     "--tensor-parallel and --compile do not run together yet"),
    (["bench", "--synthetic", "--tensor-parallel", "2", "--optimizer", "muon"],
     "--tensor-parallel with --optimizer muon: Muon orthogonalizes each whole matrix"),
    (["bench", "--synthetic", "--task", "sentiment"], "--synthetic makes random images or token ids"),
    (["bench", "--synthetic", "--tensor-parallel", "3"],
     "the blocks model: tensor_plan splits 0.1 (Linear) along its out_features = 512, which --tensor-parallel 3 "
     "does not divide: choose T dividing 512"),
    (["bench", "--synthetic", "--task", "lm", "--model", "gpt-small", "--tensor-parallel", "3"],
     "lm's model gpt-small: tensor_plan splits 0.tok (Embedding) along its num_embeddings = 2000, which "
     "--tensor-parallel 3 does not divide"),
    (["plan", "--tensor-parallel", "2", "--model", "resnet"], "image's model resnet carries none"),
])
def test_what_cannot_split_is_refused_in_one_line_naming_the_fix(argv, says, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_a_t_that_does_not_divide_a_planned_layer_is_refused():
    from pipeoptim.errors import command_line_words
    from pipeoptim.lab.config import LAB_OPTIONS
    from pipeoptim.lab.experiment import check_tensor_split
    from pipeoptim.lab.tasks.image_models import build_image_model
    from pipeoptim.options import OPTIONS

    mlp = build_image_model("mlp", 0)
    check_tensor_split(mlp, 2, "image's model mlp")  # 256 hidden features: halves
    with command_line_words((*OPTIONS, *LAB_OPTIONS)), \
            pytest.raises(ValueError, match=r"^image's model mlp: tensor_plan splits 0.1 \(Linear\) along its "
                                            r"out_features = 256, which --tensor-parallel 3 does not divide: choose "
                                            r"T dividing 256, or leave 0.1 out$"):
        check_tensor_split(mlp, 3, "image's model mlp")  # the command line's check: its words


# -- the models' plans -----------------------------------------------------------------------------

def _build(task_name: str, model: str) -> nn.Module:
    from pipeoptim.lab.tasks import get_task
    from pipeoptim.lab.tasks.base import TaskData

    stub = TaskData(train=[], test=[], info={"vocab_size": 64, "seq_len": 16})  # what the builders read
    return get_task(task_name).build_model(model, stub, seed=0)


def test_the_list_of_planned_models_is_the_models_own():
    from pipeoptim.lab.experiment import TENSOR_PLANNED, check_tensor_split
    from pipeoptim.lab.tasks import get_task, task_names
    from pipeoptim.tensor_plan import model_plan

    for task in task_names():
        for name in get_task(task).model_names():
            model = _build(task, name)
            assert bool(model_plan(model)) == (name in TENSOR_PLANNED.get(task, ())), (task, name)
            if name in TENSOR_PLANNED.get(task, ()):
                check_tensor_split(model, 2, name)  # resolves, and every split halves


def test_the_lm_models_plan_resolves_to_the_mlps_the_embedding_and_the_head():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from pipeoptim.tensor_plan import resolve_plan

    plan = resolve_plan(_build("lm", "gpt-small"), None, 2)  # embedding | 2 blocks | head
    assert {name: type(style) for name, style in plan.items()} == {
        "0.tok": RowwiseParallel, "1.mlp.0": ColwiseParallel, "2.mlp.0": ColwiseParallel,
        "1.mlp.2": RowwiseParallel, "2.mlp.2": RowwiseParallel, "3.proj": ColwiseParallel}
    assert plan["3.proj"].output_layouts[0].is_replicate()  # the logits gathered
    assert plan["0.tok"].input_layouts[0].is_replicate()  # the ids whole on every rank
    tied = resolve_plan(_build("lm", "gpt-tied-small"), None, 2)
    assert sorted(tied) == ["blocks.0.mlp.0", "blocks.0.mlp.2", "blocks.1.mlp.0", "blocks.1.mlp.2", "head", "tok"]


def test_the_blocks_model_pairs_its_blocks_and_keeps_the_head_whole():
    from pipeoptim.lab.bench_worker import blocks_model
    from pipeoptim.tensor_plan import resolve_plan

    model = blocks_model(2)  # 8 blocks and the head
    assert model._tp_plan == {"0.1": "colwise", "1.0": "rowwise", "2.0": "colwise", "3.0": "rowwise",
                              "4.0": "colwise", "5.0": "rowwise", "6.0": "colwise", "7.0": "rowwise"}
    assert len(resolve_plan(model, None, 2)) == 8


# -- bench's report ----------------------------------------------------------------------------------

def test_a_tensor_parallel_run_is_compared_with_its_t1_twin_and_the_jobs_merge():
    from pipeoptim.cli.bench import merge_jobs, ratios

    sps = {"1f1b-flush": 100.0, "1f1b-flush tp2": 50.0, "pipeoptim x2": 60.0, "pipeoptim x2 tp2": 45.0}
    assert ratios(sps, ["1f1b-flush", "pipeoptim"]) == {"1f1b-flush tp2/1f1b-flush": 0.5,
                                                        "pipeoptim x2 tp2/pipeoptim x2": 0.75}
    one = {"samples_per_second": {"sequential-1dev": 10.0, "gpipe": 20.0}, "detail": {"sequential-1dev": 1, "gpipe": 2},
           "settings": {"tensor_parallel": 1, "processes": 2, "stages": 2}}
    two = {"samples_per_second": {"gpipe tp2": 15.0}, "detail": {"gpipe tp2": 3},
           "settings": {"tensor_parallel": 2, "processes": 4, "stages": 2}}
    merged = merge_jobs([one, two])
    assert merged["samples_per_second"] == {"sequential-1dev": 10.0, "gpipe": 20.0, "gpipe tp2": 15.0}
    assert merged["settings"]["jobs"] == [{"tensor_parallel": 1, "processes": 2}, {"tensor_parallel": 2, "processes": 4}]


# -- the plan ------------------------------------------------------------------------------------------

def _profile() -> ModelProfile:
    """Two layers of 4 samples: forward 2 s and 1 s, backward 4 s and 2 s, 1000 and 600 parameter
    bytes, AdamW's state twice that, updates 1 s and 0.5 s, 400 bytes out of each."""
    def layer(i, f, b, params, update):
        return LayerProfile(i, "Linear", f, b, 400, 0, 0, 0, params, params // 4, update, 2 * params)
    return ModelProfile([layer(0, 2.0, 4.0, 1000, 1.0), layer(1, 1.0, 2.0, 600, 0.5)], "cpu", 4, 64, 0, 1, 1)


#: layer 0 planned (800 of its 1000 bytes split, half its forward time), 100 bytes a sample in the
#: forward's collectives and 50 in the backward's; layer 1 whole
SPLIT = TensorLayers(2, [800, 0], [0.5, 0.0], [100.0, 0.0], [50.0, 0.0], {"0.0": "colwise", "0.2": "rowwise"})


def test_the_plan_prices_t2_as_computed_by_hand():
    """Stage 0 (layer 0) at T = 2: its forward 2 s x (1 - 1/2 x 0.5) + 4 samples x 100 B / 1000 B/s
    = 1.9 s, its backward 4 x 0.75 + 4 x 50 / 1000 = 3.2 s, its W half 2 x 0.75 = 1.5 s; stage 1
    unchanged; per process stage 0 holds 1000 - 800 + 400 = 600 parameter bytes (and gradients), its
    optimizer state 2000 x 600 / 1000 = 1200."""
    profile = _profile()
    costs = tensor_costs(stage_costs(profile, [1, 1], bandwidth=1000.0), profile, [(0, 1), (1, 2)], SPLIT, 1000.0)
    assert costs.forward == pytest.approx([1.9, 1.0])
    assert costs.backward == pytest.approx([3.2, 2.0])
    assert costs.weight == pytest.approx([1.5, 1.0])
    assert costs.update == pytest.approx(1.0)  # the slowest stage's, less the largest kept share (stage 1: all)
    assert costs.comm == pytest.approx(0.4)  # the pipeline's own send: unchanged
    rows = stage_memory("gpipe", profile, [1, 1], [1, 1], tensor=SPLIT)
    assert [(r["parameter_bytes"], r["weights"], r["gradients"], r["optimizer"]) for r in rows] == [
        (600, 600, 600, 1200), (600, 600, 600, 1200)]
    assert [(r["tensor_parallel"], r["split_parameter_bytes"]) for r in rows] == [(2, 800), (2, 0)]
    row = predict("gpipe", profile, [1, 1], microbatches=1, batches=1, batch_size=4, bandwidth=1000.0, tensor=SPLIT)
    assert row["tensor_parallel"] == 2 and row["stage_forward_seconds"] == pytest.approx([1.9, 1.0])
    free = tensor_costs(stage_costs(profile, [1, 1]), profile, [(0, 1), (1, 2)], SPLIT, None)
    assert free.forward == pytest.approx([1.5, 1.0])  # without a bandwidth the collectives are free
    # T = 4: 3/4 of the planned half runs elsewhere, 2 x (1 - 3/4 x 0.5) = 1.25 s; 1000 - 800 + 200 bytes
    four = TensorLayers(4, *[getattr(SPLIT, f) for f in ("split_bytes", "share", "forward_wire", "backward_wire",
                                                          "planned")])
    assert tensor_costs(stage_costs(profile, [1, 1]), profile, [(0, 1), (1, 2)], four, None).forward == \
        pytest.approx([1.25, 1.0])
    assert stage_memory("gpipe", profile, [1, 1], [1, 1], tensor=four)[0]["parameter_bytes"] == 400
    # 200 of the 800 split bytes a row-wise Embedding's: its gradient held whole, 600 + 200 / 2
    embedded = TensorLayers(2, *[getattr(SPLIT, f) for f in ("split_bytes", "share", "forward_wire",
                                                             "backward_wire", "planned")], whole_grads=[200, 0])
    assert stage_memory("gpipe", profile, [1, 1], [1, 1], tensor=embedded)[0]["gradients"] == 700


def test_a_candidate_may_be_n_x_t_times_faster_than_sequential():
    from pipeoptim.recommendation import reach

    row = {"samples_per_second": 350.0}
    reach(row, 100.0, 2, tensor=2)
    assert (row["processes"], row["reachable"]) == (4, True)
    reach(row, 80.0, 2, tensor=2)
    assert row["reachable"] is False and "on 4 processes" in row["unreachable"]


def test_the_measured_split_counts_the_planned_bytes_and_the_collectives():
    """A block Linear(4, 8) column-wise, Linear(8, 4) row-wise, then a head Linear(4, 2) whose
    logits are gathered, on 5 samples at T = 2: split bytes 160 + 128 (the row-wise bias whole) and
    40; per sample the forward all-reduces the block's 16 output bytes (2(T-1)/T = 1 of them) and
    all-gathers half the head's 8, the backward all-reduces the head's 16 input-gradient bytes (the
    block's input, the data, has none)."""
    from pipeoptim.planning import model_units, tensor_layers
    from pipeoptim.tensor_plan import resolve_plan

    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)), nn.Linear(4, 2))
    net._tp_plan = {"0.0": "colwise", "0.2": "rowwise", "1": "colwise_gather_output"}
    units = model_units(net, (torch.randn(5, 4), torch.randint(0, 2, (5,))), nn.functional.cross_entropy)
    split = tensor_layers(units, resolve_plan(net, None, 2), 2)
    assert split.split_bytes == [288, 40]
    assert split.forward_wire == pytest.approx([16.0, 4.0])
    assert split.backward_wire == pytest.approx([0.0, 16.0])
    assert split.planned == {"0.0": "colwise", "0.2": "rowwise", "1": "colwise_gather_output"}
    assert all(0.0 < s <= 1.0 for s in split.share)
    assert split.whole_grads == [0, 0]
    # a token embedding split over its 10-row vocabulary: its (5, 3, 4) output all-reduced, 48 bytes a
    # sample; the ids have no gradient; its weight's gradient stays whole on every process (torch's)
    net = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    net._tp_plan = {"0": "embedding_rowwise"}
    units = model_units(net, (torch.randint(0, 10, (5, 3)), torch.randn(5, 3, 2)), nn.functional.mse_loss)
    split = tensor_layers(units, resolve_plan(net, None, 2), 2)
    assert (split.planned, split.split_bytes, split.whole_grads) == ({"0": "embedding_rowwise"}, [160, 0], [160, 0])
    assert (split.forward_wire, split.backward_wire) == ([48.0, 0.0], [0.0, 0.0])


def test_the_plan_says_what_t_does_in_its_own_words():
    from pipeoptim.lab.planner import tensor_lines

    plan = {"tensor": SPLIT.to_dict(), "settings": {"bandwidth": 1000.0}, "batch_size": 4, "microbatches": 1,
            "stages": 2, "profile": {"layers": [{"parameter_bytes": 1000, "forward": 2.0},
                                                {"parameter_bytes": 600, "forward": 1.0}]}}
    text = " ".join(tensor_lines(plan))
    assert "every stage on 2 processes (2 x 2 in all" in text and "1 colwise, 1 rowwise layers" in text
    assert "take 33 % of the layers' forward" in text  # (0.5 x 2 s) / 3 s
    assert "sends 0.4 KiB in the forward's collectives" in text and "0.2 KiB in the backward's" in text
    assert "600.00 ms per micro-batch at --bandwidth 1000 B/s" in text  # (400 + 200) B / 1000 B/s
    plan["settings"]["bandwidth"] = None
    assert "free without --bandwidth" in " ".join(tensor_lines(plan))
    assert tensor_lines({"tensor": None}) == []


def test_a_plan_with_t2_is_run_by_train_with_the_distributed_runtime(tmp_path, capsys, monkeypatch):
    from pipeoptim.lab.planner import PLAN_FORMAT, PLAN_VERSION, load_plan, pipeline_call

    plan = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "task": "image", "model": "mlp", "batch_size": 8,
            "stages": 2, "partition": [2, 2], "method": "gpipe", "microbatches": 1, "tensor_parallel": 2,
            "pipeline": {"method": "gpipe", "stages": 2, "partition": [2, 2], "micro_batches": 1,
                         "tensor_parallel": 2}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    assert load_plan(path)["tensor_parallel"] == 2
    assert "micro_batches=1, tensor_parallel=2, optimizer=..." in pipeline_call(plan)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--plan", str(path)]) == 2
    assert "--tensor-parallel 2 runs 2 processes per stage: add --runtime distributed" in capsys.readouterr().err
    path.write_text(json.dumps(dict(plan, tensor_parallel=0)))
    with pytest.raises(ValueError, match="tensor_parallel must be a positive integer, got 0"):
        load_plan(path)
    del plan["tensor_parallel"]
    path.write_text(json.dumps(plan))
    assert "tensor_parallel" not in load_plan(path)  # an older plan: T = 1
