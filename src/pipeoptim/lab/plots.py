"""Curves of one or several runs as PNG files (matplotlib, no display needed)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def smooth(values: Sequence[float], window: int) -> List[float]:
    """Trailing moving average, so that a noisy per-batch loss reads as a curve."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_runs(runs: Dict[str, Dict], path: str | Path, *, metric: str, title: str,
              higher_is_better: bool = True, split: str = "test") -> Path:
    """Loss per mini-batch (smoothed) and the metric per epoch, one line per run; the metric's
    axis says so when lower is better (perplexity). ``split``: the split the epochs' metric was
    measured on (``test``, or ``validation`` for a run with a held-out split)."""
    fig, (ax_loss, ax_metric) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, run in runs.items():
        losses = run["losses"]
        window = max(1, len(losses) // 50)
        ax_loss.plot(range(1, len(losses) + 1), smooth(losses, window), label=name, linewidth=1.4)
        epochs = [e["epoch"] + 1 for e in run["epochs"] if "metric" in e]
        values = [e["metric"] for e in run["epochs"] if "metric" in e]
        if values:
            ax_metric.plot(epochs, values, marker="o", label=name)
    ax_loss.set(xlabel="mini-batch", ylabel="training loss (moving average)", title="Training loss")
    ax_metric.set(xlabel="epoch", ylabel=metric if higher_is_better else f"{metric} (lower is better)",
                  title=f"{split.capitalize()} {metric}")
    ax_metric.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (ax_loss, ax_metric):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
