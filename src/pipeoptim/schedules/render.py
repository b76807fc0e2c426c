"""Show a simulated schedule: a terminal timeline (:func:`to_text`), a PNG (:func:`to_png`) and a
Chrome / Perfetto trace (:func:`to_chrome_trace`; the CSV of ``torch.distributed.pipelining`` is
:mod:`pipeoptim.schedules.csv_io`'s).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from .actions import Action, Kind, Schedule
from .simulate import SimResult, analytic_bubble_fraction

PathLike = Union[str, Path]

#: Microseconds of trace time per simulator unit of cost.
TRACE_US_PER_UNIT = 1000.0

KIND_NAMES: Dict[Kind, str] = {
    Kind.F: "forward", Kind.B: "backward", Kind.I: "input-grad backward",
    Kind.W: "weight-grad backward", Kind.U: "update", Kind.E: "evaluation forward",
}

COLORS: Dict[Kind, str] = {
    Kind.F: "#3B75AF", Kind.B: "#EF8636", Kind.I: "#F7B479", Kind.W: "#B5561A", Kind.U: "#1A1A1A",
    Kind.E: "#4C9F50",
}
IDLE_COLOR = "#E6E6E6"

#: Characters that fill an action's box in the text timeline.
TEXT_FILL: Dict[Kind, str] = {Kind.F: "-", Kind.B: "=", Kind.I: "~", Kind.W: "+", Kind.U: "#", Kind.E: "e"}
TEXT_IDLE = "."
TEXT_INSTANT = "U"  # an update that takes no time, on the last column of the box before it


# -- shared helpers -------------------------------------------------------------------------------
def row_labels(schedule: Schedule) -> List[str]:
    """``stage k`` for a rank that holds exactly stage k, else ``rank r`` (and its stages)."""
    labels = []
    for rank in range(schedule.num_ranks):
        stages = schedule.stages_of_rank(rank)
        if stages == [rank]:
            labels.append(f"stage {rank}")
        else:
            labels.append(f"rank {rank} (stages {','.join(map(str, stages))})" if stages else f"rank {rank}")
    return labels


def _short(action: Action) -> str:
    """``F5`` for ``2F5``: enough where the row already names the stage."""
    return f"{action.kind.value}{action.index}"


def _labels(schedule: Schedule, rank: int, action: Action) -> Tuple[str, ...]:
    """Labels to try, longest first, for an action in the row of ``rank``."""
    if schedule.stages_of_rank(rank) == [rank]:
        return _short(action), action.kind.value
    return str(action), _short(action), action.kind.value


def _plural(count: int, word: str) -> str:
    return word if count == 1 else word + ("es" if word.endswith("h") else "s")


def _per_update(s: Schedule, sep: str) -> str:
    m, u = s.microbatches_per_update, s.num_updates
    return f"M={m} {_plural(m, 'micro-batch')} per update{sep}{u} {_plural(u, 'update')}"


def summary(result: SimResult) -> str:
    """One line: schedule, sizes, makespan, bubble fraction (and its closed form if known)."""
    s = result.schedule
    placement = (f"{s.num_stages} stages" if s.num_stages == s.num_ranks
                 else f"{s.num_stages} stages on {s.num_ranks} ranks")
    line = (f"{s.name}: {placement}, {_per_update(s, ', ')} "
            f"({s.num_microbatches} {_plural(s.num_microbatches, 'micro-batch')}); "
            f"makespan {result.makespan:g}, bubble {result.bubble_fraction:.1%}")
    analytic = analytic_bubble_fraction(s, result.costs)
    if analytic is not None:
        line += f" (closed form {analytic:.1%})"
    return line


# -- text -----------------------------------------------------------------------------------------
def to_text(result: SimResult, width: int = 120) -> str:
    """A terminal timeline of ``result``: one row per rank, ``width`` columns of time.

    Each action is a box starting with its label (``F5``: forward of micro-batch 5; ``0F5`` where
    a rank holds several stages) filled with ``-`` (forward), ``=`` (backward), ``~`` / ``+``
    (input / weight half of a split backward) or ``#`` (an update with a cost); ``.`` is idle
    time and a lone ``U`` an update that takes no time (drawn on the last column of the box
    before it). Labels that do not fit a box are shortened to
    the kind's letter or left out. When costs are integers and the timeline fits, every unit of
    time gets the same whole number of columns.
    """
    schedule, makespan = result.schedule, result.makespan
    if width < 1:
        raise ValueError(f"width must be positive, got {width}")
    if makespan <= 0:
        scale = 1.0
    else:
        scale = width / makespan
        integral = all(float(t.start).is_integer() and float(t.end).is_integer() for t in result.timeline)
        if integral and scale >= 1:
            scale = float(math.floor(scale))
    columns = max(1, round(makespan * scale))
    rows = [[TEXT_IDLE] * columns for _ in range(schedule.num_ranks)]
    instants: List[Tuple[int, int]] = []
    for timed in result.timeline:
        row = rows[timed.rank]
        x0, x1 = round(timed.start * scale), round(timed.end * scale)
        if x1 <= x0:
            instants.append((timed.rank, x0))
            continue
        row[x0:x1] = TEXT_FILL[timed.action.kind] * (x1 - x0)
        # a label must leave the box's last column free, so that neighbours stay apart
        for label in _labels(schedule, timed.rank, timed.action):
            if len(label) < x1 - x0 or (len(label) == 1 and x1 - x0 == 1):
                row[x0:x0 + len(label)] = label
                break
    for rank, x in instants:  # on the last column of the box before (never part of a label)
        rows[rank][max(0, min(x, columns) - 1)] = TEXT_INSTANT

    names = row_labels(schedule)
    pad = max(len(n) for n in names)
    lines = [summary(result)]
    for name, row in zip(names, rows):
        lines.append(f"{name:>{pad}} |{''.join(row)}|")
    end_label = f"{makespan:g}"
    lines.append(f"{'time':>{pad}}  0{end_label:>{max(columns - 1, len(end_label))}}")
    kinds = {t.action.kind for t in result.timeline}
    legend = [f"{TEXT_FILL[k]} {KIND_NAMES[k]}" for k in (Kind.F, Kind.B, Kind.I, Kind.W, Kind.E)
              if k in kinds]
    if Kind.U in kinds:
        legend.append(f"{TEXT_INSTANT} update (# where it takes time)")
    legend.append(f"{TEXT_IDLE} idle")
    lines.append("legend: " + ", ".join(legend) + "; labels are kind and micro-batch (F5)")
    return "\n".join(lines)


def _darker(color: str, steps: int) -> str:
    """``color`` mixed with 30% black per step."""
    if steps == 0:
        return color
    factor = 0.7 ** steps
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c * factor):02x}" for c in rgb)


# -- PNG ------------------------------------------------------------------------------------------
def png_size(result: SimResult, width: float = 12.0, dpi: int = 100) -> Tuple[int, int]:
    """The PNG's size in pixels: ``width`` inches wide, 1.7 + 0.5 inch per rank high."""
    height = 1.7 + 0.5 * result.schedule.num_ranks
    return round(width * dpi), round(height * dpi)


def to_png(result: SimResult, path: PathLike, title: Optional[str] = None,
           width: float = 12.0, dpi: int = 100) -> Path:
    """Draw ``result`` as a timeline PNG at ``path`` (size: :func:`png_size`); returns the path.

    One row per rank from the top, time to the right. Forwards blue, backwards orange (``I``
    lighter, ``W`` darker), micro-batch numbers on boxes wide enough to hold them, updates as dark
    ticks (a thin dark box where an update has a cost), idle time grey. The title names the
    schedule (or ``title``), N, M, the number of updates and the bubble fraction. Needs
    matplotlib (the ``lab`` extra: ``pip install '.[lab]'`` in the clone).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
        from matplotlib.ticker import MaxNLocator
    except ImportError as error:  # the engine runs without it; only the PNG needs it
        raise ImportError("drawing a schedule as PNG needs matplotlib: pip install '.[lab]' in the clone "
                          "(or pip install matplotlib)") from error

    schedule, makespan = result.schedule, max(result.makespan, 1e-9)
    ranks = schedule.num_ranks
    labels = [label.replace(" (", "\n(") for label in row_labels(schedule)]
    w_px, h_px = png_size(result, width, dpi)
    fig = Figure(figsize=(w_px / dpi, h_px / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    height_in = h_px / dpi
    longest = max(len(line) for label in labels for line in label.split("\n"))
    left, right = (0.3 + 0.075 * longest) / width, 1 - 0.25 / width
    top, bottom = 1 - 0.75 / height_in, 0.85 / height_in
    fig.subplots_adjust(left=left, right=right, top=top, bottom=bottom)
    ax = fig.add_subplot()

    bar = 0.72  # box height, rows are 1 apart
    for rank in range(ranks):  # idle background, covered by the boxes
        ax.broken_barh([(0, makespan)], (rank - bar / 2, bar), color=IDLE_COLOR)

    # a rank's second (third, ...) stage in darker shades: interleaved chunks, the up pipeline
    position = {s: schedule.stages_of_rank(schedule.stage_to_rank[s]).index(s)
                for s in range(schedule.num_stages)}
    boxes: Dict[Tuple[int, Kind, int], List[Tuple[float, float]]] = {}
    instants: List[Tuple[int, float]] = []
    for t in result.timeline:
        a = t.action
        if t.end > t.start:
            boxes.setdefault((t.rank, a.kind, position[a.stage]), []).append((t.start, t.end - t.start))
        if a.kind is Kind.U and t.end - t.start < makespan / 400:
            instants.append((t.rank, t.start))
    for (rank, kind, pos), spans in boxes.items():
        ax.broken_barh(spans, (rank - bar / 2, bar), facecolor=_darker(COLORS[kind], pos),
                       edgecolor="white", linewidth=0.8)
    for rank, x in instants:  # an update that takes no time: a tick a little taller than a box
        ax.plot([x, x], [rank - 0.48, rank + 0.48], color=COLORS[Kind.U], linewidth=2.2,
                solid_capstyle="butt", zorder=3, clip_on=False)

    # micro-batch numbers where they fit: about 0.6 em per character plus a margin
    px_per_unit = (right - left) * w_px / makespan
    font = 8 if ranks <= 16 else 6
    char_px = 0.62 * font * dpi / 72
    for t in result.timeline:
        kind = t.action.kind
        if kind is Kind.U or t.end <= t.start:
            continue
        text = str(t.action.index)
        if (t.end - t.start) * px_per_unit < len(text) * char_px + 3:
            continue
        ax.text((t.start + t.end) / 2, t.rank, text, ha="center", va="center", fontsize=font,
                color="black" if kind is Kind.I else "white", fontweight="bold", zorder=4)

    ax.set_xlim(0, makespan)
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_yticks(range(ranks))
    ax.set_yticklabels(labels)
    ax.tick_params(axis="y", length=0)
    batch = "mini-batches" if schedule.microbatches_per_update == 1 else "micro-batches"
    ax.set_xlabel(f"time (simulator units); numbers on the boxes are {batch}", fontsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)

    s = schedule
    stats = (f"N={s.num_ranks} stages" if s.num_stages == s.num_ranks
             else f"N={s.num_ranks} ranks, {s.num_stages} stages")
    stats += f" · {_per_update(s, ' · ')} · makespan {result.makespan:g} · bubble {result.bubble_fraction:.1%}"
    fig.suptitle(title or s.name, fontsize=12, fontweight="bold", y=1 - 0.12 / height_in, va="top")
    ax.set_title(stats, fontsize=9, pad=6)

    kinds = {t.action.kind for t in result.timeline}
    handles = [Patch(facecolor=COLORS[k], label=f"{KIND_NAMES[k]} ({k.value})")
               for k in (Kind.F, Kind.B, Kind.I, Kind.W) if k in kinds]
    if Kind.U in kinds:
        handles.append(Line2D([], [], color=COLORS[Kind.U], linewidth=2.2, label="update (U)"))
    if any(position[st] for st in range(schedule.num_stages)):
        handles.append(Patch(facecolor=_darker(COLORS[Kind.F], 1), edgecolor=_darker(COLORS[Kind.B], 1),
                             linewidth=3, label="a rank's later stage (darker)"))
    handles.append(Patch(facecolor=IDLE_COLOR, label="idle"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=9,
               bbox_to_anchor=(0.5, 0.01), handlelength=1.5, columnspacing=1.5)
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path


# -- Chrome / Perfetto trace ---------------------------------------------------------------------
def to_chrome_trace(result: SimResult, us_per_unit: float = TRACE_US_PER_UNIT) -> dict:
    """Trace-event JSON: one complete (``ph: "X"``) event per action, pid 0, tid = rank.

    ``ts`` and ``dur`` are in microseconds, ``us_per_unit`` per simulator unit (default 1000, so
    a cost of 1 reads as 1 ms). Names are compact action strings; ``args`` hold stage, kind,
    index and the simulator's own start and end. Metadata events name the process and threads.
    """
    schedule = result.schedule
    events: List[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
                           "args": {"name": f"{schedule.name} (simulated)"}}]
    for rank, label in enumerate(row_labels(schedule)):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": label}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"sort_index": rank}})
    for t in result.timeline:
        a = t.action
        events.append({
            "name": str(a), "cat": KIND_NAMES.get(a.kind, a.kind.value), "ph": "X", "pid": 0,
            "tid": t.rank, "ts": t.start * us_per_unit, "dur": (t.end - t.start) * us_per_unit,
            "args": {"stage": a.stage, "kind": a.kind.value, "index": a.index,
                     "start": t.start, "end": t.end},
        })
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"schedule": schedule.name, "stages": schedule.num_stages,
                      "ranks": schedule.num_ranks,
                      "microbatches_per_update": schedule.microbatches_per_update,
                      "makespan": result.makespan, "bubble_fraction": result.bubble_fraction,
                      "us_per_unit": us_per_unit},
    }


def write_chrome_trace(result: SimResult, path: PathLike, us_per_unit: float = TRACE_US_PER_UNIT) -> Path:
    """Write :func:`to_chrome_trace` as JSON to ``path``; returns the path."""
    import json

    path = Path(path)
    with open(path, "w") as f:
        json.dump(to_chrome_trace(result, us_per_unit), f)
    return path
