"""On-policy distillation under DeepSpeed ZeRO-3 with two in-process teachers whose rows split unevenly across the
ranks, launched by tests/test_multiprocess.py with `accelerate launch --config_file recipes/accelerate/zero3.yaml
--gradient_accumulation_steps 2` (DeepSpeed takes its accumulation from the launcher, the trainer from its config).

Usage: accelerate launch ... opd_zero3_uneven_teachers.py STUDENT TEACHER OUT

`gradient_accumulation_steps=2` and `num_generations=1`: each rank's generation batch is 4 rows (2 micro-batches of
2), in dataset order (`shuffle_dataset=False`): rows 0-3 on rank 0 and 4-7 on rank 1, then 8-11 and 12-15. The
`teacher_id`s give rank 0 three rows of teacher "a" and one of "b", rank 1 the reverse. An in-process teacher scores
its rows in chunks of the per-device batch size (2), each chunk a forward that gathers its ZeRO-3 shards
collectively: "a" has 2 chunks of its own on rank 0 and 1 on rank 1. Each rank writes `OUT/rank<i>.json` with what
ran, its rows per teacher per generation batch and each teacher's forwards.
"""

import json
import os
import sys
from collections import Counter
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
student_path, teacher_path, output_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
rows = LabWorld(seed=0).math("train", n=16)
layout = ["a", "a", "a", "b", "a", "b", "b", "b"] * 2  # rank 0: a a a b, rank 1: a b b b, per generation batch
dataset = Dataset.from_list(
    [{"prompt": format_plain(r["question"]), "teacher_id": t} for r, t in zip(rows, layout, strict=True)]
)
trainer = OnPolicyDistillTrainer(
    model=student_path,
    teacher_model={"a": student_path, "b": teacher_path},
    args=OnPolicyDistillConfig(
        preflight="off",  # the test counts training's own teacher calls
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_generations=1,
        shuffle_dataset=False,
        max_completion_length=4,
        learning_rate=1e-3,
        signal="reverse_kl",
        **CPU,
    ),
    train_dataset=dataset,
    state_logging=False,
)
rows_per_teacher = []
generate_and_score = trainer._generate_and_score_completions


def recording(inputs):
    rows_per_teacher.append(Counter(row["teacher_id"] for row in inputs))
    return generate_and_score(inputs)


trainer._generate_and_score_completions = recording
forwards = Counter()
for name, teacher in trainer.teacher.teachers.items():
    decoder = trainer.accelerator.unwrap_model(teacher.model).get_decoder()
    decoder.register_forward_hook(lambda *args, name=name: forwards.update([name]))
trainer.train()
plugin = trainer.accelerator.state.deepspeed_plugin
(output_dir / f"rank{trainer.accelerator.process_index}.json").write_text(
    json.dumps(
        {
            "world_size": trainer.accelerator.num_processes,
            "zero_stage": None if plugin is None else plugin.zero_stage,
            "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
            "steps_per_generation": trainer.args.steps_per_generation,
            "teacher_engines": {name: type(t.model).__name__ for name, t in trainer.teacher.teachers.items()},
            "rows_per_teacher": [dict(counts) for counts in rows_per_teacher],
            "teacher_forwards": dict(forwards),
            "global_step": trainer.state.global_step,
        }
    )
)
trainer.accelerator.end_training()  # destroys the process group before exit (see tests/test_multiprocess.py)
