"""The same script under `python` (all stages in one process) and under `torchrun` (one stage
per process, gloo): the same losses, weights and metrics, to the last bit (one compute thread
each, so the float reductions are the same)."""
from __future__ import annotations

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

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SCRIPT = HERE / "torchrun_methods.py"
EXAMPLE = REPO / "examples" / "fashion_mnist_pipeline.py"


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
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


@pytest.fixture(scope="module")
def both():
    """One job in one process and one under torchrun (2 processes) for every entry the tests
    read (each entry starts from the same seed, so a job's line for it is the entry's alone)."""
    entries = ",".join([*PIPELINED, *CLIPPED, EVALUATED, *FIXES])
    return rows(run([SCRIPT, entries, 2])), rows(run([SCRIPT, entries, 2], nproc=2))


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


def test_the_schedules_people_run_equal_sequential_on_four_processes():
    """zb-h1 (split backward), interleaved and zb-v (2 chunks per process, 8 pieces),
    bidirectional (4 pieces and their replicas, 2 per process) and bitpipe (8 pieces and their
    replicas, 4 per process) on 4 processes: the same numbers as one process, and as sequential
    on the same model."""
    methods = ["1f1b-flush", "zb-h1", "interleaved", "zb-v", "bidirectional", "bitpipe"]
    local = rows(run([SCRIPT, ",".join(["sequential", *methods]), 4]))
    spread = rows(run([SCRIPT, ",".join(methods), 4], nproc=4, timeout=300))
    reference = local["sequential"]
    for method in methods:
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


def test_the_example_under_torchrun_prints_what_it_prints_under_python():
    args = [EXAMPLE, "--limit", 384, "--epochs", 2, "--stages", 2]
    alone, spread = run(args), run(args, nproc=2)
    strip = lambda text: [line.split(", ")[0] for line in text.strip().splitlines()]  # noqa: E731 (drop samples/s)
    assert strip(spread) == strip(alone)
    assert len(spread.strip().splitlines()) == 3            # printed once, by rank 0
    assert spread.strip().splitlines()[-1].endswith("weight copies per stage [2.0, 1.0]")


EXIT_SCRIPT = HERE / "torchrun_exit.py"


@pytest.mark.parametrize("mode", ["exit", "close", "with", "user", "nan", "raise"])
def test_no_gloo_worker_thread_outlives_the_pipelines_teardown(mode):
    """A gloo worker thread alive at interpreter finalization may still be releasing the last
    collective's tensor, which takes the GIL from a finalizing interpreter: the process aborts
    ("terminate called without an active exception") after its work is done. However the script
    ends, the Pipeline destroys its process groups before that: every rank has the gloo workers
    (and, where no traceback holds a receive, the threads) it had before the Pipeline, and none
    more. (Before the fix each rank still had 6 workers at exit: the links' groups and the
    default group, which a torch module imported after it keeps as a default argument.)"""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           "2", str(EXIT_SCRIPT), mode], capture_output=True, text=True, env=_env(), cwd=REPO,
                          timeout=240)
    reports = {r["rank"]: r for r in map(json.loads, (l for l in done.stdout.splitlines() if l.startswith("{")))}
    assert sorted(reports) == [0, 1], done.stderr[-3000:]
    assert "terminate called" not in done.stderr
    assert done.returncode == (0 if mode in ("exit", "close", "with", "user") else 1), done.stderr[-3000:]
    for rank, r in reports.items():
        assert r["running"] > r["before"]                      # the Pipeline had threads of its own
        assert r["workers_at_exit"] == r["workers_before"], (rank, r)
        if not (mode == "raise" and rank == 0):  # rank 0's traceback holds the receive that failed
            assert r["at_exit"] == r["before"], (rank, r)
        if mode == "close":
            assert r["after_close"] == r["before"]
    if mode == "user":  # the user's own default group: left alone
        assert all(r["workers_before"] == 2 for r in reports.values())
    if mode == "raise":
        assert "a stage failed on purpose" in done.stderr and "Connection closed by peer" in done.stderr


AGAIN = ("import json, torch, pipeoptim; from torch import nn\n"
         "g = torch.Generator().manual_seed(1)\n"
         "data = [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]\n"
         "for i in range(3):\n"
         "    torch.manual_seed(0)\n"
         "    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))\n"
         "    with pipeoptim.Pipeline(model, method='gpipe', loss_fn=nn.functional.cross_entropy, timeout=60,\n"
         "                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1)) as pipe:\n"
         "        losses = pipe.fit(data).losses\n"
         "    if pipe.rank == 0: print(json.dumps(losses), flush=True)\n")


def test_a_pipeline_made_after_one_that_ended_the_job_joins_it_again(tmp_path):
    """Three Pipelines in turn in one script, each closed (with ``with``) before the next: the
    first two tear the job's process group down, and each later one joins it again, under a
    store prefix of its own (the torn-down groups' addresses are still in torchrun's store:
    joined without one, the new groups connected to sockets that were gone)."""
    script = tmp_path / "again.py"
    script.write_text(AGAIN)
    lines = run([script], nproc=2, timeout=180).strip().splitlines()
    assert len(lines) == 3 and len(set(lines)) == 1, lines


DP_SCRIPT = HERE / "torchrun_data_parallel.py"


def test_two_replicas_of_a_two_stage_pipeline_equal_one_replica_on_the_concatenated_shards():
    """N = 2, D = 2 (four processes): gradients averaged over the replicas before every update
    make a synchronous method equal one replica on the concatenated shards, and pipeoptim its
    single-replica run on the same concatenated micro-batches (float sums in another order).
    zb-h1 sends each weight group's gradients while its weight half computes the next."""
    methods = "gpipe,1f1b-flush,zb-h1,pipeoptim,pipedream"
    one = rows(run([DP_SCRIPT, methods, 2, 2, 2]))
    two = rows(run([DP_SCRIPT, methods, 2, 2, 2, 256], nproc=4, timeout=300))  # 256-byte buckets: overlapped
    for m in methods.split(","):
        assert (one[m]["replicas"], two[m]["replicas"]) == (1, 2)
        assert two[m]["losses"] == pytest.approx(one[m]["losses"], abs=1e-6)
        assert two[m]["metric"] == pytest.approx(one[m]["metric"], abs=1e-6)
        for name, values in one[m]["weights"].items():
            np.testing.assert_allclose(two[m]["weights"][name], values, rtol=0, atol=1e-6)
        assert len(one[m]["losses"]) == 12


TINY = ("import torch, pipeoptim; from torch import nn\n"
        "m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))\n"
        "pipeoptim.Pipeline(m, method='pipeoptim', loss_fn=nn.functional.cross_entropy,\n"
        "                   optimizer=lambda p: torch.optim.SGD(p, lr=0.1), {})\n")


@pytest.mark.parametrize("nproc,settings,message", [
    (2, "stages=3", "WORLD_SIZE 2 is not a multiple of the 3 stages: start N x D processes"),
    (4, "stages=2, data_parallel=3", "data_parallel=3, but WORLD_SIZE 4 with 2 stages makes 2 replicas; "
                                     "start 6 processes or drop data_parallel"),
    (4, "stages=4", "4 stages need at least 4 layers with parameters; the model has 3"),
])
def test_a_layout_the_processes_cannot_hold_is_refused_on_every_rank(nproc, settings, message):
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), "--no-python", sys.executable, "-c", TINY.format(settings)],
                          capture_output=True, text=True, env=_env(), cwd=REPO, timeout=120)
    assert done.returncode != 0
    assert done.stderr.count(message) == nproc, done.stderr[-3000:]   # the same line on every rank, no hang


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

    run([CHECKPOINT_SCRIPT, tmp_path / "whole", 40, 2])
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


def test_two_nodes_give_what_one_node_gives(both):
    """Two torchrun agents on this machine (--nnodes 2, one process each, a c10d rendezvous)
    give the one-node job's numbers (the 2-process job of ``both``)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
                                str(SCRIPT), "pipeoptim,1f1b-flush", "2"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
              for _ in range(2)]
    try:
        outs = [a.communicate(timeout=240) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert all(a.returncode == 0 for a in agents), [err[-2000:] for _, err in outs]
    printed = [out for out, _ in outs if out.strip()]
    assert len(printed) == 1                       # rank 0 lives on one of the nodes
    two_nodes = rows(printed[0])
    one_node = both[1]
    for method in ("pipeoptim", "1f1b-flush"):
        assert two_nodes[method]["losses"] == one_node[method]["losses"]
        assert two_nodes[method]["weights"] == one_node[method]["weights"]


#: (the 2-stage, 1-replica layout: tests/test_distributed.py's bench test, with gpipe beside pipeoptim)
@pytest.mark.parametrize("stages,replicas,expected", [
    (1, 2, {"sequential-1dev", "sequential-all", "sequential x2"}),
])
def test_bench_times_data_parallel_layouts_beside_the_baselines(tmp_path, capfd, stages, replicas, expected):
    from pipeoptim.cli import main

    assert main(["bench", "--synthetic", "--batches", "2", "--warmup", "1", "--batch-size", "16",
                 "--methods", "pipeoptim", "--stages", str(stages), "--data-parallel", str(replicas),
                 "--json", "--out", str(tmp_path / "bench.json"), "--timeout", "60"]) == 0
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
