"""GSM8K rewards for GRPO and on-policy distillation, with the signature TRL's ``GRPOTrainer`` calls them with.

The trainer calls ``reward_func(prompts=..., completions=..., completion_ids=..., **dataset_columns,
trainer_state=..., log_extra=..., log_metric=...)`` and expects one float per completion. Completions are strings
(plain prompts) or ``[{"role": "assistant", "content": ...}]`` (conversational prompts); both work here.

The gold answer comes from the ``ground_truth`` column that :func:`trl_statelens.data.load_gsm8k` adds; a
``solution`` column (TRL's convention) or the raw GSM8K ``answer`` column also work.
"""

from __future__ import annotations

import re

from ..answers import NUMBER_REGEX, answers_match, extract_answer, math_verify_match, normalize_number

# A base model given plain prompts keeps writing the next "Question: ..." after its answer; that text is not part of
# the answer (the evaluation stops generation there too).
STOP_STRINGS = ("Question:",)
FORMAT_LINE = re.compile(r"^[ \t]*####[ \t]*" + NUMBER_REGEX + r"[ \t]*\.?[ \t]*$", re.MULTILINE)


def completion_text(completion) -> str:
    """The text of a plain (``str``) or conversational (list of messages) completion."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return completion.get("content") or ""
    return "".join(m.get("content") or "" for m in completion if m.get("role", "assistant") == "assistant")


def cut_at_stop(text: str, stop_strings=STOP_STRINGS) -> str:
    """The text before the first stop string (where the model started a new problem)."""
    for stop in stop_strings:
        text = text.split(stop, 1)[0]
    return text


def gold_answer(value) -> str | None:
    """A normalised gold answer from a final-answer string (``"1,200"``) or a worked solution (``"... #### 1200"``)."""
    if value is None:
        return None
    value = str(value)
    if "####" in value:
        return extract_answer(value, "strict")
    return normalize_number(value) or value.strip()


def _gold_answers(n: int, ground_truth, solution, answer) -> list[str | None]:
    for column in (ground_truth, solution, answer):
        if column is not None:
            if len(column) != n:
                raise ValueError(f"got {n} completions but {len(column)} gold answers")
            return [gold_answer(v) for v in column]
    raise ValueError(
        "GSM8K rewards need the gold answer as a data set column: 'ground_truth' (added by "
        "trl_statelens.data.load_gsm8k), 'solution' or the GSM8K 'answer' column."
    )


def gsm8k_accuracy_reward(
    prompts=None,
    completions=None,
    ground_truth=None,
    solution=None,
    answer=None,
    extraction_mode: str = "strict",
    use_math_verify: bool = False,
    log_extra=None,
    log_metric=None,
    **kwargs,
) -> list[float]:
    """1.0 when the completion's final answer equals the gold one, else 0.0 (the study's exact-answer reward).

    The answer is the number after ``####`` (``extraction_mode="strict"``, the default: it also rewards the answer
    format) or the last number (``"flexible"``), read from the completion cut at the next ``Question:``.
    ``use_math_verify=True`` (needs the ``math`` extra) also rewards a completion whose text math-verify finds the
    gold value in (``\\boxed{72}``, ``\\frac{144}{2}``) when the extracted number does not match: it can only turn a
    0 into a 1, and works off the main thread. Under ``GRPOTrainer`` the extracted answers go to the completions
    table (``log_extra``) and the share of completions with any answer to the logs as ``gsm8k_answer_found``
    (``log_metric``).
    """
    if completions is None:
        raise ValueError("gsm8k_accuracy_reward needs completions=[...]")
    golds = _gold_answers(len(completions), ground_truth, solution, answer)
    texts = [cut_at_stop(completion_text(c)) for c in completions]
    predicted = [extract_answer(text, extraction_mode) for text in texts]
    rewards = [
        float(answers_match(p, g) or (use_math_verify and g is not None and math_verify_match(text, g)))
        for text, p, g in zip(texts, predicted, golds)
    ]
    if log_extra is not None:
        log_extra("extracted_answer", ["" if p is None else p for p in predicted])
    if log_metric is not None and predicted:
        log_metric("gsm8k_answer_found", sum(p is not None for p in predicted) / len(predicted))
    return rewards


def gsm8k_format_reward(prompts=None, completions=None, **kwargs) -> list[float]:
    """1.0 when the completion (cut at the next ``Question:``) has a ``#### <number>`` line, else 0.0."""
    if completions is None:
        raise ValueError("gsm8k_format_reward needs completions=[...]")
    return [float(FORMAT_LINE.search(cut_at_stop(completion_text(c))) is not None) for c in completions]
