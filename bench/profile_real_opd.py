"""Where a real-model OPD step's time goes: SmolLM2-135M-Instruct on real GSM8K prompts, each part against its floor.

One `OnPolicyDistillTrainer` run per arm (`full`: full fine-tuning; `lora`: LoRA r=16 on every linear layer), the
student's own weights as an in-process teacher (a teacher forward costs a student forward), 8 rollouts a step (4
GSM8K train prompts in the chat template x 2), exactly `--tokens` sampled tokens each (`min_new_tokens`: the floor
generates as many). The first step warms up; the next `--steps` are timed part by part:

- generation: TRL's `_generate_single_turn` (the student's `generate`);
- teacher scoring: the teacher's `score` (one no-grad forward over prompt and completion);
- the rest of the rollouts' preparation: `_prepare_inputs` without the two above (padding, GRPO's bookkeeping);
- student forward and backward: `Trainer.training_step` without `_prepare_inputs` (the loss's forward, its
  backward; one micro-batch a step);
- optimizer: from `on_pre_optimizer_step` to `on_optimizer_step` (clipping, AdamW);
- records: `StateLoggingCallback.on_step_end` (gathering the step's state records, writing the ledger);
- the whole step, from `on_step_begin` to `on_step_end`.

Floors, right after, on the token batches the run trained on (`bench_opd.measure_floor`): a plain `generate` with the
KV cache, a no-grad teacher forward, a student forward and backward of the same loss, the optimizer step; for LoRA the
generation floor is the base model's (the adapter merged). And the FLOPs each part needs (2 N per token forward,
6 N forward and backward, N the parameters; the attention's and the LM head's included in N through the tied
embedding) at the machine's measured matmul rate.

    .venv/bin/python bench/profile_real_opd.py [--arms full lora] [--steps 2] [--tokens 128]

Runs on both cores (2 torch threads). Needs ../shared/data/gsm8k (real prompts); writes bench/results/profile_real_opd.json.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
from bench_opd import measure_floor
from common import CPU_ARGS, keep_token_batches, run_forked, say, scratch_dir, timed, write_results
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOTrainer

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLoggingCallback
from trl_statelens.data import load_gsm8k
from trl_statelens.real_models import SMOLLM2
from trl_statelens.reports.runs import resolve_model
from trl_statelens.teachers import InProcessTeacher

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
ROLLOUTS, NUM_GENERATIONS = 8, 2
THREADS = 2  # both cores (bench/common.py pins 1 for its A/B runs): the setting a real run on this machine would use


def matmul_rate(size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a float32 square matmul on this machine's `THREADS` threads (the best of `repeats`)."""
    torch.set_num_threads(THREADS)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = min(_seconds(lambda: a @ b) for _ in range(repeats))
    return 2 * size**3 / best


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class StepTimer(TrainerCallback):
    """The whole step's time and the optimizer's, per step."""

    def __init__(self):
        self.step, self.optimizer, self._start = [], [], {}

    def on_step_begin(self, args, state, control, **kwargs):
        self._start["step"] = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._start["optimizer"] = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.optimizer.append(time.perf_counter() - self._start["optimizer"])

    def on_step_end(self, args, state, control, **kwargs):
        self.step.append(time.perf_counter() - self._start["step"])


def run_arm(arm: str, model_path: str, tokens: int, steps: int) -> dict:
    """One run of `arm`, in a forked child (the timed methods are patched on classes)."""
    torch.set_num_threads(THREADS)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset = load_gsm8k(DATA, "train", prompt_format="chat", limit=64, seed=0)
    parts = {}

    for cls, name, part in (
        (GRPOTrainer, "_generate_single_turn", "generation"),
        (InProcessTeacher, "score", "teacher_scoring"),
        (OnPolicyDistillTrainer, "_prepare_inputs", "rollouts"),  # generation, scoring and GRPO's bookkeeping
        (OnPolicyDistillTrainer, "training_step", "training_step"),  # the rollouts (when due), forward, backward
        (StateLoggingCallback, "on_step_end", "records"),
    ):
        setattr(cls, name, timed(getattr(cls, name), parts.setdefault(part, [])))
    args = OnPolicyDistillConfig(
        scratch_dir(f"profile-real-{arm}-"),
        max_steps=1 + steps,
        per_device_train_batch_size=ROLLOUTS,
        num_generations=NUM_GENERATIONS,
        max_completion_length=tokens,
        generation_kwargs={"min_new_tokens": tokens},
        temperature=1.0,
        **{**CPU_ARGS, "learning_rate": 1e-5 if arm == "full" else 2e-4},
    )
    peft_config = None
    if arm == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    timer = StepTimer()
    trainer = OnPolicyDistillTrainer(
        model=model_path,
        teacher_model=model_path,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
        peft_config=peft_config,
    )
    batches = keep_token_batches(trainer)
    trainer.train()
    measured = {part: values[1:] for part, values in parts.items()}  # the first call of each: the warm-up step
    # One micro-batch a step: the step's forward and backward is its training_step without the rollouts
    measured["student_forward_backward"] = [t - r for t, r in zip(measured["training_step"], measured["rollouts"])]
    measured["rollouts_other"] = [
        r - g - s for r, g, s in zip(measured["rollouts"], measured["generation"], measured["teacher_scoring"])
    ]
    measured["optimizer"] = timer.optimizer[1:]
    measured["step"] = timer.step[1:]
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    student = trainer.accelerator.unwrap_model(trainer.model)
    floor = measure_floor(trainer, teacher, batches[1:])
    if arm == "lora":  # the generation floor is the base model's: the adapter merged into its weights
        student.merge_adapter()
        floor["generate_unmerged"] = floor["generate"]
        floor["generate"] = []
        for batch in batches[1:]:
            with torch.no_grad():
                floor["generate"].append(
                    _seconds(
                        lambda b=batch: student.generate(
                            input_ids=b["prompt_ids"],
                            attention_mask=b["prompt_mask"],
                            generation_config=trainer.generation_config,
                        )
                    )
                )
        student.unmerge_adapter()
    prompt_tokens = [int(b["prompt_mask"].sum()) for b in batches[1:]]
    return {
        "arm": arm,
        "parameters": sum(p.numel() for p in teacher.parameters()),
        "trainable": sum(p.numel() for p in student.parameters() if p.requires_grad),
        "prompt_tokens_per_step": prompt_tokens,
        "completion_tokens_per_step": ROLLOUTS * tokens,
        "seconds": measured,
        "floor_seconds": floor,
    }


def summarize(result: dict, rate: float) -> list[dict]:
    """One row per part: median seconds, the floor's, their ratio, and the FLOPs floor at `rate`."""
    n, completion = result["parameters"], result["completion_tokens_per_step"]
    tokens = completion + statistics.median(result["prompt_tokens_per_step"])
    flops = {
        "generation": 2 * n * tokens,  # every position once through the model (the cache keeps the prefix)
        "teacher_scoring": 2 * n * tokens,
        "student_forward_backward": 6 * n * tokens,
    }
    pairs = {
        "generation": "generate",
        "teacher_scoring": "teacher_forward",
        "student_forward_backward": "student_forward_backward",
        "rollouts_other": None,
        "optimizer": "optimizer_step",
        "records": None,
        "step": "total",
    }
    rows = []
    for part, floor_part in pairs.items():
        seconds = statistics.median(result["seconds"].get(part, [float("nan")]))
        floor = statistics.median(result["floor_seconds"][floor_part]) if floor_part else None
        rows.append(
            {
                "part": part,
                "seconds": round(seconds, 2),
                "floor_seconds": None if floor is None else round(floor, 2),
                "ratio": None if floor is None else round(seconds / floor, 3),
                "flops_floor_seconds": round(flops[part] / rate, 2) if part in flops else None,
            }
        )
    return rows


def main(arms, steps, tokens) -> dict:
    if not (DATA / "train.jsonl").exists():
        raise SystemExit(f"needs real GSM8K prompts at {DATA} (see ../shared/data/README.md)")
    model_path = str(resolve_model(SMOLLM2))
    rate = run_forked(matmul_rate)  # in a child too: OpenMP's threads started here would hang a forked child
    say(f"matmul: {rate / 1e9:.0f} GFLOP/s")
    results = {"matmul_flops_per_second": rate, "tokens": tokens, "arms": {}}
    for arm in arms:
        result = run_forked(run_arm, arm, model_path, tokens, steps)
        result["summary"] = summarize(result, rate)
        results["arms"][arm] = result
        say(f"{arm}:")
        for row in result["summary"]:
            say(f"  {row}")
    write_results("profile_real_opd", results)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    main(args.arms, args.steps, args.tokens)
