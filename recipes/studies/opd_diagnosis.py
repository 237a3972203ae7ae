"""Why on-policy distillation moves its target slowly on the lab: each signal, and stock TRL, run long on the dev split
with the lens watching (STUDY.md, "Diagnosis").

    python recipes/studies/opd_diagnosis.py --out runs/opd-diagnosis --jobs 2       # the OPD arms
    python recipes/studies/opd_diagnosis.py --out runs/grpo-dev --arms $(python recipes/studies/opd_diagnosis.py --grpo_arms)
    python recipes/studies/opd_diagnosis.py --out runs/budget-dev --steps 150 --arms $(python recipes/studies/opd_diagnosis.py --budget_arms)
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
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from self_distill_study import smoothed as smooth

from trl_statelens.reports.pages import write_report
from trl_statelens.reports.run_folders import load_run, target_scores_during, training_flops

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
# The pre-registered teacher-budget comparison of issue 36 (STUDY.md): the demo's setting (divergence, one rollout per
# prompt, lr 3e-4) plain and with each horizon lever, to 150 steps; `--reach` reads what each needs to reach plain's
# smoothed dev score at the demo's 75 steps
BUDGET_ARMS = {
    "budget_plain": ARMS["divergence_g1"],
    "budget_h32": [*ARMS["divergence_g1"], "--horizon", "32"],
    "budget_h48": [*ARMS["divergence_g1"], "--horizon", "48"],
    "budget_prog16": [*ARMS["divergence_g1"], "--horizon", "16", "--horizon_growth", "1"],
    # amendment 1: state selection, the rollouts the student already answers right not scored (a tenth rechecked)
    "budget_skip_correct": [*ARMS["divergence_g1"], "--skip_correct_rollouts", "true", "--recheck_fraction", "0.1"],
    # amendment 2: the offline cache, each batch and its teacher signal reused for 4 steps, by age or on staleness
    "budget_cache4": [*ARMS["divergence_g1"], "--teacher_cache_steps", "4"],
    "budget_cache4_s03": [
        *ARMS["divergence_g1"],
        "--teacher_cache_steps",
        "4",
        "--teacher_cache_max_staleness",
        "0.03",
    ],
}
BUDGET_REFERENCE, BUDGET_STEPS, BUDGET_MARGIN = "budget_plain", 75, 0.02
# The pre-registered candidates for passing a degraded teacher (issue 35, STUDY.md), run with the stress teacher after
# `--`: the look's setting that does not pull the student on rollouts it gets right, and the teacher's advantage plus
# GRPO's reward advantage (8 prompts x 4 rollouts, the same 32 rollouts a step)
DEGRADED_ARMS = {
    "degraded_skip_correct": BUDGET_ARMS["budget_skip_correct"],
    "degraded_reward_rkl": ["--signal", "reverse_kl", "--num_generations", "4", "--reward_weight", "1.0",
                            "--max_steps", "150"],
}  # fmt: skip
# The lab's mild SFT (recipes/sft.py, lab config) on the same dev protocol, for the equal-compute comparison
SFT_FLAGS = ["--target_eval_steps", "10", "--probe_steps", "10"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/opd-diagnosis")
    parser.add_argument(
        "--arms", nargs="+", default=list(ARMS), choices=[*ARMS, *GRPO_ARMS, *BUDGET_ARMS, *DEGRADED_ARMS, "sft"]
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval_every", type=int, default=25)
    parser.add_argument("--jobs", type=int, default=1, help="arms run at once, one process (one torch thread) each")
    parser.add_argument("--choose", action="store_true", help="only apply the pre-registered rule to finished arms")
    parser.add_argument("--grpo_arms", action="store_true", help="print the GRPO candidates' names and stop")
    parser.add_argument("--budget_arms", action="store_true", help="print the teacher-budget arms' names and stop")
    parser.add_argument("--degraded_arms", action="store_true", help="print the degraded-teacher candidates and stop")
    parser.add_argument("--reach", action="store_true", help="only read the finished teacher-budget arms (STUDY.md)")
    parser.add_argument(
        "--against_teacher",
        action="store_true",
        help="--choose: the reference is the teacher's dev score, not the base's",
    )
    parser.add_argument("--errors", nargs="+", metavar="NAME=ITEMS", help="print each items file's error profile")
    parser.add_argument("--tolerance", type=float, default=0.03, help="the rule's margin below the best (STUDY.md)")
    parser.add_argument(
        "extra", nargs="*", help="more recipe flags for every arm, after --, e.g. -- --learning_rate 1e-3"
    )
    args = parser.parse_args()
    if args.grpo_arms or args.budget_arms or args.degraded_arms:
        print(" ".join(GRPO_ARMS if args.grpo_arms else BUDGET_ARMS if args.budget_arms else DEGRADED_ARMS))
        return
    if args.errors:
        for name, items in (pair.split("=", 1) for pair in args.errors):
            print(f"{name:<20}", dict(error_profile(Path(items))))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.reach:
        reach(out, [arm for arm in BUDGET_ARMS if (out / arm / "results.json").exists()])
        return
    if args.choose:
        arms = [arm for arm in args.arms if (out / arm / "results.json").exists()]
        choose(out, arms, args.tolerance, args.against_teacher)
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
            flags = {**ARMS, **BUDGET_ARMS, **DEGRADED_ARMS}[arm]
            command = [sys.executable, str(RECIPES / "opd.py"), "--output_dir", str(folder), *common, *flags]
        print(f"{arm}: {' '.join(command)}", flush=True)
        running.append((arm, subprocess.Popen(command, env=env, stdout=(folder / "log.txt").open("w"),
                                              stderr=subprocess.STDOUT)))  # fmt: skip
    for arm, process in running:
        process.wait()
        _check(arm, process)
    print(f"all arms done in {(time.perf_counter() - started) / 60:.1f} min", flush=True)
    report = write_report([out / arm for arm in args.arms], out / "report")
    print(f"report: {report}")
    if all(arm in BUDGET_ARMS for arm in args.arms):  # read against every finished arm, plain's run included
        reach(out, [arm for arm in BUDGET_ARMS if (out / arm / "results.json").exists()])
    else:
        choose(out, args.arms, args.tolerance, against_teacher=all(arm in DEGRADED_ARMS for arm in args.arms))


def smoothed_dev_curve(run, trained_only: bool = False) -> tuple[list[int], list[float], list[float | None]]:
    """(steps, dev scores, smoothed dev scores) of a run scored during training, step 0 the `before` score; smoothed:
    the mean of a score and its neighbouring evaluations (STUDY.md). With `trained_only` the `before` score is left out
    of the smoothing (its own smoothed value is None): the base's score is not the student's."""
    steps, scores = target_scores_during(run, "accuracy_strict")
    curve = {int(s): float(v) for s, v in zip(steps, scores) if s > 0 or not trained_only}
    smoothed = smooth(curve)
    return [int(s) for s in steps], [float(s) for s in scores], [smoothed.get(int(s)) for s in steps]


def reach(out: Path, arms: list[str]) -> dict:
    """The pre-registered teacher-budget reading (STUDY.md, issue 36): the target is the plain arm's smoothed dev score
    at `BUDGET_STEPS`; each arm's cost to reach it is read at its first evaluation whose smoothed score is within
    `BUDGET_MARGIN` of the target: teacher tokens and training FLOPs so far (the ledger's totals) and wall time (the
    logged step times, evaluations excluded). The goal: at least 50% fewer teacher tokens and 30% less compute than
    the plain arm at its own first such evaluation."""
    rows = {}
    for arm in arms:
        run = load_run(out / arm)
        steps, scores, smoothed = smoothed_dev_curve(run)
        ledger = {int(line["step"]): line for line in run.steps.to_dict("records")}
        timed = [(e["step"], e["step_time"]) for e in run.log_history if "step_time" in e]
        rows[arm] = {"steps": steps, "dev": scores, "smoothed": smoothed, "ledger": ledger, "timed": timed}
    reference = rows[BUDGET_REFERENCE]
    target = reference["smoothed"][reference["steps"].index(BUDGET_STEPS)]
    result = {"target": target, "margin": BUDGET_MARGIN, "arms": {}}
    for arm, row in rows.items():
        hit = next((s for s, v in zip(row["steps"], row["smoothed"]) if s > 0 and v >= target - BUDGET_MARGIN), None)
        cost = None
        if hit is not None:
            line = row["ledger"][hit]
            # each logged step_time is the mean over the steps since the previous log
            wall, previous = 0.0, 0
            for step, seconds in row["timed"]:
                if step > hit:
                    break
                wall, previous = wall + seconds * (step - previous), step
            cost = {"step": hit, "teacher_tokens": line["teacher_tokens_total"], "flops": line["flops_total/total"],
                    "seconds": wall}  # fmt: skip
        # the curve the plot draws: each evaluation's smoothed score against the teacher tokens and FLOPs spent so far
        curve = [{"step": s, "smoothed": v, "teacher_tokens": row["ledger"][s]["teacher_tokens_total"] if s else 0.0,
                  "flops": row["ledger"][s]["flops_total/total"] if s else 0.0}
                 for s, v in zip(row["steps"], row["smoothed"])]  # fmt: skip
        result["arms"][arm] = {"reached": cost, "best_smoothed": max(row["smoothed"]), "curve": curve}
    plain = result["arms"][BUDGET_REFERENCE]["reached"]
    print(
        f"target: {BUDGET_REFERENCE}'s smoothed dev score at {BUDGET_STEPS} steps, {target:.3f} (margin {BUDGET_MARGIN})"
    )
    print(f"{'arm':<16}{'reached at':>11}{'teacher tokens':>16}{'FLOPs':>11}{'seconds':>9}{'goal':>6}")
    for arm, entry in result["arms"].items():
        cost = entry["reached"]
        if cost is None:
            print(f"{arm:<16}{'never':>11}   (best smoothed {entry['best_smoothed']:.3f})")
            continue
        entry["goal"] = bool(
            plain is not None
            and cost["teacher_tokens"] <= 0.5 * plain["teacher_tokens"]
            and cost["flops"] <= 0.7 * plain["flops"]
        )
        print(f"{arm:<16}{cost['step']:>11}{cost['teacher_tokens']:>16,.0f}{cost['flops']:>11.2e}"
              f"{cost['seconds']:>9.0f}{'yes' if entry['goal'] else 'no':>6}")  # fmt: skip
    (out / "reach.json").write_text(json.dumps(result, indent=2))
    plot_reach(result, out / "reach.png")
    return result


def plot_reach(result: dict, path: Path) -> None:
    """Each arm's smoothed dev score against the teacher tokens (left) and total training FLOPs (right) it had spent,
    with the target band: the issue's plot of what each lever buys."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, key, label in ((axes[0], "teacher_tokens", "teacher tokens"), (axes[1], "flops", "training FLOPs")):
        for arm, entry in result["arms"].items():
            curve = entry["curve"]
            ax.plot([c[key] for c in curve], [c["smoothed"] for c in curve], marker="o", label=arm)
        ax.axhspan(result["target"] - result["margin"], result["target"], color="grey", alpha=0.2)
        ax.set_xlabel(f"{label} spent (cumulative)")
    axes[0].set_ylabel("smoothed dev accuracy (strict)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"target {result['target']:.3f} (band: within {result['margin']}) and what each arm spent")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def choose(out: Path, arms: list[str], tolerance: float, against_teacher: bool = False) -> dict:
    """The pre-registered rule (STUDY.md): smooth each dev score with its neighbouring evaluations, take the best,
    and choose the cheapest (arm, step) within `tolerance` of it; the stock arm is not a candidate. The score to beat
    by `tolerance` is the base's (the `before` evaluation), or with `against_teacher` the teacher's (the recipe's
    evaluation of the teacher on the same problems: passing a degraded teacher)."""
    rows, base = [], None
    for arm in arms:
        run = load_run(out / arm)
        # step 0: the `before` evaluation, left out of the smoothing when the student is judged against its teacher
        steps, scores, smoothed = smoothed_dev_curve(run, trained_only=against_teacher)
        if against_teacher:
            base = json.loads((out / arm / "eval" / "teacher.json").read_text())["metrics"]["gsm8k"]["accuracy_strict"]
        elif steps[0] == 0:
            base = scores[0]
        flops = training_flops(run, steps)
        for i, step in enumerate(steps):
            if step > 0:
                rows.append({"arm": arm, "step": int(step), "dev": float(scores[i]), "smoothed": float(smoothed[i]),
                             "flops": float(flops[i])})  # fmt: skip
    candidates = [r for r in rows if r["arm"] != "stock"]
    best = max(r["smoothed"] for r in candidates)
    chosen = min((r for r in candidates if r["smoothed"] >= best - tolerance), key=lambda r: r["flops"])
    moves = best >= base + tolerance
    reference = "teacher" if against_teacher else "base"
    print(f"{reference} dev score {base:.3f}; best smoothed dev score {best:.3f}; rule: cheapest within {tolerance}")
    print(f"{'arm':<22}{'step':>6}{'dev':>8}{'smoothed':>10}{'FLOPs':>12}")
    for r in rows:
        mark = " <- chosen" if r is chosen else ""
        print(f"{r['arm']:<22}{r['step']:>6}{r['dev']:>8.3f}{r['smoothed']:>10.3f}{r['flops']:>12.3e}{mark}")
    verdict = (("passes the teacher" if moves else "does NOT pass the teacher by the margin") if against_teacher
               else ("moves the target" if moves else "does NOT move the target by the margin within these budgets"))  # fmt: skip
    print(f"chosen: {chosen['arm']} at {chosen['step']} steps ({verdict})")
    result = {reference: base, "best": best, "tolerance": tolerance, "moves_target": bool(moves), "chosen": chosen,
              "candidates": rows}  # fmt: skip
    (out / "chosen.json").write_text(json.dumps(result, indent=2))
    return result


def error_profile(items: Path) -> Counter:
    """What kind of mistake each wrong math answer in an evaluation's items file makes, read from its `a op b = c`
    lines: `copy` (an operand neither in the problem, nor a word for one such as "doubles", nor an earlier result),
    `arithmetic` (`c` is not `a op b`), `both`, `other` (neither shows in its lines); right answers count as `right`."""
    operations = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
                  "/": lambda a, b: a / b if b else None}  # fmt: skip
    implied = {"doubles": "2", "triples": "3", "half": "2", "halves": "2"}
    profile = Counter()
    for row in map(json.loads, items.read_text().splitlines()):
        if row.get("task", "gsm8k") != "gsm8k":
            continue
        if row["correct_strict"]:
            profile["right"] += 1
            continue
        known = set(re.findall(r"\d+", row["question"])) | {n for w, n in implied.items() if w in row["question"]}
        copy = arithmetic = False
        for a, op, b, c in re.findall(r"(\d+) *([-+*/]) *(\d+) *= *(\d+)", row["output"]):
            copy |= a not in known or b not in known
            arithmetic |= operations[op](int(a), int(b)) != int(c)
            known.add(c)
        profile["both" if copy and arithmetic else "copy" if copy else "arithmetic" if arithmetic else "other"] += 1
    return profile


def _check(arm: str, process) -> bool:
    if process.returncode:
        sys.exit(f"{arm} failed ({process.returncode}); see its log.txt")
    return False


if __name__ == "__main__":
    main()
