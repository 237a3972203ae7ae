"""The report's tables (the study's Table 2, state statistics, teachers, training cost, compute to a target score,
the runs), as :class:`Block` s that :mod:`.pages` renders to Markdown and HTML."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..lens.compute import FLOPS_PARTS
from ..provenance import differences_text, provenance_differences, runs_without_provenance, short
from .run_folders import Run, column, compute_curve, final_mmd, teacher_curves, teacher_names, token_weighted_mean

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


def fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return MISSING
    return format(value, spec)


# ----- the report as blocks, rendered to Markdown and HTML -----------------------------------------------------------
@dataclass
class Block:
    kind: str  # "heading", "text", "note", "warning", "table", "image", "link" (text, then a link to `image`'s file)
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
    from ..evaluation import retention_summary  # imports torch: only when a report is written

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
                "teacher scoring FLOPs",
                "teacher writing FLOPs",
                "total FLOPs",
            ],  # fmt: skip
            rows=rows,
        ),
        Block(
            "text",
            "Teacher tokens: the positions a teacher scored or wrote over the run (the ledger's `teacher_tokens`, all "
            "ranks; prompt tokens not counted). FLOPs: 2 per parameter and token forward, 6 forward and backward, "
            "from the models' sizes and the tokens processed (`trl_statelens.lens.compute.ComputeCounter`); a served "
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


PROVENANCE_WARNING = (
    "these runs did not all run with the same code, libraries or starting weights, so their differences may come "
    "from these as well as from their settings (a last-bit change of the weights or a library moves scores)"
)


def provenance_warning(runs: list[Run], base: Run | None = None) -> tuple[list[Block], list[str]]:
    """A warning and a table of what differs between the runs' provenance (the package's commit and uncommitted
    changes, library versions, the weights of each model they share by name: `trl_statelens.provenance`), with its
    lines as plain text; nothing when they agree (a note when some runs, not all, recorded none). The `--base` run,
    whose scores the others are measured against, is compared too."""
    records = {run.label: run.provenance for run in runs}
    if base is not None:
        records[f"{base.label} (--base)"] = base.provenance
    differences, missing = provenance_differences(records), runs_without_provenance(records)
    if not differences and not missing:
        return [], []
    blocks = [Block("heading", "Provenance")]
    if differences:
        labels = list(dict.fromkeys(label for _, values in differences for label in values))
        rows = [
            [what, *(f"`{short(values[label])}`" if label in values else MISSING for label in labels)]
            for what, values in differences
        ]
        blocks += [
            Block("warning", PROVENANCE_WARNING + ": see the table."),
            Block("table", header=["Differs", *labels], rows=rows),
            Block(
                "text",
                "From each run's `statelens/provenance.json` (else `results.json`'s `provenance`), written at the "
                "start of training: the package's git commit and uncommitted changes, the library versions and a "
                "sha256 of each model's weights; a model's hashes are compared between the runs that loaded it from "
                "the same folder or hub id, hashed the same way.",
            ),
        ]
    if missing:
        blocks.append(note(f"No provenance recorded, so not compared (runs from before it was): {', '.join(missing)}"))
    return blocks, differences_text(differences)


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
