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


def finish_legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=9, loc="best", framealpha=0.85)
