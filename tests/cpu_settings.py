"""Trainer settings the CPU tests share. TRL's defaults (bf16, gradient checkpointing, reporting, checkpoints,
progress bars) are slow, unsupported or noisy on a CPU test machine."""

import os

# The cores each test process may use: all of them, or under `make test` (pytest-xdist) its worker's share. Torch
# threads beyond the cores spin against the other worker's and run several times slower (the real-model tier took
# over 3x its time alone when it ran two threads beside another worker).
WORKER_THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))

CPU = dict(
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,
    report_to="none",
    logging_steps=1,
    save_strategy="no",
    dataloader_num_workers=0,
    disable_tqdm=True,
    seed=0,
)
