"""On-policy distillation under DeepSpeed ZeRO-3 with two in-process teachers routed by `teacher_id`, launched by
tests/test_multiprocess.py with `accelerate launch --config_file recipes/accelerate/zero3.yaml`.

Usage: accelerate launch --config_file zero3.yaml --num_processes 2 opd_zero3_two_teachers.py STUDENT TEACHER OUT

Each rank gets one prompt per step, so on a step where the ranks' prompts name different teachers, each teacher has
rows on one rank only: every call an in-process teacher makes (scoring, generation for the `teacher` state source,
the divergence loss) gathers its ZeRO-3 shards collectively, so the rank without its rows must still join, or the
other waits forever. One run per signal (`reverse_kl`, `divergence`), with a `teacher` share in the state-source mix.
Each rank writes `OUT/rank<i>.json` with what ran and the `teacher_id` of its rows per step.
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

SIGNALS = ("reverse_kl", "divergence")

torch.set_num_threads(1)
student_path, teacher_path, output_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
rows = LabWorld(seed=0).math("train", n=8)
# teacher_id alternates over the prompts: the sampler's shuffle decides which rank gets which on each step
dataset = Dataset.from_list(
    [{"prompt": format_plain(r["question"]), "teacher_id": "a" if i % 2 else "b"} for i, r in enumerate(rows)]
)
report = {}
for signal in SIGNALS:
    trainer = OnPolicyDistillTrainer(
        model=student_path,
        teacher_model={"a": student_path, "b": teacher_path},
        args=OnPolicyDistillConfig(
            output_dir=str(output_dir / signal),
            max_steps=3,
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=4,
            learning_rate=1e-3,
            signal=signal,
            state_source_mix={"learner": 0.5, "teacher": 0.5},
            **CPU,
        ),
        train_dataset=dataset,
        callbacks=[StateLoggingCallback(sample_rate=1.0)],  # every supervised sequence in states.jsonl
    )
    row_teachers = []
    generate_and_score = trainer._generate_and_score_completions

    def recording(inputs, generate_and_score=generate_and_score, row_teachers=row_teachers):
        row_teachers.append([row["teacher_id"] for row in inputs])  # one call per step here
        return generate_and_score(inputs)

    trainer._generate_and_score_completions = recording
    trainer.train()
    plugin = trainer.accelerator.state.deepspeed_plugin
    report[signal] = {
        "world_size": trainer.accelerator.num_processes,
        "zero_stage": None if plugin is None else plugin.zero_stage,
        "teacher_engines": {name: type(t.model).__name__ for name, t in trainer.teacher.teachers.items()},
        "row_teachers": row_teachers,
        "global_step": trainer.state.global_step,
        "log_history": trainer.state.log_history,
    }
(output_dir / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps(report))
trainer.accelerator.end_training()  # destroys the process group before exit (see tests/test_multiprocess.py)
