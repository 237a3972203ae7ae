"""What every recipe does around `trainer.train()`: resolve the lab default, load the data, evaluate before and
after, and write the run folder that `statelens report` reads.

A run folder (`output_dir`) holds:

- `results.json`: recipe, trainer, baseline, model, teacher, seed, `before` / `after` evaluations (as returned by
  :func:`~trl_statelens.evaluation.evaluate_model`), `retention` (Forgetting and Retention of `after` against
  `before`), `final_drift` (the last probe drift) and `train_seconds`;
- `eval/before.json`, `eval/after.json` and their `.items.jsonl` per-item outputs; with `--target_eval_steps`,
  `eval/steps/step<N>.items.jsonl`, the items of each evaluation during training;
- `statelens/`: the state ledger (`steps.jsonl`, `states.jsonl`, `drift.jsonl`; see the README) and
  `provenance.json` (the code, library versions and weight hashes the run started with; also `results.json`'s
  `provenance`);
- `log_history.json`: everything the trainer logged (with `--target_eval_steps`, the target task's scores during
  training as `eval/gsm8k/<metric>` at their step);
- the trained model (`save_pretrained` layout).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer

from ..data import CONTEXT_FORMATS, load_gsm8k
from ..evaluation import (
    RETENTION_TASKS,
    RetentionEvalCallback,
    evaluate_model,
    item_scores,
    paired_interval,
    parse_limit,
    retention_summary,
)
from ..lens.callback import StateLoggingCallback, check_no_ledger
from ..lens.compute import ComputeCounter, ledger_totals, tokens_seen
from ..provenance import PROVENANCE_FILE, provenance
from ..real_models import GEMMA3, SMOLLM2, build_gemma3, build_smollm2
from ..teachers import without_zero3_init

LAB = "lab"  # model / data / eval source meaning "the offline lab"
LAB_TEACHER = "lab-teacher"
TARGET_TASK = "gsm8k"  # the task the recipes train for
TARGET_METRICS = ("correct_strict", "correct_flexible", "answer_found", "clean_format")  # GSM8KTask.score's


@dataclass
class RecipeArguments:
    """Arguments every recipe shares (the trainer's own config and `ModelConfig` come next to these).

    Args:
        dataset_name: training data: `"lab"` (the offline world), a hub id (`"openai/gsm8k"`) or a local file/folder.
        prompt_format: `"plain"` (`Question: ...\\nAnswer:`, the study's format for base models) or `"chat"`.
        train_size: keep this many training rows (a seeded subset); all when unset.
        context_shots: the privileged context a self teacher reads (or a separate one, with
            `--teacher_reads_context true`) is this many solved train problems (the same for every row) instead of
            each row's reference solution; 0 (default) for the solution.
        context_format: how those solved problems are shown: `"text"` (default: one text filled into the teacher's
            template) or `"chat"` (user/assistant exchanges before the student's conversation, each closed by the chat
            template's end token; needs `prompt_format: chat`).
        eval_data: evaluation data: `"lab"`, `"hub"` (GSM8K, TruthfulQA, MMLU from the hub) or a folder with
            `gsm8k/`, `truthfulqa/`, `mmlu/`.
        eval_tasks: comma-separated tasks to score before and after training (`gsm8k,truthfulqa,mmlu`); empty for none.
        eval_limit: items per task (a seeded subset): a number for every task, `"gsm8k=500,mmlu=500,truthfulqa=200"`,
            or `"study"` (those sizes, which fit the study's numbers); all items when unset.
        eval_split: the target task's evaluation split, `"test"` or `"dev"` (the lab's 100 held-out dev problems; a
            local folder's `dev.jsonl`): before, during and after training, and the probe prompts. Choose settings on
            `"dev"`, report `"test"`.
        eval_samples: also score the target task on this many temperature-1 samples per problem
            (`eval/gsm8k/accuracy_sampled`: how often the policy that on-policy trainers sample gets the answer,
            beside greedy accuracy); 0 for greedy only.
        eval_max_new_tokens: GSM8K generation budget; an answer not finished by then scores 0.
        eval_batch_size: prompts per `generate` call (GSM8K) and questions per batch (multiple choice) in the recipe's
            evaluations; a tiny model on a CPU evaluates several times faster with a large one.
        eval_before: also score the starting model (skip it when a base evaluation run already has the scores).
        target_eval_steps: also score the target task (GSM8K) on the training model every this many steps, with the
            final evaluation's data, protocol, prompt format and generation budget; 0 for never. The scores are
            logged as `eval/gsm8k/<metric>` at their step (`log_history.json`) and the report plots them against
            the supervised tokens so far (`sample_efficiency.png`). Every process evaluates, inside the training loop.
        target_eval_limit: GSM8K items of those evaluations (a seeded subset, the first items of the final
            evaluation's own subset); the final evaluation's GSM8K limit (`eval_limit`) when unset.
        eval_protocol: `"statelens"` (the package's own prompts and scoring) or `"lm-eval"` (lm-evaluation-harness
            0.4.x's prompts, shots, filters and normalisation: numbers comparable with lm-eval's; GSM8K prompts are
            then plain whatever `prompt_format` says). See the README's Evaluation section.
        num_probes: probe prompts (from the test split) for probe drift; 0 turns drift off.
        probe_steps: measure probe drift every this many steps.
        ledger_sample_rate: share of supervised sequences written with their text to the ledger.
        target_metric: the per-problem GSM8K score behind the summary's change line and `results.json`'s
            `target_change`: `"correct_strict"` (right under the strict `#### N` match: the study's accuracy),
            `"correct_flexible"` (the last number is right), `"answer_found"` (the answer has a `#### N` line, the
            format the strict metric reads) or `"clean_format"` (exactly one such line, and the answer ends there:
            `trl_statelens.answers.clean_format`, which a looping answer fails).
        max_flops: stop after the first step at which the run's training FLOPs (`flops_total/total`, as
            `results.json`'s `compute`) reach this: a baseline at another run's compute (`StateLoggingCallback`'s
            `max_flops`); unset for no limit. `max_steps` still applies.
        baseline: `"statelens"` (our trainer) or `"stock"` (the matching stock TRL trainer on the same data, seed and
            settings, with probe drift attached), so the two output folders compare directly.
        lab_seed: which cached lab world to use.
    """

    dataset_name: str = LAB
    prompt_format: str = "plain"
    train_size: int | None = None
    context_shots: int = 0
    context_format: str = "text"
    eval_data: str = LAB
    eval_tasks: str = "gsm8k,truthfulqa,mmlu"
    eval_limit: str | None = None
    eval_split: str = "test"
    eval_samples: int = 0
    eval_max_new_tokens: int = 256
    eval_batch_size: int = 16
    eval_before: bool = True
    target_eval_steps: int = 0
    target_eval_limit: int | None = None
    eval_protocol: str = "statelens"
    num_probes: int = 16
    probe_steps: int = 10
    ledger_sample_rate: float = 0.05
    target_metric: str = "correct_strict"
    max_flops: float | None = None
    baseline: str = field(default="statelens", metadata={"help": "'statelens' or 'stock'"})
    lab_seed: int = 0

    def __post_init__(self):
        if self.baseline not in ("statelens", "stock"):
            raise ValueError(f"--baseline must be 'statelens' or 'stock', got {self.baseline!r}")
        if self.eval_protocol not in ("statelens", "lm-eval"):
            raise ValueError(f"--eval_protocol must be 'statelens' or 'lm-eval', got {self.eval_protocol!r}")
        if self.context_shots < 0:
            raise ValueError(
                f"--context_shots is a number of solved problems (0 for the solution), got {self.context_shots}"
            )
        if self.context_format not in CONTEXT_FORMATS:
            raise ValueError(f"--context_format must be one of {CONTEXT_FORMATS}, got {self.context_format!r}")
        if self.context_format == "chat" and self.prompt_format != "chat":
            raise ValueError(
                "--context_format chat shows the solved problems as chat turns: it needs --prompt_format chat"
            )
        if self.eval_split not in ("test", "dev"):
            raise ValueError(f"--eval_split must be 'test' or 'dev', got {self.eval_split!r}")
        if self.eval_samples < 0:
            raise ValueError(
                f"--eval_samples is a number of samples per problem (0 for none), got {self.eval_samples}"
            )
        if self.eval_batch_size < 1:
            raise ValueError(f"--eval_batch_size must be a positive number of items, got {self.eval_batch_size}")
        if self.target_metric not in TARGET_METRICS:
            raise ValueError(f"--target_metric must be one of {TARGET_METRICS}, got {self.target_metric!r}")
        if self.max_flops is not None and self.baseline == "stock":
            raise ValueError(
                "--max_flops reads the FLOPs count of a StateLens trainer's records, which a stock trainer does not "
                "keep: leave --baseline at 'statelens' or stop the stock run with --max_steps"
            )
        if self.max_flops is not None and not self.max_flops > 0:
            raise ValueError(f"--max_flops is a number of training FLOPs (unset for no limit), got {self.max_flops}")
        if self.target_eval_steps < 0:
            raise ValueError(f"--target_eval_steps is a number of steps (0 for never), got {self.target_eval_steps}")
        if self.target_eval_limit is not None and self.target_eval_limit < 1:
            raise ValueError(f"--target_eval_limit must be a positive number of items, got {self.target_eval_limit}")


def resolve_model(name_or_path: str | None, lab_seed: int = 0) -> str:
    """`"lab"` (or nothing) is the lab base model and `"lab-teacher"` the lab math teacher, built on first use;
    `"smollm2-135m"` the real SmolLM2-135M-Instruct and `"gemma3-270m"` Gemma 3 270M, converted on first use
    (`trl_statelens.real_models`); anything
    else is a local path (which must exist) or a hub id, loaded with `from_pretrained`."""
    from ..lab import build_lab, build_teacher

    if name_or_path in (None, LAB):
        return str(build_lab(seed=lab_seed) / "base")
    if name_or_path == LAB_TEACHER:
        build_lab(seed=lab_seed)
        return str(build_teacher(seed=lab_seed))
    if name_or_path == SMOLLM2:
        return str(build_smollm2())
    if name_or_path == GEMMA3:
        return str(build_gemma3())
    if Path(name_or_path).expanduser().exists():
        return name_or_path
    # A hub id is `name` or `owner/name` (dots allowed: "Qwen/Qwen3-0.6B-Base"); anything else is meant as a path.
    looks_like_hub_id = re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name_or_path) and not name_or_path.startswith(".")
    if not looks_like_hub_id:
        raise FileNotFoundError(f"model path {name_or_path!r} does not exist: pass a saved model folder or a hub id")
    return name_or_path


def load_train_data(args: RecipeArguments, seed: int):
    return load_gsm8k(
        args.dataset_name, "train", prompt_format=args.prompt_format, limit=args.train_size, seed=seed,
        lab_seed=args.lab_seed, context_shots=args.context_shots, context_format=args.context_format,
    )  # fmt: skip


def probe_prompts(args: RecipeArguments) -> list | None:
    """A fixed set of test prompts whose sampled prefixes measure how the policy's own states drift."""
    if args.num_probes <= 0:
        return None
    return load_gsm8k(
        args.dataset_name, args.eval_split, prompt_format=args.prompt_format, limit=args.num_probes, seed=0,
        lab_seed=args.lab_seed,
    )["prompt"]  # fmt: skip


def state_logging_callback(args: RecipeArguments, trainer=None) -> StateLoggingCallback:
    return StateLoggingCallback(
        trainer,
        probe_prompts=probe_prompts(args),
        probe_steps=args.probe_steps,
        sample_rate=args.ledger_sample_rate,
        max_flops=args.max_flops,
    )


def evaluation_settings(args: RecipeArguments, seed: int) -> dict:
    """What every evaluation of a run shares (before, during and after training), so their scores compare."""
    gsm8k_kwargs = {"max_new_tokens": args.eval_max_new_tokens, "split": args.eval_split}
    if args.eval_samples:
        gsm8k_kwargs["num_samples"] = args.eval_samples
    if args.eval_protocol == "statelens":  # lm-eval fixes the prompt itself
        gsm8k_kwargs["prompt_format"] = args.prompt_format
    return {
        "data_dir": None if args.eval_data == "hub" else args.eval_data,
        "limit": parse_limit(None if args.eval_limit is None else str(args.eval_limit)),
        "seed": seed,
        "batch_size": args.eval_batch_size,
        "protocol": args.eval_protocol,
        "task_kwargs": {TARGET_TASK: gsm8k_kwargs},
    }


def evaluate(args: RecipeArguments, model_or_path, tokenizer, out: Path, seed: int) -> dict | None:
    """Score a model on the recipe's tasks (main process only) and write `out`; `None` when no task is asked."""
    tasks = [t.strip() for t in args.eval_tasks.split(",") if t.strip()]
    if not tasks:
        return None
    settings = evaluation_settings(args, seed)
    if TARGET_TASK not in tasks:
        settings["task_kwargs"] = None
    with without_zero3_init():
        results = evaluate_model(model_or_path, tasks, tokenizer=tokenizer, **settings, out=out)
    results.pop("records")
    return results


def target_eval_callback(
    args: RecipeArguments, model_path: str, seed: int, out: Path | None = None
) -> RetentionEvalCallback | None:
    """The target task scored on the training model every `target_eval_steps` steps, each evaluation's items in
    `<out>/eval/steps/` when `out` is given; `None` when off.

    No step-0 evaluation: the `before` evaluation (or the base run's, with `--eval_before false`) is that point.
    """
    if args.target_eval_steps == 0:
        return None
    settings = evaluation_settings(args, seed)
    limit = args.target_eval_limit
    if limit is None:
        limit = settings["limit"].get(TARGET_TASK) if isinstance(settings["limit"], dict) else settings["limit"]
    return RetentionEvalCallback(
        [TARGET_TASK],
        eval_steps=args.target_eval_steps,
        # its own copy: evaluation may set a pad token, and the run saves the tokenizer it loaded
        tokenizer=AutoTokenizer.from_pretrained(model_path),
        **{**settings, "limit": limit},
        eval_on_start=False,
        items_dir=None if out is None else out / "eval" / "steps",
    )


def run_recipe(recipe: str, trainer, args: RecipeArguments, model_path: str, teacher_path: str | None = None) -> dict:
    """Evaluate the starting model, train, save, evaluate the result, write `results.json`, print a summary."""
    training_args = trainer.args
    out = Path(training_args.output_dir)
    accelerator = trainer.accelerator
    if not training_args.resume_from_checkpoint:  # before evaluating: a fresh run must not overwrite another's ledger
        check_no_ledger(out)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    target_eval = target_eval_callback(args, model_path, training_args.seed, out)  # loads its data before any work
    if target_eval is not None:
        trainer.add_callback(target_eval)
        target_eval.trainer = trainer  # scores go through trainer.log, to log_history and every report_to backend
    before = None
    if accelerator.is_main_process and args.eval_before:
        before = evaluate(args, model_path, None, out / "eval" / "before.json", training_args.seed)
    accelerator.wait_for_everyone()

    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    train_seconds = time.perf_counter() - started
    trainer.save_model(str(out))
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        trainer.end()  # destroys the process group while Python is alive (tests/test_multiprocess.py says why)
        return {}

    tokenizer.save_pretrained(out)
    after = evaluate(args, str(out), None, out / "eval" / "after.json", training_args.seed)
    retention = None
    if before is not None and all(t in before["scores"] for t in RETENTION_TASKS if t in after["scores"]):
        try:
            retention = retention_summary(before, after)
        except ValueError as error:  # no retention task, or a base score of 0
            print(f"retention not computed: {error}")
    teacher_scores = None
    if (
        teacher_path is not None
        and Path(teacher_path).is_dir()
        and after is not None
        and TARGET_TASK in after["scores"]
    ):
        # the teacher on the target, as the student is scored: what "learning from it" can reach
        target_args = dataclasses.replace(args, eval_tasks=TARGET_TASK)
        teacher_scores = evaluate(target_args, teacher_path, None, out / "eval" / "teacher.json", training_args.seed)
    drift_path = out / "statelens" / "drift.jsonl"
    drift_lines = drift_path.read_text().splitlines() if drift_path.exists() else []
    results = {
        "recipe": recipe,
        "trainer": type(trainer).__name__,
        "baseline": args.baseline,
        "run_name": training_args.run_name or out.name,
        "model": model_path,
        "teacher": teacher_path,
        "seed": training_args.seed,
        "before": before,
        "after": after,
        "retention": retention,
        "target_change": target_change(out, args.target_metric),
        "teacher_eval": teacher_scores,
        "final_drift": json.loads(drift_lines[-1]) if drift_lines else None,
        "train_seconds": round(train_seconds, 1),
        "global_steps": trainer.state.global_step,
        "distributed": what_ran(trainer),
        "compute": compute_counts(trainer),
        "recipe_arguments": dataclasses.asdict(args),
        "provenance": run_provenance(out, model_path, teacher_path),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=2))
    report = write_run_report(out)
    print_summary(results, trainer.state.log_history, out, report)
    trainer.end()
    return results


def run_provenance(out: Path, model_path: str, teacher_path: str | None = None) -> dict:
    """The record the ledger's callback wrote at the start of training (`statelens/provenance.json`), else one made
    now with the starting models' files hashed (`trl_statelens.provenance`)."""
    path = out / "statelens" / PROVENANCE_FILE
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    return provenance({"student": model_path, "teacher": teacher_path})


def compute_counts(trainer) -> dict:
    """Training compute counted from model sizes and tokens ([`ComputeCounter`] says what is counted), from the
    tokens the trainer logs as `num_tokens` and the ledger's `supervised_tokens` (and `supervised_tokens/<name>`,
    which weigh teachers of several sizes).

    `flops_per_token` multiplies `tokens`, `flops_per_supervised_token` the ledger's `supervised_tokens` (the report
    draws compute so far at each step from both), `flops_by_part` splits `flops` into student generation, student
    training, teacher scoring and teacher writing (the ledger's last `flops_total/*` are the same numbers; with a self
    teacher they include its prompts' extra tokens, `teacher_context_tokens`, which the per-token counts leave out,
    less what a shared-prefix forward saved), and `teacher_tokens`
    sums the ledger's (`None` without). N_T (`teacher_parameters`, by teacher in `teacher_parameters_by_name` when there are
    several) and every FLOP count it enters are `None` for a teacher on a server, whose size is unknown here.
    """
    counter = ComputeCounter.of(trainer)
    steps = Path(trainer.args.output_dir) / "statelens" / "steps.jsonl"
    ledger = [json.loads(line) for line in steps.read_text().splitlines()] if steps.exists() else []
    totals = ledger_totals(ledger)
    tokens = tokens_seen(trainer)
    context = totals.get("teacher_context_tokens", 0.0)
    by_part = counter.of_ledger(tokens, totals)
    per_token, per_supervised = counter.split(1, 0, totals)["total"], counter.split(0, 1, totals)["total"]
    counts = {
        "student_parameters": counter.student,
        "teacher_parameters": counter.teacher(totals),
        "flops_per_token": per_token,
        "flops_per_supervised_token": per_supervised,
        "tokens": tokens,
        "flops": by_part.pop("total"),
        "flops_by_part": by_part,
        "teacher_tokens": totals.get("teacher_tokens"),
        "teacher_context_tokens": context,
    }
    if counter.teacher_sizes is not None and len(counter.teacher_sizes) > 1:
        counts["teacher_parameters_by_name"] = counter.teacher_sizes
    return counts


def target_change(out: Path, metric: str = "correct_strict") -> dict | None:
    """The target's after - before of one per-problem score on the same problems, with a 95% bootstrap interval over
    the problems."""
    before, after = out / "eval" / "before.items.jsonl", out / "eval" / "after.items.jsonl"
    if not (before.exists() and after.exists()):
        return None
    was, now = (item_scores(path, TARGET_TASK, metric) for path in (before, after))
    questions = sorted(set(was) & set(now))
    if not questions:
        return None
    differences = [now[q] - was[q] for q in questions]
    low, high = paired_interval(differences)
    return {"task": TARGET_TASK, "metric": metric, "change": sum(differences) / len(differences), "ci95": [low, high],
            "num_items": len(questions)}  # fmt: skip


def write_run_report(out: Path) -> Path | None:
    """The run's own report (plots, state statistics) and states page, in `<out>/report`."""
    from .pages import write_report

    try:
        return write_report([out], out / "report")
    except Exception as error:  # the run and its results are saved: a report problem must not hide them
        print(f"report not written ({type(error).__name__}: {error}); try: statelens report {out} --out {out}/report")
        return None


def what_ran(trainer) -> dict:
    """What actually ran, not what the flags asked for: some launch forms silently fall back to one process or DDP."""
    accelerator = trainer.accelerator
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    teacher = getattr(trainer, "teacher_model", None)
    return {
        "type": accelerator.distributed_type.value,
        "num_processes": accelerator.num_processes,
        "zero_stage": plugin.zero_stage if plugin is not None else None,
        "engine": type(trainer.model_wrapped).__name__,
        "teacher_engine": None if teacher is None else type(teacher).__name__,
    }


def first_and_last(log_history: list[dict], key: str) -> tuple[float, float] | None:
    values = [entry[key] for entry in log_history if key in entry]
    return (values[0], values[-1]) if values else None


def print_summary(results: dict, log_history: list[dict], out: Path, report: Path | None = None) -> None:
    before, after = results["before"], results["after"]
    print(f"\n=== {results['recipe']} ({results['trainer']}), {results['global_steps']} steps in "
          f"{results['train_seconds']:.0f} s -> {out}")  # fmt: skip
    if after is not None:
        teacher = (results.get("teacher_eval") or {}).get("scores") or {}
        print(f"{'task':<12}{'before':>10}{'after':>10}" + (f"{'teacher':>10}" if teacher else ""))
        for task, score in after["scores"].items():
            was = before["scores"].get(task) if before else None
            line = f"{task:<12}{'-' if was is None else f'{was:.3f}':>10}{score:>10.3f}"
            print(line + (f"{teacher[task]:>10.3f}" if task in teacher else ""))
    change = results.get("target_change")
    if change:
        low, high = change["ci95"]
        metric = change.get("metric", "correct_strict")
        label = change["task"] if metric == "correct_strict" else f"{change['task']} {metric}"
        print(f"{label} change {change['change']:+.3f}, 95% interval [{low:+.3f}, {high:+.3f}] over "
              f"{change['num_items']} problems (paired bootstrap)")  # fmt: skip
    if results["retention"]:
        print(
            f"forgetting {results['retention']['forgetting']:+.4f}   retention {results['retention']['retention']:.4f}"
        )
    for key in ("teacher_kl/sampled", "statelens/state_nll", "statelens/offpolicy_gap", "loss"):
        pair = first_and_last(log_history, key)
        if pair:
            print(f"{key:<26} first step {pair[0]:8.4f}   last step {pair[1]:8.4f}")
    if results["final_drift"]:
        print(f"probe drift at step {results['final_drift']['step']}: mmd {results['final_drift']['mmd']:.5f}")
    if report is not None:
        print(f"report: {report.parent / 'report.html'} (and report.md, plots beside it)")
        print(f"states: {report.parent / 'states.html'}")
    else:
        print(f"report: statelens report {out} --out {out}/report")


def with_default_config(recipe_file: str, argv: list[str]) -> list[str]:
    """Without `--config`, a recipe starts from its lab config, `recipes/configs/lab/<recipe>.yaml`; command-line
    flags still override it."""
    if "--config" in argv:
        return argv
    recipe = Path(recipe_file).resolve()
    return ["--config", str(recipe.parent / "configs" / "lab" / f"{recipe.stem}.yaml"), *argv]
