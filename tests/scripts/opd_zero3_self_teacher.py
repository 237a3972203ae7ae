"""The student as its own teacher (`teacher_model_kind="live"`) under DeepSpeed ZeRO-3, launched by
tests/test_multiprocess.py with `accelerate launch --config_file recipes/accelerate/zero3.yaml`.

Usage: accelerate launch --config_file zero3.yaml --num_processes 2 opd_zero3_self_teacher.py MODEL_PATH OUTPUT_DIR

A live teacher is the student's own (partitioned) module: it scores through the student's ZeRO-3 parameter hooks,
generates through the student's engine (gathered, as GRPO's own generation), and in the divergence loss runs a
second forward of the student module inside the student's own. Two steps per signal, with `teacher` states in the
mix; a LoRA student's `base` teacher (its adapter disabled) with divergence; then an `ema` self teacher, which
needs a copy of the partitioned student, is refused. Each rank writes
`OUTPUT_DIR/rank<i>.json` with what ran.
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


def config(signal, kind="live"):
    return OnPolicyDistillConfig(
        output_dir=str(output_dir / signal),
        max_steps=2,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        continuation_length=2,
        learning_rate=1e-3,
        signal=signal,
        teacher_model_kind=kind,
        state_source_mix={"learner": 0.5, "teacher": 0.5},
        **CPU,
    )


report = {}
for signal in ("reverse_kl", "divergence", "continuation"):
    trainer = OnPolicyDistillTrainer(model=model_path, args=config(signal), train_dataset=dataset, state_logging=False)
    trainer.train()
    kl = [entry["teacher_kl"] for entry in trainer.state.log_history if "teacher_kl" in entry]
    report[signal] = {"global_step": trainer.state.global_step, "teacher_kl": kl}
# A LoRA student's "base" teacher: the same partitioned module with its adapter disabled, no copy
from peft import LoraConfig  # noqa: E402

lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
trainer = OnPolicyDistillTrainer(
    model=model_path, args=config("divergence", "base"), train_dataset=dataset, peft_config=lora, state_logging=False
)
trainer.train()
kl = [entry["teacher_kl"] for entry in trainer.state.log_history if "teacher_kl" in entry]
report["lora_base"] = {"global_step": trainer.state.global_step, "teacher_kl": kl}
plugin = trainer.accelerator.state.deepspeed_plugin
report["zero_stage"] = None if plugin is None else plugin.zero_stage
report["world_size"] = trainer.accelerator.num_processes
try:
    OnPolicyDistillTrainer(model=model_path, args=config("reverse_kl", "ema"), train_dataset=dataset)
    report["ema"] = "accepted"
except ValueError as error:
    report["ema"] = str(error)
(output_dir / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps(report))
