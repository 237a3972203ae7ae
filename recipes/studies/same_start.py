"""OPD against RL from the same start, as pre-registered in STUDY.md ("OPD against RL from the same start:
pre-registration"): every arm starts from each seed's mild SFT of the lab study (`runs/study-lab`).

    python recipes/studies/same_start.py dev --jobs 2       # OPD's signal and learning rate, on dev (seed 0)
    python recipes/studies/same_start.py test --jobs 2      # grpo100 and the three OPD arms, seeds 0-2
    python recipes/studies/same_start.py compare            # items.json, result.json, result.md, the plot
    python recipes/studies/same_start.py check              # recompute result.json from the committed items.json

`dev` runs the four OPD candidates (`CANDIDATES`: `divergence` and `reverse_kl` at lr 1e-4 and 3e-4, 75 steps, the
lab math teacher) from seed 0's mild SFT, scored on 100 dev problems every 15 steps, and applies the rule (grpo_fair's
`choose_fair`: a candidate moves if its best smoothed score is its start + 0.03; the fewest FLOPs within 0.03 of the
best). `test` runs, per seed, `grpo100` (Table 2's GRPO arm continued to 100 steps) and the OPD arms at the choice:
`opd_lab_teacher`, `opd_rl_teacher` (the seed's `grpo100` as teacher) and `opd_shuffled_teacher` (`opd_lab_teacher`
with `--teacher_row_shift 1`). Table 2's `grpo` (25 steps) is the `grpo` arm. A run whose `results.json` exists is not
run again; `--jobs 2` runs two at once, one torch thread each.

`compare` gathers every number the result reads into one file (`items.json`: per run and seed the final item scores,
the target's item scores during training and the ledger's FLOPs in parts) and computes the result from that file
alone, so `check` can recompute it from the committed copy and fail on any difference.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from grpo_fair import GRPO_FLAGS, choose_fair
from self_distill_study import smoothed
from study_lab import BOOTSTRAP_SAMPLES, SCORES, compare_runs, comparison_table, run_item_scores

from trl_statelens.evaluation import item_scores
from trl_statelens.reports.run_folders import column, load_run, target_scores_during

RECIPES = Path(__file__).resolve().parents[1]
OPD_CONFIG = RECIPES / "configs" / "lab" / "opd.yaml"
GRPO_CONFIG = RECIPES / "configs" / "lab" / "grpo.yaml"
CANDIDATES = {
    "divergence_lr1e-4": ("divergence", "1e-4"),
    "divergence_lr3e-4": ("divergence", "3e-4"),
    "reverse_kl_lr1e-4": ("reverse_kl", "1e-4"),
    "reverse_kl_lr3e-4": ("reverse_kl", "3e-4"),
}
DEV_STEPS = 75
DEV_FLAGS = ["--eval_split", "dev", "--target_eval_steps", "15", "--target_eval_limit", "100", "--probe_steps", "25",
             "--seed", "0", "--lab_seed", "0"]  # fmt: skip
# Table 2's GRPO arm (the fair arm's choice, docs/study/grpo-fair-test/grpo_flags.json) continued to 100 steps
GRPO100_FLAGS = [*GRPO_FLAGS, "--max_steps", "100", "--learning_rate", "3e-5", "--target_eval_steps", "25",
                 "--probe_steps", "25"]  # fmt: skip
OPD_ARMS = {  # name: (teacher, extra flags); "{grpo100}" is the seed's grpo100 folder
    "opd_lab_teacher": ("lab-teacher", []),
    "opd_rl_teacher": ("{grpo100}", []),
    "opd_shuffled_teacher": ("lab-teacher", ["--teacher_row_shift", "1"]),
}
ARMS = ["grpo", "grpo100", *OPD_ARMS]  # `grpo`: Table 2's run, read from the lab study
FLOP_PARTS = ("student_generation", "student_training", "teacher_scoring", "teacher_writing")
COMPARISONS = [
    ("(b) lab teacher vs GRPO", "opd_lab_teacher", "grpo"),
    ("(c) RL teacher vs GRPO", "opd_rl_teacher", "grpo"),
    ("(b) lab teacher vs shuffled", "opd_lab_teacher", "opd_shuffled_teacher"),
    ("(c) RL teacher vs shuffled", "opd_rl_teacher", "opd_shuffled_teacher"),
    ("(b) lab teacher vs the start", "opd_lab_teacher", "mild_sft"),
    ("(c) RL teacher vs the start", "opd_rl_teacher", "mild_sft"),
    ("(d) shuffled vs the start", "opd_shuffled_teacher", "mild_sft"),
    ("(a) GRPO vs the start", "grpo", "mild_sft"),
    ("grpo100 (the RL teacher) vs the start", "grpo100", "mild_sft"),
]


# ----- running ------------------------------------------------------------------------------------------------------
def run_all(jobs: list[tuple[str, Path, list[str], list[str]]], workers: int) -> None:
    """`jobs`: (name, folder, command, names of the jobs it needs first), run `workers` at a time, one torch thread
    each when several run; a job whose folder holds `results.json` is done already."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if workers > 1 else dict(os.environ)
    done = {name for name, folder, *_ in jobs if (folder / "results.json").exists()}
    waiting = [job for job in jobs if job[0] not in done]
    running = []
    while waiting or running:
        for name, process in [r for r in running if r[1].poll() is not None]:
            if process.returncode:
                sys.exit(f"{name} failed ({process.returncode}); see its log.txt")
            done.add(name)
            running.remove((name, process))
            print(f"  done: {name}", flush=True)
        ready = [job for job in waiting if set(job[3]) <= done]
        while ready and len(running) < workers:
            name, folder, command, _ = job = ready.pop(0)
            waiting.remove(job)
            folder.mkdir(parents=True, exist_ok=True)
            print(f"{name}: {' '.join(command)}", flush=True)
            log = (folder / "log.txt").open("w")
            running.append((name, subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)))
        if waiting and not running:
            sys.exit(f"cannot start {[job[0] for job in waiting]}: what they need did not run")
        time.sleep(5)


def opd_command(folder: Path, start: Path, teacher: str, signal: str, lr: str, steps: int, extra: list[str]):
    return [sys.executable, str(RECIPES / "opd.py"), "--config", str(OPD_CONFIG), "--output_dir", str(folder),
            "--model_name_or_path", str(start), "--teacher_model_name_or_path", teacher, "--signal", signal,
            "--learning_rate", lr, "--max_steps", str(steps), *extra]  # fmt: skip


def dev_phase(study: Path, out: Path, workers: int) -> dict:
    start = study / "seed0" / "mild_sft"
    jobs = [(name, out / "dev" / name, opd_command(out / "dev" / name, start, "lab-teacher", signal, lr, DEV_STEPS,
                                                     DEV_FLAGS), [])
            for name, (signal, lr) in CANDIDATES.items()]  # fmt: skip
    run_all(jobs, workers)
    return choose_phase(out)


def choose_phase(out: Path) -> dict:
    """The pre-registered rule on the dev curves (step 0: the start, the mild SFT before any OPD step)."""
    curves = {}
    for name in CANDIDATES:
        trained = load_run(out / "dev" / name)
        steps, greedy = target_scores_during(trained, "accuracy_strict")
        if steps[0] != 0:
            sys.exit(f"{out / 'dev' / name}: no step-0 dev score, so no start to judge a move against")
        flops = column(trained.steps, "flops_total/total")
        at = trained.steps["step"].to_numpy()
        curves[name] = {"start": float(greedy[0]), "start_sampled": None, "start_flops": 0.0,
                        "steps": [int(s) for s in steps[1:]], "greedy": [float(g) for g in greedy[1:]],
                        "sampled": [None] * (len(steps) - 1),
                        "flops": [float(flops[np.searchsorted(at, s, side="right") - 1]) for s in steps[1:]]}  # fmt: skip
    result = choose_fair(curves)
    chosen = result["chosen"]
    signal, lr = CANDIDATES[chosen["candidate"]]
    result["setting"] = {"signal": signal, "learning_rate": lr, "max_steps": chosen["step"]}
    (out / "chosen.json").write_text(json.dumps(result, indent=2))
    lines = ["| candidate | start | best smoothed | moves |", "|---|---:|---:|---|"]
    for name, s in result["starts"].items():
        lines.append(f"| {name} | {s['start']:.3f} | {s['best_smoothed']:.3f} | {'yes' if s['moves'] else 'no'} |")
    lines += ["", "| candidate | step | greedy | smoothed | FLOPs |", "|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        mark = " (chosen)" if r == chosen else ""
        lines.append(f"| {r['candidate']}{mark} | {r['step']} | {r['greedy']:.3f} | {r['smoothed']:.3f} | "
                     f"{r['flops']:.3e} |")  # fmt: skip
    verdict = "moves" if result["moves"] else "does NOT move (the highest smoothed score, labelled as not moving)"
    lines += ["", f"Chosen: {chosen['candidate']} at {chosen['step']} steps ({signal}, lr {lr}); OPD {verdict}."]
    (out / "dev.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def test_phase(study: Path, out: Path, seeds: list[int], workers: int) -> None:
    setting = json.loads((out / "chosen.json").read_text())["setting"]
    jobs = []
    for seed in seeds:
        folder, start = out / f"seed{seed}", study / f"seed{seed}" / "mild_sft"
        grpo100 = folder / "grpo100"
        jobs.append((f"seed{seed}/grpo100", grpo100, [sys.executable, str(RECIPES / "grpo.py"), "--config",
                     str(GRPO_CONFIG), "--seed", str(seed), "--output_dir", str(grpo100), "--eval_before", "false",
                     "--model_name_or_path", str(start), *GRPO100_FLAGS], []))  # fmt: skip
        for name, (teacher, extra) in OPD_ARMS.items():
            flags = ["--seed", str(seed), "--eval_before", "false", "--target_eval_steps", "15",
                     "--target_eval_limit", "100", "--probe_steps", "25", *extra]  # fmt: skip
            command = opd_command(folder / name, start, teacher.format(grpo100=grpo100), setting["signal"],
                                  setting["learning_rate"], setting["max_steps"], flags)  # fmt: skip
            needs = [f"seed{seed}/grpo100"] if "{grpo100}" in teacher else []
            jobs.append((f"seed{seed}/{name}", folder / name, command, needs))
    run_all(jobs, workers)


# ----- the records: every number the result reads, in one file -----------------------------------------------------
def run_folder(study: Path, out: Path, name: str, seed: int | None) -> Path:
    if name == "base":
        return study / "base"
    return (study if name in ("grpo", "mild_sft") else out) / f"seed{seed}" / name


def collect(study: Path, out: Path, seeds: list[int]) -> dict:
    """Per run and seed: the final item scores by task, the target's item scores at each evaluation during training
    (GSM8K-lab test, greedy strict), and the ledger's FLOPs in parts at the last step and at each of those evaluations;
    the base's final items; the lab teacher's test math and the FLOPs of its making."""
    records = {"seeds": seeds, "base": run_item_scores(study / "base"), "runs": {}}
    for name in ["mild_sft", *ARMS]:
        records["runs"][name] = {}
        for seed in seeds:
            folder = run_folder(study, out, name, seed)
            trained = load_run(folder)
            at = trained.steps["step"].to_numpy()
            parts = {part: np.r_[0.0, column(trained.steps, f"flops_total/{part}")] for part in FLOP_PARTS}
            during = {}
            for items in sorted((folder / "eval" / "steps").glob("step*.items.jsonl")):
                step = int(items.name[len("step") : -len(".items.jsonl")])
                index = np.searchsorted(at, step, side="right")
                during[step] = {"items": item_scores(items, "gsm8k", "correct_strict"),
                                "flops": {p: float(v[index]) for p, v in parts.items()}}  # fmt: skip
            records["runs"][name][str(seed)] = {
                "final": run_item_scores(folder),
                "flops": {p: float(v[-1]) for p, v in parts.items()},
                "during": {str(step): during[step] for step in sorted(during)},
            }
    records["lab_teacher"] = lab_teacher_record()
    return records


def lab_teacher_record() -> dict:
    """`lab-teacher`'s test scores (from the lab's `info.json`) and the FLOPs of its making: its fine-tuning's tokens
    (the rows `build_teacher` trains on, prompt included: the forward runs over them) x 6 x its matmul parameters."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_statelens.lab.build import LabWorld, format_plain, lab_dir
    from trl_statelens.lens.compute import matmul_parameters
    from trl_statelens.reports.runs import resolve_model

    path = Path(resolve_model("lab-teacher"))
    info = json.loads((lab_dir(0) / "info.json").read_text())["teacher"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = LabWorld(seed=0).math("train", n=info["steps"] * 16, seed=1)
    tokens = sum(len(tokenizer(format_plain(r["question"], r["answer"]) + tokenizer.eos_token)["input_ids"])
                 for r in rows)  # fmt: skip
    parameters = matmul_parameters(AutoModelForCausalLM.from_pretrained(path))
    return {"info": info, "making_flops": 6.0 * parameters * tokens}


def _item_scores_converted(records: dict, convert) -> dict:
    """`records` with `convert(scores, task)` applied to every item-score entry: the base's first, then each run's
    final and during-training ones (the order [`packed`] lists questions in)."""
    base = {task: convert(scores, task) for task, scores in records["base"].items()}

    def run(entry: dict) -> dict:
        return {"final": {task: convert(scores, task) for task, scores in entry["final"].items()},
                "flops": entry["flops"],
                "during": {step: {"items": convert(at["items"], "gsm8k"), "flops": at["flops"]}
                           for step, at in entry["during"].items()}}  # fmt: skip

    runs = {name: {seed: run(entry) for seed, entry in seeds.items()} for name, seeds in records["runs"].items()}
    return {**records, "base": base, "runs": runs}


def packed(records: dict) -> dict:
    """`records` with each item-score dict written as a string of 0/1 over its task's questions, listed once (each
    score is right or wrong): the committed form, a tenth of the size. [`unpacked`] gives the records back."""
    questions = {}

    def pack(scores: dict, task: str) -> str:
        order = questions.setdefault(task, sorted(scores))
        if not set(scores) <= set(order):
            raise ValueError(f"{task}: items outside the questions seen first")
        if any(scores[q] not in (0.0, 1.0) for q in scores):
            raise ValueError(f"{task}: a score other than 0 or 1 cannot be packed")
        return "".join("." if q not in scores else str(int(scores[q])) for q in order)

    return {**_item_scores_converted(records, pack), "questions": questions}


def unpacked(records: dict) -> dict:
    questions = records["questions"]

    def unpack(scores: str, task: str) -> dict:
        return {q: float(c) for q, c in zip(questions[task], scores, strict=True) if c != "."}

    out = _item_scores_converted(records, unpack)
    del out["questions"]
    return out


# ----- the result, from the records alone ---------------------------------------------------------------------------
def analyse(records: dict) -> dict:
    seeds = records["seeds"]
    runs = records["runs"]

    def scores_of(name, seed):
        return records["base"] if name == "base" else runs[name][str(seed)]["final"]

    table = {}
    for name in ["mild_sft", *ARMS]:
        per_seed = {task: [float(np.mean(list(scores_of(name, s)[task].values()))) for s in seeds] for task in SCORES}
        table[name] = {task: {"mean": float(np.mean(v)), "std": float(np.std(v, ddof=1)) if len(v) > 1 else 0.0,
                              "values": v} for task, v in per_seed.items()}  # fmt: skip
    comparisons = compare_runs(scores_of, seeds, COMPARISONS)
    compute = {name: _flops_in_parts(records, name) for name in ARMS}
    ratios = {arm: {reading: opd_to_grpo_ratio(records, arm, warm) for reading, warm in
                    (("warm_start_excluded", False), ("warm_start_included", True))}
              for arm in OPD_ARMS}  # fmt: skip
    return {"seeds": seeds, "table": table, "comparisons": comparisons, "compute": compute, "ratios": ratios,
            "start_on_curve_problems": start_on_curve_problems(records), "lab_teacher": records["lab_teacher"]}  # fmt: skip


def _flops_in_parts(records: dict, name: str) -> dict:
    """Seed means: the warm start (the mild SFT's training), the student (generation, training), the teacher
    (scoring, writing, as run) and, outside the ratio, the teacher's making."""
    seeds = [str(s) for s in records["seeds"]]
    mean = lambda run, part: float(np.mean([records["runs"][run][s]["flops"][part] for s in seeds]))  # noqa: E731
    warm = sum(mean("mild_sft", p) for p in FLOP_PARTS)
    student = mean(name, "student_generation") + mean(name, "student_training")
    teacher = mean(name, "teacher_scoring") + mean(name, "teacher_writing")
    making = 0.0
    if name == "opd_rl_teacher":
        making = sum(mean("grpo100", p) for p in FLOP_PARTS)  # its teacher's 100 GRPO steps (past the warm start)
    elif name in ("opd_lab_teacher", "opd_shuffled_teacher"):
        making = records["lab_teacher"]["making_flops"]
    return {"warm_start": warm, "student": student, "teacher": teacher, "teacher_making": making,
            "total_without_warm_start": student + teacher, "total_with_warm_start": warm + student + teacher}  # fmt: skip


def curve_arrays(records: dict, name: str, warm: bool) -> tuple[list[int], np.ndarray, np.ndarray]:
    """One run's evaluations during training: (steps, item scores `(seeds, steps, problems)` with each seed's problems
    sorted, FLOPs as run `(seeds, steps)`: student and teacher, the warm start's added when `warm`)."""
    per_seed = [records["runs"][name][str(s)] for s in records["seeds"]]
    steps = sorted(int(step) for step in per_seed[0]["during"])
    items = np.array([[[run["during"][str(t)]["items"][q] for q in sorted(run["during"][str(t)]["items"])]
                       for t in steps] for run in per_seed])  # fmt: skip
    flops = np.array([[sum(run["during"][str(t)]["flops"].values()) for t in steps] for run in per_seed])
    if warm:
        flops = flops + _flops_in_parts(records, name)["warm_start"]
    return steps, items, flops


def mean_curve(arrays, positions) -> tuple[list[int], list[float], list[float]]:
    """(steps, seed-mean score smoothed as the rule smooths, seed-mean FLOPs) on the problems at `positions`."""
    steps, items, flops = arrays
    scores = items[:, :, positions].mean(-1).mean(0)
    smooth = smoothed(dict(zip(steps, scores.tolist())))
    return steps, [smooth[s] for s in steps], flops.mean(0).tolist()


def opd_to_grpo_ratio(records: dict, arm: str, warm: bool) -> dict:
    """The pre-registered ratio: the FLOPs at which the OPD arm's seed-mean smoothed curve first reaches GRPO's best
    point (grpo100's curve: Table 2's `grpo` is its first 25 steps, to the digit) over GRPO's FLOPs there; its 95%
    interval from a bootstrap over the 100 problems (one resample for every run and seed; a resample where OPD never
    reaches GRPO's best counts as an infinite ratio, and is counted)."""
    grpo_arrays, opd_arrays = curve_arrays(records, "grpo100", warm), curve_arrays(records, arm, warm)
    count = grpo_arrays[1].shape[-1]

    def ratio(positions):
        grpo_steps, grpo, grpo_flops = mean_curve(grpo_arrays, positions)
        best = int(np.argmax(grpo))
        steps, opd, opd_flops = mean_curve(opd_arrays, positions)
        reached = next((i for i, score in enumerate(opd) if score >= grpo[best]), None)
        return {"grpo_best": grpo[best], "grpo_step": grpo_steps[best], "grpo_flops": grpo_flops[best],
                "opd_step": None if reached is None else steps[reached],
                "opd_flops": None if reached is None else opd_flops[reached],
                "opd_best": max(opd), "opd_end_flops": opd_flops[-1],
                "ratio": None if reached is None else opd_flops[reached] / grpo_flops[best]}  # fmt: skip

    result = ratio(np.arange(count))
    rng = np.random.default_rng(0)
    resampled = [ratio(rng.integers(0, count, count))["ratio"] for _ in range(BOOTSTRAP_SAMPLES)]
    values = np.array([np.inf if r is None else r for r in resampled])
    low, high = np.quantile(values, [0.025, 0.975], method="nearest")
    result.update({"ci95": [float(low), float(high)], "resamples_never_reached": int(np.isinf(values).sum())})
    return result


# ----- the phases that write and check the records ------------------------------------------------------------------
def compare_phase(study: Path, out: Path, seeds: list[int], records_dir: Path) -> dict:
    records = collect(study, out, seeds)
    result = analyse(records)
    records_dir.mkdir(parents=True, exist_ok=True)
    (records_dir / "items.json").write_text(json.dumps(packed(records), separators=(",", ":")))
    (records_dir / "result.json").write_text(json.dumps(result, indent=2))
    (records_dir / "result.md").write_text(result_markdown(result))
    for name in ("chosen.json", "dev.md"):
        (records_dir / name).write_text((out / name).read_text())
    plot_compute(records, result, records_dir / "target_vs_flops.png")
    print(result_markdown(result))
    return result


def check_phase(records_dir: Path) -> None:
    """Recompute `result.json` from the committed `items.json`; exit 1 naming the first number that differs."""
    committed = json.loads((records_dir / "result.json").read_text())
    again = json.loads(json.dumps(analyse(unpacked(json.loads((records_dir / "items.json").read_text())))))
    differences = _differences(committed, again)
    if differences:
        sys.exit(f"{records_dir}/result.json differs from its recomputation: {differences[:5]}")
    print(f"{records_dir}/result.json recomputed from items.json: every number equal")


def _differences(a, b, where="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = set(a) | set(b)
        return [d for k in sorted(keys, key=str) for d in _differences(a.get(k), b.get(k), f"{where}/{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        return [] if np.isclose(a, b, rtol=1e-9, atol=1e-12) or (np.isinf(a) and a == b) else [f"{where}: {a} != {b}"]
    return [] if a == b else [f"{where}: {a} != {b}"]


def result_markdown(result: dict) -> str:
    seeds = result["seeds"]
    lines = [f"OPD against RL from the same start (each seed's mild SFT), seeds {seeds}: test scores, mean ± SD over "
             "seeds (GSM8K-lab: greedy strict accuracy).", "", "| run | " + " | ".join(SCORES) + " |",
             "|---" * (len(SCORES) + 1) + "|"]  # fmt: skip
    for name, row in result["table"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[t]['mean']:.3f} ± {row[t]['std']:.3f}" for t in SCORES) + " |")
    teacher = result["lab_teacher"]["info"]
    lines += ["", f"lab-teacher (not trained here): test scores {json.dumps(teacher.get('scores', teacher))}", ""]
    lines.append(comparison_table(result["comparisons"], seeds))
    lines += ["Compute in parts (seed means, FLOPs as run; the teacher's making outside every ratio):", "",
              "| arm | warm start | student | teacher | total without / with the warm start | teacher's making |",
              "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, c in result["compute"].items():
        lines.append(f"| {name} | {c['warm_start']:.3e} | {c['student']:.3e} | {c['teacher']:.3e} | "
                     f"{c['total_without_warm_start']:.3e} / {c['total_with_warm_start']:.3e} | "
                     f"{c['teacher_making']:.3e} |")  # fmt: skip
    lines += ["", "OPD's FLOPs to reach GRPO's best (grpo100's smoothed seed-mean curve on the 100 problems scored "
              f"during training, where the start scores {result['start_on_curve_problems']:.3f}) over GRPO's there:",
              "",
              "| arm | reading | GRPO's best (step) | OPD reaches it at step | ratio | 95% interval | resamples never "
              "reached |", "|---|---|---|---|---:|---|---:|"]  # fmt: skip
    for arm, readings in result["ratios"].items():
        for reading, r in readings.items():
            ratio = "never" if r["ratio"] is None else f"{r['ratio']:.2f}"
            step = "never (best smoothed " + f"{r['opd_best']:.3f})" if r["opd_step"] is None else str(r["opd_step"])
            lines.append(f"| {arm} | {reading.replace('_', ' ')} | {r['grpo_best']:.3f} ({r['grpo_step']}) | {step} "
                         f"| {ratio} | [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}] | {r['resamples_never_reached']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def start_on_curve_problems(records: dict) -> float:
    """The mild SFT's score (its final evaluation) on the problems the curves are scored on, seed mean."""
    scores = []
    for seed in records["seeds"]:
        curve = next(iter(records["runs"]["grpo100"][str(seed)]["during"].values()))["items"]
        final = records["runs"]["mild_sft"][str(seed)]["final"]["gsm8k"]
        scores.append(np.mean([final[q] for q in curve]))
    return float(np.mean(scores))


def plot_compute(records: dict, result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    styles = {"grpo100": "-", "opd_lab_teacher": "--", "opd_rl_teacher": "-.", "opd_shuffled_teacher": ":"}
    start = start_on_curve_problems(records)
    for axes, warm in zip(panels, (False, True)):
        collapsed = []
        for colour, (name, style) in enumerate(styles.items()):
            arrays = curve_arrays(records, name, warm)
            _, scores, flops = mean_curve(arrays, np.arange(arrays[1].shape[-1]))
            if max(scores) < start / 2:  # drawn on the axis it would flatten the others: named instead
                collapsed.append(f"{name}: at most {max(scores):.3f} at every point, below the axis")
                continue
            axes.plot(flops, scores, linestyle=style, marker="o", color=f"C{colour}", label=name)
        axes.axhline(start, color="gray", linewidth=0.8, label=f"the start (mild SFT, same problems): {start:.3f}")
        best = result["ratios"]["opd_lab_teacher"]["warm_start_included" if warm else "warm_start_excluded"]
        axes.axhline(best["grpo_best"], color="black", linestyle=":", linewidth=0.8, label="GRPO's best")
        if collapsed:
            axes.text(0.02, 0.97, "\n".join(collapsed), transform=axes.transAxes, fontsize=8, color="C3", va="top")
        axes.set_ylim(bottom=start - 0.02)
        axes.set_xscale("log")
        axes.set_xlabel("FLOPs as run, " + ("the warm start included" if warm else "the warm start excluded"))
        axes.set_title("warm start included" if warm else "warm start excluded (as Qwen3, Thinking Machines)")
    panels[0].set_ylabel("GSM8K-lab test accuracy (100 problems, greedy, smoothed)")
    panels[0].legend(fontsize=8, loc="lower right")
    figure.suptitle(f"From the same start, seed mean of {len(records['seeds'])}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["dev", "choose", "test", "compare", "check"])
    parser.add_argument("--study", type=Path, default=Path("runs/study-lab"), help="the lab study (the starts, grpo)")
    parser.add_argument("--out", type=Path, default=Path("runs/same-start"))
    parser.add_argument("--records", type=Path, default=Path("docs/study/same-start"), help="committed records")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, one torch thread each")
    args = parser.parse_args()
    if args.phase == "dev":
        dev_phase(args.study, args.out, args.jobs)
    elif args.phase == "choose":
        choose_phase(args.out)
    elif args.phase == "test":
        test_phase(args.study, args.out, args.seeds, args.jobs)
    elif args.phase == "compare":
        compare_phase(args.study, args.out, args.seeds, args.records)
    else:
        check_phase(args.records)
