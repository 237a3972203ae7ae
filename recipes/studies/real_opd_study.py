"""On-policy distillation on the real SmolLM2-135M-Instruct (issue 34): the dev phase of the plan pre-registered in
STUDY.md ("A real model: ... plan").

    python recipes/studies/real_opd_study.py dev [--out runs/real-study] [--data ../shared/data]
    python recipes/studies/real_opd_study.py dev --smoke --out /tmp/real-smoke      # a 2-step run of each candidate
    python recipes/studies/real_opd_study.py test [--out runs/real-study]          # once dev wrote chosen.json
    python recipes/studies/real_opd_study.py demo-dev [--out runs/real-study]      # `make demo-real`'s candidates
    python recipes/studies/real_opd_study.py data [--out runs/real-study]          # only the test data folder

`dev` writes the dev data (`<out>/data-dev/gsm8k/`: `train.jsonl`, the training pool, and `test.jsonl`, the 200 dev
rows, both from `real_teacher_advantage.real_splits`), runs each candidate (`recipes/self_distill.py` with the real
config, LoRA, 8 rollouts x 128 tokens a step, the candidate's self teacher) scoring the format share on 64 dev
problems every 10 steps, applies the rule and writes `chosen.json` and `dev.md`. A candidate whose run folder holds a
`results.json` is not run again.

`test` runs the dev choice (`chosen.json`) on the held-out split: the test data folder (`<out>/data-test/`: the same
training pool, GSM8K's test split, TruthfulQA), then
- `test/opd`: OPD at the chosen setting, scored before (the base) and after on 250 GSM8K test problems and 200
  TruthfulQA questions, with probe drift on (the lens's `base_kl` and where along the answer the teacher disagrees);
- `test/sft`: LoRA SFT on the pool's reference solutions (chat prompt, the solution as the assistant turn) until its
  training FLOPs reach OPD's (`--max_flops`), scored after;
- `test/teacher`: the base behind the chosen view's template on the same GSM8K problems (what the teacher answers);
- each model's NLL per token of the test problems' reference solutions;
and writes `test.json` and `test.md`: paired differences with 95% bootstrap intervals over items. Finished parts
are not run again.

`--plan ends` runs the 2026-12-04 plan instead (STUDY.md, "A real model: a teacher that ends its answers"): candidates
`ENDS` (K1, K2: the four solved problems as chat exchanges), dev scored on the clean-format share with the repeat
share as a guard (`choose_ends`), in `<out>/dev/K*`; its test phase adds the 2026-12-03 C1 run's committed answers
(`C1_ITEMS`) as an arm. `--candidate K2` runs one candidate's dev run only (two side by side on one GPU). On a machine
with CUDA the runs train there (`--use_cpu false`).

`demo-dev` runs `make demo-real`'s candidates (`DEMO_CANDIDATES`: the dev choice with a horizon, then with a larger
learning rate) on the dev split in order until one passes the demo rule (STUDY.md, "The demo's setting" and its
amendment), writing `demo.json`. `data` writes only the test data folder (`make demo-real`
trains on that pool, so its teacher's shots are the study's).
"""

import argparse
import json
import math
import shutil
import statistics
import sys
from pathlib import Path

import torch
import yaml
from real_teacher_advantage import NUM_SHOTS, TEMPLATES, real_splits, view_prompts
from self_distill_study import smoothed
from study_lab import run
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_statelens.answers import clean_format, repeats_itself
from trl_statelens.data import chat_prompt
from trl_statelens.evaluation import evaluate_model, paired_interval
from trl_statelens.evaluation.gsm8k import GSM8KTask
from trl_statelens.real_models import SMOLLM2
from trl_statelens.reports.runs import resolve_model

ROOT = Path(__file__).resolve().parents[2]
DEV_METRIC = "eval/gsm8k/answer_found"  # the format share: answers with a `#### N` line
MARGIN, MOVES_BY = 0.05, 0.10  # the rule's tolerance below the best, and the least gain over the base that "moves"
STEPS, EVAL_EVERY, DEV_ITEMS = 40, 10, 64
# `make demo-real`'s candidates, tried in order (STUDY.md, "The demo's setting" and its amendment): flags added to the
# chosen setting, steps, dev scoring every so many steps. Conversion, loading and two evaluations take about
# DEMO_OVERHEAD_S of the demo's DEMO_LIMIT_S
DEMO_CANDIDATES = {
    "demo-h32": (["--horizon", "32"], 20, 10),
    "demo-lr6e-4": (["--learning_rate", "6e-4"], 6, 6),
}
DEMO_OVERHEAD_S, DEMO_LIMIT_S = 240, 600
# candidate: the self teacher's template (real_teacher_advantage.TEMPLATES) and what it reads as privileged context
CANDIDATES = {
    "C1": ("shots", ["--context_shots", str(NUM_SHOTS)]),
    "C2": ("solution", []),
}
# the 2026-12-04 plan: the self teacher behind the same four problems as chat exchanges, closed by the end token
ENDS = {
    "K1": ("chat_shots", ["--context_shots", str(NUM_SHOTS), "--context_format", "chat"]),
    "K2": ("chat_shots", ["--context_shots", str(NUM_SHOTS), "--context_format", "chat",
                          "--mask_truncated_completions", "true"]),
}  # fmt: skip
PLANS = {"c": CANDIDATES, "ends": ENDS}
ENDS_MARGIN, ENDS_GUARD = 0.03, 0.05  # the rule's tolerance below the best; the repeat share's allowance over the base
C1_ITEMS = ROOT / "docs" / "study" / "real" / "test" / "opd" / "eval" / "after.items.jsonl"
ON_GPU = ["--use_cpu", "false"] if torch.cuda.is_available() else []  # the real configs say use_cpu: true
SETTING = [
    "--config", str(ROOT / "recipes" / "configs" / "real" / "self_distill.yaml"), *ON_GPU,
    "--signal", "reverse_kl", "--per_device_train_batch_size", "8", "--num_generations", "2",
    "--max_completion_length", "128", "--learning_rate", "2e-4", "--lr_scheduler_type", "constant",
    "--eval_max_new_tokens", "256", "--num_probes", "0", "--seed", "0",
]  # fmt: skip
SMOKE = ["--max_completion_length", "8", "--eval_max_new_tokens", "8"]
TEST_ITEMS = {"gsm8k": 250, "truthfulqa": 200}
SMOKE_ITEMS = {"gsm8k": 2, "truthfulqa": 2}


def item_limits(smoke: bool) -> dict[str, int]:
    return SMOKE_ITEMS if smoke else TEST_ITEMS


def eval_limit_flag(smoke: bool) -> str:
    """The recipes' `--eval_limit` for the test items."""
    return ",".join(f"{task}={n}" for task, n in item_limits(smoke).items())


def write_rows(folder: Path, splits: dict[str, list[dict]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        lines = (json.dumps({"question": r["question"], "answer": r["answer"]}) for r in rows)
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def write_dev_data(data: Path, out: Path) -> Path:
    """The dev data folder: the training pool as `train.jsonl`, the dev rows as `test.jsonl`."""
    folder = out / "data-dev" / "gsm8k"
    if not (folder / "test.jsonl").exists():
        dev, pool = real_splits(data)
        write_rows(folder, {"train": pool, "test": dev})
    return folder


def write_test_data(data: Path, out: Path) -> Path:
    """The test data folder: `gsm8k/` with the same training pool and GSM8K's test split, and `truthfulqa/`."""
    folder = out / "data-test"
    if not (folder / "gsm8k" / "test.jsonl").exists():
        _, pool = real_splits(data)
        test = [json.loads(line) for line in (data / "gsm8k" / "test.jsonl").read_text().splitlines() if line]
        write_rows(folder / "gsm8k", {"train": pool, "test": test})
        shutil.copytree(data / "truthfulqa", folder / "truthfulqa", dirs_exist_ok=True)
    return folder


def dev_command(
    name: str,
    folder: Path,
    out: Path,
    smoke: bool,
    steps: int = STEPS,
    extra: tuple[str, ...] | list[str] = (),
    run_name: str = "",
    every: int = EVAL_EVERY,
) -> list[str]:
    """Candidate `name`'s dev run (`extra` flags added, in `<out>/dev/<run_name or name>`), scored every `every`
    steps; the first candidate's run also scores the base."""
    plan = next(p for p in PLANS.values() if name in p)
    view, flags = plan[name]
    steps, every, items = (2, 1, 2) if smoke else (steps, every, DEV_ITEMS)
    first = name == next(iter(plan)) and not run_name
    evaluation = ["--eval_tasks", "gsm8k", "--eval_limit", f"gsm8k={items}"] if first else ["--eval_tasks", ""]
    return [
        sys.executable, str(ROOT / "recipes" / "self_distill.py"), *SETTING, *flags, *extra, *template_flag(view),
        "--dataset_name", str(folder), "--eval_data", str(folder.parent),
        "--output_dir", str(out / "dev" / (run_name or name)), "--max_steps", str(steps),
        "--target_eval_steps", str(every), "--target_eval_limit", str(items),
        "--eval_before", "true" if first else "false", *evaluation, *(SMOKE if smoke else []),
    ]  # fmt: skip


def template_flag(view: str) -> list[str]:
    """The view's `--teacher_prompt_template`; none for chat exchanges, which the self teacher reads as turns."""
    return ["--teacher_prompt_template", TEMPLATES[view]] if view in TEMPLATES else []


def dev_curve(run_dir: Path, metric: str = DEV_METRIC) -> dict[int, float]:
    history = json.loads((run_dir / "log_history.json").read_text())
    return {e["step"]: e[metric] for e in history if metric in e}


def choose_ends(out: Path, base: dict[str, float], steps: list[int]) -> dict:
    """The 2026-12-04 rule (STUDY.md): a (candidate, step) passes the guard when its dev repeat share is at most the
    base's + ENDS_GUARD; its smoothed score is the mean of its clean share there and at the run's previous scored step
    (the first scored step: itself; the base never). `best` = the highest smoothed score among those passing; chosen
    = the fewest steps (then the earlier candidate) within ENDS_MARGIN of it; `moves` when best >= base + MOVES_BY.
    No pair passing, or none moving, is the result: `candidate` None."""
    rows = []
    for index, name in enumerate(ENDS):
        run_dir = out / "dev" / name
        clean, repeats = dev_curve(run_dir, "eval/gsm8k/clean_format"), dev_curve(run_dir, "eval/gsm8k/repeats")
        missing = [s for s in steps if s not in clean or s not in repeats]
        if missing:
            raise ValueError(f"{run_dir} has no dev score at steps {missing}")
        for i, s in enumerate(steps):
            smooth = statistics.mean([clean[s], clean[steps[max(0, i - 1)]]])
            passes = repeats[s] <= base["repeats"] + ENDS_GUARD + 1e-9
            rows.append({"candidate": name, "index": index, "steps": s, "clean": clean[s], "smoothed": smooth,
                         "repeats": repeats[s], "guard": passes})  # fmt: skip
    passing = [r for r in rows if r["guard"]]
    best = max((r["smoothed"] for r in passing), default=None)
    moves = best is not None and best >= base["clean_format"] + MOVES_BY - 1e-9
    pick = None
    if moves:
        pick = min((r for r in passing if r["smoothed"] >= best - ENDS_MARGIN - 1e-9),
                   key=lambda r: (r["steps"], r["index"]))  # fmt: skip
    return {
        "candidate": pick and pick["candidate"], "steps": pick and pick["steps"], "best_smoothed": best,
        "moves": moves, "base_dev": base, "candidates": rows,
    }  # fmt: skip


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


def dev_phase(data: Path, out: Path, smoke: bool, plan: str = "c", only: str | None = None) -> dict | None:
    folder = write_dev_data(data, out)
    for name in PLANS[plan]:
        if only not in (None, name):
            continue
        run_dir = out / "dev" / name
        if (run_dir / "results.json").exists():
            continue
        shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted run starts again
        (out / "logs").mkdir(parents=True, exist_ok=True)
        run(dev_command(name, folder, out, smoke), out / "logs" / f"dev_{name}.log")
    if only is not None:
        return None
    if plan == "ends":
        return ends_dev_summary(out, smoke)
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


def ends_dev_summary(out: Path, smoke: bool) -> dict:
    """Apply `choose_ends` to K1 and K2's dev runs; write `chosen.json` and `dev.md`."""
    before = json.loads((out / "dev" / next(iter(ENDS)) / "eval" / "before.json").read_text())["metrics"]["gsm8k"]
    base = {m: before[m] for m in ("answer_found", "clean_format", "repeats")}
    chosen = choose_ends(out, base, [1, 2] if smoke else list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY)))
    (out / "chosen.json").write_text(json.dumps(chosen, indent=2))
    lines = [
        f"base dev: format {base['answer_found']:.3f}, clean {base['clean_format']:.3f}, "
        f"repeats {base['repeats']:.3f} (guard: repeats <= {base['repeats'] + ENDS_GUARD:.3f})",
        "",
        "| candidate | steps | clean | smoothed | repeats | guard |",
        "|---|---:|---:|---:|---:|---|",
    ]
    lines += [
        f"| {r['candidate']} | {r['steps']} | {r['clean']:.3f} | {r['smoothed']:.3f} | {r['repeats']:.3f} "
        f"| {'pass' if r['guard'] else 'fails'} |"
        for r in chosen["candidates"]
    ]
    verdict = (
        f"chosen: {chosen['candidate']} at {chosen['steps']} steps"
        if chosen["candidate"]
        else "no pair passes the guard and moves: no test run"
    )
    lines += ["", f"best smoothed: {chosen['best_smoothed']}; moves: {chosen['moves']}; {verdict}"]
    (out / "dev.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return chosen


def demo_steps(curve: dict[int, float], reference: float, step_seconds: float) -> int | None:
    """The demo rule: the fewest scored steps whose dev score reaches `reference` and whose projected demo time
    (`step_seconds` a step plus DEMO_OVERHEAD_S) fits in DEMO_LIMIT_S; None when no step does."""
    fits = [
        s for s in sorted(curve) if curve[s] >= reference - 1e-9 and s * step_seconds + DEMO_OVERHEAD_S <= DEMO_LIMIT_S
    ]
    return fits[0] if fits else None


def demo_dev_phase(data: Path, out: Path, smoke: bool) -> dict:
    """The demo's candidates on the dev split (STUDY.md, "The demo's setting" and its amendment), in order: the chosen
    candidate with each one's flags, scored every `every` steps; writes `demo.json` with the rule's pick (the first
    candidate that qualifies, or None)."""
    chosen = json.loads((out / "chosen.json").read_text())
    folder = write_dev_data(data, out)
    reference = next(  # the chosen candidate's dev score at its first scored step, as chosen
        c["dev"] for c in chosen["candidates"] if c["candidate"] == chosen["candidate"] and c["steps"] == EVAL_EVERY
    )
    result = {"reference": reference, "candidates": {}, "pick": None}
    for name, (flags, steps, every) in DEMO_CANDIDATES.items():
        run_dir = out / "dev" / name
        if not (run_dir / "results.json").exists():
            shutil.rmtree(run_dir, ignore_errors=True)
            (out / "logs").mkdir(parents=True, exist_ok=True)
            command = dev_command(chosen["candidate"], folder, out, smoke, steps, flags, name, every)
            run(command, out / "logs" / f"{name}.log")
        history = json.loads((run_dir / "log_history.json").read_text())
        step_seconds = statistics.median(e["step_time"] for e in history if "step_time" in e)  # logged every step
        curve = dev_curve(run_dir)
        picked = demo_steps(curve, reference, step_seconds)
        result["candidates"][name] = {"flags": flags, "curve": curve, "step_seconds": step_seconds, "steps": picked}
        if picked is not None:
            result["pick"] = {"candidate": name, "steps": picked}
            break
    (out / "demo.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


# ----- test phase ------------------------------------------------------------------------------------------------
class TeacherViewTask(GSM8KTask):
    """GSM8K scored behind a self teacher's prompt (`real_teacher_advantage.view_prompts`): what the teacher
    answers on the items the students are scored on."""

    def __init__(self, view: str, pool: list[dict], **kwargs):
        super().__init__(**kwargs)
        self.view, self.pool = view, pool

    def prompt_texts(self, tokenizer) -> list[str]:
        rows = [{"question": e["question"], "answer": e["answer"]} for e in self.examples()]
        conversations = view_prompts(self.view, rows, self.pool)
        return [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]


def opd_test_command(chosen: dict, folder: Path, out: Path, smoke: bool) -> list[str]:
    view, flags = {**CANDIDATES, **ENDS}[chosen["candidate"]]
    return [
        sys.executable, str(ROOT / "recipes" / "self_distill.py"), *SETTING, *flags, *template_flag(view),
        "--dataset_name", str(folder / "gsm8k"),
        "--eval_data", str(folder), "--output_dir", str(out / "test" / "opd"), "--max_steps", str(chosen["steps"]),
        "--eval_before", "true", "--eval_tasks", "gsm8k,truthfulqa",
        "--eval_limit", eval_limit_flag(smoke),
        "--num_probes", "8", "--probe_steps", str(max(1, chosen["steps"] // 4)),
        *(SMOKE if smoke else []),
    ]  # fmt: skip


def sft_test_command(folder: Path, out: Path, max_flops: float, smoke: bool) -> list[str]:
    """LoRA SFT on the pool's reference solutions with the OPD run's LoRA, learning rate and sequences per step,
    stopped at the first step whose training FLOPs reach `max_flops` (the OPD run's)."""
    config = yaml.safe_load((ROOT / "recipes" / "configs" / "real" / "gsm8k_lora_sft.yaml").read_text())
    config.pop("train_size")  # the whole pool, as OPD reads it
    config.update({
        "dataset_name": str(folder / "gsm8k"), "eval_data": str(folder), "eval_tasks": "gsm8k,truthfulqa",
        "eval_limit": eval_limit_flag(smoke), "eval_before": False,
        "eval_max_new_tokens": 8 if smoke else 256, "output_dir": str(out / "test" / "sft"),
        "per_device_train_batch_size": 8, "learning_rate": 2.0e-4, "max_length": 512,
        "max_steps": 1000, "max_flops": max_flops, "use_cpu": not torch.cuda.is_available(),
    })  # fmt: skip
    path = out / "test" / "sft.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return [sys.executable, str(ROOT / "recipes" / "sft.py"), "--config", str(path)]


def teacher_eval(chosen: dict, data: Path, folder: Path, out: Path, smoke: bool) -> Path:
    """The base behind the chosen view's template, scored on the OPD run's GSM8K test problems."""
    path = out / "test" / "teacher" / "eval.json"
    if not path.exists():
        view, _ = {**CANDIDATES, **ENDS}[chosen["candidate"]]
        task = TeacherViewTask(
            view, real_splits(data)[1], source=str(folder / "gsm8k"), split="test", prompt_format="chat",
            max_new_tokens=8 if smoke else 256, limit=item_limits(smoke)["gsm8k"], seed=0,
        )  # fmt: skip
        evaluate_model(resolve_model(SMOLLM2), [task], out=path, progress=False, extra={"view": view})
    return path.with_name("eval.items.jsonl")


def reference_nll(model_path: str, folder: Path, smoke: bool) -> dict[str, float]:
    """`{question: mean NLL per token}` of each test problem's reference solution as the assistant's answer to the
    student's chat prompt, on the scored GSM8K problems."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    task = GSM8KTask(str(folder / "gsm8k"), "test", prompt_format="chat", limit=item_limits(smoke)["gsm8k"])
    nll = {}
    with torch.no_grad():
        for e in task.examples():
            prompt = tokenizer.apply_chat_template(
                chat_prompt(e["question"]), add_generation_prompt=True, tokenize=False
            )
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            answer_ids = tokenizer(e["answer"], add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prompt_ids + answer_ids])
            logps = torch.log_softmax(model(ids).logits[0, len(prompt_ids) - 1 : -1].float(), -1)
            nll[e["question"]] = -logps.gather(-1, ids[0, len(prompt_ids) :, None]).mean().item()
    return nll


def arm_scores(items: Path, nll: dict | None) -> dict[str, dict[str, float]]:
    """Per-item scores of one model from its `.items.jsonl`, read once: `{metric: {question: score}}`. `format` is
    the pre-registered metric (a `#### N` anywhere); `clean` and `repeats` are its guards, defined in
    `trl_statelens.answers` (one `#### N` line and nothing after it; a loop). Both were added after
    the runs (the first `repeats` counted only a second `####`; the 2026-12-04 correction in STUDY.md)."""
    lines = [json.loads(line) for line in items.read_text().splitlines()]
    gsm8k = [line for line in lines if line["task"] == "gsm8k"]
    truthfulqa = [line for line in lines if line["task"] == "truthfulqa"]
    scores = {
        "format": {x["question"]: float(x["strict"] is not None) for x in gsm8k},
        "clean": {x["question"]: float(clean_format(x["output"])) for x in gsm8k},
        "repeats": {x["question"]: float(repeats_itself(x["output"])) for x in gsm8k},
        "strict": {x["question"]: float(x["correct_strict"]) for x in gsm8k},
        "flexible": {x["question"]: float(x["correct_flexible"]) for x in gsm8k},
    }
    if nll is not None:
        scores["nll"] = nll
    if truthfulqa:
        scores.update({metric: {x["question"]: float(x[metric]) for x in truthfulqa} for metric in ("mc1", "mc2")})
    return scores


def paired(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """`a - b` over the items both scored: the mean and a 95% bootstrap interval (2000 resamples)."""
    questions = sorted(set(a) & set(b))
    differences = [a[q] - b[q] for q in questions]
    low, high = paired_interval(differences)
    return {"difference": statistics.mean(differences), "low": low, "high": high, "items": len(questions)}


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def lens_summary(run_dir: Path, window: int = 5) -> dict:
    """What the OPD run's records show (issue 34's "the lens on the real run"), the first `window` steps against the
    last: from `steps.jsonl` the sampled reverse KL to the teacher on the supervised tokens, the teacher's NLL of
    the student's tokens, the off-policy gap (state NLL less entropy: how unlike its own typical samples the student's
    states are) and the state NLL; from `log_history.json` rollout length and the share cut at the limit; from the
    sampled sequences of `states.jsonl` (the ledger's 5%), the sampled KL on tokens holding a digit and on the rest,
    and by position along the answer, in the run's first half and second half; from `drift.jsonl` the probes' MMD
    and `base_kl` at the last probe step. Also the teacher's privileged context per rollout (its prompt tokens over
    the student's), which the run's FLOPs count before `teacher_context_tokens` left out."""
    steps = read_lines(run_dir / "statelens" / "steps.jsonl")
    history = [e for e in json.loads((run_dir / "log_history.json").read_text()) if "completions/mean_length" in e]

    def first_last(rows: list[dict], key: str) -> dict[str, float]:
        values = [row[key] for row in rows if row.get(key) is not None]
        return {"first": statistics.mean(values[:window]), "last": statistics.mean(values[-window:])}

    summary = {
        key: first_last(steps, key) for key in ("teacher_kl/supervised", "teacher_nll", "offpolicy_gap", "state_nll")
    }
    summary.update({key: first_last(history, key) for key in ("completions/mean_length", "completions/clipped_ratio")})
    samples = read_lines(run_dir / "statelens" / "states.jsonl")
    half = max(s["step"] for s in samples) / 2 if samples else 0
    for name, part in (
        ("first_half", [s for s in samples if s["step"] <= half]),
        ("second_half", [s for s in samples if s["step"] > half]),
    ):
        kl = [(any(c.isdigit() for c in token), position, logp - teacher)
              for s in part for token, position, logp, teacher in zip(s["tokens"], s["prefix_len"], s["logp"], s["teacher_logp"])]  # fmt: skip
        number = [k for digit, _, k in kl if digit]
        bins = {f"{low}-{high - 1}": [k for _, position, k in kl if low <= position < high]
                for low, high in ((0, 16), (16, 32), (32, 64), (64, 128), (128, 10**6))}  # fmt: skip
        summary[f"samples_{name}"] = {
            "sequences": len(part),
            "tokens": len(kl),
            "number_frac": len(number) / len(kl) if kl else None,
            "kl_number": statistics.mean(number) if number else None,
            "kl_other": statistics.mean([k for digit, _, k in kl if not digit]) if len(number) < len(kl) else None,
            "kl_by_position": {b: statistics.mean(v) for b, v in bins.items() if v},
        }
    contexts = [s["teacher_context_len"] for s in samples if "teacher_context_len" in s]
    summary["teacher_context_per_rollout"] = statistics.mean(contexts) if contexts else None
    drift = read_lines(run_dir / "statelens" / "drift.jsonl")
    if drift:
        summary["drift_last"] = {key: drift[-1].get(key) for key in ("step", "mmd", "base_kl", "base_kl_topk")}
    return summary


def test_phase(data: Path, out: Path, smoke: bool) -> dict:
    chosen = json.loads((out / "chosen.json").read_text())
    if chosen["candidate"] is None:
        sys.exit(f"{out / 'chosen.json'}: the dev rule chose nothing (see dev.md), so there is no test run")
    ends = chosen["candidate"] in ENDS
    folder = write_test_data(data, out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    opd = out / "test" / "opd"
    if not (opd / "results.json").exists():
        shutil.rmtree(opd, ignore_errors=True)
        run(opd_test_command(chosen, folder, out, smoke), out / "logs" / "test_opd.log")
    opd_flops = json.loads((opd / "results.json").read_text())["compute"]["flops"]
    sft = out / "test" / "sft"
    if not (sft / "results.json").exists():
        shutil.rmtree(sft, ignore_errors=True)
        run(sft_test_command(folder, out, opd_flops, smoke), out / "logs" / "test_sft.log")
    teacher_items = teacher_eval(chosen, data, folder, out, smoke)

    nll_path = out / "test" / "reference_nll.json"
    nll = json.loads(nll_path.read_text()) if nll_path.exists() else {}
    for arm, path in (("base", resolve_model(SMOLLM2)), ("opd", str(opd)), ("sft", str(sft))):
        if arm not in nll:
            nll[arm] = reference_nll(path, folder, smoke)
            nll_path.write_text(json.dumps(nll))
    arms = {
        "base": arm_scores(opd / "eval" / "before.items.jsonl", nll["base"]),
        "opd": arm_scores(opd / "eval" / "after.items.jsonl", nll["opd"]),
        "sft": arm_scores(sft / "eval" / "after.items.jsonl", nll["sft"]),
        "teacher": arm_scores(teacher_items, None),
    }
    comparisons = [("opd", "base"), ("sft", "base"), ("opd", "sft"), ("teacher", "opd")]
    if ends:  # the 2026-12-03 run's committed answers (its NLLs are in docs/study/real/test/reference_nll.json)
        arms["c1"] = arm_scores(C1_ITEMS, json.loads((C1_ITEMS.parents[2] / "reference_nll.json").read_text())["opd"])
        comparisons.insert(1, ("opd", "c1"))
    sft_results = json.loads((sft / "results.json").read_text())
    results = {
        "chosen": chosen,
        "flops": {"opd": opd_flops, "sft": sft_results["compute"]["flops"]},
        "steps": {"opd": chosen["steps"], "sft": sft_results["global_steps"]},
        "means": {arm: {m: statistics.mean(v.values()) for m, v in scores.items()} for arm, scores in arms.items()},
        "paired": {
            f"{a} - {b}": {m: paired(arms[a][m], arms[b][m]) for m in arms[a] if m in arms[b]} for a, b in comparisons
        },
        "lens": lens_summary(opd),
    }
    (out / "test.json").write_text(json.dumps(results, indent=2))
    text = "\n".join(result_tables(results, list(arms["base"])))
    (out / "test.md").write_text(text + "\n")
    print(text)
    return results


def result_tables(results: dict, metrics: list[str]) -> list[str]:
    """`test.md`'s lines: the paired differences (`results["paired"]`), then each arm's means of `metrics`."""
    lines = ["| comparison | metric | difference | 95% interval | items |", "|---|---|---:|---|---:|"]
    for comparison, compared in results["paired"].items():
        for metric, d in compared.items():
            lines.append(
                f"| {comparison} | {metric} | {d['difference']:+.3f} | [{d['low']:+.3f}, {d['high']:+.3f}] "
                f"| {d['items']} |"
            )
    lines += ["", "| model | " + " | ".join(metrics) + " |", "|---|" + "---:|" * len(metrics)]
    for arm, values in results["means"].items():
        lines.append(f"| {arm} | " + " | ".join(_fmt(values.get(m)) for m in metrics) + " |")
    return lines


def _fmt(value: float | None) -> str:
    return "" if value is None or math.isnan(value) else f"{value:.3f}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["data", "dev", "demo-dev", "test"])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path("runs/real-study"))
    parser.add_argument("--smoke", action="store_true", help="2 steps per run, 2 problems per task, 8 tokens")
    parser.add_argument("--plan", choices=list(PLANS), default="c", help="c: 2026-12-03 (C1, C2); ends: 2026-12-04")
    parser.add_argument("--candidate", help="dev: run only this candidate of the plan (no choice made)")
    args = parser.parse_args()
    if not (args.data / "gsm8k" / "train.jsonl").exists():
        sys.exit(f"needs real GSM8K at {args.data / 'gsm8k'} (see ../shared/data/README.md)")
    if args.phase == "data":
        print(write_test_data(args.data, args.out))
    elif args.phase == "dev":
        if args.candidate not in (None, *PLANS[args.plan]):
            sys.exit(f"--candidate {args.candidate} is not in plan {args.plan}: one of {', '.join(PLANS[args.plan])}")
        dev_phase(args.data, args.out, args.smoke, args.plan, args.candidate)
    else:
        if not (args.out / "chosen.json").exists():
            sys.exit(f"no dev choice at {args.out / 'chosen.json'}: run the dev phase first")
        (demo_dev_phase if args.phase == "demo-dev" else test_phase)(args.data, args.out, args.smoke)
