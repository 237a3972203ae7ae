"""A training process that crashes while a scoring request to the teacher server is in flight; run by
tests/test_served_teacher.py.

Usage: python served_teacher_crash.py STUDENT TEACHER OUTPUT_DIR

The test server (in this process) answers after 60 s; the reward function raises while the step's scoring request
waits for that answer. The script prints `crashed <unix time>` and lets the error end the process: the test measures
how long the exit then takes.
"""

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the CPU settings and the test server

import torch  # noqa: E402
from cpu_settings import CPU  # noqa: E402
from datasets import Dataset  # noqa: E402
from vllm_test_server import TestTeacherServer  # noqa: E402

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer  # noqa: E402

torch.set_num_threads(1)
student_path, teacher_path, output_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])


def broken_reward(completions, **kwargs):
    raise ZeroDivisionError("a bug in the reward function")


server = TestTeacherServer(teacher_path).start()
trainer = OnPolicyDistillTrainer(
    model=student_path,
    args=OnPolicyDistillConfig(
        preflight="off",  # the test counts training's own teacher calls
        output_dir=str(output_dir),
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        teacher_model_server_url=server.url,
        **CPU,
    ),
    train_dataset=Dataset.from_dict({"prompt": ["Ava has 3 apples.", "Tom has 4 pears."] * 4}),
    reward_funcs=[broken_reward],
)
server.latency = 60.0  # from now on (the start-up check is answered): every answer takes a minute
try:
    trainer.train()
finally:
    print(f"crashed {time.time()}", flush=True)
