"""The self-distillation study (recipes/studies/self_distill_study.py): its smoke chain end to end on a test-size model, and
its rule against known answers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

STUDY = Path(__file__).resolve().parents[1] / "recipes" / "studies" / "self_distill_study.py"
sys.path.insert(0, str(STUDY.parent))
import self_distill_study as sds  # noqa: E402


@pytest.mark.slow
def test_smoke_chain_writes_the_choice_tables_and_state_records(tmp_path, student_path):
    out = tmp_path / "sd"
    command = [sys.executable, str(STUDY), "--smoke", "--model_name_or_path", str(student_path), "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    advantage = json.loads((out / "teacher_advantage.json").read_text())
    assert advantage["num_problems"] == 3 and advantage["teacher"]["loss_per_token"] > 0
    chosen = json.loads((out / "chosen.json").read_text())
    assert set(chosen) == {"base_dev", "margin", *sds.SMOKE_METHODS}
    assert all(chosen[m]["steps"] in (1, 2) for m in sds.SMOKE_METHODS)
    summary = json.loads((out / "summary.json").read_text())
    records = {m: row for m, row in summary["methods"].items()}
    # SFT supervised dataset states; continuation the learner's own prefixes, then the self teacher's tokens
    assert records["sft"]["source_frac/dataset"]["mean"] == 1.0
    assert records["sd_continuation"]["source_frac/learner"]["mean"] > 0
    assert records["sd_continuation"]["source_frac/teacher"]["mean"] > 0
    assert "teacher_kl" in records["sd_continuation"] and "teacher_kl" not in records["sft"]
    assert all("base_kl" in row and "offpolicy_gap" in row for row in records.values())
    pairs = {(c["run"], c["reference"], c["task"]) for c in summary["comparisons"]}
    assert ("sd_continuation", "sft", "retention tasks") in pairs and ("sft", "base", "gsm8k") in pairs
    text = (out / "summary.md").read_text()
    assert "| sd_continuation - sft | retention tasks |" in text and "Teacher's advantage" in text
    assert (out / "self_distill.png").stat().st_size > 0
    # a second invocation runs nothing again
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "done in" not in again.stdout


def test_rule_picks_the_cheapest_setting_within_the_margin(tmp_path):
    def write_dev(method, lr, scores):
        folder = sds.dev_folder(tmp_path, method, lr)
        folder.mkdir(parents=True)
        history = [{"step": step, "eval/gsm8k/accuracy_strict": score} for step, score in scores.items()]
        (folder / "log_history.json").write_text(json.dumps(history))

    methods = {"m": ("self_distill", "self_distill.yaml", ["3e-4", "1e-3"], [3, 6, 9, 12], [])}
    write_dev("m", "3e-4", {3: 0.30, 6: 0.30, 9: 0.33, 12: 0.36})  # smoothed 0.30, 0.31, 0.33, 0.345
    write_dev("m", "1e-3", {3: 0.20, 6: 0.40, 9: 0.40, 12: 0.40})  # smoothed 0.30, 0.333, 0.40, 0.40
    chosen = sds.choose(tmp_path, base_dev=0.30, methods=methods)["m"]
    # best smoothed 0.40 (1e-3 from step 9): the fewest steps at >= 0.37 is 9 at 1e-3
    assert (chosen["learning_rate"], chosen["steps"]) == ("1e-3", 9) and chosen["best_smoothed"] == pytest.approx(0.4)
    assert chosen["moves"]
    assert not sds.choose(tmp_path, base_dev=0.39, methods=methods)["m"]["moves"]  # 0.40 < 0.39 + 0.03
    # a dev run that stopped early is refused, not read as having fewer candidates
    write_dev("short", "3e-4", {3: 0.30, 6: 0.30})
    with pytest.raises(ValueError, match=r"no dev score at steps \[9, 12\]"):
        sds.choose(tmp_path, base_dev=0.30, methods={"short": (*methods["m"][:2], ["3e-4"], [3, 6, 9, 12], [])})
