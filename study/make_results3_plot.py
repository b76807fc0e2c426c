"""The equal-time report's figure (study/make_results3.py): per setting, the validation metric
against predicted time on N devices, every method's curve to the end of its budget (the mean of
its seeds, the range between the lowest and highest seed shaded), the target dashed and the
budget B dotted."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from study.common import pyplot, save_figure
from study.make_results3_arith import SYNC, mean_curve


def curves_plot(st: Any, folder: Optional[Path]) -> str:
    """Draw the setting ``st`` (a make_results3_arith.Setting) into ``folder``; return the file name
    (only the name when ``folder`` is None: the markdown does not depend on the figures)."""
    name = f"equal-time-{st.task}-{st.optimizer}-N{st.stages}.png"
    if folder is None:
        return name
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    for i, (variant, arm) in enumerate(st.arms.items()):
        points = mean_curve(arm.rows)
        if not points or arm.seconds is None:
            continue
        t = [u * arm.seconds for u, *_ in points]
        mean, low, high = ([p[k] * st.scale for p in points] for k in (1, 2, 3))
        color = "black" if variant == SYNC else f"C{i % 10}"
        label = (f"synchronous ({st.budget['fastest']['schedule']}, M = {st.budget['fastest']['microbatches']})"
                 if variant == SYNC else variant)
        ax.plot(t, mean, color=color, linewidth=1.4 if variant == SYNC else 1.0,
                label=f"{label}, {len(arm.rows)} seed{'s' if len(arm.rows) != 1 else ''}")
        ax.fill_between(t, low, high, color=color, alpha=0.15, linewidth=0)
    target = st.target()
    if target is not None:
        ax.axhline(target * st.scale, color="grey", linestyle="--", linewidth=0.8, label="target")
    ax.axvline(st.budget["budget_seconds"], color="grey", linestyle=":", linewidth=0.8, label="budget B")
    ax.set(xlabel=f"predicted seconds on {st.stages} devices", ylabel=f"validation {st.metric}",
           title=f"{st.name()}: equal time (mean of seeds, lowest to highest shaded)")
    if not st.higher:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, folder, name)
