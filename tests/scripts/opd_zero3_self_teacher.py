"""The student as its own teacher under DeepSpeed ZeRO-3, launched by tests/test_multiprocess.py with
`accelerate launch --config_file recipes/accelerate/zero3.yaml`.

Usage: accelerate launch --config_file zero3.yaml --num_processes 2 opd_zero3_self_teacher.py MODEL_PATH OUTPUT_DIR

A live teacher is the student's own (partitioned) module: it scores through the student's ZeRO-3 parameter hooks,
generates through the student's engine (gathered, as GRPO's own generation), and in the divergence loss runs a
second forward of the student module inside the student's own. Two steps per signal, with `teacher` states in the
mix; a LoRA student's `base` teacher (its adapter disabled) with divergence. Then the kinds that copy a full-weight
student, the copy loaded again from its path and partitioned: `base` (one step, empty privileged context), `ema`
(one step, checkpointed, then resumed for a second), whose gathered weights are compared with the update rule; and
`base` with the student given as an instance (no path to load the copy from) and a LoRA student's `ema`, refused.
Each rank writes `OUTPUT_DIR/rank<i>.json` with what ran.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared CPU settings

import torch  # noqa: E402
from cpu_settings import CPU  # noqa: E402
from datasets import Dataset  # noqa: E402

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer  # noqa: E402
from trl_statelens.lab import LabWorld, format_plain  # noqa: E402

torch.set_num_threads(1)
model_path, output_dir = sys.argv[1], Path(sys.argv[2])
rows = LabWorld(seed=0).math("train", n=8)
dataset = Dataset.from_list(
    [{"prompt": format_plain(r["question"]), "privileged_context": "Answer: " + r["answer"]} for r in rows]
)


def config(signal, kind="live", name=None, **kwargs):
    defaults = dict(
        output_dir=str(output_dir / (name or signal)),
        max_steps=2,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        learning_rate=1e-3,
        signal=signal,
        **({"continuation_length": 2} if signal == "continuation" else {}),
        teacher_model_kind=kind,
        state_source_mix={"learner": 0.5, "teacher": 0.5},
    )
    return OnPolicyDistillConfig(**{**defaults, **CPU, **kwargs})


report = {}
for signal in ("reverse_kl", "divergence", "continuation"):
    trainer = OnPolicyDistillTrainer(model=model_path, args=config(signal), train_dataset=dataset, state_logging=False)
    trainer.train()
    kl = [entry["teacher_kl/sampled"] for entry in trainer.state.log_history if "teacher_kl/sampled" in entry]
    report[signal] = {"global_step": trainer.state.global_step, "teacher_kl": kl}
# A LoRA student's "base" teacher: the same partitioned module with its adapter disabled, no copy
from peft import LoraConfig  # noqa: E402

lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
trainer = OnPolicyDistillTrainer(
    model=model_path, args=config("divergence", "base"), train_dataset=dataset, peft_config=lora, state_logging=False
)
trainer.train()
kl = [entry["teacher_kl/sampled"] for entry in trainer.state.log_history if "teacher_kl/sampled" in entry]
report["lora_base"] = {"global_step": trainer.state.global_step, "teacher_kl": kl}
plugin = trainer.accelerator.state.deepspeed_plugin
report["zero_stage"] = None if plugin is None else plugin.zero_stage
report["world_size"] = trainer.accelerator.num_processes


def gathered(model):
    """The model's parameters, whole (a collective: every rank gathers)."""
    import deepspeed

    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().clone() for name, p in params.items()}


def teacher_and_student(trainer):
    teacher = trainer.accelerator.unwrap_model(trainer.teacher.model)
    return gathered(teacher), gathered(trainer.accelerator.unwrap_model(trainer.model))


def max_diff(a, b):
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# A full-weight student's "base": the copy loaded again from its path. With an empty privileged context the teacher
# reads the student's own prompt, so the first step's teacher_kl is exactly 0
template = "{prompt}{privileged_context}"
blank = Dataset.from_list([{"prompt": row["prompt"], "privileged_context": ""} for row in dataset])
trainer = OnPolicyDistillTrainer(
    model=model_path,
    args=config("reverse_kl", "base", "full_base", max_steps=1, teacher_prompt_template=template),
    train_dataset=blank,
    state_logging=False,
)
trainer.train()
kl = [entry["teacher_kl/sampled"] for entry in trainer.state.log_history if "teacher_kl/sampled" in entry]
report["full_base"] = {
    "global_step": trainer.state.global_step,
    "teacher_kl": kl,
    "teacher_engine": type(trainer.teacher.model).__name__,
    "teacher_is_student": trainer.teacher.model is trainer.model,
}

# "ema": the same copy, moved by rate 0.25 after the step on gathered parameters, and checkpointed
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from trl_statelens.teachers import SelfTeacher, without_zero3_init  # noqa: E402

rate = 0.25
with without_zero3_init():
    initial = dict(AutoModelForCausalLM.from_pretrained(model_path).named_parameters())
ema_args = dict(teacher_update_rate=rate, save_strategy="steps", save_steps=1)
trainer = OnPolicyDistillTrainer(
    model=model_path, args=config("reverse_kl", "ema", "ema", max_steps=1, **ema_args), train_dataset=dataset,
    state_logging=False,
)  # fmt: skip
trainer.train()
teacher, student = teacher_and_student(trainer)
expected = {name: torch.lerp(initial[name].detach(), student[name], rate) for name in student}
saved = load_file(output_dir / "ema" / "checkpoint-1" / SelfTeacher.EMA_FILE)
report["ema"] = {
    "global_step": trainer.state.global_step,
    "teacher_engine": type(trainer.teacher.model).__name__,
    "update_rule_diff": max_diff(teacher, expected),  # 0: teacher = (1 - r) * initial + r * student
    "moved": max_diff(teacher, {k: v.detach() for k, v in initial.items()}),  # > 0: the step changed it
    "saved_diff": max_diff(saved, teacher),  # the checkpoint holds the whole average
}
# Resumed from checkpoint-1 for a second step: the teacher starts from the saved average, not from the path's weights
trainer = OnPolicyDistillTrainer(
    model=model_path, args=config("reverse_kl", "ema", "ema", **ema_args), train_dataset=dataset, state_logging=False
)
trainer.train(resume_from_checkpoint=str(output_dir / "ema" / "checkpoint-1"))
teacher, student = teacher_and_student(trainer)
report["ema"]["resumed_global_step"] = trainer.state.global_step
report["ema"]["resumed_diff"] = max_diff(teacher, {k: torch.lerp(saved[k], student[k], rate) for k in student})

# A student given as an instance has no path to load the copy from: refused, naming the fix
with without_zero3_init():
    instance = AutoModelForCausalLM.from_pretrained(model_path)
try:
    OnPolicyDistillTrainer(model=instance, args=config("reverse_kl", "base", "instance"), train_dataset=dataset)
    report["instance_base"] = "accepted"
except ValueError as error:
    report["instance_base"] = str(error)
# A LoRA student's "ema" swaps its averaged adapter in whole, which ZeRO-3 partitions: refused
try:
    OnPolicyDistillTrainer(
        model=model_path, args=config("reverse_kl", "ema", "lora_ema"), train_dataset=dataset, peft_config=lora
    )
    report["lora_ema"] = "accepted"
except ValueError as error:
    report["lora_ema"] = str(error)
(output_dir / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps(report))
