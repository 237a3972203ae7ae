"""The report's view of how completions end (`lens.endings`): per step, the share of rollouts cut at the length limit,
ended with the end token and repeating themselves, and what the teacher's signal says at the end.

A run recorded before the ledger held `ends/*` still shows most of it: TRL's `completions/clipped_ratio` is the cut
share (a rollout not cut ended with the end token, training using no stop strings), and the ledger's sampled
sequences (`states.jsonl`) give the repeat share and the teacher's log-prob of the end tokens they sampled.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ..answers import repeats_itself
from .figures import METRIC_COLORS, metrics_and_runs_legend, new_figure, save
from .guards import mark_guard_steps
from .run_folders import Run, column

# how an end-of-sequence token reads in a ledger sequence recorded before its `end` field: `<|im_end|>`, `</s>`, ...
SPECIAL_TOKEN = re.compile(r"^<[|/]?[A-Za-z_]+[|]?>$")


def sampled_sequences(run: Run) -> list[dict]:
    path = Path(run.path) / "statelens" / "states.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def sample_ended(sample: dict) -> bool:
    if "end" in sample:
        return sample["end"] == "end_token"
    return bool(sample.get("tokens")) and SPECIAL_TOKEN.match(sample["tokens"][-1].strip()) is not None


def ending_curves(run: Run) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """`{name: (steps, values)}` for each ending curve the run has."""
    curves = {}
    steps = run.steps
    if column(steps, "ends/length_limit") is not None:
        for name in ("ends/length_limit", "ends/end_token", "ends/repeats", "teacher_end/logp_at_student_ends",
                     "teacher_end/advantage_after_answer_go_on", "teacher_end/advantage_after_answer_end"):  # fmt: skip
            values = column(steps, name)
            if values is not None:
                curves[name] = (steps["step"].to_numpy(dtype=float), values)
    elif run.log_history:
        logged = [e for e in run.log_history if "completions/clipped_ratio" in e and "step" in e]
        if logged:
            x = np.array([e["step"] for e in logged], dtype=float)
            cut = np.array([e["completions/clipped_ratio"] for e in logged], dtype=float)
            curves["ends/length_limit"], curves["ends/end_token"] = (x, cut), (x, 1.0 - cut)
    samples = sampled_sequences(run)
    if samples and "ends/repeats" not in curves:
        by_step: dict[int, list[bool]] = {}
        for sample in samples:
            by_step.setdefault(sample["step"], []).append(repeats_itself(sample.get("completion", "")))
        x = np.array(sorted(by_step), dtype=float)
        curves["sampled repeats"] = (x, np.array([np.mean(by_step[int(s)]) for s in x]))
    if samples and "teacher_end/logp_at_student_ends" not in curves:
        at_ends = [(s["step"], s["teacher_logp"][-1]) for s in samples if s.get("teacher_logp") and sample_ended(s)]
        if at_ends:
            curves["sampled teacher_end/logp_at_student_ends"] = tuple(np.array(v, dtype=float) for v in zip(*at_ends))
    drift = run.drift
    for name in ("teacher_end/logp_after_answer", "student_end/logp_after_answer", "ends_repeats"):
        values = column(drift, name)
        if values is not None:
            curves[f"probes {name}"] = (drift["step"].to_numpy(dtype=float), values)
    return curves


# curve -> what it is; each curve has its colour (METRIC_COLORS in this order), each run its line style. The ledger's
# sampled sequences give a few points, drawn without a line.
SHARES = {
    "ends/length_limit": "cut at the limit",
    "ends/end_token": "ended (end token)",
    "ends/repeats": "repeating",
    "sampled repeats": "repeating (ledger samples)",
    "probes ends_repeats": "probes repeating",
}
TEACHER_VIEW = {
    "teacher_end/logp_at_student_ends": "teacher log-prob of the student's end tokens",
    "sampled teacher_end/logp_at_student_ends": "teacher log-prob of the end tokens (ledger samples)",
    "teacher_end/advantage_after_answer_go_on": "advantage of going on after #### N",
    "teacher_end/advantage_after_answer_end": "advantage of ending after #### N",
    "probes teacher_end/logp_after_answer": "probes: teacher log-prob of ending after #### N",
    "probes student_end/logp_after_answer": "probes: student log-prob of ending after #### N",
}


def plot_endings(runs, styles, out_dir: Path) -> Path | None:
    """Two panels over steps: how rollouts end (and repeat), and the teacher's signal at the end. Colour: the metric;
    line style and marker: the run."""
    curves = {run.label: ending_curves(run) for run in runs}
    curves = {label: c for label, c in curves.items() if c}
    if not curves:
        return None
    figure, (top, bottom) = new_figure(size=(7.0, 6.5), rows=2)
    for panel, kinds in ((top, SHARES), (bottom, TEACHER_VIEW)):
        drawn, runs_drawn = {}, {}  # for the legend: what -> (colour, points only); label -> the run's style
        for name, color in zip(kinds, METRIC_COLORS):
            what, points_only = kinds[name], name.startswith("sampled ")
            for label, run_curves in curves.items():
                if name not in run_curves:
                    continue
                x, y = run_curves[name]
                style = styles[label]
                # markers on curves too: a value logged only on some steps (NaN between) is an isolated point
                panel.plot(x, y, color=color, linestyle="none" if points_only else style["line"],
                           marker=style["marker"], markersize=5 if points_only else 3,
                           linewidth=style["width"], label=f"{label}: {what}")  # fmt: skip
                drawn[what], runs_drawn[label] = (color, points_only), style
        metrics_and_runs_legend(panel, drawn, {label: runs_drawn[label] for label in curves if label in runs_drawn})
    for run in runs:  # the colours here are the metrics': the guards' steps in grey
        if run.label in curves:
            mark_guard_steps((top, bottom), run, {"color": "dimgray"})
    top.set_ylabel("share of rollouts")
    top.set_ylim(-0.02, 1.02)
    top.set_title("How rollouts end, and how many repeat themselves")
    bottom.axhline(0.0, color="gray", linewidth=0.8, linestyle="--")
    bottom.set_ylabel("nats")
    bottom.set_xlabel("optimizer step")
    bottom.set_title("The teacher's view of the end (advantage > 0: pushed that way)")
    return save(figure, out_dir, "endings.png")
