"""Why on-policy distillation moves its target slowly on the lab: each signal, and stock TRL, run long on the dev split
with the lens watching (STUDY.md, "Diagnosis").

    python recipes/studies/opd_diagnosis.py --out runs/opd-diagnosis --jobs 2       # the OPD arms
    python recipes/studies/opd_diagnosis.py --out runs/grpo-dev --arms $(python recipes/studies/opd_diagnosis.py --grpo_arms)
    statelens report runs/opd-diagnosis/* --out runs/opd-diagnosis/report   # written at the end anyway

Every arm distils the lab math teacher into the lab base (lab seed 0) with the demo's settings (8 prompts x 4
rollouts a step, lr 3e-4 or the pre-registered 1e-3, temperature 1), only longer, and is scored on the 100 dev problems every `--eval_every`
steps, greedy and on 4 temperature-1 samples per problem. Every `--eval_every` steps the probes (32 dev prompts)
also measure where the student still disagrees with its teacher: exact reverse KL on its own samples and on its
step-0 samples, on number tokens and the rest, by prefix position (`statelens/drift.jsonl`). A run whose
`results.json` exists is skipped.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from trl_statelens.report import load_run, target_scores_during, training_flops, write_report

RECIPES = Path(__file__).resolve().parents[1]
ARMS = {
    "reverse_kl": ["--signal", "reverse_kl"],
    "divergence": ["--signal", "divergence"],
    "continuation": ["--signal", "continuation"],
    "stock": ["--baseline", "stock"],  # TRL's DistillationTrainer: full-vocabulary JSD, beta 1 (= jsd_beta)
    # the pre-registered second learning rate, to 150 steps (STUDY.md)
    "reverse_kl_lr1e-3": ["--signal", "reverse_kl", "--learning_rate", "1e-3", "--max_steps", "150"],
    "divergence_lr1e-3": ["--signal", "divergence", "--learning_rate", "1e-3", "--max_steps", "150"],
    "continuation_lr1e-3": ["--signal", "continuation", "--learning_rate", "1e-3", "--max_steps", "150"],
    # one rollout per prompt, as the stock trainer draws (amendment 2 in STUDY.md)
    "divergence_g1": ["--signal", "divergence", "--num_generations", "1", "--max_steps", "150"],
    "divergence_g1_lr1e-3": [
        "--signal",
        "divergence",
        "--num_generations",
        "1",
        "--learning_rate",
        "1e-3",
        "--max_steps",
        "150",
    ],
}
# The pre-registered GRPO candidates of issue 35 (STUDY.md: recipes/grpo.py and its lab config, 64 rollouts a step),
# greedy dev scores every 10 steps: rollouts per prompt x temperature x learning rate
GRPO_ARMS = {
    f"grpo_g{group}_t{temperature}_lr{lr}": [
        "--num_generations", str(group), "--temperature", str(temperature), "--learning_rate", lr,
    ]
    for group in (8, 16)
    for temperature in (0.7, 1.0)
    for lr in ("1e-4", "3e-4")
}  # fmt: skip
GRPO_FLAGS = ["--max_steps", "60", "--target_eval_steps", "10", "--probe_steps", "10", "--eval_samples", "0"]
# The lab's mild SFT (recipes/sft.py, lab config) on the same dev protocol, for the equal-compute comparison
SFT_FLAGS = ["--target_eval_steps", "10", "--probe_steps", "10"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/opd-diagnosis")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=[*ARMS, *GRPO_ARMS, "sft"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval_every", type=int, default=25)
    parser.add_argument("--jobs", type=int, default=1, help="arms run at once, one process (one torch thread) each")
    parser.add_argument("--choose", action="store_true", help="only apply the pre-registered rule to finished arms")
    parser.add_argument("--grpo_arms", action="store_true", help="print the GRPO candidates' names and stop")
    parser.add_argument("--tolerance", type=float, default=0.03, help="the rule's margin below the best (STUDY.md)")
    parser.add_argument(
        "extra", nargs="*", help="more recipe flags for every arm, after --, e.g. -- --learning_rate 1e-3"
    )
    args = parser.parse_args()
    if args.grpo_arms:
        print(" ".join(GRPO_ARMS))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.choose:
        choose(out, [arm for arm in args.arms if (out / arm / "results.json").exists()], args.tolerance)
        return
    common = [
        "--eval_split", "dev", "--max_steps", str(args.steps), "--target_eval_steps", str(args.eval_every),
        "--target_eval_limit", "100", "--eval_samples", "4", "--probe_steps", str(args.eval_every),
        "--num_probes", "32", "--seed", "0", "--lab_seed", "0", *args.extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if args.jobs > 1 else dict(os.environ)
    todo = [arm for arm in args.arms if not (out / arm / "results.json").exists()]
    started, running = time.perf_counter(), []
    for arm in todo:
        while len(running) >= args.jobs:
            running = [(a, p) for a, p in running if p.poll() is None or _check(a, p)]
            time.sleep(5)
        folder = out / arm
        shutil.rmtree(folder / "statelens", ignore_errors=True)  # an unfinished run (no checkpoints) starts over
        folder.mkdir(parents=True, exist_ok=True)
        if arm == "sft":
            command = [sys.executable, str(RECIPES / "sft.py"), "--output_dir", str(folder), *common, "--max_steps",
                       "60", *SFT_FLAGS]  # fmt: skip
        elif arm in GRPO_ARMS:  # later flags win: GRPO's own budget and evaluation cadence
            command = [sys.executable, str(RECIPES / "grpo.py"), "--output_dir", str(folder), *common, *GRPO_FLAGS,
                       *GRPO_ARMS[arm]]  # fmt: skip
        else:
            command = [sys.executable, str(RECIPES / "opd.py"), "--output_dir", str(folder), *common, *ARMS[arm]]
        print(f"{arm}: {' '.join(command)}", flush=True)
        running.append((arm, subprocess.Popen(command, env=env, stdout=(folder / "log.txt").open("w"),
                                              stderr=subprocess.STDOUT)))  # fmt: skip
    for arm, process in running:
        process.wait()
        _check(arm, process)
    print(f"all arms done in {(time.perf_counter() - started) / 60:.1f} min", flush=True)
    report = write_report([out / arm for arm in args.arms], out / "report")
    print(f"report: {report}")
    choose(out, args.arms, args.tolerance)


def choose(out: Path, arms: list[str], tolerance: float) -> dict:
    """The pre-registered rule (STUDY.md): smooth each dev score with its neighbouring evaluations, take the best,
    and choose the cheapest (arm, step) within `tolerance` of it; the stock arm is not a candidate."""
    rows, base = [], None
    for arm in arms:
        run = load_run(out / arm)
        steps, scores = target_scores_during(run, "accuracy_strict")  # step 0: the `before` evaluation
        base = scores[0] if steps[0] == 0 else base
        smoothed = [scores[max(i - 1, 0) : i + 2].mean() for i in range(len(scores))]
        flops = training_flops(run, steps)
        for i, step in enumerate(steps):
            if step > 0:
                rows.append({"arm": arm, "step": int(step), "dev": float(scores[i]), "smoothed": float(smoothed[i]),
                             "flops": float(flops[i])})  # fmt: skip
    candidates = [r for r in rows if r["arm"] != "stock"]
    best = max(r["smoothed"] for r in candidates)
    chosen = min((r for r in candidates if r["smoothed"] >= best - tolerance), key=lambda r: r["flops"])
    moves = best >= base + tolerance
    print(f"base dev score {base:.3f}; best smoothed dev score {best:.3f}; rule: cheapest within {tolerance}")
    print(f"{'arm':<22}{'step':>6}{'dev':>8}{'smoothed':>10}{'FLOPs':>12}")
    for r in rows:
        mark = " <- chosen" if r is chosen else ""
        print(f"{r['arm']:<22}{r['step']:>6}{r['dev']:>8.3f}{r['smoothed']:>10.3f}{r['flops']:>12.3e}{mark}")
    verdict = "moves the target" if moves else "does NOT move the target by the margin within these budgets"
    print(f"chosen: {chosen['arm']} at {chosen['step']} steps ({verdict})")
    result = {"base": base, "best": best, "tolerance": tolerance, "moves_target": bool(moves), "chosen": chosen,
              "candidates": rows}  # fmt: skip
    (out / "chosen.json").write_text(json.dumps(result, indent=2))
    return result


def _check(arm: str, process) -> bool:
    if process.returncode:
        sys.exit(f"{arm} failed ({process.returncode}); see its log.txt")
    return False


if __name__ == "__main__":
    main()
