"""The lab study's chain (recipes/study_lab.py) end to end: one seed, two tiny steps per run, test-size models."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

STUDY = Path(__file__).resolve().parents[1] / "recipes" / "study_lab.py"


@pytest.mark.slow
def test_study_chain_runs_every_run_and_summarizes(tmp_path, student_path):
    out = tmp_path / "study"
    command = [sys.executable, str(STUDY), "--seeds", "0", "--smoke", "--model_name_or_path", str(student_path),
               "--out", str(out)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    runs = summary["runs"]
    assert set(runs) >= {"base", "mild_sft", "stress_sft", "opd_from_mild_sft", "opd_from_stress_sft", "grpo",
                         "stock_sft", "stock_opd_from_stress_sft", "stock_grpo"}  # fmt: skip
    # the summary's numbers are the runs' own results
    mild = json.loads((out / "seed0" / "mild_sft" / "results.json").read_text())
    assert runs["mild_sft"]["gsm8k"]["values"] == [mild["after"]["scores"]["gsm8k"]]
    # OPD runs learned from the same seed's SFT runs
    opd = json.loads((out / "seed0" / "opd_from_stress_sft" / "results.json").read_text())
    assert opd["teacher"] == str(out / "seed0" / "stress_sft")
    assert (out / "seed0" / "report" / "report.md").exists() and (out / "summary.md").exists()
