"""Drawing primitives the report's plots share: a figure on matplotlib's Agg canvas (no pyplot), saving it, and a
curve drawn as measured or, when long, faint with a moving average on top."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

FIGURE_SIZE = (7.0, 4.5)
TALL_FIGURE_SIZE = (7.0, 6.0)
DPI = 120
SMOOTH_ABOVE_POINTS = 100  # longer curves are drawn faint per step, with a moving average on top
# A panel that draws several metrics of each run gives each metric its colour and each run its line style (and marker
# shape), so one run's metrics never share a colour; the run's colour of the other plots is not used there.
RUN_LINES = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))
METRIC_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive")


def new_figure(size=FIGURE_SIZE, rows: int = 1, sharex: bool = True):
    """A figure on the Agg canvas directly: no pyplot, so no global backend switch and no figures left open."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, 1, sharex=sharex, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return figure, axes


def save(figure, out_dir: Path, name: str) -> Path:
    path = out_dir / name
    figure.savefig(path, dpi=DPI)
    return path


def plot_curve(ax, x: np.ndarray, y: np.ndarray, style: dict, label: str, smooth: bool = True) -> None:
    """Short curves as they are; long noisy ones faint per step with a moving average on top, so trends show.

    Probe drift is already a smooth, sparse curve: it is drawn with `smooth=False`, as measured.
    """
    keep = np.isfinite(y)
    x, y = x[keep], y[keep]
    color, width = style["color"], style["width"]
    if not smooth or len(y) <= SMOOTH_ABOVE_POINTS:
        marker = style["marker"] if len(y) <= 30 else None
        ax.plot(x, y, color=color, label=label, linewidth=width, marker=marker, markersize=2.5 * width)
        return
    window = max(5, len(y) // 50)  # 2% of the steps
    smooth = pd.Series(y).rolling(window, center=True, min_periods=1).mean().to_numpy()
    ax.plot(x, y, color=color, alpha=0.25, linewidth=0.8)
    ax.plot(x, smooth, color=color, label=label, linewidth=width)


def metrics_and_runs_legend(ax, metrics: dict, runs: dict) -> None:
    """One legend for a panel of several metrics per run: `metrics` maps what a metric is to its (colour, marker-only),
    `runs` a run's label to its style (`line`, `marker`). Metrics are listed in their colours; with several runs, each
    run follows in grey in its line style."""
    from matplotlib.lines import Line2D

    if not metrics:
        return
    # one run: its metrics in its own line style; several: metrics as plain solid lines, the runs' styles below them
    metric_style = next(iter(runs.values())) if len(runs) == 1 else {"line": "-", "marker": None}
    handles = []
    for what, (color, points_only) in metrics.items():
        line = "none" if points_only else metric_style["line"]
        marker = metric_style["marker"] or ("o" if points_only else None)
        handles.append(Line2D([], [], color=color, linestyle=line, marker=marker, markersize=4, label=what))
    if len(runs) > 1:
        handles += [
            Line2D([], [], color="dimgray", linestyle=style["line"], marker=style["marker"], markersize=4, label=label)
            for label, style in runs.items()
        ]
    ax.legend(handles=handles, fontsize=7, loc="best", framealpha=0.85)


def finish_legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=9, loc="best", framealpha=0.85)
