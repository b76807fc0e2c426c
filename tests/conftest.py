"""Shared fixtures: small seeded models and data that every runtime test can use, and the one
torchrun job of tests/torchrun_traced.py that tests/test_traced.py and tests/test_tied_async.py
read (a job's start, two processes importing torch, costs more than its training)."""
from __future__ import annotations

import importlib
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


#: the groups of tests/torchrun_traced.py's one job (model, methods, split points), by name: the tied
#: GPT cut where the profile says, plain and clipped by the global norm (tests/test_traced.py);
#: SkipNet's several tensors across (tests/test_traced.py); every asynchronous method on the tied GPT
#: (tests/test_tied_async.py; None: its ASYNC, filled in by the fixture)
TRACED_GROUPS = {
    "tied-gpt": ("gpt", "1f1b-flush,1f1b-flush:0.5", "-"),
    "skip": ("skip", "1f1b-flush,pipedream,pipeoptim", "blocks.1"),
    "async-gpt": ("gpt", None, "layers.1"),
}


@pytest.fixture(scope="session")
def traced_under_torchrun():
    """{group name: rank 0's JSON lines of that group} of one ``torchrun --nproc-per-node 2
    tests/torchrun_traced.py`` job running every group of :data:`TRACED_GROUPS`."""
    from test_tied_async import ASYNC
    from test_traced import torchrun

    args = [arg if arg is not None else ",".join(ASYNC) for group in TRACED_GROUPS.values() for arg in group]
    names = list(TRACED_GROUPS)
    found = {name: [] for name in names}
    for row in torchrun(*args):
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
