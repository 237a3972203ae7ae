"""recipes/studies/cross_tokenizer_lab.py (issue 45's lab experiment) end to end on test-size models: a tiny teacher of
the second lab tokenizer, two steps per arm."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

SCRIPT = Path(__file__).resolve().parents[1] / "recipes" / "studies" / "cross_tokenizer_lab.py"


@pytest.mark.slow
def test_smoke_runs_both_arms_and_the_cross_arm_reads_another_tokenizer(tmp_path, student_path, math_teacher_path):
    out = tmp_path / "xt"
    command = [sys.executable, str(SCRIPT), "--smoke", "--seeds", "0", "--model_name_or_path", str(student_path),
               "--same_teacher", str(math_teacher_path), "--out", str(out)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    other = AutoTokenizer.from_pretrained(out / "other" / "teacher")
    student = AutoTokenizer.from_pretrained(student_path)
    # the second lab tokenizer keeps digit runs whole where the student's splits them
    assert len(student.tokenize("1234")) == 4 and len(other.tokenize("1234")) < 4
    # the post-hoc arm's teacher reads the student's ids
    assert AutoTokenizer.from_pretrained(out / "independent" / "teacher").get_vocab() == student.get_vocab()
    for arm in ("same", "cross", "independent"):
        results = json.loads((out / "seed0" / arm / "results.json").read_text())
        assert results["global_steps"] == 2
        assert summary["scores"][arm]["gsm8k"]["values"] == [results["after"]["scores"]["gsm8k"]]
    # only the cross arm went through the alignment, and its exact share is a share
    (same_exact,), (cross_exact,) = (
        summary["runs"]["same"]["alignment_exact"],
        summary["runs"]["cross"]["alignment_exact"],
    )
    assert same_exact is None and 0.0 <= cross_exact <= 1.0
    assert summary["teachers"]["cross"] == str(out / "other" / "teacher")
    labels = {(c["run"], c["reference"]) for c in summary["comparisons"]}
    assert labels == {("cross", "same"), ("same", "base"), ("cross", "base"), ("cross", "independent"),
                      ("independent", "base")}  # fmt: skip
    assert summary["runs"]["independent"]["alignment_exact"] == [None]
    assert "teacher_cross" in (out / "summary.md").read_text()


def test_number_signal_sums_each_numbers_log_ratio_over_its_digits(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    from cross_tokenizer_lab import number_signal

    ledger = tmp_path / "statelens"
    ledger.mkdir()
    samples = [
        {"step": 1, "tokens": [" ", "1", "3", " apples", " ", "5", "."], "logp": [-0.1, -1.0, -0.5, -0.2, -0.1, -2.0, 0.0],
         "teacher_logp": [-0.1, -0.25, -0.25, -0.3, None, -3.0, 0.0]},
        {"step": 2, "tokens": ["7", "<eos>"], "logp": [-1.0, 0.0], "teacher_logp": [-2.0, 0.0]},
        {"step": 9, "tokens": ["4", "2"], "logp": [-1.0, -1.0], "teacher_logp": [0.0, 0.0]},  # outside the window
    ]  # fmt: skip
    (ledger / "states.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    counted = number_signal(tmp_path, 1, 2)
    assert counted["several_digits"] == {"numbers": 1, "mean_log_ratio": pytest.approx(1.0)}  # 13: -0.5 - (-1.5)
    assert counted["one_digit"] == {"numbers": 2, "mean_log_ratio": pytest.approx(-1.0)}  # 5: -1.0; 7: -1.0


@pytest.mark.parametrize("amendment", ["0707", "div", "divfix", "inner"])
def test_the_amendments_committed_items_recompute_their_comparisons(amendment):
    """docs/study/cross-tokenizer-lab/0707/ (amendment 4), div/, divfix/ and inner/ (amendments 5 to 7): the paired
    comparisons in each summary (and STUDY.md) recompute from the committed per-item scores alone, intervals included;
    the comparisons of amendments 5 to 7 with each seed's start read the start's items, packed under "start"."""
    sys.path.insert(0, str(SCRIPT.parent))
    from cross_tokenizer_lab import COMPARISONS, FROM_START
    from study_lab import SCORES, compare_runs

    records = SCRIPT.parents[2] / "docs" / "study" / "cross-tokenizer-lab" / amendment
    packed = json.loads((records / "items.json").read_text())

    def scores_of(name, seed):
        entry = packed["base"] if name == "base" else packed["runs"][name][str(seed)]
        return {task: dict(zip(packed["questions"][task], entry["items"][task])) for task in SCORES}

    comparisons = COMPARISONS + (FROM_START if amendment != "0707" else [])
    recomputed = compare_runs(scores_of, packed["seeds"], comparisons)
    committed = json.loads((records / "summary.json").read_text())["comparisons"]
    assert len(recomputed) == len(committed) == 3 * len(comparisons)
    for ours, theirs in zip(recomputed, committed, strict=True):
        assert (ours["run"], ours["reference"], ours["task"]) == (theirs["run"], theirs["reference"], theirs["task"])
        assert ours["per_seed"] == pytest.approx(theirs["per_seed"], abs=1e-12)
        assert ours["ci95"] == pytest.approx(theirs["ci95"], abs=1e-12)
