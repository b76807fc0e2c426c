"""What the studies' scripts share: the folders, the JSON files a study writes and reads (one row
per line in ``runs.jsonl``, appended with one write; a times file checked by its ``format``,
written atomically with its floats rounded), the seed statistics the reports print (mean ± standard
deviation, the win/tie/lose rule), ``--shard i/n`` and the figures' matplotlib setup.

Every script of study/ runs from the repository root as ``python -m study.<name>`` and imports
the others as ``study.<name>``; the studies' rows and times are in ``study/results/``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

STUDY = Path(__file__).resolve().parent
ROOT = STUDY.parent
RESULTS = STUDY / "results"
SIGNIFICANT = 4  #: significant digits of the seconds a times file holds (the profile's noise is larger)


# --------------------------------------------------------------------------------------------
# the study's files


def append_line(path: Path, row: Dict[str, Any]) -> None:
    """Append ``row`` as one JSON line with a single write() on an O_APPEND file, so that study
    processes sharing the file never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(row) + "\n").encode())
    finally:
        os.close(fd)


def keyed_rows(path: Path, key: Callable[[Dict[str, Any]], str]) -> Dict[str, Dict[str, Any]]:
    """The rows of a runs.jsonl by ``key`` (the first of duplicates; a torn last line is ignored:
    a line cut short by a killed writer, whose run is simply run again)."""
    rows: Dict[str, Dict[str, Any]] = {}
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        rows.setdefault(key(row), row)
    return rows


def rounded(value: Any, digits: int = SIGNIFICANT) -> Any:
    """``value`` with every float rounded to ``digits`` significant digits (equal floats stay
    equal: the async methods' shared times remain identical)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    return value


def read_format(path: Path, fmt: str, kind: str, empty: Dict[str, Any]) -> Dict[str, Any]:
    """The JSON file's contents, checked to be a ``kind`` file (its ``"format"`` is ``fmt``), or
    ``empty`` where the file is missing (nothing done yet)."""
    if path.exists():
        data = json.loads(path.read_text())
        if data.get("format") != fmt:
            raise ValueError(f"{path} is not a {kind} file (no \"format\": \"{fmt}\")")
        return data
    return empty


def write_rounded(path: Path, data: Dict[str, Any]) -> None:
    """Write ``data`` atomically (a stopped call leaves the previous file whole), keys sorted,
    floats :func:`rounded`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rounded(data), indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def machine() -> Dict[str, Any]:
    import torch

    return {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}


def load_average() -> List[float]:
    return [round(x, 2) for x in os.getloadavg()]


def parse_shard(text: str) -> Tuple[int, int]:
    """``--shard i/n``: the runs whose place in the plan is i modulo n."""
    index, count = (int(x) for x in text.split("/"))
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard i/n needs 0 <= i < n, got {text}")
    return index, count


# --------------------------------------------------------------------------------------------
# the seeds' statistics


def mean_sd(values: Sequence[float]) -> Tuple[float, float]:
    """Mean and standard deviation of the values that are in (None skipped; NaNs with none; an
    infinite value, a diverged seed of a lower-is-better metric, gives infinity)."""
    values = [v for v in values if v is not None]
    if not values:
        return (float("nan"), float("nan"))
    if any(math.isinf(v) for v in values):
        return (math.inf, 0.0)
    return (statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0)


def fmt(pair: Tuple[float, float], scale: float = 1.0, digits: int = 2) -> str:
    m, s = pair
    return "-" if m != m else f"{m * scale:.{digits}f} ± {s * scale:.{digits}f}"


def verdict(a: Tuple[float, float], b: Tuple[float, float], higher: bool) -> Tuple[str, float, float]:
    """Does a win, tie or lose against b: (word, difference a - b, spread). A difference within the
    larger of the two standard deviations is a tie."""
    diff = a[0] - b[0]
    spread = max(a[1], b[1])
    if a[0] == b[0] or abs(diff) <= spread:  # equal: also both infinite (both diverged)
        return "ties", diff, spread
    return ("wins" if (diff > 0) == higher else "loses"), diff, spread


# --------------------------------------------------------------------------------------------
# the figures


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display; imported only by what draws)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, folder: Path, name: str) -> str:
    """Save ``fig`` as ``folder/name`` (no software stamp: the same figure gives the same bytes),
    close it and return ``name``."""
    fig.tight_layout()
    fig.savefig(folder / name, dpi=100, metadata={"Software": None})
    pyplot().close(fig)
    return name
