"""The example a user copies runs as it is, on a few hundred images."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fashion_mnist_pipeline.py"


def test_the_fashion_mnist_example_trains_and_reports_test_accuracy():
    done = subprocess.run([sys.executable, str(EXAMPLE), "--limit", "384", "--epochs", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["epoch 1", "epoch 2"]
    final = re.match(r"test accuracy (\d\.\d+) after 12 updates, \d+ samples/s, "
                     r"weight copies per stage \[2\.0, 2\.0, 2\.0, 1\.0\]", lines[-1])
    assert final, lines[-1]
    assert 0.1 < float(final.group(1)) <= 1.0  # ten classes: above chance after 12 updates
