"""Several stages per process (issue 26 item 2): Megatron's interleaved placement, stage k of N
holding chunks k, k + N, ... of the model, run as the method `interleaved` (1F1B over the chunks,
a flush before each update); and the V shape of `zb-v` (stage k holds chunks k and 2N-1-k, split
backwards). Both equal `sequential` with the same micro-batches: losses and final weights."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeoptim
from conftest import Crash, batches, crash_at, mlp
from pipeoptim.methods import get_method

LOSS = nn.functional.cross_entropy


def sgdm(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def _train(method, **kw):
    return pipeoptim.train(mlp(depth=8), batches(6), method=method, loss_fn=LOSS,
                           optimizer=kw.pop("optimizer", sgdm), **kw)


def _assert_equal(got, expected):
    assert len(got.losses) == len(expected.losses) == 6
    assert got.losses == pytest.approx(expected.losses, rel=1e-12, abs=0)
    for (name, a), b in zip(got.model.named_parameters(), expected.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=name)
    # the run trained: every weight moved from its initial value
    for a, b in zip(expected.model.parameters(), mlp(depth=8).parameters()):
        assert (a - b).abs().max() > 1e-4


@pytest.mark.parametrize("optimizer", [sgdm, adam], ids=["momentum", "adam"])
@pytest.mark.parametrize("n,m", [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_interleaved_two_chunks_equals_sequential(n, m, optimizer):
    reference = _train("sequential", micro_batches=m, optimizer=optimizer)
    got = _train("interleaved", stages=n, chunks=2, micro_batches=m, optimizer=optimizer)
    _assert_equal(got, reference)


@pytest.mark.parametrize("n,m", [(2, 2), (2, 4), (4, 4), (4, 8), (3, 5)])
def test_zb_v_equals_sequential(n, m):
    reference = _train("sequential", micro_batches=m, optimizer=adam)
    got = _train("zb-v", stages=n, micro_batches=m, optimizer=adam)
    _assert_equal(got, reference)


def test_zb_v_places_its_chunks_in_a_v_and_splits_the_backward():
    pipe = pipeoptim.Pipeline(mlp(depth=8), method="zb-v", stages=3, loss_fn=LOSS, optimizer=sgdm)
    assert (pipe.spec.stages, pipe.spec.chunks, pipe.placement) == (6, 2, [0, 1, 2, 2, 1, 0])
    schedule = pipe._schedule_for(1)
    assert schedule.stage_to_rank == pipe.placement and schedule.split_backward
    assert schedule.stages_of_rank(0) == [0, 5]  # the first and the last stage on one process
    pipe.step(*batches(1)[0])
    pipe.flush()
    kinds = {e.kind for stage in pipe.stages for e in stage.record.trace}
    assert kinds == {"F", "I", "W"}


def test_zb_v_shrinks_the_bubble_further_than_zb_h1():
    """The simulator, equal costs (a whole stage: F = 2, B = 4, W = half of B; a chunk half of
    that), N = 4, M = 8, two mini-batches: 1F1B 132, ZB-H1 108, ZB-V 102; no deadlock at any
    N <= 8, M <= 2N."""
    from pipeoptim.schedules import Costs, simulate

    def makespan(method, chunks, f):
        schedule = get_method(method).build_schedule(4, 8, 2)
        return simulate(schedule, Costs.uniform(4 * chunks, f, 2 * f)).makespan

    assert (makespan("1f1b-flush", 1, 2.0), makespan("zb-h1", 1, 2.0), makespan("zb-v", 2, 1.0)) == (132, 108, 102)
    for n in range(1, 9):
        for m in range(1, 2 * n + 1):
            simulate(get_method("zb-v").build_schedule(n, m, 1), Costs.uniform(2 * n))


def test_the_stages_hold_the_chunks_megatron_places():
    pipe = pipeoptim.Pipeline(mlp(depth=8), method="interleaved", stages=2, loss_fn=LOSS, optimizer=sgdm)
    assert (pipe.spec.stages, pipe.spec.chunks, pipe.spec.ranks) == (4, 2, 2)  # chunks = 2: the default
    assert pipe.spec.partition == [2, 2, 2, 2] and len(pipe.stages) == 4
    schedule = pipe._schedule_for(1)
    assert schedule.stage_to_rank == [0, 1, 0, 1] and schedule.num_ranks == 2
    assert [a.stage for a in schedule.orders[0] if a.kind.value == "F"] == [0, 0, 2, 2]
    # three chunks over 2 stages: 6 pieces of an 8-layer model, rank 1 holding pieces 1, 3, 5
    three = pipeoptim.Pipeline(mlp(depth=8), method="interleaved", stages=2, chunks=3, loss_fn=LOSS,
                               optimizer=sgdm, partition=[2, 1, 1, 2, 1, 1])
    assert three._schedule_for(1).stages_of_rank(1) == [1, 3, 5]
    assert [sum(1 for _ in s.module.parameters()) for s in three.stages] == [4, 2, 2, 4, 2, 2]


def test_three_chunks_and_global_clipping_equal_sequential():
    reference = _train("sequential", micro_batches=2, clip_grad_norm=0.3, clip_scope="global")
    got = _train("interleaved", stages=2, chunks=3, micro_batches=2, clip_grad_norm=0.3, clip_scope="global")
    _assert_equal(got, reference)
    unclipped = _train("sequential", micro_batches=2)
    assert unclipped.losses[-1] != pytest.approx(reference.losses[-1], rel=1e-6)  # the clipping acted


def test_stepping_by_hand_equals_fit_and_the_trace_has_every_chunk():
    data = batches(5)
    pipe = pipeoptim.Pipeline(mlp(depth=8), method="interleaved", stages=2, loss_fn=LOSS, optimizer=sgdm)
    got = []
    for x, y in (b for b in data):  # a generator: the horizon grows as data comes
        got += pipe.step(x, y)
    got += pipe.flush()
    listed = pipeoptim.train(mlp(depth=8), data, method="interleaved", stages=2, loss_fn=LOSS, optimizer=sgdm)
    assert got == listed.losses and len(got) == 5
    for stage in pipe.stages:  # every chunk ran F and B of each of the 10 micro-batches
        assert sorted(e.microbatch for e in stage.record.trace if e.kind == "F") == list(range(10))


@pytest.mark.parametrize("kw,message", [
    (dict(stages=4, chunks=3), "needs 12 layers with parameters, the model has 8: use chunks=2 or fewer stages"),
    (dict(method="zb-v", stages=8), "zb-v with 8 stages x 2 pieces needs 16 layers with parameters, the model has "
                                    "8: use fewer stages (at most 4) or a one-chunk method (1f1b-flush, zb-h1)"),
    (dict(stages=2, micro_batches=3), "multiple of the 2 stages (got 3); use micro_batches=2"),
    (dict(stages=2, partition=[2, 2, 4]), "lists stages x 2 entries"),
    (dict(stages=2, chunks=0), "chunks must be a positive number"),
    (dict(method="1f1b-flush", stages=2, chunks=2), "chunks=2 needs a method that places several: "
                                                     "method='interleaved'"),
    (dict(method="zb-v", stages=2, chunks=3), "zb-v places exactly 2 chunks per stage"),
])
def test_bad_chunks_are_refused_with_the_fix(kw, message):
    kw = {"method": "interleaved", **kw}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pipeoptim.Pipeline(mlp(depth=8), loss_fn=LOSS, optimizer=sgdm, **kw)


def test_interleaving_shrinks_the_bubble_the_simulator_predicts():
    """The reason to run it: at N = 4, M = 8, equal stages, the bubble of 1F1B over 2 chunks is
    half 1F1B's ((N - 1) / V of a stage's work per micro-batch instead of N - 1)."""
    from pipeoptim.schedules import Costs, simulate

    flush = simulate(get_method("1f1b-flush").build_schedule(4, 8, 1), Costs.uniform(4, 1.0, 2.0))
    inter = simulate(get_method("interleaved").build_schedule(4, 8, 1), Costs.uniform(8, 0.5, 1.0))
    assert flush.makespan == pytest.approx((8 + 3) * 3.0)
    assert inter.makespan == pytest.approx(8 * 3.0 + 3 * 3.0 / 2)


def test_the_command_lines_chunks_train_as_sequential(tmp_path, capfd):
    """`pipeoptim train --method interleaved --chunks 2`: the image MLP's 4 blocks over 2 stages
    x 2 chunks, the same losses and test metric as `sequential` with the same 2 micro-batches."""
    import json

    from pipeoptim.cli import main
    from pipeoptim.lab.tasks import MissingDataError, get_task

    try:
        get_task("image").load(batch_size=32, limit=256, seed=0)
    except MissingDataError as error:
        pytest.skip(f"needs Fashion-MNIST: {error}")
    args = ["train", "--task", "image", "--model", "mlp", "--limit", "256", "--batch-size", "32",
            "--epochs", "1", "--optimizer", "momentum", "--lr", "0.01", "--micro-batches", "2",
            "--lr-schedule", "constant", "--no-progress", "--json"]
    runs = []
    for flags in (["--method", "sequential"], ["--method", "interleaved", "--stages", "2", "--chunks", "2"],
                  ["--method", "interleaved", "--partition", "1,1,1,1"]):
        assert main([*args, "--out", str(tmp_path / str(len(runs))), *flags]) == 0
        runs.append(json.loads(capfd.readouterr().out))
    config = json.loads((tmp_path / "1" / "config.json").read_text())
    assert (config["chunks"], config["stages"]) == (2, 2)
    assert json.loads((tmp_path / "2" / "config.json").read_text())["stages"] == 2  # 4 pieces / 2 chunks
    assert len(runs[0]["losses"]) == 8
    for run in runs[1:]:
        assert run["losses"] == pytest.approx(runs[0]["losses"], rel=1e-6)
        assert run["final_metric"] == pytest.approx(runs[0]["final_metric"], rel=1e-6)
    assert main(["train", "--chunks", "0"]) == 2
    assert "--chunks must be at least 1, got 0" in capfd.readouterr().err


def test_the_command_line_under_torchrun_equals_one_process(tmp_path, capfd):
    """`pipeoptim train --runtime distributed --method interleaved --chunks 2`: two processes,
    each holding 2 of the 4 pieces (rank 0: pieces 0 and 2), the local runtime's losses and metric."""
    import json

    from pipeoptim.cli import main
    from pipeoptim.lab.tasks import MissingDataError, get_task

    try:
        get_task("image").load(batch_size=32, limit=256, seed=0)
    except MissingDataError as error:
        pytest.skip(f"needs Fashion-MNIST: {error}")
    args = ["train", "--task", "image", "--model", "mlp", "--limit", "256", "--batch-size", "32",
            "--epochs", "1", "--optimizer", "momentum", "--lr", "0.01", "--method", "interleaved",
            "--stages", "2", "--chunks", "2", "--lr-schedule", "constant", "--no-progress", "--json"]
    runs = []
    for flags in ([], ["--runtime", "distributed", "--device", "cpu"]):
        assert main([*args, "--out", str(tmp_path / str(len(runs))), *flags]) == 0
        runs.append(json.loads(capfd.readouterr().out))
    assert len(runs[0]["losses"]) == 8
    assert runs[1]["losses"] == pytest.approx(runs[0]["losses"], rel=1e-6)
    assert runs[1]["final_metric"] == pytest.approx(runs[0]["final_metric"], rel=1e-6)


def chunked_partition(method: str) -> list:
    """``pipeoptim train`` of the image MLP cut into 4 pieces (``--partition 1,1,1,1``) by ``method``."""
    return ["train", "--task", "image", "--model", "mlp", "--limit", "128", "--batch-size", "32",
            "--epochs", "1", "--optimizer", "momentum", "--lr", "0.01", "--method", method,
            "--partition", "1,1,1,1", "--lr-schedule", "constant", "--no-progress", "--json"]


def under_users_torchrun(method: str, out) -> list:
    """The arguments of ``torchrun ... -m pipeoptim`` for :func:`chunked_partition`."""
    return [*chunked_partition(method), "--runtime", "distributed", "--device", "cpu", "--out", str(out)]


@pytest.mark.parametrize("method", ["interleaved", "zb-v"])
def test_a_chunked_partition_under_the_users_torchrun_equals_one_process(tmp_path, capfd, method, request):
    """`torchrun --nproc-per-node 2 -m pipeoptim train --runtime distributed --partition 1,1,1,1`:
    4 pieces, 2 chunks per process, so 2 stages on the job's 2 processes (the worker once
    counted the partition's pieces against the processes and refused it), the local run's losses.
    (A torchrun job runs the command line once, as its last script: zb-v in tests/conftest.py's
    2-process job, interleaved in the job of ``bitpipe_resumed`` below.)"""
    import json

    from pipeoptim.cli import main
    from pipeoptim.lab.tasks import MissingDataError, get_task

    try:
        get_task("image").load(batch_size=32, limit=128, seed=0)
    except MissingDataError as error:
        pytest.skip(f"needs Fashion-MNIST: {error}")
    assert main([*chunked_partition(method), "--out", str(tmp_path / "local")]) == 0
    local = json.loads(capfd.readouterr().out)
    job = request.getfixturevalue("torchrun_2" if method == "zb-v" else "bitpipe_resumed")
    spread = json.loads("\n".join(job.lines(f"cli-{method}", rank=0)))
    assert (spread["stages"], local["stages"], len(local["losses"])) == (4, 4, 4)  # pieces
    assert spread["losses"] == pytest.approx(local["losses"], rel=1e-6)


@pytest.mark.parametrize("method", ["interleaved", "zb-v"])
def test_a_checkpointed_run_resumes_to_the_same_losses_and_loads_into_one_chunk(tmp_path, method):
    """Checkpoints hold every chunk (each stage's own file); a run cut after a checkpoint
    resumes to the uninterrupted losses; the state dict loads into a 1f1b-flush Pipeline of
    another partition by parameter names."""
    def run(folder, **kw):
        return pipeoptim.train(mlp(depth=8), batches(6), method=method, stages=2, loss_fn=LOSS,
                               optimizer=adam, epochs=2, checkpoint_dir=folder, checkpoint_every=2, **kw)

    expected = run(tmp_path / "full").losses
    assert len(expected) == 12

    with pytest.raises(Crash):
        run(tmp_path / "cut", on_batch=crash_at(9))
    assert run(tmp_path / "cut", resume=True).losses == expected

    pipe = pipeoptim.Pipeline(mlp(depth=8), method=method, stages=2, loss_fn=LOSS, optimizer=adam)
    for x, y in batches(2):
        pipe.step(x, y)
    pipe.flush()
    state = pipe.state_dict()
    # every chunk's optimizer state, in stage order: piece k holds layers 2k and 2k+1
    assert [sorted({name.split(".")[0] for name in s["optimizer"]["state"]}) for s in state["stages"]] == \
        [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    other = pipeoptim.Pipeline(mlp(depth=8), method="1f1b-flush", stages=2, loss_fn=LOSS, optimizer=adam)
    state["method"] = "1f1b-flush"
    other.load_state_dict(state)
    for (name, a), b in zip(other.model().named_parameters(), pipe.model().parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_bench_runs_the_chunked_methods(tmp_path, capfd):
    """`pipeoptim bench --methods interleaved,zb-v,bitpipe`: the blocks model cut into stages x 2
    pieces (a partition of one entry per stage would be refused; bitpipe: the same 4 pieces, each
    twice), two processes each; each run's bubble measured beside the simulator's, and the bytes
    each process holds."""
    import json

    from pipeoptim.cli import main

    assert main(["bench", "--synthetic", "--batches", "2", "--warmup", "1", "--batch-size", "16",
                 "--methods", "interleaved,zb-v,bitpipe", "--no-baselines", "--repeats", "1", "--json",
                 "--out", str(tmp_path / "bench.json"), "--timeout", "60"]) == 0
    result = json.loads(capfd.readouterr().out)
    detail = result["detail"]
    assert set(result["samples_per_second"]) == {"interleaved", "zb-v", "bitpipe"}
    assert all(v > 0 for v in result["samples_per_second"].values())
    assert detail["interleaved"]["microbatches"] == detail["zb-v"]["microbatches"] == detail["bitpipe"]["microbatches"] == 2
    assert detail["interleaved"]["partition"] == detail["zb-v"]["partition"] == detail["bitpipe"]["partition"][:4]
    for d in detail.values():
        assert 0 <= d["bubble"]["simulated"] < 1 and d["bubble"]["measured"] < 1
    # bitpipe's two processes hold every piece twice between them: twice interleaved's weights
    weights = {m: sum(d["process_bytes"]["weights"]) for m, d in detail.items()}
    assert weights["bitpipe"] == 2 * weights["interleaved"] == 2 * weights["zb-v"]


#: tests/torchrun_checkpoint.py's arguments after the run folder: mini-batches, epochs, delay, method
BITPIPE_RUN = [16, 2, 0, "bitpipe"]


@pytest.fixture(scope="module")
def bitpipe_resumed(tmp_path_factory):
    """A bitpipe run under torchrun (tests/torchrun_checkpoint.py, 2 processes) whose processes all
    end after 13 mini-batches, then a 2-process job (tests/torchrun_jobs.py) that resumes it (its
    first script, "resumed") and runs the command line of the interleaved partition
    ("cli-interleaved", last: see test_a_chunked_partition_under_the_users_torchrun_equals_one_process).
    ``.cut``: the cut run's exit status; ``.latest``: its latest.json, or None; ``.folder``: the run's
    folder; ``.cut_left_a_result``: whether the cut run wrote result.json."""
    import json
    import subprocess
    import sys

    from conftest import JOB_TIMEOUT, has_image_data
    from test_torchrun import CHECKPOINT_SCRIPT, REPO, _env
    from torchrun_jobs import launch

    folder = tmp_path_factory.mktemp("bitpipe") / "cut"
    cut = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(CHECKPOINT_SCRIPT), str(folder), *map(str, BITPIPE_RUN), "13"],
                         capture_output=True, text=True, env=_env(), cwd=REPO, timeout=240)
    latest = folder / "checkpoints" / "latest.json"
    latest = json.loads(latest.read_text()) if latest.exists() else None
    cut_left_a_result = (folder / "result.json").exists()
    jobs = {"resumed": [CHECKPOINT_SCRIPT, folder, *BITPIPE_RUN]}
    if has_image_data():
        jobs["cli-interleaved"] = ["-m", "pipeoptim", *under_users_torchrun("interleaved", folder.parent / "cli")]
    printed = launch(jobs, nproc=2, timeout=JOB_TIMEOUT)
    printed.cut, printed.latest, printed.folder, printed.cut_left_a_result = \
        cut.returncode, latest, folder, cut_left_a_result
    return printed


def test_a_chunked_run_under_torchrun_resumes_mid_epoch_to_the_uninterrupted_run(bitpipe_resumed, torchrun_2):
    """Several stages per process under torchrun, as `interleaved` holds them: `bitpipe` on 2
    processes, each holding four stages (two pieces, and replicas of the other process's two,
    which it reads from the checkpoint). A run whose processes all end after 13 mini-batches
    (checkpoints every 5) resumes from the checkpoint at mini-batch 10 to the losses and weights
    of the uninterrupted run under torchrun (the "bitpipe-whole" script of tests/conftest.py's
    2-process job; not one process: the model's dropout draws from one generator there, in another
    order than two processes' generators do with two pipelines)."""
    import json

    assert bitpipe_resumed.cut != 0 and not bitpipe_resumed.cut_left_a_result
    assert bitpipe_resumed.latest  # the cut run left a checkpoint to resume from
    bitpipe_resumed.lines("resumed")  # it ended on every rank
    torchrun_2.lines("bitpipe-whole")
    a = json.loads((torchrun_2.folder / "bitpipe-whole" / "result.json").read_text())
    b = json.loads((bitpipe_resumed.folder / "result.json").read_text())
    assert len(a["losses"]) == 32 and b["losses"] == a["losses"]
    assert b["weights"] == a["weights"]
