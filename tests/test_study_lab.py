"""The lab study's chain (recipes/studies/study_lab.py) end to end: one seed, two tiny steps per run, test-size models."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

STUDY = Path(__file__).resolve().parents[1] / "recipes" / "studies" / "study_lab.py"


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
    # each comparison's per-seed difference is the two runs' own item scores, paired by question
    stress = json.loads((out / "seed0" / "stress_sft" / "results.json").read_text())
    vs_teacher = next(
        c
        for c in summary["comparisons"]
        if c["run"] == "opd_from_stress_sft" and c["reference"] == "stress_sft" and c["task"] == "mmlu"
    )
    difference = opd["after"]["scores"]["mmlu"] - stress["after"]["scores"]["mmlu"]
    assert vs_teacher["per_seed"] == pytest.approx([difference])
    low, high = vs_teacher["ci95"]
    assert low <= vs_teacher["mean"] <= high
    # retention item by item: the flips add up to each run's mean change against the base
    base = json.loads((out / "base" / "results.json").read_text())["after"]["scores"]
    for name in ("stress_sft", "opd_from_stress_sft", "grpo"):
        after = json.loads((out / "seed0" / name / "results.json").read_text())["after"]["scores"]
        for task in ("truthfulqa", "mmlu"):
            flips = summary["flips"][name][task]
            assert flips["items"] == 3  # --smoke scores 3 items a task
            net = (flips["gained"][0] - flips["lost"][0]) / flips["items"]
            assert net == pytest.approx(after[task] - base[task]), (name, task, flips)
    assert "| stress_sft | truthfulqa |" in (out / "summary.md").read_text()


def write_items(run_dir: Path, correct: list[int]) -> None:
    (run_dir / "eval").mkdir(parents=True)
    lines = [{"task": "gsm8k", "question": f"q{i}", "correct_strict": bool(c)} for i, c in enumerate(correct)]
    lines += [{"task": task, "question": "k", key: 0.0} for task, key in (("truthfulqa", "mc1"), ("mmlu", "correct"))]
    (run_dir / "eval" / "after.items.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_paired_comparison_and_its_bootstrap_interval(tmp_path, monkeypatch):
    """Per seed: the mean item difference; the interval resamples items, so a difference every seed shows on many
    items is real, and one that depends on a single item is not."""
    sys.path.insert(0, str(STUDY.parent))
    import study_lab

    monkeypatch.setattr(study_lab, "COMPARISONS", [("better", "better", "base"), ("lucky", "lucky", "base")])
    write_items(tmp_path / "base", [0] * 100)
    for seed in (0, 1):
        write_items(tmp_path / f"seed{seed}" / "better", [1] * 30 + [0] * 70)  # +0.30 on 30 of 100 items
        write_items(tmp_path / f"seed{seed}" / "lucky", [1] + [0] * 99)  # +0.01, always the same item
    results = {
        c["run"]: c
        for c in study_lab.compare_runs(study_lab.folder_item_scores(tmp_path), [0, 1])
        if c["task"] == "gsm8k"
    }
    assert results["better"]["per_seed"] == pytest.approx([0.30, 0.30])
    low, high = results["better"]["ci95"]
    assert 0.18 < low < 0.30 < high < 0.42 and results["better"]["real"]
    assert results["lucky"]["per_seed"] == pytest.approx([0.01, 0.01]) and not results["lucky"]["real"]


def test_retention_flips_count_each_item_that_changed_whichever_way(tmp_path):
    """A run that loses 2 truthfulqa items the base got right and gains 2 it got wrong has a mean change of 0: the
    flips say 2 and 2."""
    sys.path.insert(0, str(STUDY.parent))
    import study_lab

    def write(run_dir, truthfulqa):
        (run_dir / "eval").mkdir(parents=True)
        lines = [{"task": "truthfulqa", "question": f"t{i}", "mc1": float(c)} for i, c in enumerate(truthfulqa)]
        lines += [{"task": task, "question": "k", key: 1.0} for task, key in (("gsm8k", "correct_strict"), ("mmlu", "correct"))]  # fmt: skip
        (run_dir / "eval" / "after.items.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))

    write(tmp_path / "base", [1, 1, 1, 0, 0, 0])
    write(tmp_path / "seed0" / "swaps", [0, 0, 1, 1, 1, 0])
    flips = study_lab.retention_flips(study_lab.folder_item_scores(tmp_path), [0], ["swaps"])["swaps"]
    assert flips["truthfulqa"] == {"lost": [2], "gained": [2], "items": 6}
    assert flips["mmlu"] == {"lost": [0], "gained": [0], "items": 1}


def test_grpo_flags_reach_both_grpo_runs_and_the_controls_come_with_their_advantage(tmp_path):
    """`--grpo_flags` (grpo_fair.py's chosen setting) follow the config's flags of `grpo` and `stock_grpo` only; the
    no-teacher controls join the runs only with `--constant_advantage`."""
    sys.path.insert(0, str(STUDY.parent))
    import study_lab

    flags = tmp_path / "grpo_flags.json"
    flags.write_text(json.dumps(["--max_steps", "150", "--model_name_or_path", "{mild_sft}"]))
    runs = {name: extra for name, _, _, extra in study_lab.study_runs(flags, None)}
    assert runs["grpo"] == ["--max_steps", "150", "--model_name_or_path", "{mild_sft}"]
    assert runs["stock_grpo"][-4:] == runs["grpo"] and runs["stock_grpo"][0] == "--baseline"
    assert runs["mild_sft"] == [] and "opd_rkl_constant" not in runs
    with_controls = {name: extra for name, _, _, extra in study_lab.study_runs(None, -0.25)}
    assert with_controls["grpo"] == [] and "{constant_advantage}" in with_controls["opd_rkl_constant"]
    assert "{base_model}" in with_controls["opd_rkl_teacher_is_base"]
