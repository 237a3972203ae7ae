"""On-policy distillation under DeepSpeed ZeRO-3 with state selection (`skip_correct_rollouts`) where one rank's
rollouts are all skipped, launched by tests/test_state_selection.py with `accelerate launch --config_file
recipes/accelerate/zero3.yaml`.

Usage: accelerate launch --config_file zero3.yaml --num_processes 2 opd_zero3_state_selection.py STUDENT TEACHER OUT

The reward is 1 (correct) for every rollout on rank 1 and 0 on rank 0, with no recheck: rank 1 has no row for the
teacher, yet the in-process teacher's forwards (scoring with `reverse_kl`, its `divergence` loss) and the student's
output layer (the skipped rows' log-probs with `divergence`) gather their ZeRO-3 shards from both ranks, so rank 1
must join them on stand-ins or rank 0 waits forever. Each rank writes `OUT/rank<i>.json` with what ran, the selection
codes of its rows per step and the teacher's forwards.
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
from accelerate import PartialState  # noqa: E402
from cpu_settings import CPU  # noqa: E402
from datasets import Dataset  # noqa: E402

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLoggingCallback  # noqa: E402
from trl_statelens.lab import LabWorld, format_plain  # noqa: E402


def right_on_rank_one(completions, **kwargs):
    return [float(PartialState().process_index == 1)] * len(completions)


torch.set_num_threads(1)
student_path, teacher_path, output_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
rows = LabWorld(seed=0).math("train", n=8)
dataset = Dataset.from_list([{"prompt": format_plain(r["question"])} for r in rows])
report = {}
for signal in ("reverse_kl", "divergence"):
    trainer = OnPolicyDistillTrainer(
        model=student_path,
        teacher_model=teacher_path,
        args=OnPolicyDistillConfig(
            output_dir=str(output_dir / signal),
            max_steps=2,
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=4,
            learning_rate=1e-3,
            signal=signal,
            skip_correct_rollouts=True,
            recheck_fraction=0.0,
            **CPU,
        ),
        train_dataset=dataset,
        reward_funcs=[right_on_rank_one],
        callbacks=[StateLoggingCallback(sample_rate=1.0)],  # every sequence in states.jsonl
    )
    selections = []
    generate_and_score = trainer._generate_and_score_completions

    def recording(inputs, generate_and_score=generate_and_score, selections=selections):
        output = generate_and_score(inputs)
        selections.append(output["teacher_selection"].tolist())
        return output

    trainer._generate_and_score_completions = recording
    forwards = [0]
    decoder = trainer.accelerator.unwrap_model(trainer.teacher.model).get_decoder()
    decoder.register_forward_hook(lambda *args, forwards=forwards: forwards.__setitem__(0, forwards[0] + 1))
    trainer.train()
    plugin = trainer.accelerator.state.deepspeed_plugin
    report[signal] = {
        "world_size": trainer.accelerator.num_processes,
        "zero_stage": None if plugin is None else plugin.zero_stage,
        "teacher_engine": type(trainer.teacher.model).__name__,
        "global_step": trainer.state.global_step,
        "selections": selections,
        "teacher_forwards": forwards[0],
    }
(output_dir / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps(report))
trainer.accelerator.end_training()  # destroys the process group before exit (see tests/test_multiprocess.py)
