"""On-policy distillation on the real SmolLM2-135M-Instruct (issue 34): the dev phase of the plan pre-registered in
STUDY.md ("A real model: ... plan").

    python recipes/studies/real_opd_study.py dev [--out runs/real-study] [--data ../shared/data]
    python recipes/studies/real_opd_study.py dev --smoke --out /tmp/real-smoke      # a 2-step run of each candidate

`dev` writes the dev data (`<out>/data-dev/gsm8k/`: `train.jsonl`, the training pool, and `test.jsonl`, the 200 dev
rows, both from `real_teacher_advantage.real_splits`), runs each candidate (`recipes/self_distill.py` with the real
config, LoRA, 8 rollouts x 128 tokens a step, the candidate's self teacher) scoring the format share on 64 dev
problems every 10 steps, applies the rule and writes `chosen.json` and `dev.md`. A candidate whose run folder holds a
`results.json` is not run again. The test phase comes once the dev choice is in.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

from real_teacher_advantage import NUM_SHOTS, TEMPLATES, real_splits
from self_distill_study import smoothed
from study_lab import run

ROOT = Path(__file__).resolve().parents[2]
DEV_METRIC = "eval/gsm8k/answer_found"  # the format share: answers with a `#### N` line
MARGIN, MOVES_BY = 0.05, 0.10  # the rule's tolerance below the best, and the least gain over the base that "moves"
STEPS, EVAL_EVERY, DEV_ITEMS = 40, 10, 64
# candidate: the self teacher's template (real_teacher_advantage.TEMPLATES) and what it reads as privileged context
CANDIDATES = {
    "C1": ("shots", ["--context_shots", str(NUM_SHOTS)]),
    "C2": ("solution", []),
}
SETTING = [
    "--config", str(ROOT / "recipes" / "configs" / "real" / "self_distill.yaml"),
    "--signal", "reverse_kl", "--per_device_train_batch_size", "8", "--num_generations", "2",
    "--max_completion_length", "128", "--learning_rate", "2e-4", "--lr_scheduler_type", "constant",
    "--eval_max_new_tokens", "256", "--num_probes", "0", "--seed", "0",
]  # fmt: skip
SMOKE = ["--max_completion_length", "8", "--eval_max_new_tokens", "8"]


def write_dev_data(data: Path, out: Path) -> Path:
    """The dev data folder: the training pool as `train.jsonl`, the dev rows as `test.jsonl`."""
    folder = out / "data-dev" / "gsm8k"
    if not (folder / "test.jsonl").exists():
        dev, pool = real_splits(data)
        folder.mkdir(parents=True, exist_ok=True)
        for name, rows in (("train", pool), ("test", dev)):
            lines = (json.dumps({"question": r["question"], "answer": r["answer"]}) for r in rows)
            (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def dev_command(name: str, folder: Path, out: Path, smoke: bool) -> list[str]:
    view, flags = CANDIDATES[name]
    steps, every, items = (2, 1, 2) if smoke else (STEPS, EVAL_EVERY, DEV_ITEMS)
    first = name == next(iter(CANDIDATES))
    evaluation = ["--eval_tasks", "gsm8k", "--eval_limit", f"gsm8k={items}"] if first else ["--eval_tasks", ""]
    return [
        sys.executable, str(ROOT / "recipes" / "self_distill.py"), *SETTING, *flags,
        "--teacher_prompt_template", TEMPLATES[view], "--dataset_name", str(folder), "--eval_data", str(folder.parent),
        "--output_dir", str(out / "dev" / name), "--max_steps", str(steps), "--target_eval_steps", str(every),
        "--target_eval_limit", str(items), "--eval_before", "true" if first else "false", *evaluation,
        *(SMOKE if smoke else []),
    ]  # fmt: skip


def dev_curve(run_dir: Path) -> dict[int, float]:
    history = json.loads((run_dir / "log_history.json").read_text())
    return {e["step"]: e[DEV_METRIC] for e in history if DEV_METRIC in e}


def choose(out: Path, base: float, steps: list[int]) -> dict:
    """`best` = the highest smoothed dev score over every candidate and scored step; chosen = the fewest steps (then
    the earlier candidate) within MARGIN of it. `moves`: whether `best` is at least the base's score + MOVES_BY."""
    rows = []
    for index, name in enumerate(CANDIDATES):
        curve = dev_curve(out / "dev" / name)
        missing = [s for s in steps if s not in curve]
        if missing:
            raise ValueError(f"{out / 'dev' / name} has no dev score at steps {missing}")
        smooth = smoothed({s: curve[s] for s in steps})
        rows += [(s, index, name, smooth[s], curve[s]) for s in steps]
    best = max(r[3] for r in rows)
    pick = min(r for r in rows if r[3] >= best - MARGIN - 1e-9)
    return {
        "candidate": pick[2], "steps": pick[0], "dev_smoothed": pick[3], "dev": pick[4], "best_smoothed": best,
        "base_dev": base, "moves": bool(best >= base + MOVES_BY - 1e-9),
        "candidates": [{"candidate": r[2], "steps": r[0], "smoothed": r[3], "dev": r[4]} for r in sorted(rows)],
    }  # fmt: skip


def dev_phase(data: Path, out: Path, smoke: bool) -> dict:
    folder = write_dev_data(data, out)
    for name in CANDIDATES:
        run_dir = out / "dev" / name
        if (run_dir / "results.json").exists():
            continue
        shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted run starts again
        (out / "logs").mkdir(parents=True, exist_ok=True)
        run(dev_command(name, folder, out, smoke), out / "logs" / f"dev_{name}.log")
    first = out / "dev" / next(iter(CANDIDATES))
    base = json.loads((first / "eval" / "before.json").read_text())["metrics"]["gsm8k"]["answer_found"]
    chosen = choose(out, base, [1, 2] if smoke else list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY)))
    (out / "chosen.json").write_text(json.dumps(chosen, indent=2))
    lines = [
        f"base dev format share: {base:.3f}",
        "",
        "| candidate | steps | format share | smoothed |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {c['candidate']} | {c['steps']} | {c['dev']:.3f} | {c['smoothed']:.3f} |" for c in chosen["candidates"]
    ]
    lines += ["", f"chosen: {chosen['candidate']} at {chosen['steps']} steps; moves: {chosen['moves']}"]
    (out / "dev.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return chosen


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["dev"])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path("runs/real-study"))
    parser.add_argument("--smoke", action="store_true", help="2 steps per candidate, 2 dev problems, 8 tokens")
    args = parser.parse_args()
    if not (args.data / "gsm8k" / "train.jsonl").exists():
        sys.exit(f"needs real GSM8K at {args.data / 'gsm8k'} (see ../shared/data/README.md)")
    dev_phase(args.data, args.out, args.smoke)
