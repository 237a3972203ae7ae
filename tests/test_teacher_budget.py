"""Levers on where the teacher's compute goes (issue 36): the rollout horizon (truncated and progressive OPD)."""

import json

import pytest
from cpu_settings import CPU
from datasets import Dataset

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLoggingCallback
from trl_statelens.lens.records import source_code


def opd_config(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8, num_generations=2,
                    max_completion_length=12, learning_rate=1e-3, logging_steps=1)  # fmt: skip
    return OnPolicyDistillConfig(**{**defaults, **CPU, **kwargs})


@pytest.mark.parametrize("mix", [{"learner": 1.0}, {"learner": 0.4, "teacher": 0.3, "dataset": 0.3}])
def test_a_growing_horizon_samples_scores_and_records_only_its_first_tokens(
    tmp_path, student_path, teacher_path, math_dataset, mix
):
    """Horizon 3 growing by 4 a step under a limit of 12: steps 1-4 sample 3, 7, 11 and 12 tokens per rollout (the
    student's, the teacher's and the dataset's references alike), the teacher scores or writes only those, and the
    ledger says which horizon each step ran with."""
    data = math_dataset.select(range(16))
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(teacher_path),
        args=opd_config(tmp_path, max_steps=4, horizon=3, horizon_growth=4, state_source_mix=mix),
        train_dataset=data,
        callbacks=[StateLoggingCallback(sample_rate=0.0)],
    )
    lengths, teacher_work = [], []
    generate_and_score = trainer._generate_and_score_completions

    def measured(inputs):
        output = generate_and_score(inputs)
        mask = output["completion_mask"]
        lengths.append(mask.sum(1).tolist())
        teacher_work.append(int(mask.sum() + mask[output["row_source"] == source_code("teacher")].sum()))
        return output

    trainer._generate_and_score_completions = measured
    trainer.train()

    horizons = [3, 7, 11, 12]
    assert [max(step) for step in lengths] == horizons  # some rollout of every step reaches its horizon, none passes
    steps = [json.loads(line) for line in (tmp_path / "statelens" / "steps.jsonl").read_text().splitlines()]
    assert [line["horizon"] for line in steps] == horizons
    assert [line["teacher_tokens"] for line in steps] == teacher_work
    assert all(line["prefix_len/max"] < h for line, h in zip(steps, horizons))
    history = [e for e in trainer.state.log_history if "completions/max_length" in e]
    assert [e["completions/max_length"] for e in history] == horizons


def test_the_probes_keep_sampling_the_full_length_under_a_horizon(tmp_path, student_path, teacher_path, math_dataset):
    """The horizon shortens the rollouts' generation settings; the probes (and so drift and the teacher's exact
    disagreement past the horizon) still sample `max_completion_length` tokens."""
    prompts = [row["prompt"] for row in math_dataset.select(range(4))]
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(teacher_path),
        args=opd_config(tmp_path, max_steps=2, horizon=3),
        train_dataset=math_dataset.select(range(16)),
        callbacks=[StateLoggingCallback(probe_prompts=prompts, probe_steps=1, sample_rate=0.0)],
    )
    trainer.train()
    assert trainer.generation_config.max_new_tokens == 3  # the rollouts' own setting
    drift = [json.loads(line) for line in (tmp_path / "statelens" / "drift.jsonl").read_text().splitlines()]
    for line in drift:
        # [tokens, KL] per prefix-length bin [0, 1), [1, 3), [3, 7), [7, 15): bins from the third hold tokens past
        # the 3-token horizon
        tokens_past_horizon = sum(tokens for tokens, _ in line["teacher_kl/exact_by_prefix"][2:])
        assert tokens_past_horizon > 0, line["step"]


def test_without_a_horizon_the_ledger_has_none_and_rollouts_reach_the_limit(
    tmp_path, student_path, teacher_path, math_dataset
):
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(teacher_path),
        args=opd_config(tmp_path, max_completion_length=6),
        train_dataset=Dataset.from_dict({"prompt": math_dataset["prompt"][:8]}),
        callbacks=[StateLoggingCallback(sample_rate=0.0)],
    )
    trainer.train()
    (line,) = [json.loads(line) for line in (tmp_path / "statelens" / "steps.jsonl").read_text().splitlines()]
    assert "horizon" not in line and trainer.state.log_history[0]["completions/max_length"] == 6


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"horizon": 13}, "horizon=13 must be between 1 and max_completion_length=12"),
        ({"horizon": 0}, "horizon=0 must be between 1"),
        ({"horizon_growth": 2}, "horizon_growth=2 grows the rollout horizon, which is unset"),
        ({"horizon": 4, "horizon_growth": -1}, "horizon_growth must be a number of tokens"),
        ({"horizon": 4, "mask_truncated_completions": True}, "masks every rollout cut at the horizon"),
    ],
)
def test_bad_horizon_settings_are_refused_with_the_fix(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        opd_config(tmp_path, **settings)


def test_the_stock_configs_refuse_a_horizon(tmp_path):
    args = opd_config(tmp_path, horizon=4)
    with pytest.raises(ValueError, match="horizon=4: TRL's DistillationConfig samples max_completion_length"):
        args.to_distillation_config()
