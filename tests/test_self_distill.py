"""Self-distillation against TRL's stock `SDFTTrainer`: the config mapping of `--baseline stock`, and equal losses
and gradients on one batch in the modes that match (`trl_statelens.opd.stock_sdft`)."""

import json
import os

import pytest
import torch
from cpu_settings import CPU

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLoggingCallback
from trl_statelens.opd.stock_sdft import to_sdft_config

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

# The lab's plain layout: the same problem, solved, as a one-shot exemplar before the student's prompt
TEMPLATE = "{prompt} {privileged_context}\n\n{prompt}"


def self_config(tmp_path, **kwargs):
    defaults = dict(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=8,
        num_generations=1,
        max_completion_length=8,
        learning_rate=1e-3,
        teacher_model_kind="base",
        teacher_prompt_template=TEMPLATE,
    )
    return OnPolicyDistillConfig(**{**defaults, **CPU, **kwargs})


@pytest.mark.parametrize(
    "signal, jsd_beta, mode, alpha",
    [("reverse_kl", 1.0, "sampled_token", 1.0), ("divergence", 1.0, "full_logits", 1.0),
     ("divergence", 0.3, "full_logits", 0.3)],
)  # fmt: skip
def test_matching_modes_and_settings_are_mapped(tmp_path, signal, jsd_beta, mode, alpha):
    ours = self_config(
        tmp_path, signal=signal, jsd_beta=jsd_beta, teacher_model_kind="ema", teacher_update_rate=0.2,
        temperature=0.9, top_p=0.95, top_k=20, repetition_penalty=1.1, gradient_accumulation_steps=2,
    )  # fmt: skip
    stock = to_sdft_config(ours)
    assert (stock.distillation_mode, stock.distillation_alpha) == (mode, alpha)
    assert (stock.teacher_model_kind, stock.teacher_update_rate, stock.teacher_sync_steps) == ("ema", 0.2, 1)
    assert stock.teacher_prompt_template == TEMPLATE
    # no importance-sampling ratio, every token supervised, rollouts from the student prompt, no prompt truncation
    assert stock.distillation_is_clip is None and stock.num_loss_tokens_to_skip == 0
    assert stock.generate_from_teacher is False and stock.max_prompt_length is None
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_completion_length",
                 "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
                 "steps_per_generation", "generation_batch_size", "learning_rate", "lr_scheduler_type", "seed",
                 "max_steps", "shuffle_dataset"):  # fmt: skip
        assert getattr(stock, name) == getattr(ours, name), name


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"teacher_model_kind": None, "teacher_prompt_template": "{prompt}\n\n{privileged_context}"},
            "separate teacher",
        ),
        ({"signal": "continuation"}, "continuation"),
        ({"state_source_mix": {"learner": 0.5, "dataset": 0.5}}, "state_source_mix"),
        ({"signal": "reverse_kl", "kl_discount": 0.5}, "kl_discount"),
        ({"mask_truncated_completions": True}, "mask_truncated_completions"),
    ],
)
def test_settings_without_a_counterpart_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        to_sdft_config(self_config(tmp_path, **kwargs))


@pytest.fixture
def privileged_dataset(math_dataset):
    return math_dataset.map(lambda row: {"privileged_context": row["answer"]})


@pytest.mark.parametrize("signal, jsd_beta", [("reverse_kl", 1.0), ("divergence", 1.0), ("divergence", 0.3)])
def test_loss_and_gradient_equal_stock_sdft_on_one_batch(
    tmp_path, math_trained_path, privileged_dataset, signal, jsd_beta
):
    """The same model, rows and sampled completions through both trainers' own loss code: our rollouts and our
    batch; SDFT's teacher prompts from its own builder. Every rollout is held to `max_completion_length` tokens
    (`min_new_tokens`, asserted), so SDFT's sequence mean and our token mean weigh tokens alike (see `stock_sdft`)."""
    from trl.experimental.sdft import SDFTTrainer

    args = self_config(tmp_path / "ours", signal=signal, jsd_beta=jsd_beta, generation_kwargs={"min_new_tokens": 8})
    ours = OnPolicyDistillTrainer(model=str(math_trained_path), args=args, train_dataset=privileged_dataset)
    rows = [dict(row) for row in privileged_dataset.select(range(8))]
    ours.model.train()
    batch = ours._generate_and_score_completions(rows)
    assert batch["completion_mask"].all(), "a rollout ended early: the two normalisations would differ"

    stock_args = to_sdft_config(args)
    stock_args.output_dir = str(tmp_path / "stock")
    stock = SDFTTrainer(model=str(math_trained_path), args=stock_args, train_dataset=privileged_dataset)
    stock.model.train()
    stock.current_gradient_accumulation_steps = 1  # what the Trainer's loop sets for a one-micro-batch window
    stock_inputs = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    stock_inputs |= stock.teacher_context_builder.build(
        [row["prompt"] for row in rows],
        [row["privileged_context"] for row in rows],
        batch["completion_ids"],
        batch["completion_mask"],
    )

    ours_loss = ours.compute_loss(ours.model, batch)
    stock_loss = stock.compute_loss(stock.model, stock_inputs)
    # the base self teacher differs from the student only by its prompt: something to learn, so neither side is 0
    assert ours_loss.abs().item() > 1e-4
    torch.testing.assert_close(ours_loss, stock_loss, rtol=1e-4, atol=1e-6)
    ours_loss.backward()
    stock_loss.backward()
    ours_grads = {name: p.grad for name, p in ours.model.named_parameters() if p.grad is not None}
    stock_grads = {name: p.grad for name, p in stock.model.named_parameters() if p.grad is not None}
    assert ours_grads.keys() == stock_grads.keys() and ours_grads
    for name, grad in ours_grads.items():
        torch.testing.assert_close(grad, stock_grads[name], rtol=1e-3, atol=1e-7, msg=name)


def test_stock_arm_probe_logs_no_teacher_kl(tmp_path, math_trained_path, privileged_dataset):
    """SDFT's `teacher_model` is the student (or its copy), which teaches reading a privileged prompt; the probe
    prompts have none, so scored there it would give 0 (live, PEFT base) or a reversed `base_kl` (base). The stock
    arm's probes, as ours with a self teacher, measure drift and `base_kl` only."""
    from trl.experimental.sdft import SDFTTrainer

    stock_args = to_sdft_config(self_config(tmp_path, max_steps=1))
    stock = SDFTTrainer(model=str(math_trained_path), args=stock_args, train_dataset=privileged_dataset)
    stock.add_callback(StateLoggingCallback(stock, probe_prompts=privileged_dataset["prompt"][:2], probe_steps=1))
    assert stock.teacher_model is not None  # the attribute the probe used to score
    stock.train()
    (line,) = [json.loads(row) for row in (tmp_path / "statelens" / "drift.jsonl").read_text().splitlines()]
    assert "base_kl" in line and not [key for key in line if key.startswith("teacher_kl")]
