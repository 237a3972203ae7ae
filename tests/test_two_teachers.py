"""recipes/studies/two_teachers.py (issue 27's lab demonstration) end to end on test-size models: two tiny steps per arm."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "recipes" / "studies" / "two_teachers.py"
sys.path.insert(0, str(SCRIPT.parent))
import two_teachers as tt  # noqa: E402


@pytest.mark.slow
def test_smoke_runs_every_arm_and_summarizes_per_teacher(tmp_path, student_path, math_teacher_path, world):
    out = tmp_path / "tt"
    command = [sys.executable, str(SCRIPT), "--smoke", "--seeds", "0", "--model_name_or_path", str(student_path),
               "--math_teacher", str(math_teacher_path), "--out", str(out)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    # the kb teacher was fine-tuned from the student, and routed as each arm says
    assert summary["teachers"] == {"math": str(math_teacher_path), "kb": str(out / "kb-teacher")}
    for arm, route in tt.ARMS.items():
        run_dir = out / "seed0" / arm
        results = json.loads((run_dir / "results.json").read_text())
        assert json.loads(results["teacher"]) == {task: summary["teachers"][t] for task, t in route.items()}
        # the summary's scores are the run's own
        for task in tt.SCORES:
            assert summary["scores"][arm][task]["values"] == [results["after"]["scores"][task]]
        assert 0.0 <= summary["scores"][arm]["kb_dev"]["mean"] <= 1.0
        # per-route metrics: every route logged every step, and its supervised tokens add up to the ledger's
        (metrics,) = summary["routes"][arm]
        history = json.loads((run_dir / "log_history.json").read_text())
        steps = [entry for entry in history if "statelens/supervised_tokens/math" in entry]
        assert len(steps) == results["global_steps"] == 2
        assert all(metrics[route]["teacher_kl_first"] is not None for route in tt.ROUTES)
        total = sum(metrics[route]["supervised_tokens"] for route in tt.ROUTES)
        assert total == pytest.approx(metrics["ledger_supervised_tokens"]) and total > 0
        states = [json.loads(line) for line in (run_dir / "statelens" / "states.jsonl").read_text().splitlines()]
        assert sum(metrics[route]["ledger_sequences"] for route in tt.ROUTES) == len(states) > 0
    # step 1 is the same weights and rollouts in every arm: a route's teacher_kl there is its teacher's, whatever arm
    step1 = {
        arm: next(e for e in json.loads((out / "seed0" / arm / "log_history.json").read_text()) if e["step"] == 1)
        for arm in tt.ARMS
    }
    math_kl, kb_kl = "teacher_kl/sampled/math", "teacher_kl/sampled/kb"
    assert step1["two_teachers"][math_kl] == pytest.approx(step1["math_teacher"][math_kl])
    assert step1["two_teachers"][math_kl] != pytest.approx(step1["kb_teacher"][math_kl])  # the routing matters
    if kb_kl in step1["two_teachers"]:  # (when step 1 drew a kb row)
        assert step1["two_teachers"][kb_kl] == pytest.approx(step1["kb_teacher"][kb_kl])
    # each routed prompt is its task's: kb rows are kb dev questions, never a test one
    kb_dev = {f"Question: {r['question']}\nAnswer:" for r in world.kb("dev")}
    kb_test = {f"Question: {r['question']}\nAnswer:" for r in world.kb("test")}
    rows = tt.mixed_prompts(40, seed=0, lab_seed=0)
    kb_rows = [row["prompt"] for row in rows if row["teacher_id"] == "kb"]
    assert len(kb_rows) == 10 and set(kb_rows) <= kb_dev and not set(kb_rows) & kb_test
    # paired comparisons: per seed, the two runs' difference on the same items, inside its interval
    two, math = (
        json.loads((out / "seed0" / arm / "results.json").read_text()) for arm in ("two_teachers", "math_teacher")
    )
    comparison = next(c for c in summary["comparisons"] if c["reference"] == "math_teacher" and c["task"] == "mmlu")
    assert comparison["per_seed"] == pytest.approx([two["after"]["scores"]["mmlu"] - math["after"]["scores"]["mmlu"]])
    low, high = comparison["ci95"]
    assert low <= comparison["mean"] <= high
    text = (out / "summary.md").read_text()
    assert "| two_teachers | kb | kb |" in text and "| math_teacher | kb | math |" in text
    assert (out / "seed0" / "report" / "report.md").exists()
