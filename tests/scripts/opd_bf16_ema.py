"""The EMA self teacher under DeepSpeed with bf16, launched by tests/test_multiprocess.py with
`accelerate launch --config_file recipes/accelerate/zero<2|3>.yaml --mixed_precision bf16`.

Usage: accelerate launch --config_file zero2.yaml --mixed_precision bf16 --num_processes 2 opd_bf16_ema.py MODEL OUT 2
(the last argument: the ZeRO stage of the config)

DeepSpeed with bf16 casts every parameter it is given to bf16 in place (the student when training starts, the
teacher's copy when it is prepared), after the average was made; the average must stay fp32 and be cast for the
teacher's forward. ZeRO-2: a LoRA student's `"ema"` (its adapter average, swapped in for the teacher's calls) trains
two steps, then one more update is checked against the rule; a full-weight student's `"ema"` (a copy, prepared as a
bf16 engine of its own) trains two steps, checkpointed after each. ZeRO-3: the same with the copy loaded again,
partitioned in bf16 (each rank averages its own partitions in fp32), then resumed from the first checkpoint. Each
rank writes `OUT/rank<i>.json` with what ran and the largest differences from the update rule.
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
from peft import LoraConfig  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer  # noqa: E402
from trl_statelens.lab import LabWorld, format_plain  # noqa: E402
from trl_statelens.teachers import SelfTeacher, without_zero3_init  # noqa: E402

torch.set_num_threads(1)
model_path, output_dir, stage = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
rows = LabWorld(seed=0).math("train", n=8)
dataset = Dataset.from_list(
    [{"prompt": format_plain(r["question"]), "privileged_context": "Answer: " + r["answer"]} for r in rows]
)
RATE = 0.25


def config(name, **kwargs):
    defaults = dict(
        output_dir=str(output_dir / name),
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        learning_rate=1e-2,
        signal="reverse_kl",
        teacher_model_kind="ema",
        teacher_update_rate=RATE,
    )
    return OnPolicyDistillConfig(**{**defaults, **CPU, "bf16": True, **kwargs})


def gathered(model):
    """The model's parameters, whole and in fp32 (under ZeRO-3 a collective: every rank gathers)."""
    params = dict(model.named_parameters())
    if not hasattr(next(iter(params.values())), "ds_id"):
        return {name: p.detach().float() for name, p in params.items()}
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().float().clone() for name, p in params.items()}


def max_diff(a, b):
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def dtypes(model):
    return sorted({str(p.dtype) for p in model.parameters()})


report = {}
with without_zero3_init():
    initial = {name: p.detach() for name, p in AutoModelForCausalLM.from_pretrained(model_path).named_parameters()}

if stage == 2:
    # A LoRA student's "ema": the average made from the fp32 adapter, then DeepSpeed casts the adapter to bf16
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = OnPolicyDistillTrainer(
        model=model_path, args=config("lora_ema", max_steps=2), train_dataset=dataset, peft_config=lora,
        state_logging=False,
    )  # fmt: skip
    start = {name: t.clone() for name, t in trainer.teacher.weights.average.items()}
    trainer.train()
    average = trainer.teacher.weights.average
    adapter = {name: p.detach() for name, p in trainer.teacher.weights._trained}
    before = {name: t.clone() for name, t in average.items()}
    trainer.teacher.weights.update_average(RATE)
    expected = {name: torch.lerp(before[name], adapter[name].float(), RATE) for name in adapter}
    report["lora_ema"] = {
        "global_step": trainer.state.global_step,
        "student_dtypes": dtypes(trainer.model),
        "adapter_dtypes": sorted({str(t.dtype) for t in adapter.values()}),
        "average_dtypes": sorted({str(t.dtype) for t in average.values()}),
        "moved": max_diff(before, start),  # > 0: two steps moved the average
        "update_rule_diff": max_diff(average, expected),  # 0: fp32 average <- lerp(average, adapter, r)
    }

# A full-weight student's "ema": the teacher computes in bf16, the average is fp32. Two steps, checkpointed after each
# (the checkpoint holds the student's bf16 weights and the fp32 average); the second update also refreshes what ZeRO-3
# keeps gathered between forwards (small parameters, once the first step has traced the teacher's forward)
name = "full_ema"
ema_args = dict(max_steps=2, save_strategy="steps", save_steps=1)
trainer = OnPolicyDistillTrainer(
    model=model_path, args=config(name, **ema_args), train_dataset=dataset, state_logging=False
)
trainer.train()
teacher = gathered(trainer.accelerator.unwrap_model(trainer.teacher.model))
checkpoints = [output_dir / name / f"checkpoint-{step}" for step in (1, 2)]
students = [{k: v.float() for k, v in load_file(c / "model.safetensors").items()} for c in checkpoints]
saved = [load_file(c / SelfTeacher.EMA_FILE) for c in checkpoints]
saved_dtypes = sorted({str(t.dtype) for t in saved[1].values()})
saved = [{k: v.float() for k, v in average.items()} for average in saved]
# The average starts at the student's weights as the copy holds them before the cast: the fp32 file's under ZeRO-2 (a
# deep copy of the fp32 student), their bf16 rounding under ZeRO-3 (the copy is loaded partitioned in bf16)
zero3 = stage == 3
start = {k: v.to(torch.bfloat16).float() if zero3 else v for k, v in initial.items()}
report[name] = {
    "global_step": trainer.state.global_step,
    "teacher_dtypes": dtypes(trainer.accelerator.unwrap_model(trainer.teacher.model)),
    "saved_dtypes": saved_dtypes,
    # 0: the fp32 average, saved whole, follows the rule at each step
    "rule_diffs": [
        max_diff(saved[0], {k: torch.lerp(start[k], students[0][k], RATE) for k in start}),
        max_diff(saved[1], {k: torch.lerp(saved[0][k], students[1][k], RATE) for k in start}),
    ],
    "teacher_cast_diff": max_diff(teacher, {k: v.to(torch.bfloat16).float() for k, v in saved[1].items()}),  # 0
    "moved": max_diff(saved[1], start),  # > 0
    "bf16_moved": max_diff(teacher, {k: v.to(torch.bfloat16).float() for k, v in start.items()}),  # > 0
}
if zero3:  # resumed from step 1: the fp32 average continues from the saved one, exactly
    resumed_dir = output_dir / "resumed"
    trainer = OnPolicyDistillTrainer(
        model=model_path, args=config("resumed", **ema_args), train_dataset=dataset, state_logging=False
    )
    trainer.train(resume_from_checkpoint=str(checkpoints[0]))
    student = gathered(trainer.accelerator.unwrap_model(trainer.model))
    final = load_file(resumed_dir / "checkpoint-2" / SelfTeacher.EMA_FILE)
    report[name]["resumed_global_step"] = trainer.state.global_step
    report[name]["resumed_rule_diff"] = max_diff(final, {k: torch.lerp(saved[0][k], student[k], RATE) for k in start})
report["zero_stage"] = trainer.accelerator.state.deepspeed_plugin.zero_stage
report["bf16"] = trainer.model_wrapped.bfloat16_enabled()
report["world_size"] = trainer.accelerator.num_processes
(output_dir / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps(report))
