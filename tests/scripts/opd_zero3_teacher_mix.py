"""On-policy distillation under DeepSpeed ZeRO-3 with a `teacher` share in the state-source mix, launched by
tests/test_multiprocess.py with `accelerate launch --config_file recipes/accelerate/zero3.yaml`.

Usage: accelerate launch --config_file zero3.yaml --num_processes 2 opd_zero3_teacher_mix.py MODEL_PATH OUTPUT_DIR

Sources are drawn per rank, so on some generation batches one rank has teacher rows and the other none; teacher
generation gathers ZeRO-3 shards collectively, so a rank that skipped it would leave the other waiting. Each rank
writes `OUTPUT_DIR/rank<i>.json` with what ran and its teacher rows per generation batch.
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
dataset = Dataset.from_list([{"prompt": format_plain(r["question"])} for r in rows])
# seed 0, 2 rows per rank: the ranks draw [1, 0] and [1, 0] teacher rows on the first two generation batches
trainer = OnPolicyDistillTrainer(
    model=model_path,
    teacher_model=model_path,
    args=OnPolicyDistillConfig(
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        learning_rate=1e-3,
        state_source_mix={"learner": 0.8, "teacher": 0.2},
        **CPU,
    ),
    train_dataset=dataset,
    state_logging=False,
)
teacher_rows = []
generate = trainer._generate


def counting_generate(prompts):
    teacher_rows.append(trainer._rollout_batch.sources.count("teacher"))
    return generate(prompts)


trainer._generate = counting_generate
trainer.train()
plugin = trainer.accelerator.state.deepspeed_plugin
(output_dir / f"rank{trainer.accelerator.process_index}.json").write_text(
    json.dumps(
        {
            "world_size": trainer.accelerator.num_processes,
            "zero_stage": None if plugin is None else plugin.zero_stage,
            "teacher_engine": type(trainer.teacher_model).__name__,
            "teacher_rows": teacher_rows,
            "global_step": trainer.state.global_step,
        }
    )
)
