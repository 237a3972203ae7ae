"""A teacher's privileged context. A self teacher's solved problems as the chat the student speaks
(`context_format="chat"`): each shot a user/assistant exchange closed by the template's end token, so the teacher has
seen where an answer ends. A separate teacher shown each row's context (`teacher_reads_context`): it scores after the
row's prompt with that context, the student never sees it, and bad settings are refused before any model loads."""

import pytest
from cpu_settings import CPU
from test_self_teacher import assert_plain_forward_logps, opd_config, with_context
from transformers import AutoModelForCausalLM

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, load_gsm8k
from trl_statelens.data import shots_context
from trl_statelens.teachers import resolve_rows
from trl_statelens.teachers.self_teacher import is_exchanges
from trl_statelens.teachers.self_teacher import with_context as teacher_view


def test_chat_context_is_the_shots_as_exchanges_and_text_context_is_unchanged():
    shots = [
        {"question": "What is 3 + 4?", "answer": "3 + 4 = 7\n#### 7"},
        {"question": "2 * 5?", "answer": "#### 10"},
    ]
    exchanges = shots_context(shots, "chat")
    assert [m["role"] for m in exchanges] == ["user", "assistant", "user", "assistant"]
    assert exchanges[1]["content"] == "3 + 4 = 7\n#### 7" and is_exchanges(exchanges)
    text = shots_context(shots)
    assert text == "Question: What is 3 + 4?\nAnswer: 3 + 4 = 7\n#### 7\n\nQuestion: 2 * 5?\nAnswer: #### 10"
    assert not is_exchanges(text) and not is_exchanges([{"role": "assistant", "content": "#### 7"}])


def test_chat_context_needs_a_chat_prompt():
    with pytest.raises(ValueError, match="context_format='chat'.*prompt_format='chat'"):
        load_gsm8k("lab", "train", prompt_format="plain", context_shots=2, context_format="chat", limit=4)
    with pytest.raises(ValueError, match="unknown context_format 'turns'"):
        load_gsm8k("lab", "train", prompt_format="chat", context_shots=2, context_format="turns", limit=4)


def test_the_teacher_reads_each_shot_closed_by_the_end_token_then_the_students_conversation(
    tmp_path, math_trained_path, tokenizer
):
    data = load_gsm8k("lab", "train", prompt_format="chat", context_shots=2, context_format="chat", limit=8)
    args = OnPolicyDistillConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=8, teacher_model_kind="base", **CPU,
    )  # fmt: skip
    trainer = OnPolicyDistillTrainer(model=str(math_trained_path), args=args, train_dataset=data, state_logging=False)
    rows = [dict(row) for row in data.select(range(2))]
    student = [list(ids) for ids in trainer._tokenize_prompts([row["prompt"] for row in rows])[0]]
    for row, ids, student_ids in zip(rows, trainer.teacher.prompts(student, rows), student):
        text = tokenizer.decode(ids)
        shots = row["privileged_context"]
        for shot in shots[1::2]:  # each solved answer, then the end of its turn
            assert shot["content"] + "<|im_end|>" in text
        # the student's own conversation, unchanged, closes the teacher's prompt
        assert ids[-len(student_ids) :] == student_ids
        assert text.index(shots[-1]["content"]) < text.index(row["question"])


def test_recipes_take_the_context_format_and_refuse_chat_turns_behind_a_plain_prompt():
    from trl_statelens.reports.runs import RecipeArguments, load_train_data

    args = RecipeArguments(
        dataset_name="lab", prompt_format="chat", context_shots=2, context_format="chat", train_size=4
    )
    assert is_exchanges(load_train_data(args, seed=0)[0]["privileged_context"])
    with pytest.raises(ValueError, match="--context_format chat .* needs --prompt_format chat"):
        RecipeArguments(dataset_name="lab", prompt_format="plain", context_shots=2, context_format="chat")


# ----- a separate teacher shown the row's context (`teacher_reads_context`) ------------------------------
def separate_teacher_config(tmp_path, **kwargs):
    return opd_config(tmp_path, **{"teacher_model_kind": None, "teacher_reads_context": True, **kwargs})


def test_separate_teacher_scores_after_the_rows_context(tmp_path, math_trained_path, math_teacher_path, math_dataset):
    """The teacher's prompt is the row's prompt with its context filled in (contexts of several lengths in one batch);
    its log-prob of completion token j is a plain forward of the teacher over [that prompt + completion]; the student's
    prompt is unchanged, and the extra tokens are counted for the teacher's FLOPs."""
    template = "{prompt}\nHint: {privileged_context}"
    data = with_context(math_dataset, ["", "Answer: 7", "Add the apples, then the pears: 3 + 4 = 7."])
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=str(math_teacher_path),
        args=separate_teacher_config(tmp_path, teacher_prompt_template=template),
        train_dataset=data,
    )
    assert trainer.probe_teacher_model is None  # the probes' prompts hold no context
    rows = [dict(row) for row in data.select(range(4)) for _ in range(2)]
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows)
    extra = 0
    for row, teacher_ids, student_ids, student_mask in zip(
        rows, batch["teacher_prompt_ids"], batch["prompt_ids"], batch["prompt_mask"]
    ):
        filled = template.format(prompt=row["prompt"], privileged_context=row["privileged_context"])
        assert teacher_ids == trainer._tokenizer(filled)["input_ids"]
        assert student_ids[student_mask.bool()].tolist() == trainer._tokenizer(row["prompt"])["input_ids"]
        extra += len(teacher_ids) - int(student_mask.sum())
    assert extra > 0 and trainer.step_counts.peek("teacher_context_tokens") == extra
    teacher_logps = resolve_rows(batch["teacher_scores"], batch["completion_ids"], batch["completion_mask"]).logps
    teacher = AutoModelForCausalLM.from_pretrained(math_teacher_path).eval()
    assert_plain_forward_logps(teacher, batch, teacher_logps, trainer.temperature)


def test_solved_exchanges_are_read_as_turns_before_the_question():
    shots = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "#### 2"}]
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    assert teacher_view(prompt, shots, "{prompt}{privileged_context}") == [prompt[0], *shots, prompt[1]]
    assert teacher_view("2 + 2?", "1 + 1 = 2", "{privileged_context}\n{prompt}") == "1 + 1 = 2\n2 + 2?"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(teacher_model_kind="base"), "a self teacher always reads"),
        (dict(teacher_prompt_template="Hint: {privileged_context}"), "lacks {prompt}"),
    ],
)
def test_bad_context_settings_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        separate_teacher_config(tmp_path, **kwargs)


def test_rows_without_a_context_column_are_refused_before_training(tmp_path, math_trained_path, math_dataset):
    with pytest.raises(ValueError, match="teacher_reads_context=True.*'privileged_context' column"):
        OnPolicyDistillTrainer(
            model=str(math_trained_path),
            teacher_model=str(math_trained_path),
            args=separate_teacher_config(tmp_path),
            train_dataset=math_dataset,
        )
