"""`trl_statelens.runs.compute_counts`: the teacher share of a run's training FLOPs, for every kind of teacher."""

import json

import pytest
from cpu_settings import CPU
from datasets import Dataset

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLoggingCallback
from trl_statelens.lab import build_model
from trl_statelens.lab.model import build_qwen3
from trl_statelens.runs import compute_counts, matmul_parameters


def opd_config(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8, num_generations=2,
                    max_completion_length=8, learning_rate=1e-3)  # fmt: skip
    return OnPolicyDistillConfig(**{**defaults, **CPU, **kwargs})


def test_two_in_process_teachers_of_different_sizes_are_weighted_by_the_tokens_each_supervised(
    tmp_path, student_path, tokenizer, math_dataset
):
    """Each rollout token is scored by its row's teacher: N_T is the two sizes weighted by each one's share of the
    supervised tokens (the ledger's `supervised_tokens/<name>`). It was 0: `trainer.teacher_model` is None there."""
    teachers = {"big": build_qwen3(tokenizer, 64, 2, 128, seed=1), "small": build_qwen3(tokenizer, 64, 1, 128, seed=2)}
    sizes = {name: matmul_parameters(model) for name, model in teachers.items()}
    assert sizes["big"] > sizes["small"] > 0
    data = Dataset.from_dict(
        {"prompt": math_dataset["prompt"][:16], "teacher_id": ["big", "small", "small", None] * 4}
    )
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=teachers,
        args=opd_config(tmp_path),
        train_dataset=data,
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
    )
    trainer.train()
    (step,) = [json.loads(line) for line in (tmp_path / "statelens" / "steps.jsonl").read_text().splitlines()]
    big, small = step["supervised_tokens/big"], step["supervised_tokens/small"]
    assert big > 0 and small > 0
    expected = (sizes["big"] * big + sizes["small"] * small) / (big + small)
    counts = compute_counts(trainer)
    student = matmul_parameters(trainer.model)
    assert counts["teacher_parameters_by_name"] == sizes
    assert counts["teacher_parameters"] == pytest.approx(expected)
    assert counts["flops_per_token"] == pytest.approx(8 * student + 2 * expected)
    assert counts["flops"] == pytest.approx(counts["flops_per_token"] * counts["tokens"]) and counts["tokens"] > 0


def test_teachers_of_one_size_need_no_ledger_and_a_self_teacher_is_the_students_size(
    tmp_path, student_path, teacher_path, math_dataset
):
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model={"a": str(teacher_path), "b": str(student_path)},
        args=opd_config(tmp_path / "two"),
        train_dataset=math_dataset,
        state_logging=False,
    )
    student = matmul_parameters(trainer.model)
    assert compute_counts(trainer)["teacher_parameters"] == student  # the test models share one size
    self_taught = OnPolicyDistillTrainer(
        model=str(student_path),
        args=opd_config(tmp_path / "self", teacher_model_kind="base"),
        train_dataset=math_dataset.add_column("privileged_context", math_dataset["completion"]),
        state_logging=False,
    )
    assert compute_counts(self_taught)["teacher_parameters"] == student


def test_a_teacher_of_unknown_size_counts_no_flops(tmp_path, student_path, tokenizer, math_dataset):
    """A served teacher's size is unknown in the training processes: `None`, not 0 (the student's share alone would
    understate the run). A stand-in object with the `Teacher` attributes the count reads."""
    from types import SimpleNamespace

    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=build_model("test", tokenizer),
        args=opd_config(tmp_path),
        train_dataset=math_dataset,
        state_logging=False,
    )
    local = trainer.teacher
    trainer.teacher = SimpleNamespace(
        model=None, names=("local", "served"), reads_own_prompts=False,
        teachers={"local": local, "served": SimpleNamespace(model=None)},
    )  # fmt: skip
    counts = compute_counts(trainer)
    assert counts["teacher_parameters"] is None and counts["flops_per_token"] is None and counts["flops"] is None
    assert counts["teacher_parameters_by_name"] == {"local": matmul_parameters(local.model), "served": None}
