"""The preflight's result (`statelens/preflight.json`, docs/preflight.md) at the top of the report and the states
page: each run's verdict and the checks that did not pass, with their numbers and fixes."""

from __future__ import annotations

import html

from ..preflight import read_summary
from .tables import Block

HEADER = ["run", "verdict", "check", "value", "threshold", "fix"]


def preflight_rows(runs) -> list[list[str]]:
    """One row per check that warned or failed (one `pass` row for a run whose checks all passed); runs without a
    `preflight.json` are left out."""
    rows = []
    for run in runs:
        result = read_summary(run.path)
        if result is None:
            continue
        flagged = [c for c in result["checks"] if c["verdict"] in ("warn", "fail")]
        if not flagged:
            rows.append([run.label, result["verdict"], "all checks", "", "", ""])
        for check in flagged:
            value = "" if check["value"] is None else f"{check['value']:.3g}"
            rows.append([run.label, check["verdict"], check["name"], value, check["threshold"], check["fix"]])
    return rows


def preflight_blocks(runs) -> list[Block]:
    rows = preflight_rows(runs)
    if not rows:
        return []
    return [
        Block("heading", "Preflight (before step 1)"),
        Block("table", header=HEADER, rows=rows),
    ]


def preflight_html(runs) -> str:
    """The same table as HTML, for the states page ("" without any `preflight.json`)."""
    rows = preflight_rows(runs)
    if not rows:
        return ""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADER)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f'<h2>Preflight (before step 1)</h2>\n<table id="preflight"><tr>{head}</tr>{body}</table>\n'
