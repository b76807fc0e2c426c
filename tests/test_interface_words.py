"""Refusals in the words of the interface that was used, and errors that say where (issue 65).

A refusal that names an option names it as Python's keyword (``micro_batches=4``) to a Python
caller and as the flag (``--micro-batches 4``) on the command line; a misspelled keyword is
refused as Python refuses one, naming the nearest; the user's own error inside a stage's pass
comes back naming the rank, stage, layers, pass and micro-batch, ``from`` the original; a target
whose rows differ from the inputs' is refused at the split in the user's sizes."""
from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import pipeoptim
from pipeoptim import Pipeline
from pipeoptim.cli import build_parser, main, own_flags
from pipeoptim.errors import Shown, command_line_words, layers_of, option, placed
from pipeoptim.lab.config import LAB_OPTIONS
from pipeoptim.options import OPTIONS
from pipeoptim.runtime.microbatch import split_batch

QUICK = ["--task", "image", "--model", "mlp", "--limit", "640", "--no-progress"]
LOSS = nn.functional.mse_loss


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def mlp(last_in: int = 8) -> nn.Sequential:
    """Four layers with parameters (stage 1 of two: layers 3-5); ``last_in`` other than 8 makes
    the last layer's shape wrong for its input."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 8), nn.ReLU(),
                         nn.Linear(last_in, 2))


def data(rows: int = 8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 2, generator=g)


def cli_error(argv, capsys, tmp_path, monkeypatch) -> str:
    """The one line `pipeoptim ARGV` refuses with (exit code 2), run in this process."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1, lines
    return lines[0]


# -- one refusal, two interfaces -----------------------------------------------------------------
#: (the Pipeline's keywords, the command line's flags, what the Python refusal says, what the
#: command line's says): each the same check, reached from both sides
BOTH = [
    (dict(method="pipedream-2bw", stages=4, micro_batches=2),
     ["--method", "pipedream-2bw", "--stages", "4", "--micro-batches", "2"],
     "pipedream-2bw needs micro-batches >= stages (2 < 4); use micro_batches=4",
     "pipedream-2bw needs micro-batches >= stages (2 < 4); use --micro-batches 4"),
    (dict(method="interleaved", stages=2, micro_batches=3),
     ["--method", "interleaved", "--stages", "2", "--micro-batches", "3"],
     "interleaved needs micro-batches to be a multiple of the 2 stages (got 3); use micro_batches=2",
     "interleaved needs micro-batches to be a multiple of the 2 stages (got 3); use --micro-batches 2"),
    (dict(method="interleaved", stages=2, chunks=3),
     ["--method", "interleaved", "--stages", "2", "--chunks", "3"],
     "needs 6 layers with parameters, the model has 4: use chunks=2 or fewer stages",
     "needs 6 layers with parameters, the model has 4: use --chunks 2 or fewer stages"),
    (dict(stages=9), ["--stages", "9"],
     "9 stages need at least 9 layers with parameters; the model has 4 (of 6 layers); use stages=4 or fewer",
     "9 stages need at least 9 layers with parameters; the model has 4 (of 4 layers); use --stages 4 or fewer"),
    (dict(stages=2, partition=[2, 2, 2]), ["--stages", "2", "--partition", "3,3,1"],
     "stages=2 but partition=[2, 2, 2] makes 3 stages: drop one of them",
     "--stages 2 but --partition 3,3,1 makes 3 stages: drop one of them"),
    (dict(method="1f1b-flush", stages=2, chunks=2), ["--method", "1f1b-flush", "--stages", "2", "--chunks", "2"],
     "1f1b-flush runs one chunk per stage; chunks=2 needs a method that places several: method='interleaved'",
     "1f1b-flush runs one chunk per stage; --chunks 2 needs a method that places several: --method interleaved"),
    (dict(method="zb-v", stages=2, chunks=3), ["--method", "zb-v", "--stages", "2", "--chunks", "3"],
     "zb-v places exactly 2 chunks per stage (a V); drop chunks=3 or use method='interleaved' for 3",
     "zb-v places exactly 2 chunks per stage (a V); drop --chunks 3 or use --method interleaved for 3"),
]


@pytest.mark.parametrize("keywords, flags, python, command_line", BOTH, ids=[" ".join(c[1][:2]) for c in BOTH])
def test_a_refusal_names_the_option_as_the_interface_takes_it(keywords, flags, python, command_line, capsys,
                                                              tmp_path, monkeypatch):
    with pytest.raises(ValueError) as refused:
        Pipeline(mlp(), loss_fn=LOSS, optimizer=sgd, **keywords)
    assert python in str(refused.value)
    said = cli_error(["train", *flags, *QUICK], capsys, tmp_path, monkeypatch)
    assert command_line in said, said
    assert "micro_batches=" not in said and "stages=" not in said and "chunks=" not in said and "='" not in said


def test_too_many_micro_batches_for_the_samples_are_refused_in_each_interfaces_words(capsys, tmp_path,
                                                                                    monkeypatch):
    pipe = Pipeline(mlp(), loss_fn=LOSS, optimizer=sgd, method="gpipe", stages=2, micro_batches=16)
    with pytest.raises(ValueError) as refused:
        pipe.step(*data(8))
    assert str(refused.value) == ("cannot split a mini-batch of 8 samples into 16 micro-batches "
                                  "(use micro_batches=8 or fewer, or larger mini-batches)")
    said = cli_error(["train", "--method", "gpipe", "--micro-batches", "1000", "--stages", "2", *QUICK],
                     capsys, tmp_path, monkeypatch)
    assert said.endswith("cannot split a mini-batch of 64 samples into 1000 micro-batches "
                         "(use --micro-batches 64 or fewer, or a larger --batch-size)"), said


def test_the_command_line_spells_each_option_as_its_flag_and_python_as_its_keyword():
    assert option("micro_batches", 4) == "micro_batches=4"
    assert option("clip_scope", "global") == "clip_scope='global'"
    assert option("stages", Shown("N")) == "stages=N"
    assert option("memory_limit", 40) == "memory_limit=40"
    with command_line_words((*OPTIONS, *LAB_OPTIONS), own_flags(build_parser(), "plan")):
        assert option("micro_batches", 4) == "--micro-batches 4"
        assert option("clip_grad_norm") == "--clip-grad"           # the table's own flag name
        assert option("clip_scope", "global") == "--clip-scope global"
        assert option("partition", [3, 3, 2]) == "--partition 3,3,2"
        assert option("shard_replicas", True) == "--shard-replicas"
        assert option("batch_size") == "--batch-size"              # the lab's option
        assert option("split_points") == "split_points (Python only)"
        assert option("memory_limit", 40) == "--memory-limit 40"  # a subcommand's own (plan's)
        assert option("devices", "cuda") == "--device cuda"  # a table's flag, not plan's own --device
        with pytest.raises(ValueError, match=r"^--tensor-parallel 2 splits each stage over 2 processes: .* or "
                                             r"drop --tensor-parallel$"):
            Pipeline(mlp(), loss_fn=LOSS, optimizer=sgd, stages=2, tensor_parallel=2)
    assert option("micro_batches") == "micro_batches"  # the block left: Python's again


# -- the engine's refusals met below the Pipeline, in either interface's words ---------------------
def _refusal(call) -> str:
    """What ``call`` refuses with (a ValueError or a transport's error), or returns (a problem said)."""
    try:
        said = call()
    except (ValueError, RuntimeError) as error:
        return str(error)
    assert isinstance(said, str), said
    return said


def _layout(**settings):
    from pipeoptim.methods import get_method
    from pipeoptim.runtime.layout import plan_layout

    return lambda: plan_layout(get_method("pipeoptim"), **settings)


def _no_compiler():
    from pipeoptim.runtime.compiled import missing_toolchain

    return lambda: missing_toolchain("inductor", ("cpu",))


def _traced_tensor_layers():
    from types import SimpleNamespace

    from pipeoptim.planning import tensor_layers

    return lambda: tensor_layers(SimpleNamespace(traced=object(), name="Net"), {}, 2)


def _memory_limit():
    from pipeoptim.recommendation import recommend

    return lambda: recommend([{"method": "gpipe", "microbatches": 1, "max_stage_memory": 50,
                               "samples_per_second": 1.0}], memory_limit=40)


def _control_timeout():
    from types import SimpleNamespace

    from pipeoptim.runtime.control import _control

    def fails():
        raise RuntimeError("Connection closed by peer")
    return lambda: _control(SimpleNamespace(check_open=lambda: None, rank=1, timeout=5.0), "the losses", fails)


def _link_timeout():
    from pipeoptim.runtime.link import Link

    link = Link("activation", 1, None, 0, torch.device("cpu"), 5.0, 1)
    return lambda: (_ for _ in ()).throw(link.fail("receiving", 3, RuntimeError("Timed out")))


def _local_gpu():
    from pipeoptim.runtime.control import local_gpu

    return lambda: local_gpu(0, 0)


def _no_such_gpu():
    from pipeoptim.world import resolve_devices

    return lambda: resolve_devices("cuda:99", 2)


def _schedule(name: str, *args):
    from pipeoptim.schedules.async_1f1b import two_bw
    from pipeoptim.schedules.flush_1f1b import interleaved_1f1b

    return lambda: {"2bw": two_bw, "interleaved": interleaved_1f1b}[name](*args)


#: (what is refused, the Python words, the command line's): each text ends the refusal
BELOW = [
    (lambda: _layout(processes=4, stages=2, data_parallel=3),
     "data_parallel=3, but WORLD_SIZE 4 with 2 stages makes 2 replicas; start 6 processes or drop data_parallel",
     "--data-parallel 3, but WORLD_SIZE 4 with 2 stages makes 2 replicas; start 6 processes or drop "
     "--data-parallel"),
    (lambda: _layout(processes=6, tensor_parallel=4),
     "WORLD_SIZE 6 is not a multiple of tensor_parallel=4: start N x D x 4 processes (T per stage of each "
     "replica) or give another tensor_parallel",
     "WORLD_SIZE 6 is not a multiple of --tensor-parallel 4: start N x D x 4 processes (T per stage of each "
     "replica) or give another --tensor-parallel"),
    (lambda: _layout(stages=2, chunks=0), "chunks must be a positive number of model chunks per stage, got 0",
     "--chunks must be a positive number of model chunks per stage, got 0"),
    (lambda: _layout(stages=2, data_parallel=0), "data_parallel must be at least 1, got 0",
     "--data-parallel must be at least 1, got 0"),
    (lambda: _layout(stages=0), "stages must be at least 1, got 0", "--stages must be at least 1, got 0"),
    (lambda: lambda: __import__("pipeoptim.runtime.layout").runtime.layout.Layout(None).processes,
     "the pipeline's ranks are not known yet: give stages=N or partition",
     "the pipeline's ranks are not known yet: give --stages N or --partition"),
    (lambda: _schedule("2bw", 4, 2), "a third weight version. Use micro_batches=4 or more.",
     "a third weight version. Use --micro-batches 4 or more."),
    (lambda: _schedule("interleaved", 4, 6), "(got M=6, N=4); try micro_batches=4",
     "(got M=6, N=4); try --micro-batches 4"),
    (_no_compiler, "or pass compile='aot_eager' (no compiler, less speed)",
     "or pass --compile aot_eager (no compiler, less speed)"),
    (_traced_tensor_layers, "Net is traced (not yet priced): drop tensor_parallel, or plan an nn.Sequential model",
     "Net is traced (not yet priced): drop --tensor-parallel, or plan an nn.Sequential model"),
    (_memory_limit, "no method fits memory_limit=40 bytes per stage; the smallest, gpipe with 1 micro-batches, "
                    "needs 50 bytes",
     "no method fits --memory-limit 40 bytes per stage; the smallest, gpipe with 1 micro-batches, needs 50 bytes"),
    (_control_timeout, "slower than the timeout (5 s); see its own error, or raise timeout",
     "slower than the timeout (5 s); see its own error, or raise --timeout"),
    (_link_timeout, "see its own error, or raise timeout if stages are merely slow",
     "see its own error, or raise --timeout if stages are merely slow"),
    (_local_gpu, "devices='cuda': no CUDA device is visible to this process",
     "--device cuda: no CUDA device is visible to this process"),
    (_no_such_gpu, "CUDA device(s) visible; use devices='auto' or fewer stages per GPU",
     "CUDA device(s) visible; use --device auto or fewer stages per GPU"),
]


@pytest.mark.parametrize("made, python, command_line", BELOW, ids=[c[1][:40] for c in BELOW])
def test_a_refusal_below_the_pipeline_speaks_the_interface_in_use(made, python, command_line, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")  # (the toolchain's: no compiler here)
    call = made()
    said = _refusal(call)
    assert said.endswith(python), said
    with command_line_words((*OPTIONS, *LAB_OPTIONS), own_flags(build_parser(), "plan")):
        said = _refusal(call)
    assert said.endswith(command_line), said
    assert "='" not in said  # no Python literal on the command line


def test_the_run_logs_packages_are_refused_in_the_interface_in_use(monkeypatch):
    from pipeoptim.run_log import check_run_log

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # not installed, whether it is here or not
    with pytest.raises(ValueError, match=r"^log_dir writes TensorBoard event files"):
        check_run_log("tb", None)
    with command_line_words((*OPTIONS, *LAB_OPTIONS)), \
            pytest.raises(ValueError, match=r"^--tensorboard writes TensorBoard event files"):
        check_run_log("tb", None)  # the default: no words given, the command line's while it runs


def test_a_distributed_runs_last_line_is_the_one_process_runs(monkeypatch, tmp_path, capsys):
    """Rank 0 of `pipeoptim train --runtime distributed` ends as a run in one process does: its
    throughput labelled (lab/experiment.final_line)."""
    import torch.distributed as dist

    from pipeoptim.lab import experiment, stage_worker
    from pipeoptim.lab.config import RunConfig
    from pipeoptim.runtime import control

    summary = {"metric": "accuracy", "final_metric": 0.8125, "best_metric": 0.84375, "final_loss": 0.5,
               "samples_per_second": 1234.4, "weight_copies": [2.0, 1.0]}
    monkeypatch.setattr(control, "init_process_group", lambda **settings: None)
    monkeypatch.setattr(dist, "get_rank", lambda *group: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda *group: 2)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *group: None)
    monkeypatch.setattr(stage_worker, "_agree_on_folder", lambda out, timeout: out)
    monkeypatch.setattr(experiment, "run_experiment", lambda cfg, **settings: summary)
    for key in ("stage", "out"):
        monkeypatch.setitem(stage_worker._this_stage, key, None)
    cfg = RunConfig(task="image", model="mlp", method="gpipe", stages=2)
    assert stage_worker.worker(cfg, out=tmp_path, timeout=5.0, device="cpu", threads=1, json=False,
                               progress=False) == 0
    assert capsys.readouterr().out.splitlines() == [
        "final accuracy: 0.8125 (best 0.8438), final loss 0.5000, 1234 samples/s over the whole training "
        "(epoch-end evaluations and checkpoints included), weight copies per stage [2.0, 1.0]",
        f"run folder: {tmp_path}"]


# -- a misspelled keyword ------------------------------------------------------------------------
@pytest.mark.parametrize("keywords, says", [
    (dict(micro_batch=2), "Pipeline() got an unexpected keyword argument 'micro_batch'; did you mean micro_batches=?"),
    (dict(step="exact"), "Pipeline() got an unexpected keyword argument 'step'; did you mean steps= (an option of "
                         "pipeoptim, not of zb-h1)?"),
    (dict(method="pipeoptim", step="exact"), "Pipeline() got an unexpected keyword argument 'step'; did you mean "
                                             "steps=?"),
    (dict(epochs=2), "Pipeline() got fit()'s keyword argument 'epochs': give it to pipe.fit(loader, epochs=...)"),
    (dict(zzzq=1), "Pipeline() got an unexpected keyword argument 'zzzq'; its keywords, and each method's: "
                   "help(pipeoptim.Pipeline)"),
])
def test_a_misspelled_keyword_is_refused_naming_the_nearest(keywords, says):
    with pytest.raises(TypeError) as refused:
        Pipeline(mlp(), loss_fn=LOSS, optimizer=sgd, stages=2, **keywords)
    assert str(refused.value).startswith(says), str(refused.value)


def test_another_methods_option_names_the_methods_that_take_it():
    with pytest.raises(ValueError, match=r"^method 'zb-h1' takes no option steps \(its options: none\); steps "
                                         r"applies to pipeoptim$"):
        Pipeline(mlp(), loss_fn=LOSS, optimizer=sgd, stages=2, steps="exact")
    with pytest.raises(TypeError, match=r"'micro_batch'; did you mean micro_batches=\?$"):
        pipeoptim.train(mlp(), [data()], loss_fn=LOSS, optimizer=sgd, stages=2, micro_batch=2)


# -- the user's error in a stage -----------------------------------------------------------------
def test_a_models_error_says_the_stage_its_layers_the_pass_and_the_micro_batch():
    pipe = Pipeline(mlp(last_in=5), loss_fn=LOSS, optimizer=sgd, method="gpipe", stages=2, micro_batches=2)
    with pytest.raises(RuntimeError) as failed:
        pipe.step(*data(8))
    error = failed.value
    assert str(error) == ("stage 1 (layers 3-5: Linear, ReLU, Linear), forward of micro-batch 0 (rows 0-3) of "
                          "mini-batch 0: mat1 and mat2 shapes cannot be multiplied (4x8 and 5x2)")
    assert type(error.__cause__) is RuntimeError  # the original, its traceback kept
    assert str(error.__cause__) == "mat1 and mat2 shapes cannot be multiplied (4x8 and 5x2)"
    assert placed(error, "again") is None  # never said twice


class Refusal(Exception):
    """A user's exception made from a message: raised again as itself."""


class Coded(Exception):
    """A user's exception that needs two arguments: raised again as a RuntimeError."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(code, text)


class FailsBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fail):
        ctx.fail = fail
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.fail:
            raise Refusal("no gradient here")
        return grad, None


class Gate(nn.Module):
    """The identity, whose backward of its 4th forward in training fails (a Refusal), and whose
    forward in eval mode fails (a Coded error)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        if not self.training:
            raise Coded(7, "not in eval mode")
        self.calls += 1
        return FailsBackward.apply(x, self.calls == 4)


def as_rank_1_of_2(patch: pytest.MonkeyPatch) -> None:
    """torch.distributed as a process of a 2-process torchrun job sees it (its rank 1)."""
    from pipeoptim.runtime import pass_errors

    patch.setattr(pass_errors.dist, "is_initialized", lambda: True)
    patch.setattr(pass_errors.dist, "get_world_size", lambda *group: 2)
    patch.setattr(pass_errors.dist, "get_rank", lambda *group: 1)


def test_a_backward_an_update_and_a_forward_only_pass_say_where_too(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Gate(), nn.Linear(8, 8), nn.Linear(8, 2))
    pipe = Pipeline(model, loss_fn=LOSS, optimizer=sgd, method="gpipe", stages=2, micro_batches=2)
    pipe.step(*data(6))
    with monkeypatch.context() as patch, pytest.raises(Refusal) as failed:
        as_rank_1_of_2(patch)
        pipe.step(*data(6))
    assert str(failed.value) == ("rank 1, stage 0 (layers 0-2: Linear, Gate, Linear), backward of micro-batch 1 "
                                 "(rows 3-5) of mini-batch 1: no gradient here")
    assert type(failed.value.__cause__) is Refusal

    pipe = Pipeline(model, loss_fn=LOSS, optimizer=sgd, method="gpipe", stages=2)
    pipe.stages[0].module.eval()
    with pytest.raises(RuntimeError) as failed:
        pipe.forward(data()[0])
    assert str(failed.value) == ("stage 0 (layers 0-2: Linear, Gate, Linear), forward-only pass of batch 0: "
                                 "(7, 'not in eval mode')")
    assert type(failed.value.__cause__) is Coded

    def broken(params):
        opt = torch.optim.SGD(params, lr=0.1)
        opt.step = lambda *a, **k: (_ for _ in ()).throw(ValueError("lr schedule exhausted"))
        return opt
    pipe = Pipeline(mlp(), loss_fn=LOSS, optimizer=broken, method="gpipe", stages=2)
    with pytest.raises(ValueError, match=r"^stage \d \(layers \d-\d: .*\), update 0: lr schedule exhausted$"):
        pipe.step(*data())


def test_the_pipelines_own_errors_and_a_callbacks_stay_as_they_are():
    pipe = Pipeline(mlp(), loss_fn=lambda out, target: (out - target) ** 2, optimizer=sgd, stages=2)
    with pytest.raises(ValueError, match=r"^loss_fn must return a scalar tensor"):
        pipe.step(*data())

    def on_batch(index, loss):
        raise Refusal("stop here")
    with pytest.raises(Refusal) as stopped:
        pipeoptim.train(mlp(), [data()], loss_fn=LOSS, optimizer=sgd, stages=2, on_batch=on_batch)
    assert str(stopped.value) == "stop here" and stopped.value.__cause__ is None


def test_a_traced_pieces_layers_are_named_by_their_submodules():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(8, 8)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Linear(4, 8)
            self.blocks = nn.ModuleList([Block() for _ in range(9)])
            self.head = nn.Linear(8, 2)

    assert layers_of(Model()) == "emb, blocks.0, blocks.1, blocks.2, blocks.3, ..., head (11)"
    assert layers_of(nn.Sequential(nn.Linear(2, 2))) == "layer 0: Linear"


# -- a target whose rows are not the inputs' -----------------------------------------------------
def test_a_target_of_other_rows_than_the_inputs_is_refused_in_the_users_sizes():
    pipe = Pipeline(mlp(), loss_fn=LOSS, optimizer=sgd, method="gpipe", stages=2, micro_batches=2)
    x, y = data(8)
    with pytest.raises(ValueError) as refused:
        pipe.step(x, y[:6])
    assert str(refused.value) == (
        "the target has 6 rows but the input tensor has 8: every tensor of a mini-batch holds one row per sample "
        "along dimension 0, where it is split into 2 micro-batches; give the target 8 rows, one per sample of the "
        "input tensor")
    labels = torch.zeros(6, 5, dtype=torch.long)  # a causal LM's labels are the rows of its input_ids
    with pytest.raises(ValueError, match=r"^batch\['labels'\] has 6 rows but batch\['input_ids'\] has 8: "):
        split_batch({"input_ids": torch.zeros(8, 5, dtype=torch.long), "labels": labels}, labels, 2)
    with pytest.raises(ValueError, match=r"^inputs\[1\] has 3 rows but inputs\[0\] has 8: "):
        split_batch((x, torch.zeros(3)), y, 2)


def test_what_is_no_row_of_anything_is_not_refused():
    x, y = data(8)
    kept = split_batch((x, torch.tensor(0.5)), y, 1)  # one micro-batch: as given, the scalar too
    assert kept[0][0][1].item() == 0.5 and len(split_batch((x, x[:, :1]), y, 4)) == 4
    from pipeoptim.runtime.microbatch import _check_parts
    _check_parts((x, torch.tensor(0.5)), 2, y)  # a 0-dim tensor has no rows to disagree on
