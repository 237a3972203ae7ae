"""The real-model study's dev rule (recipes/studies/real_opd_study.py), on dev curves written by hand."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "recipes" / "studies"))
import real_opd_study as study  # noqa: E402


def write_curve(out: Path, name: str, scores: dict[int, float]) -> None:
    run = out / "dev" / name
    run.mkdir(parents=True)
    history = [{"step": s, study.DEV_METRIC: v} for s, v in scores.items()] + [{"step": 40, "loss": 0.1}]
    (run / "log_history.json").write_text(json.dumps(history))


def test_the_rule_takes_the_fewest_steps_within_the_margin_of_the_best_smoothed_score(tmp_path):
    write_curve(tmp_path, "C1", {10: 0.20, 20: 0.50, 30: 0.60, 40: 0.62})
    write_curve(tmp_path, "C2", {10: 0.30, 20: 0.58, 30: 0.66, 40: 0.70})
    chosen = study.choose(tmp_path, base=0.125, steps=[10, 20, 30, 40])
    # smoothed: C1 0.35 0.433 0.573 0.61; C2 0.44 0.513 0.647 0.68 -> best 0.68, within 0.05: C2 at 30 (0.647)
    assert chosen["best_smoothed"] == pytest.approx(0.68)
    assert (chosen["candidate"], chosen["steps"]) == ("C2", 30)
    assert chosen["dev"] == pytest.approx(0.66) and chosen["moves"]
    assert study.choose(tmp_path, base=0.60, steps=[10, 20, 30, 40])["moves"] is False  # 0.68 < 0.60 + 0.10


def test_a_candidate_without_a_score_at_a_step_stops_the_rule(tmp_path):
    write_curve(tmp_path, "C1", {10: 0.2, 20: 0.3, 30: 0.3, 40: 0.3})
    write_curve(tmp_path, "C2", {10: 0.2, 20: 0.3, 40: 0.3})
    with pytest.raises(ValueError, match=r"no dev score at steps \[30\]"):
        study.choose(tmp_path, base=0.1, steps=[10, 20, 30, 40])
