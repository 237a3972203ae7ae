"""Self-distillation with privileged context on the lab (issue 28, item 4): learn lab math from its reference
solutions by (a) SFT on them or (b) self-distillation with each signal, from the lab base; target gain, retention
and the state records that explain the difference, over 3 seeds.

    make self-distill-study      # = python recipes/studies/self_distill_study.py --jobs 2 --out runs/self-distill-study
    python recipes/studies/self_distill_study.py --dry_run                # the runs and their estimated time, nothing run
    python recipes/studies/self_distill_study.py --smoke --model_name_or_path MODEL --out /tmp/sd   # the CI test

The plan and its rule are pre-registered in STUDY.md, "Self-distillation with privileged context: plan". Phases:

1. `base`: the lab base on the test split (every task) and on the dev split (math), and the teacher's advantage:
   the base's per-token loss on the dev reference solutions behind the student's prompt and behind the self
   teacher's, and its greedy dev accuracy behind each (`teacher_advantage.json`).
2. `dev`: per method and learning rate, one seed-0 run scoring the 100 dev problems every `EVAL_EVERY` steps; the
   rule (`choose`) picks each method's learning rate and steps (`chosen.json`).
3. `test`: each method at its chosen setting, seeds 0, 1, 2, scored on the test split; then the tables
   (`summary.md`, `summary.json`) and `self_distill.png`.

Every run is a recipe (sft.py, self_distill.py) with its lab config; a run whose `results.json` exists is skipped, so
an interrupted study continues where it stopped (the choice is recomputed from the dev runs, deterministically).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from study_lab import run  # logs the command and its time, and stops on a failure

from trl_statelens.evaluation import RETENTION_TASKS, item_scores, paired_interval, retention_summary

RECIPES = Path(__file__).resolve().parents[1]
CONFIGS = RECIPES / "configs" / "lab"
SEEDS = [0, 1, 2]
TASKS = ("gsm8k", *RETENTION_TASKS)
ITEM_SCORE = {"gsm8k": "correct_strict", "truthfulqa": "mc1", "mmlu": "correct"}  # per item, in eval/*.items.jsonl
MARGIN = 0.03  # the rule's tolerance below the best smoothed dev score (about one standard error of 100 problems)
BOOTSTRAP_SAMPLES = 2000

# method: (recipe, lab config, learning rates, steps scored on dev, flags). A step is 16 sequences (SFT) or 16 rollouts
# of 16 prompts (self-distillation); everything else as the config. The longest candidates cost about the same
# training time (40 SFT steps about 30 s, 12 self-distillation steps 29-52 s): what fits 15 minutes on 2 cores.
SD = ["--per_device_train_batch_size", "16", "--num_generations", "1"]
SD_STEPS = [3, 6, 9, 12]
METHODS = {
    "sft": ("sft", "sft.yaml", ["5e-4", "1e-3"], [10, 20, 30, 40], ["--per_device_train_batch_size", "16"]),
    "sd_reverse_kl": ("self_distill", "self_distill.yaml", ["3e-4", "1e-3"], SD_STEPS, [*SD, "--signal", "reverse_kl"]),
    "sd_divergence": ("self_distill", "self_distill.yaml", ["3e-4", "1e-3"], SD_STEPS,
                      [*SD, "--signal", "divergence", "--jsd_beta", "1.0"]),
    "sd_continuation": ("self_distill", "self_distill.yaml", ["3e-4", "1e-3"], SD_STEPS,
                        [*SD, "--signal", "continuation", "--continuation_length", "16"]),
}  # fmt: skip
# Dev runs: math on the dev split scored during training only (no final evaluation: the last scored step is the
# end), no probes; test runs: every task after training, a probe at the end (base_kl against step 0)
DEV = ["--eval_split", "dev", "--eval_tasks", "", "--target_eval_limit", "100", "--num_probes", "0"]
COMMON = ["--eval_before", "false", "--lab_seed", "0", "--ledger_sample_rate", "0.05"]
# --smoke: SFT and one signal (continuation: the teacher writes tokens, so all three sources show in the records; the
# other signals' recipe runs are tested on their own), one learning rate, steps {1, 2}, one seed, tiny batches and
# evaluations (the chain, not the numbers)
SMOKE_METHODS = ("sft", "sd_continuation")
SMOKE_EVAL = ["--eval_limit", "3", "--eval_max_new_tokens", "8"]
SMOKE_FLAGS = {
    "sft": ["--per_device_train_batch_size", "4", "--max_length", "160"],
    "self_distill": [
        "--per_device_train_batch_size",
        "4",
        "--max_completion_length",
        "8",
        "--continuation_length",
        "4",
    ],
}

# ----- cost estimate (rough): seconds at one torch thread on a quiet core ------------------------------------------
# Per optimizer step of 16: SFT 0.75 s (forgetting study); self-distillation per rollout as OPD (forgetting study:
# divergence 0.22, reverse_kl 0.15, continuation 0.27 s; the self teacher is the student's size, its prompt about
# twice the student's). TRL's SDFTTrainer (full_logits, `--baseline stock`): 10 steps of 16 rollouts with two 100-
# problem dev evaluations took 55 s of CPU in all, one step and nothing else 19 s (the start). Timing runs of ours
# (12 steps of 16 rollouts, no evaluation, no probe; CPU seconds, start included): reverse_kl 50, divergence 57,
# continuation 62, i.e. about 2.6, 3.3 and 3.8 s a step against the 2.4, 3.5 and 4.3 used here. Per run: start,
# load, save, report ~20 s; a 100-problem dev evaluation ~5 s; the test evaluation (300 + 60 + kb items) ~13 s; a
# probe ~2.4 s.
PER_STEP = {"sft": 0.75, "sd_reverse_kl": 0.15 * 16, "sd_divergence": 0.22 * 16, "sd_continuation": 0.27 * 16}
START, DEV_EVAL, TEST_EVAL, PROBE = 20.0, 5.0, 13.0, 2.4


def dev_folder(out: Path, method: str, lr: str) -> Path:
    return out / "dev" / f"{method}_lr{lr}"


def test_folder(out: Path, method: str, seed: int) -> Path:
    return out / f"seed{seed}" / method


def command(
    method: str, folder: Path, lr: str, steps: int, seed: int, extra: list[str], model: list[str], smoke: bool = False
) -> list[str]:
    recipe, config, _, _, flags = METHODS[method]
    if smoke:
        extra = [*extra, *SMOKE_FLAGS[recipe], *SMOKE_EVAL, "--target_eval_limit", "3"]
    return [sys.executable, str(RECIPES / f"{recipe}.py"), "--config", str(CONFIGS / config), *model, *COMMON, *flags,
            "--learning_rate", lr, "--max_steps", str(steps), "--seed", str(seed), *extra,
            "--output_dir", str(folder)]  # fmt: skip


def run_all(jobs: list[tuple[Path, list[str]]], parallel: int) -> None:
    """Run every (folder, command) whose `results.json` is missing, `parallel` at once, one torch thread each."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    todo = [(folder, cmd) for folder, cmd in jobs if not (folder / "results.json").exists()]
    running = []
    while todo or running:
        while todo and len(running) < parallel:
            folder, cmd = todo.pop(0)
            shutil.rmtree(folder / "statelens", ignore_errors=True)  # an unfinished run starts over
            folder.mkdir(parents=True, exist_ok=True)
            print(f"{folder}: {' '.join(cmd)}", flush=True)
            log = (folder / "log.txt").open("w")
            running.append((folder, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), time.time()))
        time.sleep(1)
        for entry in list(running):
            folder, process, started = entry
            if process.poll() is None:
                continue
            running.remove(entry)
            if process.returncode:
                for _, other, _ in running:
                    other.terminate()
                sys.exit(f"{folder} failed ({process.returncode}); see {folder / 'log.txt'}")
            print(f"{folder} done in {time.time() - started:.0f} s", flush=True)


# ----- the teacher's advantage: what the privileged context gives the base --------------------------------------
def teacher_advantage(model_path: str, template: str, limit: int | None, max_new_tokens: int) -> dict:
    """On the dev split: the base's mean per-token loss on each reference solution (with its eos) after the student's
    prompt and after the teacher's, and its greedy accuracy after each. A self teacher can only teach what its
    context adds: if the two are close, self-distillation has next to nothing to distil."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_statelens.answers import extract_answer
    from trl_statelens.data import gsm8k_examples

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    rows = gsm8k_examples("lab", "dev", limit=limit)
    prompts = {"student": [r["prompt"] for r in rows],
               "teacher": [template.format(prompt=r["prompt"], privileged_context=r["privileged_context"]) for r in rows]}  # fmt: skip
    result = {"num_problems": len(rows), "template": template}
    for who, texts in prompts.items():
        loss, tokens, correct = 0.0, 0, 0
        for text, row in zip(texts, rows):
            prompt = tokenizer(text)["input_ids"]
            target = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            with torch.no_grad():
                logits = model(torch.tensor([prompt + target])).logits[0, len(prompt) - 1 : -1]
            loss += torch.nn.functional.cross_entropy(logits, torch.tensor(target), reduction="sum").item()
            tokens += len(target)
        for start in range(0, len(texts), 50):
            batch = tokenizer(texts[start : start + 50], return_tensors="pt", padding=True)
            with torch.no_grad():
                generated = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                           pad_token_id=tokenizer.pad_token_id)  # fmt: skip
            for ids, row in zip(generated[:, batch["input_ids"].size(1) :], rows[start : start + 50]):
                answer = extract_answer(tokenizer.decode(ids, skip_special_tokens=True), "strict")
                correct += answer == row["ground_truth"]
        result[who] = {"loss_per_token": loss / tokens, "greedy_accuracy": correct / len(rows)}
    return result


# ----- the rule --------------------------------------------------------------------------------------------------
def dev_curve(folder: Path) -> dict[int, float]:
    """Dev accuracy (strict, the recipes' score) at each scored step of a dev run, from its log history."""
    history = json.loads((folder / "log_history.json").read_text())
    return {e["step"]: e["eval/gsm8k/accuracy_strict"] for e in history if "eval/gsm8k/accuracy_strict" in e}


def smoothed(curve: dict[int, float]) -> dict[int, float]:
    """Each score averaged with its neighbouring evaluations (one neighbour at either end)."""
    steps = sorted(curve)
    return {s: float(np.mean([curve[t] for t in steps[max(0, i - 1) : i + 2]])) for i, s in enumerate(steps)}


def choose(out: Path, base_dev: float, methods=METHODS) -> dict:
    """Per method: `best` = its highest smoothed dev score over learning rates and steps; chosen = the fewest steps
    (then the lower learning rate) whose smoothed score is at least `best - MARGIN`. `moves` says whether the best
    is at least the base's dev score + MARGIN."""
    chosen = {}
    for method, (_, _, lrs, steps, _) in methods.items():
        candidates = []  # (steps, lr index, lr, smoothed score, raw score)
        for i, lr in enumerate(lrs):
            curve = dev_curve(dev_folder(out, method, lr))
            missing = [s for s in steps if s not in curve]
            if missing:  # a candidate without a score would drop out of the rule silently
                raise ValueError(f"{dev_folder(out, method, lr)} has no dev score at steps {missing}")
            smooth = smoothed(curve)
            candidates += [(s, i, lr, smooth[s], curve[s]) for s in steps]
        best = max(c[3] for c in candidates)
        pick = min(c for c in candidates if c[3] >= best - MARGIN - 1e-9)
        chosen[method] = {"learning_rate": pick[2], "steps": pick[0], "dev_smoothed": pick[3], "dev": pick[4],
                          "best_smoothed": best, "moves": bool(best >= base_dev + MARGIN - 1e-9),
                          "candidates": [{"steps": c[0], "learning_rate": c[2], "smoothed": c[3], "dev": c[4]}
                                         for c in sorted(candidates)]}  # fmt: skip
    return chosen


# ----- analysis ----------------------------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_items(folder: Path) -> dict[str, dict[str, float]]:
    items = folder / "eval" / "after.items.jsonl"
    return {task: item_scores(items, task, ITEM_SCORE[task]) for task in TASKS}


def interval_over_tasks(differences: list[np.ndarray], samples: int = BOOTSTRAP_SAMPLES, seed: int = 0):
    """95% bootstrap interval of the mean over tasks of each task's mean paired difference (`seeds x items` per
    task), resampling each task's items independently (the same resample for every seed)."""
    rng = np.random.default_rng(seed)
    means = np.zeros(samples)
    for d in differences:
        per_item = d.mean(0)
        means += per_item[rng.integers(0, per_item.size, size=(samples, per_item.size))].mean(1)
    means /= len(differences)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def comparisons(out: Path, seeds: list[int], methods: list[str]) -> list[dict]:
    """Each method against the base, and each self-distillation signal against SFT: per task and for the retention
    tasks together (Forgetting, base minus post: here post minus base, so negative is forgetting), paired per item
    and seed, with 95% bootstrap intervals over items."""
    base = run_items(out / "base")
    scores = {(m, s): run_items(test_folder(out, m, s)) for m in methods for s in seeds}
    pairs = [(m, "base") for m in methods] + [(m, "sft") for m in methods if m != "sft" and "sft" in methods]
    rows = []
    for method, reference in pairs:
        per_task = {}
        for task in TASKS:
            questions = sorted(base[task])
            refs = [base[task] if reference == "base" else scores[reference, s][task] for s in seeds]
            per_task[task] = np.array(
                [[scores[method, s][task][q] - ref[q] for q in questions] for s, ref in zip(seeds, refs)]
            )
        for task, d in per_task.items():
            low, high = paired_interval(d, samples=BOOTSTRAP_SAMPLES)
            rows.append(_comparison(method, reference, task, d.mean(1).tolist(), float(d.mean()), (low, high)))
        retention = [per_task[t] for t in RETENTION_TASKS]
        low, high = interval_over_tasks(retention)
        per_seed = np.mean([d.mean(1) for d in retention], axis=0).tolist()
        rows.append(_comparison(method, reference, "retention tasks", per_seed, float(np.mean(per_seed)), (low, high)))
    return rows


def _comparison(run, reference, task, per_seed, mean, ci) -> dict:
    return {"run": run, "reference": reference, "task": task, "per_seed": per_seed, "mean": mean, "ci95": list(ci),
            "real": bool(ci[0] > 0 or ci[1] < 0)}  # fmt: skip


def state_records(folder: Path) -> dict:
    """What a test run supervised (its ledger, `statelens/steps.jsonl`, averaged over steps; tokens summed) and how
    far it moved (the last probe's `base_kl`), with the self teacher's KL where the trainer logged it."""
    steps = read_jsonl(folder / "statelens" / "steps.jsonl")
    drift = read_jsonl(folder / "statelens" / "drift.jsonl")
    history = json.loads((folder / "log_history.json").read_text())

    def mean(key, rows=steps):
        values = [r[key] for r in rows if r.get(key) is not None]
        return float(np.mean(values)) if values else None

    return {
        "supervised_tokens": float(sum(r.get("supervised_tokens", 0.0) for r in steps)),
        **{f"source_frac/{s}": mean(f"source_frac/{s}") for s in ("dataset", "learner", "teacher")},
        "state_nll": mean("state_nll"),
        "offpolicy_gap": mean("offpolicy_gap"),
        "prefix_len/mean": mean("prefix_len/mean"),
        "teacher_kl": mean("teacher_kl/sampled", history),
        "base_kl": drift[-1].get("base_kl") if drift else None,
        "base_kl_topk": drift[-1].get("base_kl_topk") if drift else None,
        "mmd": drift[-1].get("mmd") if drift else None,
    }


def summarize(out: Path, seeds: list[int], methods: list[str]) -> dict:
    base_scores = json.loads((out / "base" / "results.json").read_text())["after"]["scores"]
    table = {}
    for method in methods:
        columns = {}
        for seed in seeds:
            folder = test_folder(out, method, seed)
            scores = json.loads((folder / "results.json").read_text())["after"]["scores"]
            values = {task: scores[task] for task in TASKS}
            try:
                values.update(retention_summary(base_scores, scores))
            except ValueError:  # a retention task the base scored 0 on (the smoke's random model)
                pass
            values.update({k: v for k, v in state_records(folder).items() if v is not None})
            for key, value in values.items():
                columns.setdefault(key, []).append(value)
        table[method] = {k: {"mean": float(np.mean(v)), "std": float(np.std(v, ddof=1)) if len(v) > 1 else 0.0,
                             "values": v} for k, v in columns.items()}  # fmt: skip
    return {"base": base_scores, "methods": table}


def markdown(summary: dict, chosen: dict, advantage: dict, rows: list[dict], seeds, minutes: float) -> str:
    fmt = lambda cell: f"{cell['mean']:.4f} ± {cell['std']:.4f}" if cell else "-"  # noqa: E731
    s, t = advantage["student"], advantage["teacher"]
    lines = [f"Self-distillation study on the lab, seeds {seeds}; this invocation took {minutes:.1f} minutes.", "",
             f"Teacher's advantage on {advantage['num_problems']} dev problems (the base behind the student's prompt "
             f"/ the self teacher's): loss per reference token {s['loss_per_token']:.4f} / {t['loss_per_token']:.4f},"
             f" greedy accuracy {s['greedy_accuracy']:.3f} / {t['greedy_accuracy']:.3f}.", "",
             "Chosen on dev (rule: STUDY.md): " + "; ".join(
                 f"{m} lr {c['learning_rate']} x {c['steps']} steps (smoothed dev {c['dev_smoothed']:.3f}, best "
                 f"{c['best_smoothed']:.3f}{'' if c['moves'] else ', does not move the target'})"
                 for m, c in chosen.items()), ""]  # fmt: skip
    columns = [*TASKS, "forgetting", "retention"]
    records = ["supervised_tokens", "source_frac/dataset", "source_frac/learner", "source_frac/teacher",
               "offpolicy_gap", "state_nll", "teacher_kl", "base_kl", "base_kl_topk"]  # fmt: skip
    for title, keys, with_base in (("Scores (test split), mean ± sd over seeds", columns, True),
                                   ("State records (test runs), mean ± sd over seeds", records, False)):  # fmt: skip
        lines += [f"{title}:", "", "| run | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        if with_base:
            lines.append("| base | " + " | ".join(f"{summary['base'][k]:.4f}" if k in summary["base"] else "-"
                                                 for k in keys) + " |")  # fmt: skip
        for method, row in summary["methods"].items():
            lines.append(f"| {method} | " + " | ".join(fmt(row.get(k)) for k in keys) + " |")
        lines.append("")
    lines += [f"Paired differences (run minus reference, per item and seed; 95% bootstrap interval over items, "
              f"{BOOTSTRAP_SAMPLES} resamples; 'real': excludes 0):", "",
              "| run - reference | task | per seed | mean | 95% interval | real |", "|---|---|---|---|---|---|"]  # fmt: skip
    for c in rows:
        per_seed = ", ".join(f"{v:+.3f}" for v in c["per_seed"])
        lines.append(f"| {c['run']} - {c['reference']} | {c['task']} | {per_seed} | {c['mean']:+.3f} | "
                     f"[{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}] | {'yes' if c['real'] else 'no'} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(summary: dict, rows: list[dict], path: Path) -> None:
    """Left: target gain against retention change (post - base), per seed and method. Right: base_kl at the end
    against the mean off-policy gap of the supervised states, per seed and method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for method, row in summary["methods"].items():
        target = next(r for r in rows if (r["run"], r["reference"], r["task"]) == (method, "base", "gsm8k"))
        retained = next(
            r for r in rows if (r["run"], r["reference"], r["task"]) == (method, "base", "retention tasks")
        )
        left.scatter(target["per_seed"], retained["per_seed"], label=method)
        if "base_kl" in row and "offpolicy_gap" in row:
            right.scatter(row["offpolicy_gap"]["values"], row["base_kl"]["values"], label=method)
    left.axhline(0, color="grey", lw=0.5)
    left.axvline(0, color="grey", lw=0.5)
    left.set(xlabel="target gain (lab math, test)", ylabel="retention change (mean of the two tasks)")
    right.set(xlabel="off-policy gap of the supervised states (mean over steps)", ylabel="base_kl at the end")
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----- the study ---------------------------------------------------------------------------------------------------
def estimate_seconds(methods=METHODS, seeds=SEEDS, jobs: int = 2) -> float:
    """Wall time at `jobs` runs at once, every method at its longest candidate on the test split (the upper bound)."""
    dev = sum(len(lrs) * (START + steps[-1] * PER_STEP[m] + len(steps) * DEV_EVAL)
              for m, (_, _, lrs, steps, _) in methods.items())  # fmt: skip
    test = len(seeds) * sum(START + steps[-1] * PER_STEP[m] + TEST_EVAL + 2 * PROBE
                            for m, (_, _, _, steps, _) in methods.items())  # fmt: skip
    base = 2 * START + TEST_EVAL + DEV_EVAL + 20.0  # two evaluations and the teacher's advantage
    return base + (dev + test) / jobs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/self-distill-study")
    parser.add_argument("--model_name_or_path", default="lab", help="the base model every run starts from")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one process (one torch thread) each")
    parser.add_argument("--smoke", action="store_true", help="tiny runs through every phase (the CI test)")
    parser.add_argument("--dry_run", action="store_true", help="print the runs and the estimated time; run nothing")
    parser.add_argument("--dev_only", action="store_true", help="stop after the dev runs and the choice")
    args = parser.parse_args()
    methods = METHODS
    if args.smoke:
        methods = {m: (r, c, lrs[:1], [1, 2], f) for m, (r, c, lrs, _, f) in METHODS.items() if m in SMOKE_METHODS}
    seeds = [0] if args.smoke else SEEDS
    if args.dry_run:
        for m, (recipe, config, lrs, steps, flags) in methods.items():
            print(f"{m}: {recipe}.py {config} lr {lrs} steps {steps} {' '.join(flags)}")
        print(f"{len(seeds)} seeds; estimated {estimate_seconds(methods, seeds, args.jobs) / 60:.1f} minutes at "
              f"--jobs {args.jobs} on a quiet machine (every method at its longest candidate)")  # fmt: skip
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model = ["--model_name_or_path", args.model_name_or_path]
    eval_smoke = SMOKE_EVAL if args.smoke else []

    # 1. the base, and what the privileged context gives it
    for folder, split in ((out / "base", []), (out / "base_dev", ["--eval_split", "dev", "--eval_tasks", "gsm8k"])):
        if not (folder / "results.json").exists():
            folder.mkdir(parents=True, exist_ok=True)
            run([sys.executable, str(RECIPES / "eval.py"), "--output_dir", str(folder), *model, *split, *eval_smoke],
                folder / "log.txt")  # fmt: skip
    base_path = json.loads((out / "base" / "results.json").read_text())["model"]
    base_dev = json.loads((out / "base_dev" / "results.json").read_text())["after"]["scores"]["gsm8k"]
    if not (out / "teacher_advantage.json").exists():
        import yaml

        template = yaml.safe_load((CONFIGS / "self_distill.yaml").read_text())["teacher_prompt_template"]
        advantage = teacher_advantage(base_path, template, 3 if args.smoke else None, 8 if args.smoke else 96)
        (out / "teacher_advantage.json").write_text(json.dumps(advantage, indent=2))
    advantage = json.loads((out / "teacher_advantage.json").read_text())

    # 2. dev runs (seed 0) and the rule
    dev_jobs = []
    for method, (_, _, lrs, steps, _) in methods.items():
        every = int(np.gcd.reduce(steps))
        for lr in lrs:
            folder = dev_folder(out, method, lr)
            extra = [*DEV, "--target_eval_steps", str(every)]
            dev_jobs.append((folder, command(method, folder, lr, steps[-1], 0, extra, model, args.smoke)))
    run_all(dev_jobs, args.jobs)
    chosen = choose(out, base_dev, methods)
    (out / "chosen.json").write_text(json.dumps({"base_dev": base_dev, "margin": MARGIN, **chosen}, indent=2))
    for method, c in chosen.items():
        print(f"chosen: {method} lr {c['learning_rate']} x {c['steps']} steps (smoothed dev {c['dev_smoothed']:.3f}, "
              f"best {c['best_smoothed']:.3f}, base {base_dev:.3f}{'' if c['moves'] else ': does not move the target'})")  # fmt: skip
    if args.dev_only:
        return

    # 3. test runs at the chosen settings, every seed
    test_jobs = []
    for seed in seeds:
        for method, c in chosen.items():
            folder = test_folder(out, method, seed)
            probes = ["--probe_steps", str(c["steps"]), "--target_eval_steps", "0"]
            test_jobs.append((folder, command(method, folder, c["learning_rate"], c["steps"], seed, probes, model,
                                              args.smoke)))  # fmt: skip
    run_all(test_jobs, args.jobs)
    summary = summarize(out, seeds, list(methods))
    rows = comparisons(out, seeds, list(methods))
    minutes = (time.perf_counter() - started) / 60
    (out / "summary.json").write_text(json.dumps({"seeds": seeds, "minutes": minutes, "teacher_advantage": advantage,
                                                  "chosen": chosen, **summary, "comparisons": rows}, indent=2))  # fmt: skip
    text = markdown(summary, chosen, advantage, rows, seeds, minutes)
    (out / "summary.md").write_text(text)
    plot(summary, rows, out / "self_distill.png")
    print(text)


if __name__ == "__main__":
    main()
