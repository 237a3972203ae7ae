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
import itertools
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from .compute import FLOPS_PARTS
from .states_html import write_states_page

TARGET_TASK = "gsm8k"
TARGET_METRIC = "accuracy_strict"  # GSM8KTask's primary metric, when results.json does not name it
SCORE_COLUMNS = {"gsm8k": "GSM8K", "truthfulqa": "TruthfulQA", "mmlu": "MMLU"}
TABLE2_HEADER = ["Run", *SCORE_COLUMNS.values(), "MMD drift", "Forgetting", "Retention"]
STATE_TABLE_HEADER = [
    "Run",
    "Steps",
    "Supervised tokens",
    "dataset",
    "learner",
    "teacher",
    "state_nll",
    "state_entropy",
    "offpolicy_gap",
    "prefix p10",
    "prefix p50",
    "prefix p90",
    "prefix max",
    "teacher_kl/supervised",
]
MISSING = "-"
RUN_FOLDER_CONTENTS = (
    "a run folder holds results.json, statelens/steps.jsonl, statelens/drift.jsonl and/or log_history.json, "
    "as written by the recipes"
)
FIGURE_SIZE = (7.0, 4.5)
TALL_FIGURE_SIZE = (7.0, 6.0)
DPI = 120
SMOOTH_ABOVE_POINTS = 100  # longer curves are drawn faint per step, with a moving average on top
TEACHER_LINES = ("-", "--", ":", "-.")  # one per teacher of a run with several, in its colour


# ----- reading run folders ----------------------------------------------------------------------------------------
@dataclass
class Run:
    """What one run folder holds; `None` for each missing piece, with a note saying so."""

    path: Path
    label: str
    results: dict | None
    steps: pd.DataFrame | None  # one row per optimizer step
    drift: pd.DataFrame | None  # one row per probe step
    log_history: list[dict] | None
    notes: list[str] = field(default_factory=list)
    steps_are_averages: bool = False  # `steps` rebuilt from log_history.json's averages, not the per-step ledger

    def evaluation(self, which: str) -> dict | None:
        """Task scores of the `before` or `after` evaluation, or None."""
        evaluation = (self.results or {}).get(which)
        if not isinstance(evaluation, dict) or not isinstance(evaluation.get("scores"), dict):
            return None
        return evaluation["scores"]

    @property
    def is_stock_baseline(self) -> bool:
        return (self.results or {}).get("baseline") == "stock"


def read_json(path: Path, notes: list[str]):
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        notes.append(f"`{path.name}` is not valid JSON ({err}); left out")
        return None


def read_jsonl(path: Path, notes: list[str]) -> pd.DataFrame | None:
    """One row per line; a line that does not parse (say, the last line of a run still writing) is skipped."""
    if not path.is_file():
        return None
    rows, bad_lines = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            bad_lines += 1
    if bad_lines:
        notes.append(f"`{path.parent.name}/{path.name}`: skipped {bad_lines} line(s) that are not valid JSON")
    if not rows:
        notes.append(f"`{path.parent.name}/{path.name}` is empty")
        return None
    frame = pd.DataFrame(rows)
    if "step" not in frame:
        notes.append(f"`{path.parent.name}/{path.name}` has no `step` field: lines are numbered 1, 2, ... instead")
        frame["step"] = np.arange(1, len(frame) + 1)
    return frame.sort_values("step", kind="stable").reset_index(drop=True)


def frame_from_log_history(log_history: list[dict], prefix: str, required: str) -> pd.DataFrame | None:
    """The `prefix`-keyed metrics the trainer logged (averages over its logging interval), prefix removed."""
    rows = [
        {"step": entry["step"], **{k[len(prefix) :]: v for k, v in entry.items() if k.startswith(prefix)}}
        for entry in log_history
        if isinstance(entry, dict) and "step" in entry and f"{prefix}{required}" in entry
    ]
    return pd.DataFrame(rows) if rows else None


def load_run(path: str | Path) -> Run:
    """Read one run folder. Raises if the folder does not exist or holds none of the run files."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"run folder {str(path)!r} does not exist: {RUN_FOLDER_CONTENTS}")
    notes: list[str] = []
    results = read_json(path / "results.json", notes)
    if results is not None and not isinstance(results, dict):
        notes.append("`results.json` is not a JSON object; left out")
        results = None
    log_history = read_json(path / "log_history.json", notes)
    if isinstance(log_history, dict):  # a whole trainer_state.json copied in place of its log_history
        log_history = log_history.get("log_history")
    if log_history is not None and not isinstance(log_history, list):
        notes.append("`log_history.json` is not a list of log entries; left out")
        log_history = None
    steps = read_jsonl(path / "statelens" / "steps.jsonl", notes)
    drift = read_jsonl(path / "statelens" / "drift.jsonl", notes)
    if results is None and steps is None and drift is None and log_history is None:
        raise ValueError(f"{str(path)!r} holds no run files: {RUN_FOLDER_CONTENTS}")

    if results is None:
        notes.append("no `results.json`: no evaluation scores")
    elif not isinstance(results.get("after"), dict):
        notes.append("`results.json` has no `after` evaluation: no scores")
    if isinstance((results or {}).get("compute"), dict) and results["compute"].get("flops") is None:
        notes.append("`results.json` counts no FLOPs (a served teacher's size is unknown): not in the compute plot")
    is_stock = (results or {}).get("baseline") == "stock"
    steps_are_averages = False
    if steps is None and log_history:
        steps = frame_from_log_history(log_history, "statelens/", "state_nll")
        steps_are_averages = steps is not None
        if steps is not None:
            notes.append("no `statelens/steps.jsonl`: state curves from `log_history.json` (logged averages)")
    if steps is None:
        why = "a stock TRL baseline records no per-step states" if is_stock else "no `statelens/steps.jsonl`"
        notes.append(f"{why}: no state statistics or state curves")
    if drift is None and log_history:
        drift = frame_from_log_history(log_history, "statelens/drift/", "mmd")
        if drift is not None:
            notes.append("no `statelens/drift.jsonl`: drift curves from `log_history.json`")
    if drift is None:
        notes.append("no probe drift (`statelens/drift.jsonl`)")

    label = str((results or {}).get("run_name") or path.resolve().name)
    return Run(
        path=path,
        label=label,
        results=results,
        steps=steps,
        drift=drift,
        log_history=log_history,
        notes=notes,
        steps_are_averages=steps_are_averages,
    )


def make_labels_unique(runs: list[Run]) -> None:
    """Two runs with the same run name get their folder names added, so legends and rows tell them apart."""
    counts = pd.Series([run.label for run in runs]).value_counts()
    for run in runs:
        if counts[run.label] > 1:
            run.label = f"{run.label} ({run.path})"


# ----- numbers -----------------------------------------------------------------------------------------------------
def column(frame: pd.DataFrame | None, name: str) -> np.ndarray | None:
    """`frame[name]` as floats (NaN where absent), or None when the column is missing or all NaN."""
    if frame is None or name not in frame:
        return None
    values = pd.to_numeric(frame[name], errors="coerce").to_numpy(dtype=float)
    return values if np.isfinite(values).any() else None


def token_weighted_mean(steps: pd.DataFrame | None, name: str, source: str | None = None) -> float | None:
    """Mean of a per-step metric, each step weighted by its supervised tokens (the mean over supervised tokens), or
    by its supervised tokens from one state ``source`` for a metric averaged over those tokens only."""
    values = column(steps, name)
    if values is None:
        return None
    weights = column(steps, "supervised_tokens")
    weights = np.ones_like(values) if weights is None else np.nan_to_num(weights)
    if source is not None:
        share = column(steps, f"source_frac/{source}")
        weights = weights * (0.0 if share is None else np.nan_to_num(share))
    usable = np.isfinite(values) & (weights > 0)
    if not usable.any():
        return None
    return float(np.average(values[usable], weights=weights[usable]))


def metric_curve(run: Run, name: str, log_key: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps, values) of metric `name` from the ledger, else of `log_key` from the trainer's log history."""
    for frame, key in ((run.steps, name), (frame_from_log_history(run.log_history or [], "", log_key), log_key)):
        values = column(frame, key)
        if values is not None:
            keep = np.isfinite(values)
            return frame["step"].to_numpy(dtype=float)[keep], values[keep]
    return None


def teacher_kl_curve(run: Run) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps, sampled reverse KL to the teacher): the ledger's `teacher_kl/supervised` (over the supervised tokens
    the learner sampled), else the trainer's logged `teacher_kl/sampled` (over every token it sampled; OPD trainers
    log it)."""
    return metric_curve(run, "teacher_kl/supervised", "teacher_kl/sampled")


def teacher_names(run: Run) -> list[str]:
    """The teachers of a run with several (`OnPolicyDistillTrainer` with a dict of teachers): the names in its
    ledger's `supervised_tokens/<name>` and its log's `statelens/supervised_tokens/<name>` and
    `teacher_kl/sampled/<name>`, in order of appearance."""
    keys = list(run.steps.columns) if run.steps is not None else []
    keys += [key for entry in run.log_history or [] if isinstance(entry, dict) for key in entry]
    prefixes = ("supervised_tokens/", "statelens/supervised_tokens/", "teacher_kl/sampled/")
    names = [key.split(prefix, 1)[1] for key in keys for prefix in prefixes if key.startswith(prefix)]
    return list(dict.fromkeys(names))


def teacher_curves(run: Run, name: str) -> dict[str, tuple[np.ndarray, np.ndarray] | None]:
    """Teacher `name`'s per-step curves: `teacher_kl` (the trainer logs it as `teacher_kl/sampled/<name>`), `supervised_tokens` and
    `source_frac_teacher` (the ledger records them; from the log history when there is no ledger)."""
    return {
        "teacher_kl": metric_curve(run, f"teacher_kl/sampled/{name}", f"teacher_kl/sampled/{name}"),
        "supervised_tokens": metric_curve(run, f"supervised_tokens/{name}", f"statelens/supervised_tokens/{name}"),
        "source_frac_teacher": metric_curve(
            run, f"source_frac/teacher/{name}", f"statelens/source_frac/teacher/{name}"
        ),
    }


def target_eval_key(run: Run) -> str:
    """The log key of the target score during training: `eval/gsm8k/<the evaluation's primary metric>`."""
    for which in ("after", "before"):
        evaluation = (run.results or {}).get(which)
        metrics = evaluation.get("primary_metrics") if isinstance(evaluation, dict) else None
        if isinstance(metrics, dict) and metrics.get(TARGET_TASK):
            return f"eval/{TARGET_TASK}/{metrics[TARGET_TASK]}"
    return f"eval/{TARGET_TASK}/{TARGET_METRIC}"


def sample_efficiency_curve(run: Run, base_scores: dict | None) -> tuple[np.ndarray, np.ndarray] | None:
    """(supervised tokens so far, target score) for a run scored on the target task during training; else `None`.

    x is the running sum of the ledger's `supervised_tokens` (one line per optimizer step, all ranks together) up to
    and including the evaluated step: the evaluation at the end of step s sees the model those tokens trained. The
    first point (0 tokens) is the run's `before` score, else the base row's (a run with `--eval_before false`); the
    last is the `after` score, at the run's total.
    """
    key = target_eval_key(run)
    during = [
        (int(entry["step"]), float(entry[key]))
        for entry in run.log_history or []
        if isinstance(entry, dict) and "step" in entry and isinstance(entry.get(key), (int, float))
    ]
    if not during:
        return None
    tokens = column(run.steps, "supervised_tokens")
    if tokens is None or run.steps_are_averages:
        run.notes.append(
            "target scores during training but no per-step supervised tokens (`statelens/steps.jsonl`): "
            "not in the sample-efficiency plot"
        )
        return None
    ledger_steps = run.steps["step"].to_numpy(dtype=np.int64)
    so_far = np.cumsum(np.nan_to_num(tokens))
    points = []
    start = (run.evaluation("before") or base_scores or {}).get(TARGET_TASK)
    if start is not None:
        points.append((0.0, float(start)))
    beyond = [step for step, _ in during if step > ledger_steps[-1]]
    if beyond:
        run.notes.append(f"target scores at steps {beyond} are past the ledger's last step: left out of the plot")
    for step, score in during:
        if 0 < step <= ledger_steps[-1]:
            points.append((float(so_far[np.searchsorted(ledger_steps, step, side="right") - 1]), score))
        elif step == 0:
            points.append((0.0, score))
    after = (run.evaluation("after") or {}).get(TARGET_TASK)
    if after is not None:
        points.append((float(so_far[-1]), float(after)))
    x, y = np.array(points, dtype=float).T
    return x, y


def final_mmd(run: Run) -> float | None:
    final_drift = (run.results or {}).get("final_drift")
    if isinstance(final_drift, dict) and final_drift.get("mmd") is not None:
        return float(final_drift["mmd"])
    values = column(run.drift, "mmd")
    if values is not None:
        run.notes.append("MMD drift is the last `drift.jsonl` value (`results.json` has no `final_drift`)")
        return float(values[np.isfinite(values)][-1])
    return None


def prefix_histogram(steps: pd.DataFrame | None) -> np.ndarray | None:
    """Supervised tokens per prefix-length bin, summed over steps (bin k: prefix lengths [2**k - 1, 2**(k+1) - 1))."""
    if steps is None or "prefix_len_hist" not in steps:
        return None
    hists = [h for h in steps["prefix_len_hist"] if isinstance(h, list) and h]
    if not hists:
        return None
    lengths = np.fromiter(map(len, hists), dtype=np.int64, count=len(hists))
    counts = np.fromiter(itertools.chain.from_iterable(hists), dtype=float, count=int(lengths.sum()))
    bin_of_each = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    totals = np.bincount(bin_of_each, weights=counts)
    return totals if totals.sum() > 0 else None


def prefix_bin_label(k: int) -> str:
    low, high = 2**k - 1, 2 ** (k + 1) - 2
    return str(low) if low == high else f"{low}-{high}"


def fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return MISSING
    return format(value, spec)


# ----- the report as blocks, rendered to Markdown and HTML ----------------------------------------------------------
@dataclass
class Block:
    kind: str  # "heading", "text", "note", "table", "image", "link" (text, then a link to `image`'s file name)
    text: str = ""
    header: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    image: Path | None = None


def note(text: str) -> Block:
    return Block("note", text)


def base_scores_for(runs: list[Run], base: Run | None) -> tuple[dict | None, str]:
    """The Base row's scores and a sentence saying where they come from."""
    if base is not None:
        scores = base.evaluation("after")
        if scores is not None:
            return scores, f"Base: the `after` evaluation of `{base.label}` (--base)."
        return None, f"Base: --base `{base.label}` has no `after` evaluation, so there is no base row."
    for index, run in enumerate(runs):
        scores = run.evaluation("before")
        if scores is not None:
            skipped = "" if index == 0 else " (the first run with one)"
            return scores, f"Base: the `before` evaluation of `{run.label}`{skipped}; pass --base RUN_DIR to choose."
    return None, "Base: no run has a `before` evaluation and no --base was given, so there is no base row."


def table2(runs: list[Run], base_scores: dict | None, base_source: str) -> list[Block]:
    from .evaluation import retention_summary  # imports torch: only when a report is written

    rows, notes = [], [base_source]
    if base_scores is not None:
        rows.append(["Base", *(fmt(base_scores.get(t), ".4f") for t in SCORE_COLUMNS), MISSING, MISSING, MISSING])
    for run in runs:
        after = run.evaluation("after")
        forgetting = retention = None
        if after is not None and base_scores is not None:
            try:
                summary = retention_summary(base_scores, after)
                forgetting, retention = summary["forgetting"], summary["retention"]
            except ValueError as err:
                notes.append(f"`{run.label}`: no Forgetting/Retention ({err}).")
            own = (run.results or {}).get("retention")
            if forgetting is not None and isinstance(own, dict) and own.get("forgetting") is not None:
                if abs(own["forgetting"] - forgetting) > 1e-9 or abs(own["retention"] - retention) > 1e-9:
                    notes.append(
                        f"`{run.label}`: against its own `before` evaluation (results.json `retention`), "
                        f"Forgetting {own['forgetting']:.4f}, Retention {own['retention']:.4f}."
                    )
        scores = after or {}
        rows.append(
            [
                run.label,
                *(fmt(scores.get(t), ".4f") for t in SCORE_COLUMNS),
                fmt(final_mmd(run), ".4g"),
                fmt(forgetting, ".4f"),
                fmt(retention, ".4f"),
            ]
        )
    blocks = [
        Block("heading", "Scores, drift and retention (the study's Table 2)"),
        Block("table", header=TABLE2_HEADER, rows=rows),
        Block(
            "text",
            "Scores are accuracies of the `after` evaluation. Forgetting = mean(base - post) and Retention = "
            "mean(post / base) over TruthfulQA and MMLU, against the Base row. MMD drift: the final probe drift "
            "(MMD², RBF kernel) of the learner's own states against step 0.",
        ),
    ]
    return blocks + [note(text) for text in notes]


def state_table(runs: list[Run]) -> list[Block]:
    rows, notes = [], []
    for run in runs:
        steps = run.steps
        if steps is None:
            rows.append([run.label] + [MISSING] * (len(STATE_TABLE_HEADER) - 1))
            notes.append(f"`{run.label}`: no per-step state records.")
            continue
        tokens = column(steps, "supervised_tokens")
        prefix_max = column(steps, "prefix_len/max")
        rows.append(
            [
                run.label,
                str(len(steps)),
                fmt(None if tokens is None else int(np.nansum(tokens)), ","),
                *(
                    fmt(token_weighted_mean(steps, f"source_frac/{s}"), ".3f")
                    for s in ("dataset", "learner", "teacher")
                ),
                *(fmt(token_weighted_mean(steps, m), ".4f") for m in ("state_nll", "state_entropy", "offpolicy_gap")),
                *(fmt(token_weighted_mean(steps, f"prefix_len/{q}"), ".1f") for q in ("p10", "p50", "p90")),
                fmt(None if prefix_max is None else float(np.nanmax(prefix_max)), ".0f"),
                fmt(token_weighted_mean(steps, "teacher_kl/supervised", source="learner"), ".4f"),
            ]
        )
    return [
        Block("heading", "State statistics"),
        Block("table", header=STATE_TABLE_HEADER, rows=rows),
        Block(
            "text",
            "Supervised tokens: the total over all steps. dataset / learner / teacher: share of supervised tokens by "
            "state source. The other columns are per-step values averaged over steps, each step weighted by its "
            "supervised tokens (prefix quantiles are per-step quantiles so averaged); prefix max is the longest "
            "supervised prefix of the run; teacher_kl/supervised: the sampled reverse KL log p_student - log p_teacher "
            "over supervised tokens the learner sampled itself (OPD reverse_kl and divergence; the continuation "
            "signal supervises the teacher's own tokens).",
        ),
        *(note(text) for text in notes),
    ]


def teacher_table(runs: list[Run]) -> list[Block]:
    """One row per teacher of each run with several: its supervised tokens and their share, the share of all
    supervised tokens on prefixes it wrote, and its teacher_kl."""
    rows = []
    for run in runs:
        names = teacher_names(run)
        curves = {name: teacher_curves(run, name) for name in names}
        totals = {
            name: float(np.sum(c["supervised_tokens"][1])) if c["supervised_tokens"] is not None else None
            for name, c in curves.items()
        }
        everything = sum(t for t in totals.values() if t is not None)
        for name, curve in curves.items():
            tokens, written, kl = totals[name], curve["source_frac_teacher"], curve["teacher_kl"]
            rows.append(
                [
                    run.label,
                    name,
                    fmt(None if tokens is None else int(tokens), ","),
                    fmt(None if tokens is None or not everything else tokens / everything, ".3f"),
                    fmt(
                        None if written is None else token_weighted_mean(run.steps, f"source_frac/teacher/{name}"),
                        ".3f",
                    ),
                    fmt(None if kl is None else float(np.mean(kl[1])), ".4f"),
                ]
            )
    if not rows:
        return []
    return [
        Block("heading", "Teachers"),
        Block(
            "table",
            header=["Run", "Teacher", "Supervised tokens", "share", "teacher-written share", "teacher_kl/sampled"],
            rows=rows,
        ),
        Block(
            "text",
            "Runs with several teachers (each row routed by its `teacher_id`). Supervised tokens: the total over all "
            "steps on the rows this teacher answered, and their share of the run's. Teacher-written share: of all "
            "supervised tokens, those on prefixes this teacher wrote (`source_frac/teacher/<name>`, token-weighted "
            "over steps; the run's teacher column above is their sum). teacher_kl/sampled: the mean of the logged "
            "`teacher_kl/sampled/<name>` values, over the tokens its rows' student sampled.",
        ),
    ]


def cost_table(runs: list[Run]) -> list[Block]:
    """One row per run whose ledger counts its cost: the positions its teacher scored or wrote and its training FLOPs
    by part (the ledger's last `flops_total/*`, the same as `results.json`'s `compute`)."""
    rows = []
    for run in runs:
        total = column(run.steps, "flops_total/student_training")
        if total is None:
            continue
        teacher_tokens = column(run.steps, "teacher_tokens")
        parts = [column(run.steps, f"flops_total/{part}") for part in FLOPS_PARTS + ("total",)]
        rows.append(
            [
                run.label,
                fmt(None if teacher_tokens is None else int(np.nansum(teacher_tokens)), ","),
                *(fmt(None if values is None else float(values[-1]), ".2e") for values in parts),
            ]
        )
    if not rows:
        return []
    return [
        Block("heading", "Training cost"),
        Block(
            "table",
            header=[
                "Run",
                "Teacher tokens",
                "student generation FLOPs",
                "student training FLOPs",
                "teacher FLOPs",
                "total FLOPs",
            ],  # fmt: skip
            rows=rows,
        ),
        Block(
            "text",
            "Teacher tokens: the positions a teacher scored or wrote over the run (the ledger's `teacher_tokens`, all "
            "ranks; prompt tokens not counted). FLOPs: 2 per parameter and token forward, 6 forward and backward, "
            "from the models' sizes and the tokens processed (`trl_statelens.compute.ComputeCounter`); a served "
            "teacher's size is unknown, so are its FLOPs and the total (-).",
        ),
    ]


COMPUTE_GAINS = (0.05, 0.10)  # target-score gains over the start for the compute table


def compute_table(runs: list[Run], base_scores: dict | None = None) -> list[Block]:
    """Training FLOPs each run needed to first reach its start score + each of `COMPUTE_GAINS` on the target
    (evaluations during training), next to its total compute and final score."""
    rows = []
    for run in runs:
        curve = compute_curve(run, base_scores)
        if curve is None:
            continue
        flops, scores = curve
        start = scores[0]
        reached = []
        for gain in COMPUTE_GAINS:
            hit = np.nonzero(scores >= start + gain - 1e-9)[0]
            reached.append(f"{flops[hit[0]]:.2e}" if hit.size else "not reached")
        rows.append([run.label, f"{start:.3f}", *reached, f"{flops[-1]:.2e}", f"{scores[-1]:.3f}"])
    if not rows:
        return []
    gains = [f"FLOPs to start + {gain:.2f}" for gain in COMPUTE_GAINS]
    return [
        Block("heading", "Compute to reach a target score"),
        Block("table", header=["Run", "start", *gains, "total FLOPs", "final"], rows=rows),
        Block(
            "text",
            "FLOPs counted from the models' sizes and the tokens processed (results.json `compute`: 2 per parameter "
            "and token forward, 6 forward and backward; generation and teacher included), at the first evaluation "
            "during training whose target score reaches the start score plus the gain. One evaluation of 100 "
            "problems moves by about 0.04 by chance, so a single crossing is noisy.",
        ),
    ]


# ----- plots -------------------------------------------------------------------------------------------------------
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


def plot_state_curves(runs, styles, out_dir) -> Path | None:
    with_steps = [run for run in runs if column(run.steps, "state_nll") is not None]
    if not with_steps:
        return None
    figure, (nll_ax, gap_ax) = new_figure(TALL_FIGURE_SIZE, rows=2)
    for run in with_steps:
        steps = run.steps["step"].to_numpy(dtype=float)
        plot_curve(nll_ax, steps, column(run.steps, "state_nll"), styles[run.label], run.label)
        gap = column(run.steps, "offpolicy_gap")
        if gap is not None:
            plot_curve(gap_ax, steps, gap, styles[run.label], run.label)
    nll_ax.set_title("Learner NLL of the supervised tokens (state_nll)")
    nll_ax.set_ylabel("state_nll (nats)")
    gap_ax.set_title("Off-policy gap: state_nll - state_entropy (about 0 for self-sampled tokens)")
    gap_ax.set_ylabel("offpolicy_gap (nats)")
    gap_ax.axhline(0.0, color="gray", linewidth=0.8, linestyle="--")
    gap_ax.set_xlabel("optimizer step")
    finish_legend(nll_ax)
    return save(figure, out_dir, "state_curves.png")


def plot_prefix_histograms(runs, styles, out_dir) -> Path | None:
    histograms = {run.label: h for run in runs if (h := prefix_histogram(run.steps)) is not None}
    if not histograms:
        return None
    num_bins = max(len(h) for h in histograms.values())
    figure, (ax,) = new_figure()
    width = 0.8 / len(histograms)
    for index, (label, hist) in enumerate(histograms.items()):
        share = np.pad(hist, (0, num_bins - len(hist))) / hist.sum()
        ax.bar(
            np.arange(num_bins) + (index - (len(histograms) - 1) / 2) * width,
            share,
            width,
            color=styles[label]["color"],
            label=label,
        )
    ax.set_xticks(
        np.arange(num_bins), [prefix_bin_label(k) for k in range(num_bins)], rotation=30 if num_bins > 8 else 0
    )
    ax.set_xlabel("prefix length (tokens since the prompt)")
    ax.set_ylabel("share of supervised tokens")
    ax.set_title("Where supervision lands: prefix lengths of supervised tokens")
    finish_legend(ax)
    return save(figure, out_dir, "prefix_lengths.png")


def plot_drift(runs, styles, out_dir) -> Path | None:
    with_drift = [run for run in runs if column(run.drift, "mmd") is not None]
    if not with_drift:
        return None
    with_base_kl = [run for run in with_drift if column(run.drift, "base_kl") is not None]
    rows = 3 if with_base_kl else 2
    figure, axes = new_figure((TALL_FIGURE_SIZE[0], TALL_FIGURE_SIZE[1] * rows / 2), rows=rows)
    mmd_ax, sw_ax = axes[0], axes[1]
    for run in with_drift:
        steps = run.drift["step"].to_numpy(dtype=float)
        plot_curve(mmd_ax, steps, column(run.drift, "mmd"), styles[run.label], run.label, smooth=False)
        sliced = column(run.drift, "sliced_wasserstein")
        if sliced is not None:
            plot_curve(sw_ax, steps, sliced, styles[run.label], run.label, smooth=False)
    mmd_ax.set_title("Probe drift of the learner's own states vs step 0: MMD²")
    mmd_ax.set_ylabel("MMD² (RBF kernel)")
    sw_ax.set_title("Probe drift: sliced Wasserstein distance")
    sw_ax.set_ylabel("sliced Wasserstein")
    if with_base_kl:
        kl_ax = axes[2]
        for run in with_base_kl:
            style, steps = styles[run.label], run.drift["step"].to_numpy(dtype=float)
            plot_curve(kl_ax, steps, column(run.drift, "base_kl"), style, run.label, smooth=False)
            if column(run.drift, "base_kl_topk") is not None:
                kl_ax.plot(
                    steps, column(run.drift, "base_kl_topk"), color=style["color"], linestyle="--", linewidth=1.0
                )
        kl_ax.set_title("Forward KL(π₀ ‖ π_θ) per probe token: base_kl, base_kl_topk (dashed)")
        kl_ax.set_ylabel("nats per token")
        kl_ax.axhline(0.0, color="gray", linewidth=0.8, linestyle="--")
    axes[-1].set_xlabel("optimizer step")
    finish_legend(mmd_ax)
    return save(figure, out_dir, "drift.png")


def plot_tradeoff(runs, styles, out_dir, base_scores: dict | None) -> Path | None:
    from .evaluation import retention_summary

    points = []
    for run in runs:
        after = run.evaluation("after")
        if base_scores is None or after is None or after.get(TARGET_TASK) is None:
            continue
        try:
            points.append((run.label, retention_summary(base_scores, after)["retention"], after[TARGET_TASK]))
        except ValueError:
            continue
    if not points:
        return None
    figure, (ax,) = new_figure()
    if base_scores.get(TARGET_TASK) is not None:
        ax.scatter([1.0], [base_scores[TARGET_TASK]], marker="*", s=160, color="black", label="Base", zorder=3)
        ax.axhline(base_scores[TARGET_TASK], color="gray", linewidth=0.8, linestyle="--")
    ax.axvline(1.0, color="gray", linewidth=0.8, linestyle="--")
    for label, retention, target in points:
        size = 30 * styles[label]["width"] ** 2  # earlier runs larger, so a later run on the same spot leaves a ring
        ax.scatter([retention], [target], s=size, color=styles[label]["color"], label=label, zorder=3)
    # runs on the same spot share one annotation instead of printing their names over each other
    spots = pd.DataFrame(points, columns=["label", "retention", "target"]).round({"retention": 6, "target": 6})
    for (retention, target), group in spots.groupby(["retention", "target"], sort=False):
        ax.annotate(
            ", ".join(group["label"]), (retention, target), textcoords="offset points", xytext=(7, 5), fontsize=8
        )
    ax.set_xlabel("Retention (mean post / base over TruthfulQA and MMLU)")
    ax.set_ylabel(f"{SCORE_COLUMNS[TARGET_TASK]} accuracy (target)")
    ax.set_title("Trade-off: target score vs retention (up and right is better)")
    ax.margins(x=0.2, y=0.15)
    finish_legend(ax)
    return save(figure, out_dir, "tradeoff.png")


def plot_teacher_kl(runs, styles, out_dir) -> Path | None:
    curves = {run.label: curve for run in runs if (curve := teacher_kl_curve(run)) is not None}
    if not curves:
        return None
    figure, (ax,) = new_figure()
    for label, (steps, values) in curves.items():
        plot_curve(ax, steps, values, styles[label], label)
    ax.axhline(0.0, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("sampled reverse KL (nats per token)")
    ax.set_title("Sampled reverse KL to the teacher: log p_student - log p_teacher")
    finish_legend(ax)
    return save(figure, out_dir, "teacher_kl.png")


def plot_teachers(runs, styles, out_dir) -> Path | None:
    """Per teacher of each run with several: teacher_kl and supervised tokens over steps (colour: the run; line
    style: the teacher)."""
    with_teachers = [(run, names) for run in runs if (names := teacher_names(run))]
    if not with_teachers:
        return None
    figure, (kl_ax, tokens_ax) = new_figure(TALL_FIGURE_SIZE, rows=2)
    for run, names in with_teachers:
        for index, name in enumerate(names):
            curves = teacher_curves(run, name)
            for ax, key in ((kl_ax, "teacher_kl"), (tokens_ax, "supervised_tokens")):
                if curves[key] is not None:
                    ax.plot(*curves[key], color=styles[run.label]["color"], linestyle=TEACHER_LINES[index % 4],
                            marker=styles[run.label]["marker"], markersize=3, label=f"{run.label}: {name}")  # fmt: skip
    kl_ax.axhline(0.0, color="gray", linewidth=0.8, linestyle="--")
    kl_ax.set_title("Sampled reverse KL to each teacher (teacher_kl/sampled/<name>)")
    kl_ax.set_ylabel("nats per token")
    tokens_ax.set_title("Supervised tokens per step on each teacher's rows")
    tokens_ax.set_ylabel("tokens")
    tokens_ax.set_xlabel("optimizer step")
    finish_legend(kl_ax)
    finish_legend(tokens_ax)
    return save(figure, out_dir, "teachers.png")


def target_scores_during(run: Run, metric: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(step, `eval/gsm8k/<metric>`) from the log history, step 0 from the `before` evaluation when it has it."""
    key = f"eval/{TARGET_TASK}/{metric}"
    points = [
        (float(e["step"]), float(e[key]))
        for e in run.log_history or []
        if isinstance(e, dict) and "step" in e and isinstance(e.get(key), (int, float))
    ]
    before = (run.results or {}).get("before") or {}
    start = ((before.get("metrics") or {}).get(TARGET_TASK) or {}).get(metric)
    if isinstance(start, (int, float)) and points:
        points.insert(0, (0.0, float(start)))
    return tuple(np.array(points, dtype=float).T) if points else None


def training_flops(run: Run, steps) -> np.ndarray | None:
    """Training FLOPs up to the end of each of `steps`: the ledger's `flops_total/total` at the last step at or before
    it where the ledger has it (it counts a self teacher's context too); else from `results.json`'s `compute` counts,
    the logged `num_tokens` (every `logging_steps`: linear in between) and the ledger's `supervised_tokens`; `None`
    without them."""
    steps = np.asarray(steps, dtype=float)
    ledger = column(run.steps, "flops_total/total")
    if ledger is not None and len(ledger) and not np.isnan(ledger).any():
        index = np.searchsorted(run.steps["step"].to_numpy(), steps, side="right")
        return np.r_[0.0, ledger][index]
    compute = (run.results or {}).get("compute")
    logged = [(e["step"], e["num_tokens"]) for e in run.log_history or [] if isinstance(e, dict) and "num_tokens" in e]
    if not isinstance(compute, dict) or compute.get("flops_per_token") is None or not logged:
        return None  # (`None` per token: a served teacher, whose size is unknown)
    token_steps, tokens = np.array(logged, dtype=float).T
    flops = compute["flops_per_token"] * np.interp(steps, np.r_[0.0, token_steps], np.r_[0.0, tokens])
    supervised = column(run.steps, "supervised_tokens")
    if compute.get("flops_per_supervised_token") and supervised is not None:
        so_far = np.r_[0.0, np.cumsum(np.nan_to_num(supervised))]
        index = np.searchsorted(run.steps["step"].to_numpy(), steps, side="right")
        flops = flops + compute["flops_per_supervised_token"] * so_far[index]
    return np.where(steps > 0, flops, 0.0)


def compute_curve(run: Run, base_scores: dict | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """(training FLOPs so far, target score) at each target evaluation: the `before` score (else the base row's) at 0,
    the `after` score at the run's total."""
    curve = target_scores_during(run, target_eval_key(run).rsplit("/", 1)[-1])
    flops = None if curve is None else training_flops(run, curve[0])
    if flops is None:
        return None
    scores = curve[1]
    if curve[0][0] > 0 and (base_scores or {}).get(TARGET_TASK) is not None:
        flops, scores = np.r_[0.0, flops], np.r_[float(base_scores[TARGET_TASK]), scores]
    after, total = (run.evaluation("after") or {}).get(TARGET_TASK), run.results["compute"].get("flops")
    if after is not None and total:
        flops, scores = np.r_[flops, total], np.r_[scores, after]
    return flops, scores


def plot_target_against(curves: dict, styles, out_dir, xlabel: str, title: str, name: str) -> Path | None:
    """Each run's target score (y) against what it had spent so far (x): `curves` maps a run's label to (x, scores)."""
    if not curves:
        return None
    figure, (ax,) = new_figure()
    for label, (spent, scores) in curves.items():
        style = styles[label]
        ax.plot(spent, scores, color=style["color"], label=label, linewidth=style["width"],
                marker=style["marker"], markersize=2.5 * style["width"])  # fmt: skip
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{SCORE_COLUMNS[TARGET_TASK]} accuracy (target)")
    ax.set_title(f"{title} (up and left is better)")
    ax.margins(y=0.1)
    finish_legend(ax)
    return save(figure, out_dir, name)


def plot_compute(runs, styles, out_dir, base_scores: dict | None = None) -> Path | None:
    curves = {run.label: c for run in runs if (c := compute_curve(run, base_scores)) is not None}
    xlabel = "training FLOPs so far (student and teacher, generation included)"
    return plot_target_against(curves, styles, out_dir, xlabel, "Target score vs training compute", "compute.png")


def teacher_tokens_curve(run: Run, base_scores: dict | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """(teacher tokens spent so far, target score) at each evaluation during training: the ledger's
    `teacher_tokens_total` at the last step at or before it, the base's score at 0 when the run has no `before`;
    `None` for a run without a teacher in its ledger (SFT, GRPO)."""
    curve = target_scores_during(run, target_eval_key(run).rsplit("/", 1)[-1])
    spent = column(run.steps, "teacher_tokens_total")
    if curve is None or spent is None or not len(spent) or np.isnan(spent).all():
        return None
    steps, scores = curve
    index = np.searchsorted(run.steps["step"].to_numpy(), steps, side="right")
    tokens = np.r_[0.0, np.nan_to_num(spent)][index]
    if steps[0] > 0 and (base_scores or {}).get(TARGET_TASK) is not None:
        tokens, scores = np.r_[0.0, tokens], np.r_[float(base_scores[TARGET_TASK]), scores]
    return tokens, scores


def plot_teacher_tokens(runs, styles, out_dir, base_scores: dict | None = None) -> Path | None:
    curves = {run.label: c for run in runs if (c := teacher_tokens_curve(run, base_scores)) is not None}
    xlabel = "teacher tokens so far (ledger teacher_tokens_total: positions a teacher scored or wrote)"
    return plot_target_against(curves, styles, out_dir, xlabel, "Target score vs teacher tokens", "teacher_tokens.png")


def plot_teacher_disagreement(runs, styles, out_dir) -> Path | None:
    """Where the student still disagrees with its teacher, measured the same way for every trainer on the probe
    states (exact reverse KL), next to the target score greedy and sampled when a run scored it during training (no
    empty panel otherwise)."""
    with_kl = [run for run in runs if column(run.drift, "teacher_kl/exact") is not None]
    if not with_kl:
        return None
    scores = {}  # per run scored during training: (line style, curve), greedy (solid) and temperature-1 (dashed)
    for run in with_kl:
        curves = [
            (line, target_scores_during(run, metric))
            for metric, line in ((TARGET_METRIC, "-"), ("accuracy_sampled", "--"))
        ]
        if any(curve is not None for _, curve in curves):
            scores[run.label] = [(line, curve) for line, curve in curves if curve is not None]
    rows = 4 if scores else 3
    figure, axes = new_figure((7.0, 2.5 * rows), rows=rows)
    states_ax, kind_ax, length_ax = axes[:3]
    for run in with_kl:
        style, steps = styles[run.label], run.drift["step"].to_numpy(dtype=float)
        for ax, solid, dashed in (
            (states_ax, "teacher_kl/exact", "teacher_kl/exact_fixed"),
            (kind_ax, "teacher_kl/exact_number", "teacher_kl/exact_other"),
        ):
            if column(run.drift, solid) is not None:
                plot_curve(ax, steps, column(run.drift, solid), style, run.label, smooth=False)
            if column(run.drift, dashed) is not None:
                ax.plot(steps, column(run.drift, dashed), color=style["color"], linestyle="--", linewidth=1.0)
        plot_curve(length_ax, steps, column(run.drift, "probe_tokens"), style, run.label, smooth=False)
    states_ax.set_title("Reverse KL to the teacher, probe states: own (solid), step-0 (dashed)")
    kind_ax.set_title("... by token: number tokens (solid), the rest (dashed)")
    length_ax.set_title("Probe completion length (tokens)")
    for ax in (states_ax, kind_ax):
        ax.set_ylabel("nats per token")
    axes[-1].set_xlabel("optimizer step")
    finish_legend(states_ax)
    if scores:
        score_ax = axes[3]
        for label, curves in scores.items():
            style = styles[label]
            for line, curve in curves:
                score_ax.plot(*curve, color=style["color"], linestyle=line, marker=style["marker"], markersize=3,
                              label=label if line == "-" else None)  # fmt: skip
        score_ax.set_title("Target during training: greedy (solid), temperature-1 samples (dashed)")
        score_ax.set_ylabel("accuracy")
        finish_legend(score_ax)
    return save(figure, out_dir, "teacher_disagreement.png")


def plot_teacher_kl_by_prefix(runs, styles, out_dir) -> Path | None:
    """Reverse KL to the teacher on the probe states by prefix-length bin, at the first probe step (dashed) and the
    last (solid): which parts of the answers still disagree."""
    with_bins = [run for run in runs if run.drift is not None and "teacher_kl/exact_by_prefix" in run.drift]
    if not with_bins:
        return None
    figure, (ax,) = new_figure()
    num_bins = 1
    for run in with_bins:
        lines = [b for b in run.drift["teacher_kl/exact_by_prefix"] if isinstance(b, list) and b]
        if not lines:
            continue
        num_bins = max(num_bins, len(lines[0]), len(lines[-1]))
        for bins, line, label in ((lines[0], "--", None), (lines[-1], "-", run.label)):
            kl = np.array([np.nan if mean is None else mean for _, mean in bins], dtype=float)
            ax.plot(np.arange(len(kl)), kl, color=styles[run.label]["color"], linestyle=line, marker="o",
                    markersize=3, label=label)  # fmt: skip
    ax.set_xticks(range(num_bins), [prefix_bin_label(k) for k in range(num_bins)], fontsize=8)
    ax.set_xlabel("prefix length (tokens since the prompt)")
    ax.set_ylabel("reverse KL to the teacher (nats per token)")
    ax.set_title("Disagreement by position: first probe step (dashed), last (solid)")
    finish_legend(ax)
    return save(figure, out_dir, "teacher_kl_by_prefix.png")


def plot_reward_signal(runs, styles, out_dir) -> Path | None:
    """Where GRPO's reward signal is: the share of each step's prompt groups whose rewards differ (the others give
    every token a zero advantage) and of supervised tokens with a non-zero advantage; then, over the whole run, that
    share of groups by the problem's `solution_steps` (when `groups.jsonl` has it)."""
    from .records import has_spread  # imports torch: only when a run has reward groups

    with_groups = [run for run in runs if column(run.steps, "reward_groups/spread_frac") is not None]
    if not with_groups:
        return None
    figure, (steps_ax, difficulty_ax) = new_figure(TALL_FIGURE_SIZE, rows=2, sharex=False)
    difficulties = set()
    for run in with_groups:
        steps = run.steps["step"].to_numpy(dtype=float)
        style = styles[run.label]
        plot_curve(steps_ax, steps, column(run.steps, "reward_groups/spread_frac"), style, f"{run.label}: groups")
        tokens = column(run.steps, "weight/nonzero_frac")
        if tokens is not None:
            steps_ax.plot(steps, tokens, color=style["color"], linestyle=":", label=f"{run.label}: tokens")
        groups = read_jsonl(run.path / "statelens" / "groups.jsonl", run.notes)
        if groups is not None and "solution_steps" in groups:
            groups = groups.dropna(subset=["solution_steps"])
            groups["spread"] = [has_spread(rewards) for rewards in groups["rewards"]]
            by_steps = groups.groupby("solution_steps")["spread"].agg(["mean", "size"])
            difficulty_ax.plot(by_steps.index.to_numpy(dtype=float), by_steps["mean"].to_numpy(), color=style["color"],
                               marker=style["marker"], label=run.label)  # fmt: skip
            for x, share, size in zip(by_steps.index, by_steps["mean"], by_steps["size"]):
                difficulty_ax.annotate(
                    f"n={int(size)}", (x, share), fontsize=7, xytext=(3, 3), textcoords="offset points"
                )
            difficulties.update(int(x) for x in by_steps.index)
    steps_ax.set_title("Groups whose rewards differ (solid), tokens with an advantage (dotted)")
    steps_ax.set_ylabel("share")
    steps_ax.set_xlabel("optimizer step")
    steps_ax.set_ylim(-0.02, 1.02)
    finish_legend(steps_ax)
    difficulty_ax.set_title("Groups whose rewards differ, by difficulty, over the whole run")
    difficulty_ax.set_xticks(sorted(difficulties))
    difficulty_ax.set_xlabel("solution_steps (lines of the reference solution that compute)")
    difficulty_ax.set_ylabel("share of groups")
    difficulty_ax.set_ylim(-0.02, 1.02)
    finish_legend(difficulty_ax)
    return save(figure, out_dir, "reward_signal.png")


def plot_sample_efficiency(runs, styles, out_dir, base_scores: dict | None) -> Path | None:
    curves = {run.label: c for run in runs if (c := sample_efficiency_curve(run, base_scores)) is not None}
    xlabel = "supervised tokens so far (ledger supervised_tokens, all ranks)"
    title = "Sample efficiency: target score vs supervised tokens"
    return plot_target_against(curves, styles, out_dir, xlabel, title, "sample_efficiency.png")


def plot_blocks(runs: list[Run], out_dir: Path, base_scores: dict | None) -> list[Block]:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return [
            Block("heading", "Plots"),
            note("No plots: matplotlib is not installed (`pip install 'trl-statelens[plots]'`)."),
        ]
    palette = "tab10" if len(runs) <= 10 else "tab20"
    from matplotlib import colormaps

    markers = "osD^vP*Xh<>p"
    # colour, marker shape and a line width that shrinks with the run's index: where two runs' curves or points
    # coincide (a stock baseline matching its StateLens run), the earlier one still shows around the later one
    last = max(len(runs) - 1, 1)
    styles = {
        run.label: {
            "color": colormaps[palette](index % 20),
            "marker": markers[index % len(markers)],
            "width": 1.5 + 1.5 * (last - index) / last if len(runs) > 1 else 1.8,
        }
        for index, run in enumerate(runs)
    }
    plots = [
        (
            "State NLL and off-policy gap over steps",
            lambda: plot_state_curves(runs, styles, out_dir),
            "no run has per-step state records (`statelens/steps.jsonl`)",
        ),
        (
            "Prefix lengths of supervised tokens",
            lambda: plot_prefix_histograms(runs, styles, out_dir),
            "no run has `prefix_len_hist` in `statelens/steps.jsonl`",
        ),
        (
            "Probe drift over steps",
            lambda: plot_drift(runs, styles, out_dir),
            "no run has probe drift (`statelens/drift.jsonl`)",
        ),
        (
            "Target score vs retention",
            lambda: plot_tradeoff(runs, styles, out_dir, base_scores),
            "it needs base scores and at least one run with an `after` evaluation",
        ),
        (
            "Teacher KL over steps",
            lambda: plot_teacher_kl(runs, styles, out_dir),
            "no run logged `teacher_kl/sampled` (only on-policy distillation runs do)",
        ),
        (
            "Teacher KL and supervised tokens per teacher",
            lambda: plot_teachers(runs, styles, out_dir),
            "no run has several teachers",
        ),
        (
            "Target score vs training compute",
            lambda: plot_compute(runs, styles, out_dir, base_scores),
            "no run has `compute` in results.json and target scores during training (--target_eval_steps N)",
        ),
        (
            "Target score vs teacher tokens",
            lambda: plot_teacher_tokens(runs, styles, out_dir, base_scores),
            "no run has a teacher in its ledger and target scores during training (--target_eval_steps N)",
        ),
        (
            "Where the student disagrees with its teacher",
            lambda: plot_teacher_disagreement(runs, styles, out_dir),
            "no run has teacher_kl/exact in `statelens/drift.jsonl` (a teacher in the trainer's process and probes)",
        ),
        (
            "Where along the answer the student disagrees with its teacher",
            lambda: plot_teacher_kl_by_prefix(runs, styles, out_dir),
            "no run has teacher_kl/exact_by_prefix in `statelens/drift.jsonl`",
        ),
        (
            "Where GRPO's reward signal is",
            lambda: plot_reward_signal(runs, styles, out_dir),
            "no run has `reward_groups/spread_frac` in `statelens/steps.jsonl` (StateLens GRPO runs do)",
        ),
        (
            "Target score vs supervised tokens",
            lambda: plot_sample_efficiency(runs, styles, out_dir, base_scores),
            "no run with a state ledger was scored on the target during training (recipes: --target_eval_steps N)",
        ),
    ]
    blocks = [
        Block("heading", "Plots"),
        Block(
            "text",
            "Each run keeps its colour in every plot; earlier runs are drawn wider, so a run that coincides with "
            f"a later one still shows around it. Per-step curves longer than {SMOOTH_ABOVE_POINTS} steps are "
            "drawn faint, with a moving average over 2% of the steps on top; probe drift is drawn as measured.",
        ),
    ]
    for title, draw, missing in plots:
        path = draw()
        blocks.append(Block("image", title, image=path) if path else note(f"No plot '{title}': {missing}."))
        if path is not None and path.name == "sample_efficiency.png":
            blocks.append(
                Block(
                    "text",
                    "How many states each method needed: the target score at each evaluation during training against "
                    "the tokens supervised up to that step (the ledger's `supervised_tokens`; a state supervised "
                    "twice counts twice). The first point is the `before` score (else the base row's), the last the "
                    "`after` score.",
                )
            )
    return blocks


def run_notes(runs: list[Run]) -> list[Block]:
    blocks = [Block("heading", "Runs")]
    rows = []
    for run in runs:
        results = run.results or {}
        rows.append(
            [
                run.label,
                str(results.get("recipe", MISSING)),
                str(results.get("trainer", MISSING)),
                str(results.get("baseline", MISSING)),
                f"`{run.path}`",
                "; ".join(run.notes) or "complete",
            ]
        )
    blocks.append(Block("table", header=["Run", "Recipe", "Trainer", "Baseline", "Folder", "Notes"], rows=rows))
    return blocks


def markdown(blocks: list[Block]) -> str:
    lines = ["# StateLens report", ""]
    for block in blocks:
        if block.kind == "heading":
            lines += [f"## {block.text}", ""]
        elif block.kind == "text":
            lines += [block.text, ""]
        elif block.kind == "note":
            lines += [f"> **Note:** {block.text}", ""]
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


# ----- entry points ------------------------------------------------------------------------------------------------
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
    blocks = (
        table2(runs, base_scores, base_source)
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
