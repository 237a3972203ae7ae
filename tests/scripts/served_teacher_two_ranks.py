"""Two-rank on-policy distillation with the teacher behind a (test) vLLM server, launched by
tests/test_served_teacher.py with `accelerate launch`.

Usage: accelerate launch --multi_gpu --num_processes 2 served_teacher_two_ranks.py STUDENT URL OUTPUT_DIR

Each rank sends its own rows to the server. Rank i writes `OUTPUT_DIR/rank<i>.json`: the world size, the logged
`teacher_kl`, and each step's batch (prompt and completion ids and masks) with the teacher log-probs it was given.
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

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLoggingCallback  # noqa: E402
from trl_statelens.lab import LabWorld, format_plain  # noqa: E402

torch.set_num_threads(1)
student_path, url, output_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
rows = LabWorld(seed=0).math("train", n=32)
dataset = Dataset.from_list([{"prompt": format_plain(r["question"])} for r in rows])
trainer = OnPolicyDistillTrainer(
    model=student_path,
    args=OnPolicyDistillConfig(
        preflight="off",  # the test counts training's own teacher calls
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        learning_rate=1e-3,
        teacher_model_server_url=url,
        **CPU,
    ),
    train_dataset=dataset,
    callbacks=[StateLoggingCallback()],
)
batches = []
generate_and_score = trainer._generate_and_score_completions


def keep_batch(inputs):
    output = generate_and_score(inputs)
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
    batches.append({key: output[key].tolist() for key in keys})
    batches[-1]["teacher_logps"] = trainer._resolve_teacher_logps(output).tolist()  # once the server answered
    return output


trainer._generate_and_score_completions = keep_batch
trainer.train()
result = {
    "world_size": trainer.accelerator.num_processes,
    "teacher_kl": [e["teacher_kl/sampled"] for e in trainer.state.log_history if "teacher_kl/sampled" in e],
    "batches": batches,
}
(output_dir / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps(result))
