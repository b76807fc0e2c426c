"""The distributed runtime (one process per stage, gloo on CPU) against the local runtime.

docs/architecture.md, "Invariants and where they are tested", invariant 4: for every method
the per-batch losses of a distributed run equal the local runtime's. One script of the session's
4-process torchrun job (tests/conftest.py's ``torchrun_4``, tests/torchrun_distributed.py: no start
of 4 processes of its own) runs every method through `pipeoptim.Pipeline` on 4 stages, and on
2 stages x 2 replicas (each replica on the same data, so that their mean is one replica's run), plus tuple activations, uneven micro-batches and the 1-stage `sequential` path;
the tests below read its results. Separate runs check a hung peer (the run
fails within the timeout: the last run of tests/test_leaner_messages.py's 2-process spawn), two
"nodes" under torchrun, and `pipeoptim train --runtime distributed` starting torchrun itself (with
every run option at once); the command-line runs train on made-up images
(tests/made_up_images.py: each process reads them in milliseconds).

Every test has a pytest-timeout mark and every process group a timeout, so a deadlock fails
in seconds instead of hanging.
"""
from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Optional, Sequence

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import pipeoptim
from conftest import batches, mlp
from made_up_images import use_made_up_images
from pipeoptim.runtime.control import init_process_group
from pipeoptim.runtime.transport import PipeComm
from pipeoptim.runtime.wire import PipelineCommError, signature
from pipeoptim.runtime.wire import decode_layout, encode_layout, layout_of

LOSS = nn.functional.cross_entropy
PIPELINED = [m for m in pipeoptim.method_names()
             # (bidirectional under torchrun: tests/test_torchrun.py, test_bidirectional.py)
             if m != "sequential" and not pipeoptim.get_method(m).mirrored]
GROUP_TIMEOUT = 120  # seconds; the spawns finish far sooner
REPO = Path(__file__).resolve().parents[1]


def sgdm(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


# ---------------------------------------------------------------------------------------------
# a model whose blocks pass (float tensor, int tensor) tuples


class TupleIn(nn.Module):
    """(x, bucket) -> (h, bucket): a linear layer plus a learned embedding of an integer input."""

    def __init__(self, width: int = 12) -> None:
        super().__init__()
        self.linear = nn.Linear(6, width)
        self.embed = nn.Embedding(3, width)

    def forward(self, inputs):
        x, bucket = inputs
        return torch.tanh(self.linear(x) + self.embed(bucket)), bucket


class TupleBlock(nn.Module):
    def __init__(self, width: int = 12) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.embed = nn.Embedding(3, width)

    def forward(self, inputs):
        h, bucket = inputs
        return torch.tanh(self.linear(h) + self.embed(bucket)), bucket


class TupleHead(nn.Module):
    def __init__(self, width: int = 12) -> None:
        super().__init__()
        self.linear = nn.Linear(width, 4)

    def forward(self, inputs):
        h, _ = inputs
        return self.linear(h)


def tuple_model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(TupleIn(), TupleBlock(), TupleBlock(), TupleHead()).double()


def tuple_batches(count: int = 4, size: int = 10):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(count):
        x = torch.randn(size, 6, generator=g, dtype=torch.float64)
        bucket = torch.randint(0, 3, (size,), generator=g)
        out.append(((x, bucket), torch.randint(0, 4, (size,), generator=g)))
    return out


# ---------------------------------------------------------------------------------------------
# spawning


def spawn(fn, world: int, tmp_path: Path, *args, deadline: float = 100.0, asleep: Sequence[int] = ()) -> Dict[int, bool]:
    """Run ``fn(rank, world, init_method, out_dir, *args)`` in ``world`` fresh processes; fail
    if any exits non-zero or is still running after ``deadline`` seconds (then killed). The ranks
    ``asleep`` (a hung peer's) are not waited for: once the others have exited they are killed;
    returned: whether each was still running then."""
    ctx = mp.get_context("spawn")
    init = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=fn, args=(r, world, init, str(tmp_path), *args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline
    try:
        waited = [r for r in range(world) if r not in asleep]
        for r in waited:
            procs[r].join(max(0.0, end - time.monotonic()))
        alive = [r for r in waited if procs[r].is_alive()]
        assert not alive, f"ranks {alive} still running after {deadline} s (deadlock?)"
        failed = {r: procs[r].exitcode for r in waited if procs[r].exitcode != 0}
        assert not failed, f"ranks exited with status {failed} (their errors are in the captured stderr)"
        return {r: procs[r].is_alive() for r in asleep}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def _train(model, data, method, **kw):
    """One run through pipeoptim.Pipeline on every process of the job (its stages x replicas;
    every replica reads the same data, so that the replicas' mean is one replica's run)."""
    with pipeoptim.Pipeline(model, method=method, optimizer=kw.pop("optimizer", sgdm), loss_fn=LOSS,
                            timeout=GROUP_TIMEOUT, **kw) as pipe:
        res = pipe.fit(data)
        state = {k: v.clone() for k, v in pipe.model().state_dict().items()}
        links = _links(pipe.world.comm)
    return {"losses": res.losses, "trace": res.version_trace, "state": state, "links": links}


def _links(comm):
    """How a PipeComm's links are carried: process groups of their own, or tags of its control
    group (which is it, the tags, the links' group sizes and the control group's size)."""
    links = list(comm._links.values())
    return {"own": comm.link_groups, "links": len(links),
            "on_control": all(link.group is comm.control for link in links),
            "distinct": len({id(link.group) for link in links}),
            "sizes": sorted(dist.get_world_size(link.group) for link in links),
            "tags": sorted(link.tag for link in links), "control_size": dist.get_world_size(comm.control)}


def settle() -> None:
    """Collect what lives on after the imports and freeze it: each Pipeline's close() runs
    gc.collect(), which then walks only what was made since (as tests/torchrun_sharded.py)."""
    gc.collect()
    gc.freeze()


def _equivalence_worker(rank: int, world: int, init: Optional[str], out: str) -> None:
    """Every run the tests below read, on rank ``rank`` of ``world``, in a process group it starts
    (``init``: its init method; None: torchrun's environment); its results saved to OUT/rankR.pt."""
    init_process_group(init_method=init, rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    settle()
    results = {}
    for method in PIPELINED:  # 4 stages, all processes
        results[("mlp", method, 4)] = _train(mlp(), batches(5), method, stages=4)
    results[("mlp", "pipeoptim+corrections", 4)] = _train(mlp(), batches(6), "pipeoptim", stages=4,
                                                           **CORRECTIONS)
    # 2 stages x 2 replicas: ranks 0-1 and 2-3 are two pipelines, told of each other (each
    # replica's own group carries its control messages and its links)
    for method in PIPELINED:
        results[("mlp", method, 2)] = _train(mlp(), batches(5), method, stages=2)
    results[("mlp", "pipeoptim", "2 told")] = results[("mlp", "pipeoptim", 2)]
    # tuple activations, with uneven micro-batches (10 samples in 4: 3, 3, 2, 2)
    for method in ("1f1b-flush", "pipeoptim", "zb-h1"):
        results[("tuple", method, 2)] = _train(tuple_model(), tuple_batches(), method, stages=2,
                                               micro_batches=4 if method != "pipeoptim" else None)
    # uneven micro-batches of a plain tensor model, Adam
    for method in ("gpipe", "pipedream-2bw"):
        results[("uneven", method, 2)] = _train(mlp(), batches(4), method, stages=2, micro_batches=3,
                                                optimizer=adam)
    # sequential is one stage: 4 replicas of a 1-stage pipeline
    results[("mlp", "sequential", 1)] = _train(mlp(), batches(5), "sequential")
    # two pipelines on sub-groups that do not know of each other: their links are tags of the pair's group
    # (the other ranks build no PipeComm, so no group can be made for a link)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = PipeComm(pairs[rank // 2], timeout=GROUP_TIMEOUT)
    results[("links", rank)] = {"trace": None, "whole": results[("mlp", "pipeoptim", 4)]["links"],
                                "pair": _links(pair), "told": results[("mlp", "pipeoptim", 2)]["links"]}
    pair.close()
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(torchrun_4):
    """Results of the 4-process job's ``equivalence`` script: {(model, method, stages): {losses,
    trace, state}}."""
    torchrun_4.lines("equivalence")  # (fails, with the job's stderr, unless it ended on every rank)
    tmp = torchrun_4.folder / "equivalence"
    results = {}
    for rank in (3, 2, 1, 0):  # every rank holds every run's losses, traces and models
        for key, value in torch.load(tmp / f"rank{rank}.pt", weights_only=False).items():
            if value["trace"] is not None or key not in results:
                results[key] = value
    return results


def _local(model, data, method, stages, **kw):
    return pipeoptim.train(model, data, method=method, stages=stages, optimizer=kw.pop("optimizer", sgdm),
                           loss_fn=LOSS, **kw)


def _close(got, expected, rel=1e-5):
    assert len(got) == len(expected)
    assert got == pytest.approx(expected, rel=rel)


#: every delay correction at once (sync warm-up, PipeMare lr, EMA direction, ramp), checked below
CORRECTIONS = dict(sync_warmup=2, lr_correction="delay", lr_correction_steps=3, delta="ema",
                   prediction_warmup=2)


@pytest.mark.timeout(420)
def test_delay_corrections_run_the_same_distributed_as_local(spawned):
    got = spawned[("mlp", "pipeoptim+corrections", 4)]
    local = _local(mlp(), batches(6), "pipeoptim", 4, **CORRECTIONS)
    _close(got["losses"], local.losses)
    assert got["trace"] == local.version_trace


@pytest.mark.timeout(420)
@pytest.mark.parametrize("stages", [4, 2])
@pytest.mark.parametrize("method", PIPELINED)
def test_distributed_losses_equal_local(spawned, method, stages):
    got = spawned[("mlp", method, stages)]
    local = _local(mlp(), batches(5), method, stages)
    _close(got["losses"], local.losses)
    if stages == 4:  # every rank gathered the version trace and the trained model
        assert got["trace"] == local.version_trace
        for name, value in local.model.state_dict().items():
            torch.testing.assert_close(got["state"][name], value, rtol=1e-9, atol=1e-12)


@pytest.mark.timeout(420)
def test_each_direction_of_a_gloo_link_has_a_group_of_its_own(spawned):
    """gloo: where every rank of the job builds the pipeline (the whole job's, or replicas told
    of each other) each direction of each boundary is a 2-rank group of its own, so that
    activations and gradients do not share a socket pair; a pipeline on a sub-group whose
    other ranks build nothing carries its links as tags of its own group, one per direction."""
    links_of = {0: 2, 1: 4, 2: 4, 3: 2}  # of a rank in the 4-stage pipeline
    for rank in range(4):
        links = spawned[("links", rank)]
        n = links_of[rank]
        assert links["whole"] == {"own": True, "links": n, "on_control": False, "distinct": n,
                                  "sizes": [2] * n, "tags": [0] * n, "control_size": 4}
        assert links["told"] == {"own": True, "links": 2, "on_control": False, "distinct": 2,
                                 "sizes": [2, 2], "tags": [0, 0], "control_size": 2}
        assert links["pair"] == {"own": False, "links": 2, "on_control": True, "distinct": 1,
                                 "sizes": [2, 2], "tags": [1, 2], "control_size": 2}
    got = spawned[("mlp", "pipeoptim", "2 told")]
    local = _local(mlp(), batches(5), "pipeoptim", 2)
    _close(got["losses"], local.losses)
    assert got["trace"] == local.version_trace


@pytest.mark.timeout(420)
def test_sequential_runs_as_a_one_process_pipeline(spawned):
    got = spawned[("mlp", "sequential", 1)]
    local = pipeoptim.train(mlp(), batches(5), method="sequential", optimizer=sgdm, loss_fn=LOSS)
    _close(got["losses"], local.losses)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("method", ["1f1b-flush", "pipeoptim", "zb-h1"])
def test_tuple_activations_cross_stages(spawned, method):
    """Blocks pass (float, int) tuples; the int entry carries no gradient back."""
    got = spawned[("tuple", method, 2)]
    local = _local(tuple_model(), tuple_batches(), method, 2,
                   micro_batches=4 if method != "pipeoptim" else None)
    _close(got["losses"], local.losses)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("method", ["gpipe", "pipedream-2bw"])
def test_uneven_micro_batches(spawned, method):
    """8 samples in 3 micro-batches (3, 3, 2): two message shapes, each agreed once."""
    got = spawned[("uneven", method, 2)]
    local = _local(mlp(), batches(4), method, 2, micro_batches=3, optimizer=adam)
    _close(got["losses"], local.losses)


# ---------------------------------------------------------------------------------------------
# a hung peer


class HangAfter(nn.Module):
    """Passes its input through; its ``after``-th call sleeps (the stage stops answering)."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after, self.calls = after, 0

    def forward(self, x):
        self.calls += 1
        if self.calls > self.after:
            time.sleep(120)
        return x


HANG_TIMEOUT = 3.0  #: seconds the stage-to-stage links of the hung run wait


def hung_peer(rank: int, out: str) -> None:
    """The last run of a 2-process job: stage 1 stops answering in its third forward. Rank 0
    writes ``hang0.json`` (the error and the seconds it took) and ends the process; rank 1 sleeps in
    its forward until it is killed (:func:`spawn`'s ``asleep``)."""
    model = nn.Sequential(*mlp(depth=4), HangAfter(2))  # stage 1 holds the last block and HangAfter
    start = time.perf_counter()
    try:  # the stage-to-stage links time out after HANG_TIMEOUT
        pipeoptim.Pipeline(model, method="pipeoptim", stages=2, optimizer=sgdm, loss_fn=LOSS,
                           timeout=HANG_TIMEOUT).fit(batches(6))
        outcome = {"error": None}
    except PipelineCommError as error:
        outcome = {"error": str(error)}
    outcome["seconds"] = time.perf_counter() - start
    (Path(out) / f"hang{rank}.json").write_text(json.dumps(outcome))
    os._exit(0)  # do not wait on the hung peer while tearing down


@pytest.mark.timeout(360)
def test_a_hung_peer_fails_the_run_within_the_timeout(tmp_path_factory):
    """Stage 0 of two processes gives up on a peer that stops answering, naming what it waited
    for, within the links' timeout, while the peer is still asleep. (The last run of the one
    2-process spawn of tests/test_leaner_messages.py and tests/test_pipelining_peer.py.)"""
    from test_leaner_messages import two_process_job

    hang = two_process_job(tmp_path_factory)["hang"]
    assert hang["stage 1 asleep"]  # when stage 0 had ended
    outcome = hang["stage 0"]
    assert outcome["error"] is not None
    assert "gradient of micro-batch" in outcome["error"] and "timeout (3 s)" in outcome["error"]
    assert HANG_TIMEOUT <= outcome["seconds"] < HANG_TIMEOUT + 15


# ---------------------------------------------------------------------------------------------
# torchrun: two "nodes", and `pipeoptim train --runtime distributed` launching it


@pytest.fixture(scope="module")
def made_up_images(tmp_path_factory):
    """The command-line runs of this module (and the processes they start) read made-up images."""
    yield from use_made_up_images(tmp_path_factory)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


# the settings of _local_summary's RunConfig (whose defaults are not the command line's recipe)
TRAIN_ARGS = ["--task", "image", "--model", "mlp", "--limit", "256", "--batch-size", "32", "--stages", "2",
              "--epochs", "1", "--optimizer", "momentum", "--lr", "0.01", "--lr-schedule", "constant",
              "--no-progress", "--json", "--timeout", "60"]


def _local_summary(method: str):
    from pipeoptim.lab.config import RunConfig
    from pipeoptim.lab.experiment import run_experiment

    cfg = RunConfig(task="image", model="mlp", method=method, stages=2, batch_size=32, limit=256)
    return run_experiment(cfg, out_dir=None, show_progress=False, log=lambda *a, **k: None)


@pytest.mark.timeout(120)
def test_two_nodes_under_torchrun_match_local(tmp_path, made_up_images):
    port = _free_port()
    procs = []
    for node in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "-m", "pipeoptim", "train", "--runtime", "distributed", "--method", "pipedream",
                   "--out", str(tmp_path / "run"), *TRAIN_ARGS]
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=_env(), cwd=tmp_path))
    try:
        outs = [p.communicate(timeout=100) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    summary = json.loads(outs[0][0])  # node 0 holds rank 0, which prints the summary
    assert outs[1][0].strip() == ""   # and only it
    local = _local_summary("pipedream")
    _close(summary["losses"], local["losses"])
    assert summary["final_metric"] == pytest.approx(local["final_metric"], abs=0.01)
    assert {k for k in local if k != "out"} <= set(summary)
    assert (tmp_path / "run" / "summary.json").exists()


#: every option of a run the local runtime takes beside the method's (schedule, warm-up, clipping,
#: precision, evaluations within the epoch, a validation split, diagnostics, recomputation): the
#: flags a local run takes beyond TRAIN_ARGS. Each changes what the run reports (the losses, the
#: evaluations, the validation metric, the prediction error; recomputation only the config), so one
#: run with all of them tells a flag the distributed runtime drops or reads otherwise.
RUN_FLAGS = {
    "schedule": ["--lr-schedule", "warmup-cosine", "--warmup-steps", "3"],
    "clip": ["--clip-grad", "0.5"],
    "bf16": ["--precision", "bf16"],
    "eval-every": ["--eval-every", "3"],
    "holdout": ["--holdout", "64"],
    "diagnose": ["--diagnose-every", "2"],
    "recompute": ["--recompute"],
}


@pytest.mark.timeout(240)
def test_every_run_option_gives_the_local_runtimes_numbers_on_two_processes(tmp_path, capfd, made_up_images):
    """`pipeoptim train --runtime distributed` (here called in-process) runs torchrun with one
    process per stage; rank 0 prints the summary once and writes the run folder. It builds the
    same Pipeline from the same settings as `--runtime local`: the same losses, evaluations
    (pipelined across the processes), test metric, diagnostics and run folder, with every run
    flag at once."""
    from pipeoptim.cli import main

    flags = [flag for case in RUN_FLAGS.values() for flag in case]
    runs = {}
    for runtime in ("distributed", "local"):
        out = tmp_path / runtime
        assert main(["train", "--runtime", runtime, "--method", "pipeoptim", "--out", str(out),
                     *TRAIN_ARGS, *flags]) == 0
        summary = json.loads(capfd.readouterr().out)  # one JSON object, printed once
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[runtime] = summary, lines, json.loads((out / "config.json").read_text())
    (got, got_lines, got_config), (local, local_lines, local_config) = runs["distributed"], runs["local"]
    assert got["runtime"] == "distributed" and "runtime" not in local and got["stages"] == 2
    for name in ("metrics.jsonl", "summary.json", "curves.png", "config.json"):
        assert (tmp_path / "distributed" / name).exists(), name
    assert [x["loss"] for x in got_lines if x["type"] == "batch"] == got["losses"]
    assert got_config == local_config
    assert len(got["losses"]) == 8 and got["losses"] == local["losses"]
    assert [(e["epoch"], e["batch"], e["updates"]) for e in got["evaluations"]] == \
        [(0, 3, 3), (0, 6, 6), (0, 8, 8)]  # --eval-every 3
    for key in ("epoch", "batch", "updates", "metric"):
        assert [e[key] for e in got["evaluations"]] == [e[key] for e in local["evaluations"]]
    for key in ("final_metric", "validation_metric", "best_metric", "final_loss", "eval_split", "holdout",
                "prediction_error"):
        assert got.get(key) == local.get(key), key
    assert got.get("prediction_error") is not None  # --diagnose-every 2
    assert [(x["type"], x.get("batch"), x.get("loss"), x.get("metric"), x.get("prediction_error"))
            for x in got_lines] == \
        [(x["type"], x.get("batch"), x.get("loss"), x.get("metric"), x.get("prediction_error"))
         for x in local_lines]
    assert set(got) - {"runtime", "device"} == set(local)


# ---------------------------------------------------------------------------------------------
# no processes


def test_message_layouts_round_trip():
    value = (torch.zeros(3, 4, dtype=torch.float64), torch.zeros(3, dtype=torch.int64), None)
    layout = layout_of(value, "activation")
    assert decode_layout(encode_layout(layout).tolist()) == layout
    single = layout_of(torch.zeros(2, 5, dtype=torch.bfloat16), "activation")
    assert decode_layout(encode_layout(single).tolist()) == single == (False, ((torch.bfloat16, (2, 5)),))
    with pytest.raises(TypeError, match="tensor or a tuple of tensors"):
        layout_of((torch.zeros(1), 3), "activation")


def test_signature_keys_by_input_shapes():
    (x, bucket), y = tuple_batches(1)[0]
    assert signature(((x, bucket), y, 1.0)) == ((10, 6), (10,))
    assert signature((x[:3], y[:3], 0.3)) == ((3, 6),)


def test_distributed_options():
    from pipeoptim.cli import build_parser

    args = build_parser().parse_args(["train", "--runtime", "distributed", "--timeout", "7", "--device", "cpu"])
    assert args.timeout == 7 and args.device == "cpu" and args.threads == 1


def test_failure_report_names_the_lost_stage_not_those_stopped_or_cut_off(tmp_path):
    from pipeoptim.checkpoint import save_manifest
    from pipeoptim.lab.launcher import failure_report
    from pipeoptim.lab.run_folder import write_status

    run = tmp_path / "run"
    write_status(run, 0, state="failed", kind="comm", message="lost contact with rank 2")
    write_status(run, 2, state="running")
    # stage 2 died by SIGKILL, stage 0 lost contact with it, stages 1 and 3 were stopped
    text, lost = failure_report({0: (1, ""), 1: (-15, "SIGTERM"), 2: (-9, "SIGKILL"), 3: (-15, "SIGTERM")}, run)
    assert lost == [2]
    assert text.startswith(f"stage 2 (rank 2, pid {os.getpid()}) was lost: killed by SIGKILL")
    assert text.endswith("No checkpoint was written yet")
    # 2 stages x 2 replicas: rank 2 runs stage 0 of replica 1
    text, _ = failure_report({0: (1, ""), 1: (-15, "SIGTERM"), 2: (-9, "SIGKILL"), 3: (-15, "SIGTERM")}, run, (2, 2))
    assert text.startswith(f"stage 0 of replica 1 (rank 2, pid {os.getpid()}) was lost")
    (run / "checkpoints" / "epoch0001-batch000000").mkdir(parents=True)
    save_manifest(run / "checkpoints" / "epoch0001-batch000000", {}, {})
    # no signal death: the stage that failed on its own, not the one cut off from it
    write_status(run, 1, state="failed", kind="error", message="RuntimeError: out of memory")
    text, lost = failure_report({0: (1, ""), 1: (1, "")}, run)
    assert lost == [1] and "failed (exit status 1): RuntimeError: out of memory" in text
    assert text.endswith(f"Last checkpoint: {run / 'checkpoints' / 'epoch0001-batch000000'}; continue "
                         f"with: pipeoptim train --runtime distributed --resume {run}")


def test_world_size_must_match_the_stages(monkeypatch, capsys):
    from pipeoptim.cli import main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    # --stages given to main() counts, whatever the program's own argv (here pytest's)
    assert main(["train", "--runtime", "distributed", "--stages", "2", "--model", "mlp"]) == 2
    assert "world size is 3" in capsys.readouterr().err


def test_a_users_torchrun_job_keeps_the_stages_and_takes_the_replicas_from_its_size(tmp_path):
    """The engine's rule in `pipeoptim train` under a user's torchrun: --stages fixed, the replicas the
    world over them (a job re-formed on fewer processes continues with fewer), unless --data-parallel
    is given, which the job must then hold; a resumed run keeps its own stages."""
    from pipeoptim.lab.config import RunConfig
    from pipeoptim.lab.launcher import job_stages

    cfg = RunConfig(task="image", model="mlp", method="pipeoptim", stages=2)
    assert [job_stages(cfg, world) for world in (2, 4, 6)] == [2, 2, 2]
    with pytest.raises(ValueError, match=r"--stages 2 runs 2 stage processes per replica but the world size is 5: "
                                         r"start a multiple of 2 processes, .*--nproc-per-node 2 or 4\)"):
        job_stages(cfg, 5)
    given = RunConfig(task="image", model="mlp", method="pipeoptim", stages=2, data_parallel=2)
    assert job_stages(given, 4) == 2
    with pytest.raises(ValueError, match=r"--stages 2 --data-parallel 2 runs 2 stage processes x 2 replicas but the "
                                         r"world size is 2: start 4 processes \(torchrun --nproc-per-node 4\), or "
                                         r"leave out --data-parallel, so that the replicas follow the world size"):
        job_stages(given, 2)
    with pytest.raises(ValueError, match=r"set \"data_parallel\": null in .*config.json"):
        job_stages(given, 2, resumed=tmp_path)
    # no --stages: a new run's come from the world
    assert job_stages(RunConfig(task="image", model="mlp", method="pipeoptim", stages=4), 2, stages_given=False) == 2
    assert job_stages(RunConfig(task="image", model="mlp", method="pipeoptim", stages=4, data_parallel=2), 8,
                      stages_given=False) == 4
    # resumed, the run's own 4 stages stay: 2 processes cannot hold them
    with pytest.raises(ValueError, match=r"the run in .* \(--stages 4\) runs 4 stage processes per replica"):
        job_stages(RunConfig(task="image", model="mlp", method="pipeoptim", stages=4), 2, resumed=tmp_path,
                   stages_given=False)


@pytest.mark.timeout(120)
def test_bench_reports_every_method_beside_the_baselines(tmp_path, capfd):
    from pipeoptim.cli import main

    out = tmp_path / "bench.json"
    # 3 timed mini-batches: stage 0's third forward comes after its first update, so PipeOptim predicts;
    # two rounds, the runs taking turns in a rotated order (the default is 5)
    assert main(["bench", "--synthetic", "--batches", "3", "--warmup", "1", "--batch-size", "16",
                 "--methods", "gpipe,pipeoptim", "--optimizer", "momentum", "--json", "--out", str(out),
                 "--timeout", "60", "--repeats", "2"]) == 0
    result = json.loads(capfd.readouterr().out)
    assert set(result["samples_per_second"]) == {"sequential-1dev", "sequential-all", "gpipe", "pipeoptim"}
    assert all(v > 0 for v in result["samples_per_second"].values())
    assert {"pipeoptim/sequential-1dev", "pipeoptim/gpipe"} <= set(result["ratios"])
    assert result["settings"]["stages"] == 2 and result["detail"]["gpipe"]["microbatches"] == 2
    assert result["settings"]["data_parallel"] == 1
    assert len(result["detail"]["pipeoptim"]["cpu_share"][0]) == 2          # a share per process
    assert all(len(result["detail"][m]["rounds_samples_per_second"]) == 2 for m in ("gpipe", "pipeoptim"))
    for name, copies in (("gpipe", [1, 1]), ("pipeoptim", [2, 1])):  # the state per stage, measured = closed form
        memory = result["detail"][name]["state_memory"]
        assert [m["weights"] for m in memory] == [m["weights_closed_form"] for m in memory] == \
            [c * m["parameters"] for c, m in zip(copies, memory)]
        assert all(m["gradients"] == m["optimizer"] == m["parameters"] > 0 for m in memory)  # SGD momentum
    assert json.loads(out.read_text())["samples_per_second"] == result["samples_per_second"]
