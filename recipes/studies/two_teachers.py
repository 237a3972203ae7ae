"""Two teachers with different strengths on the lab (issue 27, item 5): OPD on a mix of math and knowledge-base (kb)
prompts, each row routed by its `teacher_id` column, against each single teacher on the same prompts.

    make two-teachers      # = python recipes/studies/two_teachers.py --seeds 0 1 --jobs 2 --out runs/two-teachers
    python recipes/studies/two_teachers.py --smoke --model_name_or_path MODEL --math_teacher TEACHER --out /tmp/tt  # the test

The teachers: `lab-teacher` (the lab base fine-tuned on lab math: strong at math, it forgot part of the kb) and a kb
teacher, the lab base fine-tuned on the kb's `dev` split (90 questions with their answers, answer tokens only, never
a `test` item; built here on first use, cached in `lab_dir(seed)/kb-teacher`). The prompts: lab math train problems
routed `teacher_id=math`, and a `KB_SHARE` of kb `dev` questions routed `teacher_id=kb` (the student answers, the
routed teacher scores its answer under the lab OPD settings: `divergence`, jsd_beta 1). Arms, same prompts and seeds:

- `two_teachers`: math rows to the math teacher, kb rows to the kb teacher;
- `math_teacher` / `kb_teacher`: every row to that one teacher. They route by task too, both names to the same teacher
  (a router of one teacher twice equals that teacher alone, tests/test_multi_teacher.py), so every arm logs
  `teacher_kl/sampled/{math,kb}` and `statelens/supervised_tokens/{math,kb}` per task.

Scores: target gsm8k (lab math test), retention mmlu (kb test: facts of entities the kb teacher never saw) and
truthfulqa (truth test), and `kb_dev` (the routed kb prompts' own questions: what the kb teacher knows). Outputs in
`--out`: `base/`, `teacher_math/`, `teacher_kb/` (evaluations), `seed<s>/<arm>/` (run folders with their reports),
`seed<s>/report/`, `summary.json` and `summary.md` (scores over seeds, paired differences with 95% bootstrap intervals
over test items (recipes/studies/study_lab.py's), and the per-task teacher metrics from each run's logs and ledger).

Time, estimated from a 5-step timing of the `two_teachers` arm (2026-12-01, one torch thread): 10.5 s a step of 32
prompts at load average 5 on the 2 cores (other jobs on the machine), about 6 s on a quiet machine (0.22 s a rollout,
recipes/studies/forgetting_study.py's divergence figure; kb rows are a few tokens). Per run add about 45 s (start, the
evaluation after, report, probe). 6 runs of 20 steps and 3 evaluations, 2 at once, the kb teacher (20 s) and the
summary (30 s): about 10 minutes on a quiet machine, about 17 at load 5.
"""

import argparse
import json
import os
import random
import shutil
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from study_lab import BOOTSTRAP_SAMPLES, SCORES, SMOKE_FLAGS, compare_runs, comparison_table, folder_item_scores, run

RECIPES = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(RECIPES))  # each arm runs recipes/opd.py's `main` in its own process (`train`)
CONFIG = RECIPES / "configs" / "lab" / "opd.yaml"
ROUTES = ("math", "kb")  # teacher_id values: the prompt's task
ARMS = {  # arm -> teacher of each route
    "two_teachers": {"math": "math", "kb": "kb"},
    "math_teacher": {"math": "math", "kb": "math"},
    "kb_teacher": {"math": "kb", "kb": "kb"},
}
COMPARISONS = [
    ("two teachers vs the math teacher alone", "two_teachers", "math_teacher"),
    ("two teachers vs the kb teacher alone", "two_teachers", "kb_teacher"),
    ("two teachers vs the base", "two_teachers", "base"),
    ("math teacher alone vs the base", "math_teacher", "base"),
]
KB_SHARE = 0.25  # of the prompts; the kb `dev` split has 90 questions, repeated as needed
KB_TEACHER = dict(steps=20, batch_size=16, lr=5e-4)  # about 3.5 epochs over the 90 kb dev answers
STEPS = 20
LAST_STEPS = 5  # teacher_kl "last": mean of the last this many steps


def build_kb_teacher(base: str, out: Path, lab_seed: int, steps: int = KB_TEACHER["steps"]) -> Path:
    """The kb teacher: `base` fine-tuned on the kb `dev` split's questions and answers (never `test`), as
    `build_teacher` fine-tunes the math teacher; cached in `out`."""
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_statelens.lab import LabWorld, fine_tune_on_answers

    rows = [
        {"question": r["question"], "answer": r["choices"][r["answer"]]} for r in LabWorld(seed=lab_seed).kb("dev")
    ]
    batch_size = KB_TEACHER["batch_size"]
    epochs = [random.Random(epoch).sample(rows, len(rows)) for epoch in range(steps * batch_size // len(rows) + 1)]
    model, tokenizer = AutoModelForCausalLM.from_pretrained(base), AutoTokenizer.from_pretrained(base)
    ordered = [row for epoch in epochs for row in epoch][: steps * batch_size]
    fine_tune_on_answers(model, tokenizer, ordered, steps, batch_size, KB_TEACHER["lr"], desc="kb teacher")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def mixed_prompts(num_rows: int, seed: int, lab_seed: int):
    """`num_rows` prompts: lab math train problems (`teacher_id=math`) and a `KB_SHARE` of kb dev questions
    (`teacher_id=kb`); the trainer shuffles them."""
    from datasets import Dataset

    from trl_statelens.data import load_gsm8k
    from trl_statelens.lab import LabWorld, format_plain

    num_kb = round(KB_SHARE * num_rows)
    math = load_gsm8k("lab", "train", limit=num_rows - num_kb, seed=seed, lab_seed=lab_seed)["prompt"]
    kb = [format_plain(r["question"]) for r in LabWorld(seed=lab_seed).kb("dev")]
    rows = [{"prompt": p, "teacher_id": "math"} for p in math]
    rows += [{"prompt": kb[i % len(kb)], "teacher_id": "kb"} for i in range(num_kb)]
    return Dataset.from_list(rows)


def train(argv: list[str]) -> None:
    """One arm: recipes/opd.py's run (`argv`: its flags) on the mixed prompts."""
    from opd import OPDScriptArguments
    from opd import main as opd_main
    from trl import ModelConfig, TrlParser

    from trl_statelens import OnPolicyDistillConfig

    args, training_args, model_args = TrlParser(
        (OPDScriptArguments, OnPolicyDistillConfig, ModelConfig)
    ).parse_args_and_config(args=argv)
    rows = training_args.max_steps * training_args.per_device_train_batch_size // training_args.num_generations
    opd_main(args, training_args, model_args, dataset=mixed_prompts(rows, training_args.seed, args.lab_seed))


def kb_dev_accuracy(model_path: str, lab_seed: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_statelens.lab import LabWorld, score_multiple_choice

    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_path), AutoTokenizer.from_pretrained(model_path)
    return score_multiple_choice(model, tokenizer, LabWorld(seed=lab_seed).kb("dev"))


def route_metrics(run_dir: Path) -> dict:
    """Per route: `teacher_kl/sampled/<route>` at the first step with rows of it and over the last `LAST_STEPS` such steps (the
    trainer's logs, one entry a step), supervised tokens in all (the logs), and the ledger's supervised tokens in all (`steps.jsonl`, every
    route) and sampled sequences per route (`states.jsonl`)."""
    history = json.loads((run_dir / "log_history.json").read_text())
    ledger = run_dir / "statelens"
    steps = [json.loads(line) for line in (ledger / "steps.jsonl").read_text().splitlines()]
    sampled = ledger / "states.jsonl"  # (none when `ledger_sample_rate` drew no sequence)
    states = [json.loads(line) for line in sampled.read_text().splitlines()] if sampled.exists() else []
    out = {"ledger_supervised_tokens": sum(step["supervised_tokens"] for step in steps)}
    for route in ROUTES:
        kl = [entry[f"teacher_kl/sampled/{route}"] for entry in history if f"teacher_kl/sampled/{route}" in entry]
        tokens = [entry[f"statelens/supervised_tokens/{route}"] for entry in history
                  if f"statelens/supervised_tokens/{route}" in entry]  # fmt: skip
        out[route] = {
            "teacher_kl_first": kl[0] if kl else None,
            "teacher_kl_last": statistics.mean(kl[-LAST_STEPS:]) if kl else None,
            "supervised_tokens": sum(tokens),
            "ledger_sequences": sum(state["teacher"] == route for state in states),
        }
    return out


def summarize(out: Path, seeds: list[int], lab_seed: int) -> dict:
    """Scores (per seed, mean, sd) of the base, the teachers and every arm; every arm's route metrics per seed."""

    def scores(run_dir: Path) -> dict:
        after = json.loads((run_dir / "results.json").read_text())["after"]["scores"]
        return {**{task: after[task] for task in SCORES}, "kb_dev": kb_dev_accuracy(model_of(run_dir), lab_seed)}

    table = {
        name: {k: spread([v]) for k, v in scores(out / name).items()}
        for name in ("base", "teacher_math", "teacher_kb")
    }
    routes = {}
    for arm in ARMS:
        per_seed = [scores(out / f"seed{seed}" / arm) for seed in seeds]
        table[arm] = {k: spread([s[k] for s in per_seed]) for k in per_seed[0]}
        routes[arm] = [route_metrics(out / f"seed{seed}" / arm) for seed in seeds]
    return {"scores": table, "routes": routes}


def model_of(run_dir: Path) -> str:
    results = json.loads((run_dir / "results.json").read_text())
    return results["model"] if results["recipe"] == "eval" else str(run_dir)


def spread(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}  # fmt: skip


def markdown(summary: dict, comparisons: list[dict], seeds: list[int]) -> str:
    columns = [*SCORES, "kb_dev"]
    lines = [f"Two teachers on the lab, seeds {seeds}: scores, mean ± sd over seeds (gsm8k: math test, the target; "
             "mmlu: kb test and truthfulqa: truth test, retention; kb_dev: the routed kb prompts' questions).", "",
             "| run | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]  # fmt: skip
    for name, row in summary["scores"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[c]['mean']:.3f} ± {row[c]['sd']:.3f}" for c in columns) + " |")
    lines += ["", "Per task (route) from each run's logs and ledger, mean over seeds: teacher_kl at the route's first "
              f"step and over its last {LAST_STEPS}, supervised tokens, ledger sequences sampled.", "",
              "| arm | route | teacher | teacher_kl first | teacher_kl last | supervised tokens | ledger sequences |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm, per_seed in summary["routes"].items():
        for route in ROUTES:
            cells = [statistics.mean(s[route][key] for s in per_seed) for key in
                     ("teacher_kl_first", "teacher_kl_last", "supervised_tokens", "ledger_sequences")]  # fmt: skip
            lines.append(f"| {arm} | {route} | {ARMS[arm][route]} | {cells[0]:.4f} | {cells[1]:.4f} | "
                         f"{cells[2]:.0f} | {cells[3]:.1f} |")  # fmt: skip
    return "\n".join(lines) + "\n\n" + comparison_table(comparisons, seeds)


def main():
    if sys.argv[1:2] == ["--train"]:  # one arm, started by the invocation below
        return train(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", default="runs/two-teachers")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one process (one torch thread) each")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--model_name_or_path", default="lab", help="the student, and the kb teacher's base")
    parser.add_argument("--math_teacher", default="lab-teacher")
    parser.add_argument("--lab_seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="two tiny steps per run, 3 items per task (the test)")
    options = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # every run one torch thread: `--jobs` of them share the cores
    from trl_statelens.lab import lab_dir
    from trl_statelens.reports.runs import LAB, resolve_model

    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    base_model = resolve_model(options.model_name_or_path, options.lab_seed)
    kb_folder = lab_dir(options.lab_seed) / "kb-teacher" if options.model_name_or_path == LAB else out / "kb-teacher"
    teachers = {
        "math": resolve_model(options.math_teacher, options.lab_seed),
        "kb": str(
            build_kb_teacher(base_model, kb_folder, options.lab_seed, 2 if options.smoke else KB_TEACHER["steps"])
        ),
    }
    eval_flags = SMOKE_FLAGS["eval"] if options.smoke else []
    jobs = []  # (command, folder)
    for name, model in (("base", base_model), ("teacher_math", teachers["math"]), ("teacher_kb", teachers["kb"])):
        jobs.append(([sys.executable, str(RECIPES / "eval.py"), "--output_dir", str(out / name),
                      "--model_name_or_path", model, "--lab_seed", str(options.lab_seed), *eval_flags], out / name))  # fmt: skip
    for seed in options.seeds:
        for arm, route in ARMS.items():
            spec = json.dumps({task: teachers[teacher] for task, teacher in route.items()})
            flags = [*SMOKE_FLAGS["opd"], *eval_flags, "--ledger_sample_rate", "1.0"] if options.smoke else []
            jobs.append(([sys.executable, __file__, "--train", "--config", str(CONFIG), "--model_name_or_path",
                          base_model, "--teacher_model_name_or_path", spec, "--lab_seed", str(options.lab_seed),
                          "--seed", str(seed), "--max_steps", str(options.steps), "--probe_steps", str(options.steps),
                          "--logging_steps", "1", "--eval_before", "false", *flags,
                          "--output_dir", str(out / f"seed{seed}" / arm)], out / f"seed{seed}" / arm))  # fmt: skip
    jobs = [(command, folder) for command, folder in jobs if not (folder / "results.json").exists()]
    for _, folder in jobs:
        shutil.rmtree(folder / "statelens", ignore_errors=True)  # an unfinished run starts over
        folder.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(options.jobs) as pool:  # a failed run exits here (study_lab's `run`)
        list(pool.map(lambda job: run(job[0], job[1] / "log.txt"), jobs))

    from trl_statelens.reports.pages import write_report

    for seed in options.seeds:
        write_report([out / f"seed{seed}" / arm for arm in ARMS], out / f"seed{seed}" / "report", base=out / "base")
    summary = summarize(out, options.seeds, options.lab_seed)
    comparisons = compare_runs(folder_item_scores(out), options.seeds, COMPARISONS)
    summary.update(seeds=options.seeds, teachers=teachers, kb_share=KB_SHARE, kb_teacher=KB_TEACHER,
                   bootstrap_samples=BOOTSTRAP_SAMPLES, comparisons=comparisons)  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    text = markdown(summary, comparisons, options.seeds)
    (out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
