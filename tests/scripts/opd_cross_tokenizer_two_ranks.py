"""On-policy distillation from a teacher of another tokenizer on two ranks, DDP or DeepSpeed ZeRO-3, launched by
tests/test_cross_tokenizer_*.py with `accelerate launch --multi_gpu --num_processes 2` (or
`test_multiprocess.launch_zero3`).

Usage: accelerate launch --multi_gpu --num_processes 2 opd_cross_tokenizer_two_ranks.py STUDENT TEACHER OUT [SAME
[SETTINGS]]

Each rank writes `OUT/rank<i>.json` with what ran (world size, backend, ZeRO stage, the teacher's class and its
model's, optimizer steps) and the exact and supervised tokens of its own rows per step, counted from its batches, with
the teacher of each row, the rows it asked the teacher to write and the tokens the teacher wrote in its own tokens;
the trainer's `alignment/exact` is summed over both ranks. With SAME (a teacher of the student's tokenizer; `-` for
none), the two are routed:
prompts alternate between `same` and `other` (TEACHER), so a rank can hold only same-tokenizer rows at a step.
SETTINGS, a JSON object, are further `OnPolicyDistillConfig` settings (`signal`, `state_source_mix`). With
`{"signal": "divergence"}` each step's counts add the supervised positions given a distribution of the teacher (a
same-tokenizer row's all, another's where both tokenizations cut).
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
from trl_statelens.teachers import resolved_signal  # noqa: E402
from trl_statelens.teachers.alignment import TeacherSignal  # noqa: E402

torch.set_num_threads(1)
student_path, teacher_path, output_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
same_path = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "-" else None
settings = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
rows = LabWorld(seed=0).math("train", n=16)
dataset = Dataset.from_list([{"prompt": format_plain(r["question"])} for r in rows])
if same_path is not None:
    dataset = dataset.add_column("teacher_id", ["same", "other"] * 8)
trainer = OnPolicyDistillTrainer(
    model=student_path,
    teacher_model=teacher_path if same_path is None else {"same": same_path, "other": teacher_path},
    args=OnPolicyDistillConfig(
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=24,
        learning_rate=1e-3,
        temperature=1.0,
        **CPU,
        **settings,
    ),
    train_dataset=dataset,
    callbacks=[StateLoggingCallback(sample_rate=1.0)],
)
counts, teachers = [], []  # per step on this rank: (exact supervised tokens, supervised tokens); rows' teachers
compute_loss = trainer._compute_loss


def counting_loss(model, inputs):
    if model.training:
        signal = resolved_signal(inputs["teacher_scores"], inputs["completion_ids"])
        supervised = inputs.get("loss_mask", inputs["completion_mask"]).bool()  # continuation: the teacher's tokens
        counts.append([int(((signal == TeacherSignal.EXACT) & supervised).sum()), int(supervised.sum())])
        teachers.append(inputs["teacher"])
    return compute_loss(model, inputs)


written_rows = []  # per teacher generation on this rank: the rows it asked the teacher to write (0: it only joined)
generate = trainer.teacher.generate


def counting_generate(prompts, *args, **kwargs):
    written_rows.append(len(prompts))
    return generate(prompts, *args, **kwargs)


trainer._compute_loss = counting_loss
trainer.teacher.generate = counting_generate
trainer.train()
accelerator = trainer.accelerator
plugin = accelerator.state.deepspeed_plugin
report = {
    "world_size": accelerator.num_processes,
    "backend": str(getattr(accelerator.state, "backend", "")),
    "zero_stage": None if plugin is None else plugin.zero_stage,
    "global_step": trainer.state.global_step,
    "teacher": type(trainer.teacher).__name__,
    "teacher_engine": type(getattr(trainer.teacher, "model", None)).__name__,
    "written_rows": written_rows,
    "own_tokens_written": trainer._own_tokens_written(),
    "counts": counts,
    "teachers": teachers,
    "log_history": trainer.state.log_history,
}
(output_dir / f"rank{accelerator.process_index}.json").write_text(json.dumps(report))
trainer.accelerator.end_training()
