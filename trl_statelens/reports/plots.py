"""The report's plots: one PNG per question, drawn with matplotlib on its Agg canvas (no pyplot), each returned as a
:class:`~.tables.Block` (or a note saying why it is missing)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .endings import plot_endings
from .figures import (
    METRIC_COLORS,
    RUN_LINES,
    SMOOTH_ABOVE_POINTS,
    TALL_FIGURE_SIZE,
    finish_legend,
    metrics_and_runs_legend,
    new_figure,
    plot_curve,
    save,
)
from .guards import MARKS_TEXT, guard_steps, mark_guard_steps
from .run_folders import (
    TARGET_METRIC,
    TARGET_TASK,
    Run,
    column,
    compute_curve,
    prefix_bin_label,
    prefix_histogram,
    read_jsonl,
    sample_efficiency_curve,
    target_scores_during,
    teacher_curves,
    teacher_kl_curve,
    teacher_names,
    teacher_tokens_curve,
)
from .tables import SCORE_COLUMNS, Block, note

TEACHER_LINES = ("-", "--", ":", "-.")  # one per teacher of a run with several, in its colour


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
        mark_guard_steps((nll_ax, gap_ax), run, styles[run.label])
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
        mark_guard_steps(axes, run, styles[run.label])
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
    from ..evaluation import retention_summary

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
    curves = {run.label: (run, curve) for run in runs if (curve := teacher_kl_curve(run)) is not None}
    if not curves:
        return None
    figure, (ax,) = new_figure()
    for label, (run, (steps, values)) in curves.items():
        plot_curve(ax, steps, values, styles[label], label)
        mark_guard_steps((ax,), run, styles[label])
    ax.axhline(0.0, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("sampled reverse KL (nats per token)")
    ax.set_title("Sampled reverse KL to the teacher: log p_student - log p_teacher")
    finish_legend(ax)
    return save(figure, out_dir, "teacher_kl.png")


def plot_alignment(runs, styles, out_dir) -> Path | None:
    """From a teacher of another tokenizer, per step: the share of supervised tokens whose teacher log-prob is exact
    (`alignment/exact`) and the same among tokens that spell a digit (`alignment/exact/numbers`). Colour: the metric;
    line style: the run."""
    logged = {
        run.label: entries for run in runs if (entries := [e for e in run.log_history or [] if "alignment/exact" in e])
    }
    if not logged:
        return None
    figure, (ax,) = new_figure()
    metrics = {"alignment/exact": "all tokens", "alignment/exact/numbers": "digits"}
    for label, entries in logged.items():
        steps = np.array([e["step"] for e in entries])
        for (key, kind), color in zip(metrics.items(), METRIC_COLORS):
            values = np.array([e.get(key, np.nan) for e in entries], dtype=float)
            keep = np.isfinite(values)
            style = styles[label]
            ax.plot(steps[keep], values[keep], color=color, linestyle=style["line"], marker=style["marker"],
                    markersize=3, label=f"{label}: {kind}")  # fmt: skip
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("share of supervised tokens")
    ax.set_title("Teacher of another tokenizer: where its log-probs are exact")
    metric_colors = {kind: (color, False) for kind, color in zip(metrics.values(), METRIC_COLORS)}
    metrics_and_runs_legend(ax, metric_colors, {label: styles[label] for label in logged})
    return save(figure, out_dir, "alignment.png")


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
        mark_guard_steps((states_ax, kind_ax, length_ax), run, style)
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
    from ..lens.records import has_spread  # imports torch: only when a run has reward groups

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
        mark_guard_steps((steps_ax,), run, style)
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
            "line": RUN_LINES[index % len(RUN_LINES)],
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
            "Where a teacher of another tokenizer is exact",
            lambda: plot_alignment(runs, styles, out_dir),
            "no run logged `alignment/exact` (a teacher whose tokenizer differs from the student's)",
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
            "How rollouts end, and the teacher's view of the end",
            lambda: plot_endings(runs, styles, out_dir),
            "no run has `ends/*` in `statelens/steps.jsonl` or TRL's `completions/clipped_ratio` (sampling trainers)",
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
            "a later one still shows around it. Where a panel draws several metrics of each run (how rollouts end, "
            "where a teacher of another tokenizer is exact), the colour is the metric and the line style the run, "
            f"as its legend says. Per-step curves longer than {SMOOTH_ABOVE_POINTS} steps are "
            "drawn faint, with a moving average over 2% of the steps on top; probe drift is drawn as measured.",
        ),
    ]
    if any(guard_steps(run) for run in runs):
        blocks.append(Block("text", MARKS_TEXT))
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
