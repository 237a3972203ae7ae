"""The `divergence` signal from a served teacher with the student under DeepSpeed ZeRO-3, launched by
tests/test_multiprocess.py with `accelerate launch --config_file recipes/accelerate/zero3.yaml`.

Usage: accelerate launch ... served_teacher_zero3_divergence.py STUDENT URL OUT

The loss calls the student's output layer once per `heads.POSITION_CHUNK` supervised positions, and under ZeRO-3
each call gathers the layer's shards from both ranks. `POSITION_CHUNK` is set to 2 here, and every row's completion
is its reference answer (`dataset` states, `shuffle_dataset=False`, `num_generations=1`: rows 0-1 on rank 0, 2-3
on rank 1, then 4-5 and 6-7), so the ranks supervise different numbers of positions: on the first step rank 0's
references do not fit in `max_completion_length` and `mask_truncated_completions` masks them whole (no supervised
position), while rank 1's fit; on the second both fit, rank 1's longer. Each rank writes `OUT/rank<i>.json` with
what ran, its supervised positions per step and its calls of the output layer in each step's loss.
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

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, heads  # noqa: E402
from trl_statelens.lab import LabWorld, format_plain  # noqa: E402

heads.POSITION_CHUNK = 2
torch.set_num_threads(1)
student_path, url, output_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
long_answer = "the answer is the sum of all the numbers in the question and then some more"
references = [long_answer, long_answer, "4", "12", "7", "9", "so 30", "41"]
rows = LabWorld(seed=0).math("train", n=len(references))
dataset = Dataset.from_list(
    [{"prompt": format_plain(r["question"]), "completion": " " + c} for r, c in zip(rows, references, strict=True)]
)
trainer = OnPolicyDistillTrainer(
    model=student_path,
    args=OnPolicyDistillConfig(
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=2,
        num_generations=1,
        shuffle_dataset=False,
        max_completion_length=6,
        mask_truncated_completions=True,
        learning_rate=1e-3,
        signal="divergence",
        state_source_mix={"dataset": 1.0},
        teacher_model_server_url=url,
        **CPU,
    ),
    train_dataset=dataset,
    state_logging=False,
)
supervised = []
generate_and_score = trainer._generate_and_score_completions


def recording(inputs):
    output = generate_and_score(inputs)
    supervised.append(int(output["completion_mask"].sum()))
    return output


trainer._generate_and_score_completions = recording
# The output layer's calls within each micro-batch's loss (the student's own generation calls it too, per token)
head_calls, loss_head_calls = [], []
head = trainer.accelerator.unwrap_model(trainer.model).get_output_embeddings()
head.register_forward_hook(lambda *args: head_calls.append(1))
divergence_loss = trainer.teacher.divergence_loss


def counting(*args, **kwargs):
    before = len(head_calls)
    result = divergence_loss(*args, **kwargs)
    loss_head_calls.append(len(head_calls) - before)
    return result


trainer.teacher.divergence_loss = counting
trainer.train()
plugin = trainer.accelerator.state.deepspeed_plugin
(output_dir / f"rank{trainer.accelerator.process_index}.json").write_text(
    json.dumps(
        {
            "world_size": trainer.accelerator.num_processes,
            "zero_stage": None if plugin is None else plugin.zero_stage,
            "student_engine": type(trainer.model_wrapped).__name__,
            "position_chunk": heads.POSITION_CHUNK,
            "supervised_positions": supervised,
            "loss_head_calls": loss_head_calls,
            "global_step": trainer.state.global_step,
        }
    )
)
trainer.accelerator.end_training()  # destroys the process group before exit (see tests/test_multiprocess.py)
