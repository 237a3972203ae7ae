"""Two ranks start a fresh run in a folder holding another run's ledger; launched by tests/test_multiprocess.py.

Usage: accelerate launch --multi_gpu --num_processes 2 ledger_refused_two_ranks.py MODEL_PATH OUTPUT_DIR

`OUTPUT_DIR/run/statelens/steps.jsonl` already holds a step. Each rank writes `OUTPUT_DIR/rank<i>.txt` with the error
`trainer.train()` raised there (or "trained" if it raised none), then ends the process group.
"""

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
from trl import SFTConfig  # noqa: E402

from trl_statelens import StateLensSFTTrainer  # noqa: E402

torch.set_num_threads(1)
model_path, output_dir = sys.argv[1], Path(sys.argv[2])
trainer = StateLensSFTTrainer(
    model=model_path,
    args=SFTConfig(
        output_dir=str(output_dir / "run"), max_steps=1, per_device_train_batch_size=1, max_length=32, **CPU
    ),
    train_dataset=Dataset.from_dict({"text": ["Ava has 3 apples and buys 4 more."] * 4}),
)
try:
    trainer.train()
    outcome = "trained"
except ValueError as error:
    outcome = f"ValueError: {error}"
(output_dir / f"rank{trainer.accelerator.process_index}.txt").write_text(outcome)
trainer.accelerator.end_training()  # destroys the process group while Python is alive (see test_multiprocess.py)
