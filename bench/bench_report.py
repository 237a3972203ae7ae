"""Benchmark of `statelens report`: 6 synthetic runs of 1000 logged steps each (target: under 30 s).

    .venv/bin/python bench/bench_report.py [--runs 6] [--steps 1000] [--keep DIR]

Writes the run folders in a temporary directory (the recipes' layout: results.json, statelens/steps.jsonl,
statelens/drift.jsonl every 10 steps, log_history.json), times `write_report` alone (not the imports or the data
generation), prints the time and writes `bench/results/report.json`. `--keep DIR` leaves the report there to look at.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from trl_statelens.evaluation import retention_summary
from trl_statelens.reports.pages import write_report

RESULTS_FILE = Path(__file__).parent / "results" / "report.json"
PROBE_EVERY = 10
# (run name, recipe, trainer, baseline, state-source shares or None for a stock run without steps.jsonl, teacher)
RUN_KINDS = [
    ("mild-sft", "sft", "StateLensSFTTrainer", "statelens", {"dataset": 1.0}, False),
    ("stress-sft", "sft", "StateLensSFTTrainer", "statelens", {"dataset": 1.0}, False),
    ("stock-sft", "sft", "SFTTrainer", "stock", None, False),
    ("opd-from-mild", "opd", "OnPolicyDistillTrainer", "statelens", {"learner": 0.8, "teacher": 0.2}, True),
    ("opd-from-stress", "opd", "OnPolicyDistillTrainer", "statelens", {"learner": 1.0}, True),
    ("grpo", "grpo", "StateLensGRPOTrainer", "statelens", {"learner": 1.0}, False),
]


def evaluation(rng, gsm8k, truthfulqa, mmlu, jitter=0.0):
    scores = {
        task: round(float(score + jitter * rng.standard_normal()), 3)
        for task, score in (("gsm8k", gsm8k), ("truthfulqa", truthfulqa), ("mmlu", mmlu))
    }
    return {"model": "lab/base", "scores": scores, "metrics": {t: {"accuracy": s} for t, s in scores.items()}}


def step_lines(rng, num_steps, sources, teacher):
    """Per-step aggregates with a decaying trend plus noise, built column by column."""
    steps = np.arange(1, num_steps + 1)
    decay = np.exp(-steps / (num_steps / 3))
    tokens = rng.integers(2000, 4000, num_steps).astype(float)
    nll = 1.0 + 1.5 * decay + 0.08 * rng.standard_normal(num_steps)
    entropy = 1.1 + 0.3 * decay + 0.05 * rng.standard_normal(num_steps)
    teacher_kl = 0.1 + 0.9 * decay + 0.05 * rng.standard_normal(num_steps)
    hist = rng.poisson(lam=[20, 40, 90, 180, 300, 260, 120, 30], size=(num_steps, 8))
    lines = []
    for i, step in enumerate(steps):
        line = {
            "step": int(step),
            "epoch": float(step / num_steps),
            "supervised_tokens": tokens[i],
            "sequences": 32.0,
            "state_nll": nll[i],
            "state_entropy": entropy[i],
            "offpolicy_gap": nll[i] - entropy[i],
            **{f"source_frac/{s}": sources.get(s, 0.0) for s in ("dataset", "learner", "teacher")},
            "prefix_len/p10": 3.0,
            "prefix_len/p50": 24.0,
            "prefix_len/p90": 70.0,
            "prefix_len/mean": 30.0,
            "prefix_len/max": 140.0,
            "weight/mean": 1.0,
            "weight/abs_mean": 1.0,
            "weight/positive_frac": 1.0,
            "prefix_len_hist": hist[i].tolist(),
        }
        if teacher:
            line["teacher_kl/supervised"] = teacher_kl[i]
            line["teacher_nll"] = 1.4
        lines.append(line)
    return lines


def drift_lines(rng, num_steps, scale):
    probe_steps = np.arange(0, num_steps + 1, PROBE_EVERY)
    growth = scale * np.sqrt(probe_steps / num_steps)
    return [
        {
            "step": int(step),
            "mmd": float(g),
            "centroid": float(10 * g),
            "sliced_wasserstein": float(5 * g + 0.001 * rng.random()),
            "jaccard": float(min(1.0, 20 * g)),
            "num_states": 256,
        }
        for step, g in zip(probe_steps, growth)
    ]


def write_runs(root: Path, num_runs: int, num_steps: int) -> list[Path]:
    rng = np.random.default_rng(0)
    base = evaluation(rng, 0.448, 0.300, 0.436)
    folders = []
    for index in range(num_runs):
        name, recipe, trainer, baseline, sources, teacher = RUN_KINDS[index % len(RUN_KINDS)]
        name = name if index < len(RUN_KINDS) else f"{name}-{index}"
        folder = root / name
        (folder / "statelens").mkdir(parents=True)
        after = evaluation(rng, 0.47, 0.28, 0.42, jitter=0.02)
        drift = drift_lines(rng, num_steps, scale=0.008 + 0.002 * index)
        results = {
            "recipe": recipe,
            "trainer": trainer,
            "baseline": baseline,
            "run_name": name,
            "model": "lab/base",
            "teacher": "lab/mild-sft" if teacher else None,
            "seed": 0,
            "before": base,
            "after": after,
            "retention": retention_summary(base, after),
            "final_drift": {k: drift[-1][k] for k in ("mmd", "centroid", "sliced_wasserstein", "jaccard")},
            "train_seconds": 100.0,
        }
        (folder / "results.json").write_text(json.dumps(results))
        log_history = [{"step": s, "loss": 2.0 / s**0.3} for s in range(1, num_steps + 1)]
        if sources is not None:
            steps = step_lines(rng, num_steps, sources, teacher)
            (folder / "statelens" / "steps.jsonl").write_text("".join(json.dumps(line) + "\n" for line in steps))
            log_history = [{**entry, **{f"statelens/{k}": v for k, v in line.items() if k != "prefix_len_hist"}}
                           for entry, line in zip(log_history, steps)]  # fmt: skip
        (folder / "statelens" / "drift.jsonl").write_text("".join(json.dumps(line) + "\n" for line in drift))
        (folder / "log_history.json").write_text(json.dumps(log_history))
        folders.append(folder)
    return folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--keep", default=None, help="copy the report folder here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folders = write_runs(Path(tmp) / "runs", args.runs, args.steps)
        out = Path(tmp) / "report"
        started = time.perf_counter()
        write_report(folders, out)
        seconds = time.perf_counter() - started
        if args.keep:
            shutil.copytree(out, args.keep, dirs_exist_ok=True)

    print(f"report on {args.runs} runs x {args.steps} steps: {seconds:.2f} s (target: under 30 s)")
    RESULTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_FILE.write_text(json.dumps({"seconds": round(seconds, 3), "runs": args.runs, "steps": args.steps}) + "\n")


if __name__ == "__main__":
    main()
