"""Shared fixtures: small seeded models and data that every runtime test can use, and the torchrun
jobs whose lines the test files read: one of 2 processes and one of 4, each running several of the
tests' scripts in turn (a job's start, the processes importing torch, costs more than most
scripts' training)."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

# Tests run with one intra-op thread: deterministic, and fair to multi-process tests.
torch.set_num_threads(1)
os.environ.setdefault("PIPEOPTIM_CACHE", os.path.join(os.path.dirname(__file__), "..", ".cache"))


def load_benchmark(name: str) -> ModuleType:
    """The module ``benchmarks.<name>`` (``name`` without .py): benchmarks/ is a package, importable
    from the repository root (pytest's ``pythonpath = ["."]``)."""
    return importlib.import_module(f"benchmarks.{name}")


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as the module ``name`` (scripts/ is no package; registered in
    ``sys.modules``, where a dataclass of the script looks its module up)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def mlp(depth: int = 8, width: int = 12, classes: int = 4, dtype=torch.float64, seed: int = 0) -> nn.Sequential:
    """An MLP of ``depth`` Linear+Tanh blocks, one block per layer so any partition works."""
    torch.manual_seed(seed)
    layers = [nn.Linear(6, width)] + [nn.Sequential(nn.Tanh(), nn.Linear(width, width)) for _ in range(depth - 2)]
    layers += [nn.Sequential(nn.Tanh(), nn.Linear(width, classes))]
    return nn.Sequential(*layers).to(dtype)


def batches(count: int = 12, size: int = 8, classes: int = 4, dtype=torch.float64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(count, size, 6, generator=g, dtype=dtype)
    ys = torch.randint(0, classes, (count, size), generator=g)
    return list(zip(xs, ys))


def has_image_data() -> bool:
    """Whether Fashion-MNIST is installed (tests that train on it skip without it)."""
    try:
        from pipeoptim.lab.tasks.image import load_arrays

        load_arrays()
    except Exception:  # noqa: BLE001 - MissingDataError or an unreadable file: skip
        return False
    return True


def roll_back_to_older_checkpoint(run_dir) -> None:
    """Point a run folder's ``latest.json`` at its oldest checkpoint, as if the run had died
    right after writing it."""
    import json

    store = run_dir / "checkpoints"
    older = sorted(p.name for p in store.iterdir() if p.is_dir())[0]
    (store / "latest.json").write_text(json.dumps({"checkpoint": older}))


@pytest.fixture
def tiny_mlp():
    return mlp()


@pytest.fixture
def tiny_batches():
    return batches()


#: the groups of tests/torchrun_traced.py (model, methods, split points), by name: the tied GPT cut
#: where the profile says, plain and clipped by the global norm (tests/test_traced.py); SkipNet's
#: several tensors across (tests/test_traced.py); every asynchronous method on the tied GPT
#: (tests/test_tied_async.py; None: its ASYNC, filled in by the fixture)
TRACED_GROUPS = {
    "tied-gpt": ("gpt", "1f1b-flush,1f1b-flush:0.5", "-"),
    "skip": ("skip", "1f1b-flush,pipedream,pipeoptim", "blocks.1"),
    "async-gpt": ("gpt", None, "layers.1"),
}

#: what the scripts of the 2-process job import anyway, imported before its first Pipeline and left
#: out of the collections of every Pipeline's teardown (tests/torchrun_jobs.py, ``--preload``)
PRELOAD = ["torch", "torch._dynamo", "torch._functorch.aot_autograd", "torch._inductor.compile_fx", "transformers",
           *(f"transformers.models.{family}.modeling_{family}" for family in ("gpt2", "llama", "qwen2", "bert", "vit",
                                                                               "t5", "bart", "resnet")),
           "pipeoptim.pipeline", "pipeoptim.cli", "pipeoptim.lab.tasks.image", "library_models", "traced_models",
           "first_day"]

#: what the scripts of the 4- and 8-process jobs import anyway (dynamo at the first optimizer step,
#: FSDP2 and tensor parallelism's modules, the library models of the tensor-parallel and sharded ones)
PRELOAD_WIDE = ["torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "transformers",
                "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
                "pipeoptim.pipeline", "traced_models"]

#: the wall-clock limit of a shared job (a loaded 2-core machine runs the 2-process one for minutes)
JOB_TIMEOUT = 1200


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After each test file (its module's fixtures gone): collect what is garbage, and leave what
    lives on (the modules imported so far, the session's fixtures) out of the later collections, so
    that the collector walks only what was made since, not torch's, dynamo's and transformers'
    modules over and over (as tests/torchrun_jobs.py does in a job's processes)."""
    yield
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        import gc

        gc.collect()
        gc.freeze()


def pytest_collection_modifyitems(items):
    """A test that reads a shared torchrun job may be the one that waits for all of it: its
    pytest-timeout limit is the job's, not the 300 s of one test."""
    for item in items:
        if {"torchrun_2", "torchrun_4", "torchrun_8"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.timeout(JOB_TIMEOUT + 300), append=False)  # before the test's own


@pytest.fixture(scope="session")
def torchrun_2(tmp_path_factory):
    """One ``torchrun --nproc-per-node 2`` job (tests/torchrun_jobs.py) running, in turn, every
    2-process script whose numbers the tests hold against one process; ``torchrun_2.rows(name)``:
    what script ``name`` printed. A job's start (the launcher and two processes importing torch)
    costs more than most scripts' training. The scripts, by name:

    - ``refusals``: Pipelines the processes cannot hold, refused on every rank (test_torchrun.py,
      test_bidirectional.py), first: the first Pipeline of the job starts its process group
    - ``methods``: every method, clipped, evaluated every k, with the delay fixes (test_torchrun.py)
    - ``compiled``: every method compiled with aot_eager and eager (test_compile.py)
    - ``traced``: the groups of :data:`TRACED_GROUPS` (test_traced.py, test_tied_async.py)
    - ``dict``: library LMs from dict batches (test_dict_batches.py; their weights in ``folder/dict``)
    - ``eval-2``: evaluation in the bubbles on 2 stages (test_eval_in_bubbles_torchrun.py)
    - ``example``: examples/fashion_mnist_pipeline.py (test_torchrun.py)
    - ``dualpipev-2``: dualpipev and torch's DualPipeV order on 2 processes (test_dualpipev.py)
    - ``bitpipe-whole``: tests/torchrun_checkpoint.py's uninterrupted bitpipe run, which a cut one
      resumes to (test_chunks.py; in ``folder/bitpipe-whole``)
    - ``gpu-check``: scripts/gpu_check_worker.py's CPU rows, the GPU check's table small
      (test_gpu_check.py; its checkpoints in ``folder/gpu-check``)
    - ``first-day``: the library models as they come, one stage per process
      (tests/torchrun_first_day.py: test_first_day.py, test_seq2seq.py; its checkpoints in
      ``folder/first-day``)
    - ``cli-zb-v``: ``-m pipeoptim train`` of a chunked partition (test_chunks.py; with Fashion-MNIST
      only), last: the command line's worker starts the job's process group and destroys it, and
      runs once a process (a second run joins the group without a new store prefix, and hangs)

    ``torchrun_2.folder``: where they write."""
    import test_chunks
    import test_compile
    import test_dict_batches
    import test_first_day
    import test_gpu_check
    import test_torchrun
    from test_tied_async import ASYNC
    from torchrun_jobs import HERE, launch

    folder = tmp_path_factory.mktemp("torchrun_2")
    (folder / "dict").mkdir()
    (folder / "first-day").mkdir()
    traced = [arg if arg is not None else ",".join(ASYNC) for group in TRACED_GROUPS.values() for arg in group]
    jobs = {
        "refusals": [HERE / "torchrun_refusals.py"],
        "methods": [test_torchrun.SCRIPT, ",".join(test_torchrun.ENTRIES), 2],
        "compiled": [HERE / "torchrun_compiled.py", ",".join(test_compile.UNDER_TORCHRUN), "aot_eager"],
        "traced": [HERE / "torchrun_traced.py", *traced],
        "dict": [HERE / "torchrun_dict_batches.py", ",".join(test_dict_batches.UNDER_TORCHRUN), folder / "dict"],
        "eval-2": [HERE / "torchrun_eval_in_bubbles.py", 2],
        "example": [test_torchrun.EXAMPLE, *test_torchrun.EXAMPLE_ARGS],
        "dualpipev-2": [HERE / "torchrun_dualpipev.py", 2],
        "bitpipe-whole": [test_torchrun.CHECKPOINT_SCRIPT, folder / "bitpipe-whole", *test_chunks.BITPIPE_RUN],
        "gpu-check": [test_gpu_check.WORKER, *test_gpu_check.worker_args(folder / "gpu-check")],
        "first-day": [HERE / "torchrun_first_day.py",
                      ",".join(test_first_day.JOB_ENTRIES) + f"@{folder / 'first-day'}"],
    }
    if has_image_data():  # last: the command line's worker starts the process group itself and ends it
        jobs["cli-zb-v"] = ["-m", "pipeoptim", *test_chunks.under_users_torchrun("zb-v", folder / "cli-zb-v")]
    printed = launch(jobs, nproc=2, preload=PRELOAD, timeout=JOB_TIMEOUT)
    printed.folder = folder
    return printed


@pytest.fixture(scope="session")
def torchrun_4(tmp_path_factory):
    """One ``torchrun --nproc-per-node 4`` job (tests/torchrun_jobs.py) of the 4-process scripts:

    - ``schedules``: the schedules people run, one pipeline over 4 processes (test_torchrun.py)
    - ``eval-4``: evaluation in the bubbles on 4 stages (test_eval_in_bubbles_torchrun.py)
    - ``dualpipev-4``: dualpipev and torch's DualPipeV order on 4 processes (test_dualpipev.py)
    - ``chunked-replicas``: a tied GPT under chunked methods on 2 stages x 2 replicas (test_library_models.py)
    - ``tensor-parallel``: 2 stages x 2 tensor ranks, every family and Llama's own plan (test_tensor_parallel.py)
    - ``tensor-checkpoints``: checkpoints from one process to 2 x 2 tensor ranks and back (test_tensor_parallel.py;
      in ``torchrun_4.folder``)
    - ``data-parallel``: 2 replicas of 2 stages, small gradient buckets (test_torchrun.py; test_multinode.py's one-node reference)
    - ``equivalence``: every method on 4 stages and on 2 x 2, in a process group the script starts
      (tests/torchrun_distributed.py: test_distributed.py; in ``torchrun_4.folder / "equivalence"``)
    - ``sharded``: each stage sharded over its 2 replicas, every weight policy, the resharded checkpoint,
      the GPT-2 example and the command line (tests/torchrun_sharded.py: test_sharding.py, test_examples.py;
      in ``torchrun_4.folder / "sharded"``), last: its command line's run ends the job's process group"""
    import test_library_models
    import test_sharding
    import test_tensor_parallel
    import test_torchrun
    from torchrun_jobs import HERE, launch

    folder = tmp_path_factory.mktemp("torchrun_4")
    (folder / "sharded").mkdir()
    (folder / "equivalence").mkdir()
    printed = launch({"schedules": [test_torchrun.SCRIPT, ",".join(test_torchrun.SCHEDULES), 4],
                      "eval-4": [HERE / "torchrun_eval_in_bubbles.py", 4],
                      "dualpipev-4": [HERE / "torchrun_dualpipev.py", 4],
                      "chunked-replicas": [HERE / "torchrun_chunked_replicas.py",
                                           ",".join(test_library_models.CHUNKED_REPLICAS)],
                      "tensor-parallel": [HERE / "torchrun_tensor_parallel.py", ",".join(test_tensor_parallel.UNDER_TORCHRUN)],
                      "tensor-checkpoints": [HERE / "torchrun_tensor_parallel.py", "checkpoints", folder],
                      "data-parallel": [test_torchrun.DP_SCRIPT, *test_torchrun.DATA_PARALLEL, 256],
                      "equivalence": [HERE / "torchrun_distributed.py", folder / "equivalence"],
                      "sharded": [test_sharding.SCRIPT, *test_sharding.job_args(folder / "sharded")]},
                     nproc=4, preload=PRELOAD_WIDE, timeout=JOB_TIMEOUT)
    printed.folder = folder
    return printed


@pytest.fixture(scope="session")
def torchrun_8():
    """One ``torchrun --nproc-per-node 8`` job: 2 stages x 2 replicas x 2 tensor ranks, each split
    stage sharded over its replicas (tests/torchrun_tensor_parallel.py's ``SHARDED`` entries of
    test_tensor_parallel.py, as ``tensor-parallel-8``)."""
    import test_tensor_parallel
    from torchrun_jobs import HERE, launch

    return launch({"tensor-parallel-8": [HERE / "torchrun_tensor_parallel.py", ",".join(test_tensor_parallel.SHARDED)]},
                  nproc=8, preload=PRELOAD_WIDE[:4] + ["pipeoptim.pipeline"], timeout=JOB_TIMEOUT)


@pytest.fixture(scope="session")
def traced_under_torchrun(torchrun_2):
    """{group name: rank 0's JSON lines of that group} of tests/torchrun_traced.py in the 2-process job."""
    names = list(TRACED_GROUPS)
    found = {name: [] for name in names}
    for row in torchrun_2.rows("traced"):
        found[names[row.pop("group")]].append(row)
    return found


class Crash(Exception):
    """What :func:`crash_at` raises: a run stopped there, as if killed, for a resume test."""


def crash_at(stop: int):
    """An ``on_batch`` callback that raises :class:`Crash` once mini-batch ``stop``'s loss is in."""
    def on_batch(index: int, loss: float) -> None:
        if index == stop:
            raise Crash()
    return on_batch
