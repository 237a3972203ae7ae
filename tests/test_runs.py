"""`trl_statelens.reports.runs.compute_counts`: the teacher share of a run's training FLOPs, for every kind of teacher; the
records' per-step `teacher_tokens` and FLOPs by part, against a hand count."""

import json
from collections import Counter

import pytest
from cpu_settings import CPU
from datasets import Dataset
from transformers import TrainerCallback
from vllm_test_server import TestTeacherServer

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLoggingCallback, collective
from trl_statelens.lab import build_model
from trl_statelens.lab.model import build_qwen3
from trl_statelens.lens.compute import FLOPS_PARTS, ComputeCounter, matmul_parameters
from trl_statelens.lens.records import source_code
from trl_statelens.reports.runs import compute_counts


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


@pytest.fixture(scope="module")
def teacher_server(teacher_path):
    with TestTeacherServer(teacher_path) as server:
        yield server


class TokensSeen(TrainerCallback):
    """`num_input_tokens_seen` (the rollout tokens `compute` counts) at the end of each step, 0 before the first."""

    def __init__(self):
        self.seen = [0]

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(state.num_input_tokens_seen)


@pytest.mark.parametrize(
    "kind, signal, mix",
    [
        ("in_process", "reverse_kl", {"learner": 0.5, "teacher": 0.5}),
        ("in_process", "continuation", {"learner": 1.0}),
        ("self", "reverse_kl", {"learner": 1.0}),
        ("router", "reverse_kl", {"learner": 0.5, "teacher": 0.5}),
        ("served", "reverse_kl", {"learner": 0.5, "teacher": 0.5}),
    ],
)
def test_teacher_tokens_and_flops_by_part_match_a_hand_count(
    kind, signal, mix, tmp_path, student_path, teacher_path, math_dataset, monkeypatch, request
):
    """Per step, `teacher_tokens` is what the teacher was given to score (every rollout's completion tokens) plus
    what it wrote (the rollouts of `teacher` states; a `continuation`, which it then scores after the student's
    prefix), counted by hand from each generation batch's masks. Another rank is played that always needs one more
    teacher call (as in tests/test_collective.py): this rank makes its stand-in calls (an extra scoring chunk, a
    generation or a chunk for a router's teacher without rows here), which are not counted. The step's
    `flops/<part>` is DESIGN.md's count from the models' sizes and the step's tokens (with the teacher's writing of
    `teacher` states: its prompts and the tokens written), and the last `flops_total/*` are `results.json`'s; a served
    teacher's are unknown (`None`), its tokens are counted all the same."""
    # (the teachers' agreement only: the trainer's and the records' gathers stay this single process's)
    monkeypatch.setattr(collective, "agreed_calls", lambda accelerator, count: count + 1)
    data = Dataset.from_dict({"prompt": math_dataset["prompt"][:8]})
    teacher_model, kind_args = {
        "in_process": (str(teacher_path), {}),
        "self": (None, {"teacher_model_kind": "base"}),
        "router": ({"a": str(teacher_path), "b": str(student_path)}, {}),  # every row is a's: b has none here
        "served": (None, None),
    }[kind]
    if kind == "self":
        data = data.add_column("privileged_context", math_dataset["completion"][:8])
    if kind == "served":
        kind_args = {"teacher_model_server_url": request.getfixturevalue("teacher_server").url}
    tokens_seen = TokensSeen()
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=teacher_model,
        args=opd_config(
            tmp_path,
            max_steps=2,
            per_device_train_batch_size=4,
            signal=signal,
            state_source_mix=mix,
            **({"continuation_length": 4} if signal == "continuation" else {}),
            **kind_args,
        ),  # fmt: skip
        train_dataset=data,
        callbacks=[StateLoggingCallback(sample_rate=0.0), tokens_seen],
    )
    by_hand, context, writing = Counter(), Counter(), Counter()
    generate_and_score = trainer._generate_and_score_completions

    def counted(inputs):
        output = generate_and_score(inputs)
        mask = output["completion_mask"]
        if signal == "continuation":  # the teacher wrote the continuation, then scored the prefix and it
            count = output["loss_mask"].sum() + mask.sum()
        else:  # every rollout scored; those of teacher states written by the teacher first
            count = mask.sum() + mask[output["row_source"] == source_code("teacher")].sum()
        by_hand[trainer.state.global_step + 1] += int(count)
        # a self teacher's prompts are longer than the student's (`prompt_mask`) by its privileged context
        extra = [len(t) - int(m.sum()) for t, m in zip(output["teacher_prompt_ids"], output["prompt_mask"])]
        context[trainer.state.global_step + 1] += sum(extra)
        # the teacher's generation of teacher states: a forward over each one's prompt, one per token written
        rows = (output["row_source"] == source_code("teacher")).nonzero().flatten().tolist()
        written = sum(len(output["teacher_prompt_ids"][i]) + int(mask[i].sum()) for i in rows)
        writing[trainer.state.global_step + 1] += written
        return output

    trainer._generate_and_score_completions = counted
    trainer.train()

    steps = [json.loads(line) for line in (tmp_path / "statelens" / "steps.jsonl").read_text().splitlines()]
    assert [line["teacher_tokens"] for line in steps] == [by_hand[1], by_hand[2]] and min(by_hand.values()) > 0
    assert steps[-1]["teacher_tokens_total"] == by_hand[1] + by_hand[2]
    if "teacher" in mix:
        assert any(line["source_frac/teacher"] > 0 for line in steps)  # the teacher wrote some states

    student = matmul_parameters(trainer.model)
    teacher = {
        "in_process": lambda: matmul_parameters(trainer.teacher.model),
        "self": lambda: student,
        "router": lambda: matmul_parameters(trainer.teacher.teachers["a"].model),
        "served": lambda: None,
    }[kind]()
    cut = signal == "continuation"
    assert (min(context.values()) > 0) == (kind == "self") and max(context.values()) >= 0
    for step, (line, before, after) in enumerate(zip(steps, tokens_seen.seen, tokens_seen.seen[1:]), start=1):
        tokens, supervised = after - before, line["supervised_tokens"]
        assert tokens > 0 and line.get("teacher_context_tokens", 0) == context[step]
        assert line["flops/student_generation"] == pytest.approx(2 * student * tokens)
        assert line["flops/student_training"] == pytest.approx(6 * student * (tokens + cut * supervised))
        if teacher is None:
            assert line["flops/teacher_scoring"] is None and line["flops/teacher_writing"] is None
            assert line["flops/total"] is None
        else:  # a continuation is written from each cut state, then scored
            reads = tokens + context[step]
            assert line["flops/teacher_scoring"] == pytest.approx(2 * teacher * (reads + cut * supervised))
            written = cut * (reads + supervised) + writing[step]
            assert line["flops/teacher_writing"] == pytest.approx(2 * teacher * written)
            parts = [line[f"flops/{part}"] for part in FLOPS_PARTS]
            assert line["flops/total"] == pytest.approx(sum(parts))
    counts = compute_counts(trainer)
    assert counts["teacher_tokens"] == by_hand[1] + by_hand[2]
    assert counts["teacher_context_tokens"] == context[1] + context[2]
    for part, value in {**counts["flops_by_part"], "total": counts["flops"]}.items():
        if value is None:  # a served teacher's part, and so the total
            assert steps[-1][f"flops_total/{part}"] is None and part.startswith(("teacher", "total"))
            assert teacher is None
        else:
            assert steps[-1][f"flops_total/{part}"] == pytest.approx(value)
            assert value == pytest.approx(sum(line[f"flops/{part}"] for line in steps))


def test_teacher_flops_count_the_teacher_states_the_teacher_wrote(tmp_path, student_path, teacher_path, math_dataset):
    """Half the rows are `teacher` states: the in-process teacher generates them (a forward over each one's prompt,
    then one per written token) and then scores every row. `teacher_tokens` counts the written tokens; the teacher
    FLOPs must count the writing too: 2 N_T per prompt token of those rollouts (`teacher_generation_prompt_tokens`)
    and per token written (`teacher_written_tokens`). (Review 2026-12-04, 3.)"""
    args = opd_config(tmp_path, signal="divergence", state_source_mix={"learner": 0.5, "teacher": 0.5})
    trainer = OnPolicyDistillTrainer(
        model=str(student_path), teacher_model=str(teacher_path), args=args,
        train_dataset=math_dataset.select(range(16)),
    )  # fmt: skip
    prompts = []  # the teacher's prompt tokens of the teacher-state rows, counted by hand
    generate_and_score = trainer._generate_and_score_completions

    def counted(inputs):
        output = generate_and_score(inputs)
        rows = (output["row_source"] == source_code("teacher")).nonzero().flatten().tolist()
        prompts.append(sum(len(output["teacher_prompt_ids"][i]) for i in rows))
        return output

    trainer._generate_and_score_completions = counted
    trainer.train()
    line = json.loads((tmp_path / "statelens" / "steps.jsonl").read_text().splitlines()[0])
    n_teacher = matmul_parameters(trainer.teacher.model)
    tokens = trainer.state.num_input_tokens_seen
    written = line["teacher_tokens"] - line["supervised_tokens"]  # scored = every completion token here
    assert written > 0  # the teacher wrote rollouts this step
    assert line["flops/teacher_writing"] >= 2 * n_teacher * written, "the teacher's writing is not counted"
    assert (line["teacher_written_tokens"], line["teacher_generation_prompt_tokens"]) == (written, sum(prompts))
    assert line["flops/teacher_writing"] == pytest.approx(2 * n_teacher * (written + sum(prompts)))
    assert line["flops/teacher_scoring"] == pytest.approx(2 * n_teacher * tokens)
    counts = compute_counts(trainer)  # results.json's count is the ledger's
    for part in ("teacher_scoring", "teacher_writing"):
        assert counts["flops_by_part"][part] == pytest.approx(line[f"flops_total/{part}"])
    assert counts["flops"] == pytest.approx(line["flops_total/total"])


@pytest.mark.parametrize("continuation", [False, True])
def test_the_flops_parts_sum_to_the_total_with_every_count_on(continuation):
    """Student generation, student training, teacher scoring and teacher writing are the whole count: with every
    ledger count at work (a self teacher's context and shared start, skipped rows, the cache's reuses, `teacher`
    states), the parts add up to `total`, and the shared start and the cache's reruns land in the teacher's scoring."""
    totals = {
        "supervised_tokens": 40.0, "teacher_context_tokens": 300.0, "teacher_skipped_tokens": 20.0,
        "teacher_prefix_shared_tokens": 240.0, "teacher_prefix_run_tokens": 30.0, "cache_reused_tokens": 90.0,
        "cache_reused_completion_tokens": 50.0, "cache_reused_teacher_tokens": 110.0, "cache_checked_tokens": 90.0,
        "teacher_generation_prompt_tokens": 15.0, "teacher_written_tokens": 25.0,
    }  # fmt: skip
    counter = ComputeCounter(student=3, teacher_sizes={"": 5}, samples=True, reference=True,
                             continuation=continuation, teacher_head=7)  # fmt: skip
    flops = counter.of_ledger(100.0, totals)
    assert set(flops) == {*FLOPS_PARTS, "total"}
    assert flops["total"] == pytest.approx(sum(flops[part] for part in FLOPS_PARTS))
    reads = 100 + 300 - 20 - (240 - 30)  # the rollouts, the context, less the skipped rows and the start's saving
    scoring = 2 * 5 * (reads + 110 + continuation * 40) + 2 * 7 * 50
    assert flops["teacher_scoring"] == pytest.approx(scoring)
    writing = 2 * 5 * (15 + 25) + continuation * 2 * 5 * (100 + 300 - 20 + 40)
    assert flops["teacher_writing"] == pytest.approx(writing)


@pytest.mark.parametrize("signal", ["divergence", "continuation"])
def test_training_flops_count_at_the_steps_that_train_on_a_generation_batch(
    tmp_path, student_path, teacher_path, math_dataset, signal
):
    """steps_per_generation = 2 x gradient_accumulation_steps: each generation batch is sampled at one step and
    trained on at two. The sampling (and the `continuation` teacher's reading of the rollouts) counts at the step
    that samples; the student's training on the rollouts, and a `divergence` teacher's scoring in the loss, half at
    each of the two steps (a continuation's supervised tokens, at the step that trains on them). The run's totals
    stay `results.json`'s. (The second step's `flops/student_training` was 0.)"""
    tokens_seen = TokensSeen()
    cut = signal == "continuation"
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(teacher_path),
        args=opd_config(
            tmp_path,
            max_steps=4,
            per_device_train_batch_size=2,
            steps_per_generation=2,
            signal=signal,
            **({"continuation_length": 4} if cut else {}),
        ),  # fmt: skip
        train_dataset=math_dataset.select(range(16)),
        callbacks=[StateLoggingCallback(sample_rate=0.0), tokens_seen],
    )
    trainer.train()
    steps = [json.loads(line) for line in (tmp_path / "statelens" / "steps.jsonl").read_text().splitlines()]
    student, teacher = matmul_parameters(trainer.model), matmul_parameters(trainer.teacher.model)
    seen = tokens_seen.seen
    assert seen[1] == seen[2] > 0 and seen[3] == seen[4] > seen[2]  # sampled at steps 1 and 3
    for step, line in enumerate(steps, start=1):
        first = step if step % 2 else step - 1  # the step that sampled this step's generation batch
        batch, sampled, supervised = (
            seen[first] - seen[first - 1],
            seen[step] - seen[step - 1],
            line["supervised_tokens"],
        )
        assert line["flops/student_generation"] == pytest.approx(2 * student * sampled)
        assert line["flops/student_training"] == pytest.approx(6 * student * (batch / 2 + cut * supervised))
        scored = 4 * (sampled + supervised) if cut else batch  # divergence: 2 N_T per token, half the batch a step
        teacher_parts = line["flops/teacher_scoring"] + line["flops/teacher_writing"]
        assert teacher_parts == pytest.approx(teacher * scored)
    counts = compute_counts(trainer)
    for part, value in {**counts["flops_by_part"], "total": counts["flops"]}.items():
        assert steps[-1][f"flops_total/{part}"] == pytest.approx(value)
        assert value == pytest.approx(sum(line[f"flops/{part}"] for line in steps))
