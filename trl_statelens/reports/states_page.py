"""`states.html`: a self-contained page to browse the supervised states of one or several runs.

`statelens report` writes it next to `report.html`. Everything is inlined (data as JSON, hand-written JavaScript and
SVG, no library, no network), so it works opened from disk. It shows:

- sequences sampled from each run's `statelens/states.jsonl`: the prompt in grey (beside it, when the teacher read a
  prompt of its own, as a self teacher shown privileged context does, that prompt and its extra tokens), then each
  supervised token coloured by the chosen quantity (state source, learner log-prob, teacher log-prob, the gap
  `log p_S - log p_T`, weight or advantage, entropy); hovering a token shows its values and prefix length;
- filters by run, step range, source and reward (and by teacher, with a run of several teachers, whose tokens can
  also be coloured by which teacher answers their row), and a sort by off-policy gap or teacher KL, 40 sequences a
  page;
- the preflight's flagged checks and the run guards' firings, when the runs recorded them (the report's tables);
- per run, the prefix-length histogram over steps as a heatmap (from `steps.jsonl`), and state and drift metrics
  over steps; dragging across a chart or the heatmap sets the step filter, double-click clears it.

The filter lives in the URL's `#fragment` (`#source=learner&steps=10-20&color=gap&sort=kl`, `#teacher=math&color=teacher_id`),
so a view can be shared or opened directly.

A big ledger is sampled, not embedded whole: at most `max_sequences` sequences and `max_tokens` tokens in all, spread
evenly over each run's ledger lines (the page says how many it shows out of how many). Per-token values are
rounded to 3 decimals (entropy 2). The page renders one page of sequences at a time, so it stays responsive
whatever the ledger size (measured in `tests/test_states_html.py`'s notes and the README).
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from .guards import guards_html
from .preflight import preflight_html
from .states_data import MAX_SEQUENCES, MAX_TOKENS, page_data


def write_states_page(runs, path, max_sequences: int = MAX_SEQUENCES, max_tokens: int = MAX_TOKENS) -> Path:
    """Write `states.html` for `runs` (:class:`~.run_folders.Run` objects) to `path`."""
    data = json.dumps(page_data(runs, max_sequences, max_tokens), ensure_ascii=False, separators=(",", ":"))
    data = data.replace("</", "<\\/")  # no `</script>` inside the data block
    title = "StateLens states: " + ", ".join(run.label for run in runs)
    page = PAGE.replace("{title}", html.escape(title)).replace("{style}", STYLE).replace("{script}", SCRIPT)
    page = page.replace("{preflight}", preflight_html(runs)).replace("{guards}", guards_html(runs))
    page = page.replace("{data}", data)  # last: the data may hold any text, including the placeholders
    path = Path(path)
    path.write_text(page, encoding="utf-8")
    return path


# ----- the page ---------------------------------------------------------------------------------------------------
PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{style}</style></head>
<body>
<h1>StateLens states</h1>
{preflight}{guards}<p id="summary"></p>
<div id="errors" hidden></div>
<div id="layout">
<section id="left">
<form id="filters" onsubmit="return false">
  <fieldset><legend>Runs</legend><div id="run-boxes"></div></fieldset>
  <fieldset><legend>Steps</legend>
    <input id="step-min" type="number" placeholder="from"> – <input id="step-max" type="number" placeholder="to">
    <button type="button" id="step-clear">all</button></fieldset>
  <fieldset><legend>Source</legend><div id="source-boxes"></div></fieldset>
  <fieldset id="teacher-field" hidden><legend>Teacher</legend><div id="teacher-boxes"></div></fieldset>
  <fieldset><legend>Reward</legend>
    <input id="reward-min" type="number" step="any" placeholder="min"> –
    <input id="reward-max" type="number" step="any" placeholder="max"></fieldset>
  <fieldset><legend>Colour tokens by</legend><select id="color-by"></select></fieldset>
  <fieldset><legend>Sort by</legend><select id="sort-by"></select></fieldset>
</form>
<div id="legend"></div>
<div id="pager"><button type="button" id="prev">&larr;</button> <span id="page-info"></span>
  <button type="button" id="next">&rarr;</button></div>
<div id="sequences"></div>
</section>
<section id="right">
<h2>Where supervision lands</h2>
<p class="hint">Share of each step's supervised tokens per prefix-length bin. Drag across a chart to filter steps;
double-click to clear.</p>
<div id="heatmaps"></div>
<h2>State and drift metrics</h2>
<div id="charts"></div>
</section>
</div>
<div id="tooltip" hidden></div>
<script type="application/json" id="data">{data}</script>
<script>{script}</script>
</body></html>
"""

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1em 1.5em; color: #222; }
h1 { margin: 0 0 .2em; font-size: 1.5em; } h2 { font-size: 1.1em; margin: .8em 0 .3em; }
#summary { color: #555; margin: 0 0 .6em; }
#errors { background: #fde8e8; border-left: 4px solid #c00; padding: .4em .8em; white-space: pre-wrap; }
#layout { display: flex; gap: 1.5em; align-items: flex-start; }
#left { flex: 3; min-width: 0; } #right { flex: 2; min-width: 360px; }
#filters { display: flex; flex-wrap: wrap; gap: .4em; }
fieldset { border: 1px solid #ddd; padding: .2em .5em; font-size: .9em; }
input[type=number] { width: 5.5em; }
label { margin-right: .6em; white-space: nowrap; }
#legend { margin: .5em 0; font-size: .85em; display: flex; align-items: center; gap: .5em; flex-wrap: wrap; }
.swatch { display: inline-block; width: 1em; height: 1em; vertical-align: middle; border: 1px solid #aaa; }
.ramp { display: inline-block; width: 160px; height: 1em; vertical-align: middle; border: 1px solid #aaa; }
#pager { margin: .4em 0; }
.seq { border: 1px solid #e3e3e3; border-radius: 4px; margin: .5em 0; padding: .4em .6em; }
.seq-head { font-size: .8em; color: #444; margin-bottom: .3em; }
.seq-head b { color: #000; }
.badge { display: inline-block; padding: 0 .4em; border-radius: 3px; color: #fff; font-size: .9em; }
.badge.cached { background: #4a6fa5; } .badge.skipped { background: #777; } .badge.recheck { background: #b8860b; }
.badge.end-end_token { background: #2e7d32; } .badge.end-length_limit { background: #8d6e63; }
.badge.end-stop { background: #607d8b; } .badge.repeats { background: #c62828; }
.seq.skipped { border-style: dashed; background: #f6f6f6; } .seq.skipped .completion { opacity: .45; text-decoration: line-through; }
.text { font-family: ui-monospace, monospace; font-size: .85em; white-space: pre-wrap; word-break: break-word;
  line-height: 1.6; }
.prompt { color: #888; border-left: 3px dashed #ccc; padding-left: .4em; margin-bottom: .2em; }
.prompt .more { color: #36c; cursor: pointer; }
.prompts { display: flex; gap: .8em; } .prompts > .prompt { flex: 1; min-width: 0; }
.prompt-label { color: #555; font-family: system-ui, sans-serif; font-size: .9em; display: block; }
.tok { padding: 1px 0; border-right: 1px solid #fff; cursor: default; }
.tok.cell { display: inline-block; width: .7em; height: 1em; vertical-align: middle; margin-right: 1px; }
.tok:hover { outline: 2px solid #000; }
.tok.chunked { box-shadow: inset 0 -3px 0 #222; }  /* teacher value shared out over a chunk */
#tooltip { position: fixed; background: #fff; border: 1px solid #888; padding: .3em .5em; font-size: .8em;
  pointer-events: none; box-shadow: 2px 2px 6px rgba(0,0,0,.2); z-index: 10; max-width: 320px; }
#tooltip table td { padding: 0 .4em; } #tooltip code { background: #f3f3f3; }
.hint { color: #666; font-size: .85em; margin: 0 0 .4em; }
svg text { font-size: 10px; fill: #333; } svg .title { font-size: 11px; font-weight: 600; }
svg.chart { display: block; margin-bottom: .6em; cursor: crosshair; user-select: none; }
.note { color: #8a5a00; font-size: .85em; }
"""

# The page's script (hand-written JavaScript, no library), kept as a file of its own beside this module
SCRIPT = "\n" + Path(__file__).with_name("states_page.js").read_text(encoding="utf-8")
