"""bench/gpu_check.py in its `--quick` CPU form: the tables it writes, every number in them finite and positive."""

import json
import math
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import gpu_check  # noqa: E402


@pytest.mark.slow
def test_quick_run_writes_a_row_per_arm_with_finite_positive_numbers(tmp_path):
    results = gpu_check.main([str(tmp_path), "--quick"])
    assert json.loads((tmp_path / "gpu_check.json").read_text())["table"] == results["table"]
    assert [(row["trainer"], row["arm"]) for row in results["table"]] == list(gpu_check.ARMS)
    for row in results["table"]:
        for key in ("median_step_seconds", "peak_memory_mb", "step_time_ratio", "peak_memory_ratio"):
            assert math.isfinite(row[key]) and row[key] > 0, (row, key)
        if row["arm"] == "stock":
            assert row["step_time_ratio"] == row["peak_memory_ratio"] == 1.0
    assert results["finite_losses"] is True
    assert results["launched"] == {name: {"skipped": "not in --quick runs"} for name in gpu_check.LAUNCHES}

    # The profiled arms: ops by self time and every region each trainer has, against stock
    assert set(results["profiles"]) == set(gpu_check.PROFILED)
    for profile in results["profiles"].values():
        assert set(profile) == {"CPU"}  # and "CUDA" on a GPU
        assert set(profile["CPU"]["regions_ms"]) == set(gpu_check.REGIONS)
        assert all(ms > 0 for ms in profile["CPU"]["regions_ms"].values())
        assert profile["CPU"]["ops_ms"] and all(ms > 0 for ms in profile["CPU"]["ops_ms"].values())

    table = (tmp_path / "gpu_check.md").read_text()
    numbers = r"\| ([\d,.]+) \| ([\d,.]+) \| ([\d.]+) \| ([\d.]+) \|$"
    for trainer, arm in gpu_check.ARMS:
        line = re.search(rf"^\| {trainer} \| {arm} {numbers}", table, re.M)
        assert line, (trainer, arm)
        assert all(float(value.replace(",", "")) > 0 for value in line.groups())
    assert table.count("Profile, one step:") == 2 and table.count("| CPU | region compute_loss |") == 2


def test_launched_rows_say_what_ran_or_why_not():
    """The launch table (not run on a CPU): a rank's record per trainer, a failure pointing to the JSON, a skip."""
    record = {"distributed_type": "FSDP", "fsdp_version": 2, "global_step": 1, "losses": [0.5]}
    ranks = [{"sft": record, "grpo": record, "opd": {**record, "teacher_device": "cuda:0"}}]
    results = {
        "setup": {"mode": "gpu", "device": "H100", "dtype": "bfloat16", "date": "d", "torch": "t", "transformers": "x",
                  "trl": "1.16.0", "student_parameters": 1, "teacher_parameters": 2, "rollouts": 16,
                  "completion_tokens": 128, "steps": 5, "warmup": 2},
        "wall_seconds": 1.0,
        "table": [],
        "launched": {"FSDP2": {"ranks": ranks, "returncode": 0}, "ZeRO-3": {"ranks": [], "returncode": 1}},
        "profiles": {},
    }  # fmt: skip
    table = gpu_check.markdown(results)
    assert "| FSDP2 | OPD | FSDP v2 | 1 | 0.5 | cuda:0 |" in table
    assert "| FSDP2 | SFT | FSDP v2 | 1 | 0.5 |  |" in table
    assert "| ZeRO-3 | all | failed (exit 1): see gpu_check.json |" in table
    results["launched"]["ZeRO-3"] = {"skipped": "deepspeed is not installed"}
    assert "| ZeRO-3 | all | deepspeed is not installed |" in gpu_check.markdown(results)
