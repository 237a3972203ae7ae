"""The forgetting-forecast study (recipes/studies/forgetting_study.py): its smoke chain end to end on test-size models, and
its analysis against known answers."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

STUDY = Path(__file__).resolve().parents[1] / "recipes" / "studies" / "forgetting_study.py"
sys.path.insert(0, str(STUDY.parent))
import forgetting_study as fs  # noqa: E402


@pytest.mark.slow
def test_smoke_chain_writes_every_statistic_at_every_time_point(tmp_path, student_path):
    out = tmp_path / "fs"
    command = [sys.executable, str(STUDY), "--smoke", "--model_name_or_path", str(student_path), "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    forecast = json.loads((out / "forecast.json").read_text())
    assert {row["run"] for row in forecast["runs"]} == set(fs.SMOKE_RUNS)
    cells = {(c["statistic"], c["at"], c["group"]) for c in forecast["table"]}
    assert cells == {(s, t, g) for s in fs.STATISTICS for t in fs.FRACTIONS for g in ("pooled", *fs.METHODS)}
    markdown = (out / "forecast.md").read_text()
    for statistic in fs.STATISTICS:
        for label in fs.FRACTIONS:
            assert f"| {statistic} | {label} | pooled |" in markdown
    assert (out / "forgetting_vs_base_kl.png").stat().st_size > 0
    assert (out / "forgetting_vs_param_distance.png").stat().st_size > 0
    # (a time point needs 3 runs with a Retention: a random model may score 0 at base on the smoke's 3 items)
    assert set(json.loads((out / "calibration.json").read_text())["time_points"]) <= set(fs.FRACTIONS)
    for row in forecast["runs"]:
        for at in row["stats"].values():
            assert at["probe_step"] == at["step"]  # a probe landed on the 10% / 25% / 100% step
            assert at["base_kl"] is not None and at["param_distance"] is not None
            assert (at["teacher_kl"] is not None) == (row["method"] == "opd")
        if row["method"] == "sft":  # (a random-weight GRPO policy earns no reward: zero advantages, no update)
            assert row["stats"]["100%"]["param_distance"] > row["stats"]["10%"]["param_distance"] > 0
        assert not list((out / row["run"]).glob("checkpoint-*"))  # read, then deleted
    # the OPD students learned from the study's own SFT run
    opd = json.loads((out / "opd_div_stressteacher" / "results.json").read_text())
    assert opd["teacher"] == str(out / "sft_stress")
    # a second invocation skips every finished run
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "sft_stress:" not in again.stdout


def test_spearman_and_r2_against_known_answers():
    x, y = [1, 2, 3, 4, 5], [2, 1, 4, 3, 5]
    # 1 - 6 sum(d^2) / (n (n^2 - 1)) with d = (-1, 1, -1, 1, 0): 1 - 24 / 120
    assert fs.spearman(x, y) == pytest.approx(0.8)
    assert fs.r_squared(x, y) == pytest.approx(0.64)  # y holds ranks too: Pearson r = 0.8
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=40), rng.normal(size=40)
    b[::5] = b[0]  # ties
    a[::7] = a[1]
    assert fs.spearman(a, b) == pytest.approx(scipy_stats.spearmanr(a, b).statistic)
    assert fs.r_squared(a, b) == pytest.approx(scipy_stats.linregress(a, b).rvalue ** 2)
    assert math.isnan(fs.spearman([1, 1, 1], [1, 2, 3]))


def test_bootstrap_interval_and_quadratic_law():
    x = np.arange(10.0)
    low, high = fs.bootstrap_interval(x, 3 * x + 1, "spearman", samples=200)
    assert low == pytest.approx(1.0) and high == pytest.approx(1.0)  # every resample is monotone
    y = np.random.default_rng(0).normal(size=10)
    low, high = fs.bootstrap_interval(x, y, "spearman", samples=500)
    assert low < fs.spearman(x, y) < high
    law = fs.quadratic_law([0.1, 0.2, 0.4, 0.8], [0.5 * v + 2 * v**2 for v in (0.1, 0.2, 0.4, 0.8)])
    assert law["a"] == pytest.approx(0.5) and law["b"] == pytest.approx(2.0) and law["r2"] == pytest.approx(1.0)


def test_analysis_table_pools_and_splits_by_method():
    rows = []
    for i in range(12):
        method = fs.METHODS[i % 3]
        kl = 0.01 * (i + 1)
        stats = {label: {s: (None if s == "teacher_kl" and method != "opd" else kl * f) for s in fs.STATISTICS}
                 for label, f in fs.FRACTIONS.items()}  # fmt: skip
        rows.append({"run": f"r{i}", "method": method, "forgetting": 3 * kl + 10 * kl**2, "stats": stats})
    analysis = fs.analyse(rows)
    table = {(c["statistic"], c["at"], c["group"]): c for c in analysis["table"]}
    assert len(table) == len(fs.STATISTICS) * len(fs.FRACTIONS) * (1 + len(fs.METHODS))
    pooled = table["base_kl", "25%", "pooled"]
    assert (
        pooled["n"] == 12
        and pooled["spearman"] == pytest.approx(1.0)
        and pooled["spearman_ci95"] == pytest.approx([1.0, 1.0])
    )
    assert table["teacher_kl", "25%", "pooled"]["n"] == 4  # OPD runs only
    assert table["teacher_kl", "25%", "pooled"]["spearman"] is None  # fewer than MIN_RUNS
    assert table["base_kl", "100%", "sft"]["n"] == 4
    assert analysis["law"]["a"] == pytest.approx(3.0) and analysis["law"]["b"] == pytest.approx(10.0)
