"""The same script under `python` (all stages in one process) and under `torchrun` (one stage
per process, gloo): the same losses, weights and metrics, to the last bit (one compute thread
each, so the float reductions are the same).

The torchrun side of most tests is a script of tests/conftest.py's shared jobs (``torchrun_2``,
``torchrun_4``: one start for several scripts), the python side the same script run in the pytest
process (tests/torchrun_jobs.py's ``run_here``)."""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeoptim.methods import method_names
from torchrun_jobs import run_here

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SCRIPT = HERE / "torchrun_methods.py"
EXAMPLE = REPO / "examples" / "fashion_mnist_pipeline.py"
EXAMPLE_ARGS = ["--limit", 384, "--epochs", 2, "--stages", 2]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["PIPEOPTIM_STRICT_TRANSPORT"] = "1"  # NCCL's rules on gloo (runtime/strict.py): what would hang on a GPU fails
    return env


def run(args, nproc: int = 0, timeout: float = 240) -> str:
    """stdout of ``python args`` (nproc 0) or of ``torchrun --nproc-per-node nproc args``."""
    launcher = [] if not nproc else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    done = subprocess.run([sys.executable, *launcher, *map(str, args)], capture_output=True, text=True,
                          env=_env(), cwd=REPO, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def rows(text: str) -> dict:
    return {r["method"]: r for r in map(json.loads, text.strip().splitlines())}


PIPELINED = [m for m in method_names() if m != "sequential"]
#: the cases of the tests below beside every method's plain run: global clipping, evaluations every k
CLIPPED = [f"{m}+clip=0.05" for m in ("gpipe", "1f1b-flush", "interleaved")]
EVALUATED = "pipeoptim+eval=2"
#: the delay fixes: error feedback, the delay-aware optimizer (each stage told its delay per step)
FIXES = ["pipedream-2bw+ef=1", "pipeoptim-2bw+ef=1", "pipeoptim+opt=delay-nadamw"]
#: fp16 (tests/test_fp16.py): its found-inf flag agreed over the processes on global clipping's path
FP16 = "zb-h1+fp16=20+clip=0.05"
#: a complex64 and an int16 tensor crossing the cut (tests/traced_models.py's odd_dtypes_model)
ODD_WIRE = "1f1b-flush+wire=odd"
#: every entry the tests below read, in one run (each starts from the same seed, so a run's line
#: for it is the entry's alone)
ENTRIES = [*PIPELINED, *CLIPPED, EVALUATED, *FIXES, FP16, ODD_WIRE]


@pytest.fixture(scope="module")
def both(torchrun_2):
    """Every entry in one process (here) and under torchrun (2 processes: the "methods" script of
    the 2-process job)."""
    return rows(run_here(SCRIPT, ",".join(ENTRIES), 2)), rows("\n".join(torchrun_2.lines("methods", rank=0)))


@pytest.mark.parametrize("method", PIPELINED)
def test_every_method_under_torchrun_equals_one_process(both, method):
    local, spread = both[0][method], both[1][method]
    assert (local["processes"], spread["processes"]) == (1, 2)
    assert spread["stepped"] == local["stepped"]          # step()/flush() by hand
    assert spread["losses"] == local["losses"]            # fit(), two epochs
    assert spread["metric"] == local["metric"]            # evaluate(), pipelined across processes
    assert spread["weights"] == local["weights"]          # model(), gathered on every rank
    assert spread["fit_weights"] == local["weights"]      # fit()'s result.model, gathered too
    assert spread["fit_model_whole"] and local["fit_model_whole"]  # ... on every rank
    assert spread["weight_versions"] == local["weight_versions"]
    assert len(local["losses"]) == 9
    # issue 62: model(device=...) whole there; evaluate_model's function run through the stages on
    # their processes (no model copied to rank 0) gives one process's value, bit for bit
    assert spread["whole_on_meta"] and local["whole_on_meta"]
    assert spread["evaluated_model"] == local["evaluated_model"]


#: the schedules of the 4-process job (tests/conftest.py's torchrun_4)
SCHEDULES = ["1f1b-flush", "zb-h1", "interleaved", "zb-v", "bidirectional", "bitpipe"]


def test_the_schedules_people_run_equal_sequential_on_four_processes(torchrun_4):
    """zb-h1 (split backward), interleaved and zb-v (2 chunks per process, 8 pieces),
    bidirectional (4 pieces and their replicas, 2 per process) and bitpipe (8 pieces and their
    replicas, 4 per process) on 4 processes: the same numbers as one process, and as sequential
    on the same model."""
    local = rows(run_here(SCRIPT, ",".join(["sequential", *SCHEDULES]), 4))
    spread = rows("\n".join(torchrun_4.lines("schedules", rank=0)))
    assert sorted(spread) == sorted(SCHEDULES)
    reference = local["sequential"]
    for method in SCHEDULES:
        assert spread[method]["processes"] == 4 and local[method]["processes"] == 1
        assert spread[method]["losses"] == local[method]["losses"], method
        assert spread[method]["weights"] == local[method]["weights"], method
        assert local[method]["losses"] == pytest.approx(reference["losses"], rel=1e-6), method
        for name, value in local[method]["weights"].items():
            assert np.allclose(value, reference["weights"][name],
                               rtol=1e-5, atol=1e-7), (method, name)


def test_evaluations_every_k_under_torchrun_equal_one_process(both):
    """Every rank drains and evaluates at the same mini-batches; the evaluations agree."""
    local, spread = both[0][EVALUATED], both[1][EVALUATED]
    assert spread["losses"] == local["losses"] and spread["evaluations"] == local["evaluations"]
    assert [e["batch"] for e in local["evaluations"]] == [2, 3, 5, 6]  # 3 mini-batches per epoch
    assert [e["updates"] for e in local["evaluations"]] == [5, 6, 8, 9]  # after 3 stepped by hand


def test_the_delay_fixes_under_torchrun_equal_one_process(both):
    local, spread = both
    for entry in FIXES:
        assert spread[entry]["losses"] == local[entry]["losses"], entry
        assert spread[entry]["weights"] == local[entry]["weights"], entry
        assert spread[entry]["weight_versions"] == local[entry]["weight_versions"], entry
    for entry in FIXES[:2]:  # the feedback bites, and holds its two buffers
        plain = local[entry.split("+")[0]]
        assert local[entry]["losses"][4:] != plain["losses"][4:]
        assert [v - p for v, p in zip(local[entry]["weight_versions"], plain["weight_versions"])] == [2, 2]


def test_global_clipping_under_torchrun_equals_one_process(both):
    local, spread = both
    for m in CLIPPED:
        assert spread[m]["losses"] == local[m]["losses"]
        assert spread[m]["weights"] == local[m]["weights"]
    assert local["gpipe+clip=0.05"]["losses"][4:] != local["gpipe"]["losses"][4:]  # the clipping bites


def test_fp16_under_torchrun_equals_one_process(both):
    """fp16's loss scale under torchrun, from 2**20, which the first updates overflow: every
    update's found-inf flag agreed by both processes (with the global clipping norm), the same
    losses, weights, skipped updates and scale as one process."""
    local, spread = both[0][FP16], both[1][FP16]
    for key in ("stepped", "losses", "weights", "skips", "scale"):
        assert spread[key] == local[key], key
    assert local["skips"][:2] == [0, 0] and len(local["skips"]) < 9  # of 9 updates: skipped, then applied


def test_only_nccls_dtypes_go_on_the_wire_and_complex_activations_train(both):
    """Issue 62: NCCL has no complex or int16. A complex64 activation and an int16 mask crossing
    the cut (and the complex64 gradient crossing back) travel as their bytes: every send of the
    links is of a dtype NCCL carries, the losses are one process's, and both equal the model
    trained whole (a received complex activation collects its gradient, as a float one does)."""
    import copy

    import torch
    from torch import nn as tnn
    from traced_models import odd_dtypes_model

    local, spread = both[0][ODD_WIRE], both[1][ODD_WIRE]
    assert set(spread["wire"]) <= {"torch.float32", "torch.float64", "torch.float16", "torch.bfloat16",
                                   "torch.int64", "torch.int32", "torch.int8", "torch.uint8", "torch.bool"}
    assert "torch.uint8" in spread["wire"]  # the complex and int16 tensors' bytes
    assert spread["stepped"] == pytest.approx(local["stepped"], rel=1e-6)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(6)]
    net = copy.deepcopy(odd_dtypes_model())
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    plain = []
    for x, y in data[:3]:  # the entry's first three mini-batches, each in 2 micro-batches
        total = 0.0
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            loss = tnn.functional.cross_entropy(net(xs), ys) / 2
            loss.backward()
            total += float(loss)
        opt.step()
        opt.zero_grad()
        plain.append(total)
    assert local["stepped"] == pytest.approx(plain, rel=1e-5)


def test_the_example_under_torchrun_prints_what_it_prints_under_python(torchrun_2):
    alone = run_here(EXAMPLE, *EXAMPLE_ARGS).strip().splitlines()
    spread = torchrun_2.lines("example")                     # every rank's lines
    strip = lambda lines: [line.split(", ")[0] for line in lines]  # noqa: E731 (drop samples/s)
    assert strip(spread) == strip(alone)
    assert len(spread) == 3 and set(torchrun_2.ranks("example")) == {0}  # printed once, by rank 0
    assert spread[-1].endswith("weight copies per stage [2.0, 1.0]")


EXIT_SCRIPT = HERE / "torchrun_exit.py"


@functools.lru_cache(maxsize=None)
def teardown(modes: str) -> tuple:
    """(exit status, stderr, {rank: report}) of ``torchrun --nproc-per-node 2 torchrun_exit.py MODES``,
    on gloo's own rules: gloo's threads are what it checks, and a rank whose peer raised learns it from
    gloo's closed connection (under NCCL's rules, as the strict transport keeps them, it would wait
    out the timeout)."""
    env = {k: v for k, v in _env().items() if k != "PIPEOPTIM_STRICT_TRANSPORT"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           "2", str(EXIT_SCRIPT), modes], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=240)
    reports = {r["rank"]: r for r in map(json.loads, (l for l in done.stdout.splitlines() if l.startswith("{")))}
    return done.returncode, done.stderr, reports


#: how a script's Pipelines end, a job each: those that let the script go on (close, with) before
#: the one that ends it; the user's own process group with a stop on a NaN loss
ENDINGS = ["close,with,exit", "user,nan", "raise"]


@pytest.mark.parametrize("modes", ENDINGS)
def test_no_gloo_worker_thread_outlives_the_pipelines_teardown(modes):
    """A gloo worker thread alive at interpreter finalization may still be releasing the last
    collective's tensor, which takes the GIL from a finalizing interpreter: the process aborts
    ("terminate called without an active exception") after its work is done. However the script
    ends, the Pipeline destroys its process groups before that: every rank has the gloo workers
    (and, where no traceback holds a receive, the threads) it had before the Pipeline, and none
    more; a Pipeline closed (twice) or left by its ``with`` block has them back at once, and the
    script goes on. (Before the fix each rank still had 6 workers at exit: the links' groups and
    the default group, which a torch module imported after it keeps as a default argument.)"""
    returncode, stderr, reports = teardown(modes)
    ends = [m for m in modes.split(",") if m != "user"] or ["exit"]
    assert sorted(reports) == [0, 1], stderr[-3000:]
    assert "terminate called" not in stderr
    assert returncode == (0 if ends[-1] == "exit" else 1), stderr[-3000:]
    for rank, r in reports.items():
        assert [p["mode"] for p in r["pipelines"]] == ends, (rank, r)
        for p in r["pipelines"]:
            assert p["running"] > r["before"], (rank, p)         # the Pipeline had threads of its own
            if p["mode"] in ("close", "with"):
                assert (p["after"], p["workers_after"]) == (r["before"], r["workers_before"]), (rank, p)
        assert r["workers_at_exit"] == r["workers_before"], (rank, r)
        if not (ends[-1] == "raise" and rank == 0):  # rank 0's traceback holds the receive that failed
            assert r["at_exit"] == r["before"], (rank, r)
    if modes.startswith("user"):  # the user's own default group: left alone
        assert all(r["workers_before"] == 2 for r in reports.values())
    if ends[-1] == "nan":  # the stop on a non-finite loss (every rank's, each at exit above)
        assert "NonFiniteLoss: loss became nan" in stderr, stderr[-3000:]
    if ends[-1] == "raise":
        assert "a stage failed on purpose" in stderr and "Connection closed by peer" in stderr


def test_a_pipeline_made_after_one_that_ended_the_job_joins_it_again():
    """Three Pipelines in turn in one script (the "close,with,exit" job above), the first closed,
    the second left by its ``with`` block: the first two tear the job's process group down, and
    each later one joins it again, under a store prefix of its own (the torn-down groups'
    addresses are still in torchrun's store: joined without one, the new groups connected to
    sockets that were gone). The three train alike, from the same seed."""
    returncode, stderr, reports = teardown("close,with,exit")
    assert returncode == 0, stderr[-3000:]
    for rank, r in reports.items():
        losses = [p["losses"] for p in r["pipelines"]]
        assert len(losses) == 3 and len(losses[0]) == 6 and losses.count(losses[0]) == 3, (rank, losses)


DP_SCRIPT = HERE / "torchrun_data_parallel.py"


#: the data-parallel script's arguments: methods, stages, micro-batches, replicas
DATA_PARALLEL = ["gpipe,1f1b-flush,zb-h1,pipeoptim,pipedream", 2, 2, 2]


def test_two_replicas_of_a_two_stage_pipeline_equal_one_replica_on_the_concatenated_shards(torchrun_4):
    """N = 2, D = 2 (four processes): gradients averaged over the replicas before every update
    make a synchronous method equal one replica on the concatenated shards, and pipeoptim its
    single-replica run on the same concatenated micro-batches (float sums in another order).
    zb-h1 sends each weight group's gradients while its weight half computes the next."""
    methods = DATA_PARALLEL[0]
    one = rows(run_here(DP_SCRIPT, *DATA_PARALLEL))
    two = rows("\n".join(torchrun_4.lines("data-parallel", rank=0)))  # 256-byte buckets: overlapped
    assert sorted(two) == sorted(methods.split(","))
    for m in methods.split(","):
        assert (one[m]["replicas"], two[m]["replicas"]) == (1, 2)
        assert two[m]["losses"] == pytest.approx(one[m]["losses"], abs=1e-6)
        assert two[m]["metric"] == pytest.approx(one[m]["metric"], abs=1e-6)
        for name, values in one[m]["weights"].items():
            np.testing.assert_allclose(two[m]["weights"][name], values, rtol=0, atol=1e-6)
        assert len(one[m]["losses"]) == 12


#: tests/torchrun_refusals.py's cases on 2 processes, and the line each is refused with
REFUSED = {
    "stages": "WORLD_SIZE 2 is not a multiple of the 3 stages: start N x D processes",
    "replicas": "data_parallel=3, but WORLD_SIZE 2 with 1 stages makes 2 replicas; start 3 processes or drop "
                "data_parallel",
    "layers": "2 stages need at least 2 layers with parameters; the model has 1",
    "fp16": "precision='fp16' with pipeoptim under torchrun is not supported",
}


def test_a_layout_the_processes_cannot_hold_is_refused_on_every_rank(torchrun_2):
    """Under torchrun (the "refusals" script of the 2-process job, the job's first Pipelines):
    every rank refuses each layout with the same line and goes on, none waits on a peer."""
    refused = torchrun_2.rows("refusals")
    for case, message in REFUSED.items():
        lines = [r["refused"] for r in refused if r["case"] == case]
        assert len(lines) == 2 and all(line and line.startswith(message) for line in lines), (case, lines)


@pytest.mark.parametrize("settings,message", [
    (dict(stages=3, processes=2), "WORLD_SIZE 2 is not a multiple of the 3 stages: start N x D processes"),
    (dict(stages=2, data_parallel=3, processes=4), "data_parallel=3, but WORLD_SIZE 4 with 2 stages makes 2 "
                                                   "replicas; start 6 processes or drop data_parallel"),
    (dict(stages=4, processes=4), None),  # the layout holds; the model does not (below)
])
def test_the_layout_refusals_name_the_processes_to_start(settings, message):
    """The lines of the test above, for the numbers of other jobs (4 processes), from the layout
    every rank plans (pipeoptim.runtime.layout); a model with fewer layers than 4 stages is refused
    as it is in one process."""
    import torch
    from torch import nn

    import pipeoptim
    from pipeoptim.runtime.layout import plan_layout

    if message is None:
        plan_layout(pipeoptim.get_method("pipeoptim"), **settings)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
        with pytest.raises(ValueError, match="4 stages need at least 4 layers with parameters; the model has 3"):
            pipeoptim.Pipeline(model, method="pipeoptim", stages=4, loss_fn=nn.functional.cross_entropy,
                               optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
        return
    with pytest.raises(ValueError) as refused:
        plan_layout(pipeoptim.get_method("pipeoptim"), **settings)
    assert str(refused.value).startswith(message)


CHECKPOINT_SCRIPT = HERE / "torchrun_checkpoint.py"


def children(pid: int) -> list:
    """The pids whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def stages_after_first_checkpoint(job: subprocess.Popen, run_dir: Path) -> list:
    """Wait until the run in ``run_dir`` has a checkpoint; the pids of its two stage processes
    (the children of torchrun's agent)."""
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "latest.json").exists():
        assert job.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    stages = []
    while len(stages) < 2:
        assert time.monotonic() < deadline, "the stage processes were not found"
        stages = sorted(c for agent in [job.pid] + children(job.pid) for c in children(agent))
        time.sleep(0.01)
    return stages


def start(run_dir: Path, delay: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(CHECKPOINT_SCRIPT), str(run_dir), "40", "2", str(delay)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)


def test_a_killed_stage_resumes_from_its_checkpoint_to_the_uninterrupted_run(tmp_path):
    """kill -9 of one stage process after the first checkpoint: the job ends, the newest
    checkpoint is complete, and running the script again resumes to the same losses and weights."""
    from pipeoptim.checkpoint import latest_checkpoint, read_manifest

    run_here(CHECKPOINT_SCRIPT, tmp_path / "whole", 40, 2)  # one process, here
    whole = json.loads((tmp_path / "whole" / "result.json").read_text())
    job = start(tmp_path / "cut", delay=0.05)
    try:
        os.kill(stages_after_first_checkpoint(job, tmp_path / "cut")[-1], signal.SIGKILL)
        job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert not (tmp_path / "cut" / "result.json").exists()
    folder = latest_checkpoint(tmp_path / "cut" / "checkpoints")
    manifest = read_manifest(folder)
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    run([CHECKPOINT_SCRIPT, tmp_path / "cut", 40, 2], nproc=2)
    resumed = json.loads((tmp_path / "cut" / "result.json").read_text())
    assert resumed["losses"] == whole["losses"]
    assert resumed["weights"] == whole["weights"]


#: (the 2-stage, 1-replica layout: tests/test_distributed.py's bench test, with gpipe beside pipeoptim)
@pytest.mark.parametrize("stages,replicas,expected", [
    (1, 2, {"sequential-1dev", "sequential-all", "sequential x2"}),
])
def test_bench_times_data_parallel_layouts_beside_the_baselines(tmp_path, capfd, stages, replicas, expected):
    from pipeoptim.cli import main

    assert main(["bench", "--synthetic", "--batches", "2", "--warmup", "1", "--batch-size", "16",
                 "--methods", "pipeoptim", "--stages", str(stages), "--data-parallel", str(replicas),
                 "--repeats", "1", "--json", "--out", str(tmp_path / "bench.json"), "--timeout", "60"]) == 0
    result = json.loads(capfd.readouterr().out)
    assert set(result["samples_per_second"]) == expected
    assert (result["settings"]["stages"], result["settings"]["data_parallel"]) == (stages, replicas)
    assert all(v > 0 for v in result["samples_per_second"].values())
    pipelined = [name for name in expected if not name.startswith("sequential-")][0]
    assert len(result["detail"][pipelined]["cpu_share"][0]) == 2          # a share per process


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_torchrun_ends_every_stage_of_a_pipeline_script(tmp_path, signum):
    """Ctrl-C or SIGTERM of the user's torchrun: every process of the run is gone within 5 s,
    each stage says so in one line, and the newest checkpoint is whole."""
    from pipeoptim.checkpoint import latest_checkpoint, read_manifest

    job = start(tmp_path / "run", delay=0.05)
    try:
        stages = stages_after_first_checkpoint(job, tmp_path / "run")
        job.send_signal(signum)
        _, err = job.communicate(timeout=30)
        gone_by = time.monotonic() + 5
        while any(os.path.exists(f"/proc/{p}") for p in stages) and time.monotonic() < gone_by:
            time.sleep(0.05)
        assert not any(os.path.exists(f"/proc/{p}") for p in stages)
    finally:
        if job.poll() is None:
            job.kill()
    lines = [line for line in err.splitlines() if line.startswith("pipeoptim: rank")]
    name = signal.Signals(signum).name
    assert sorted(lines) == [f"pipeoptim: rank {r} stopped by {name} (launcher); resume from the last "
                             f"checkpoint with fit(..., resume=True)" for r in (0, 1)]
    assert "Traceback" not in "\n".join(l for l in err.splitlines() if "pipeoptim" in l)
    read_manifest(latest_checkpoint(tmp_path / "run" / "checkpoints"))
