"""Two-rank run of the StateLens trainers, launched by tests/test_multiprocess.py with `accelerate launch`.

Usage: accelerate launch --multi_gpu --num_processes 2 statelens_two_ranks.py MODEL_PATH OUTPUT_DIR

Each rank writes `OUTPUT_DIR/rank<i>.json` with what it actually ran (world size, backend) and the supervised tokens
it computed the loss on per optimizer step, counted from the batches (not from the records), for SFT, GRPO and on-policy distillation,
and GRPO's rollouts as its reward function scored them on this rank (`solution_steps`, reward).
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
from transformers import AutoTokenizer  # noqa: E402
from trl import GRPOConfig, SFTConfig  # noqa: E402

from trl_statelens import (  # noqa: E402
    OnPolicyDistillConfig,
    OnPolicyDistillTrainer,
    StateLensGRPOTrainer,
    StateLensSFTTrainer,
    StateLoggingCallback,
)
from trl_statelens.data import solution_steps  # noqa: E402
from trl_statelens.lab import LabWorld, format_plain  # noqa: E402

torch.set_num_threads(1)
model_path, output_dir = sys.argv[1], Path(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(model_path)
rows = LabWorld(seed=0).math("train", n=32)
dataset = Dataset.from_list([{"prompt": format_plain(r["question"]), "completion": " " + r["answer"]} for r in rows])
common = dict(**CPU, per_device_train_batch_size=2, learning_rate=1e-3)

# SFT, with gradient accumulation: ranks see different rows, so different numbers of supervised tokens
sft = StateLensSFTTrainer(
    model=model_path,
    args=SFTConfig(
        output_dir=str(output_dir / "sft"), max_steps=3, gradient_accumulation_steps=2, max_length=256, **common
    ),
    train_dataset=dataset,
    processing_class=tokenizer,
    callbacks=[StateLoggingCallback(sample_rate=1.0)],
)
sft_tokens = []


def count_labels(module, args, kwargs):
    if module.training and kwargs.get("fused_lm_head"):
        sft_tokens.append(int((kwargs["labels"][:, 1:] != -100).sum()))


sft.model.register_forward_pre_hook(count_labels, with_kwargs=True)
sft.train()


grpo_rollouts = []  # per reward call, this rank's (solution_steps, reward)


def digit_reward(completions, solution_steps, **kwargs):
    rewards = [float(sum(ch.isdigit() for ch in completion)) for completion in completions]
    grpo_rollouts.append(list(zip(solution_steps, rewards)))
    return rewards


grpo = StateLensGRPOTrainer(
    model=model_path,
    reward_funcs=digit_reward,
    args=GRPOConfig(
        output_dir=str(output_dir / "grpo"), max_steps=2, num_generations=2, max_completion_length=8, **common
    ),
    train_dataset=Dataset.from_dict(
        {"prompt": dataset["prompt"], "solution_steps": [solution_steps(r["answer"]) for r in rows]}
    ),
    processing_class=tokenizer,
    callbacks=[StateLoggingCallback(sample_rate=1.0)],
    preflight="off",  # the preflight calls the reward function too: the test reads the training's calls only
)
grpo_tokens = []
compute_loss = grpo._compute_loss


def counting_compute_loss(model, inputs):
    grpo_tokens.append(int(inputs["completion_mask"].sum()))
    return compute_loss(model, inputs)


grpo._compute_loss = counting_compute_loss
grpo.train()

# On-policy distillation with teacher continuations and a mix of state sources: teacher generation on each rank
opd = OnPolicyDistillTrainer(
    model=model_path,
    teacher_model=model_path,
    args=OnPolicyDistillConfig(
        output_dir=str(output_dir / "opd"),
        max_steps=2,
        num_generations=2,
        max_completion_length=8,
        signal="continuation",
        continuation_length=4,
        state_source_mix={"learner": 0.5, "dataset": 0.25, "teacher": 0.25},
        **common,
    ),
    train_dataset=dataset,
    processing_class=tokenizer,
    callbacks=[StateLoggingCallback(sample_rate=1.0)],
)
opd_tokens = []
opd_compute_loss = opd._compute_loss


def counting_opd_loss(model, inputs):
    opd_tokens.append(int(inputs["loss_mask"].sum()))
    return opd_compute_loss(model, inputs)


opd._compute_loss = counting_opd_loss
opd.train()

accelerator = sft.accelerator
(output_dir / f"rank{accelerator.process_index}.json").write_text(
    json.dumps(
        {
            "world_size": accelerator.num_processes,
            "distributed_type": accelerator.distributed_type.value,
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
            "sft_tokens_per_micro_batch": sft_tokens,
            "grpo_tokens_per_step": grpo_tokens,
            "grpo_rollouts": grpo_rollouts,
            "opd_tokens_per_step": opd_tokens,
        }
    )
)
# Destroy the process group (it joins gloo's worker threads) while Python is still fully alive: a collective's last
# reference dropped by a gloo thread during interpreter shutdown aborts the process ("terminate called without an
# active exception", SIGABRT). See the note in tests/test_multiprocess.py.
opd.end()
