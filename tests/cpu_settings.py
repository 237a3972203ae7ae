"""Trainer settings the CPU tests share. TRL's defaults (bf16, gradient checkpointing, reporting, checkpoints,
progress bars) are slow, unsupported or noisy on a CPU test machine."""

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
