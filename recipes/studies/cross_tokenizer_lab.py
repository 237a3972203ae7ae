"""A teacher of another tokenizer on the lab (issue 45, item 5), as pre-registered in STUDY.md ("Pre-registration: a
teacher of another tokenizer on the lab"): reverse-KL OPD of the lab base from the lab math teacher, which shares
the student's tokenizer (`same`), against the same run from a math teacher of a second lab tokenizer (`cross`).

    python recipes/studies/cross_tokenizer_lab.py --seeds 0 1 2 --jobs 2 --out runs/cross-tokenizer-lab
    python recipes/studies/cross_tokenizer_lab.py --smoke --model_name_or_path M --same_teacher T --out /tmp/xt  # test

The second lab tokenizer is trained on the same world with the same vocabulary size, but keeps runs of digits whole
for its merges to join (the lab's splits digits one by one), so its merges differ too. Its teacher is built as the
lab's own: a lab-size base pretrained by `pretrain`'s defaults, then `build_teacher`'s fine-tuning on math answers
(300 steps of 16). The matching rule: while its dev math accuracy is more than `MATCH_BY` below the same-tokenizer
teacher's, 100 more steps on fresh problems, 600 steps at most. Cached in `--out/other/`.

Then per seed each arm: `recipes/opd.py` with the lab config (`opd.yaml`: 75 steps of 32 rollouts, lr 3e-4) and
`--signal reverse_kl` (the signal a teacher of another tokenizer supports). A third arm, added after the first
results (STUDY.md, amendment): `independent`, a teacher of the student's tokenizer pretrained from another seed and
fine-tuned the same way, as far from the student as the other tokenizer's teacher but reading its ids. Amendment 5
runs the three arms from each seed's own start (`--start`, the lab study's mild SFT) at another signal and budget
(`--signal`, `--learning_rate`, `--max_steps`), and compares each arm with its start too. `summary.json`
and `summary.md` in `--out`: scores over seeds, paired comparisons with 95% bootstrap intervals over test problems
(study_lab.py's), the teachers' own scores, the cross arm's `alignment/exact` (all tokens and digits) and
`alignment/per_decision_exact`, and `teacher_kl/sampled` at the first and last steps.
"""

import argparse
import json
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from study_lab import SCORES, SMOKE_FLAGS, compare_runs, comparison_table, folder_item_scores, run, run_item_scores

RECIPES = Path(__file__).resolve().parents[1]
CONFIG = RECIPES / "configs" / "lab" / "opd.yaml"
ARMS = ("same", "cross", "independent")
COMPARISONS = [
    ("teacher of another tokenizer vs the student's (students)", "cross", "same"),
    ("same-tokenizer teacher's student vs the base", "same", "base"),
    ("other-tokenizer teacher's student vs the base", "cross", "base"),
    # the post-hoc arm (STUDY.md, amendment 1): a teacher pretrained apart, of the student's tokenizer
    ("teacher of another tokenizer vs one of the student's, both pretrained apart (students)", "cross", "independent"),
    ("independently pretrained teacher's student vs the base", "independent", "base"),
]
TEACHER_STEPS, MORE_STEPS, MAX_TEACHER_STEPS = 300, 100, 600  # `build_teacher`'s 300 steps of 16, lr 5e-4
MATCH_BY = 0.05
EDGE_STEPS = 5  # teacher_kl "first" and "last": the mean over this many steps at each end
RUN_COLUMNS = ("teacher_kl_first", "teacher_kl_last", "alignment_exact", "alignment_exact_numbers",
               "alignment_per_decision_exact", "alignment_mapped")  # fmt: skip
# With each seed's own start (`--start`, amendment 5): each arm against it
FROM_START = [
    ("same-tokenizer teacher's student vs its start", "same", "start"),
    ("other-tokenizer teacher's student vs its start", "cross", "start"),
    ("independently pretrained teacher's student vs its start", "independent", "start"),
]


def build_teacher_from_scratch(out: Path, tokenizer, seed: int, same_teacher: str, smoke: bool) -> dict:
    """A lab-size base pretrained with `tokenizer` (seed `seed`) and its math teacher under `out`, by the lab's recipe
    and the matching rule; cached."""
    info_path = out / "info.json"
    if info_path.exists():
        return json.loads(info_path.read_text())
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_statelens.lab import LabWorld, build_model, fine_tune_on_answers, pretrain, score_math
    from trl_statelens.reports.runs import resolve_model

    world = LabWorld(seed=0)
    model = build_model("test" if smoke else "lab", tokenizer, seed=seed)
    settings = dict(max_steps=2, min_steps=2, batch_size=2, block=32) if smoke else {}
    pretrained = pretrain(model, tokenizer, world, out / "pretrain", seed=seed, **settings)
    model.save_pretrained(out / "base")
    tokenizer.save_pretrained(out / "base")

    dev = world.math("dev", n=8 if smoke else None)
    same = AutoModelForCausalLM.from_pretrained(resolve_model(same_teacher))
    same_dev = score_math(same, AutoTokenizer.from_pretrained(resolve_model(same_teacher)), dev)
    steps, batch = (2, 2) if smoke else (TEACHER_STEPS, 16)
    rows = world.math("train", n=MAX_TEACHER_STEPS * batch, seed=1)  # `build_teacher`'s problems, then fresh ones
    fine_tune_on_answers(model, tokenizer, rows[: steps * batch], steps, batch, 5e-4, desc="math teacher")
    history = [{"steps": steps, "dev_math": score_math(model, tokenizer, dev)}]
    while history[-1]["dev_math"] < same_dev - MATCH_BY and steps < MAX_TEACHER_STEPS and not smoke:
        more = rows[steps * batch : (steps + MORE_STEPS) * batch]
        fine_tune_on_answers(model, tokenizer, more, MORE_STEPS, batch, 5e-4, desc="math teacher")
        steps += MORE_STEPS
        history.append({"steps": steps, "dev_math": score_math(model, tokenizer, dev)})
    model.save_pretrained(out / "teacher")
    tokenizer.save_pretrained(out / "teacher")
    info = {"pretrain_steps": pretrained["steps"], "same_teacher_dev_math": same_dev, "fine_tuning": history,
            "vocab_size": len(tokenizer), "pretrain_seed": seed}  # fmt: skip
    info_path.write_text(json.dumps(info, indent=2))
    return info


def build_teachers(out: Path, student: str, same_teacher: str, smoke: bool) -> dict:
    """`other/`: the second lab tokenizer's teacher (seed 0, as the lab's); `independent/`: a teacher of the student's
    tokenizer pretrained from another seed (1), the post-hoc arm that holds the teacher's distance from the student
    apart from its tokenizer."""
    from transformers import AutoTokenizer

    from trl_statelens.lab import LabWorld, build_tokenizer
    from trl_statelens.reports.runs import resolve_model

    if not (out / "other" / "info.json").exists():
        tokenizer = build_tokenizer(LabWorld(seed=0), individual_digits=False, num_documents=2000 if smoke else 20000)
        tokenizer.save_pretrained(out / "other" / "tokenizer")
    other_tokenizer = AutoTokenizer.from_pretrained(out / "other" / "tokenizer")
    student_tokenizer = AutoTokenizer.from_pretrained(resolve_model(student))
    return {
        "cross": build_teacher_from_scratch(out / "other", other_tokenizer, 0, same_teacher, smoke),
        "independent": build_teacher_from_scratch(out / "independent", student_tokenizer, 1, same_teacher, smoke),
    }


def teacher_kl_ends(run_dir: Path) -> dict:
    """`teacher_kl/sampled` over the first and the last `EDGE_STEPS` logged steps, and the mean exact shares."""
    history = [e for e in json.loads((run_dir / "log_history.json").read_text()) if "teacher_kl/sampled" in e]
    kl = [e["teacher_kl/sampled"] for e in history]
    shares = {}
    for key in ("alignment/exact", "alignment/exact/numbers", "alignment/per_decision_exact", "alignment/mapped"):
        logged = [e[key] for e in history if key in e]
        shares[key.replace("/", "_")] = float(np.mean(logged)) if logged else None
    return {"teacher_kl_first": float(np.mean(kl[:EDGE_STEPS])), "teacher_kl_last": float(np.mean(kl[-EDGE_STEPS:])),
            **shares}  # fmt: skip


def number_signal(run_dir: Path, first: int, last: int) -> dict:
    """Over the ledger's sampled sequences of steps `first`-`last`: how many numbers of one digit and of several the
    student wrote, and the mean teacher-minus-student log-prob summed over each number's tokens (the signal its digits
    got; the ledger keeps a chunk's value shared out over its tokens, so the sum is the chunk's). None sampled: none
    counted."""
    counts, signal = {"one_digit": 0, "several_digits": 0}, {"one_digit": [], "several_digits": []}
    sampled = run_dir / "statelens" / "states.jsonl"  # (none when the ledger's sample rate drew no sequence)
    for line in sampled.read_text().splitlines() if sampled.exists() else []:
        sample = json.loads(line)
        if not first <= sample["step"] <= last:
            continue
        tokens, student, teacher = sample["tokens"], sample["logp"], sample["teacher_logp"]
        i = 0
        while i < len(tokens):
            if not tokens[i].isdigit():
                i += 1
                continue
            end = i
            while end + 1 < len(tokens) and tokens[end + 1].isdigit():
                end += 1
            kind = "one_digit" if end == i else "several_digits"
            counts[kind] += 1
            signal[kind].append(sum(teacher[k] - student[k] for k in range(i, end + 1) if teacher[k] is not None))
            i = end + 1
    return {kind: {"numbers": counts[kind], "mean_log_ratio": float(np.mean(v)) if v else None}
            for kind, v in signal.items()}  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("runs/cross-tokenizer-lab"))
    parser.add_argument("--model_name_or_path", default="lab", help="the student every run starts from")
    parser.add_argument("--same_teacher", default="lab-teacher", help="the teacher of the student's tokenizer")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, one torch thread each")
    parser.add_argument("--smoke", action="store_true", help="tiny other teacher, 2 steps per run (the CI test)")
    parser.add_argument("--start", help="each seed's start, with {seed} in it (runs/study-lab/seed{seed}/mild_sft), "
                        "instead of --model_name_or_path; the comparisons add each arm against its start")  # fmt: skip
    parser.add_argument("--signal", default="reverse_kl", choices=["reverse_kl", "divergence"])
    parser.add_argument("--learning_rate", help="the OPD learning rate (default: the lab config's)")
    parser.add_argument("--max_steps", help="the OPD steps (default: the lab config's)")
    args = parser.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    built = build_teachers(out, args.model_name_or_path, args.same_teacher, args.smoke)
    print(f"teachers built here: {json.dumps(built)}", flush=True)
    teachers = {"same": args.same_teacher, "cross": str(out / "other" / "teacher"),
                "independent": str(out / "independent" / "teacher")}  # fmt: skip
    eval_flags = SMOKE_FLAGS["eval"] if args.smoke else []
    smoke = [*SMOKE_FLAGS["opd"], *eval_flags] if args.smoke else []
    settings = [flag for name in ("learning_rate", "max_steps") if getattr(args, name)
                for flag in (f"--{name}", getattr(args, name))]  # fmt: skip

    commands = []  # (command, folder): the evaluations of the base and both teachers, then every arm of every seed
    for name, model in (("base", args.model_name_or_path), *((f"teacher_{a}", t) for a, t in teachers.items())):
        commands.append(([sys.executable, str(RECIPES / "eval.py"), "--output_dir", str(out / name),
                          "--model_name_or_path", model, *eval_flags], out / name))  # fmt: skip
    for seed in args.seeds:
        for arm in ARMS:
            folder = out / f"seed{seed}" / arm
            start = args.start.format(seed=seed) if args.start else args.model_name_or_path
            commands.append(([sys.executable, str(RECIPES / "opd.py"), "--config", str(CONFIG), "--seed", str(seed),
                              "--output_dir", str(folder), "--eval_before", "false", "--signal", args.signal,
                              "--model_name_or_path", start, "--teacher_model_name_or_path", teachers[arm],
                              *settings, *smoke], folder))  # fmt: skip
    todo = [(command, folder) for command, folder in commands if not (folder / "results.json").exists()]
    for _, folder in todo:
        folder.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1" if args.jobs > 1 else "")
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda job: run(job[0], job[1] / "log.txt"), todo))

    summary = {"seeds": args.seeds, "teachers": teachers, "built": built, "scores": {}, "runs": {}}
    for name in ("base", *(f"teacher_{arm}" for arm in ARMS)):
        scores = json.loads((out / name / "results.json").read_text())["after"]["scores"]
        summary["scores"][name] = {task: {"mean": scores[task], "values": [scores[task]]} for task in SCORES}
    for arm in ARMS:
        results = [json.loads((out / f"seed{s}" / arm / "results.json").read_text()) for s in args.seeds]
        summary["scores"][arm] = {task: {"mean": statistics.mean(v), "values": v} for task in SCORES
                                  for v in [[r["after"]["scores"][task] for r in results]]}  # fmt: skip
        runs, steps = [out / f"seed{s}" / arm for s in args.seeds], [r["global_steps"] for r in results]
        summary["runs"][arm] = {
            "train_seconds": [r["train_seconds"] for r in results],
            **{k: [teacher_kl_ends(run)[k] for run in runs] for k in RUN_COLUMNS},
            "numbers_first_10_steps": [number_signal(run, 1, 10) for run in runs],
            "numbers_last_10_steps": [number_signal(run, n - 9, n) for run, n in zip(runs, steps)],
        }
    in_folder = folder_item_scores(out)

    def scores_of(name, seed):
        return run_item_scores(Path(args.start.format(seed=seed))) if name == "start" else in_folder(name, seed)

    comparisons = COMPARISONS + (FROM_START if args.start else [])
    summary["start"], summary["settings"] = args.start, {"signal": args.signal, "opd": settings}
    summary["comparisons"] = compare_runs(scores_of, args.seeds, comparisons)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    text = summary_table(summary) + "\n" + comparison_table(summary["comparisons"], args.seeds)
    (out / "summary.md").write_text(text)
    print(text)


def summary_table(summary: dict) -> str:
    lines = [f"Seeds {summary['seeds']}; teachers: {summary['teachers']}.", "",
             "| model | " + " | ".join(SCORES) + " |", "|---" * (len(SCORES) + 1) + "|"]  # fmt: skip
    for name, scores in summary["scores"].items():
        lines.append(
            f"| {name} | " + " | ".join(", ".join(f"{v:.3f}" for v in scores[t]["values"]) for t in SCORES) + " |"
        )
    lines += [
        "",
        "| arm | train seconds | teacher_kl first | teacher_kl last | alignment/exact | alignment/exact/numbers | "
        "alignment/per_decision_exact | alignment/mapped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, run_ in summary["runs"].items():
        cells = [", ".join("-" if v is None else f"{v:.3f}" for v in run_[k])
                 for k in ("train_seconds", *RUN_COLUMNS)]  # fmt: skip
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += ["", "Numbers the student wrote in the ledger's sampled sequences, per seed, and the mean over them of "
              "the teacher-minus-student log-prob summed over each number's tokens:", "",
              "| arm | steps | one-digit numbers | their log-ratio | longer numbers | their log-ratio |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for arm, run_ in summary["runs"].items():
        for window, label in (("numbers_first_10_steps", "first 10"), ("numbers_last_10_steps", "last 10")):
            cells = []
            for kind in ("one_digit", "several_digits"):
                seeds = [seed[kind] for seed in run_[window]]
                cells.append(", ".join(str(seed["numbers"]) for seed in seeds))
                cells.append(", ".join("-" if seed["mean_log_ratio"] is None else f"{seed['mean_log_ratio']:.2f}"
                                       for seed in seeds))  # fmt: skip
            lines.append(f"| {arm} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
