"""Compiled stages (runtime/compiled.py, ``Pipeline(compile=...)``): the same losses as eager for
every method, in one process and under torchrun, one graph per stage however the weight versions
swap, one more at most for a mini-batch of another size, and the refusals naming the fix.

The compiled runs share one model shape, so inductor's on-disk cache compiles each distinct
stage graph once for the whole file (about 20 s cold on one core, under 1 s warm)."""
import json

import pytest
import torch
from torch import nn

import pipeoptim
from pipeoptim.methods import method_names
from pipeoptim.prepare import check_compile
from pipeoptim.runtime.compiled import missing_toolchain
from traced_models import TinyGPT, lm_batches, lm_loss

REL = 1e-5  #: compiled against eager: inductor fuses differently, so not bit for bit


def mlp(method: str = "pipeoptim", width: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4)]
    if pipeoptim.get_method(method).chunks > 1:  # 2 stages x 2 chunks: a layer with weights for each
        layers[2:2] = [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def batches(count: int = 8, size: int = 8, last: int = 8):
    g = torch.Generator().manual_seed(1)
    sizes = [size] * (count - 1) + [last]
    return [(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)) for n in sizes]


def pipeline(method: str, compile, **settings) -> pipeoptim.Pipeline:
    return pipeoptim.Pipeline(mlp(method), method=method, stages=1 if method == "sequential" else 2,
                              loss_fn=nn.functional.mse_loss, compile=compile,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), **settings)


def close(a, b):
    return all(abs(x - y) <= REL * abs(x) for x, y in zip(a, b)) and len(a) == len(b)


@pytest.fixture(scope="module")
def every_method():
    """{method: (eager losses, compiled losses, compilations per stage after 8 mini-batches,
    compilations after 8 more)} with inductor, one process."""
    out = {}
    data = batches()
    for method in method_names():
        eager = pipeline(method, False).fit(data).losses
        pipe = pipeline(method, True)
        compiled = pipe.fit(data).losses
        first = list(pipe.compilations)
        pipe.fit(data)  # another segment: the versions go on swapping
        out[method] = (eager, compiled, first, list(pipe.compilations))
    return out


@pytest.mark.parametrize("method", method_names())
def test_compiled_losses_equal_eager_for_every_method(every_method, method):
    eager, compiled, _, _ = every_method[method]
    assert close(eager, compiled), (eager, compiled)


@pytest.mark.parametrize("method", method_names())
def test_weight_version_swaps_compile_nothing(every_method, method):
    """One graph per stage (per chunk of an interleaved or V schedule) after 8 mini-batches in
    which the versions swap at every pass, and still one after 8 more."""
    _, _, first, later = every_method[method]
    stages = 1 if method == "sequential" else 2 * pipeoptim.get_method(method).chunks
    assert first == [1] * stages
    assert later == first


def test_the_result_reports_each_stages_compilations():
    result = pipeline("pipeoptim", True).fit(batches(4))
    assert result.metrics["compilations"] == [1, 1]
    assert pipeline("pipeoptim", False).fit(batches(2)).metrics["compilations"] == [None, None]


@pytest.mark.parametrize("method", ["1f1b-flush", "pipeoptim"])
def test_a_last_mini_batch_of_another_size_recompiles_at_most_once(method):
    data = batches(8, size=8, last=5)
    eager = pipeline(method, False).fit(data, epochs=2).losses
    pipe = pipeline(method, True)
    pipe.fit(data)
    after_one = list(pipe.compilations)
    both = pipe.fit(data).losses  # the same sizes again: nothing new (a Pipeline's losses so far)
    assert close(eager, both)
    assert all(1 <= n <= 2 for n in after_one), after_one
    assert pipe.compilations == after_one


@pytest.mark.parametrize("method,settings", [("pipeoptim", {"recompute": True}), ("zb-v", {"recompute": True}),
                                             ("pipedream", {"precision": "bf16"}),
                                             ("1f1b-flush", {"clip_grad_norm": 0.05, "clip_scope": "global"})])
def test_compiled_with_other_settings_equals_eager(method, settings):
    data = batches(6)
    eager = pipeline(method, False, **settings).fit(data).losses
    pipe = pipeline(method, "aot_eager", **settings)  # the settings' paths, without inductor's rounding
    assert pipe.fit(data).losses == eager
    assert pipe.compilations == [1] * len(pipe.compilations)


@pytest.mark.parametrize("method", ["1f1b-flush", "pipeoptim"])
def test_a_compiled_traced_gpt_with_tied_weights_equals_eager(method):
    """A traced model (GraphModule stages) whose head is tied to the embedding: the owner's
    values travel into the holder's compiled graph as inputs."""
    data = lm_batches(4)
    losses = []
    for compile in (False, "aot_eager"):  # the tied values' path (inductor's kernels: the MLP tests')
        torch.manual_seed(0)
        pipe = pipeoptim.Pipeline(TinyGPT(layers=2), method=method, stages=2, loss_fn=lm_loss, compile=compile,
                                  optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), example_input=data[0][0],
                                  partitioner="params")  # the same cut in both runs (not by measured time)
        losses.append(pipe.fit(data).losses)
    assert losses[1] == losses[0]
    assert pipe.compilations == [1, 1]


def test_compile_refusals_name_the_fix(monkeypatch):
    with pytest.raises(ValueError, match="no backend of that name; use one of inductor"):
        pipeline("pipeoptim", "no-such-backend")
    with pytest.raises(ValueError, match="must be True, False or a torch.compile backend"):
        pipeline("pipeoptim", 3)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    problem = missing_toolchain("inductor", ("cpu",))
    assert problem.startswith("compile=True on the CPU needs a C++ compiler") and "\n" not in problem
    with pytest.raises(ValueError, match="needs a C\\+\\+ compiler .* or pass compile='aot_eager'"):
        pipeline("pipeoptim", True)
    assert missing_toolchain("aot_eager", ("cpu",)) is None and missing_toolchain("inductor", ("cuda",)) is None
    pipeline("pipeoptim", "aot_eager")  # needs no compiler
    monkeypatch.delenv("CXX")

    class Settings:
        shard_replicas, compile, devices = True, "inductor", "cpu"
    with pytest.raises(ValueError, match="compile and shard_replicas do not run together yet"):
        check_compile(Settings())


#: the methods of the torchrun test (bidirectional under torchrun: tests/test_torchrun.py, test_bidirectional.py)
UNDER_TORCHRUN = [m for m in method_names() if m != "sequential" and not pipeoptim.get_method(m).mirrored]


def test_compiled_every_method_under_torchrun_equals_eager(torchrun_2):
    """Two processes, one stage each: the same losses compiled and eager for every method, one
    graph per stage (per chunk) on each rank. With aot_eager (torch's graphs run by eager
    kernels) the losses are equal to the bit: what the distributed executor adds to a compiled
    stage is exact; inductor's rounding is the one-process tests'. (The "compiled" script,
    tests/torchrun_compiled.py, of tests/conftest.py's 2-process job.)"""
    rows = {r["method"]: r for r in torchrun_2.rows("compiled")}
    assert sorted(rows) == sorted(UNDER_TORCHRUN)
    for method, row in rows.items():
        assert row["compiled"] == row["eager"], (method, row)
        assert row["compilations"] == [1] * (2 * pipeoptim.get_method(method).chunks), (method, row)
        assert row["eager_compilations"] == [None] * len(row["compilations"])


def test_the_command_line_compiles_and_reports_each_stages_graphs(tmp_path, capsys):
    from pipeoptim.cli import main
    assert main(["train", "--task", "image", "--model", "mlp", "--method", "pipeoptim", "--stages", "2",
                 "--epochs", "1", "--limit", "256", "--compile", "aot_eager", "--out", str(tmp_path / "run"),
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["compilations"] == [1, 1]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["compile"] == "aot_eager"
