"""GRPO given a fair start and budget on the lab (issue 46): the dev phase of the plan pre-registered in STUDY.md
("Pre-registration: a fair GRPO arm, OPD against GRPO at equal compute, a no-teacher control").

    python recipes/studies/grpo_fair.py dev --out runs/grpo-fair --jobs 2        # the warm start, then F1-F3
    python recipes/studies/grpo_fair.py choose --out runs/grpo-fair             # only the rule, on finished runs
    python recipes/studies/grpo_fair.py dev --smoke --out /tmp/grpo-fair-smoke  # 2 steps each, 4 dev problems

`dev` first trains the warm start, Table 2's `mild_sft` (`recipes/configs/lab/sft.yaml`, lab seed 0, training seed
0), then the candidates in `CANDIDATES` (`recipes/grpo.py` with the lab config and `GRPO_FLAGS`: 16 rollouts per
prompt at temperature 1.0, 300 steps), each scored on the lab's 100 dev problems every 25 steps, greedy (the rule's
score) and on 4 samples per problem at temperature 1 (reported beside it). Then the rule (`choose_fair`) writes
`chosen.json` and `dev.md`. A run whose `results.json` exists is not run again; `--jobs 2` runs two candidates at
once, one torch thread each.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from self_distill_study import smoothed
from study_lab import run

from trl_statelens.reports.run_folders import load_run, target_scores_during, training_flops

RECIPES = Path(__file__).resolve().parents[1]
CONFIGS = RECIPES / "configs" / "lab"
# candidate: (the run it starts from, None for the lab base; learning rate)
CANDIDATES = {
    "F1_cold": (None, "1e-4"),
    "F2_warm": ("mild_sft", "1e-4"),
    "F3_warm_lr3e-5": ("mild_sft", "3e-5"),
}
GRPO_FLAGS = ["--num_generations", "16", "--temperature", "1.0", "--max_steps", "300", "--beta", "0.04"]
DEV_FLAGS = ["--eval_split", "dev", "--target_eval_steps", "25", "--target_eval_limit", "100", "--eval_samples", "4",
             "--probe_steps", "25", "--seed", "0", "--lab_seed", "0"]  # fmt: skip
SMOKE_EVAL = ["--max_steps", "2", "--eval_limit", "4", "--eval_max_new_tokens", "8", "--probe_steps", "1",
              "--num_probes", "2"]  # fmt: skip
SMOKE_GRPO = [*SMOKE_EVAL, "--target_eval_steps", "1", "--target_eval_limit", "4", "--per_device_train_batch_size", "8",
              "--num_generations", "4", "--max_completion_length", "8"]  # fmt: skip
MOVES_BY = TOLERANCE = 0.03  # a candidate moves if its best smoothed score is its start's + MOVES_BY


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
                   str(folder), *model, *GRPO_FLAGS, "--learning_rate", lr, *DEV_FLAGS, *(SMOKE_GRPO if smoke else [])]  # fmt: skip
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


def _check(name: str, process) -> bool:
    if process.returncode:
        sys.exit(f"{name} failed ({process.returncode}); see its log.txt")
    return False


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["dev", "choose"])
    parser.add_argument("--out", type=Path, default=Path("runs/grpo-fair"))
    parser.add_argument("--jobs", type=int, default=1, help="candidates run at once, one torch thread each")
    parser.add_argument("--smoke", action="store_true", help="2 steps per run, 4 dev problems, 8 tokens")
    args = parser.parse_args()
    if args.phase == "dev":
        dev_phase(args.out, args.jobs, args.smoke)
    else:
        choose_phase(args.out)
