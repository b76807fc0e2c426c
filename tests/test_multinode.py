"""A job on two nodes gives the numbers of the same job on one: two torchrun agents on this machine
(``--nnodes 2``, a c10d rendezvous on the loopback), each starting its node's processes.

Ranks fill the nodes in order (node g holds ranks g*K .. g*K+K-1 with ``--nproc-per-node K``) and
rank d*N + k runs stage k of replica d: with K = N each node holds one whole pipeline and the
replicas span the nodes; with K < N the pipeline does (README, "Several nodes"). One job of two
nodes of K = 2 runs both, a 4-stage pipeline and 2 replicas of a 2-stage one, on tiny models with
the tests' strict transport (tests/torchrun_jobs.py's ``env``); the losses, evaluations and
weights are those of one process and of one node (the replicas' script in tests/conftest.py's
4-process job: no job of its own to start), to the last bit. One process per node (K = 1,
N = 2, through the command line) is tests/test_distributed.py's two-node test: a third start of
agents costs more than this file's training."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import pytest

from test_torchrun import DATA_PARALLEL
from torchrun_jobs import HERE, Printed, env, run_here

METHODS = HERE / "torchrun_methods.py"
DATA_PARALLEL_SCRIPT = HERE / "torchrun_data_parallel.py"
NODES_SCRIPT = HERE / "torchrun_nodes.py"
#: the pipeline across the nodes: tests/torchrun_methods.py's methods and stages
ACROSS = ["pipeoptim,1f1b-flush", 4]
#: replicas across the nodes: tests/torchrun_data_parallel.py's methods, stages, micro-batches,
#: replicas of its one-process run, and gradient buckets small enough to overlap the backward: two
#: of the methods of tests/conftest.py's ``torchrun_4`` job's ``data-parallel`` script, run there on
#: one node with the same arguments (test_torchrun.py's DATA_PARALLEL and buckets of 256 bytes)
REPLICATED = ["1f1b-flush,pipeoptim", *DATA_PARALLEL[1:], 256]
TIMEOUT = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_nodes(jobs: Dict[str, Sequence], nodes: int, nproc: int, timeout: float = TIMEOUT) -> Printed:
    """tests/torchrun_jobs.py's job of ``jobs`` ({name: [script, *args]}) on ``nodes`` torchrun
    agents of ``nproc`` processes each, all on this machine; every agent in a session of its own, so
    that it is killed with its processes after ``timeout`` seconds."""
    argv: List[str] = []
    for i, (name, (script, *args)) in enumerate(jobs.items()):
        argv += [*(["---"] if i else []), name, str(script), *map(str, args)]
    port = free_port()
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(nproc),
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"nodes-{port}"]
    with tempfile.TemporaryDirectory(prefix="torchrun-nodes-") as folder:
        agents = [subprocess.Popen([*agent, str(HERE / "torchrun_jobs.py"), *argv],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**env(), "TORCHRUN_JOBS_OUT": folder}, cwd=HERE.parent,
                                   start_new_session=True)
                  for _ in range(nodes)]
        deadline, outs, killed = time.monotonic() + timeout, [], ""
        try:
            for agent in agents:
                outs.append(agent.communicate(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for agent in agents:  # each agent and its processes: a process group of their own
                if agent.poll() is None:
                    os.killpg(agent.pid, signal.SIGKILL)
            outs += [agent.communicate() for agent in agents[len(outs):]]
            killed = f"\n(the job was killed after {timeout} s)"
        lines = "".join(path.read_text() for path in sorted(Path(folder).glob("rank*.jsonl")))
    status = next((a.returncode for a in agents if a.returncode), 0)
    stdout = "".join(out for out, _ in outs)
    stderr = "".join(f"--- node agent {i}:\n{err}" for i, (_, err) in enumerate(outs)) + killed
    return Printed(subprocess.CompletedProcess(agents[0].args, status, stdout, stderr), nodes * nproc, lines)


@pytest.fixture(scope="module")
def jobs(torchrun_4) -> Tuple[Printed, Printed]:
    """One job on two nodes of two processes (world 4): where the ranks of a 4-stage and of a 2-stage
    Pipeline sit, a 4-stage pipeline across the nodes, and 2 replicas of a 2-stage one; and the
    session's 4-process job on one node, which runs the replicas' script with the same arguments
    (its ``data-parallel``)."""
    two_nodes = launch_nodes({"where-4": [NODES_SCRIPT, 4], "where-2": [NODES_SCRIPT, 2],
                              "methods": [METHODS, *ACROSS], "data-parallel": [DATA_PARALLEL_SCRIPT, *REPLICATED]},
                             nodes=2, nproc=2)
    return two_nodes, torchrun_4


def where(printed: Printed, name: str) -> Dict[int, tuple]:
    """{rank: (node, replica, stages)} from tests/torchrun_nodes.py's lines."""
    return {row["rank"]: (row["node"], row["replica"], row["stages"]) for row in printed.rows(name)}


def by_method(lines: List[str]) -> dict:
    return {row["method"]: row for row in map(json.loads, lines)}


def same_numbers(got: dict, expected: dict, methods: str) -> None:
    assert sorted(got) == sorted(expected) == sorted(methods.split(","))
    for method in got:
        assert got[method]["losses"] == expected[method]["losses"], method
        assert got[method]["weights"] == expected[method]["weights"], method
        assert got[method]["metric"] == expected[method]["metric"], method


def test_a_pipeline_across_two_nodes_gives_the_losses_of_one_process(jobs):
    """N = 4 on two nodes of K = 2: stages 0, 1 on one node, 2, 3 on the other (the hand-offs
    between stages 1 and 2 cross them); the methods script's losses, evaluations and weights, bit
    for bit, of one process (as are the script's torchrun runs on one node, tests/test_torchrun.py)."""
    two_nodes = jobs[0]
    assert where(two_nodes, "where-4") == {0: (0, 0, [0]), 1: (0, 0, [1]), 2: (1, 0, [2]), 3: (1, 0, [3])}
    spread = by_method(two_nodes.lines("methods", rank=0))
    assert two_nodes.ranks("methods") == [0] * len(spread)  # rank 0 prints, on whichever node it is
    local = by_method(run_here(METHODS, *ACROSS).splitlines())
    same_numbers(spread, local, ACROSS[0])
    for method in spread:
        assert (spread[method]["processes"], local[method]["processes"]) == (4, 1)
        assert spread[method]["stepped"] == local[method]["stepped"]  # step() and flush() by hand


def test_two_replicas_of_a_pipeline_on_two_nodes_give_the_losses_of_one_node(jobs):
    """N = 2, D = 2 on two nodes of K = 2: each node holds one whole pipeline (ranks 0, 1: replica
    0; ranks 2, 3: replica 1), so only the replicas' gradient averaging crosses the nodes; the
    losses, evaluations and weights, bit for bit, of the same script's four processes on one node
    (tests/conftest.py's ``torchrun_4`` job)."""
    two_nodes, one_node = jobs
    assert where(two_nodes, "where-2") == {0: (0, 0, [0]), 1: (0, 0, [1]), 2: (1, 1, [0]), 3: (1, 1, [1])}
    spread = by_method(two_nodes.lines("data-parallel", rank=0))
    assert set(REPLICATED[0].split(",")) <= set(DATA_PARALLEL[0].split(","))  # the one-node job runs them
    local = {method: row for method, row in by_method(one_node.lines("data-parallel", rank=0)).items()
             if method in REPLICATED[0].split(",")}
    assert {row["replicas"] for row in [*spread.values(), *local.values()]} == {2}
    same_numbers(spread, local, REPLICATED[0])
