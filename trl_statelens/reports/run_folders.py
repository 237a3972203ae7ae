"""Run folders as the recipes write them, read for `statelens report` (:class:`Run`, :func:`load_run`), and the
numbers and curves the report's tables and plots take from them (see :mod:`.pages` for what a folder holds)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ..guards import GUARDS_FILE
from ..provenance import read_run_provenance

TARGET_TASK = "gsm8k"
TARGET_METRIC = "accuracy_strict"  # GSM8KTask's primary metric, when results.json does not name it
RUN_FOLDER_CONTENTS = (
    "a run folder holds results.json, statelens/steps.jsonl, statelens/drift.jsonl and/or log_history.json, "
    "as written by the recipes"
)


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
    provenance: dict | None = None  # `statelens/provenance.json`, else results.json's `provenance`
    guard_firings: list[dict] | None = None  # `statelens/guards.jsonl`: [] when the guards watched and none fired

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
        provenance=read_run_provenance(path),
        guard_firings=read_guard_firings(path),
    )


def read_guard_firings(path: Path) -> list[dict] | None:
    """The guard firings a run recorded (`statelens/guards.jsonl`, one per line; docs/guards.md), `[]` when its guards
    watched and none fired, `None` without the file (guards off, or a run from before them)."""
    record = path / "statelens" / GUARDS_FILE
    if not record.is_file():
        return None
    firings = []
    for line in record.read_text(encoding="utf-8").splitlines():
        try:
            firings.append(json.loads(line))
        except json.JSONDecodeError:  # blank, or the torn last line of a run killed while writing it
            continue
    return firings


def make_labels_unique(runs: list[Run]) -> None:
    """Two runs with the same run name get their folder names added, so legends and rows tell them apart."""
    counts = pd.Series([run.label for run in runs]).value_counts()
    for run in runs:
        if counts[run.label] > 1:
            run.label = f"{run.label} ({run.path})"


# ----- numbers -------------------------------------------------------------------------------------------------------
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


# ----- curves against what a run spent -------------------------------------------------------------------------------
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
