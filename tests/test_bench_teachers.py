"""Issue 27's teacher benchmarks in their smoke modes, on test-size models: a training run per top-k
(`bench/bench_topk_training.py`) and several served teachers against one (`bench/bench_served_teacher.py --multi`).
Only consistency is asserted, never a time."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "bench"


def run_bench(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent)}
    result = subprocess.run([sys.executable, *args], cwd=BENCH, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.slow
def test_topk_training_run_with_k_the_vocabulary_trains_as_the_exact_run(
    tmp_path, math_trained_path, math_teacher_path, tokenizer
):
    vocab = len(tokenizer)
    run_bench("bench_topk_training.py", "--smoke", "--student", str(math_trained_path), "--teacher",
              str(math_teacher_path), "--ks", "2", str(vocab), "--out", str(tmp_path))  # fmt: skip
    runs = {run["k"]: run for run in json.loads((tmp_path / "topk_training.json").read_text())["runs"]}
    assert set(runs) == {None, 2, vocab}  # None: the in-process exact teacher
    for run in runs.values():
        assert len(run["teacher_kl"]) == 2 and all(math.isfinite(v) for v in run["teacher_kl"])
        assert run["teacher_kl_first"] == run["teacher_kl"][0] and run["final_teacher_kl"] >= 0
        assert 0.0 <= run["dev_accuracy"] <= 1.0
    # top-k with k = V is the exact divergence: the same updates, so the same rollouts and KL step by step
    assert runs[vocab]["teacher_kl"] == pytest.approx(runs[None]["teacher_kl"], rel=1e-4, abs=1e-6)
    assert runs[vocab]["final_teacher_kl"] == pytest.approx(runs[None]["final_teacher_kl"], rel=1e-4, abs=1e-6)
    # k = 2: the same first step (same weights, same rollouts), then another update
    assert runs[2]["teacher_kl"][0] == pytest.approx(runs[None]["teacher_kl"][0], rel=1e-4)
    assert runs[2]["teacher_kl"][1] != pytest.approx(runs[None]["teacher_kl"][1], rel=1e-4)


@pytest.mark.slow
def test_two_served_teachers_of_one_model_match_one_served_teacher(tmp_path):
    run_bench(
        "bench_served_teacher.py", "--multi", "--smoke", "--repeats", "1", "--steps", "1", "--out", str(tmp_path)
    )
    results = json.loads((tmp_path / "served_multi_teacher.json").read_text())
    one, two = results["runs"]["one_teacher"], results["runs"]["two_teachers"]
    assert len(one) == len(two) == 1 and len(one[0]["step_seconds"]) == len(two[0]["step_seconds"]) == 1
    ratio = next(row for row in results["rows"] if row["metric"].startswith("step time"))
    assert ratio["median"] == pytest.approx(two[0]["step_seconds"][0] / one[0]["step_seconds"][0])
    # the same teacher behind both servers: routing changes nothing in what the student learns from
    assert len(one[0]["teacher_kl"]) == 2 and results["teacher_kl_max_abs_diff"] < 1e-5
