"""The clean-format share and the repetition guard, on hand-made answers and on the real-model study's own answers."""

import json
from pathlib import Path

import pytest

from trl_statelens.answers import clean_format, repeats_itself
from trl_statelens.evaluation.gsm8k import GSM8KTask

ROOT = Path(__file__).resolve().parents[1]
REAL_TEST = ROOT / "docs" / "study" / "real" / "test"
GSM8K_TRAIN = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def answers(path: Path) -> dict[str, str]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {row["question"]: row["output"] for row in rows if row["task"] == "gsm8k"}


@pytest.mark.parametrize(
    "text, clean",
    [
        ("3 + 4 = 7\n#### 7", True),
        ("#### 7\n\n", True),  # cut by the "Question:" stop string as the next problem began
        ("#### $1,200.50 \n", True),
        ("3 + 4 = 7\n#### 7\n#### 7", False),
        ("#### 7\nThe answer is: 7", False),  # the real OPD student's habit
        ("#### 7 is the answer", False),
        ("The answer is 7.", False),
        ("#### seven", False),
    ],
)
def test_clean_format_is_one_final_answer_line_and_nothing_after_it(text, clean):
    assert clean_format(text) is clean


@pytest.mark.parametrize(
    "text, loops",
    [
        ("#### 18\n#### 18\n#### 18", True),  # the same answer line again
        ("#### 2\n#### 3\n#### 4\n#### 5", True),  # a counting loop: lines differ, the mark repeats
        ("She has 8 books in all.\nShe has 8 books in all.", True),
        (
            "1. she feeds them in the morning and then again in the evening\n"
            "2. she feeds them in the morning and then again in the evening\n"
            "3. she feeds them in the morning and then again in the evening",
            True,
        ),  # numbered: no line repeats
        ("Half of 32 is 16.\n16 tables have 2 chairs each for a total of 32 chairs\n#### 32", False),
        ("}\n}\nx = 1\n#### 1", False),  # short lines repeat in well-formed text
    ],
)
def test_repeats_itself_on_hand_made_answers(text, loops):
    assert repeats_itself(text) is loops


def test_the_real_students_answers_end_after_their_answer_line_in_one_of_250():
    """The 2026-12-03 OPD run's test answers (docs/study/real/test/opd): 230 of 250 hold a `#### N` and 1 ends there.
    Every answer of the student's that strict scoring found but the clean share refuses goes on past `N`."""
    opd = answers(REAL_TEST / "opd" / "eval" / "after.items.jsonl")
    task = GSM8KTask()
    found = [q for q, a in opd.items() if task.score(a, {"ground_truth": "0", "answer": "#### 0"})["answer_found"]]
    clean = [q for q, a in opd.items() if clean_format(a)]
    assert (len(opd), len(found), len(clean)) == (250, 230, 1)
    assert set(clean) <= set(found)
    assert all(opd[q].rstrip() != opd[q].split("####")[0] for q in found)


def test_real_loops_are_caught_and_sft_answers_mostly_are_not():
    """Real loops from the committed answers: the student's pure loops (opening with `####`) all repeat; SFT, trained
    on reference solutions, repeats far less than the OPD student."""
    opd = answers(REAL_TEST / "opd" / "eval" / "after.items.jsonl")
    sft = answers(REAL_TEST / "sft" / "eval" / "after.items.jsonl")
    pure_loops = [a for a in opd.values() if a.lstrip().startswith("####") and a.count("####") > 2]
    assert len(pure_loops) >= 40
    assert all(repeats_itself(a) for a in pure_loops)
    opd_share = sum(map(repeats_itself, opd.values())) / len(opd)
    sft_share = sum(map(repeats_itself, sft.values())) / len(sft)
    assert opd_share > 0.6 and sft_share < 0.3


def test_evaluation_records_carry_both_guards():
    record = GSM8KTask().score("#### 7\nThe answer is: 7", {"ground_truth": "7", "answer": "#### 7"})
    assert record["answer_found"] and record["correct_strict"]
    assert record["clean_format"] is False and record["repeats"] is False


@pytest.mark.skipif(not GSM8K_TRAIN.exists(), reason="real GSM8K is not at ../shared/data")
def test_reference_solutions_are_clean_and_almost_never_flagged_as_loops():
    solutions = [json.loads(line)["answer"] for line in GSM8K_TRAIN.read_text().splitlines()]
    assert all(clean_format(s) for s in solutions)
    assert sum(map(repeats_itself, solutions)) / len(solutions) < 0.002
