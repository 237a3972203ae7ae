"""The teacher-budget reading of recipes/studies/opd_diagnosis.py (issue 36), on dev curves and ledgers written by
hand."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "recipes" / "studies"))
import opd_diagnosis as diagnosis  # noqa: E402


def write_arm(out: Path, arm: str, scores: dict[int, float], tokens_per_step: float, flops_per_step: float) -> None:
    """A finished arm: dev scores every 25 steps (0: the base), 150 steps of ledger, step times logged every 5 steps
    (each the mean of its 5 steps: 1 s a step here)."""
    run = out / arm
    (run / "statelens").mkdir(parents=True)
    results = {"before": {"metrics": {"gsm8k": {"accuracy_strict": scores[0]}}}, "after": {"scores": {}}}
    (run / "results.json").write_text(json.dumps(results))
    history = [{"step": s, "eval/gsm8k/accuracy_strict": v} for s, v in scores.items() if s]
    history += [{"step": s, "step_time": 1.0} for s in range(5, 151, 5)]
    (run / "log_history.json").write_text(json.dumps(history))
    lines = [{"step": s, "teacher_tokens_total": tokens_per_step * s, "flops_total/total": flops_per_step * s}
             for s in range(1, 151)]  # fmt: skip
    (run / "statelens" / "steps.jsonl").write_text("\n".join(json.dumps(line) for line in lines))


def test_each_arm_is_costed_where_its_smoothed_dev_score_first_comes_within_the_margin(tmp_path):
    steps = [0, 25, 50, 75, 100, 125, 150]
    plain = dict(zip(steps, [0.28, 0.30, 0.34, 0.36, 0.38, 0.36, 0.37]))  # smoothed at 75: (0.34+0.36+0.38)/3 = 0.36
    cheap = dict(zip(steps, [0.28, 0.30, 0.33, 0.35, 0.35, 0.37, 0.36]))  # smoothed 0.343 at 75: within 0.02
    short = dict(zip(steps, [0.28, 0.25, 0.26, 0.25, 0.27, 0.26, 0.26]))  # never
    write_arm(tmp_path, "budget_plain", plain, tokens_per_step=3000, flops_per_step=3e10)
    write_arm(tmp_path, "budget_h32", cheap, tokens_per_step=1000, flops_per_step=1.5e10)
    write_arm(tmp_path, "budget_h48", short, tokens_per_step=1500, flops_per_step=2e10)
    result = diagnosis.reach(tmp_path, ["budget_plain", "budget_h32", "budget_h48"])
    assert result["target"] == pytest.approx(0.36)
    plain_cost, cheap_cost = result["arms"]["budget_plain"]["reached"], result["arms"]["budget_h32"]["reached"]
    # plain: smoothed 0.333 at 50 (short of 0.34), 0.36 at 75
    assert plain_cost == {"step": 75, "teacher_tokens": 225_000, "flops": pytest.approx(2.25e12), "seconds": 75.0}
    assert cheap_cost["step"] == 75 and cheap_cost["teacher_tokens"] == 75_000
    assert result["arms"]["budget_h32"]["goal"] and not result["arms"]["budget_plain"]["goal"]
    assert result["arms"]["budget_h48"]["reached"] is None
    assert json.loads((tmp_path / "reach.json").read_text())["arms"]["budget_h32"]["goal"] is True
    # the plot's curve: each evaluation's smoothed score at the tokens spent so far (step 0 spent nothing)
    curve = result["arms"]["budget_h32"]["curve"]
    assert [c["teacher_tokens"] for c in curve] == [0, 25_000, 50_000, 75_000, 100_000, 125_000, 150_000]
    assert curve[3]["smoothed"] == pytest.approx((0.33 + 0.35 + 0.35) / 3)
    assert (tmp_path / "reach.png").stat().st_size > 10_000
