"""The dev rule of the study where SmolLM2-135M-Instruct teaches Gemma 3 270M base
(recipes/studies/cross_family_student.py), on dev curves written by hand."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "recipes" / "studies"))
import cross_family_student as study  # noqa: E402


def write_curves(out: Path, curves: dict[str, dict[int, tuple[float, float]]]) -> dict[str, Path]:
    """Each run's `log_history.json`: (clean share, repeat share) at each scored step."""
    runs = {}
    for name, points in curves.items():
        run = runs[name] = out / name
        run.mkdir()
        history = [{"step": s, "eval/gsm8k/clean_format": c, "eval/gsm8k/repeats": r} for s, (c, r) in points.items()]
        (run / "log_history.json").write_text(json.dumps(history + [{"step": 20, "loss": 0.1}]))
    return runs


def test_the_rule_takes_the_fewest_steps_within_the_margin_among_those_the_guard_passes(tmp_path):
    runs = write_curves(tmp_path, {"2e-4": {10: (0.10, 0.30), 20: (0.30, 0.30)},
                                   "6e-4": {10: (0.40, 0.60), 20: (0.50, 0.30)}})  # fmt: skip
    chosen = study.choose(runs, {"clean_format": 0.0, "repeats": 0.30}, [10, 20])
    # 6e-4 at 10 fails the guard (0.60 > 0.30 + 0.05); smoothed: 2e-4 0.10, 0.20; 6e-4 at 20 0.45 -> the best
    assert chosen["best_smoothed"] == pytest.approx(0.45)
    assert (chosen["candidate"], chosen["steps"], chosen["moves"]) == ("6e-4", 20, True)
    assert [row["guard"] for row in chosen["candidates"]] == [True, True, False, True]


def test_nothing_moving_still_chooses_the_fewest_steps_and_the_smaller_rate(tmp_path):
    runs = write_curves(
        tmp_path, {"2e-4": {10: (0.0, 0.94), 20: (0.0, 1.0)}, "6e-4": {10: (0.0, 0.97), 20: (0.0, 0.97)}}
    )
    chosen = study.choose(runs, {"clean_format": 0.0, "repeats": 0.969}, [10, 20])
    assert (chosen["candidate"], chosen["steps"], chosen["moves"], chosen["guard_failed"]) == (
        "2e-4",
        10,
        False,
        False,
    )


def test_none_passing_the_guard_falls_back_to_the_smaller_rate_at_the_last_step(tmp_path):
    runs = write_curves(tmp_path, {"2e-4": {10: (0.5, 0.9), 20: (0.6, 0.9)}, "6e-4": {10: (0.7, 0.9), 20: (0.8, 0.9)}})
    chosen = study.choose(runs, {"clean_format": 0.0, "repeats": 0.5}, [10, 20])
    assert (chosen["candidate"], chosen["steps"], chosen["moves"], chosen["guard_failed"]) == ("2e-4", 20, False, True)


def test_a_run_without_a_scored_step_is_refused(tmp_path):
    runs = write_curves(tmp_path, {"2e-4": {10: (0.0, 0.9)}, "6e-4": {10: (0.0, 0.9), 20: (0.0, 0.9)}})
    with pytest.raises(ValueError, match=r"has no dev score at steps \[20\]"):
        study.choose(runs, {"clean_format": 0.0, "repeats": 0.9}, [10, 20])
