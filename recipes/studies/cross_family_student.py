"""A teacher of another family that helps? SmolLM2-135M-Instruct behind K1's four solved problems (as ChatML
exchanges) teaching Gemma 3 270M base, each in its own tokenizer (issue 54, item 4). STUDY.md, "An instruct teacher
of another family teaching Gemma 3 270M base: pre-registration".

    python recipes/studies/cross_family_student.py dev  [--data ../shared/data] [--out runs/cross-student]
    python recipes/studies/cross_family_student.py test [--out runs/cross-student]     # once dev wrote chosen.json
    python recipes/studies/cross_family_student.py dev --smoke --out /tmp/cross-student  # 2 steps, 2 items, 8 tokens

Needs `make install-gemma3`. Every run is `recipes/opd.py` at K1's setting (`real_opd_study.SETTING` after its
config, K1's flags: the same training pool and four problems, LoRA r 16, `reverse_kl`, 4 prompts x 2 rollouts of 128
tokens, seed 0), the student `gemma3-270m` answering in Gemma's own turns, the teacher `smollm2-135m` reading the four
problems as its own chat turns (`--teacher_reads_context true`), under bf16 autocast where the CPU has bf16 (as `make
demo-real`).

`dev` runs each learning rate in `LEARNING_RATES` for `DEV_STEPS` steps on the dev split (the training pool and 200
dev problems of `real_teacher_advantage.real_splits`), scoring the clean-format share and the repeat share on the
first `DEV_ITEMS` dev problems every `EVAL_EVERY` steps (the first run scores the base too, and runs the preflight:
the later runs share its setting before step 1, so theirs is off), then applies `choose` and writes `chosen.json`
and `dev.md`. `test` runs the choice on GSM8K's test split, scoring the base and the student on its first
`TEST_ITEMS["gsm8k"]` problems (greedy, 256 tokens) and TruthfulQA's first `TEST_ITEMS["truthfulqa"]`, and writes
`test.json`/`test.md`: paired differences with 95% bootstrap intervals over problems, and the run's records. A run
folder holding its `results.json` is not run again.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from real_opd_study import (
    ENDS,
    ROOT,
    SETTING,
    SMOKE,
    arm_scores,
    dev_curve,
    paired,
    result_tables,
    write_dev_data,
    write_test_data,
)
from study_lab import run

from trl_statelens.real_models import GEMMA3, SMOLLM2

LEARNING_RATES = ["2e-4", "6e-4"]  # K1's, and the larger one `make demo-real` fell back to
DEV_STEPS, EVAL_EVERY, DEV_ITEMS = 20, 10, 32
MARGIN, GUARD, MOVES_BY = 0.03, 0.05, 0.10  # the rule's tolerance below the best; repeats over the base; a move
TEST_ITEMS = {"gsm8k": 250, "truthfulqa": 100}
SMOKE_ITEMS = {"gsm8k": 2, "truthfulqa": 2}
# The test's evaluation batch (the recipe's default is 16): Gemma's greedy decoding reads its weights once a step
# whatever the batch, so four batches of 64 should take well under the time of sixteen of 16 (STUDY.md, the amendment)
EVAL_BATCH = 64


def bf16_flag() -> list[str]:
    """bf16 autocast where the CPU computes in bf16 (as the Makefile's REAL_BF16), else fp32."""
    cpu = Path("/proc/cpuinfo")
    has_bf16 = cpu.exists() and any(flag in cpu.read_text() for flag in ("avx512_bf16", "amx_bf16"))
    return ["--bf16", "true" if has_bf16 else "false"]


def opd_command(folder: Path, run_dir: Path, learning_rate: str, steps: int, smoke: bool) -> list[str]:
    """K1's command with Gemma 3 270M base as the student and SmolLM2-135M-Instruct, behind the shots, its teacher."""
    _, k1_flags = ENDS["K1"]
    return [
        sys.executable, str(ROOT / "recipes" / "opd.py"),
        "--config", str(ROOT / "recipes" / "configs" / "real" / "opd.yaml"), *SETTING[2:], *k1_flags, *bf16_flag(),
        "--model_name_or_path", GEMMA3, "--teacher_model_name_or_path", SMOLLM2, "--teacher_reads_context", "true",
        "--learning_rate", learning_rate, "--dataset_name", str(folder), "--output_dir", str(run_dir),
        "--max_steps", str(2 if smoke else steps), *(SMOKE if smoke else []),
    ]  # fmt: skip


def dev_phase(data: Path, out: Path, smoke: bool) -> dict:
    folder = write_dev_data(data, out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    items, every = (2, 1) if smoke else (DEV_ITEMS, EVAL_EVERY)
    for index, rate in enumerate(LEARNING_RATES):
        run_dir = out / "dev" / f"lr{rate}"
        if (run_dir / "results.json").exists():
            continue
        first = index == 0
        scoring = ["--eval_before", "true", "--eval_tasks", "gsm8k", "--eval_limit", f"gsm8k={items}"] if first else [
            "--eval_before", "false", "--eval_tasks", "", "--preflight", "off"]  # fmt: skip
        command = opd_command(folder, run_dir, rate, DEV_STEPS, smoke) + [
            "--eval_data", str(folder.parent), "--target_eval_steps", str(every), "--target_eval_limit", str(items),
            *scoring,
        ]  # fmt: skip
        run(command, out / "logs" / f"dev-lr{rate}.log")
    base = base_dev_scores(out / "dev" / f"lr{LEARNING_RATES[0]}")
    steps = [1, 2] if smoke else list(range(every, DEV_STEPS + 1, every))
    chosen = choose({rate: out / "dev" / f"lr{rate}" for rate in LEARNING_RATES}, base, steps)
    (out / "chosen.json").write_text(json.dumps(chosen, indent=2))
    lines = [f"base on {items} dev problems: clean {base['clean_format']:.3f}, repeats {base['repeats']:.3f}", "",
             "| learning rate | steps | clean | smoothed | repeats | guard |", "|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in chosen["candidates"]:
        lines.append(f"| {r['candidate']} | {r['steps']} | {r['clean']:.3f} | {r['smoothed']:.3f} | "
                     f"{r['repeats']:.3f} | {'pass' if r['guard'] else 'fail'} |")  # fmt: skip
    lines += ["", f"chosen: learning rate {chosen['candidate']}, {chosen['steps']} steps; moves: {chosen['moves']}"]
    (out / "dev.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return chosen


def base_dev_scores(run_dir: Path) -> dict[str, float]:
    """The base's dev scores, from the first run's evaluation before training (its `eval_before` items)."""
    scores = arm_scores(run_dir / "eval" / "before.items.jsonl", None)
    return {"clean_format": statistics.mean(scores["clean"].values()),
            "repeats": statistics.mean(scores["repeats"].values())}  # fmt: skip


def choose(runs: dict[str, Path], base: dict[str, float], steps: list[int]) -> dict:
    """The rule written before the runs (STUDY.md): a (learning rate, step) passes the guard when its dev repeat share
    is at most the base's + GUARD; its smoothed score is the mean of its clean share there and at the run's previous
    scored step (the first: itself). `best` = the highest smoothed score among those passing; chosen = the fewest
    steps (then the smaller learning rate) within MARGIN of it, whether or not it moves (`moves`: best >= the base's
    clean share + MOVES_BY). None passing: the smaller learning rate at the last step, `guard_failed` set."""
    rows = []
    for index, (name, run_dir) in enumerate(runs.items()):
        clean, repeats = dev_curve(run_dir, "eval/gsm8k/clean_format"), dev_curve(run_dir, "eval/gsm8k/repeats")
        missing = [s for s in steps if s not in clean or s not in repeats]
        if missing:
            raise ValueError(f"{run_dir} has no dev score at steps {missing}")
        for i, s in enumerate(steps):
            rows.append({"candidate": name, "index": index, "steps": s, "clean": clean[s],
                         "smoothed": statistics.mean([clean[s], clean[steps[max(0, i - 1)]]]),
                         "repeats": repeats[s], "guard": repeats[s] <= base["repeats"] + GUARD + 1e-9})  # fmt: skip
    passing = [r for r in rows if r["guard"]]
    best = max((r["smoothed"] for r in passing), default=None)
    if best is None:
        pick = {"candidate": next(iter(runs)), "steps": steps[-1]}
    else:
        pick = min(
            (r for r in passing if r["smoothed"] >= best - MARGIN - 1e-9), key=lambda r: (r["steps"], r["index"])
        )
    return {"candidate": pick["candidate"], "steps": pick["steps"], "best_smoothed": best,
            "moves": best is not None and best >= base["clean_format"] + MOVES_BY - 1e-9,
            "guard_failed": best is None, "base_dev": base, "candidates": rows}  # fmt: skip


def records(run_dir: Path, window: int = 5) -> dict:
    """The run's logged metrics, its first `window` steps against its last: the alignment's exact shares, the
    sampled teacher KL, how rollouts ended; and the median step time."""
    history = json.loads((run_dir / "log_history.json").read_text())
    summary = {}
    for key in ("alignment/exact", "alignment/per_decision_exact", "alignment/exact/numbers", "teacher_kl/sampled",
                "completions/mean_length", "completions/clipped_ratio", "statelens/ends/end_token",
                "statelens/ends/repeats", "statelens/ends/after_answer"):  # fmt: skip
        values = [entry[key] for entry in history if entry.get(key) is not None]
        if values:
            summary[key] = {"first": statistics.mean(values[:window]), "last": statistics.mean(values[-window:])}
    seconds = [entry["step_time"] for entry in history if "step_time" in entry]
    summary["step_seconds_median"] = statistics.median(seconds) if seconds else None
    return summary


def test_phase(data: Path, out: Path, smoke: bool) -> dict:
    chosen = json.loads((out / "chosen.json").read_text())
    folder = write_test_data(data, out)
    run_dir = out / "test" / "opd"
    items = SMOKE_ITEMS if smoke else TEST_ITEMS
    if not (run_dir / "results.json").exists():
        command = opd_command(folder / "gsm8k", run_dir, chosen["candidate"], chosen["steps"], smoke) + [
            "--eval_data", str(folder), "--eval_before", "true", "--eval_tasks", ",".join(items),
            "--eval_limit", ",".join(f"{task}={n}" for task, n in items.items()), "--preflight", "off",
            "--eval_batch_size", str(EVAL_BATCH),
        ]  # fmt: skip
        run(command, out / "logs" / "test.log")
    arms = {
        "base": arm_scores(run_dir / "eval" / "before.items.jsonl", None),
        "taught": arm_scores(run_dir / "eval" / "after.items.jsonl", None),
    }
    results = {
        "chosen": {"learning_rate": chosen["candidate"], "steps": chosen["steps"], "moves_on_dev": chosen["moves"]},
        "means": {arm: {m: statistics.mean(v.values()) for m, v in scores.items()} for arm, scores in arms.items()},
        "paired": {"taught - base": {m: paired(arms["taught"][m], arms["base"][m]) for m in arms["base"]}},
        "records": records(run_dir),
        "compute": json.loads((run_dir / "results.json").read_text()).get("compute"),
    }
    clean = results["paired"]["taught - base"]["clean"]
    results["reading"] = "helps" if clean["low"] > 0 else "harms" if clean["high"] < 0 else "no change resolved"
    (out / "test.json").write_text(json.dumps(results, indent=2))
    lines = result_tables(results, list(arms["base"]))
    lines += ["", f"clean-format share, taught - base: {clean['difference']:+.3f} [{clean['low']:+.3f}, "
              f"{clean['high']:+.3f}] (pre-registered reading: {results['reading']})"]  # fmt: skip
    text = "\n".join(lines)
    (out / "test.md").write_text(text + "\n")
    print(text)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["dev", "test"])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path("runs/cross-student"))
    parser.add_argument("--smoke", action="store_true", help="2 steps per run, 2 problems per task, 8 tokens")
    args = parser.parse_args()
    if not (args.data / "gsm8k" / "train.jsonl").exists():
        sys.exit(f"needs real GSM8K at {args.data / 'gsm8k'} (see ../shared/data/README.md)")
    if args.phase == "test" and not (args.out / "chosen.json").exists():
        sys.exit(f"no dev choice at {args.out / 'chosen.json'}: run the dev phase first")
    (dev_phase if args.phase == "dev" else test_phase)(args.data, args.out, args.smoke)
