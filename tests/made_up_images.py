"""A made-up stand-in for Fashion-MNIST, written as the four idx files the image task reads, for
the tests that run ``pipeoptim train --task image`` in processes of their own (the launcher and
each stage read the data set): a few hundred kilobytes, read in milliseconds, where the real
files take seconds of CPU to decompress in every process; and the tests run where Fashion-MNIST
is not installed. Each class is a fixed pattern plus noise, so that a few updates learn.

:func:`use_made_up_images` points ``$PIPEOPTIM_FASHION_MNIST_DIR`` at such a folder for a test
module (the processes it starts inherit the variable)."""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Iterator

import numpy as np

ENV = "PIPEOPTIM_FASHION_MNIST_DIR"
NAMES = {"train": "train", "test": "t10k"}


def write_images(folder: Path, train: int = 4096, test: int = 256, seed: int = 0) -> Path:
    """``train`` training and ``test`` test images (28 x 28 bytes, 10 classes) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    patterns = rng.integers(0, 256, size=(10, 28, 28))
    for split, count in (("train", train), ("test", test)):
        labels = rng.integers(0, 10, size=count).astype(np.uint8)
        images = np.clip(patterns[labels] + rng.integers(-80, 81, size=(count, 28, 28)), 0, 255).astype(np.uint8)
        for array, kind, magic in ((images, "images-idx3", 0x803), (labels, "labels-idx1", 0x801)):
            header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
            (folder / f"{NAMES[split]}-{kind}-ubyte").write_bytes(header + array.tobytes())
    return folder


def use_made_up_images(tmp_path_factory) -> Iterator[Path]:
    """For a module-scoped fixture: ``$PIPEOPTIM_FASHION_MNIST_DIR`` names a folder of made-up
    images while the module runs (``yield from use_made_up_images(tmp_path_factory)``)."""
    import pytest

    folder = write_images(tmp_path_factory.mktemp("made-up-images"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV, str(folder))
        yield folder
