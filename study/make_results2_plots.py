"""The second study's figures (study/make_results2.py): per cell, the validation metric
against the peak lr (sensitivity); per setting, the curves against updates and against predicted
time on N devices."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from study import study2_plan
from study.common import pyplot, save_figure
from study.make_results2_data import Setting, sweep_points


def sensitivity_plot(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]], task: str, optimizer: str,
                     metric: str, higher: bool, scale: float, folder: Optional[Path]) -> str:
    """Final validation metric against the peak lr, a curve per method; the file's name (written
    into ``folder``; None: only the name)."""
    name = f"sensitivity-{task}-{optimizer}.png"
    if folder is None:
        return name
    fig, ax = pyplot().subplots(figsize=(7, 4.2))
    diverged: List[Tuple[float, str]] = []
    for i, variant in enumerate(["sequential", *suite["methods"]]):
        points = sweep_points(suite, rows, task, optimizer, variant)
        color = "black" if variant == "sequential" else f"C{i}"
        xs = [lr for lr, kind, _ in points if kind in ("end", "third")]
        ys = [m * scale for _, kind, m in points if kind in ("end", "third")]
        ax.plot(xs, ys, color=color, linewidth=1.2, label=variant)
        for lr, kind, m in points:
            if kind == "end":
                ax.plot([lr], [m * scale], "o", color=color, markersize=4)
            elif kind == "third":
                ax.plot([lr], [m * scale], "o", color=color, markersize=4, markerfacecolor="white")
            elif kind == "diverged":
                diverged.append((lr, color))
    # zoomed on the good end (a near-chance first third would flatten every other curve; the sweep
    # table has every value), then the diverged lrs at the worst end: the bottom for accuracy, the top
    # for perplexity
    values = [m * scale for v in ["sequential", *suite["methods"]]
              for _, kind, m in sweep_points(suite, rows, task, optimizer, v) if kind in ("end", "third")]
    if values:
        best = max(values) if higher else min(values)
        low, high = (max(min(values), 0.85 * best), best + 0.02 * abs(best)) if higher else \
            (0.95 * best, min(max(values), 1.6 * best))
        ax.set_ylim(low, high)
    worst = ax.get_ylim()[0 if higher else 1]
    for lr, color in diverged:
        ax.plot([lr], [worst], "x", color=color, markersize=7)
    lrs = study2_plan.sweep_lrs(suite, task, optimizer)
    ax.set_xscale("log")
    ax.set_xlim(min(lrs) / 1.3, max(lrs) * 1.3)  # (also when no point is in yet)
    ax.set(xlabel="peak learning rate", ylabel=f"validation {metric}",
           title=f"{task}, {optimizer}, N={max(suite['stages'])}: filled = whole run, hollow = first third, "
                 f"x = diverged; values far from the best off the axis (the table has them)")
    ax.title.set_fontsize(8)
    if ax.get_legend_handles_labels()[0]:  # (a panel may have no curve yet)
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return save_figure(fig, folder, name)


def curves_plot(st: Setting, folder: Optional[Path]) -> str:
    """The validation metric against updates and against predicted time on N devices, a curve
    per method (its first seed); the file's name (written into ``folder``; None: only the name)."""
    name = f"curves-{st.task}-{st.optimizer}-N{st.stages}.png"
    if folder is None:
        return name
    fig, (by_updates, by_time) = pyplot().subplots(1, 2, figsize=(12, 4.2))
    target = st.target()
    for i, (variant, method) in enumerate(st.methods.items()):
        if not method.ok:
            continue
        run = method.ok[0]  # the first seed that did not diverge
        color = "black" if variant == "sequential" else f"C{i}"
        updates = [e["updates"] for e in run["evaluations"]]
        metrics = [e["metric"] * st.scale for e in run["evaluations"]]
        by_updates.plot(updates, metrics, color=color, linewidth=1.2, label=variant)
        seconds = st.seconds(variant)
        if seconds is not None:
            label = "sequential, as gpipe/1f1b-flush" if variant == "sequential" else variant
            by_time.plot([u * seconds for u in updates], metrics, color=color, linewidth=1.2, label=label)
    for ax, xlabel in ((by_updates, "updates"), (by_time, f"predicted seconds on {st.stages} devices")):
        if target is not None:
            ax.axhline(target * st.scale, color="grey", linestyle="--", linewidth=0.8)
        ax.set(xlabel=xlabel, ylabel=f"validation {st.metric}")
        if not st.higher:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # (a panel may have no curve yet)
            ax.legend(fontsize=7)
    by_updates.set_title(f"{st.name()}: first seed of each method; dashed: the target", fontsize=9)
    return save_figure(fig, folder, name)
