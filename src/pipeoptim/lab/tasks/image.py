"""Image classification on Fashion-MNIST: 28x28 grey-scale images of clothing, 10 classes.

Data. The four gzipped idx files come from Debian's ``dataset-fashion-mnist`` package
(``/usr/share/datasets/fashion-mnist``; ``$PIPEOPTIM_FASHION_MNIST_DIR`` points elsewhere). They
are parsed with numpy, nothing is downloaded, and a missing data set raises
:class:`~pipeoptim.lab.tasks.base.MissingDataError` naming the install command. Parsed arrays are
cached in memory per process. Pixels are scaled to [0, 1] and then normalised with the mean and
standard deviation of the whole training set (independent of ``limit`` and ``seed``).

Batches. :meth:`ImageTask.load` shuffles the 60,000 training images once with a generator seeded
by ``seed``; ``limit`` keeps the first ``limit`` of that order; the last incomplete batch is
dropped, so every training mini-batch has exactly ``batch_size`` examples. ``holdout=N`` (off by
default) holds the last N images of the training file out as the validation split, before the
shuffle and ``limit`` apply to the rest: the validation images are the same for every ``limit``
and ``seed``, in file order, and the other images keep their order (the shuffled order without
the held-out ones). The test set keeps the
file order (seed-independent, roughly class-balanced at any prefix): all 10,000 images without
``limit``, otherwise the first ``min(10000, max(limit // 5, 1000, batch_size))`` of them, a fixed
set large enough for a steady accuracy but cheap to evaluate. Test batches keep the last partial
batch. Inputs are float32 tensors ``(B, 1, 28, 28)``; targets int64 ``(B,)``.

Models: :mod:`pipeoptim.lab.tasks.image_models` (``vgg``, the default; ``vgg-bn``, ``resnet``, ``mlp``).
"""
from __future__ import annotations

import functools
import gzip
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from .base import ClassificationTask, MissingDataError, TaskData, check_holdout
from .common import seeded_permutation
from .image_models import MODELS, build_image_model

DATA_DIR_ENV = "PIPEOPTIM_FASHION_MNIST_DIR"
DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
INSTALL_HINT = (
    "install it with `sudo apt-get install --no-install-recommends dataset-fashion-mnist` "
    f"(or `make setup`), or point ${DATA_DIR_ENV} at a folder holding the four idx files"
)

#: The idx files of the data set (each may be gzipped, ``NAME.gz``, or plain, ``NAME``).
FILES: Dict[str, str] = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
IMAGE_MAGIC = 0x00000803  #: unsigned bytes, 3 dimensions (count, rows, columns)
LABEL_MAGIC = 0x00000801  #: unsigned bytes, 1 dimension (count)

CLASSES: Tuple[str, ...] = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
NUM_CLASSES = len(CLASSES)
INPUT_SHAPE = (1, 28, 28)
FULL_TEST_SIZE = 10_000
MIN_LIMITED_TEST_SIZE = 1_000


# ---------------------------------------------------------------------------------------------
# idx files


class IdxFormatError(ValueError):
    """A file is not in the idx format (or not the idx file that was expected)."""


#: idx type codes (third byte of the magic number) -> big-endian numpy dtype
_IDX_DTYPES: Dict[int, str] = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike, expected_magic: Optional[int] = None) -> np.ndarray:
    """Parse an idx file (gzipped or plain, told apart by its first bytes) into a numpy array.

    The idx format: a 4-byte big-endian magic number ``0x0000TTDD`` (``TT`` the element type,
    ``DD`` the number of dimensions), then ``DD`` big-endian uint32 sizes, then the elements.
    ``expected_magic`` (e.g. :data:`IMAGE_MAGIC`) makes any other magic number an error.
    Raises :class:`IdxFormatError` for a malformed file. The array is a read-only view of the
    file's bytes.
    """
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as error:
            raise IdxFormatError(f"{path}: broken gzip data ({error})") from error
    if len(raw) < 4:
        raise IdxFormatError(f"{path}: too short for an idx file ({len(raw)} bytes)")
    magic = int.from_bytes(raw[:4], "big")
    if expected_magic is not None and magic != expected_magic:
        raise IdxFormatError(
            f"{path}: bad idx magic number 0x{magic:08x}, expected 0x{expected_magic:08x}"
        )
    type_code, ndim = raw[2], raw[3]
    if raw[:2] != b"\x00\x00" or type_code not in _IDX_DTYPES or ndim == 0:
        raise IdxFormatError(f"{path}: bad idx magic number 0x{magic:08x} (not an idx file?)")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IdxFormatError(f"{path}: idx header cut short")
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_IDX_DTYPES[type_code])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise IdxFormatError(
            f"{path}: idx data has {len(raw) - header} bytes, shape {shape} needs {expected}"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)


# ---------------------------------------------------------------------------------------------
# the data set


@dataclass(frozen=True)
class FashionMnistArrays:
    """The parsed data set: uint8 images ``(N, 28, 28)``, uint8 labels ``(N,)``, pixel statistics."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    mean: float  #: mean pixel value of the training set, on the [0, 1] scale
    std: float   #: standard deviation of the training set's pixels, on the [0, 1] scale
    source: str  #: the folder the files were read from


def data_dir() -> Path:
    """The Fashion-MNIST folder: ``$PIPEOPTIM_FASHION_MNIST_DIR`` or Debian's install location."""
    return Path(os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR)


def _find_files(directory: Path) -> Dict[str, Path]:
    """The path of each of :data:`FILES` in ``directory``; raises MissingDataError if any lacks."""
    found: Dict[str, Path] = {}
    missing: List[str] = []
    for key, name in FILES.items():
        for candidate in (directory / f"{name}.gz", directory / name):
            if candidate.is_file():
                found[key] = candidate
                break
        else:
            missing.append(f"{name}.gz")
    if missing:
        raise MissingDataError(
            f"Fashion-MNIST not found in {directory} (missing {', '.join(missing)}); {INSTALL_HINT}"
        )
    return found


def load_arrays(directory: str | os.PathLike | None = None) -> FashionMnistArrays:
    """Read the data set from ``directory`` (default :func:`data_dir`); cached per process."""
    return _load_arrays_cached(str(Path(directory) if directory is not None else data_dir()))


@functools.lru_cache(maxsize=4)
def _load_arrays_cached(directory: str) -> FashionMnistArrays:
    paths = _find_files(Path(directory))
    arrays = {
        key: read_idx(path, IMAGE_MAGIC if key.endswith("images") else LABEL_MAGIC)
        for key, path in paths.items()
    }
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.shape[1:] != INPUT_SHAPE[1:] or images.shape[0] != labels.shape[0]:
            raise IdxFormatError(
                f"{directory}: {split} images {images.shape} and labels {labels.shape} do not "
                f"form a 28x28 image data set"
            )
        if labels.size and int(labels.max()) >= NUM_CLASSES:
            raise IdxFormatError(f"{directory}: {split} labels exceed {NUM_CLASSES - 1}")
    # Pixel statistics from the histogram of byte values: exact, and much faster than np.std.
    counts = np.bincount(arrays["train_images"].ravel(), minlength=256).astype(np.float64)
    values = np.arange(counts.size, dtype=np.float64) / 255.0
    mean = float((counts * values).sum() / counts.sum())
    std = float(np.sqrt((counts * (values - mean) ** 2).sum() / counts.sum()))
    return FashionMnistArrays(
        train_images=arrays["train_images"], train_labels=arrays["train_labels"],
        test_images=arrays["test_images"], test_labels=arrays["test_labels"],
        mean=mean, std=std, source=directory,
    )


def _batches(images: np.ndarray, labels: np.ndarray, batch_size: int, drop_last: bool,
             mean: float, std: float) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """uint8 images ``(N, 28, 28)`` and labels -> mini-batches of normalised float32
    ``(B, 1, 28, 28)`` images and int64 labels ``(B,)``, each batch in its own memory.

    The conversion runs in numpy, one batch at a time: torch's multi-threaded element-wise ops
    are far slower here when the cores are busy with other work (thread oversubscription).
    """
    n = labels.shape[0]
    end = n - n % batch_size if drop_last else n
    scale, shift = 1.0 / (255.0 * std), -mean / std
    batches: List[Tuple[torch.Tensor, torch.Tensor]] = []
    for start in range(0, end, batch_size):
        stop = min(start + batch_size, end)
        x = images[start:stop].astype(np.float32)
        x *= np.float32(scale)
        x += np.float32(shift)
        y = labels[start:stop].astype(np.int64)
        batches.append((torch.from_numpy(x.reshape(stop - start, *INPUT_SHAPE)), torch.from_numpy(y)))
    return batches


def n_test_examples(limit: Optional[int], batch_size: int) -> int:
    """How many test images :meth:`ImageTask.load` keeps for a given training ``limit``."""
    if limit is None:
        return FULL_TEST_SIZE
    return min(FULL_TEST_SIZE, max(limit // 5, MIN_LIMITED_TEST_SIZE, batch_size))


class ImageTask(ClassificationTask):
    """Fashion-MNIST classification; the metric is test accuracy in [0, 1]."""

    name = "image"
    default_model = "vgg"
    default_batch_size = 64
    #: Learning rates for ``vgg`` at batch 64 (momentum and Nesterov with momentum 0.9), from a
    #: sweep of one epoch on 10,000 images, two seeds; each reaches 0.70-0.79 test accuracy.
    #: Higher rates (momentum 0.05, SGD 0.1) reach only about 0.70 and are less stable, so
    #: these leave some room for the staleness of asynchronous pipelines.
    default_lr: Dict[str, float] = {
        "sgd": 0.05,
        "momentum": 0.01,
        "nesterov": 0.01,
        "adam": 1e-3,
        "adamw": 1e-3,
        "rmsprop": 5e-4,
        "adagrad": 0.01,
        "muon": 0.02,  # Muon's usual lr on the hidden matrices (AdamW part: lr / 10); not tuned here
    }

    def model_names(self) -> Sequence[str]:
        return list(MODELS)

    def load(self, *, batch_size: int, limit: int | None, seed: int,
             holdout: Optional[int] = None) -> TaskData:
        """Fashion-MNIST as mini-batches; see the module docstring for what ``limit`` keeps and
        what ``holdout`` holds out (the last ``holdout`` images of the training file)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        arrays = load_arrays()
        n_total = arrays.train_labels.shape[0]
        check_holdout(holdout, n_total - 1, f"the {n_total} training images, one left to train on")
        order = np.asarray(seeded_permutation(n_total, seed), dtype=np.int64)
        validation: List[Tuple[torch.Tensor, torch.Tensor]] = []
        if holdout is not None:
            first_held = n_total - holdout
            order = order[order < first_held]
            validation = _batches(arrays.train_images[first_held:], arrays.train_labels[first_held:],
                                  batch_size, drop_last=False, mean=arrays.mean, std=arrays.std)
        if limit is not None:
            order = order[:limit]
        train = _batches(arrays.train_images[order], arrays.train_labels[order], batch_size,
                         drop_last=True, mean=arrays.mean, std=arrays.std)
        if not train:
            raise ValueError(f"{len(order)} training images (limit={limit}) make no full batch of {batch_size}")

        n_test = min(n_test_examples(limit, batch_size), arrays.test_labels.shape[0])
        test = _batches(arrays.test_images[:n_test], arrays.test_labels[:n_test], batch_size,
                        drop_last=False, mean=arrays.mean, std=arrays.std)

        info = {
            "source": arrays.source,
            "n_train": len(train) * batch_size,
            "n_train_total": n_total,
            "n_test": n_test,
            "batch_size": batch_size,
            "limit": limit,
            "seed": seed,
            "num_classes": NUM_CLASSES,
            "classes": list(CLASSES),
            "input_shape": INPUT_SHAPE,
            "mean": arrays.mean,
            "std": arrays.std,
        }
        if holdout is not None:
            info["n_validation"] = holdout  # the last images of the training file
        return TaskData(train=train, test=test, info=info, validation=validation)

    def build_model(self, name: str, data: TaskData | None = None, *, seed: int) -> nn.Sequential:
        """Model ``name`` (see :data:`MODELS`), seeded; ``data`` is not needed and may be None."""
        return build_image_model(name, seed)
