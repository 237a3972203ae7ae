"""`statelens report`: the study's Table 2, state statistics and plots across run folders.

A run folder is what the recipes write (any piece may be missing; the report says which and goes on):

- `results.json`: recipe, trainer, baseline (`statelens` or `stock`), run name, the `before` and `after` evaluations
  (:func:`~trl_statelens.evaluation.evaluate_model` without records), `retention`, `final_drift`;
- `statelens/steps.jsonl`: one line per optimizer step of state aggregates and `prefix_len_hist` (StateLens trainers
  only; a stock TRL baseline has none);
- `statelens/drift.jsonl`: one line per probe step of drift distances against step 0;
- `log_history.json`: the trainer's `state.log_history` (with `--target_eval_steps`, the target task's scores during
  training as `eval/gsm8k/<metric>`).

:func:`write_report` writes `report.md`, a self-contained `report.html` (images embedded as data URIs) and one PNG
per question into the output folder. Forgetting and Retention in the table are taken against the Base row, the
study's definition, with :func:`~trl_statelens.evaluation.retention_summary`.
"""

from __future__ import annotations

import argparse
import base64
import html
import sys
from pathlib import Path

from .guards import guard_blocks
from .plots import plot_blocks
from .preflight import preflight_blocks
from .run_folders import RUN_FOLDER_CONTENTS, load_run, make_labels_unique
from .states_page import write_states_page
from .tables import (
    PROVENANCE_WARNING,
    Block,
    base_scores_for,
    compute_table,
    cost_table,
    provenance_warning,
    run_notes,
    state_table,
    table2,
    teacher_table,
)


# ----- the report's blocks as Markdown and HTML ----------------------------------------------------------------------
def markdown(blocks: list[Block]) -> str:
    lines = ["# StateLens report", ""]
    for block in blocks:
        if block.kind == "heading":
            lines += [f"## {block.text}", ""]
        elif block.kind == "text":
            lines += [block.text, ""]
        elif block.kind == "note":
            lines += [f"> **Note:** {block.text}", ""]
        elif block.kind == "warning":
            lines += [f"> **Warning:** {block.text}", ""]
        elif block.kind == "table":
            lines.append("| " + " | ".join(block.header) + " |")
            lines.append("|" + "---|" * len(block.header))
            lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in block.rows]
            lines.append("")
        elif block.kind == "image":
            lines += [f"### {block.text}", "", f"![{block.text}]({block.image.name})", ""]
        elif block.kind == "link":
            lines += [f"{block.text} [{block.image.name}]({block.image.name})", ""]
    return "\n".join(lines)


def inline_code(text: str) -> str:
    """HTML-escape, then turn Markdown's `code` spans into <code>."""
    parts = html.escape(text).split("`")
    return "".join(f"<code>{part}</code>" if index % 2 else part for index, part in enumerate(parts))


HTML_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f3f3f3; }
.note { background: #fff6e0; border-left: 4px solid #e0a800; padding: 0.4em 0.8em; }
.warning { background: #fdecea; border-left: 4px solid #c62828; padding: 0.4em 0.8em; }
img { max-width: 100%; border: 1px solid #eee; }
"""


def html_page(blocks: list[Block]) -> str:
    body = ["<h1>StateLens report</h1>"]
    for block in blocks:
        if block.kind == "heading":
            body.append(f"<h2>{html.escape(block.text)}</h2>")
        elif block.kind == "text":
            body.append(f"<p>{inline_code(block.text)}</p>")
        elif block.kind == "note":
            body.append(f'<p class="note"><strong>Note:</strong> {inline_code(block.text)}</p>')
        elif block.kind == "warning":
            body.append(f'<p class="warning"><strong>Warning:</strong> {inline_code(block.text)}</p>')
        elif block.kind == "table":
            header = "".join(f"<th>{html.escape(cell)}</th>" for cell in block.header)
            rows = "".join(
                "<tr>" + "".join(f"<td>{inline_code(cell)}</td>" for cell in row) + "</tr>" for row in block.rows
            )
            body.append(f"<table><thead><tr>{header}</tr></thead><tbody>{rows}</tbody></table>")
        elif block.kind == "image":
            data = base64.b64encode(block.image.read_bytes()).decode("ascii")
            body.append(f"<h3>{html.escape(block.text)}</h3>")
            body.append(f'<img alt="{html.escape(block.text)}" src="data:image/png;base64,{data}">')
        elif block.kind == "link":
            name = html.escape(block.image.name)
            body.append(f'<p>{inline_code(block.text)} <a href="{name}">{name}</a></p>')
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>StateLens report</title>'
        f"<style>{HTML_STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


# ----- entry points --------------------------------------------------------------------------------------------------
def write_report(run_dirs, out_dir, base=None) -> Path:
    """Compare run folders: write `report.md`, a self-contained `report.html` and PNG plots into `out_dir`.

    Args:
        run_dirs: run folders as the recipes write them (see the module docstring); each is a row and a curve.
        out_dir: folder for the report (created).
        base: a run folder whose `after` evaluation is the Base row (e.g. a `statelens eval` run of the base
            model); default: the first run's `before` evaluation.

    Returns:
        The path of `report.md`.
    """
    if not run_dirs:
        raise ValueError(f"write_report needs at least one run folder: {RUN_FOLDER_CONTENTS}")
    base_run = load_run(base) if base is not None else None
    base_path = base_run.path.resolve() if base_run is not None else None
    # the base model's own evaluation run is the Base row, not a run row as well
    runs = [load_run(path) for path in run_dirs if Path(path).resolve() != base_path]
    make_labels_unique(runs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    base_scores, base_source = base_scores_for(runs, base_run)
    provenance_blocks, differences = provenance_warning(runs, base_run)
    if differences:  # said where it is seen, not only in the report
        print(f"statelens report: warning: {PROVENANCE_WARNING}:", file=sys.stderr)
        print("".join(f"  - {line}\n" for line in differences), end="", file=sys.stderr)
    blocks = (
        provenance_blocks
        + preflight_blocks(runs)
        + guard_blocks(runs)
        + table2(runs, base_scores, base_source)
        + state_table(runs)
        + teacher_table(runs)
        + plot_blocks(runs, out_dir, base_scores)
        + compute_table(runs, base_scores)
        + cost_table(runs)
        + run_notes(runs)
    )
    states_path = write_states_page(runs, out_dir / "states.html")
    blocks.insert(
        0, Block("link", "The supervised states, token by token, in a browser (no server needed):", image=states_path)
    )
    report_path = out_dir / "report.md"
    report_path.write_text(markdown(blocks), encoding="utf-8")
    (out_dir / "report.html").write_text(html_page(blocks), encoding="utf-8")
    return report_path


def run_report_cli(args: argparse.Namespace) -> int:
    """`statelens report`: write the report and say where it is; a bad run folder is a one-line error, exit 2."""
    try:
        report_path = write_report(args.run_dirs, args.out, base=args.base)
    except (FileNotFoundError, ValueError) as err:
        print(f"statelens report: error: {err}", file=sys.stderr)
        return 2
    print(
        f"report written: {report_path}, {report_path.with_suffix('.html')} and {report_path.parent / 'states.html'}"
    )
    return 0
