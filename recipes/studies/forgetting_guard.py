"""The forgetting guard acting on the lab's stress SFT (STUDY.md, "Table 2 again, item by item, and the forgetting
guard on stress SFT: pre-registration"): each seed's stress SFT stopped at the first probe whose `base_kl` passes the
budget (the mean final `base_kl` of the study's mild SFT runs), against the same seed's unguarded stress SFT.

    python recipes/studies/forgetting_guard.py --study runs/study-lab --out runs/forgetting-guard

Needs a finished lab study (`make study-lab`); writes `summary.json` and `summary.md` in `--out`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import study_lab
from study_lab import CONFIGS, RECIPES, SCORES, compare_runs, comparison_table

from trl_statelens.evaluation import retention_summary

COMPARISONS = [("stress SFT stopped by the forgetting guard", "guarded", "stress_sft")]
MATH_LOSS = 0.01  # the rule: lab math lower by at most this much (seed means)


def budget(study: Path, seeds: list[int]) -> float:
    """The mean over `seeds` of the study's mild SFT runs' final probe `base_kl`."""
    values = [json.loads((study / f"seed{s}" / "mild_sft" / "results.json").read_text())["final_drift"]["base_kl"]
              for s in seeds]  # fmt: skip
    return statistics.mean(values)


def guarded_command(seed: int, folder: Path, max_base_kl: float) -> list[str]:
    return [sys.executable, str(RECIPES / "sft.py"), "--config", str(CONFIGS / "stress_sft.yaml"), "--seed", str(seed),
            "--output_dir", str(folder), "--eval_before", "false", "--model_name_or_path", "lab",
            "--guards", "stop", "--max_base_kl", repr(max_base_kl), "--probe_steps", "10"]  # fmt: skip


def losses(folder: Path) -> dict[int, float]:
    history = json.loads((folder / "log_history.json").read_text())
    history = history.get("log_history", history) if isinstance(history, dict) else history
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", type=Path, default=Path("runs/study-lab"))
    parser.add_argument("--out", type=Path, default=Path("runs/forgetting-guard"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    max_base_kl = budget(args.study, args.seeds)
    print(f"budget: base_kl {max_base_kl:.4f} (the mild SFT's final, mean over seeds {args.seeds})", flush=True)
    folders = {seed: args.out / f"seed{seed}" / "guarded" for seed in args.seeds}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    running = []
    for seed, folder in folders.items():
        if not (folder / "results.json").exists():
            folder.mkdir(parents=True, exist_ok=True)
            log = (folder / "log.txt").open("w")
            command = guarded_command(seed, folder, max_base_kl)
            running.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    if any(process.wait() for process in running):
        sys.exit(f"a guarded run failed; see {args.out}/seed*/guarded/log.txt")

    def scores_of(name: str, seed: int | None):
        if name == "guarded":
            return study_lab.run_item_scores(folders[seed])
        return study_lab.folder_item_scores(args.study)(name, seed)

    base = study_lab.run_outcome(args.study, "base", None)["scores"]
    per_seed = {}
    for seed, folder in folders.items():
        guarded = study_lab.run_outcome(args.out, "guarded", seed)
        unguarded = study_lab.run_outcome(args.study, "stress_sft", seed)
        fired = [json.loads(line) for line in (folder / "statelens" / "guards.jsonl").read_text().splitlines()]
        stop = next((alarm["step"] for alarm in fired if alarm["guard"] == "forgetting"), None)
        own, theirs = losses(folder), losses(args.study / f"seed{seed}" / "stress_sft")
        per_seed[seed] = {
            "stopped_at": stop,
            "losses_match_until_stop": all(theirs.get(step) == loss for step, loss in own.items()),
            "guarded": {**guarded["scores"], **retention_summary(base, guarded["scores"])},
            "unguarded": {**unguarded["scores"], **retention_summary(base, unguarded["scores"])},
        }
    mean = {side: {key: statistics.mean(s[side][key] for s in per_seed.values()) for key in (*SCORES, "forgetting")}
            for side in ("guarded", "unguarded")}  # fmt: skip
    comparisons = compare_runs(scores_of, args.seeds, COMPARISONS)
    halves = mean["guarded"]["forgetting"] <= 0.5 * mean["unguarded"]["forgetting"]
    keeps_math = mean["guarded"]["gsm8k"] - mean["unguarded"]["gsm8k"] >= -MATH_LOSS
    summary = {"budget_base_kl": max_base_kl, "seeds": args.seeds, "per_seed": per_seed, "mean": mean,
               "comparisons": comparisons, "forgetting_halved": halves, "math_kept": keeps_math,
               "acts": halves and keeps_math}  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    lines = [f"Budget: probe base_kl {max_base_kl:.4f}. Rule: Forgetting at most half the unguarded run's "
             f"({'yes' if halves else 'no'}) and lab math lower by at most {MATH_LOSS} ({'yes' if keeps_math else 'no'})"
             f": the guard {'acts' if halves and keeps_math else 'does not act'} by the rule.", "",
             "| seed | stopped at step | losses equal until then | math guarded / unguarded | Forgetting guarded / unguarded |",
             "|---|---|---|---|---|"]  # fmt: skip
    for seed, s in per_seed.items():
        lines.append(f"| {seed} | {s['stopped_at']} | {'yes' if s['losses_match_until_stop'] else 'no'} | "
                     f"{s['guarded']['gsm8k']:.3f} / {s['unguarded']['gsm8k']:.3f} | "
                     f"{s['guarded']['forgetting']:.3f} / {s['unguarded']['forgetting']:.3f} |")  # fmt: skip
    lines.append(f"| mean | | | {mean['guarded']['gsm8k']:.3f} / {mean['unguarded']['gsm8k']:.3f} | "
                 f"{mean['guarded']['forgetting']:.3f} / {mean['unguarded']['forgetting']:.3f} |")  # fmt: skip
    text = "\n".join(lines) + "\n\n" + comparison_table(comparisons, args.seeds)
    (args.out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
