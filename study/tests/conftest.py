"""The study tests' fixtures: one compute thread (as tests/conftest.py), and a tiny synthetic
stand-in for Fashion-MNIST where the study's machinery trains or profiles the image task."""
from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


def synthetic_images(batch_size: int, limit: int, seed: int, holdout: int = 0, test: int = 2):
    """The image task's data as ``ImageTask.load`` shapes it (normalised ``(B, 1, 28, 28)`` float32
    images, int64 labels of 10 classes), made up: ``limit // batch_size`` training mini-batches in
    a seeded order, ``holdout`` validation images and ``test`` test mini-batches. Each class is a
    pattern plus noise, so that a few updates learn something."""
    from pipeoptim.lab.tasks.base import TaskData

    patterns = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(1234))

    def batches(count: int, size: int, stream: int):
        g = torch.Generator().manual_seed(stream)
        out = []
        for _ in range(count):
            y = torch.randint(0, 10, (size,), generator=g)
            out.append((patterns[y] + torch.randn(size, 1, 28, 28, generator=g), y))
        return out

    train = batches(limit // batch_size, batch_size, 1 + seed)
    validation = batches(-(-holdout // batch_size), batch_size, 1000) if holdout else []
    info = {"source": "synthetic (study/tests/conftest.py)", "n_train": len(train) * batch_size, "limit": limit,
            "batch_size": batch_size, "seed": seed}
    return TaskData(train=train, test=batches(test, batch_size, 2000), info=info, validation=validation)


@pytest.fixture
def tiny_images(monkeypatch):
    """The image task loads :func:`synthetic_images` (no data set needed, nothing to read), and a
    run folder gets no curves.png (matplotlib draws nothing the study's tests read)."""
    from pipeoptim.lab.tasks.image import ImageTask

    def load(self, *, batch_size, limit, seed, holdout=None):
        return synthetic_images(batch_size, limit, seed, holdout or 0)

    monkeypatch.setattr(ImageTask, "load", load)
    monkeypatch.setattr("pipeoptim.lab.experiment.plot_runs", lambda *args, **kwargs: None)
