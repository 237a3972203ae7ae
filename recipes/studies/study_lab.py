"""The study on the lab, across seeds: every run of the reference study, its stock-TRL baselines, reports, and a
Table 2 with mean and spread over seeds.

    make study-lab                                   # = python recipes/studies/study_lab.py --seeds 0 1 2 --jobs 3
    python recipes/studies/study_lab.py --seeds 0 --smoke --model_name_or_path MODEL --out /tmp/smoke   # the CI test

Each run is a recipe with its lab config (recipes/configs/lab/), the seed, and teachers taken from the same seed's
SFT runs. A run whose `results.json` exists is skipped, so an interrupted study continues where it stopped.
Seeds vary post-training (data order, sampling); every seed starts from the same lab base model.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from trl_statelens.evaluation import item_scores, paired_interval, retention_summary
from trl_statelens.reports.pages import write_report

RECIPES = Path(__file__).resolve().parents[1]
CONFIGS = RECIPES / "configs" / "lab"
# Stock trainers write no state ledger, so the sample-efficiency plot has no x for them: skip their target evaluations
STOCK = ["--baseline", "stock", "--target_eval_steps", "0"]
# name, recipe, lab config, extra flags ({run} is replaced by the folder of this seed's run of that name)
RUNS = [
    ("mild_sft", "sft", "sft.yaml", []),
    ("stress_sft", "sft", "stress_sft.yaml", []),
    ("opd_from_mild_sft", "opd", "opd_from_mild_sft.yaml", ["--teacher_model_name_or_path", "{mild_sft}"]),
    ("opd_from_stress_sft", "opd", "opd_from_stress_sft.yaml", ["--teacher_model_name_or_path", "{stress_sft}"]),
    ("opd_rkl_from_stress_sft", "opd", "opd_from_stress_sft.yaml",
     ["--teacher_model_name_or_path", "{stress_sft}", "--signal", "reverse_kl"]),
    ("grpo", "grpo", "grpo.yaml", []),
    ("stock_sft", "sft", "sft.yaml", [*STOCK]),
    ("stock_opd_from_stress_sft", "opd", "opd_from_stress_sft.yaml",
     ["--teacher_model_name_or_path", "{stress_sft}", *STOCK]),
    ("stock_grpo", "grpo", "grpo.yaml", [*STOCK]),
]  # fmt: skip
# The no-teacher controls of the reverse-KL OPD arm (with `--constant_advantage`): one constant advantage on every
# supervised token in place of the teacher's (which still scores, for the lens), and a teacher equal to the student's
# start ({base_model}, the model every run starts from)
CONTROLS = [
    ("opd_rkl_constant", "opd", "opd_from_stress_sft.yaml",
     ["--teacher_model_name_or_path", "{stress_sft}", "--signal", "reverse_kl",
      "--constant_advantage", "{constant_advantage}"]),
    ("opd_rkl_teacher_is_base", "opd", "opd_from_stress_sft.yaml",
     ["--teacher_model_name_or_path", "{base_model}", "--signal", "reverse_kl"]),
]  # fmt: skip
SCORES = ("gsm8k", "truthfulqa", "mmlu")
ITEM_SCORE = {"gsm8k": "correct_strict", "truthfulqa": "mc1", "mmlu": "correct"}  # per item, in eval/*.items.jsonl
RETENTION = ("truthfulqa", "mmlu")  # the retention checks, counted item by item (`retention_flips`)
# The study's phenomena as paired comparisons (run, reference): per seed, and a bootstrap over test problems
COMPARISONS = [
    ("1. mild SFT helps the target, forgets little", "mild_sft", "base"),
    ("1. stress SFT forgets", "stress_sft", "base"),
    ("2. OPD student (divergence) vs its degraded teacher", "opd_from_stress_sft", "stress_sft"),
    ("2. OPD student (reverse_kl) vs its degraded teacher", "opd_rkl_from_stress_sft", "stress_sft"),
    ("2. stock DistillationTrainer student vs the degraded teacher", "stock_opd_from_stress_sft", "stress_sft"),
    ("2. OPD student (divergence) vs the base", "opd_from_stress_sft", "base"),
    ("2. OPD student (reverse_kl) vs the base", "opd_rkl_from_stress_sft", "base"),
    ("OPD from the mild teacher vs the base", "opd_from_mild_sft", "base"),
    ("3. GRPO helps the target, keeps retention", "grpo", "base"),
    ("3. GRPO vs the mild SFT", "grpo", "mild_sft"),
]
CONTROL_COMPARISONS = [
    ("5. constant advantage vs the teacher's (reverse_kl OPD)", "opd_rkl_constant", "opd_rkl_from_stress_sft"),
    ("5. teacher equal to the student's start vs the degraded teacher", "opd_rkl_teacher_is_base",
     "opd_rkl_from_stress_sft"),
]  # fmt: skip
BOOTSTRAP_SAMPLES = 2000
# --smoke: two tiny steps per run and three items per evaluation task, to keep the chain working in CI
SMOKE_FLAGS = {
    "eval": ["--eval_limit", "3", "--eval_max_new_tokens", "8"],
    "sft": ["--max_steps", "2", "--per_device_train_batch_size", "4", "--probe_steps", "1"],
    "grpo": ["--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "2",
             "--max_completion_length", "8", "--probe_steps", "1"],
    "opd": ["--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "2",
            "--max_completion_length", "8", "--probe_steps", "1"],
}  # fmt: skip
# and here GRPO and OPD evaluate the target after each step, as their curves against compute read (grpo_fair.py)
SMOKE_TARGET_EVAL = ["--target_eval_steps", "1", "--target_eval_limit", "3"]


def run(command: list[str], log: Path) -> None:
    started = time.perf_counter()
    print(f"  $ {' '.join(command)}", flush=True)
    with log.open("w") as f:
        result = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        sys.exit(f"failed ({result.returncode}); see {log}")
    print(f"    done in {time.perf_counter() - started:.0f} s", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="runs/study-lab")
    parser.add_argument("--model_name_or_path", default="lab", help="the base model every run starts from")
    parser.add_argument("--smoke", action="store_true", help="two tiny steps per run (the CI test of the chain)")
    parser.add_argument("--jobs", type=int, default=1, help="seeds run at once, one process each (one torch thread)")
    parser.add_argument(
        "--runs", nargs="+", choices=[name for name, *_ in RUNS + CONTROLS], help="only these runs (default: all)"
    )
    parser.add_argument("--grpo_flags", type=Path, help="a JSON list of flags for `grpo` and `stock_grpo`, after "
                        "their config's (recipes/studies/grpo_fair.py writes the chosen setting's)")  # fmt: skip
    parser.add_argument("--constant_advantage", type=float, help="run the no-teacher controls too (CONTROLS), the "
                        "constant one with this advantage on every supervised token")  # fmt: skip
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model = ["--model_name_or_path", args.model_name_or_path]
    eval_flags = SMOKE_FLAGS["eval"] if args.smoke else []
    runs = study_runs(args.grpo_flags, args.constant_advantage)
    names = [name for name, *_ in runs]
    placeholders = {"base_model": args.model_name_or_path, "constant_advantage": str(args.constant_advantage)}

    base = out / "base"
    if not (base / "results.json").exists():
        print("base model evaluation", flush=True)
        base.mkdir(parents=True, exist_ok=True)
        run(
            [sys.executable, str(RECIPES / "eval.py"), "--output_dir", str(base), *model, *eval_flags],
            base / "log.txt",
        )

    if args.jobs > 1 and len(args.seeds) > 1:  # one process per seed, each running this script for its seed
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        forwarded = sys.argv[1:]
        for i in range(0, len(args.seeds), args.jobs):
            wave = [
                subprocess.Popen(
                    [sys.executable, __file__, *forwarded, "--seeds", str(seed), "--jobs", "1"],
                    env=env,
                    stdout=(out / f"seed{seed}.log").open("w"),
                    stderr=subprocess.STDOUT,
                )
                for seed in args.seeds[i : i + args.jobs]
            ]
            if any(process.wait() for process in wave):
                sys.exit(f"a seed failed; see {out}/seed*.log")

    for seed in args.seeds:
        seed_dir = out / f"seed{seed}"
        folders = {name: seed_dir / name for name in names}
        for name, recipe, config, extra in runs:
            folder = folders[name]
            if (folder / "results.json").exists() or (args.runs and name not in args.runs):
                continue
            print(f"seed {seed}: {name}", flush=True)
            shutil.rmtree(folder / "statelens", ignore_errors=True)  # an unfinished run (no checkpoints) starts over
            folder.mkdir(parents=True, exist_ok=True)
            flags = [flag.format(**placeholders, **{k: str(v) for k, v in folders.items()}) for flag in extra]
            smoke = SMOKE_FLAGS[recipe] + eval_flags if args.smoke else []
            smoke += SMOKE_TARGET_EVAL if args.smoke and recipe != "sft" else []
            command = [sys.executable, str(RECIPES / f"{recipe}.py"), "--config", str(CONFIGS / config), "--seed", str(seed),
                       "--output_dir", str(folder), "--eval_before", "false", *model, *smoke, *flags]  # fmt: skip
            run(command, folder / "log.txt")
        if all((folders[name] / "results.json").exists() for name in folders):
            write_report([folders[name] for name in names], seed_dir / "report", base=base)
    if not all((out / f"seed{seed}" / name / "results.json").exists() for seed in args.seeds for name in names):
        print("some runs are not done yet (--runs): no report or summary")
        return
    summary = summarize(lambda name, seed: run_outcome(out, name, seed), args.seeds, names)
    scores_of = folder_item_scores(out)
    comparisons = compare_runs(
        scores_of, args.seeds, COMPARISONS + (CONTROL_COMPARISONS if args.constant_advantage else [])
    )
    flips = retention_flips(scores_of, args.seeds, names)
    minutes = (time.perf_counter() - started) / 60
    (out / "summary.json").write_text(
        json.dumps(
            {"seeds": args.seeds, "minutes": minutes, "runs": summary, "comparisons": comparisons, "flips": flips},
            indent=2,
        )
    )
    text = (
        summary_table(summary, args.seeds, minutes)
        + "\n"
        + comparison_table(comparisons, args.seeds)
        + "\n"
        + flips_table(flips, args.seeds)
    )
    (out / "summary.md").write_text(text)
    print(text)


def study_runs(grpo_flags: Path | None, constant_advantage: float | None) -> list[tuple]:
    """`RUNS`, GRPO's runs with the flags in the `grpo_flags` file after their own, and `CONTROLS` when a
    `constant_advantage` is given."""
    extra = json.loads(grpo_flags.read_text()) if grpo_flags else []
    runs = [(n, r, c, [*flags, *extra] if r == "grpo" else flags) for n, r, c, flags in RUNS]
    return runs + (CONTROLS if constant_advantage is not None else [])


def run_outcome(out: Path, name: str, seed: int | None) -> dict:
    """A run's final scores by task and its last probe MMD (`None` without probes), from its `results.json`; the
    base's (`name="base"`) from the study's base evaluation."""
    results = json.loads((out / ("base" if name == "base" else f"seed{seed}/{name}") / "results.json").read_text())
    drift = results["final_drift"]
    return {"scores": {task: results["after"]["scores"][task] for task in SCORES}, "mmd": drift and drift["mmd"]}


def summarize(outcome_of, seeds: list[int], names: list[str]) -> dict:
    """Per run (`names`): every Table 2 column as mean, standard deviation and the per-seed values.
    `outcome_of(name, seed)`: the run's [`run_outcome`] (or the committed one, `recipes/studies/lab_items.py`)."""
    base_scores = outcome_of("base", None)["scores"]
    table = {"base": {task: {"mean": base_scores[task], "std": 0.0, "values": [base_scores[task]]} for task in SCORES}}
    for name in names:
        columns = {}
        for seed in seeds:
            outcome = outcome_of(name, seed)
            scores = outcome["scores"]
            values = {task: scores[task] for task in SCORES}
            try:
                values.update(retention_summary(base_scores, scores))
            except ValueError:  # a retention task the base scored 0 on: retention is undefined
                pass
            if outcome["mmd"] is not None:
                values["mmd"] = outcome["mmd"]
            for column, value in values.items():
                columns.setdefault(column, []).append(value)
        table[name] = {
            column: {"mean": statistics.mean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0, "values": v}
            for column, v in columns.items()
        }
    return table


def run_item_scores(run_dir: Path) -> dict[str, dict[str, float]]:
    """Per task, the score of every test item of the run's final evaluation, keyed by its question."""
    items = run_dir / "eval" / "after.items.jsonl"
    return {task: item_scores(items, task, ITEM_SCORE[task]) for task in SCORES}


def folder_item_scores(out: Path):
    """`scores_of(name, seed)` for a study folder: a run's item scores (`run_item_scores`), the base's for `"base"`."""

    def scores_of(name: str, seed: int) -> dict[str, dict[str, float]]:
        return run_item_scores(out / "base" if name == "base" else out / f"seed{seed}" / name)

    return scores_of


def compare_runs(scores_of, seeds: list[int], comparisons: list[tuple] | None = None) -> list[dict]:
    """For each of ``comparisons`` (`(label, run, reference)`, default ``COMPARISONS``) and task: the run minus its
    reference, per seed (paired on the same seed; the base is shared), and a 95% bootstrap interval of the seed-mean
    difference, resampling test problems (the same problems for every seed, so the interval covers which problems the
    test happens to hold, not seed noise). `scores_of(name, seed)`: a run's item scores by task and question
    ([`folder_item_scores`], or the committed items, `recipes/studies/lab_items.py`)."""
    comparisons = COMPARISONS if comparisons is None else comparisons
    base = scores_of("base", None)
    names = {name for _, run, reference in comparisons for name in (run, reference) if name != "base"}
    scores = {(name, seed): scores_of(name, seed) for name in names for seed in seeds}
    results = []
    for label, run, reference in comparisons:
        for task in SCORES:
            questions = sorted(base[task])
            differences = []  # seeds x questions
            for seed in seeds:
                a = scores[run, seed][task]
                b = base[task] if reference == "base" else scores[reference, seed][task]
                differences.append([a[q] - b[q] for q in questions])
            differences = np.array(differences)
            low, high = paired_interval(differences, samples=BOOTSTRAP_SAMPLES)
            results.append(
                {
                    "label": label,
                    "run": run,
                    "reference": reference,
                    "task": task,
                    "per_seed": differences.mean(1).tolist(),
                    "mean": float(differences.mean()),
                    "ci95": [float(low), float(high)],
                    "real": bool(low > 0 or high < 0),
                }
            )
    return results


def retention_flips(scores_of, seeds: list[int], names: list[str]) -> dict:
    """Per run and retention task: the items the base answers right and the run wrong (`lost`) and the reverse
    (`gained`), per seed. A mean change hides flips that cancel: a run can lose 20 items and gain 20."""
    base = scores_of("base", None)
    flips = {}
    for name in names:
        flips[name] = {}
        for task in RETENTION:
            lost, gained = [], []
            for seed in seeds:
                scores = scores_of(name, seed)[task]
                lost.append(sum(1 for q, right in base[task].items() if right and not scores[q]))
                gained.append(sum(1 for q, right in base[task].items() if not right and scores[q]))
            flips[name][task] = {"lost": lost, "gained": gained, "items": len(base[task])}
    return flips


def flips_table(flips: dict, seeds: list[int]) -> str:
    lines = [f"Retention item by item, per seed {seeds}: items the base gets right and the run wrong (lost) and the "
             "reverse (gained); the mean change is (gained - lost) / items.", "",
             "| run | task | lost | gained | items |", "|---|---|---|---|---|"]  # fmt: skip
    for name, tasks in flips.items():
        for task, f in tasks.items():
            lost, gained = ", ".join(map(str, f["lost"])), ", ".join(map(str, f["gained"]))
            lines.append(f"| {name} | {task} | {lost} | {gained} | {f['items']} |")
    return "\n".join(lines) + "\n"


def comparison_table(comparisons: list[dict], seeds: list[int]) -> str:
    lines = ["Paired comparisons: run minus reference, per seed " + str(seeds) + ", their mean, and a 95% bootstrap "
             f"interval over test problems ({BOOTSTRAP_SAMPLES} resamples). 'real': the interval excludes 0.", "",
             "| comparison | task | per seed | mean | 95% interval | real |", "|---|---|---|---|---|---|"]  # fmt: skip
    for c in comparisons:
        per_seed = ", ".join(f"{v:+.3f}" for v in c["per_seed"])
        low, high = c["ci95"]
        lines.append(
            f"| {c['label']} ({c['run']} - {c['reference']}) | {c['task']} | {per_seed} | {c['mean']:+.3f} | "
            f"[{low:+.3f}, {high:+.3f}] | {'yes' if c['real'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def summary_table(summary: dict, seeds: list[int], minutes: float) -> str:
    columns = [*SCORES, "mmd", "forgetting", "retention"]
    lines = [f"Lab study, seeds {seeds}: mean ± standard deviation over seeds. This invocation took {minutes:.1f} "
             "minutes (runs already done are skipped).", "",
             "| run | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]  # fmt: skip
    for name, row in summary.items():
        cells = [f"{row[c]['mean']:.4f} ± {row[c]['std']:.4f}" if c in row else "-" for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
