"""A teacher of another family on the real pair (issue 45): Gemma 3 270M base, behind four solved problems, teaching
SmolLM2-135M-Instruct through the cross-tokenizer path. STUDY.md, "A teacher of another family on the real pair:
pre-registration".

    python recipes/studies/cross_family_real.py [--data ../shared/data] [--out runs/cross-real]
    python recipes/studies/cross_family_real.py --smoke --out /tmp/cross-real-smoke     # 2 steps, 2 items, 8 tokens

Needs `make install-gemma3`. One run of `recipes/opd.py` at the setting of the 2026-12-05 K1 test run
(`real_opd_study.SETTING` and K1's flags: the same training pool, the same four solved problems as chat exchanges,
LoRA, `reverse_kl`, 8 rollouts x 128 tokens a step, 40 steps), the teacher Gemma 3 270M base reading those problems
(`--teacher_reads_context true`) in a text layout (`recipes/configs/real/text_frame.jinja`: `Question: ...`,
`Answer:`, each answer closed by Gemma's `<eos>`, which SmolLM2's `<|im_end|>` then maps to; the base model reads its
own turn tokens as noise), from a folder beside the run that links Gemma's converted files and holds that template
(`teacher_folder`), instead of the student's own base. The primary is the teacher KL on each step's fresh prompts,
its last 10 steps against its first 10 (`teacher_kl_change`: bootstrap over steps). The student is scored after
training on K1's test items (250 GSM8K test problems, greedy, 256 tokens; 200 TruthfulQA questions); `test.json` and
`test.md` hold paired differences with 95% bootstrap intervals over items against the base and against K1's student,
both read from their committed answers (`docs/study/real/ends-test/opd/eval/`), and what the run's records show
(the alignment's exact share, the teacher KL, how rollouts end). A run folder holding its evaluated answers
(`eval/after.items.jsonl`) is not run again.
"""

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

from real_opd_study import ENDS, ROOT, SETTING, SMOKE, arm_scores, paired, result_tables, write_test_data
from study_lab import run

K1_ITEMS = ROOT / "docs" / "study" / "real" / "ends-test" / "opd" / "eval"
TEXT_FRAME = ROOT / "recipes" / "configs" / "real" / "text_frame.jinja"
WINDOW = 10  # the primary's first and last steps
STEPS = 40
ITEMS = {"gsm8k": 250, "truthfulqa": 200}
SMOKE_ITEMS = {"gsm8k": 2, "truthfulqa": 2}


def teacher_folder(out: Path) -> Path:
    """Gemma 3 270M's converted folder (built once) seen through the text layout: its files linked, the chat
    template replaced."""
    from trl_statelens.real_models import build_gemma3

    gemma, folder = build_gemma3(), out / "gemma3-270m-text-frame"
    folder.mkdir(parents=True, exist_ok=True)
    for source in gemma.iterdir():
        target = folder / source.name
        if source.name != "chat_template.jinja" and not target.exists():
            target.symlink_to(source.resolve())
    (folder / "chat_template.jinja").write_text(TEXT_FRAME.read_text())
    return folder


def teacher_kl_change(history: list[dict], window: int = WINDOW, resamples: int = 2000) -> dict:
    """The mean `teacher_kl/sampled` of the last `window` steps less that of the first `window`, with a 95% bootstrap
    interval resampling the steps within each window (each step's rollouts are of prompts not trained on before)."""
    import random

    values = [entry["teacher_kl/sampled"] for entry in history if "teacher_kl/sampled" in entry]
    first, last = values[:window], values[-window:]
    generator = random.Random(0)
    draws = sorted(
        statistics.mean(generator.choices(last, k=len(last))) - statistics.mean(generator.choices(first, k=len(first)))
        for _ in range(resamples)
    )
    return {
        "first": statistics.mean(first),
        "last": statistics.mean(last),
        "difference": statistics.mean(last) - statistics.mean(first),
        "low": draws[int(0.025 * resamples)],
        "high": draws[int(0.975 * resamples) - 1],
        "steps": len(values),
    }


def train_command(folder: Path, teacher: Path, run_dir: Path, smoke: bool) -> list[str]:
    """K1's test-run command with Gemma 3 as the teacher: `recipes/opd.py` instead of the self-distillation recipe,
    the same flags after the config."""
    _, k1_flags = ENDS["K1"]
    items = SMOKE_ITEMS if smoke else ITEMS
    return [
        sys.executable, str(ROOT / "recipes" / "opd.py"),
        "--config", str(ROOT / "recipes" / "configs" / "real" / "opd.yaml"), *SETTING[2:], *k1_flags,
        "--teacher_model_name_or_path", str(teacher), "--teacher_reads_context", "true",
        "--dataset_name", str(folder / "gsm8k"), "--eval_data", str(folder), "--output_dir", str(run_dir),
        "--max_steps", str(2 if smoke else STEPS), "--eval_before", "false", "--eval_tasks", "gsm8k,truthfulqa",
        "--eval_limit", ",".join(f"{task}={n}" for task, n in items.items()),
        *(SMOKE if smoke else []),
    ]  # fmt: skip


def first_last(history: list[dict], key: str, window: int = 5) -> dict[str, float] | None:
    values = [entry[key] for entry in history if entry.get(key) is not None]
    if not values:
        return None
    return {"first": statistics.mean(values[:window]), "last": statistics.mean(values[-window:])}


def records(run_dir: Path) -> dict:
    """The run's logged metrics, its first 5 steps against its last 5: how exact the teacher's signal was (all tokens,
    digits), the sampled teacher KL, how rollouts ended, and the teacher's extra prompt tokens per step."""
    history = json.loads((run_dir / "log_history.json").read_text())
    keys = (
        "alignment/exact", "alignment/exact/numbers", "teacher_kl/sampled", "completions/mean_length",
        "completions/clipped_ratio", "statelens/ends/end_token", "statelens/ends/repeats",
        "statelens/ends/after_answer", "statelens/teacher_context_tokens",
    )  # fmt: skip
    summary = {key: first_last(history, key) for key in keys}
    seconds = [entry["step_time"] for entry in history if "step_time" in entry]
    summary["step_seconds_median"] = statistics.median(seconds) if seconds else None
    return summary


def main(data: Path, out: Path, smoke: bool) -> dict:
    folder = write_test_data(data, out)
    run_dir = out / "opd"
    if not (run_dir / "eval" / "after.items.jsonl").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        (out / "logs").mkdir(parents=True, exist_ok=True)
        run(train_command(folder, teacher_folder(out), run_dir, smoke), out / "logs" / "opd.log")
    arms = {
        "base": arm_scores(K1_ITEMS / "before.items.jsonl", None),
        "k1": arm_scores(K1_ITEMS / "after.items.jsonl", None),
        "gemma": arm_scores(run_dir / "eval" / "after.items.jsonl", None),
    }
    comparisons = [("gemma", "base"), ("gemma", "k1")]
    results = {
        "means": {arm: {m: statistics.mean(v.values()) for m, v in scores.items()} for arm, scores in arms.items()},
        "paired": {
            f"{a} - {b}": {m: paired(arms[a][m], arms[b][m]) for m in arms[a] if m in arms[b]} for a, b in comparisons
        },
        "records": records(run_dir),
        # (the recipe writes results.json after scoring the teacher on the target too, which this study does not read)
        "compute": json.loads((run_dir / "results.json").read_text()).get("compute")
        if (run_dir / "results.json").exists()
        else None,
    }
    change = results["teacher_kl"] = teacher_kl_change(json.loads((run_dir / "log_history.json").read_text()))
    results["reading"] = (
        "moves toward the teacher"
        if change["high"] < 0
        else "moves away from the teacher"
        if change["low"] > 0
        else "no change resolved"
    )
    (out / "test.json").write_text(json.dumps(results, indent=2))
    lines = result_tables(results, list(arms["base"]))
    lines += [
        "",
        f"teacher KL on fresh prompts, steps 1-{WINDOW} -> last {WINDOW}: {change['first']:.3f} -> {change['last']:.3f}, "
        f"{change['difference']:+.3f} [{change['low']:+.3f}, {change['high']:+.3f}]",
        f"reading (pre-registered): {results['reading']}",
    ]
    text = "\n".join(lines)
    (out / "test.md").write_text(text + "\n")
    print(text)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path("runs/cross-real"))
    parser.add_argument("--smoke", action="store_true", help="2 steps, 2 items per task, 8 tokens")
    args = parser.parse_args()
    if not (args.data / "gsm8k" / "train.jsonl").exists():
        sys.exit(f"needs real GSM8K at {args.data / 'gsm8k'} (see ../shared/data/README.md)")
    main(args.data, args.out, args.smoke)
