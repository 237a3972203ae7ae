"""The trainer's per-step counts (`trainer.step_counts`, `lens.step_counts.StepCounts`): each optimizer step's own,
whether or not a `StateLoggingCallback` reads them at the step's end."""

from collections import Counter

import pytest
import torch
from cpu_settings import CPU
from datasets import Dataset
from transformers import TrainerCallback

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLoggingCallback
from trl_statelens.lens.step_counts import StepCounts
from trl_statelens.opd.cache import CACHE_COUNTS, CACHE_SLOT
from trl_statelens.opd.selection import SELECTION_COUNTS, SKIPPED


def score_reward(completions, score, **kwargs):
    return [float(s) for s in score]


class HeldAtStepEnd(TrainerCallback):
    """What the trainer's step counts hold at each optimizer step's end, read without taking them."""

    def __init__(self, trainer, names):
        self.trainer, self.names, self.held = trainer, names, []

    def on_step_end(self, args, state, control, **kwargs):
        counts = self.trainer.step_counts
        self.held.append({name: counts.peek(name) for name in self.names})


@pytest.mark.parametrize("lever", ["selection", "cache"])
def test_without_state_logging_the_counts_hold_one_step_only(
    tmp_path, student_path, teacher_path, math_dataset, lever
):
    """With `state_logging=False` nothing takes the counts at a step's end: they still hold that step's alone (the
    teacher tokens counted in it, its selection or its cache sums), never the run's so far, and the recheck draws of
    each step start at its first generation batch."""
    settings = dict(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8, num_generations=2,
                    max_completion_length=8, learning_rate=1e-3, shuffle_dataset=False)  # fmt: skip
    if lever == "selection":
        settings.update(skip_correct_rollouts=True, recheck_fraction=0.5)
        scores = [0.0, 1.0, 0.5, 1.5, 1.0, 0.0, 2.0, 0.9] * 2
        rows = {"prompt": math_dataset["prompt"][:16], "score": scores}
        names = ("teacher_tokens", *SELECTION_COUNTS, "selection_batches")
    else:
        settings.update(teacher_cache_steps=3, signal="divergence")  # (its teacher's hidden states cached too)
        rows = {"prompt": math_dataset["prompt"][:16]}
        names = ("teacher_tokens", CACHE_COUNTS)
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(teacher_path),
        args=OnPolicyDistillConfig(**{**settings, **CPU}),
        train_dataset=Dataset.from_dict(rows),
        reward_funcs=[score_reward] if lever == "selection" else None,
        state_logging=False,
    )
    assert not any(isinstance(c, StateLoggingCallback) for c in trainer.callback_handler.callbacks)
    reading = HeldAtStepEnd(trainer, names)
    trainer.add_callback(reading)
    counted, batches = Counter(), []  # the teacher tokens counted in each step; each step's micro-batch
    count_teacher_tokens, compute_loss = trainer._count_teacher_tokens, trainer._compute_loss

    def counting(rows):
        if trainer.model.training:
            counted[trainer.state.global_step] += sum(len(row) for row in rows)
        count_teacher_tokens(rows)

    def watched(model, inputs):
        batches.append(inputs)
        return compute_loss(model, inputs)

    trainer._count_teacher_tokens, trainer._compute_loss = counting, watched
    trainer.train()

    held = reading.held
    assert len(held) == len(batches) == 3
    assert [h["teacher_tokens"] for h in held] == [counted[step] for step in range(3)]
    if lever == "selection":
        assert all(counted[step] > 0 for step in range(3))
        for h, batch in zip(held, batches):
            skipped = batch["teacher_selection"] == SKIPPED
            assert h["selection_skipped"] == int(skipped.sum()) > 0
            assert h["selection_batches"] == 1  # each step drew one generation batch, its first
            assert h["selection_skipped_tokens"] == int(
                batch["prompt_mask"][skipped].sum() + batch["completion_mask"][skipped].sum()
            )
    else:
        assert counted[0] > 0 and counted[1] == counted[2] == 0  # one refresh, two reuses
        assert [batch[CACHE_SLOT].age for batch in batches] == [2, 2, 2]  # the one micro-batch, reused twice
        reused = int(batches[0]["prompt_mask"].sum() + batches[0]["completion_mask"].sum())
        assert [h[CACHE_COUNTS][3].item() for h in held] == [0, reused, reused]  # reused tokens: each step's own
        assert batches[0][CACHE_SLOT].teacher_hidden is not None


def test_a_new_steps_first_count_drops_the_last_steps_and_take_clears():
    class Trainer:
        class state:
            global_step = 0

    counts = StepCounts(Trainer)
    counts.add(teacher_tokens=5, sums=torch.ones(2))
    counts.add(teacher_tokens=2, sums=torch.ones(2))
    assert counts.peek("teacher_tokens") == 7 and counts.peek("sums").tolist() == [2.0, 2.0]
    Trainer.state.global_step = 1
    assert counts.peek("teacher_tokens") == 7  # the last step's, until this step counts
    counts.add(selection_skipped=1)
    assert counts.peek("teacher_tokens") == 0 and counts.peek("sums", None) is None
    assert counts.take("selection_skipped", "teacher_tokens") == [1, 0]
    assert counts.peek("selection_skipped") == 0
