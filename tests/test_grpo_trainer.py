"""StateLensGRPOTrainer: the same training as TRL's GRPOTrainer, plus learner-state records."""

import json

import pytest
import torch
from cpu_settings import CPU
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from trl_statelens import StateLensGRPOTrainer, StateLoggingCallback


def digit_reward(completions, **kwargs):
    """A reward that varies between completions, so advantages are not all zero."""
    return [float(sum(ch.isdigit() for ch in completion)) for completion in completions]


@pytest.fixture(scope="module")
def prompt_dataset(math_dataset):
    return Dataset.from_dict({"prompt": math_dataset["prompt"]})


def grpo_config(tmp_path, name, **overrides):
    settings = dict(
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        learning_rate=1e-3,
        **CPU,
    )
    settings.update(overrides)
    return GRPOConfig(output_dir=str(tmp_path / name), **settings)


def train(trainer_cls, model_path, args, dataset, tokenizer, **kwargs):
    trainer = trainer_cls(
        model=str(model_path),
        reward_funcs=digit_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        **kwargs,
    )
    calls = []
    trainer.model.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    return trainer, logs, len(calls)


def test_same_training_as_stock_grpo(tmp_path, student_path, tokenizer, prompt_dataset):
    stock, stock_logs, stock_calls = train(
        GRPOTrainer, student_path, grpo_config(tmp_path, "stock"), prompt_dataset, tokenizer
    )
    # the preflight's forwards run before step 1 (docs/preflight.md): off, to count training's own
    lens, lens_logs, lens_calls = train(
        StateLensGRPOTrainer, student_path, grpo_config(tmp_path, "lens"), prompt_dataset, tokenizer, preflight="off"
    )
    for key in ("loss", "reward", "entropy", "completions/mean_length"):
        assert [log[key] for log in lens_logs] == pytest.approx([log[key] for log in stock_logs], rel=1e-6), key
    torch.testing.assert_close(lens.model.state_dict(), stock.model.state_dict())
    assert lens_calls == stock_calls  # generation steps plus one loss forward per step: nothing extra
    for log in lens_logs:
        assert log["statelens/source_frac/learner"] == 1.0
        assert log["statelens/state_entropy"] == pytest.approx(log["entropy"], rel=1e-5)


@pytest.mark.slow
def test_learner_states_have_no_offpolicy_gap_and_match_the_masks(
    tmp_path, math_trained_path, tokenizer, prompt_dataset
):
    """At temperature 1 the expected NLL of a sampled token is the entropy: the gap averages near 0."""
    args = grpo_config(
        tmp_path,
        "onpolicy",
        max_steps=8,
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=16,
        temperature=1.0,
        learning_rate=1e-4,
    )
    trainer = StateLensGRPOTrainer(
        model=str(math_trained_path),
        reward_funcs=digit_reward,
        args=args,
        train_dataset=prompt_dataset,
        processing_class=tokenizer,
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
    )
    completion_lengths = []  # supervised tokens per step, from the loss mask
    original_compute_loss = trainer._compute_loss

    def compute_loss(model, inputs):
        completion_lengths.append(inputs["completion_mask"].sum(1).tolist())
        return original_compute_loss(model, inputs)

    trainer._compute_loss = compute_loss
    trainer.train()
    ledger = tmp_path / "onpolicy" / "statelens"
    steps = [json.loads(line) for line in (ledger / "steps.jsonl").read_text().splitlines()]
    states = [json.loads(line) for line in (ledger / "states.jsonl").read_text().splitlines()]

    mean_gap = sum(line["offpolicy_gap"] for line in steps) / len(steps)
    assert abs(mean_gap) < 0.2  # vs about 6 nats on another task's dataset states (SFT test)
    assert steps[0]["state_entropy"] > 0.3  # a model with preferences, yet not deterministic

    assert [line["supervised_tokens"] for line in steps] == [sum(lengths) for lengths in completion_lengths]
    for step, lengths in enumerate(completion_lengths, start=1):
        step_states = [state for state in states if state["step"] == step]
        assert sorted(state["num_supervised"] for state in step_states) == sorted(lengths)
        for state in step_states:
            assert state["source"] == "learner"
            assert state["prefix_len"] == list(range(state["num_supervised"]))
            assert state["reward"] == digit_reward([state["completion"]])[0]
            assert len(set(state["weight"])) == 1  # one advantage per sequence
        # Group-normalised advantages: each group of num_generations completions sums to about 0
        assert abs(sum(state["weight"][0] for state in step_states)) < 1e-3


@pytest.mark.parametrize("drop", ["top_entropy_quantile", "off_policy_mask_threshold", "vllm_token_mask"])
def test_records_count_only_the_tokens_the_grpo_loss_counts(tmp_path, student_path, tokenizer, prompt_dataset, drop):
    """GRPO drops tokens from its policy loss beyond the completion mask: the records drop the same ones."""
    settings = {"top_entropy_quantile": dict(top_entropy_quantile=0.5)}.get(drop, {})
    if drop == "off_policy_mask_threshold":  # KL is 0 on fresh rollouts: a negative threshold drops A < 0 sequences
        settings = dict(off_policy_mask_threshold=-1.0)
    trainer = StateLensGRPOTrainer(
        model=str(student_path),
        reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],  # A < 0 for some
        args=grpo_config(tmp_path, drop, max_steps=2, **settings),
        train_dataset=prompt_dataset,
        processing_class=tokenizer,
    )
    expected = []
    entropy_masks = []
    high_entropy_mask = trainer.get_high_entropy_mask
    trainer.get_high_entropy_mask = lambda *args: entropy_masks.append(high_entropy_mask(*args)) or entropy_masks[-1]
    compute_loss = trainer._compute_loss

    def spy(model, inputs):
        mask = inputs["completion_mask"].bool()
        if drop == "vllm_token_mask":  # vLLM's "token_mask" mode zeroes the ratio of the tokens it drops
            ratio = torch.ones(mask.shape)
            ratio[:, ::3] = 0.0
            inputs = {**inputs, "importance_sampling_ratio": ratio}
            trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
        try:
            loss = compute_loss(model, inputs)
        finally:
            trainer.use_vllm = False
        if drop == "top_entropy_quantile":
            mask &= entropy_masks[-1]
        elif drop == "off_policy_mask_threshold":
            mask &= (inputs["advantages"] >= 0)[:, None]
        else:
            mask &= ratio != 0
        expected.append(int(mask.sum()))
        return loss

    trainer._compute_loss = spy
    trainer.train()
    steps = [json.loads(line) for line in (tmp_path / drop / "statelens" / "steps.jsonl").read_text().splitlines()]
    assert [line["supervised_tokens"] for line in steps] == expected
    completion_tokens = 2 * 4 * 8  # an upper bound: 2 steps of 4 completions of at most 8 tokens
    assert 0 < sum(expected) < completion_tokens


def test_each_prompts_group_of_rollouts_is_in_the_ledger_with_its_rewards_and_difficulty(
    tmp_path, student_path, tokenizer, math_dataset
):
    """`groups.jsonl`: one line per prompt's group of rollouts, its rewards as the loss got them and the data's
    `solution_steps`; `reward_groups/spread_frac` is the share of groups whose rewards differ, and only their
    tokens carry a non-zero advantage (`weight/nonzero_frac`)."""
    from trl_statelens.data import solution_steps

    data = Dataset.from_dict({
        "prompt": math_dataset["prompt"][:16],
        "solution_steps": [solution_steps(a) for a in math_dataset["answer"][:16]],
    })  # fmt: skip
    assert len(set(data["solution_steps"])) > 1

    def flat_on_one_step_problems(completions, solution_steps, **kwargs):
        return [1.0 if s == 1 else float(sum(ch.isdigit() for ch in c)) for c, s in zip(completions, solution_steps)]

    trainer = StateLensGRPOTrainer(
        model=str(student_path),
        reward_funcs=flat_on_one_step_problems,
        args=grpo_config(tmp_path, "groups", per_device_train_batch_size=8, num_generations=4, temperature=1.0),
        train_dataset=data,
        processing_class=tokenizer,
    )
    seen = []  # (prompt, solution_steps, reward) of every rollout, in the order GRPO groups them
    calculate = trainer._calculate_rewards

    def calculate_and_keep(inputs, prompts, completions, completion_ids_list):
        rewards = calculate(inputs, prompts, completions, completion_ids_list)
        seen.append([(str(p), row["solution_steps"], r) for p, row, r in zip(prompts, inputs, rewards[:, 0].tolist())])
        return rewards

    trainer._calculate_rewards = calculate_and_keep
    trainer.train()
    ledger = tmp_path / "groups" / "statelens"
    groups = [json.loads(line) for line in (ledger / "groups.jsonl").read_text().splitlines()]
    steps = [json.loads(line) for line in (ledger / "steps.jsonl").read_text().splitlines()]
    assert [g["step"] for g in groups] == [1, 1, 2, 2, 3, 3]  # 8 rollouts a step, 4 per prompt
    rollouts = [rollout for batch in seen for rollout in batch]
    ids = {}
    for index, group in enumerate(groups):
        members = rollouts[4 * index : 4 * index + 4]
        assert len({m[0] for m in members}) == 1  # one prompt's group
        assert group["rewards"] == [m[2] for m in members] and group["solution_steps"] == members[0][1]
        assert ids.setdefault(members[0][0], group["prompt_id"]) == group["prompt_id"]
    assert len(set(ids.values())) == len(ids)  # a prompt's id is its own
    for step in (1, 2, 3):
        spread = [len(set(g["rewards"])) > 1 for g in groups if g["step"] == step]
        line = steps[step - 1]
        assert line["reward_groups/spread_frac"] == sum(spread) / len(spread)
        if not any(spread):
            assert line["weight/nonzero_frac"] == 0.0
    assert any(g["solution_steps"] == 1 and len(set(g["rewards"])) == 1 for g in groups)
    assert any(len(set(g["rewards"])) > 1 for g in groups)
