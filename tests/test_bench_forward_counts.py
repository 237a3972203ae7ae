"""Forward calls per optimizer step, the one benchmark number a test can pin down: StateLens trainers add none to
TRL's, and on-policy distillation costs the rollout's generation forwards plus one loss forward for the student and
one forward for the teacher (bench/ measures the time and memory)."""

import pytest
from cpu_settings import CPU
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

from trl_statelens import (
    OnPolicyDistillConfig,
    OnPolicyDistillTrainer,
    StateLensGRPOTrainer,
    StateLensSFTTrainer,
)

CPU = dict(**CPU, max_steps=2, learning_rate=1e-3)
COMPLETION_TOKENS = 8
# Every rollout runs to full length, so each step generates with exactly COMPLETION_TOKENS forwards
FULL_LENGTH = dict(max_completion_length=COMPLETION_TOKENS, generation_kwargs={"min_new_tokens": COMPLETION_TOKENS})


class ForwardsPerStep(TrainerCallback):
    """Counts the forward calls of each named module (a backbone: every loss path calls it) in every step."""

    def __init__(self, **modules):
        self.calls = dict.fromkeys(modules, 0)
        self.per_step = []
        for name, module in modules.items():
            module.register_forward_pre_hook(lambda *_, name=name: self.calls.__setitem__(name, self.calls[name] + 1))

    def on_step_begin(self, args, state, control, **kwargs):
        self._at_begin = dict(self.calls)

    def on_step_end(self, args, state, control, **kwargs):
        self.per_step.append({name: self.calls[name] - self._at_begin[name] for name in self.calls})


def count_forwards(trainer, **modules):
    counter = ForwardsPerStep(**modules)
    trainer.add_callback(counter)
    trainer.train()
    return counter.per_step


def generation_lengths(trainer):
    """Tokens generated for each rollout batch (the longest rollout's length): one generation forward per token."""
    lengths = []
    original = trainer._generate

    def spy(prompts):
        output = original(prompts)
        lengths.append(max(len(ids) for ids in output[1]))  # output[1]: the completion ids of each rollout
        return output

    trainer._generate = spy
    return lengths


@pytest.fixture(scope="module")
def prompts(math_dataset):
    return Dataset.from_dict({"prompt": math_dataset["prompt"]})


def test_sft_one_forward_per_step_like_stock(tmp_path, student_path, tokenizer, math_dataset):
    per_step = {}
    for name, trainer_cls in (("stock", SFTTrainer), ("lens", StateLensSFTTrainer)):
        args = SFTConfig(str(tmp_path / name), per_device_train_batch_size=4, max_length=128, **CPU)
        trainer = trainer_cls(
            model=str(student_path), args=args, train_dataset=math_dataset, processing_class=tokenizer
        )
        per_step[name] = count_forwards(trainer, student=trainer.model.model)
    assert per_step["lens"] == per_step["stock"] == [{"student": 1}] * 2


def test_grpo_generation_plus_one_loss_forward_per_step_like_stock(tmp_path, student_path, tokenizer, prompts):
    per_step, lengths = {}, {}
    for name, trainer_cls in (("stock", GRPOTrainer), ("lens", StateLensGRPOTrainer)):
        args = GRPOConfig(str(tmp_path / name), per_device_train_batch_size=4, num_generations=2, **FULL_LENGTH, **CPU)
        trainer = trainer_cls(
            model=str(student_path),
            reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
            args=args,
            train_dataset=prompts,
            processing_class=tokenizer,
        )
        lengths[name] = generation_lengths(trainer)
        per_step[name] = count_forwards(trainer, student=trainer.model.model)
    assert lengths["stock"] == lengths["lens"] == [COMPLETION_TOKENS] * 2
    assert per_step["lens"] == per_step["stock"] == [{"student": COMPLETION_TOKENS + 1}] * 2


@pytest.mark.parametrize(
    "signal, teacher_forwards",
    [
        ("reverse_kl", 1),  # one teacher forward scores the rollout
        ("divergence", 1),  # one teacher forward, inside the loss
        ("continuation", 4 + 1),  # the teacher writes continuation_length tokens, then scores them
    ],
)
def test_opd_forwards_per_step(tmp_path, student_path, teacher_path, math_dataset, signal, teacher_forwards):
    args = OnPolicyDistillConfig(
        str(tmp_path),
        signal=signal,
        **({"continuation_length": 4} if signal == "continuation" else {}),
        per_device_train_batch_size=4,
        num_generations=2,
        **FULL_LENGTH,
        **CPU,
    )
    trainer = OnPolicyDistillTrainer(
        model=str(student_path), teacher_model=str(teacher_path), args=args, train_dataset=math_dataset
    )
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    lengths = generation_lengths(trainer)
    per_step = count_forwards(trainer, student=trainer.model.model, teacher=teacher.model)
    assert lengths == [COMPLETION_TOKENS] * 2
    # student: the rollout's generation forwards plus the loss's one forward, no separate scoring pass
    assert per_step == [{"student": length + 1, "teacher": teacher_forwards} for length in lengths]
