"""GSM8K loading and final-answer extraction."""

import importlib.util
import json
from pathlib import Path

import pytest

from trl_statelens.answers import answers_match, extract_answer, normalize_number
from trl_statelens.data import load_gsm8k, read_data_file, seeded_subset
from trl_statelens.lab import LabWorld, format_plain

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

ROWS = [
    {"question": "Tom has 3 apples and buys 2 more. How many?", "answer": "3 + 2 = <<3+2=5>>5\n#### 5"},
    {"question": "A box holds 1,000 pens; 250 are sold. How many remain?", "answer": "1000-250=750\n#### 750"},
    {"question": "It is 4 degrees and drops 10. What is it now?", "answer": "4 - 10 = -6\n#### -6"},
    {"question": "Ann earns $1,200 a week. How much in 2 weeks?", "answer": "1200*2=2400\n#### 2,400"},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----- answer extraction ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("1,234", "1234"),
        ("$1,234", "1234"),
        ("5.00", "5"),
        ("5.0", "5"),
        ("2.50", "2.5"),
        ("18.", "18"),
        ("-7", "-7"),
        ("\u22127", "-7"),
        ("$-3", "-3"),
        ("-0", "0"),
        ("+4", "4"),
        ("50%", "50"),
        (".5", "0.5"),
        ("  42 ", "42"),
        ("twelve", None),
        ("", None),
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    "text, strict, flexible",
    [
        ("She has 3 + 4 = 7.\n#### 7", "7", "7"),
        ("#### 1,200", "1200", "1200"),
        ("####1200", "1200", "1200"),
        ("#### $18.00", "18", "18"),
        ("#### -5\n\nQuestion: Next one has 99 cats", "-5", "99"),
        ("The answer is 72.", None, "72"),
        ("It costs $2.50 per pound, so $12.50 in total.", None, "12.5"),
        ("#### 8 and then 9", "8", "9"),
        ("first #### 3 then #### 4", "3", "4"),
        ("1,2,3", None, "3"),
        ("no numbers here", None, None),
        ("#### x", None, None),
    ],
)
def test_extract_answer_modes(text, strict, flexible):
    assert extract_answer(text, "strict") == strict
    assert extract_answer(text, "flexible") == flexible


def test_extract_answer_rejects_unknown_mode():
    with pytest.raises(ValueError, match="unknown extraction mode"):
        extract_answer("#### 3", "loose")


def test_answers_match_normalises_both_sides():
    assert answers_match("1,200", "1200")
    assert answers_match("5.00", "5")
    assert not answers_match("5.5", "5")
    assert not answers_match(None, "5")


def test_math_verify_is_optional():
    if importlib.util.find_spec("math_verify") is None:
        with pytest.raises(ImportError, match=r"trl-statelens\[math\]"):
            answers_match("1/2", "0.5", use_math_verify=True)
    else:
        assert answers_match("1/2", "0.5", use_math_verify=True)
    assert answers_match("7", "7.0", use_math_verify=True)  # equal after normalisation: math-verify not needed


def test_gold_answers_of_all_real_gsm8k_rows():
    """Acceptance: extracting every real gold answer gives the number after '####' (8792 rows)."""
    files = [SHARED_DATA / "gsm8k" / "train.jsonl", SHARED_DATA / "gsm8k" / "test.jsonl"]
    if not all(f.is_file() for f in files):
        pytest.skip("real GSM8K files not present in ../shared/data/gsm8k")
    rows = [row for f in files for row in read_data_file(f)]
    assert len(rows) == 8792
    wrong = []
    for row in rows:
        after_marks = row["answer"].split("####")[-1].strip().replace(",", "")
        if (
            extract_answer(row["answer"], "strict") != after_marks
            or extract_answer(row["answer"], "flexible") != after_marks
        ):
            wrong.append(row["answer"][-40:])
    assert wrong == []


# ----- load_gsm8k -------------------------------------------------------------------------------------------------
def test_plain_format_matches_lab_format(tmp_path):
    data = load_gsm8k(write_jsonl(tmp_path / "test.jsonl", ROWS), "test")
    assert data.column_names == [
        "prompt", "completion", "question", "answer", "ground_truth", "solution_steps", "privileged_context"
    ]  # fmt: skip
    for row, source in zip(data, ROWS):
        assert row["privileged_context"] == source["answer"]  # a self teacher's context: the reference solution
        assert row["prompt"] == format_plain(source["question"])
        assert row["completion"].startswith(" ")
        assert row["prompt"] + row["completion"] == format_plain(source["question"], source["answer"])
    assert data["ground_truth"] == ["5", "750", "-6", "2400"]
    assert data["solution_steps"] == [1, 1, 1, 1]


def test_chat_format_is_conversational(tmp_path):
    data = load_gsm8k(write_jsonl(tmp_path / "test.jsonl", ROWS), "test", prompt_format="chat")
    assert data[0]["prompt"] == [{"role": "user", "content": ROWS[0]["question"]}]
    assert data[0]["completion"] == [{"role": "assistant", "content": ROWS[0]["answer"]}]


def test_k_shot_exemplars_come_from_train_and_never_the_row_itself(tmp_path):
    folder = tmp_path / "gsm8k"
    write_jsonl(folder / "train.jsonl", ROWS)
    write_jsonl(folder / "test.jsonl", [{"question": "Q? 1 + 1", "answer": "#### 2"}])
    test_row = load_gsm8k(folder, "test", num_shots=2)[0]
    blocks = test_row["prompt"].split("\n\n")
    assert len(blocks) == 3 and blocks[-1] == format_plain("Q? 1 + 1")
    assert all(b.startswith("Question: ") and "\nAnswer: " in b for b in blocks[:2])
    for row in load_gsm8k(folder, "train", num_shots=3):  # train prompts: 3 shots, none of them the row
        blocks = row["prompt"].split("\n\n")
        assert len(blocks) == 4
        assert all(row["question"] not in b for b in blocks[:3])
    chat = load_gsm8k(folder, "test", num_shots=2, prompt_format="chat")[0]["prompt"]
    assert [m["role"] for m in chat] == ["user", "assistant", "user", "assistant", "user"]


def test_context_shots_give_a_self_teacher_solved_problems_instead_of_the_solution(tmp_path):
    folder = tmp_path / "gsm8k"
    write_jsonl(folder / "train.jsonl", ROWS)
    rows = load_gsm8k(folder, "train", prompt_format="chat", context_shots=2)
    for row in rows:
        blocks = row["privileged_context"].split("\n\n")
        shown = [b.split("\nAnswer: ")[0].removeprefix("Question: ") for b in blocks]
        assert len(blocks) == 2 and all(b.startswith("Question: ") and "\nAnswer: " in b for b in blocks)
        assert row["question"] not in shown and row["answer"] not in row["privileged_context"]
        assert row["prompt"] == [{"role": "user", "content": row["question"]}]  # the student sees no shot
    # the same solved problems for every row whose question is not among them
    contexts = {r["privileged_context"] for r in rows}
    assert 1 <= len(contexts) <= 3
    plain = load_gsm8k(folder, "train")
    assert [r["privileged_context"] for r in plain] == [r["answer"] for r in ROWS]


def test_limit_is_a_seeded_subset_in_source_order(tmp_path):
    path = write_jsonl(tmp_path / "test.jsonl", [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(50)])
    a = load_gsm8k(path, "test", limit=10, seed=1)["question"]
    assert a == load_gsm8k(path, "test", limit=10, seed=1)["question"]
    assert a != load_gsm8k(path, "test", limit=10, seed=2)["question"]
    assert len(a) == 10 and a == sorted(a, key=lambda q: int(q[1:]))
    assert seeded_subset([1, 2, 3], None) == [1, 2, 3]


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".json"])
def test_other_file_formats(tmp_path, suffix):
    path = tmp_path / f"rows{suffix}"
    if suffix == ".csv":
        import csv

        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["question", "answer"])
            writer.writeheader()
            writer.writerows(ROWS)
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ROWS), path)
    else:
        path.write_text(json.dumps(ROWS))
    data = load_gsm8k(path, "test")
    assert data["answer"] == [r["answer"] for r in ROWS]
    assert data["ground_truth"][1] == "750"


def test_lab_source_gives_the_lab_world_rows():
    data = load_gsm8k("lab", "test", limit=None)
    world_rows = LabWorld(seed=0).math("test")
    assert len(data) == len(world_rows) == 300
    assert data[0]["question"] == world_rows[0]["question"]
    assert data[0]["prompt"] + data[0]["completion"] == format_plain(
        world_rows[0]["question"], world_rows[0]["answer"]
    )
    assert len(load_gsm8k("lab", "train", limit=5)) == 5


def test_hub_id_goes_through_load_dataset_with_main_config(monkeypatch):
    from datasets import Dataset

    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return Dataset.from_list(ROWS[:2])

    monkeypatch.setattr("datasets.load_dataset", fake_load_dataset)
    data = load_gsm8k("openai/gsm8k", "test")
    assert calls == [("openai/gsm8k", "main", "test")]
    assert data["ground_truth"] == ["5", "750"]


def test_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_gsm8k(tmp_path / "missing.jsonl", "test")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"problem": "x", "solution": "#### 1"}])
    with pytest.raises(ValueError, match=r"lack the columns \['question', 'answer'\]"):
        load_gsm8k(bad, "test")
    with pytest.raises(ValueError, match="unknown prompt_format"):
        load_gsm8k(write_jsonl(tmp_path / "ok.jsonl", ROWS), "test", prompt_format="markdown")
    (tmp_path / "empty_folder").mkdir()
    with pytest.raises(ValueError, match="no 'test' split in folder"):
        load_gsm8k(tmp_path / "empty_folder", "test")


def test_solution_steps_count_the_lines_that_compute(world):
    """The difficulty GRPO's records group by: a lab problem's operations, a real solution's computing lines."""
    from trl_statelens.data import solution_steps

    real = "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe has no more.\nShe makes 9 * 2 = $<<9*2=18>>18.\n#### 18"
    assert solution_steps(real) == 2
    rows = world.math("train", n=200)
    # the lab's answers: a starting line, then one computing line per operation (1 to 3 of them)
    assert {solution_steps(r["answer"]) for r in rows} == {1, 2, 3}
    assert all(solution_steps(r["answer"]) == len(r["answer"].splitlines()) - 2 for r in rows)
