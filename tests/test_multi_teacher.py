"""Several teachers: each row goes to the teacher its `teacher_id` names (`TeacherRouter`)."""

import json
import runpy

import pytest
import torch
from cpu_settings import CPU
from vllm_test_server import TestTeacherServer

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLoggingCallback
from trl_statelens.teachers import resolve_rows


def opd_config(tmp_path, **kwargs):
    defaults = dict(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=8,
        num_generations=2,
        max_completion_length=8,
        learning_rate=1e-3,
    )
    return OnPolicyDistillConfig(**{**defaults, **CPU, **kwargs})


def routed(dataset, ids=("math", "other", None)):
    """The dataset with a `teacher_id` column cycling through `ids` (None: the default, the first teacher)."""
    return dataset.add_column("teacher_id", [ids[i % len(ids)] for i in range(len(dataset))])


@pytest.fixture
def two_teachers(math_teacher_path, teacher_path):
    return {"math": str(math_teacher_path), "other": str(teacher_path)}


def test_routed_rows_get_their_own_teachers_logps(tmp_path, math_trained_path, math_dataset, two_teachers):
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=two_teachers,
        args=opd_config(tmp_path),
        train_dataset=routed(math_dataset),
    )
    rows = [dict(row) for row in routed(math_dataset).select(range(4)) for _ in range(2)]
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows)
    assert batch["teacher"] == ["math", "math", "other", "other", "math", "math", "math", "math"]
    logps = resolve_rows(batch["teacher_scores"], batch["completion_ids"], batch["completion_mask"]).logps
    prompts = [p[m.bool()].tolist() for p, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
    completions = [c[m.bool()].tolist() for c, m in zip(batch["completion_ids"], batch["completion_mask"])]
    # Each single teacher scoring every row: the routed batch holds, row by row, the named teacher's answer
    single = {
        name: resolve_rows(teacher.score(prompts, completions), batch["completion_ids"], batch["completion_mask"])
        for name, teacher in trainer.teacher.teachers.items()
    }
    for i, name in enumerate(batch["teacher"]):
        torch.testing.assert_close(logps[i], single[name].logps[i], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(single["math"].logps, single["other"].logps)  # the routing matters


def test_routed_divergence_equals_each_teachers_loss_on_its_rows(
    tmp_path, math_trained_path, math_dataset, two_teachers
):
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=two_teachers,
        args=opd_config(tmp_path, signal="divergence"),
        train_dataset=routed(math_dataset),
    )
    rows = [dict(row) for row in routed(math_dataset).select(range(4)) for _ in range(2)]
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows)
    student = trainer.accelerator.unwrap_model(trainer.model)
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    from trl_statelens.heads import _completion_hidden_states

    hidden = _completion_hidden_states(student, input_ids, attention_mask, batch["completion_ids"].size(1))
    mask, normalizer = batch["completion_mask"].float(), torch.tensor(10.0)
    routed_out = trainer.teacher.divergence_loss(student, hidden, batch, mask, normalizer, 1.0, 1.0)
    expected = 0.0
    for name, teacher in trainer.teacher.teachers.items():
        index = torch.tensor([i for i, t in enumerate(batch["teacher"]) if t == name])
        part = {k: batch[k][index] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        part_out = teacher.divergence_loss(student, hidden[index], part, mask[index], normalizer, 1.0, 1.0)
        expected = expected + part_out.loss
        for field in ("teacher_logps", "logps", "entropies"):  # each row's values from its own teacher's pass
            row_values, part_values = getattr(routed_out, field)[index], getattr(part_out, field).float()
            torch.testing.assert_close(row_values, part_values, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(routed_out.loss, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("signal", ["reverse_kl", "continuation", "divergence"])
def test_every_signal_trains_with_two_teachers(tmp_path, math_trained_path, math_dataset, two_teachers, signal):
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=two_teachers,
        args=opd_config(
            tmp_path,
            signal=signal,
            state_source_mix={"learner": 0.5, "teacher": 0.5},
            **({"continuation_length": 4} if signal == "continuation" else {}),
        ),
        train_dataset=routed(math_dataset),
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
    )
    trainer.train()
    logged = trainer.state.log_history[0]
    for name in two_teachers:
        assert logged[f"statelens/supervised_tokens/{name}"] > 0
        if signal != "continuation":
            assert f"teacher_kl/sampled/{name}" in logged
    ledger = [json.loads(line) for line in open(tmp_path / "statelens" / "states.jsonl")]
    assert {entry["teacher"] for entry in ledger} == set(two_teachers)


def test_per_teacher_state_metrics_match_a_hand_count_of_the_ledger(
    tmp_path, math_trained_path, math_dataset, two_teachers
):
    """`supervised_tokens/<name>` and `source_frac/teacher/<name>` per optimizer step, counted again from every
    sequence of the ledger: with gradient accumulation a step spans two micro-batches, both counted."""
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=two_teachers,
        args=opd_config(
            tmp_path,
            max_steps=2,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            state_source_mix={"learner": 0.5, "teacher": 0.5},
        ),  # fmt: skip
        train_dataset=routed(math_dataset),
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
    )
    trainer.train()
    ledger = tmp_path / "statelens"
    states = [json.loads(line) for line in open(ledger / "states.jsonl")]
    steps = [json.loads(line) for line in open(ledger / "steps.jsonl")]
    assert [line["step"] for line in steps] == [1, 2]
    for line in steps:
        mine = [state for state in states if state["step"] == line["step"]]
        total = sum(state["num_supervised"] for state in mine)
        assert line["supervised_tokens"] == total
        for name in two_teachers:
            theirs = [state for state in mine if state["teacher"] == name]
            assert line[f"supervised_tokens/{name}"] == sum(state["num_supervised"] for state in theirs)
            written = sum(state["num_supervised"] for state in theirs if state["source"] == "teacher")
            assert line[f"source_frac/teacher/{name}"] == pytest.approx(written / total)
        assert sum(line[f"source_frac/teacher/{name}"] for name in two_teachers) == pytest.approx(
            line["source_frac/teacher"]
        )
    # both teachers wrote prefixes on some step: the breakdown is not trivially one teacher's
    assert all(any(line[f"source_frac/teacher/{name}"] > 0 for line in steps) for name in two_teachers)
    # the trainer's log: one value per step (logging_steps=1), the ledger's
    logged = [entry for entry in trainer.state.log_history if "statelens/source_frac/teacher" in entry]
    for entry, line in zip(logged, steps, strict=True):
        for name in two_teachers:
            assert entry[f"statelens/supervised_tokens/{name}"] == line[f"supervised_tokens/{name}"]
            assert entry[f"statelens/source_frac/teacher/{name}"] == pytest.approx(line[f"source_frac/teacher/{name}"])


def test_unknown_teacher_id_is_refused(tmp_path, math_trained_path, math_dataset, two_teachers):
    with pytest.raises(ValueError, match=r"not given: \['physics'\].*\['math', 'other'\]"):
        OnPolicyDistillTrainer(
            model=str(math_trained_path),
            teacher_model=two_teachers,
            args=opd_config(tmp_path),
            train_dataset=routed(math_dataset, ids=("math", "physics")),
        )


def test_teacher_ids_with_a_single_teacher_are_refused(tmp_path, math_trained_path, math_teacher_path, math_dataset):
    with pytest.raises(ValueError, match="single teacher"):
        OnPolicyDistillTrainer(
            model=str(math_trained_path),
            teacher_model=str(math_teacher_path),
            args=opd_config(tmp_path),
            train_dataset=routed(math_dataset),
        )


def test_empty_teacher_dict_is_refused(tmp_path, math_trained_path, math_dataset):
    with pytest.raises(ValueError, match="empty dict"):
        OnPolicyDistillTrainer(
            model=str(math_trained_path), teacher_model={}, args=opd_config(tmp_path), train_dataset=math_dataset
        )


def test_a_teacher_with_another_vocabulary_is_named(tmp_path, tokenizer, math_trained_path, math_dataset):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    small = Qwen3ForCausalLM(
        Qwen3Config(vocab_size=len(tokenizer) - 8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    )  # fmt: skip
    with pytest.raises(ValueError, match="teacher 'small':.*smaller than the student's"):
        OnPolicyDistillTrainer(
            model=str(math_trained_path),
            teacher_model={"math": str(math_trained_path), "small": small},
            args=opd_config(tmp_path),
            train_dataset=math_dataset,
        )


@pytest.mark.parametrize("signal", ["reverse_kl", "divergence"])
def test_a_served_and_an_in_process_teacher_train_together(
    tmp_path, tokenizer, teacher_path, math_teacher_path, math_trained_path, math_dataset, signal
):
    with TestTeacherServer(teacher_path) as server:
        trainer = OnPolicyDistillTrainer(
            model=str(math_trained_path),
            teacher_model={"local": str(math_teacher_path), "served": server.url},
            # the served teacher's top-k covers the vocabulary (read with divergence only)
            args=opd_config(
                tmp_path, signal=signal, **({"teacher_top_k": len(tokenizer)} if signal == "divergence" else {})
            ),
            train_dataset=routed(math_dataset, ids=("local", "served")),
        )
        trainer.train()
    logged = trainer.state.log_history[0]
    assert all(logged[f"statelens/supervised_tokens/{name}"] > 0 for name in ("local", "served"))
    assert all(torch.isfinite(torch.tensor(logged[f"teacher_kl/sampled/{name}"])) for name in ("local", "served"))


def test_a_served_teacher_at_another_temperature_is_refused(tmp_path, math_trained_path, math_dataset):
    with pytest.raises(ValueError, match="teacher 'kb' is served at http://host:1: temperature=0.7"):
        OnPolicyDistillTrainer(
            model=str(math_trained_path),
            teacher_model={"kb": "http://host:1"},
            args=opd_config(tmp_path, temperature=0.7),
            train_dataset=math_dataset,
        )


def test_an_in_process_teacher_without_rows_here_joins_on_a_stand_in_row(
    tmp_path, math_trained_path, math_teacher_path, math_dataset, monkeypatch
):
    """Under ZeRO-3 another rank may hold this teacher's rows: a rank with none still runs its forward."""
    from trl_statelens import collective

    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model={"math": str(math_teacher_path)},
        args=opd_config(tmp_path, signal="divergence"),
        train_dataset=math_dataset,
    )
    teacher = trainer.teacher.teachers["math"]
    monkeypatch.setattr(collective, "gather_counts", lambda accelerator, count: [count, 1])  # another rank has rows
    forwards = []
    trainer.accelerator.unwrap_model(teacher.model).register_forward_hook(lambda *args: forwards.append(1))
    assert teacher.score([], []) == []
    empty = torch.zeros((0, 3), dtype=torch.long)
    batch = {"prompt_ids": empty, "prompt_mask": empty, "completion_ids": empty, "completion_mask": empty}
    hidden = torch.zeros((0, 3, trainer.model.config.hidden_size), requires_grad=True)
    out = teacher.divergence_loss(trainer.model, hidden, batch, empty.float(), torch.tensor(1.0), 1.0, 1.0)
    assert out.loss.item() == 0.0
    assert out.teacher_logps.shape == out.logps.shape == out.entropies.shape == (0, 3)
    assert len(forwards) == 2


def test_the_recipe_reads_named_teachers(tmp_path):
    from pathlib import Path

    named_teachers = runpy.run_path(str(Path(__file__).parents[1] / "recipes" / "opd.py"))["named_teachers"]
    folder = str(tmp_path)
    expected = {"math": folder, "kb": "http://host:8000"}
    assert named_teachers(f"math={folder},kb=http://host:8000", 0) == expected
    assert named_teachers(json.dumps(expected), 0) == expected
    assert named_teachers(folder, 0) is None  # a single teacher
