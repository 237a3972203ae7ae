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


def test_passing_a_degraded_teacher_is_judged_on_the_students_own_scores_against_the_teachers(tmp_path):
    steps = [0, 25, 50, 75, 100, 125, 150]
    # with the base's 0.28 in the smoothing, step 25 would read (0.28 + 0.22 + 0.22) / 3 = 0.24, a pass by the margin
    copies = dict(zip(steps, [0.28, 0.22, 0.22, 0.21, 0.21, 0.22, 0.21]))
    passes = dict(zip(steps, [0.28, 0.20, 0.22, 0.25, 0.27, 0.26, 0.26]))  # best: (0.27 + 0.26 + 0.26) / 3 at 125
    write_arm(tmp_path, "copies", copies, tokens_per_step=1000, flops_per_step=1e10)
    write_arm(tmp_path, "passes", passes, tokens_per_step=1000, flops_per_step=2e10)
    for arm in ("copies", "passes"):
        (tmp_path / arm / "eval").mkdir()
        teacher = {"metrics": {"gsm8k": {"accuracy_strict": 0.21}}}
        (tmp_path / arm / "eval" / "teacher.json").write_text(json.dumps(teacher))
    only_copies = diagnosis.choose(tmp_path, ["copies"], 0.03, against_teacher=True)
    assert only_copies["teacher"] == 0.21 and only_copies["best"] == pytest.approx(0.22)
    assert not only_copies["moves_target"]
    both = diagnosis.choose(tmp_path, ["copies", "passes"], 0.03, against_teacher=True)
    assert both["moves_target"] and both["best"] == pytest.approx((0.27 + 0.26 + 0.26) / 3)
    # the cheapest (arm, step) within 0.03 of the best (0.233): `copies` at 25 steps costs 2.5e11 but smooths to 0.22;
    # `passes` at 50 steps to 0.223, at 75 to (0.22 + 0.25 + 0.27) / 3 = 0.247
    assert (both["chosen"]["arm"], both["chosen"]["step"]) == ("passes", 75)


def test_each_wrong_answer_is_read_as_a_copy_or_an_arithmetic_mistake(tmp_path):
    question = "Ivan has 7 eggs. Ivan doubles the pile. Then Ivan buys 18 more. How many eggs does Ivan have now?"
    outputs = {
        "right": ("Ivan has 7 * 2 = 14.\nThen 14 + 18 = 32.\n#### 32", True),
        "arithmetic": ("Ivan has 7 * 2 = 14.\nThen 14 + 18 = 30.\n#### 30", False),  # operands fine, sum wrong
        "copy": ("Ivan has 7 * 2 = 14.\nThen 14 + 15 = 29.\n#### 29", False),  # 15 is not in the problem
        "both": ("Ivan has 7 * 2 = 14.\nThen 14 + 15 = 31.\n#### 31", False),
        "other": ("Ivan has many eggs.\n#### 5", False),
    }
    rows = [{"task": "gsm8k", "question": question, "output": out, "correct_strict": right}
            for out, right in outputs.values()]  # fmt: skip
    rows.append({"task": "truthfulqa", "question": "q", "output": "1 + 1 = 3", "correct_strict": False})  # not math
    items = tmp_path / "after.items.jsonl"
    items.write_text("\n".join(json.dumps(row) for row in rows))
    assert diagnosis.error_profile(items) == {kind: 1 for kind in outputs}
