"""The scaling sweep's CI-sized mode (`bench/bench_scaling.py --quick`): it runs end to end and its JSON holds every
field BENCHMARKS.md reads. Only counts and exact-vs-estimate agreement are asserted, never a time."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "bench"


@pytest.mark.slow
def test_quick_scaling_sweep_writes_every_field(tmp_path):
    temporary = tmp_path / "tmp"  # the sweep's TMPDIR: its saved models and run folders go there
    temporary.mkdir()
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent), "TMPDIR": str(temporary)}
    subprocess.run(
        [sys.executable, "bench_scaling.py", "--quick", "--steps", "1", "--out", str(tmp_path)],
        cwd=BENCH,
        env=env,
        check=True,
        capture_output=True,
        timeout=600,
    )
    # nothing of the benchmark's is left behind (`make bench` used to leave every run's models in /tmp)
    assert not [p.name for p in temporary.iterdir() if "bench" in p.name]
    results = json.loads((tmp_path / "scaling_quick.json").read_text())
    assert results["quick"] is True
    assert set(results["machine"]) == {"probe", "sft", "opd"}
    assert all(Path(plot).exists() for plot in results["plots"]) and len(results["plots"]) == 3

    # probe drift: within the budget the callback's path is the exact dense one, value for value; the linear path
    # agrees with it (centroid, sliced Wasserstein, Jaccard to rounding, MMD within the estimate's error)
    points = results["probe"]["points"]
    assert [p["states_per_side"] for p in points] == [40, 160]
    for point in points:
        assert point["default"]["values"] == point["exact"]["values"]
        assert point["other_distances_max_relative_error"] < 1e-9
        assert all(abs(error) < 0.15 for error in point["mmd_relative_errors"])
        assert point["linear"]["train_mem_mb"] >= 0 and point["linear"]["seconds"] > 0
    assert set(results["probe"]["slopes"]) == {"exact"}  # the linear path's growth is fitted above 1024 states
    step = results["probe"]["probe_step"]
    assert len(step["sample_seconds"]) == 2 and len(step["drift_seconds"]) == 1 and step["states"][0] > 0
    assert step["probe_step_seconds"] > 0 and step["training_step_seconds"] > 0

    # SFT on packed sequences: no extra forward at any length, and every ratio present
    sft = results["sft"]
    assert [p["max_length"] for p in sft["points"]] == [64, 128]
    for point in sft["points"]:
        assert point["extra_forwards"] == [0]
        assert {"time_ratio", "own_code_ratio", "memory_ratio"} <= set(point)
    assert set(sft["slopes"]) == {
        "stock_step_seconds",
        "lens_step_seconds",
        "own_seconds_per_step",
        "stock_train_mem_mb",
    }

    # OPD vs DistillationTrainer: every cell has the four arms, the floor and the ratios; forwards per step are the
    # rollout's generation forwards plus one loss forward
    cells = results["opd"]["cells"]
    assert [(c["vocab_size"], c["completion_tokens"]) for c in cells] == [(1024, 8), (1024, 16), (2048, 8)]
    for cell in cells:
        length = cell["completion_tokens"]
        assert cell["forwards_per_step"]["distill"] == {"student": length + 1, "teacher": 1}
        assert cell["forwards_per_step"]["reverse_kl"] == {"student": length + 1, "teacher": 1}
        for arm in ("reverse_kl", "continuation", "divergence"):
            assert cell[f"{arm}_time_ratio"] > 0 and cell[f"{arm}_memory_ratio"] > 0
        assert cell["reverse_kl_step_over_floor"] > 0 and "reverse_kl_non_generation_ratio" in cell
    assert results["opd"]["complete"] is True
    slopes = results["opd"]["slopes"]
    assert "reverse_kl vs vocab_size at completion_tokens=8" in slopes
    assert "distill vs completion_tokens at vocab_size=1024" in slopes


@pytest.mark.slow
def test_versus_runs_one_arm_against_distill_in_pairs(tmp_path):
    """`--versus divergence`: only that arm and DistillationTrainer, `--repeats` pairs at every OPD cell, a ratio per
    pair and their median, min and max (the command BENCHMARKS.md gives for divergence against its floor)."""
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent)}
    command = ["bench_scaling.py", "--versus", "divergence", "--quick", "--repeats", "2", "--steps", "1"]
    done = subprocess.run(
        [sys.executable, *command, "--out", str(tmp_path)], cwd=BENCH, env=env, check=True, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    results = json.loads((tmp_path / "scaling_versus_divergence_quick.json").read_text())
    assert results["arm"] == "divergence" and results["repeats"] == 2
    assert [(c["vocab_size"], c["completion_tokens"]) for c in results["cells"]] == [(1024, 8), (1024, 16), (2048, 8)]
    for cell in results["cells"]:
        assert set(cell["step_seconds"]) == {"distill", "divergence"}
        assert len(cell["time_ratios"]) == len(cell["memory_ratios"]) == 2
        median, low, high = cell["time_ratio"]
        assert low <= median <= high and low > 0
    assert done.stdout.count("\n| 1024 |") == 2  # the printed table, a row per cell
