"""GRPO given a fair start and budget on the lab (issue 46): the dev phase of the plan pre-registered in STUDY.md
("Pre-registration: a fair GRPO arm, OPD against GRPO at equal compute, a no-teacher control").

    python recipes/studies/grpo_fair.py dev --out runs/grpo-fair --jobs 2        # the warm start, then F1-F3
    python recipes/studies/grpo_fair.py choose --out runs/grpo-fair             # only the rule, on finished runs
    python recipes/studies/grpo_fair.py dev --smoke --out /tmp/grpo-fair-smoke  # 2 steps each, 4 dev problems
    python recipes/studies/grpo_fair.py test --out runs/grpo-fair --study runs/study-lab --jobs 2   # then the test

`dev` first trains the warm start, Table 2's `mild_sft` (`recipes/configs/lab/sft.yaml`, lab seed 0, training seed
0), then the candidates in `CANDIDATES` (`recipes/grpo.py` with the lab config and `GRPO_FLAGS`: 16 rollouts per
prompt at temperature 1.0, 300 steps), each scored on the lab's 100 dev problems every 25 steps, greedy (the rule's
score) and on 4 samples per problem at temperature 1 (reported beside it). Then the rule (`choose_fair`) writes
`chosen.json` and `dev.md`. A run whose `results.json` exists is not run again; `--jobs 2` runs two candidates at
once, one torch thread each.

`test` (the pre-registration's items 3-5, on the test split, seeds 0-2) runs the lab study (`study_lab.py`) with its
GRPO runs at the chosen (candidate, step) and the no-teacher controls: first seed 0's reverse-KL OPD arm, whose mean
`weight/abs_mean` over its steps is `c` (the control's advantage is `-c`), then every run of every seed. Then OPD
against GRPO at equal compute (`compare_compute`): `compute.json` and `opd_vs_grpo.png` in `--out`.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from self_distill_study import smoothed
from study_lab import run

from trl_statelens.evaluation import item_scores
from trl_statelens.reports.run_folders import column, load_run, target_scores_during, training_flops

RECIPES = Path(__file__).resolve().parents[1]
CONFIGS = RECIPES / "configs" / "lab"
# candidate: (the run it starts from, None for the lab base; learning rate)
CANDIDATES = {
    "F1_cold": (None, "1e-4"),
    "F2_warm": ("mild_sft", "1e-4"),
    "F3_warm_lr3e-5": ("mild_sft", "3e-5"),
}
GRPO_FLAGS = ["--num_generations", "16", "--temperature", "1.0", "--beta", "0.04"]
DEV_STEPS = ["--max_steps", "300"]
DEV_FLAGS = ["--eval_split", "dev", "--target_eval_steps", "25", "--target_eval_limit", "100", "--eval_samples", "4",
             "--probe_steps", "25", "--seed", "0", "--lab_seed", "0"]  # fmt: skip
SMOKE_EVAL = ["--max_steps", "2", "--eval_limit", "4", "--eval_max_new_tokens", "8", "--probe_steps", "1",
              "--num_probes", "2"]  # fmt: skip
SMOKE_GRPO = [*SMOKE_EVAL, "--target_eval_steps", "1", "--target_eval_limit", "3", "--per_device_train_batch_size", "8",
              "--num_generations", "4", "--max_completion_length", "8"]  # fmt: skip
MOVES_BY = TOLERANCE = 0.03  # a candidate moves if its best smoothed score is its start's + MOVES_BY
STUDY_LAB = Path(__file__).resolve().parent / "study_lab.py"
TEST_EVAL = ["--target_eval_steps", "25", "--probe_steps", "25"]  # the OPD configs evaluate every 15 steps already
# item 4's curves: each run with the runs whose training it needs (a warm start, an OPD teacher's SFT)
COMPUTE_RUNS = {"grpo": [], "opd_from_mild_sft": ["mild_sft"], "opd_from_stress_sft": ["stress_sft"]}
BOOTSTRAP_SAMPLES = 2000


def dev_phase(out: Path, jobs: int, smoke: bool) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    start = out / "mild_sft"
    if not (start / "results.json").exists():
        sft = [sys.executable, str(RECIPES / "sft.py"), "--config", str(CONFIGS / "sft.yaml"), "--output_dir",
               str(start), *DEV_FLAGS, "--target_eval_steps", "0", *(SMOKE_EVAL if smoke else [])]  # fmt: skip
        start.mkdir(parents=True, exist_ok=True)
        run(sft, start / "log.txt")
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if jobs > 1 else dict(os.environ)
    running = []
    for name, (start_run, lr) in CANDIDATES.items():
        folder = out / name
        if (folder / "results.json").exists():
            continue
        while len(running) >= jobs:
            running = [(n, p) for n, p in running if p.poll() is None or _check(n, p)]
            time.sleep(5)
        folder.mkdir(parents=True, exist_ok=True)
        model = [] if start_run is None else ["--model_name_or_path", str(out / start_run)]
        command = [sys.executable, str(RECIPES / "grpo.py"), "--config", str(CONFIGS / "grpo.yaml"), "--output_dir",
                   str(folder), *model, *GRPO_FLAGS, *DEV_STEPS, "--learning_rate", lr, *DEV_FLAGS, *(SMOKE_GRPO if smoke else [])]  # fmt: skip
        print(f"{name}: {' '.join(command)}", flush=True)
        log = (folder / "log.txt").open("w")
        running.append((name, subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)))
    for name, process in running:
        process.wait()
        _check(name, process)
    return choose_phase(out)


def candidate_curves(out: Path) -> dict[str, dict]:
    """Per finished candidate: its start (step-0 greedy and sampled dev scores, and the FLOPs already spent on the
    model it starts from) and its trained steps' scores and FLOPs."""
    curves = {}
    for name, (start_run, _) in CANDIDATES.items():
        if not (out / name / "results.json").exists():
            continue
        candidate = load_run(out / name)
        steps, greedy = target_scores_during(candidate, "accuracy_strict")
        during = target_scores_during(candidate, "accuracy_sampled")
        sampled = dict(zip(*during)) if during is not None else {}
        if steps[0] != 0:
            sys.exit(f"{out / name}: no step-0 (`before`) dev score, so no start to judge a move against")
        start_flops = 0.0
        if start_run is not None:
            started_from = load_run(out / start_run)
            start_flops = float(training_flops(started_from, [started_from.steps["step"].max()])[0])
        trained = [int(s) for s in steps[1:]]
        curves[name] = {
            "start": float(greedy[0]),
            "start_sampled": sampled.get(0.0),
            "start_flops": start_flops,
            "steps": trained,
            "greedy": [float(v) for v in greedy[1:]],
            "sampled": [sampled.get(float(s)) for s in trained],
            "flops": [float(f) for f in training_flops(candidate, trained)],
        }
    return curves


def choose_fair(curves: dict[str, dict]) -> dict:
    """The pre-registered rule (STUDY.md): a candidate's smoothed score at a step is the mean of its greedy scores
    there and at its neighbouring trained evaluations (the start is never in it); it *moves* if its best smoothed
    score is at least its start + `MOVES_BY`. Among the candidates that move, the (candidate, step) with the fewest
    FLOPs (the start's included) within `TOLERANCE` of their best; if none moves, the one with the highest smoothed
    score of all (ties: fewer FLOPs), reported as not moving: never the cheapest for being cheap."""
    rows, starts = [], {}
    for name, curve in curves.items():
        smooth = smoothed(dict(zip(curve["steps"], curve["greedy"])))
        starts[name] = {"start": curve["start"], "start_sampled": curve["start_sampled"],
                        "best_smoothed": max(smooth.values())}  # fmt: skip
        starts[name]["moves"] = starts[name]["best_smoothed"] >= curve["start"] + MOVES_BY
        for i, step in enumerate(curve["steps"]):
            rows.append({"candidate": name, "step": step, "greedy": curve["greedy"][i], "sampled": curve["sampled"][i],
                         "smoothed": smooth[step], "flops": curve["start_flops"] + curve["flops"][i]})  # fmt: skip
    moving = [r for r in rows if starts[r["candidate"]]["moves"]]
    pool = moving or rows
    best = max(r["smoothed"] for r in pool)
    margin = TOLERANCE if moving else 1e-12  # nothing moves: the highest smoothed score itself
    chosen = min((r for r in pool if r["smoothed"] >= best - margin), key=lambda r: r["flops"])
    return {"moves": bool(moving), "best": best, "chosen": chosen, "starts": starts, "rows": rows}


def choose_phase(out: Path) -> dict:
    result = choose_fair(candidate_curves(out))
    (out / "chosen.json").write_text(json.dumps(result, indent=2))
    lines = ["| candidate | start (greedy / sampled) | moves |", "|---|---|---|"]
    for name, start in result["starts"].items():
        sampled = "" if start["start_sampled"] is None else f" / {start['start_sampled']:.3f}"
        lines.append(f"| {name} | {start['start']:.3f}{sampled} | {'yes' if start['moves'] else 'no'} |")
    lines += ["", "| candidate | step | greedy | smoothed | sampled | FLOPs |", "|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        sampled = "" if r["sampled"] is None else f"{r['sampled']:.3f}"
        mark = " (chosen)" if r is result["chosen"] else ""
        lines.append(f"| {r['candidate']}{mark} | {r['step']} | {r['greedy']:.3f} | {r['smoothed']:.3f} | {sampled} "
                     f"| {r['flops']:.3e} |")  # fmt: skip
    chosen = result["chosen"]
    verdict = "moves the target" if result["moves"] else "does NOT move the target within 300 steps"
    lines += ["", f"Chosen: {chosen['candidate']} at {chosen['step']} steps; GRPO {verdict}."]
    text = "\n".join(lines)
    (out / "dev.md").write_text(text + "\n")
    print(text)
    return result


def test_phase(out: Path, study: Path, seeds: list[int], jobs: int, smoke: bool, model: str) -> dict:
    chosen = json.loads((out / "chosen.json").read_text())["chosen"]
    start_run, lr = CANDIDATES[chosen["candidate"]]
    grpo_flags = [*GRPO_FLAGS, "--max_steps", str(chosen["step"]), "--learning_rate", lr, *TEST_EVAL]
    grpo_flags += [] if start_run is None else ["--model_name_or_path", "{" + start_run + "}"]
    grpo_flags += SMOKE_GRPO if smoke else []
    (out / "grpo_flags.json").write_text(json.dumps(grpo_flags))
    common = [sys.executable, str(STUDY_LAB), "--out", str(study), "--model_name_or_path", model,
              "--grpo_flags", str(out / "grpo_flags.json"), *(["--smoke"] if smoke else [])]  # fmt: skip
    opd_rkl = study / f"seed{seeds[0]}" / "opd_rkl_from_stress_sft"
    if not (opd_rkl / "results.json").exists():
        run([*common, "--seeds", str(seeds[0]), "--runs", "stress_sft", "opd_rkl_from_stress_sft"], out / "c.log")
    advantage = -float(np.nanmean(column(load_run(opd_rkl).steps, "weight/abs_mean")))
    (out / "test_settings.json").write_text(
        json.dumps({"chosen": chosen, "grpo_flags": grpo_flags, "constant_advantage": advantage}, indent=2)
    )
    seeds_flags = ["--seeds", *map(str, seeds), "--jobs", str(jobs), "--constant_advantage", repr(advantage)]
    run([*common, *seeds_flags], out / "study.log")
    return compare_compute(study, seeds, out, grpo_start=start_run)


def compute_curves(study: Path, seeds: list[int], grpo_start: str | None) -> dict[str, dict]:
    """Per run of `COMPUTE_RUNS` and seed: its training-time target evaluations (greedy, per item) and the FLOPs
    spent to reach each, the runs it needs included (`grpo_start`: the run GRPO started from, if any)."""
    curves = {}
    for name, needed in COMPUTE_RUNS.items():
        needed = needed + ([grpo_start] if name == "grpo" and grpo_start else [])
        curves[name] = []
        for seed in seeds:
            folder = study / f"seed{seed}" / name
            trained = load_run(folder)
            during = target_scores_during(trained, "accuracy_strict")
            if during is None:
                sys.exit(f"{folder}: no target evaluation during training, so no curve against compute")
            steps = [int(s) for s in during[0] if s > 0]
            before = 0.0  # the training FLOPs of the runs it needs
            for other in needed:
                started = load_run(study / f"seed{seed}" / other)
                before += float(training_flops(started, [started.steps["step"].max()])[0])
            flops = training_flops(trained, steps) + before
            items = [item_scores(folder / "eval" / "steps" / f"step{s}.items.jsonl", "gsm8k", "correct_strict")
                     for s in steps]  # fmt: skip
            if any(set(i) != set(items[0]) for i in items):
                sys.exit(f"{folder}: its evaluations during training scored different problems")
            curves[name].append({"steps": steps, "flops": [float(f) for f in flops], "items": items,
                                 "problems": sorted(items[0])})  # fmt: skip
            if name == "grpo" and grpo_start:  # where GRPO started, on the same problems: drawn, never in the ratio
                start = item_scores(study / f"seed{seed}" / grpo_start / "eval" / "after.items.jsonl", "gsm8k",
                                    "correct_strict")  # fmt: skip
                curves[name][-1]["start"] = {"flops": before, "greedy": float(np.mean([start[q] for q in items[0]]))}
    for i, seed in enumerate(seeds):  # (the problems a seed's evaluations draw depend on the seed)
        if any(runs[i]["problems"] != curves["grpo"][i]["problems"] for runs in curves.values()):
            sys.exit(f"seed {seed}: the runs' evaluations during training scored different problems")
    return curves


def mean_curve(runs: list[dict], positions) -> tuple[list[int], list[float], list[float]]:
    """(steps, seed-mean score smoothed as the rule smooths, seed-mean FLOPs) of one run's seeds, scored on the
    problems at `positions` of each seed's sorted problems (a resample: repeats allowed)."""
    steps = runs[0]["steps"]
    scores = [np.mean([np.mean([run["items"][i][run["problems"][p]] for p in positions]) for run in runs])
              for i in range(len(steps))]  # fmt: skip
    flops = [float(np.mean([run["flops"][i] for run in runs])) for i in range(len(steps))]
    smooth = smoothed(dict(zip(steps, scores)))
    return steps, [smooth[s] for s in steps], flops


def opd_to_grpo_ratio(curves: dict[str, list], positions) -> dict:
    """GRPO's best (the highest point of its seed-mean curve, smoothed as the rule smooths) against the FLOPs at which
    `opd_from_mild_sft`'s curve first reaches it, on the problems at `positions` ([`mean_curve`]): `ratio` = GRPO's
    FLOPs at its best over OPD's there (`None` if OPD never reaches it)."""
    grpo_steps, grpo, grpo_flops = mean_curve(curves["grpo"], positions)
    best = int(np.argmax(grpo))
    opd_steps, opd, opd_flops = mean_curve(curves["opd_from_mild_sft"], positions)
    reached = next((i for i, score in enumerate(opd) if score >= grpo[best]), None)
    return {
        "grpo_best": grpo[best], "grpo_step": grpo_steps[best], "grpo_flops": grpo_flops[best],
        "opd_step": None if reached is None else opd_steps[reached],
        "opd_flops": None if reached is None else opd_flops[reached],
        "ratio": None if reached is None else grpo_flops[best] / opd_flops[reached],
    }  # fmt: skip


def compare_compute(study: Path, seeds: list[int], out: Path, grpo_start: str | None) -> dict:
    """Item 4: the ratio on the test problems, its 95% interval from a bootstrap over them (one resample of positions
    applied to every run and seed: a seed's runs are scored on the same problems, which the seed draws; a resample
    where OPD never reaches GRPO's best counts as ratio 0 and is counted), and the curves on one plot
    (`opd_vs_grpo.png`)."""
    curves = compute_curves(study, seeds, grpo_start)
    count = len(curves["grpo"][0]["problems"])
    result = opd_to_grpo_ratio(curves, range(count))
    rng = np.random.default_rng(0)
    ratios = [opd_to_grpo_ratio(curves, rng.integers(0, count, count))["ratio"] for _ in range(BOOTSTRAP_SAMPLES)]
    never = sum(r is None for r in ratios)
    low, high = np.percentile([0.0 if r is None else r for r in ratios], [2.5, 97.5])
    result.update({"ci95": [float(low), float(high)], "resamples": BOOTSTRAP_SAMPLES, "resamples_never_reached": never,
                   "seeds": seeds, "problems": count})  # fmt: skip
    (out / "compute.json").write_text(json.dumps({**result, "curves": _curve_summary(curves)}, indent=2))
    _plot_compute(curves, count, result, out / "opd_vs_grpo.png")
    print(json.dumps(result, indent=2))
    return result


def _curve_summary(curves: dict) -> dict:
    return {name: [{"steps": run["steps"], "flops": run["flops"],
                    "greedy": [float(np.mean(list(items.values()))) for items in run["items"]],
                    **({"start": run["start"]} if "start" in run else {})}
                   for run in runs] for name, runs in curves.items()}  # fmt: skip


def _plot_compute(curves: dict, count: int, result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, runs in curves.items():
        _, scores, flops = mean_curve(runs, range(count))
        line = axes.plot(flops, scores, marker="o", label=f"{name} (mean of {len(runs)} seeds, smoothed)")[0]
        if all("start" in run for run in runs):  # GRPO's warm start, on the same problems (not in the ratio)
            start = [np.mean([run["start"][key] for run in runs]) for key in ("flops", "greedy")]
            axes.plot([start[0], flops[0]], [start[1], scores[0]], color=line.get_color(), linestyle="--", marker="o",
                      markevery=[0], markerfacecolor="white", label=f"{name}: from its start, the warm-start model")  # fmt: skip
    axes.axhline(result["grpo_best"], color="gray", linestyle=":", label="GRPO's best")
    axes.set_xscale("log")
    axes.set_xlabel("training FLOPs (the runs each needs included)")
    axes.set_ylabel("GSM8K-lab test accuracy (greedy, 100 problems)")
    ratio = "OPD never reaches it" if result["ratio"] is None else (
        f"ratio {result['ratio']:.2f} [{result['ci95'][0]:.2f}, {result['ci95'][1]:.2f}]")  # fmt: skip
    axes.set_title(f"OPD against GRPO at equal compute: {ratio}")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _check(name: str, process) -> bool:
    if process.returncode:
        sys.exit(f"{name} failed ({process.returncode}); see its log.txt")
    return False


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["dev", "choose", "test"])
    parser.add_argument("--out", type=Path, default=Path("runs/grpo-fair"))
    parser.add_argument("--study", type=Path, default=Path("runs/study-lab"), help="the lab study's folder (test)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="the test phase's seeds")
    parser.add_argument("--model_name_or_path", default="lab", help="the base model every run starts from (test)")
    parser.add_argument("--jobs", type=int, default=1, help="candidates run at once, one torch thread each")
    parser.add_argument("--smoke", action="store_true", help="2 steps per run, 4 dev problems, 8 tokens")
    args = parser.parse_args()
    if args.phase == "dev":
        dev_phase(args.out, args.jobs, args.smoke)
    elif args.phase == "test":
        test_phase(args.out, args.study, args.seeds, args.jobs, args.smoke, args.model_name_or_path)
    else:
        choose_phase(args.out)
