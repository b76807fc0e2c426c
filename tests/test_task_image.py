"""Tests of the Fashion-MNIST image task and the shared task helpers (fast, seeded)."""
from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from pipeoptim.lab.tasks import MissingDataError, get_task
from pipeoptim.lab.tasks.common import (
    batchify,
    cache_dir,
    classification_accuracy,
    evaluation_mode,
    seeded,
    seeded_permutation,
)
from pipeoptim.lab.tasks.image import (
    DATA_DIR_ENV,
    FILES,
    IMAGE_MAGIC,
    LABEL_MAGIC,
    IdxFormatError,
    ImageTask,
    MissingDataError as ImageMissingDataError,
    load_arrays,
    n_test_examples,
    read_idx,
)


def _data_installed() -> bool:
    """Whether Fashion-MNIST can be read (from $PIPEOPTIM_FASHION_MNIST_DIR or Debian's folder)."""
    try:
        load_arrays()
    except MissingDataError:
        return False
    return True


needs_data = pytest.mark.skipif(
    not _data_installed(),
    reason="Fashion-MNIST is not installed: sudo apt-get install --no-install-recommends dataset-fashion-mnist",
)


def write_idx(path: Path, array: np.ndarray, magic: int, compress: bool = True) -> None:
    """Write ``array`` (uint8) as an idx file with the given magic number."""
    raw = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    raw += array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if compress else raw)


def write_tiny_dataset(folder: Path, n_train: int = 10, n_test: int = 4) -> None:
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("test", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        write_idx(folder / (FILES[f"{split}_images"] + ".gz"), images, IMAGE_MAGIC)
        write_idx(folder / (FILES[f"{split}_labels"] + ".gz"), labels, LABEL_MAGIC)


# --- idx parsing -----------------------------------------------------------------------------


def test_read_idx_gzipped_and_plain(tmp_path: Path) -> None:
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "images.gz", images, IMAGE_MAGIC)
    write_idx(tmp_path / "images", images, IMAGE_MAGIC, compress=False)
    for name in ("images.gz", "images"):
        got = read_idx(tmp_path / name, IMAGE_MAGIC)
        assert got.dtype == np.uint8 and got.shape == (2, 3, 4)
        np.testing.assert_array_equal(got, images)
    labels = np.array([3, 1, 4, 1, 5], dtype=np.uint8)
    write_idx(tmp_path / "labels.gz", labels, LABEL_MAGIC)
    np.testing.assert_array_equal(read_idx(tmp_path / "labels.gz", LABEL_MAGIC), labels)


def test_read_idx_wrong_magic_is_a_clear_error(tmp_path: Path) -> None:
    labels = np.array([1, 2, 3], dtype=np.uint8)
    write_idx(tmp_path / "labels.gz", labels, LABEL_MAGIC)
    with pytest.raises(IdxFormatError, match=r"bad idx magic number 0x00000801, expected 0x00000803"):
        read_idx(tmp_path / "labels.gz", IMAGE_MAGIC)
    write_idx(tmp_path / "junk.gz", labels, 0x12345678)
    with pytest.raises(IdxFormatError, match="bad idx magic number 0x12345678"):
        read_idx(tmp_path / "junk.gz")
    assert issubclass(IdxFormatError, ValueError)


def test_read_idx_truncated_data_is_an_error(tmp_path: Path) -> None:
    raw = struct.pack(">IIII", IMAGE_MAGIC, 2, 28, 28) + bytes(28 * 28)  # one image of two
    (tmp_path / "cut").write_bytes(raw)
    with pytest.raises(IdxFormatError, match="needs 1568"):
        read_idx(tmp_path / "cut")


# --- the data set ----------------------------------------------------------------------------


def test_missing_data_names_the_apt_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    with pytest.raises(MissingDataError) as info:
        ImageTask().load(batch_size=4, limit=8, seed=0)
    message = str(info.value)
    assert "sudo apt-get install --no-install-recommends dataset-fashion-mnist" in message
    assert str(tmp_path) in message and DATA_DIR_ENV in message
    assert ImageMissingDataError is MissingDataError


def test_load_from_a_tiny_dataset_in_the_env_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_tiny_dataset(tmp_path, n_train=10, n_test=4)
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    data = ImageTask().load(batch_size=4, limit=None, seed=0)
    assert [x.shape[0] for x, _ in data.train] == [4, 4]  # 10 examples: the last 2 are dropped
    assert [x.shape[0] for x, _ in data.test] == [4]
    assert data.info["source"] == str(tmp_path) and data.info["n_train"] == 8
    assert data.train[0][0].shape == (4, 1, 28, 28) and data.train[0][0].dtype == torch.float32
    assert data.train[0][1].dtype == torch.int64
    # labels were 0..9 in file order: training follows the seeded permutation, test the file order
    assert torch.cat([y for _, y in data.train]).tolist() == seeded_permutation(10, 0)[:8]
    assert data.test[0][1].tolist() == [0, 1, 2, 3]


def test_limit_below_one_batch_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_tiny_dataset(tmp_path, n_train=10, n_test=4)
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    with pytest.raises(ValueError, match="no full batch of 8"):
        ImageTask().load(batch_size=8, limit=5, seed=0)


def test_n_test_examples() -> None:
    assert n_test_examples(None, 64) == 10_000
    assert n_test_examples(2000, 64) == 1000
    assert n_test_examples(20_000, 64) == 4000
    assert n_test_examples(500, 2048) == 2048
    assert n_test_examples(60_000, 64) == 10_000


@needs_data
def test_load_is_seeded() -> None:
    task = ImageTask()
    a = task.load(batch_size=32, limit=200, seed=1)
    b = task.load(batch_size=32, limit=200, seed=1)
    c = task.load(batch_size=32, limit=200, seed=2)
    assert len(a.train) == 6 and all(x.shape == (32, 1, 28, 28) for x, _ in a.train)  # 200 -> 192
    assert a.info["n_train"] == 192 and a.info["n_test"] == 1000
    assert sum(y.shape[0] for _, y in a.test) == 1000 and a.test[-1][1].shape[0] == 1000 % 32
    for (xa, ya), (xb, yb) in zip(a.train, b.train):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.train[0][1], c.train[0][1])
    assert torch.equal(a.test[0][0], c.test[0][0])  # the test set does not depend on the seed
    # a smaller limit is a prefix of the same shuffled order
    d = task.load(batch_size=32, limit=64, seed=1)
    assert torch.equal(d.train[1][1], a.train[1][1])


@needs_data
def test_full_dataset_sizes_and_normalisation() -> None:
    data = ImageTask().load(batch_size=64, limit=None, seed=0)
    assert data.info["n_train_total"] == 60_000 and data.info["n_test"] == 10_000
    assert len(data.train) == 60_000 // 64 and len(data.test) == 157
    x = torch.cat([x for x, _ in data.train])
    assert abs(x.mean().item()) < 1e-3 and abs(x.std().item() - 1.0) < 1e-3
    assert data.info["mean"] == pytest.approx(0.2860406, abs=1e-6)
    assert data.info["std"] == pytest.approx(0.3530242, abs=1e-6)
    labels = torch.cat([y for _, y in data.test])
    assert torch.bincount(labels).tolist() == [1000] * 10


# --- models ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ImageTask().model_names())
def test_models_map_images_to_logits(name: str) -> None:
    model = ImageTask().build_model(name, None, seed=0)
    assert isinstance(model, nn.Sequential) and len(model) >= 4
    out = model(torch.randn(4, 1, 28, 28))
    assert out.shape == (4, 10)
    # every block maps one tensor to one tensor, so any cut is a valid stage boundary
    h = torch.randn(4, 1, 28, 28)
    for block in model:
        h = block(h)
        assert isinstance(h, torch.Tensor)


@pytest.mark.parametrize("name", ImageTask().model_names())
def test_build_model_is_seeded_and_leaves_global_rng_alone(name: str) -> None:
    task = ImageTask()
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = task.build_model(name, None, seed=7)
    assert torch.equal(torch.rand(3), expected_next)
    b = task.build_model(name, None, seed=7)
    c = task.build_model(name, None, seed=8)
    pa, pb, pc = (list(m.state_dict().values()) for m in (a, b, c))
    assert all(torch.equal(u, v) for u, v in zip(pa, pb))
    assert not all(torch.equal(u, v) for u, v in zip(pa, pc))


def test_parameter_counts() -> None:
    task = ImageTask()
    counts = {n: sum(p.numel() for p in task.build_model(n, None, seed=0).parameters()) for n in task.model_names()}
    assert counts == {"vgg": 201_170, "vgg-bn": 201_482, "resnet": 170_298, "mlp": 335_114}


def test_unknown_model_lists_choices() -> None:
    with pytest.raises(ValueError, match="vgg, vgg-bn, resnet, mlp"):
        ImageTask().build_model("alexnet", None, seed=0)


def test_task_attributes_and_registry() -> None:
    task = get_task("image")
    assert isinstance(task, ImageTask)
    assert (task.name, task.metric, task.default_model, task.default_batch_size) == ("image", "accuracy", "vgg", 64)
    assert task.higher_is_better and task.default_model in task.model_names()
    assert {"sgd", "momentum", "adam"} <= set(task.default_lr)


def test_loss_is_cross_entropy() -> None:
    logits = torch.tensor([[2.0, 0.0], [0.0, 0.0]])
    target = torch.tensor([0, 1])
    expected = (torch.log1p(torch.exp(torch.tensor(-2.0))) + torch.log(torch.tensor(2.0))) / 2
    assert ImageTask().loss(logits, target).item() == pytest.approx(expected.item(), rel=1e-6)


def test_evaluate_restores_training_mode() -> None:
    task = ImageTask()
    model = task.build_model("vgg-bn", None, seed=0)
    model.train()
    model[1].eval()  # a partly-eval model keeps its flags
    x = torch.randn(8, 1, 28, 28)
    y = torch.zeros(8, dtype=torch.int64)
    data_test = [(x, y)]
    from pipeoptim.lab.tasks.base import TaskData

    before = model[0][1].running_mean.clone()
    acc = task.evaluate(model, TaskData(train=[], test=data_test))
    assert 0.0 <= acc <= 1.0
    assert model.training and model[0].training and not model[1].training
    assert torch.equal(model[0][1].running_mean, before)  # eval mode: BN statistics untouched


# --- shared helpers --------------------------------------------------------------------------


def test_batchify() -> None:
    x = torch.arange(10).float().unsqueeze(1)
    y = torch.arange(10)
    kept = batchify(x, y, 4, drop_last=True)
    assert [b[1].tolist() for b in kept] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    everything = batchify(x, y, 4, drop_last=False)
    assert [b[1].tolist() for b in everything] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert everything[0][0].untyped_storage().nbytes() == 4 * 4  # a copy, not a view
    pairs = batchify((x, x * 2), y, 5, drop_last=True)
    assert isinstance(pairs[1][0], tuple) and pairs[1][0][1].squeeze(1).tolist() == [10, 12, 14, 16, 18]
    with pytest.raises(ValueError):
        batchify(x, y[:9], 4, drop_last=True)


def test_seeded_helpers() -> None:
    assert seeded_permutation(10, 3) == seeded_permutation(10, 3)
    assert sorted(seeded_permutation(10, 3)) == list(range(10))
    assert seeded_permutation(10, 3) != seeded_permutation(10, 4)
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    with seeded(5):
        a = torch.rand(2)
    with seeded(5):
        assert torch.equal(torch.rand(2), a)
    assert torch.equal(torch.rand(2), expected)


def test_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPEOPTIM_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c" and cache_dir().is_dir()
    assert cache_dir("image") == tmp_path / "c" / "image" and (tmp_path / "c" / "image").is_dir()


def test_classification_accuracy_and_evaluation_mode() -> None:
    model = nn.Sequential(nn.Identity())
    batches = [(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 0])),
               (torch.tensor([[0.0, 1.0]]), torch.tensor([1]))]
    assert classification_accuracy(model, batches) == pytest.approx(2 / 3)
    assert classification_accuracy(model, []) == 0.0
    model.train()
    with evaluation_mode(model):
        assert not model.training and not torch.is_grad_enabled()
    assert model.training and torch.is_grad_enabled()


# --- training --------------------------------------------------------------------------------


@needs_data
@pytest.mark.parametrize("model_name, optimizer, epochs", [("vgg", "adam", 2), ("mlp", "momentum", 2)])
def test_short_training_learns(model_name: str, optimizer: str, epochs: int) -> None:
    """Two epochs on 2,000 images (a few seconds) reach test accuracy far above chance (0.1)."""
    torch.manual_seed(0)
    task = ImageTask()
    data = task.load(batch_size=64, limit=2000, seed=0)
    model = task.build_model(model_name, data, seed=0)
    lr = task.default_lr[optimizer]
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model.train()
    for _ in range(epochs):
        for x, y in data.train:
            opt.zero_grad()
            task.loss(model(x), y).backward()
            opt.step()
    accuracy = task.evaluate(model, data)
    assert model.training
    assert accuracy > 0.6, accuracy


def test_the_models_module_agrees_on_the_classes():
    from pipeoptim.lab.tasks import image, image_models

    assert image_models.NUM_CLASSES == len(image.CLASSES) == 10
    assert image.build_image_model is image_models.build_image_model  # the task's API before the split
    assert image_models.build_image_model("mlp", seed=0)(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
