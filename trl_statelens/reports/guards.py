"""The run guards' firings (`statelens/guards.jsonl`, docs/guards.md) in the report: a table near the top, beside the
preflight's, and a dotted vertical line at each firing's step on the per-step plots; the same table on the states
page."""

from __future__ import annotations

import html

from .run_folders import Run
from .tables import Block

HEADER = ["run", "step", "guard", "action", "metric", "value", "threshold", "message"]
MARKS_TEXT = "Dotted vertical lines in a run's colour mark the steps at which its guards fired (the Guards table)."


def _shown(value) -> str:
    return "" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def guard_rows(runs: list[Run]) -> list[list[str]]:
    """One row per firing, in step order (one `no guard fired` row for a run whose guards stayed quiet); runs without
    a `guards.jsonl` are left out."""
    rows = []
    for run in runs:
        if run.guard_firings is None:
            continue
        if not run.guard_firings:
            rows.append([run.label, "", "no guard fired", "", "", "", "", ""])
        for firing in sorted(run.guard_firings, key=lambda firing: firing.get("step", 0)):
            rows.append(
                [run.label]
                + [_shown(firing.get(key)) for key in ("step", "guard", "action", "metric", "value", "threshold")]
                + [firing.get("message", "")]
            )
    return rows


def guard_blocks(runs: list[Run]) -> list[Block]:
    rows = guard_rows(runs)
    if not rows:
        return []
    return [Block("heading", "Guards (during training)"), Block("table", header=HEADER, rows=rows)]


def guards_html(runs: list[Run]) -> str:
    """The same table as HTML, for the states page ("" when no run has a `guards.jsonl`)."""
    rows = guard_rows(runs)
    if not rows:
        return ""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADER)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f'<h2>Guards (during training)</h2>\n<table id="guards"><tr>{head}</tr>{body}</table>\n'


def guard_steps(run: Run) -> list[int]:
    return sorted({firing["step"] for firing in run.guard_firings or [] if "step" in firing})


def mark_guard_steps(axes, run: Run, style: dict) -> None:
    """A dotted vertical line in the run's colour on each of `axes` (x: optimizer step) at each step where one of
    its guards fired."""
    for step in guard_steps(run):
        for ax in axes:
            ax.axvline(step, color=style["color"], linestyle=":", linewidth=1.2, alpha=0.9)
