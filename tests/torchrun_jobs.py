"""Several of the tests' torchrun scripts in turn, in one torchrun job (tests/conftest.py's
``torchrun_2`` and ``torchrun_4``): a job's start, the launcher and every process importing torch,
costs more CPU than most of the scripts' training, so the checks against one process of several
test files share one start.

    torchrun ... tests/torchrun_jobs.py [--preload MODULE,...] NAME SCRIPT ARG... [--- NAME SCRIPT ARG... ...]

Each SCRIPT (a path, or ``-m MODULE``) runs as ``__main__`` with ``sys.argv = [SCRIPT, *ARGS]``, in
this process, after the ones before it, and its Pipelines end with it: the teardowns their
``atexit`` would run at the script's exit run when it returns (pipeoptim/torchrun.py, ``leave``:
the last Pipeline made first), so the next script's first Pipeline starts the job's process group
again, as a script's Pipeline made after another's close() does. (Left alive to the exit, every
script's Pipelines would keep their process groups and those groups' gloo threads, whose idle
wakeups cost the scripts after them the more, the more there are; and their teardowns at the exit
would walk everything the scripts left. Measured: some 35 of the 2-process job's 100 CPU-s, 40 of
the 4-process job's 100.) What it prints to stdout on each rank comes out after it as JSON lines
``{"job": NAME, "rank": RANK, "line": LINE}``, then ``{"job": NAME, "rank": RANK, "done": true,
"cpu": SECONDS}`` (the script's CPU time on that rank, its teardowns' included; at the exit, job
``(exit)``: what is left). A script that raises ends the job: the scripts after it print nothing,
and its Pipelines end at the exit. Each rank writes its lines to a file of its own in the folder
``TORCHRUN_JOBS_OUT`` names (stdout without it): on the stdout the ranks share, a line longer than
the pipe's atomic write (4 KiB; a row of losses is longer) could be cut by another rank's, and a
line lost so fails a test.

``--preload``: modules imported before any script, and then, with everything else alive at that
point, left out of the cyclic garbage collector (``gc.freeze``); after each script and its
Pipelines' teardowns, what it left alive (the modules it imported, its compiled graphs) is
collected once and frozen too. Each Pipeline's teardown runs a full collection, about 0.1 CPU-s
a process over torch's, dynamo's and transformers' modules, for each of the ~80 Pipelines of the
2-process job: it walks only what was made since. Nothing of a Pipeline's is frozen (a script's
Pipelines end before the freeze), so the collections still find every cycle a Pipeline leaves.

This module is also the tests' side of those jobs: :func:`launch` starts one, :class:`Printed`
reads it, :func:`run_here` runs a script's one-process reference in the pytest process."""
from __future__ import annotations

import atexit
import contextlib
import gc
import io
import json
import os
import resource
import runpy
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

HERE = Path(__file__).resolve().parent


def cpu() -> float:
    """This process's CPU seconds so far (every thread's)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def emit(row: dict) -> None:
    """One line of this rank's: to its own file under ``TORCHRUN_JOBS_OUT`` (else to stdout)."""
    folder = os.environ.get("TORCHRUN_JOBS_OUT")
    line = json.dumps(row) + "\n"
    if folder is None:
        sys.stdout.write(line)
        sys.stdout.flush()
        return
    with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.jsonl"), "a") as out:
        out.write(line)


def run_script(script: str, args: Sequence[str], job: Optional[str] = None) -> str:
    """What ``python SCRIPT ARGS`` (``-m MODULE ARGS``) prints to stdout, run in this process;
    under a job, each line is also emitted as the job's (even when the script raises)."""
    out = io.StringIO()
    saved = sys.argv
    try:
        with contextlib.redirect_stdout(out):
            try:
                if script == "-m":
                    sys.argv = [args[0], *args[1:]]
                    runpy.run_module(args[0], run_name="__main__", alter_sys=True)
                else:
                    sys.argv = [script, *args]
                    runpy.run_path(script, run_name="__main__")
            except SystemExit as end:  # a command line's exit status
                if end.code not in (0, None):
                    raise
    finally:
        sys.argv = saved
        if job is not None:
            rank = int(os.environ.get("RANK", "0"))
            for line in out.getvalue().splitlines():
                emit({"job": job, "rank": rank, "line": line})
    return out.getvalue()


def settle() -> None:
    """Collect what is garbage now, and leave what lives on out of the later collections."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def exit_hooks() -> Iterator[List]:
    """The functions registered with ``atexit`` inside the block, in order (registered as well)."""
    made: List = []
    register = atexit.register

    def recording(func, *args, **kwargs):
        made.append(func)
        return register(func, *args, **kwargs)

    atexit.register = recording
    try:
        yield made
    finally:
        atexit.register = register


def tear_down(hooks: List) -> None:
    """Run the Pipelines' exit teardowns among ``hooks`` (pipeoptim/torchrun.py, ``leave``) as the
    script's exit would: the last one made first. Each runs once: at the exit it does nothing."""
    for hook in reversed(hooks):
        owner = getattr(hook, "__self__", None)
        if getattr(hook, "__name__", "") == "leave" and type(owner).__module__ == "pipeoptim.torchrun":
            hook()


def main(argv: List[str]) -> None:
    if argv[:1] == ["--preload"]:
        import importlib

        for module in argv[1].split(","):
            try:
                importlib.import_module(module)
            except ImportError:  # a test that needs it skips, and its script is not run
                pass
        argv = argv[2:]
        settle()
    jobs: List[List[str]] = [[]]
    for arg in argv:
        if arg == "---":
            jobs.append([])
        else:
            jobs[-1].append(arg)
    rank = int(os.environ.get("RANK", "0"))
    ended: List[float] = []  # the CPU time when the last script ended: the teardowns' share, at the exit
    atexit.register(lambda: ended and emit({"job": "(exit)", "rank": rank, "cpu": round(cpu() - ended[0], 2)}))
    for name, script, *args in jobs:
        start = cpu()
        with exit_hooks() as hooks:
            run_script(script, args, job=name)
        tear_down(hooks)  # (a script that raised ends the job: its Pipelines end at the exit)
        settle()
        emit({"job": name, "rank": rank, "done": True, "cpu": round(cpu() - start, 2)})
    ended.append(cpu())


# -- the tests' side ---------------------------------------------------------------------------------

def env() -> Dict[str, str]:
    """The environment of a torchrun job of the tests: one compute thread, src/ and tests/ on the
    path, no torchrun variables of an outer job, gloo on the loopback device, and NCCL's rules
    kept on it (runtime/strict.py: a send met only by its started receive, a pair's operations in
    order, a pair's first operation waiting for both ends), so that what would hang on a GPU fails
    here."""
    from test_torchrun import _env

    out = _env()
    out["PYTHONPATH"] += os.pathsep + str(HERE)
    out["PIPEOPTIM_STRICT_TRANSPORT"] = "1"
    return out


class Printed:
    """What one job of :func:`launch` printed, by script: ``lines(name)``, ``rows(name)``."""

    def __init__(self, done: subprocess.CompletedProcess, nproc: int, lines: str = "") -> None:
        """``lines``: the ranks' files of JSON lines, one after the other (with the job's stdout)."""
        self.nproc, self.returncode, self.stdout, self.stderr = nproc, done.returncode, done.stdout, done.stderr
        self.printed: Dict[str, List[dict]] = {}
        self.finished: Dict[str, set] = {}
        self.cpu: Dict[str, float] = {}  #: CPU seconds of each script, every rank's together
        for line in (lines + done.stdout).splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if not isinstance(row, dict) or "job" not in row:
                continue
            if "cpu" in row:
                self.cpu[row["job"]] = self.cpu.get(row["job"], 0.0) + row["cpu"]
            if row.get("done"):
                self.finished.setdefault(row["job"], set()).add(row["rank"])
            elif "line" in row:
                self.printed.setdefault(row["job"], []).append(row)

    def lines(self, name: str, rank: Optional[int] = None) -> List[str]:
        """The lines script ``name`` printed (on ``rank``, or on any), in the order they came; the
        test fails, with the job's stderr, unless the script ended on every rank."""
        import pytest

        if self.finished.get(name) != set(range(self.nproc)):
            pytest.fail(f"{name!r} of the torchrun job did not end on every rank (exit status "
                        f"{self.returncode}):\n{self.stderr[-4000:]}")
        return [r["line"] for r in self.printed.get(name, []) if rank is None or r["rank"] == rank]

    def ranks(self, name: str) -> List[int]:
        """The rank of each line of ``lines(name)``."""
        self.lines(name)
        return [r["rank"] for r in self.printed.get(name, [])]

    def rows(self, name: str) -> List[dict]:
        """The JSON lines script ``name`` printed, from every rank."""
        return [json.loads(line) for line in self.lines(name) if line.startswith("{")]


def launch(jobs: Dict[str, Sequence], nproc: int, preload: Sequence[str] = (), timeout: float = 900) -> Printed:
    """One ``torchrun --nproc-per-node NPROC`` job running every script of ``jobs`` ({name:
    [script, *args]}) in turn; killed, its workers too, after ``timeout`` seconds."""
    argv: List[str] = ["--preload", ",".join(preload)] if preload else []
    for i, (name, (script, *args)) in enumerate(jobs.items()):
        argv += [*(["---"] if i else []), name, str(script), *map(str, args)]
    with tempfile.TemporaryDirectory(prefix="torchrun-jobs-") as folder:
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                str(nproc), str(HERE / "torchrun_jobs.py"), *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**env(), "TORCHRUN_JOBS_OUT": folder},
                               cwd=HERE.parent, start_new_session=True)
        try:
            out, err = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # the launcher and its workers: their own process group
            os.killpg(job.pid, signal.SIGKILL)
            out, err = job.communicate()
            err += f"\n(the job was killed after {timeout} s)"
        lines = "".join(path.read_text() for path in sorted(Path(folder).glob("rank*.jsonl")))
    return Printed(subprocess.CompletedProcess(job.args, job.returncode, out, err), nproc, lines)


def run_here(script, *args) -> str:
    """stdout of ``python SCRIPT ARGS`` (``-m MODULE ARGS``), run in the pytest process: the
    one-process reference of a torchrun job, without a process of its own to import torch. The
    global random state is put back after (the scripts seed it)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        return run_script(str(script), [str(a) for a in args])


if __name__ == "__main__":
    main(sys.argv[1:])
