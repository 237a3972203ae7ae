"""StateLensSFTTrainer: the same training as TRL's SFTTrainer, plus dataset-state records."""

import json

import pytest
import torch
from cpu_settings import CPU
from datasets import Dataset
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer

from trl_statelens import StateLensSFTTrainer, StateLoggingCallback


def sft_config(tmp_path, name, **overrides):
    settings = dict(max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3, max_length=128, **CPU)
    settings.update(overrides)
    return SFTConfig(output_dir=str(tmp_path / name), **settings)


def train(trainer_cls, model_path, args, dataset, tokenizer, **kwargs):
    """Train and return the trainer, its per-step logs and the number of backbone forward calls."""
    trainer = trainer_cls(
        model=str(model_path), args=args, train_dataset=dataset, processing_class=tokenizer, **kwargs
    )
    calls = []
    backbone = (
        trainer.model.get_base_model().model if hasattr(trainer.model, "get_base_model") else trainer.model.model
    )
    backbone.register_forward_pre_hook(lambda module, args: calls.append(1))
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    return trainer, logs, len(calls)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def count_supervised_labels(trainer):
    """Supervised tokens per optimizer step, counted from the labels the model receives (independent of records)."""
    per_micro_batch = []

    def hook(module, args, kwargs):
        if module.training and kwargs.get("fused_lm_head"):
            per_micro_batch.append(int((kwargs["labels"][:, 1:] != -100).sum()))

    trainer.model.register_forward_pre_hook(hook, with_kwargs=True)
    return per_micro_batch


def test_same_training_as_stock_sft_and_state_nll_is_the_loss(tmp_path, student_path, tokenizer, math_dataset):
    stock, stock_logs, stock_calls = train(
        SFTTrainer, student_path, sft_config(tmp_path, "stock"), math_dataset, tokenizer
    )
    # the preflight's forwards run before step 1 (docs/preflight.md): off, to count training's own
    lens, lens_logs, lens_calls = train(
        StateLensSFTTrainer, student_path, sft_config(tmp_path, "lens"), math_dataset, tokenizer, preflight="off"
    )
    assert [log["loss"] for log in lens_logs] == pytest.approx([log["loss"] for log in stock_logs], rel=1e-6)
    torch.testing.assert_close(lens.model.state_dict(), stock.model.state_dict())
    assert lens_calls == stock_calls == 3  # no extra forward pass

    # One process, no gradient accumulation: the loss is the mean token NLL over the step's supervised tokens
    for log in lens_logs:
        assert log["statelens/state_nll"] == pytest.approx(log["loss"], rel=1e-5)
        assert log["statelens/source_frac/dataset"] == 1.0
        assert log["statelens/weight/mean"] == 1.0
        assert log["statelens/offpolicy_gap"] == pytest.approx(
            log["statelens/state_nll"] - log["statelens/state_entropy"]
        )
        # TRL's own entropy metric is the same masked mean
        assert log["statelens/state_entropy"] == pytest.approx(log["entropy"], rel=1e-5)
    steps = read_jsonl(tmp_path / "lens" / "statelens" / "steps.jsonl")
    assert [line["step"] for line in steps] == [1, 2, 3]
    assert not (tmp_path / "stock" / "statelens").exists()


def test_ledger_text_prefix_lengths_and_counts_match_the_masks(tmp_path, student_path, tokenizer, math_dataset):
    args = sft_config(tmp_path, "ledger", max_steps=2, max_length=512)
    trainer = StateLensSFTTrainer(
        model=str(student_path),
        args=args,
        train_dataset=math_dataset,
        processing_class=tokenizer,
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
    )
    label_counts = count_supervised_labels(trainer)
    trainer.train()
    ledger = tmp_path / "ledger" / "statelens"
    steps, states = read_jsonl(ledger / "steps.jsonl"), read_jsonl(ledger / "states.jsonl")
    assert [line["supervised_tokens"] for line in steps] == label_counts
    assert sum(sum(line["prefix_len_hist"]) for line in steps) == sum(label_counts)
    assert len(states) == 2 * 4  # sample_rate=1: every sequence of both steps
    completions = {row["prompt"]: row["completion"] for row in math_dataset}
    for state in states:
        assert state["completion"] == completions[state["prompt"]] + tokenizer.eos_token
        assert state["prefix_len"] == list(range(state["num_supervised"]))
        assert len(state["logp"]) == len(state["entropy"]) == state["num_supervised"]
        assert state["source"] == "dataset" and state["teacher_logp"] is None
    assert sum(state["num_supervised"] for state in states) == sum(label_counts)


def test_offpolicy_gap_is_large_on_another_tasks_dataset_states(
    tmp_path, math_trained_path, tokenizer, math_dataset, kb_dataset
):
    """A model trained on math is confident and wrong on knowledge-base answers: a clearly positive gap."""
    gaps = {}
    for name, dataset in (("math", math_dataset), ("kb", kb_dataset)):
        args = sft_config(tmp_path, name, max_steps=2, per_device_train_batch_size=8, learning_rate=1e-5)
        _, logs, _ = train(StateLensSFTTrainer, math_trained_path, args, dataset, tokenizer)
        gaps[name] = sum(log["statelens/offpolicy_gap"] for log in logs) / len(logs)
    assert gaps["kb"] > 2.0
    assert gaps["kb"] > gaps["math"] + 2.0


@pytest.mark.slow
def test_conversational_peft_and_gradient_accumulation(tmp_path, student_path, tokenizer, world):
    rows = world.math("train", n=16)
    dataset = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": row["question"]}],
                "completion": [{"role": "assistant", "content": row["answer"]}],
            }
            for row in rows
        ]
    )
    args = sft_config(
        tmp_path, "chat", max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_length=256
    )
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = StateLensSFTTrainer(
        model=str(student_path),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
    )
    label_counts = count_supervised_labels(trainer)
    trainer.train()
    ledger = tmp_path / "chat" / "statelens"
    steps, states = read_jsonl(ledger / "steps.jsonl"), read_jsonl(ledger / "states.jsonl")
    # Two micro-batches per optimizer step, recorded together
    assert [line["supervised_tokens"] for line in steps] == [
        label_counts[0] + label_counts[1],
        label_counts[2] + label_counts[3],
    ]
    assert [line["sequences"] for line in steps] == [4, 4]
    answers = {row["question"]: row["answer"] for row in rows}
    for state in states:
        question = next(q for q in answers if q in state["prompt"])
        assert state["prompt"].endswith("<|im_start|>assistant\n")
        assert state["completion"].startswith(answers[question] + "<|im_end|>")
        assert state["prefix_len"] == list(range(state["num_supervised"]))


@pytest.mark.slow
def test_padding_free_packed_sequences(tmp_path, student_path, tokenizer, math_dataset):
    args = sft_config(tmp_path, "packed", max_steps=2, packing=True, max_length=512, per_device_train_batch_size=2)
    trainer = StateLensSFTTrainer(
        model=str(student_path),
        args=args,
        train_dataset=math_dataset,
        processing_class=tokenizer,
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
    )
    assert trainer.padding_free
    label_counts = count_supervised_labels(trainer)
    trainer.train()
    ledger = tmp_path / "packed" / "statelens"
    steps, states = read_jsonl(ledger / "steps.jsonl"), read_jsonl(ledger / "states.jsonl")
    assert [line["supervised_tokens"] for line in steps] == label_counts
    assert all(line["sequences"] > 2 for line in steps)  # several sequences per packed row
    completions = {row["prompt"]: row["completion"] for row in math_dataset}
    for state in states:
        # Positions restart at each packed sequence: prompt and completion of one row each, prefix from 0
        assert state["completion"] == completions[state["prompt"]] + tokenizer.eos_token
        assert state["prefix_len"] == list(range(state["num_supervised"]))
