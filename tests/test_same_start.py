"""The same-start study's result is computed from its records alone, and `check` recomputes it
(recipes/studies/same_start.py)."""

import json
import sys
from pathlib import Path

import pytest

STUDIES = Path(__file__).resolve().parents[1] / "recipes" / "studies"
COMMITTED = Path(__file__).resolve().parents[1] / "docs" / "study" / "same-start"
sys.path.insert(0, str(STUDIES))
import same_start  # noqa: E402

PROBLEMS = 10


def items(right: int) -> dict[str, float]:
    return {f"q{i}": float(i < right) for i in range(PROBLEMS)}


def flops(total: float) -> dict[str, float]:
    # split over the parts as a run's ledger splits it: the ratio reads their sum
    return {"student_generation": 0.2 * total, "student_training": 0.6 * total, "teacher_scoring": 0.2 * total,
            "teacher_writing": 0.0}  # fmt: skip


def run(curve: dict[int, tuple[int, float]], final: int = 5) -> dict:
    """A run's records: at each step, (problems right, FLOPs so far)."""
    last = max(curve) if curve else None
    return {
        "final": {"gsm8k": items(final), "truthfulqa": items(final), "mmlu": items(final)},
        "flops": flops(curve[last][1] if curve else 1e12),
        "during": {str(step): {"items": items(right), "flops": flops(f)} for step, (right, f) in curve.items()},
    }


@pytest.fixture
def records(monkeypatch):
    """GRPO scores 2, 4, 6 of 10 at 1, 2, 3 TFLOPs (smoothed 0.3, 0.4, 0.5: its best 0.5 at 3e12); the lab-teacher
    arm 4, 6, 8 at 0.5, 1, 1.5 TFLOPs (smoothed 0.5, 0.6, 0.7: reaches 0.5 at 0.5e12); the shuffled arm stays at 1."""
    grpo = {25: (2, 1e12), 50: (4, 2e12), 75: (6, 3e12)}
    lab = {15: (4, 0.5e12), 30: (6, 1e12), 45: (8, 1.5e12)}
    flat = {15: (1, 0.5e12), 30: (1, 1e12), 45: (1, 1.5e12)}
    runs = {"mild_sft": {}, "grpo": {}, "grpo100": {}, "opd_lab_teacher": {}, "opd_rl_teacher": {},
            "opd_shuffled_teacher": {}}  # fmt: skip
    monkeypatch.setattr(same_start, "BOOTSTRAP_SAMPLES", 200)  # (the committed records are checked at 2000 below)
    for seed in ("0", "1"):
        runs["mild_sft"][seed] = run({}, final=3)
        runs["grpo"][seed] = run({25: grpo[25]}, final=4)
        runs["grpo100"][seed] = run(grpo, final=6)
        runs["opd_lab_teacher"][seed] = run(lab, final=8)
        runs["opd_rl_teacher"][seed] = run(lab, final=7)
        runs["opd_shuffled_teacher"][seed] = run(flat, final=1)
    base = {"gsm8k": items(2), "truthfulqa": items(5), "mmlu": items(5)}
    return {"seeds": [0, 1], "base": base, "runs": runs, "lab_teacher": {"info": {"steps": 1}, "making_flops": 7e12}}


def test_ratio_reads_the_curves_with_and_without_the_warm_start(records):
    result = same_start.analyse(records)
    excluded = result["ratios"]["opd_lab_teacher"]["warm_start_excluded"]
    assert excluded["grpo_best"] == pytest.approx(0.5) and excluded["grpo_step"] == 75
    assert excluded["opd_step"] == 15 and excluded["ratio"] == pytest.approx(0.5e12 / 3e12)
    included = result["ratios"]["opd_lab_teacher"]["warm_start_included"]  # the mild SFT's 1e12 added to both
    assert included["ratio"] == pytest.approx(1.5e12 / 4e12)
    shuffled = result["ratios"]["opd_shuffled_teacher"]["warm_start_excluded"]
    assert shuffled["ratio"] is None and shuffled["resamples_never_reached"] > 0.9 * 200
    assert shuffled["ci95"][1] == float("inf")
    compute = result["compute"]["opd_lab_teacher"]
    assert compute["student"] == pytest.approx(0.8 * 1.5e12) and compute["teacher"] == pytest.approx(0.2 * 1.5e12)
    assert compute["warm_start"] == pytest.approx(1e12) and compute["teacher_making"] == 7e12
    assert result["compute"]["opd_rl_teacher"]["teacher_making"] == pytest.approx(3e12)  # grpo100's own steps
    against_grpo = next(c for c in result["comparisons"] if c["run"] == "opd_lab_teacher" and c["reference"] == "grpo")
    assert against_grpo["task"] == "gsm8k" and against_grpo["mean"] == pytest.approx(0.4)


def test_check_recomputes_and_names_a_changed_number(tmp_path, records):
    (tmp_path / "items.json").write_text(json.dumps(same_start.packed(records)))
    assert same_start.unpacked(same_start.packed(records)) == records
    (tmp_path / "result.json").write_text(json.dumps(same_start.analyse(records)))
    same_start.check_phase(tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    result["ratios"]["opd_lab_teacher"]["warm_start_excluded"]["ratio"] = 0.2
    (tmp_path / "result.json").write_text(json.dumps(result))
    with pytest.raises(SystemExit, match="ratios/opd_lab_teacher/warm_start_excluded/ratio"):
        same_start.check_phase(tmp_path)


@pytest.mark.skipif(not (COMMITTED / "items.json").exists(), reason="the study's records are not committed yet")
def test_committed_result_recomputes():
    same_start.check_phase(COMMITTED)
