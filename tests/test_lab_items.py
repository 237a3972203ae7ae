"""The lab's committed item scores recompute every Table 2 number (recipes/studies/lab_items.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

STUDIES = Path(__file__).resolve().parents[1] / "recipes" / "studies"
COMMITTED = Path(__file__).resolve().parents[1] / "docs" / "study" / "items" / "table2.json"
sys.path.insert(0, str(STUDIES))
import lab_items  # noqa: E402
import study_lab  # noqa: E402

COMPARISONS = [("helps", "trained", "base"), ("against its start", "trained", "start")]


def write_run(folder: Path, math: list[int], truth: list[int], kb: list[int], mmd: float | None) -> None:
    (folder / "eval").mkdir(parents=True)
    lines = [{"task": "gsm8k", "question": f"q{i}", "correct_strict": bool(c)} for i, c in enumerate(math)]
    lines += [{"task": "truthfulqa", "question": f"t{i}", "mc1": float(c)} for i, c in enumerate(truth)]
    lines += [{"task": "mmlu", "question": f"k{i}", "correct": bool(c)} for i, c in enumerate(kb)]
    (folder / "eval" / "after.items.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    scores = {"gsm8k": sum(math) / len(math), "truthfulqa": sum(truth) / len(truth), "mmlu": sum(kb) / len(kb)}
    drift = None if mmd is None else {"mmd": mmd}
    (folder / "results.json").write_text(json.dumps({"after": {"scores": scores}, "final_drift": drift}))


@pytest.fixture
def study(tmp_path, monkeypatch):
    """A two-seed study folder, its summary as `study_lab.py` writes it, and a STUDY.md holding its comparison rows."""
    monkeypatch.setattr(lab_items, "COMPARISONS", COMPARISONS)
    out = tmp_path / "study"
    write_run(out / "base", [0] * 20, [1, 1, 0, 0], [1, 0, 1, 0, 1], None)
    for seed in (0, 1):
        write_run(
            out / f"seed{seed}" / "start", [1] * (2 + seed) + [0] * (18 - seed), [1, 0, 0, 0], [1, 0, 1, 0, 0], 0.01
        )
        write_run(out / f"seed{seed}" / "trained", [1] * (6 + seed) + [0] * (14 - seed), [1, 1, 1, 0], [0, 1, 1, 0, 1], 0.02)  # fmt: skip
    names, seeds, scores_of = ["start", "trained"], [0, 1], study_lab.folder_item_scores(out)
    summary = {
        "seeds": seeds,
        "runs": study_lab.summarize(lambda name, seed: study_lab.run_outcome(out, name, seed), seeds, names),
        "comparisons": study_lab.compare_runs(scores_of, seeds, COMPARISONS),
        "flips": study_lab.retention_flips(scores_of, seeds, names),
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "STUDY.md").write_text("# Study\n\n" + study_lab.comparison_table(summary["comparisons"], seeds))
    packed = lab_items.pack(out, seeds, names)
    return tmp_path, packed, summary


def test_a_packed_study_recomputes_its_summary_and_its_rows(study):
    tmp_path, packed, summary = study
    assert packed["questions"]["gsm8k"][0] == lab_items.question_key(0, "q0")  # questions by hash, not their text
    text = (tmp_path / "STUDY.md").read_text()
    recomputed = lab_items.recompute(json.loads(json.dumps(packed)))  # as read back from the file
    assert lab_items.differences(recomputed, summary, text, packed["seeds"]) == []
    assert recomputed["comparisons"][0]["per_seed"] == pytest.approx([0.30, 0.35])


def test_a_number_that_differs_is_named(study):
    tmp_path, packed, summary = study
    text = (tmp_path / "STUDY.md").read_text()
    recomputed = lab_items.recompute(packed)
    first = summary["comparisons"][0]
    row = next(line for line in text.splitlines() if f"({first['run']} - {first['reference']}) | gsm8k" in line)
    edited = text.replace(row, row.replace(f"{first['mean']:+.3f}", "+0.999"))
    assert any(
        "STUDY.md lacks the row" in d and "| gsm8k |" in d
        for d in lab_items.differences(recomputed, summary, edited, [0, 1])
    )
    summary["runs"]["trained"]["mmlu"]["values"][1] += 0.2  # a committed Table 2 cell that the items do not give
    assert any(d.startswith("Table 2 trained mmlu") for d in lab_items.differences(recomputed, summary, text, [0, 1]))
    packed["runs"]["trained"]["1"]["items"]["gsm8k"][10] = 1.0  # an item score changed: its comparison moves
    moved = lab_items.differences(lab_items.recompute(packed), summary, text, [0, 1])
    assert any(d.startswith("comparison trained - base (gsm8k)") for d in moved)


@pytest.mark.skipif(not COMMITTED.exists(), reason="no committed lab items")
def test_the_committed_lab_items_recompute_table_2():
    """`make check-lab` on the committed file: every Table 2 number of docs/study/summary.json and every comparison
    row of STUDY.md."""
    result = subprocess.run([sys.executable, str(STUDIES / "lab_items.py"), "check", str(COMMITTED)],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
