"""A run's summary (what `pipeoptim train --json` prints and summary.json holds) describes its
data set, it does not carry it: the source and the sizes, a few hundred bytes, never the
examples or the reference sentences (a translation summary used to be ~230 KB, 210 KB of it
references)."""
from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

from conftest import has_image_data
from pipeoptim.cli import main
from pipeoptim.lab.tasks.base import TaskData
from pipeoptim.lab.tasks.image import load_arrays

SUMMARY_BOUND = 4096  #: bytes of the whole --json summary of a short run
DATA_BOUND = 1024     #: bytes of its "data" entry




def run_json(argv, capsys) -> dict:
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert len(out.encode()) < SUMMARY_BOUND, f"the --json summary is {len(out.encode())} bytes"
    summary = json.loads(out)
    assert len(json.dumps(summary["data"], indent=2)) < DATA_BOUND
    return summary


def test_describe_keeps_json_values_and_counts_batches():
    batch = (torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))
    data = TaskData(train=[batch] * 5, test=[batch] * 2,
                    info={"source": "somewhere", "sizes": {"train": 10, "test": 4}, "tensor": torch.zeros(3)},
                    extra={"refs": ["a sentence"] * 1000})
    assert data.describe() == {"source": "somewhere", "sizes": {"train": 10, "test": 4},
                               "batches": {"train": 5, "test": 2}}


@pytest.mark.skipif(not has_image_data(), reason="needs Fashion-MNIST (apt-get install dataset-fashion-mnist)")
def test_image_summary_describes_the_data(tmp_path, capsys):
    summary = run_json(["train", "--task", "image", "--model", "mlp", "--limit", "640", "--stages", "2",
                        "--no-progress", "--json", "--out", str(tmp_path / "run")], capsys)
    data = summary["data"]
    assert data["source"] == load_arrays().source
    assert (data["n_train"], data["n_train_total"], data["n_test"]) == (640, 60_000, 1000)
    assert data["batches"] == {"train": 10, "test": 16}  # 640 / 64; 1000 test images in batches of 64
    assert data["num_classes"] == 10 and data["input_shape"] == [1, 28, 28]
    # summary.json holds the same summary as --json printed
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["data"] == data


@pytest.mark.skipif(not (shutil.which("mod2imp") and importlib.util.find_spec("sentencepiece")
                         and importlib.util.find_spec("sacrebleu")),
                    reason="needs mod2imp + Bible modules (sudo apt-get install --no-install-recommends "
                           "sword-text-web sword-text-sparv libsword-utils) and pip install sentencepiece sacrebleu")
def test_translation_summary_describes_the_data_without_sentences(tmp_path, capsys, monkeypatch):
    from pipeoptim.lab.tasks.translation import TranslationTask

    monkeypatch.setattr(TranslationTask, "eval_limit", 8)  # decode 8 test sentences, not 500
    summary = run_json(["train", "--task", "translation", "--limit", "64", "--batch-size", "32", "--stages", "2",
                        "--no-progress", "--json", "--out", str(tmp_path / "run")], capsys)
    data = summary["data"]
    assert data["source"].startswith("SWORD ") and "mod2imp" in data["source"]
    sizes = data["sizes"]
    assert sizes["pairs"] == 31077 and sizes["train"] == 64 and 600 < sizes["test"] < 800
    assert data["vocab_size"] == 4000 and data["eval_limit"] == 8
    assert data["batches"]["train"] == 2 and data["batches"]["test"] == -(-sizes["test"] // 32)
    for bulky in ("valid", "valid_refs", "test_src", "test_refs", "test_keys"):
        assert bulky not in data
    assert summary["metric"] == "bleu" and 0 <= summary["final_metric"] <= 100
