"""GSM8K rewards, called the way TRL's GRPOTrainer calls them."""

import pytest

from trl_statelens.evaluation.rewards import gsm8k_accuracy_reward, gsm8k_format_reward

GOLD_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)
RIGHT = " Natalia sold 48 / 2 = 24 clips in May.\nAltogether she sold 48 + 24 = 72 clips.\n#### 72"
RIGHT_THEN_RAMBLES = RIGHT + "\n\nQuestion: Weng earns $12 an hour. How much for 50 minutes?\nAnswer: 10\n#### 10"
WRONG = " Natalia sold 48 + 2 = 50 clips.\n#### 50"
NO_MARKS = " She sold 48 in April and 24 in May, so 72 clips."
COMMAS = " 600 * 2 = 1200 dollars.\n#### 1,200"


def call_like_grpo(reward_func, completions, **columns):
    """GRPOTrainer passes prompts, completions, completion_ids, every data set column and three extras."""
    logged = {"extra": {}, "metric": {}}
    rewards = reward_func(
        prompts=["Question: Natalia sold clips...\nAnswer:"] * len(completions),
        completions=completions,
        completion_ids=[[1, 2, 3]] * len(completions),
        question=["Natalia sold clips..."] * len(completions),
        trainer_state=None,
        log_extra=lambda column, values: logged["extra"].__setitem__(column, values),
        log_metric=lambda name, value: logged["metric"].__setitem__(name, value),
        **columns,
    )
    return rewards, logged


def test_accuracy_reward_on_plain_completions():
    completions = [RIGHT, RIGHT_THEN_RAMBLES, WRONG, NO_MARKS]
    rewards, logged = call_like_grpo(gsm8k_accuracy_reward, completions, ground_truth=["72"] * 4)
    assert rewards == [1.0, 1.0, 0.0, 0.0]  # strict: no '####' line, no reward
    assert logged["extra"]["extracted_answer"] == ["72", "72", "50", ""]
    assert logged["metric"]["gsm8k_answer_found"] == pytest.approx(0.75)


def test_accuracy_reward_flexible_mode_reads_the_last_number():
    rewards = gsm8k_accuracy_reward(
        completions=[NO_MARKS, WRONG], ground_truth=["72", "72"], extraction_mode="flexible"
    )
    assert rewards == [1.0, 0.0]


def test_accuracy_reward_on_conversational_completions():
    completions = [[{"role": "assistant", "content": RIGHT.strip()}], [{"role": "assistant", "content": WRONG}]]
    rewards, _ = call_like_grpo(gsm8k_accuracy_reward, completions, ground_truth=["72", "72"])
    assert rewards == [1.0, 0.0]


@pytest.mark.parametrize(
    "columns",
    [{"ground_truth": ["1200"]}, {"solution": ["1,200"]}, {"answer": ["600 * 2 = 1200\n#### 1,200"]}],
)
def test_accuracy_reward_reads_gold_from_any_usual_column(columns):
    rewards, _ = call_like_grpo(gsm8k_accuracy_reward, [COMMAS], **columns)
    assert rewards == [1.0]


def test_accuracy_reward_prefers_ground_truth_over_raw_answer():
    rewards, _ = call_like_grpo(gsm8k_accuracy_reward, [RIGHT], ground_truth=["72"], answer=[GOLD_SOLUTION + "0"])
    assert rewards == [1.0]


def test_accuracy_reward_without_gold_column_says_which_columns_work():
    with pytest.raises(ValueError, match="ground_truth"):
        gsm8k_accuracy_reward(prompts=["p"], completions=[RIGHT], question=["q"])


def test_format_reward_wants_a_final_answer_line():
    completions = [RIGHT, RIGHT_THEN_RAMBLES, NO_MARKS, " so the answer is #### 72 clips", COMMAS, " ####\n72"]
    rewards, _ = call_like_grpo(gsm8k_format_reward, completions, ground_truth=["72"] * 6)
    assert rewards == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    chat = [[{"role": "assistant", "content": "24 + 48 = 72\n#### 72"}]]
    assert gsm8k_format_reward(completions=chat) == [1.0]


def test_math_verify_reads_the_completion_text_and_runs_off_the_main_thread():
    """math-verify sees the whole completion (no '####' line here, so extraction alone finds nothing right), and its
    signal-based timeouts are off, so a reward thread can call it."""
    import threading

    pytest.importorskip("math_verify")
    completions = [" So she sold \\boxed{72} clips.", " That is \\frac{144}{2} clips.", " She sold 71 clips.\n#### 71"]
    assert gsm8k_accuracy_reward(completions=completions, ground_truth=["72"] * 3) == [0.0, 0.0, 0.0]
    results = {}

    def reward_in_a_thread():
        results["rewards"] = gsm8k_accuracy_reward(
            completions=completions, ground_truth=["72"] * 3, use_math_verify=True
        )

    thread = threading.Thread(target=reward_in_a_thread)
    thread.start()
    thread.join()
    assert results["rewards"] == [1.0, 1.0, 0.0]
