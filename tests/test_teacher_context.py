"""A self teacher's solved problems as the chat the student speaks (`context_format="chat"`): each shot a user/assistant
exchange closed by the template's end token, so the teacher has seen where an answer ends."""

import pytest
from cpu_settings import CPU

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, load_gsm8k
from trl_statelens.data import shots_context
from trl_statelens.teachers.self_teacher import is_exchanges


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
