"""OnPolicyDistillTrainer vs TRL's DistillationTrainer(beta=1), and the OPD step vs its floor.

Equal work per step: every arm trains on 8 rollouts of exactly `COMPLETION_TOKENS` tokens (`min_new_tokens` forbids an
early eos) from prompts of exactly `PROMPT_TOKENS` tokens. DistillationTrainer samples one rollout per prompt (8
prompts), OPD samples `num_generations=2` per prompt (4 prompts x 2), as GRPO must. The arms alternate within each
repeat, each in a fresh forked process, at two vocabulary sizes: the lab's 1024 and 32768 (same widths, larger
embedding), since the full-vocabulary losses scale with V.

The floor (reverse_kl arm, right after its training run, on the very token batches it trained on): plain
`generate` of the same rollouts, one no-grad teacher forward scoring the completion tokens, one student forward and
backward of a sampled-token loss on them, and the optimizer step. Each is timed on its own; the OPD step over their
sum is the overhead ratio.

    .venv/bin/python bench/bench_opd.py [--repeats 3] [--steps 4] [--size lab|real]

`--size real` runs the same arms with the real SmolLM2-135M-Instruct (`smollm2-135m`: 30 layers, vocab 49,152) as
student and as teacher (the same weights: the cost is that of a same-size teacher), rollouts of
REAL_COMPLETION_TOKENS tokens, and writes `opd_real.json`.
"""

import argparse
import dataclasses
import statistics
import time

import torch
from common import (
    CPU_ARGS,
    backbone,
    count_parameters,
    count_saved_parameters,
    keep_token_batches,
    print_table,
    ratio_row,
    run_forked,
    say,
    scratch_dir,
    train_and_measure,
    write_results,
)
from datasets import Dataset
from transformers import AutoTokenizer
from trl import DistillationConfig, DistillationTrainer

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer
from trl_statelens.lab import LabWorld, build_qwen3, build_tokenizer, format_plain
from trl_statelens.real_models import SMOLLM2
from trl_statelens.reports.runs import resolve_model

STUDENT = dict(hidden=256, layers=4, ffn=1024)
TEACHER = dict(hidden=256, layers=4, ffn=1024)  # same shape, other weights: the teacher forward costs one student one
VOCAB_SIZES = (1024, 32768)
ROLLOUTS_PER_STEP = 8
NUM_GENERATIONS = 2
PROMPT_TOKENS = 48
COMPLETION_TOKENS = 32
REAL_COMPLETION_TOKENS = 16  # a step of the real model costs ~100x more than one of the lab-width models
CONTINUATION_TOKENS = 16
WARMUP_STEPS = 1
ARMS = ("distill", "reverse_kl", "continuation", "divergence")


def fixed_length_prompts(tokenizer, world, n: int) -> list[str]:
    """Math prompts cut to exactly PROMPT_TOKENS tokens (kept only when the cut text re-tokenizes to that length)."""
    prompts = []
    # Five-step problems: the lab's own (1-3 steps) are mostly shorter than PROMPT_TOKENS
    long_problems = dataclasses.replace(world, math_steps=(5, 5))
    for row in long_problems.math("train", n=4 * n, seed=7):
        ids = tokenizer(format_plain(row["question"]), add_special_tokens=False)["input_ids"]
        if len(ids) < PROMPT_TOKENS:
            continue
        text = tokenizer.decode(ids[:PROMPT_TOKENS])
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) == PROMPT_TOKENS:
            prompts.append(text)
        if len(prompts) == n:
            break
    return prompts


def run_arm(
    arm,
    student_path,
    teacher_path,
    tokenizer,
    dataset,
    steps,
    with_floor,
    rollouts=ROLLOUTS_PER_STEP,
    completion_tokens=COMPLETION_TOKENS,
):
    """One training run in a forked child: step times, forwards per step, peak memory (and the floor)."""
    output_dir = scratch_dir(f"bench-{arm}-")
    common = dict(
        output_dir=output_dir,
        max_steps=WARMUP_STEPS + steps,
        per_device_train_batch_size=rollouts,
        max_completion_length=completion_tokens,
        temperature=1.0,
        generation_kwargs={"min_new_tokens": completion_tokens},
        **CPU_ARGS,
    )
    if arm == "distill":
        trainer = DistillationTrainer(
            model=student_path,
            teacher_model=teacher_path,
            args=DistillationConfig(beta=1.0, **common),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    else:
        trainer = OnPolicyDistillTrainer(
            model=student_path,
            teacher_model=teacher_path,
            args=OnPolicyDistillConfig(
                signal=arm,
                num_generations=NUM_GENERATIONS,
                **({"continuation_length": CONTINUATION_TOKENS} if arm == "continuation" else {}),
                **common,
            ),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    batches = keep_token_batches(trainer) if with_floor else []  # the token batches the steps train on
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    modules = {"student": backbone(trainer.model), "teacher": backbone(teacher)}
    result = train_and_measure(trainer, modules, WARMUP_STEPS)
    tokens = rollouts * (completion_tokens + (CONTINUATION_TOKENS if arm == "continuation" else 0))
    result["tokens_per_second"] = tokens / statistics.median(result["step_seconds"])
    if with_floor:
        result["floor"] = measure_floor(trainer, teacher, batches[WARMUP_STEPS:])
    return result


def save_models(tokenizer, vocab_size, directory, student_shape, teacher_shape):
    """A random-init student and teacher (seeds 0 and 1) at `vocab_size`, saved with the tokenizer: their paths and
    parameter counts."""
    paths, parameters = {}, {}
    for name, shape, seed in (("student", student_shape, 0), ("teacher", teacher_shape, 1)):
        model = build_qwen3(tokenizer, **shape, vocab_size=vocab_size, seed=seed)
        paths[name] = f"{directory}/{name}-{vocab_size}"
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
        parameters[name] = count_parameters(model)
    return paths, parameters


def run_arm_forked(arm, paths, tokenizer, dataset, steps, **sizes):
    """`run_arm` in a forked child, with the floor measured on the reverse_kl arm."""
    return run_forked(
        run_arm, arm, paths["student"], paths["teacher"], tokenizer, dataset, steps, arm == "reverse_kl", **sizes
    )


def measure_floor(trainer, teacher, batches) -> dict:
    """Time each part of the minimal work of a reverse-KL step, on the token batches the trainer trained on."""
    student = trainer.accelerator.unwrap_model(trainer.model)
    parts = {"generate": [], "teacher_forward": [], "student_forward_backward": [], "optimizer_step": []}
    for batch in batches:
        prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
        completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        keep = completion_ids.size(1) + 1  # the positions that predict the completion tokens (and one more)

        start = time.perf_counter()
        student.eval()
        with torch.no_grad():
            student.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=trainer.generation_config
            )
        student.train()
        parts["generate"].append(time.perf_counter() - start)

        start = time.perf_counter()
        with torch.no_grad():
            logits = teacher(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep).logits
            teacher_logps = (logits[:, :-1] / trainer.temperature).log_softmax(-1)
            teacher_logps = teacher_logps.gather(-1, completion_ids[..., None]).squeeze(-1)
        parts["teacher_forward"].append(time.perf_counter() - start)

        start = time.perf_counter()
        logits = student(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep).logits
        logps = (logits[:, :-1] / trainer.temperature).log_softmax(-1)
        logps = logps.gather(-1, completion_ids[..., None]).squeeze(-1)
        advantages = (teacher_logps - logps.detach()) * completion_mask
        loss = -(advantages * logps).sum() / completion_mask.sum()
        loss.backward()
        parts["student_forward_backward"].append(time.perf_counter() - start)

        start = time.perf_counter()
        trainer.optimizer.step()
        parts["optimizer_step"].append(time.perf_counter() - start)
        trainer.optimizer.zero_grad(set_to_none=True)
        del logits, logps, loss
    parts["total"] = [sum(values) for values in zip(*parts.values())]
    return parts


def main(repeats: int = 3, steps: int = 4, size: str = "lab") -> dict:
    world = LabWorld(seed=0)
    if size == "real":
        real_path = resolve_model(SMOLLM2)
        tokenizer = AutoTokenizer.from_pretrained(real_path)
    else:
        tokenizer = build_tokenizer(world, vocab_size=1024, num_documents=2000)
    prompts = fixed_length_prompts(tokenizer, world, n=256)
    dataset = Dataset.from_dict({"prompt": prompts})
    model_dir = scratch_dir("bench-opd-models-")
    results = {"setup": {"size": size}, "runs": {}}
    tables = []
    completion_tokens = REAL_COMPLETION_TOKENS if size == "real" else COMPLETION_TOKENS
    for vocab_size in [len(tokenizer)] if size == "real" else VOCAB_SIZES:
        if size == "real":  # the real model is its own teacher here: the same work as the lab rows, at real size
            paths = {"student": real_path, "teacher": real_path}
            parameters = dict.fromkeys(paths, count_saved_parameters(real_path))
        else:
            paths, parameters = save_models(tokenizer, vocab_size, model_dir, STUDENT, TEACHER)
        for name in paths:
            results["setup"][f"{name}_params_V{vocab_size}"] = parameters[name]
        runs = {arm: [] for arm in ARMS}
        for repeat in range(repeats):
            arms = ARMS if repeat % 2 == 0 else ARMS[::-1]  # alternate the order as well
            for arm in arms:
                start = time.perf_counter()
                run = run_arm_forked(arm, paths, tokenizer, dataset, steps, completion_tokens=completion_tokens)
                runs[arm].append(run)
                say(
                    f"V={vocab_size} repeat {repeat + 1}/{repeats} {arm}: median step "
                    f"{statistics.median(run['step_seconds']):.3f}s, train mem {run['train_mem_mb']:.0f} MB "
                    f"({time.perf_counter() - start:.0f}s)"
                )
        results["runs"][f"V{vocab_size}"] = runs
        tables.append((vocab_size, summarize(runs, vocab_size)))

    for vocab_size, rows in tables:
        print_table(f"OPD vs DistillationTrainer(beta=1), V={vocab_size} (ratios over repeats)", rows)
    results["tables"] = {f"V{v}": rows for v, rows in tables}
    results["setup"].update(
        student=SMOLLM2 if size == "real" else STUDENT,
        teacher=SMOLLM2 if size == "real" else TEACHER,
        rollouts_per_step=ROLLOUTS_PER_STEP,
        num_generations=NUM_GENERATIONS,
        prompt_tokens=PROMPT_TOKENS,
        completion_tokens=completion_tokens,
        continuation_tokens=CONTINUATION_TOKENS,
        warmup_steps=WARMUP_STEPS,
        measured_steps=steps,
        repeats=repeats,
    )
    path = write_results("opd_real" if size == "real" else "opd", results)
    say(f"wrote {path}")
    return results


def summarize(runs: dict, vocab_size: int) -> list[dict]:
    def median_step(run):
        return statistics.median(run["step_seconds"])

    big = vocab_size >= 32768
    rows = []
    for arm in ARMS[1:]:
        pairs = list(zip(runs[arm], runs["distill"]))
        time_target = "<= 0.8" if arm == "reverse_kl" and big else ""
        memory_target = "<= 0.6" if arm == "reverse_kl" and big else ""
        rows += [
            ratio_row(f"{arm} / distill: step time", [median_step(a) / median_step(b) for a, b in pairs], time_target),
            ratio_row(f"{arm} / distill: peak RSS", [a["peak_rss_mb"] / b["peak_rss_mb"] for a, b in pairs]),
            ratio_row(
                f"{arm} / distill: train memory (peak - start RSS)",
                [a["train_mem_mb"] / b["train_mem_mb"] for a, b in pairs],
                memory_target,
            ),
            ratio_row(
                f"{arm} / distill: tokens/s", [a["tokens_per_second"] / b["tokens_per_second"] for a, b in pairs]
            ),
        ]
    for arm in ARMS:
        rows.append(ratio_row(f"{arm}: step seconds", [median_step(run) for run in runs[arm]]))
        rows.append(ratio_row(f"{arm}: completion tokens/s", [run["tokens_per_second"] for run in runs[arm]]))
        rows.append(ratio_row(f"{arm}: train memory MB", [run["train_mem_mb"] for run in runs[arm]]))
        for model in ("student", "teacher"):
            counts = [step[model] for run in runs[arm] for step in run["forwards_per_step"]]
            rows.append(ratio_row(f"{arm}: {model} forwards per step", [float(c) for c in counts]))
    floors = [run["floor"] for run in runs["reverse_kl"]]
    for part in ("generate", "teacher_forward", "student_forward_backward", "optimizer_step", "total"):
        rows.append(ratio_row(f"floor: {part} seconds", [statistics.median(f[part]) for f in floors]))
    rows.append(
        ratio_row(
            "reverse_kl step / floor",
            [median_step(run) / statistics.median(run["floor"]["total"]) for run in runs["reverse_kl"]],
            "<= 1.1",
        )
    )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per run, after one warm-up step")
    parser.add_argument("--size", choices=("lab", "real"), default="lab")
    options = parser.parse_args()
    main(options.repeats, options.steps, options.size)
