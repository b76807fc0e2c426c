"""study/study2_times.py, the study's predicted seconds per mini-batch: the lookup the
report uses (and its messages), the micro-batches the study's runs use, the table's invariants
on a made-up profile (exact) and on a real profile of a tiny model, and the file's two parts
(part 1 keeps the check at N = 2, the check keeps part 1), with the bench stubbed and made-up
images."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from study.tests.helpers import mlp
from study import study2_times
from pipeoptim.throughput import profile_sizes, scaled_profile
from pipeoptim.profile import LayerProfile, ModelProfile
from pipeoptim.checks import check_run
from pipeoptim.config import PipelineConfig
from pipeoptim.methods import get_method
from pipeoptim.runtime.layout import plan_layout

ASYNC_1F1B = ("async-naive", "pipedream", "spectrain", "pipeoptim")  # one schedule, one micro-batch, no flush
ALL = ["sequential", "gpipe", "1f1b-flush", "async-naive", "pipedream", "pipedream-2bw", "spectrain", "xpipe",
       "pipeoptim"]


@pytest.fixture(scope="module")
def times_mod():
    return study2_times


def _times():
    at8 = {"methods": {"gpipe": {"seconds_per_batch": 0.05}, "pipeoptim": {"seconds_per_batch": 0.02}}}
    cell = {"sequential": {"seconds_per_batch": 0.1}, "stages": {"8": at8}}
    return {"format": "pipeoptim-study2-times", "predict": {"cells": {"image": {"momentum": cell}}}}


def test_lookup(times_mod):
    times = _times()
    assert times_mod.seconds_per_batch(times, "image", "momentum", 8, "pipeoptim") == 0.02
    assert times_mod.seconds_per_batch(times, "image", "momentum", 8, "gpipe") == 0.05
    # sequential has one device whatever N; a variant with options times as its method
    assert times_mod.seconds_per_batch(times, "image", "momentum", 4, "sequential") == 0.1
    assert times_mod.seconds_per_batch(times, "image", "momentum", 8, "pipeoptim+lr_correction") == 0.02


@pytest.mark.parametrize("args, message", [
    (("lm", "adamw", 8, "pipeoptim"), "no predicted times for task 'lm' (the file has: image)"),
    (("image", "adamw", 8, "pipeoptim"),
     "no predicted times for task 'image' with optimizer 'adamw' (it has: momentum)"),
    (("image", "momentum", 4, "pipeoptim"), "no predicted times for image x momentum at N = 4 (it has N = 8)"),
    (("image", "momentum", 8, "xpipe"),
     "no predicted time of method 'xpipe' for image x momentum at N = 8 (it has: gpipe, pipeoptim)"),
])
def test_lookup_says_what_is_missing(times_mod, args, message):
    with pytest.raises(KeyError) as caught:
        times_mod.seconds_per_batch(_times(), *args)
    assert str(caught.value) == message
    with pytest.raises(times_mod.MissingTime, match="no predictions"):
        times_mod.seconds_per_batch({"format": "pipeoptim-study2-times"}, *args)


def test_methods_and_microbatches_are_the_studys(times_mod):
    suite = times_mod.SUITES["default"]
    assert times_mod.study_methods(suite) == ALL
    model = mlp(depth=8)
    for n in (4, 8):
        for method in ALL:
            meth = get_method(method)
            spec = check_run(PipelineConfig.of(method=method, stages=n), model, meth, plan_layout(meth, stages=n))
            assert times_mod.study_microbatches(method, n) == spec.microbatches
    defaults = ("gpipe", "1f1b-flush", "pipedream-2bw", "xpipe", "pipeoptim")
    assert [times_mod.study_microbatches(m, 8) for m in defaults] == [8, 8, 8, 2, 1]
    assert times_mod.microbatch_counts(ALL, [4, 8]) == [1, 2, 4, 8]


def _made_up_profile(layers: int, batch: int) -> ModelProfile:
    """Layer k: forward (1 + k % 3) ms, backward twice that, update 0.1 ms (uneven stages)."""
    rows = [LayerProfile(index=k, name="Linear", forward=1e-3 * (1 + k % 3), backward=2e-3 * (1 + k % 3),
                         output_bytes=1000, saved_bytes=1000, saved_input_bytes=0, saved_output_bytes=0,
                         parameter_bytes=4000, parameters=1000, update=1e-4, optimizer_bytes=4000)
            for k in range(layers)]
    return ModelProfile(layers=rows, device="cpu", batch_size=batch, input_bytes=1000, warmup=0, repeats=1,
                        threads=1, loss_forward=1e-4, loss_backward=1e-4)


def _check_table(times_mod, table, stage_counts, batches, costs_are_fixed: bool = True):
    """The structure and what must hold for the simulator, whatever the costs. With a measured
    profile (``costs_are_fixed=False``) the comparison of a flushing pipeline with an asynchronous
    one depends on timings of micro-batches of other sizes, which a loaded machine can reorder:
    only the structure is checked."""
    assert table["batches"] == batches
    seq = table["sequential"]
    assert seq["microbatches"] == 1 and seq["seconds_per_batch"] > 0
    assert sorted(table["stages"]) == sorted(str(n) for n in stage_counts)
    for n in stage_counts:
        at_n = table["stages"][str(n)]
        rows = at_n["methods"]
        assert list(rows) == ALL[1:] and len(at_n["partition"]) == n == len(at_n["stage_seconds"])
        assert sum(at_n["partition"]) == table["layers"]
        for method, row in rows.items():
            assert row["microbatches"] == times_mod.study_microbatches(method, n)
            assert row["seconds_per_batch"] > 0
        # one schedule (asynchronous 1F1B, no flush), one micro-batch: the same time, exactly
        assert len({rows[m]["seconds_per_batch"] for m in ASYNC_1F1B}) == 1
        # a flush before every update costs a fill and a drain per mini-batch
        for method in ("gpipe", "1f1b-flush"):
            if costs_are_fixed:
                assert rows[method]["seconds_per_batch"] > rows["async-naive"]["seconds_per_batch"]


def test_table_invariants_on_a_made_up_profile(times_mod):
    net, batch, batches = mlp(depth=8), 64, 200
    full = _made_up_profile(len(net), batch)
    # micro-batch costs proportional to their samples (the planner's linear scaling): deterministic
    profiles = {m: scaled_profile(full, -(-batch // m) / batch) if m > 1 else full for m in (1, 2, 4, 8)}
    model = times_mod.ProfiledModel(net, batch, profiles, times_mod.ProfileSettings(stage_timing="profile"))
    table = times_mod.cell_table(model, [4, 8], ALL, batches)
    _check_table(times_mod, table, [4, 8], batches)
    seq = table["sequential"]
    # sequential: forward, backward (the loss's included) and update of every layer, one after the other
    whole = sum(3e-3 * (1 + k % 3) for k in range(8)) + 2e-4
    assert seq["stage_seconds"] == [pytest.approx(whole)]
    assert seq["seconds_per_batch"] == pytest.approx(whole + 8 * 1e-4)
    for n in ("4", "8"):
        at_n = table["stages"][n]
        assert sum(at_n["stage_seconds"]) == pytest.approx(whole)  # the stages add up to the model
        rows = at_n["methods"]
        # steady state: a mini-batch every slowest stage's forward + backward (+ its update),
        # plus one fill and drain spread over the 200 mini-batches
        cycle = max(at_n["stage_seconds"]) + at_n["update_seconds"]
        assert cycle < rows["async-naive"]["seconds_per_batch"] < 1.1 * cycle
        assert rows["async-naive"]["seconds_per_batch"] < seq["seconds_per_batch"]
        # with costs linear in the samples, the micro-batched flush-free methods run as fast as
        # one micro-batch per update (a fill and drain apart)
        for method in ("xpipe", "pipedream-2bw"):
            assert rows[method]["seconds_per_batch"] == pytest.approx(rows["async-naive"]["seconds_per_batch"], rel=0.1)
    # the same pipeline on more stages is faster (uniform split of equal-cost groups)
    assert table["stages"]["8"]["methods"]["pipeoptim"]["seconds_per_batch"] \
        < table["stages"]["4"]["methods"]["pipeoptim"]["seconds_per_batch"]


def test_table_of_a_real_profile(times_mod):
    """A real profile (tiny model, one repeat), stages timed as the runtime runs them."""
    torch.manual_seed(0)
    net, batch = mlp(depth=4), 8
    x, y = torch.randn(batch, 6, dtype=torch.float64), torch.randint(0, 4, (batch,))
    loss = torch.nn.functional.cross_entropy
    settings = times_mod.ProfileSettings(warmup=0, repeats=1)
    counts = times_mod.microbatch_counts(ALL, [2, 4])
    profiles = profile_sizes(net, x, y, loss, batch_size=batch, microbatches=counts, warmup=0, repeats=1)
    model = times_mod.ProfiledModel(net, batch, profiles, settings, x, y, loss,
                                    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    table = times_mod.cell_table(model, [4, 2], ALL, 16)
    _check_table(times_mod, table, [4, 2], 16, costs_are_fixed=False)
    assert set(model.timings) == {((4,), 8), ((2, 2), 8), ((2, 2), 4), ((1, 1, 1, 1), 8),
                                  ((1, 1, 1, 1), 4), ((1, 1, 1, 1), 2)}  # each split and size timed once


def _sorted_everywhere(text: str) -> bool:
    ok = []
    json.loads(text, object_pairs_hook=lambda pairs: ok.append([k for k, _ in pairs] == sorted(k for k, _ in pairs)))
    return all(ok)


def test_both_parts_write_their_own_section(times_mod, tiny_images, tmp_path, monkeypatch, capsys):
    out = tmp_path / "times.json"
    quick = ["--suite", "smoke", "--out", str(out), "--warmup", "0", "--repeats", "1"]

    def fake_bench(argv):  # what `pipeoptim bench` writes, with made-up figures
        path = Path(argv[argv.index("--out") + 1])
        methods = argv[argv.index("--methods") + 1].split(",")
        sps = {"sequential-1dev": 1000.0, "sequential-all": 1500.0, **{m: 1600.0 for m in methods}}
        path.write_text(json.dumps({"samples_per_second": sps, "settings": {"partition": [2, 2]},
                                    "detail": {m: {"microbatches": 2 if m in ("gpipe", "1f1b-flush") else 1}
                                               for m in sps}, "load_average": {"before": [0, 0, 0]}}))
        return 0

    monkeypatch.setattr("pipeoptim.cli.main", fake_bench)
    assert times_mod.main(quick + ["--check-n2"]) == 0
    assert times_mod.main(quick + ["--stage-timing", "profile"]) == 0  # part 1 after the check
    text = out.read_text()
    assert _sorted_everywhere(text)
    times = json.loads(text)
    check = times["check_n2"]["cells"]["image"]["momentum"]
    assert check["partition"] == [2, 2] and check["bench_batches"] == 32
    for method in ("sequential", "gpipe", "1f1b-flush", "async-naive", "pipeoptim"):
        row = check["methods"][method]
        measured = 32 / (1000.0 if method == "sequential" else 1600.0)  # batch 32 / samples per second
        assert row["measured_seconds_per_batch"] == pytest.approx(measured, rel=1e-3)
        assert row["measured_over_predicted"] == pytest.approx(measured / row["seconds_per_batch"], rel=2e-3)
        assert row["microbatches"] == row["measured_microbatches"]
    cell = times["predict"]["cells"]["image"]["momentum"]
    assert cell["batches"] == 12 and cell["settings"]["stage_timing"] == "profile"  # 384 images / 32
    assert cell["settings"]["threads"] == 1 and cell["settings"]["repeats"] == 1
    assert set(cell["load_average"]) == {"start", "end"}
    assert times_mod.seconds_per_batch(times, "image", "momentum", 2, "pipeoptim") > 0
    # the check again: part 1 stays; --resume skips part 1's cell
    assert times_mod.main(quick + ["--check-n2"]) == 0
    assert json.loads(out.read_text())["predict"] == times["predict"]
    capsys.readouterr()
    assert times_mod.main(quick + ["--stage-timing", "profile", "--resume"]) == 0
    assert "skipped" in capsys.readouterr().out
    assert json.loads(out.read_text())["predict"]["cells"] == times["predict"]["cells"]
