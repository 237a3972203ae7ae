"""Two ranks resume a run that then stops at `max_flops`; launched by tests/test_resume.py.

Usage: accelerate launch --multi_gpu --num_processes 2 max_flops_resume_two_ranks.py MODEL_PATH OUTPUT_DIR

First a 4-step run with the teacher cache (`teacher_cache_steps=2`: steps 2 and 4 train on the reused batch, work the
FLOPs count takes from the ledger's counts) and a checkpoint at step 2; its ledger gives the FLOPs so far at each step.
Then the run is resumed from `checkpoint-2` with `max_flops` just under step 3's count: every rank must stop after
step 3. (A rank that counted on without the ledger's totals, which only the main process reads, would count step 2's
reused batch as nothing, train on into step 4 alone and wait there for the other.) Each rank writes
`OUTPUT_DIR/rank<i>.json`: the step it stopped at, and its FLOPs so far when the resumed run began.
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
from transformers import TrainerCallback  # noqa: E402

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLoggingCallback  # noqa: E402
from trl_statelens.lab import LabWorld, format_plain  # noqa: E402

torch.set_num_threads(1)
model_path, output_dir = sys.argv[1], Path(sys.argv[2])
run_dir = output_dir / "run"
dataset = Dataset.from_list([{"prompt": format_plain(r["question"])} for r in LabWorld(seed=0).math("train", n=32)])
args = OnPolicyDistillConfig(
    **{**CPU, "save_strategy": "steps"}, save_steps=2, output_dir=str(run_dir), max_steps=4,
    per_device_train_batch_size=4, num_generations=2, max_completion_length=8, learning_rate=1e-3,
    signal="divergence", teacher_cache_steps=2,
)  # fmt: skip


class FlopsAtStart(TrainerCallback):
    """The FLOPs so far that `logging` counts from when training (re)starts (after its own `on_train_begin`)."""

    def __init__(self, logging: StateLoggingCallback):
        self.logging, self.total = logging, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.total = self.logging._flops_so_far["total"]


first = OnPolicyDistillTrainer(model=model_path, teacher_model=model_path, args=args, train_dataset=dataset)
first.train()
first.accelerator.wait_for_everyone()  # the main process has written the ledger
steps = [json.loads(line) for line in (run_dir / "statelens" / "steps.jsonl").read_text().splitlines()]
flops = {line["step"]: line["flops_total/total"] for line in steps}
assert steps[1]["cache_reused_tokens"] > 0, steps[1]  # step 2 trained from the cache
budget = flops[3] - 0.01 * (flops[3] - flops[2])  # reached by step 3's count, not by step 3's less step 2's reuse

logging = StateLoggingCallback(max_flops=budget)
start = FlopsAtStart(logging)
resumed = OnPolicyDistillTrainer(
    model=model_path, teacher_model=model_path, args=args, train_dataset=dataset, callbacks=[logging, start]
)
resumed.train(resume_from_checkpoint=str(run_dir / "checkpoint-2"))
rank = resumed.accelerator.process_index
outcome = {"world_size": resumed.accelerator.num_processes, "stopped_at": resumed.state.global_step}
outcome.update(flops_at_resume=start.total, flops_at_step_2=flops[2])
(output_dir / f"rank{rank}.json").write_text(json.dumps(outcome))
resumed.accelerator.end_training()  # destroys the process group while Python is alive (see test_multiprocess.py)
