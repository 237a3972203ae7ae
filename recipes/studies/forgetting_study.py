"""Forecasting forgetting from states (issue 29): a grid of short lab runs (SFT, GRPO, OPD) from the lab base, the
candidate statistics of each at 10%, 25% and 100% of its steps, and how well each forecasts the run's Forgetting.

    make forgetting-study        # = python recipes/studies/forgetting_study.py --jobs 2 --out runs/forgetting-study
    python recipes/studies/forgetting_study.py --dry_run                  # the grid and its estimated time, nothing run
    python recipes/studies/forgetting_study.py --smoke --model_name_or_path MODEL --out /tmp/fs   # the CI test
    python recipes/studies/forgetting_study.py --analyse_only --out runs/forgetting-study --to docs/study/forgetting

The plan (grid, statistics, analysis, decision rule) is pre-registered in STUDY.md, "Forecasting forgetting from
states: pre-registered plan". Every run is a recipe (sft.py, grpo.py, opd.py) with its lab config and the grid's
flags; a run whose `results.json` exists is skipped, so an interrupted study continues where it stopped. Runs skip
the before evaluation: Forgetting and Retention are taken against the study's own base evaluation (`<out>/base`). Each run
saves its model (weights only) every `probe_steps` steps so the parameter distance from the base can be read at
10% and 25%; those checkpoints are deleted once the run's statistics are written (`<run>/forecast_stats.json`).

Outputs: `<out>/forecast.json` (every run's statistics and Forgetting, and the table), `<out>/forecast.md`
(the table, the fitted law), `<out>/forgetting_vs_base_kl.png`, `<out>/forgetting_vs_param_distance.png` and
`<out>/calibration.json` (the lines Forgetting ~ a + b param_distance and Retention ~ a + b param_distance at each
time point with bootstrap samples: `trl_statelens/lens/forgetting_calibration.json`, ForgettingForecast's default, is this
file from the study's 31 runs). Re-analyse finished runs without running anything: `--analyse_only`.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from study_lab import run  # the lab study's runner: logs the command, its time, and stops on a failure

from trl_statelens.evaluation import RETENTION_TASKS

RECIPES = Path(__file__).resolve().parents[1]
CONFIGS = RECIPES / "configs" / "lab"
FRACTIONS = {"10%": 0.10, "25%": 0.25, "100%": 1.00}
STATISTICS = ["base_kl", "base_kl_topk", "mmd", "offpolicy_gap", "state_nll_change", "supervised_tokens",
              "teacher_kl", "param_distance"]  # fmt: skip
METHODS = ("sft", "grpo", "opd")
BOOTSTRAP_SAMPLES = 2000
MIN_RUNS = 5  # fewer runs with a statistic than this: no correlation is reported for that cell
CALIBRATION_SAMPLES = 200  # bootstrap (a, b) pairs per line in calibration.json (ForgettingForecast's interval)
CALIBRATION_STATISTIC = "param_distance"  # the statistic the pre-registered rule shipped the callback on

# ----- the grid ----------------------------------------------------------------------------------------------------
# Every run: (name, recipe, lab config, steps, seed, flags). {name} in a flag is that run's folder (a teacher built
# inside the study first). SFT runs over the stress run's 320 problems are 20 steps an epoch at batch 16.
SFT320 = ["--train_size", "320"]
GRPO8 = ["--num_generations", "8"]  # these arms predate issue 35, whose rule moved grpo.yaml to 16 samples a prompt


# OPD centre: the issue-25 rule's per-step settings (divergence, jsd_beta 1, num_generations 1, lr 3e-4), shortened
# to 20 steps of 16 prompts (the rule's run is 75 steps of 32) so the whole study fits in about 45 minutes.
def opd(signal="divergence", teacher="lab-teacher", learning_rate="3e-4", *extra: str) -> list[str]:
    return ["--signal", signal, "--num_generations", "1", "--learning_rate", learning_rate,
            "--per_device_train_batch_size", "16", "--teacher_model_name_or_path", teacher, *extra]  # fmt: skip


# GRPO as its lab config (8 prompts x 8 samples, temperature 0.7), 20 steps; learning rate and KL coefficient vary.
GRID = [
    # teachers of the OPD runs: the study's mild and stress SFT (built first)
    ("sft_mild", "sft", "sft.yaml", 60, 0, []),
    ("sft_stress", "sft", "stress_sft.yaml", 100, 0, []),
    # SFT: learning rate x epochs over 320 problems, from mild to well past stress (5 epochs at 1e-3)
    ("sft_e1_lr5e-4", "sft", "stress_sft.yaml", 20, 0, [*SFT320, "--learning_rate", "5e-4"]),
    ("sft_e3_lr5e-4", "sft", "stress_sft.yaml", 60, 0, [*SFT320, "--learning_rate", "5e-4"]),
    ("sft_e2_lr1e-3", "sft", "stress_sft.yaml", 40, 0, [*SFT320, "--learning_rate", "1e-3"]),
    ("sft_e8_lr1e-3", "sft", "stress_sft.yaml", 160, 0, [*SFT320, "--learning_rate", "1e-3"]),
    ("sft_e3_lr2e-3", "sft", "stress_sft.yaml", 60, 0, [*SFT320, "--learning_rate", "2e-3"]),
    ("sft_e5_lr2e-3", "sft", "stress_sft.yaml", 100, 0, [*SFT320, "--learning_rate", "2e-3"]),
    ("sft_e8_lr2e-3", "sft", "stress_sft.yaml", 160, 0, [*SFT320, "--learning_rate", "2e-3"]),
    ("sft_mild_s1", "sft", "sft.yaml", 60, 1, []),
    ("sft_stress_s1", "sft", "stress_sft.yaml", 100, 1, []),
    ("sft_e5_lr2e-3_s1", "sft", "stress_sft.yaml", 100, 1, [*SFT320, "--learning_rate", "2e-3"]),
    # GRPO: learning rate x KL coefficient (beta)
    ("grpo_lr1e-4_b0.04", "grpo", "grpo.yaml", 20, 0, [*GRPO8, "--learning_rate", "1e-4", "--beta", "0.04"]),
    ("grpo_lr1e-4_b0.04_s1", "grpo", "grpo.yaml", 20, 1, [*GRPO8, "--learning_rate", "1e-4", "--beta", "0.04"]),
    ("grpo_lr3e-4_b0.04", "grpo", "grpo.yaml", 20, 0, [*GRPO8, "--learning_rate", "3e-4", "--beta", "0.04"]),
    ("grpo_lr1e-3_b0", "grpo", "grpo.yaml", 20, 0, [*GRPO8, "--learning_rate", "1e-3", "--beta", "0.0"]),
    ("grpo_lr1e-3_b0.04", "grpo", "grpo.yaml", 20, 0, [*GRPO8, "--learning_rate", "1e-3", "--beta", "0.04"]),
    ("grpo_lr1e-3_b0.04_s1", "grpo", "grpo.yaml", 20, 1, [*GRPO8, "--learning_rate", "1e-3", "--beta", "0.04"]),
    ("grpo_lr1e-3_b0.2", "grpo", "grpo.yaml", 20, 0, [*GRPO8, "--learning_rate", "1e-3", "--beta", "0.2"]),
    # OPD: the three signals, state-source mixes, teachers of three qualities, a higher learning rate
    ("opd_div_labteacher", "opd", "opd.yaml", 20, 0, opd()),
    ("opd_div_labteacher_s1", "opd", "opd.yaml", 20, 1, opd()),
    ("opd_rkl_labteacher", "opd", "opd.yaml", 20, 0, opd("reverse_kl")),
    ("opd_cont_labteacher", "opd", "opd.yaml", 20, 0, opd("continuation")),
    ("opd_div_mildteacher", "opd", "opd.yaml", 20, 0, opd(teacher="{sft_mild}")),
    ("opd_div_stressteacher", "opd", "opd.yaml", 20, 0, opd(teacher="{sft_stress}")),
    ("opd_div_stressteacher_s1", "opd", "opd.yaml", 20, 1, opd(teacher="{sft_stress}")),
    ("opd_rkl_stressteacher", "opd", "opd.yaml", 20, 0,
     opd("reverse_kl", "{sft_stress}")),
    ("opd_div_mix_dataset", "opd", "opd.yaml", 20, 0,
     opd("divergence", "lab-teacher", "3e-4", "--state_source_mix", '{"learner": 0.5, "dataset": 0.5}')),
    ("opd_div_mix_teacher", "opd", "opd.yaml", 20, 0,
     opd("divergence", "lab-teacher", "3e-4", "--state_source_mix", '{"learner": 0.5, "teacher": 0.5}')),
    ("opd_div_lr1e-3", "opd", "opd.yaml", 20, 0, opd(learning_rate="1e-3")),
    ("opd_div_lr1e-3_s1", "opd", "opd.yaml", 20, 1, opd(learning_rate="1e-3")),
]  # fmt: skip
# Every run: no before evaluation (the base run has it), no evaluation during training, the full evaluation after
COMMON = ["--eval_before", "false", "--target_eval_steps", "0", "--lab_seed", "0", "--save_strategy", "steps",
          "--save_only_model", "true"]  # fmt: skip
# --smoke: one run per method (the OPD one taught by the study's own SFT run), 2 steps each, three items per evaluation
# task (no lab-teacher: the model is a test model)
SMOKE_RUNS = ["sft_stress", "grpo_lr1e-4_b0.04", "opd_div_stressteacher"]
SMOKE_STEPS = 2
SMOKE_FLAGS = {
    "eval": ["--eval_limit", "3", "--eval_max_new_tokens", "8"],
    "sft": ["--per_device_train_batch_size", "4"],
    "grpo": ["--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "8"],
    "opd": ["--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "8"],
}  # fmt: skip

# ----- cost estimate (rough) ---------------------------------------------------------------------------------------
# Seconds of one optimizer step, from train_seconds / steps of the runs in runs/study-lab/seed0 and
# runs/opd-diagnosis (one torch thread each, 2-3 processes on a shared 2-core machine), less their evaluations
# during training (~5 s per 100 greedy problems, ~15 s with 4 samples each) and probes (~1.5-2 s each):
#   SFT, 16 sequences: mild 69.5 s / 60 steps -> 0.68; stress 105.6 s / 100 -> 0.78            => 0.75 s a step
#   GRPO, 64 rollouts: 149.7 s / 20 -> 6.3 s a step                                            => 0.10 s a rollout
#   OPD divergence, 32 prompts x 1: from stress 576.0 s / 75 -> 7.2; from mild 688.1 / 75 -> 8.7;
#     lab-teacher (opd-diagnosis divergence_g1) 1005.7 / 150 -> 6.0                            => 0.22 s a rollout
#   OPD reverse_kl, 32 x 1: 401.6 / 75 -> 4.8                                                  => 0.15 s a rollout
#   OPD continuation: 1.22x divergence at 8 x 4 (opd-diagnosis: 4.3 against 3.5 s a step)      => 0.27 s a rollout
PER_STEP = {"sft": 0.75, "grpo": 0.10 * 64}
PER_ROLLOUT = {"divergence": 0.22, "reverse_kl": 0.15, "continuation": 0.27}
PROBE_SECONDS = {"sft": 1.6, "grpo": 2.2, "opd": 2.4}  # 16 prompts; 64 (SFT) or 96 tokens; + base_kl/teacher_kl
RUN_OVERHEAD = 40.0  # start, model load, the evaluation after (~13 s for the base), save, report, statistics
NUM_PROBES_PER_RUN = 20  # probe_steps = steps / 20 (see probe_plan)


def flag_value(flags: list[str], name: str, default=None):
    """The last value of `--name` in `flags` (later flags win, as on the recipes' command line)."""
    value = default
    for i, flag in enumerate(flags[:-1]):
        if flag == name:
            value = flags[i + 1]
    return value


def estimate_seconds(recipe: str, steps: int, flags: list[str]) -> float:
    """A rough wall time of one run at one torch thread, from the measured runs above."""
    if recipe == "opd":
        rollouts = int(flag_value(flags, "--per_device_train_batch_size", 32))
        per_step = PER_ROLLOUT[flag_value(flags, "--signal", "divergence")] * rollouts
    else:
        per_step = PER_STEP[recipe]
    probes = min(NUM_PROBES_PER_RUN, steps)
    return steps * per_step + probes * PROBE_SECONDS[recipe] + RUN_OVERHEAD


def probe_plan(steps: int) -> tuple[dict[str, int], int]:
    """The steps at 10%, 25% and 100% of `steps` (at least step 1) and a `probe_steps` (their greatest common
    divisor) that lands a probe, and a weights-only checkpoint, on each of them."""
    at = {label: max(1, round(fraction * steps)) for label, fraction in FRACTIONS.items()}
    return at, math.gcd(*at.values())


# ----- running -----------------------------------------------------------------------------------------------------
def run_command(name, recipe, config, steps, seed, flags, out: Path, model: list[str], smoke: bool) -> list[str]:
    folders = {other: str(out / other) for other, *_ in GRID}
    flags = [flag.format(**folders) if "{" in flag and not flag.startswith('{"') else flag for flag in flags]
    if smoke:
        steps = SMOKE_STEPS
        flags = [*flags, *SMOKE_FLAGS[recipe], *SMOKE_FLAGS["eval"]]
    _, probe_steps = probe_plan(steps)
    return [sys.executable, str(RECIPES / f"{recipe}.py"), "--config", str(CONFIGS / config), *model, *COMMON,
            *flags, "--seed", str(seed), "--max_steps", str(steps), "--probe_steps", str(probe_steps),
            "--save_steps", str(probe_steps), "--output_dir", str(out / name)]  # fmt: skip


def teachers_of(flags: list[str]) -> list[str]:
    return [flag[1:-1] for flag in flags if flag.startswith("{") and not flag.startswith('{"')]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/forgetting-study")
    parser.add_argument("--model_name_or_path", default="lab", help="the base model every run starts from")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one process (one torch thread) each")
    parser.add_argument("--smoke", action="store_true", help="a few runs of two tiny steps (the CI test)")
    parser.add_argument("--dry_run", action="store_true", help="print the grid and its estimated time; run nothing")
    parser.add_argument("--runs", nargs="+", choices=[name for name, *_ in GRID], help="only these runs")
    parser.add_argument(
        "--analyse_only",
        action="store_true",
        help="read --out's forecast.json (its finished runs), write the calibration and plots to --to",
    )
    parser.add_argument("--to", help="with --analyse_only: the folder to write into (default: --out)")
    args = parser.parse_args()
    grid = [row for row in GRID if (not args.smoke or row[0] in SMOKE_RUNS) and (not args.runs or row[0] in args.runs)]
    if args.dry_run:
        print(grid_table(grid, args.jobs))
        return
    if args.analyse_only:  # reads --out, writes only into --to
        rows = json.loads((Path(args.out) / "forecast.json").read_text())["runs"]
        to = Path(args.to or args.out)
        to.mkdir(parents=True, exist_ok=True)
        calibration(rows, to / "calibration.json")
        plot_forgetting(rows, to / "forgetting_vs_base_kl.png")
        plot_param_distance(rows, to / "forgetting_vs_param_distance.png")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model = ["--model_name_or_path", args.model_name_or_path]
    eval_flags = SMOKE_FLAGS["eval"] if args.smoke else []
    base = out / "base"
    if not (base / "results.json").exists():
        print("base model evaluation", flush=True)
        base.mkdir(parents=True, exist_ok=True)
        run(
            [sys.executable, str(RECIPES / "eval.py"), "--output_dir", str(base), *model, *eval_flags],
            base / "log.txt",
        )
    failed = run_grid(grid, out, model, args.smoke, args.jobs)
    rows = [run_row(out / name, name, recipe, seed) for name, recipe, _, _, seed, _ in grid]
    rows = [row for row in rows if row is not None]
    analysis = analyse(rows)
    minutes = (time.perf_counter() - started) / 60
    (out / "forecast.json").write_text(json.dumps({"minutes": minutes, "runs": rows, **analysis}, indent=2))
    plot_forgetting(rows, out / "forgetting_vs_base_kl.png")
    plot_param_distance(rows, out / "forgetting_vs_param_distance.png")
    calibration(rows, out / "calibration.json")
    text = forecast_markdown(rows, analysis, minutes)
    (out / "forecast.md").write_text(text)
    print(text)
    if failed:
        sys.exit(f"runs failed or were skipped: {failed}; see their log.txt")


def run_grid(grid, out: Path, model: list[str], smoke: bool, jobs: int) -> list[str]:
    """Run every run not done yet, `jobs` at once (one torch thread each), a teacher before its students; write each
    finished run's statistics. Returns the runs that failed or whose teacher failed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    todo = [row for row in grid if not (out / row[0] / "results.json").exists()]
    failed, running = [], {}
    for name, *_ in grid:  # finished runs from an earlier invocation whose statistics are not written yet
        if (out / name / "results.json").exists() and not (out / name / "forecast_stats.json").exists():
            write_stats(out / name, model_path(model, out))
    while todo or running:
        for name, process in list(running.items()):
            if process.poll() is None:
                continue
            del running[name]
            if process.returncode:
                print(f"{name} failed ({process.returncode}); see {out / name / 'log.txt'}", flush=True)
                failed.append(name)
            else:
                write_stats(out / name, model_path(model, out))
                print(f"{name} done", flush=True)
        for row in list(todo):
            if len(running) >= jobs:
                break
            name, recipe, config, steps, seed, flags = row
            teachers = teachers_of(flags)
            if any(t in failed for t in teachers):
                todo.remove(row)
                failed.append(name)
                continue
            if any(not (out / t / "results.json").exists() for t in teachers):
                continue  # its teacher is still running
            todo.remove(row)
            folder = out / name
            shutil.rmtree(folder / "statelens", ignore_errors=True)  # an unfinished run starts over
            for checkpoint in folder.glob("checkpoint-*"):
                shutil.rmtree(checkpoint)
            folder.mkdir(parents=True, exist_ok=True)
            command = run_command(name, recipe, config, steps, seed, flags, out, model, smoke)
            print(f"{name}: {' '.join(command)}", flush=True)
            with (folder / "log.txt").open("w") as log:
                running[name] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        if running and not any(p.poll() is not None for p in running.values()):
            time.sleep(2)
        elif (
            not running
            and todo
            and all(any(not (out / t / "results.json").exists() for t in teachers_of(row[5])) for row in todo)
        ):  # nothing running and nothing startable: their teachers are not in this invocation's grid
            failed += [row[0] for row in todo]
            break
    return failed


def model_path(model: list[str], out: Path) -> str:
    """The base model's folder, as the base evaluation resolved it."""
    return json.loads((out / "base" / "results.json").read_text())["model"]


# ----- statistics of one run ---------------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def parameter_distance(weights: Path, base_weights: Path) -> float:
    """L2 distance over all weights (every tensor both files hold) between two safetensors files."""
    from safetensors.torch import load_file

    a, b = load_file(str(weights)), load_file(str(base_weights))
    total = sum(float((a[key].double() - b[key].double()).pow(2).sum()) for key in a.keys() & b.keys())
    return math.sqrt(total)


def write_stats(run_dir: Path, base_model: str) -> dict:
    """The candidate statistics of a finished run at 10%, 25% and 100% of its steps (`forecast_stats.json`); deletes
    the run's checkpoints afterwards."""
    results = json.loads((run_dir / "results.json").read_text())
    steps = results["global_steps"]
    at, _ = probe_plan(steps)
    drift = {line["step"]: line for line in read_jsonl(run_dir / "statelens" / "drift.jsonl")}
    ledger = read_jsonl(run_dir / "statelens" / "steps.jsonl")
    window = max(1, round(0.05 * steps))  # state_nll change: mean of the last `window` steps minus the first
    base_weights = Path(base_model) / "model.safetensors"
    stats = {}
    for label, step in at.items():
        row = {"step": step}
        probe_step = min(drift, key=lambda s: (abs(s - step), s)) if drift else None
        row["probe_step"] = probe_step  # == step by construction (probe_plan); recorded to show it
        line = drift.get(probe_step, {})
        for key in ("base_kl", "base_kl_topk", "mmd"):
            row[key] = line.get(key)
        row["teacher_kl"] = line.get("teacher_kl/exact")  # the probe's exact KL to the teacher
        upto = [entry for entry in ledger if entry["step"] <= step]
        nll = [entry["state_nll"] for entry in upto if entry.get("state_nll") is not None]
        gap = [entry["offpolicy_gap"] for entry in upto if entry.get("offpolicy_gap") is not None]
        row["offpolicy_gap"] = float(np.mean(gap)) if gap else None  # mean over the steps so far
        row["state_nll_change"] = float(np.mean(nll[-window:]) - np.mean(nll[:window])) if nll else None
        row["supervised_tokens"] = float(sum(entry.get("supervised_tokens", 0.0) for entry in upto)) if upto else None
        weights = (
            run_dir / "model.safetensors" if step == steps else run_dir / f"checkpoint-{step}" / "model.safetensors"
        )
        row["param_distance"] = (
            parameter_distance(weights, base_weights) if weights.exists() and base_weights.exists() else None
        )
        stats[label] = row
    (run_dir / "forecast_stats.json").write_text(json.dumps(stats, indent=2))
    for checkpoint in run_dir.glob("checkpoint-*"):
        shutil.rmtree(checkpoint)
    return stats


def forgetting_of(base_scores: dict, scores: dict) -> tuple[float, float | None]:
    """Forgetting `mean(base - post)` over the retention tasks, and Retention `mean(post / base)` (None when a base
    score is 0): `trl_statelens.evaluation.retention_summary`'s definitions."""
    tasks = [t for t in RETENTION_TASKS if t in base_scores and t in scores]
    forgetting = float(np.mean([base_scores[t] - scores[t] for t in tasks]))
    retention = (
        None
        if any(base_scores[t] == 0 for t in tasks)
        else float(np.mean([scores[t] / base_scores[t] for t in tasks]))
    )
    return forgetting, retention


def run_row(run_dir: Path, name: str, recipe: str, seed: int) -> dict | None:
    """One run's Forgetting, Retention, target score and statistics; None while it is not done."""
    if not (run_dir / "forecast_stats.json").exists():
        return None
    base_scores = json.loads((run_dir.parent / "base" / "results.json").read_text())["after"]["scores"]
    results = json.loads((run_dir / "results.json").read_text())
    scores = results["after"]["scores"]
    forgetting, retention = forgetting_of(base_scores, scores)
    return {"run": name, "method": recipe, "seed": seed, "steps": results["global_steps"],
            "train_seconds": results["train_seconds"], "forgetting": forgetting, "retention": retention,
            "target": scores.get("gsm8k"), "target_change": scores.get("gsm8k", math.nan) - base_scores.get("gsm8k", math.nan),
            "stats": json.loads((run_dir / "forecast_stats.json").read_text())}  # fmt: skip


# ----- analysis ----------------------------------------------------------------------------------------------------
def _ranks(rows: np.ndarray) -> np.ndarray:
    """Ranks from 1 along the last axis, ties sharing their mean rank (as `scipy.stats.rankdata`)."""
    below = (rows[..., :, None] > rows[..., None, :]).sum(-1)
    tied = (rows[..., :, None] == rows[..., None, :]).sum(-1)
    return below + (tied + 1) / 2


def _pearson(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson's correlation along the last axis; NaN where either side is constant."""
    constant = (np.ptp(x, axis=-1) == 0) | (np.ptp(y, axis=-1) == 0)
    xc, yc = x - x.mean(-1, keepdims=True), y - y.mean(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = (xc * yc).sum(-1) / np.sqrt((xc**2).sum(-1) * (yc**2).sum(-1))
    return np.where(constant, np.nan, np.clip(r, -1.0, 1.0))


def _spearman_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return _pearson(_ranks(x), _ranks(y))


def _r2_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return _pearson(x, y) ** 2


def spearman(x, y) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties at their mean rank); NaN when either
    side is constant."""
    return float(_spearman_rows(np.asarray(x, float)[None], np.asarray(y, float)[None])[0])


def r_squared(x, y) -> float:
    """R^2 of the least-squares line y ~ a + b x (for one predictor, Pearson's r squared); NaN when constant."""
    return float(_r2_rows(np.asarray(x, float)[None], np.asarray(y, float)[None])[0])


ROW_STATISTICS = {"spearman": _spearman_rows, "r2": _r2_rows}


def bootstrap_interval(x, y, statistic: str, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of `statistic` ("spearman" or "r2") over runs resampled with replacement (resamples
    where it is undefined, a constant side, are dropped)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    index = np.random.default_rng(seed).integers(0, len(x), size=(samples, len(x)))
    values = ROW_STATISTICS[statistic](x[index], y[index])
    values = values[~np.isnan(values)]
    if not len(values):
        return math.nan, math.nan
    low, high = np.percentile(values, [2.5, 97.5])
    return float(low), float(high)


def quadratic_law(x, y) -> dict:
    """Least squares of y ~ a x + b x^2 (no intercept: no movement, no forgetting), its R^2 (against the mean of y)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    design = np.stack([x, x**2], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = y - design @ np.array([a, b])
    total = ((y - y.mean()) ** 2).sum()
    return {"a": float(a), "b": float(b), "r2": float(1 - (residual**2).sum() / total) if total > 0 else math.nan}


def pairs(rows: list[dict], statistic: str, label: str, method: str | None):
    x, y = [], []
    for row in rows:
        value = row["stats"][label].get(statistic)
        if (method is None or row["method"] == method) and value is not None and not math.isnan(value):
            x.append(value)
            y.append(row["forgetting"])
    return np.array(x, float), np.array(y, float)


def analyse(rows: list[dict]) -> dict:
    """For each statistic x time point x group (pooled, sft, grpo, opd): n, Spearman and R^2 against Forgetting with
    95% bootstrap intervals over runs; the quadratic law of Forgetting on base_kl at 100%."""
    table = []
    for statistic in STATISTICS:
        for label in FRACTIONS:
            for group in ("pooled", *METHODS):
                x, y = pairs(rows, statistic, label, None if group == "pooled" else group)
                cell = {"statistic": statistic, "at": label, "group": group, "n": len(x)}
                if len(x) >= MIN_RUNS:
                    cell["spearman"] = spearman(x, y)
                    cell["spearman_ci95"] = list(bootstrap_interval(x, y, "spearman"))
                    cell["r2"] = r_squared(x, y)
                    cell["r2_ci95"] = list(bootstrap_interval(x, y, "r2"))
                else:
                    cell.update(spearman=None, spearman_ci95=None, r2=None, r2_ci95=None)
                table.append(cell)
    law = None
    x, y = pairs(rows, "base_kl", "100%", None)
    if len(x) >= 3 and x.std() > 0:
        law = quadratic_law(x, y)
        rng = np.random.default_rng(0)
        fits = [quadratic_law(x[i], y[i]) for i in rng.integers(0, len(x), size=(BOOTSTRAP_SAMPLES, len(x)))
                if x[i].std() > 0]  # fmt: skip
        for key in ("a", "b"):
            law[f"{key}_ci95"] = [float(v) for v in np.percentile([f[key] for f in fits], [2.5, 97.5])]
        law["n"] = len(x)
    return {"table": table, "law": law}


def linear_fit(x, y) -> tuple[float, float]:
    """Least squares of y ~ a + b x: (a, b)."""
    b, a = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    return float(a), float(b)


def calibration(rows: list[dict], path: Path | None = None, samples: int = CALIBRATION_SAMPLES, seed: int = 0) -> dict:
    """ForgettingForecast's calibration: at each time point, the least-squares lines Forgetting ~ a + b x and
    Retention ~ a + b x over the runs, x = `param_distance`, and `samples` bootstrap (a, b) pairs (runs resampled with
    replacement, the same resamples for both lines; resamples with a constant x are dropped, so a few fewer may be
    kept). Runs without the statistic or a Retention are left out. Written to `path` as JSON when given."""
    out = {"statistic": CALIBRATION_STATISTIC, "provenance": {
        "source": "recipes/studies/forgetting_study.py (issue 29, STUDY.md: 'Forecasting forgetting from states')",
        "lab": "lab seed 0: the lab's 1.1M-parameter Qwen3 base, full fine-tuning (SFT, GRPO, OPD)",
        "runs": len(rows), "methods": {m: sum(r["method"] == m for r in rows) for m in METHODS},
        "date": time.strftime("%Y-%m-%d"), "bootstrap_seed": seed,
        "caveat": "param_distance's scale depends on the model and its size: this calibration only holds on the lab",
    }, "time_points": {}}  # fmt: skip
    for label, fraction in FRACTIONS.items():
        used = [
            r for r in rows if r["stats"][label].get(CALIBRATION_STATISTIC) is not None and r["retention"] is not None
        ]
        x = np.array([r["stats"][label][CALIBRATION_STATISTIC] for r in used], float)
        targets = {"forgetting": np.array([r["forgetting"] for r in used], float),
                   "retention": np.array([r["retention"] for r in used], float)}  # fmt: skip
        if len(x) < 3 or np.ptp(x) == 0:
            continue
        index = np.random.default_rng(seed).integers(0, len(x), size=(samples, len(x)))
        index = index[np.ptp(x[index], axis=1) > 0]
        point = {"fraction": fraction, "n": len(x), "distance_range": [float(x.min()), float(x.max())]}
        for name, y in targets.items():
            a, b = linear_fit(x, y)
            point[name] = {"a": a, "b": b, "bootstrap": [list(linear_fit(x[i], y[i])) for i in index]}
        out["time_points"][label] = point
    if path is not None:
        Path(path).write_text(json.dumps(out, indent=1))
    return out


def fmt(value, ci=None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    text = f"{value:+.2f}"
    if ci is not None and not any(math.isnan(v) for v in ci):
        text += f" [{ci[0]:+.2f}, {ci[1]:+.2f}]"
    return text


def forecast_markdown(rows: list[dict], analysis: dict, minutes: float) -> str:
    lines = [f"Forecasting forgetting (issue 29): {len(rows)} runs; this invocation took {minutes:.1f} minutes (runs "
             "already done are skipped). Spearman's rho and R^2 of each statistic against Forgetting, with 95% "
             f"bootstrap intervals over runs ({BOOTSTRAP_SAMPLES} resamples); '-': fewer than {MIN_RUNS} runs.", "",
             "| statistic | at | group | n | Spearman [95%] | R^2 [95%] |", "|---|---|---|---|---|---|"]  # fmt: skip
    for cell in analysis["table"]:
        lines.append(f"| {cell['statistic']} | {cell['at']} | {cell['group']} | {cell['n']} | "
                     f"{fmt(cell['spearman'], cell['spearman_ci95'])} | {fmt(cell['r2'], cell['r2_ci95'])} |")  # fmt: skip
    law = analysis["law"]
    if law:
        lines += ["", f"Fitted law, pooled over {law['n']} runs: Forgetting = a * base_kl + b * base_kl^2 (at 100%), "
                  f"a = {law['a']:.4g} [{law['a_ci95'][0]:.4g}, {law['a_ci95'][1]:.4g}], b = {law['b']:.4g} "
                  f"[{law['b_ci95'][0]:.4g}, {law['b_ci95'][1]:.4g}], R^2 = {law['r2']:.3f}."]  # fmt: skip
    lines += ["", "| run | method | seed | steps | Forgetting | Retention | target | base_kl 10% | 25% | 100% |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        kl = [row["stats"][label].get("base_kl") for label in FRACTIONS]
        kl_cells = " | ".join("-" if v is None else f"{v:.4f}" for v in kl)
        retention = "-" if row["retention"] is None else f"{row['retention']:.3f}"
        target = "-" if row["target"] is None else f"{row['target']:.3f}"
        lines.append(f"| {row['run']} | {row['method']} | {row['seed']} | {row['steps']} | {row['forgetting']:+.3f} | "
                     f"{retention} | {target} | {kl_cells} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot_forgetting(rows: list[dict], path: Path) -> None:
    """Forgetting against base_kl at 100%, each run a point coloured by method, with the fitted quadratic law."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for method, colour in zip(METHODS, ("tab:blue", "tab:orange", "tab:green")):
        x, y = pairs(rows, "base_kl", "100%", method)
        ax.scatter(x, y, label=f"{method} ({len(x)})", color=colour, alpha=0.8)
    x, y = pairs(rows, "base_kl", "100%", None)
    if len(x) >= 3 and x.std() > 0:
        law = quadratic_law(x, y)
        grid = np.linspace(min(0.0, x.min()), x.max(), 100)
        ax.plot(grid, law["a"] * grid + law["b"] * grid**2, color="grey", linestyle="--",
                label=f"a x + b x^2 (R^2 {law['r2']:.2f})")  # fmt: skip
    ax.axhline(0.0, color="black", linewidth=0.5)
    ax.set_xlabel("base_kl at the end of training (per token, probe prompts)")
    ax.set_ylabel("Forgetting (mean base - post, retention tasks)")
    ax.set_title("Forgetting against KL(pi_0 || pi_theta), one point per run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_param_distance(rows: list[dict], path: Path, label: str = "100%") -> None:
    """Forgetting against param_distance at `label` of training, each run a point coloured by method, with the
    least-squares line Forgetting ~ a + b x (the line ForgettingForecast forecasts with)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for method, colour in zip(METHODS, ("tab:blue", "tab:orange", "tab:green")):
        x, y = pairs(rows, "param_distance", label, method)
        ax.scatter(x, y, label=f"{method} ({len(x)})", color=colour, alpha=0.8)
    x, y = pairs(rows, "param_distance", label, None)
    if len(x) >= 3 and x.std() > 0:
        a, b = linear_fit(x, y)
        grid = np.linspace(0.0, x.max(), 100)
        ax.plot(grid, a + b * grid, color="grey", linestyle="--",
                label=f"a + b x (R^2 {r_squared(x, y):.2f}, Spearman {spearman(x, y):+.2f})")  # fmt: skip
    ax.axhline(0.0, color="black", linewidth=0.5)
    ax.set_xlabel(f"param_distance at {label} of training (L2 norm of theta_t - theta_0)")
    ax.set_ylabel("Forgetting (mean base - post, retention tasks)")
    ax.set_title("Forgetting against the weights' distance moved, per run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def grid_table(grid, jobs: int) -> str:
    lines = ["| run | recipe | config | steps | seed | flags | probe steps (10%, 25%, 100%) | est. s |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    total, by_kind = 0.0, {}
    for name, recipe, config, steps, seed, flags in grid:
        seconds = estimate_seconds(recipe, steps, flags)
        total += seconds
        kind = recipe if recipe != "opd" else f"opd/{flag_value(flags, '--signal')}"
        by_kind.setdefault(kind, []).append(seconds)
        at, probe_steps = probe_plan(steps)
        shown = " ".join(flags).replace("|", "\\|")
        lines.append(f"| {name} | {recipe} | {config} | {steps} | {seed} | `{shown}` | every {probe_steps}: "
                     f"{', '.join(str(s) for s in at.values())} | {seconds:.0f} |")  # fmt: skip
    lines += ["", f"{len(grid)} runs; estimated {total / 60:.0f} job-minutes, about {total / 60 / jobs:.0f} minutes "
              f"with {jobs} at once (rough: from runs measured at one thread under load)."]  # fmt: skip
    for kind, seconds in by_kind.items():
        lines.append(f"- {kind}: {len(seconds)} runs, {min(seconds):.0f}-{max(seconds):.0f} s each")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
