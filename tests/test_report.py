"""`statelens report` on small synthetic run folders written in the recipes' layout."""

import argparse
import itertools
import json
import re

import numpy as np
import pandas as pd
import pytest
from matplotlib.image import imread

from trl_statelens.cli import add_report_arguments
from trl_statelens.evaluation import retention_summary
from trl_statelens.reports.pages import run_report_cli, write_report
from trl_statelens.reports.run_folders import (
    load_run,
    sample_efficiency_curve,
    teacher_tokens_curve,
    token_weighted_mean,
)

PLOTS = ["state_curves.png", "prefix_lengths.png", "drift.png", "tradeoff.png", "teacher_kl.png"]


def evaluation(gsm8k, truthfulqa, mmlu):
    scores = {"gsm8k": gsm8k, "truthfulqa": truthfulqa, "mmlu": mmlu}
    return {
        "model": "lab/base",
        "scores": scores,
        "primary_metrics": {"gsm8k": "accuracy", "truthfulqa": "mc1", "mmlu": "accuracy"},
        "metrics": {"gsm8k": {"accuracy": gsm8k}, "truthfulqa": {"mc1": truthfulqa}, "mmlu": {"accuracy": mmlu}},
    }


def step_lines(num_steps, *, sources, teacher=False, seed=0):
    """Per-step aggregates as the callback writes them, with a trend so the curves are not flat."""
    rng = np.random.default_rng(seed)
    lines = []
    for step in range(1, num_steps + 1):
        nll = 2.0 * np.exp(-step / num_steps) + 0.05 * rng.standard_normal()
        entropy = 1.2 + 0.05 * rng.standard_normal()
        tokens = int(rng.integers(200, 400))
        line = {
            "step": step,
            "epoch": step / num_steps,
            "supervised_tokens": float(tokens),
            "sequences": 8.0,
            "state_nll": nll,
            "state_entropy": entropy,
            "offpolicy_gap": nll - entropy,
            **{f"source_frac/{name}": share for name, share in sources.items()},
            "prefix_len/p10": 2.0,
            "prefix_len/p50": 12.0 + step % 3,
            "prefix_len/p90": 40.0,
            "prefix_len/mean": 16.0,
            "prefix_len/max": 60.0 + step % 5,
            "weight/mean": 1.0,
            "weight/abs_mean": 1.0,
            "weight/positive_frac": 1.0,
            "prefix_len_hist": [8, 16, 30, 60, 80, 70, 30 + step % 4],
        }
        if teacher:
            line["teacher_kl/supervised"] = 0.8 * np.exp(-step / num_steps) + 0.02 * rng.standard_normal()
            line["teacher_nll"] = 1.5
        lines.append(line)
    return lines


def drift_lines(num_probes, scale):
    return [
        {
            "step": 5 * i,
            "mmd": scale * i,
            "centroid": 0.1 * i,
            "sliced_wasserstein": 0.02 * i,
            "jaccard": 0.05 * i,
            "base_kl": 0.5 * scale * i,
            "base_kl_topk": 0.4 * scale * i,
            "num_states": 64,
        }
        for i in range(num_probes)
    ]


def write_run(folder, *, results=None, steps=None, drift=None, log_history=None):
    (folder / "statelens").mkdir(parents=True)
    if results is not None:
        (folder / "results.json").write_text(json.dumps(results))
    if log_history is not None:
        (folder / "log_history.json").write_text(json.dumps(log_history))
    for name, lines in (("steps.jsonl", steps), ("drift.jsonl", drift)):
        if lines is not None:
            (folder / "statelens" / name).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def results_json(recipe, trainer, baseline, run_name, before, after, drift):
    return {
        "recipe": recipe,
        "trainer": trainer,
        "baseline": baseline,
        "run_name": run_name,
        "model": "lab/base",
        "teacher": None,
        "seed": 0,
        "before": before,
        "after": after,
        "retention": retention_summary(before, after) if before else None,
        "final_drift": {"mmd": drift[-1]["mmd"], "centroid": 0.4, "sliced_wasserstein": 0.08, "jaccard": 0.2},
        "train_seconds": 12.5,
    }


BASE = evaluation(0.448, 0.300, 0.436)
SFT_AFTER = evaluation(0.512, 0.295, 0.444)
STOCK_BEFORE = evaluation(0.448, 0.310, 0.430)  # a slightly different base eval: its own retention differs
STOCK_AFTER = evaluation(0.420, 0.245, 0.364)


@pytest.fixture
def runs(tmp_path):
    """A complete StateLens SFT run, a stock-TRL baseline without steps.jsonl, an OPD run without results.json."""
    sft_drift = drift_lines(6, 0.002)
    sft = write_run(
        tmp_path / "sft",
        results=results_json("sft", "StateLensSFTTrainer", "statelens", "mild-sft", BASE, SFT_AFTER, sft_drift),
        steps=step_lines(40, sources={"dataset": 1.0, "learner": 0.0, "teacher": 0.0}),
        drift=sft_drift,
        log_history=[{"step": s, "loss": 2.0 - s / 40} for s in range(1, 41)],
    )
    stock_drift = drift_lines(6, 0.0025)
    stock = write_run(
        tmp_path / "stock",
        results=results_json("sft", "SFTTrainer", "stock", "stock-sft", STOCK_BEFORE, STOCK_AFTER, stock_drift),
        drift=stock_drift,
    )
    opd = write_run(
        tmp_path / "opd",
        steps=step_lines(40, sources={"dataset": 0.0, "learner": 0.75, "teacher": 0.25}, teacher=True, seed=1),
        drift=drift_lines(6, 0.003),
        log_history=[{"step": s, "loss": 1.0, "teacher_kl/sampled": 0.5} for s in range(1, 41)],
    )
    return {"sft": sft, "stock": stock, "opd": opd}


def markdown_table(text, heading):
    """The first table after `## heading` as a list of {column: cell}."""
    section = text.split(f"## {heading}", 1)[1]
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    header, body = cells[0], cells[2:]
    return {row[0]: dict(zip(header, row)) for row in body}


def close(cell, value, decimals):
    assert cell != "-", f"expected {value}, the table shows no value"
    assert float(cell) == pytest.approx(value, abs=0.5 * 10**-decimals + 1e-12)


def assert_not_blank(path):
    pixels = imread(path)[..., :3]
    assert pixels.ndim == 3 and pixels.shape[0] > 300 and pixels.shape[1] > 500, f"{path.name}: {pixels.shape}"
    assert pixels.var() > 1e-3, f"{path.name} looks blank (pixel variance {pixels.var():.2e})"


def test_report_tables_plots_and_notes(runs, tmp_path):
    out = tmp_path / "report"
    report_path = write_report([runs["sft"], runs["stock"], runs["opd"]], out)
    text = report_path.read_text()

    table = markdown_table(text, "Scores, drift and retention")
    assert list(table) == ["Base", "mild-sft", "stock-sft", "opd"]  # base row first, then the runs in order
    for task, column in (("gsm8k", "GSM8K"), ("truthfulqa", "TruthfulQA"), ("mmlu", "MMLU")):
        close(table["Base"][column], BASE["scores"][task], 4)  # the first run's `before`
        close(table["mild-sft"][column], SFT_AFTER["scores"][task], 4)
        close(table["stock-sft"][column], STOCK_AFTER["scores"][task], 4)
        assert table["opd"][column] == "-"
    for name, after in (("mild-sft", SFT_AFTER), ("stock-sft", STOCK_AFTER)):
        expected = retention_summary(BASE, after)  # against the Base row, as in the study
        close(table[name]["Forgetting"], expected["forgetting"], 4)
        close(table[name]["Retention"], expected["retention"], 4)
        run_results = json.loads((runs["sft" if name == "mild-sft" else "stock"] / "results.json").read_text())
        assert float(table[name]["MMD drift"]) == pytest.approx(run_results["final_drift"]["mmd"], rel=1e-3)
    assert float(table["opd"]["MMD drift"]) == pytest.approx(0.003 * 5, rel=1e-3)  # last drift.jsonl line
    assert table["opd"]["Forgetting"] == table["opd"]["Retention"] == "-"

    states = markdown_table(text, "State statistics")
    sft_steps = [json.loads(line) for line in (runs["sft"] / "statelens" / "steps.jsonl").read_text().splitlines()]
    tokens = np.array([s["supervised_tokens"] for s in sft_steps])
    assert int(states["mild-sft"]["Supervised tokens"].replace(",", "")) == tokens.sum()
    weighted_nll = np.average([s["state_nll"] for s in sft_steps], weights=tokens)
    close(states["mild-sft"]["state_nll"], weighted_nll, 4)
    close(states["mild-sft"]["dataset"], 1.0, 3)
    assert states["mild-sft"]["teacher_kl/supervised"] == "-"
    close(states["opd"]["learner"], 0.75, 3)
    close(states["opd"]["teacher"], 0.25, 3)
    assert states["opd"]["teacher_kl/supervised"] != "-"
    assert set(states["stock-sft"].values()) == {"stock-sft", "-"}

    # visible notes for what is missing
    assert "a stock TRL baseline records no per-step states" in text
    assert "no `results.json`: no evaluation scores" in text
    assert "Base: the `before` evaluation of `mild-sft`" in text
    assert "`stock-sft`: against its own `before` evaluation" in text  # its stored retention differs from the table

    for name in PLOTS:
        assert f"]({name})" in text
        assert_not_blank(out / name)
    assert imread(out / "drift.png").shape[0] == 9 * 120  # three panels of 3 inches at 120 dpi: base_kl below

    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == len(PLOTS)
    assert "<table>" in page and "mild-sft" in page and 'class="note"' in page


def test_base_run_and_cli(runs, tmp_path, capsys):
    base = write_run(
        tmp_path / "base-eval",
        results={"recipe": "eval", "run_name": "base-model", "before": None, "after": evaluation(0.4, 0.32, 0.42)},
    )
    parser = add_report_arguments(argparse.ArgumentParser())
    out = tmp_path / "cli-report"
    # the base run listed among the runs too: it is the Base row, not also a run row
    args = parser.parse_args([str(runs["stock"]), str(base), "--out", str(out), "--base", str(base)])
    assert run_report_cli(args) == 0
    assert "report written" in capsys.readouterr().out

    text = (out / "report.md").read_text()
    table = markdown_table(text, "Scores, drift and retention")
    assert list(table) == ["Base", "stock-sft"]
    close(table["Base"]["GSM8K"], 0.4, 4)
    expected = retention_summary(evaluation(0.4, 0.32, 0.42), STOCK_AFTER)
    close(table["stock-sft"]["Forgetting"], expected["forgetting"], 4)
    close(table["stock-sft"]["Retention"], expected["retention"], 4)
    assert "Base: the `after` evaluation of `base-model` (--base)" in text
    # no run has state records or a teacher: those plots are skipped with a note, the others drawn
    assert "No plot 'State NLL and off-policy gap over steps'" in text
    assert "No plot 'Prefix lengths of supervised tokens'" in text
    assert "No plot 'Teacher KL over steps'" in text
    for name in ("drift.png", "tradeoff.png"):
        assert_not_blank(out / name)
    assert not (out / "state_curves.png").exists()


def test_partial_ledger_and_log_history_fallback(tmp_path):
    """A run still writing (a cut last line) and a run whose ledger is gone but whose log history has the metrics."""
    writing = write_run(tmp_path / "writing", steps=step_lines(5, sources={"learner": 1.0}))
    with open(writing / "statelens" / "steps.jsonl", "a") as f:
        f.write('{"step": 6, "state_')
    logged = write_run(
        tmp_path / "logged",
        log_history=[
            {
                "step": s,
                "loss": 1.0,
                "statelens/state_nll": 1.5,
                "statelens/offpolicy_gap": 0.2,
                "statelens/drift/mmd": 0.01,
            }
            for s in (10, 20)
        ],
    )
    text = write_report([writing, logged], tmp_path / "out").read_text()
    assert "skipped 1 line(s) that are not valid JSON" in text
    assert "state curves from `log_history.json`" in text
    assert "Base: no run has a `before` evaluation" in text
    states = markdown_table(text, "State statistics")
    assert states["writing"]["Steps"] == "5"
    close(states["logged"]["state_nll"], 1.5, 4)
    assert_not_blank(tmp_path / "out" / "state_curves.png")


def test_clear_errors_for_missing_or_empty_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nope")) + ".*results.json"):
        write_report([tmp_path / "nope"], tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no run files"):
        write_report([tmp_path / "empty"], tmp_path / "out")


def test_cli_reports_a_bad_folder_in_one_line(tmp_path, capsys):
    parser = add_report_arguments(argparse.ArgumentParser())
    args = parser.parse_args([str(tmp_path / "nope"), "--out", str(tmp_path / "out")])
    assert run_report_cli(args) == 2
    error = capsys.readouterr().err
    assert error.startswith("statelens report: error: run folder") and "does not exist" in error


def test_teacher_kl_is_weighted_by_the_learner_tokens_it_averages():
    steps = pd.DataFrame(
        {
            "supervised_tokens": [100, 300],
            "source_frac/learner": [1.0, 0.0],  # step 2's tokens all came from the dataset: its value covers nothing
            "teacher_kl/supervised": [0.2, 0.9],
            "state_nll": [1.0, 2.0],
        }
    )
    assert token_weighted_mean(steps, "teacher_kl/supervised", source="learner") == pytest.approx(0.2)
    assert token_weighted_mean(steps, "state_nll") == pytest.approx((100 * 1.0 + 300 * 2.0) / 400)


def test_sample_efficiency_plots_the_target_against_the_ledger_tokens(tmp_path):
    """Target scores during training (`--target_eval_steps`) against the supervised tokens the ledger counted."""

    def scored(pairs):  # the entries RetentionEvalCallback logs for gsm8k; the synthetic evaluations name `accuracy`
        return [{"step": step, "epoch": step / 6, "eval/gsm8k/accuracy": score} for step, score in pairs]

    sft_drift = drift_lines(3, 0.002)
    sft = write_run(
        tmp_path / "sft",
        results=results_json("sft", "StateLensSFTTrainer", "statelens", "mild-sft", BASE, SFT_AFTER, sft_drift),
        steps=step_lines(6, sources={"dataset": 1.0}),
        log_history=[{"step": s, "loss": 1.0} for s in range(1, 7)] + scored([(2, 0.46), (4, 0.49), (6, 0.5)]),
    )
    # --eval_before false, as the lab study runs: the 0-token point is the base run's score; step 8 is past the ledger
    opd_after = evaluation(0.47, 0.3, 0.44)
    opd = write_run(
        tmp_path / "opd",
        results={"recipe": "opd", "baseline": "statelens", "run_name": "opd", "before": None, "after": opd_after},
        steps=step_lines(6, sources={"learner": 1.0}, teacher=True, seed=1),
        log_history=scored([(3, 0.455), (6, 0.46), (8, 0.9)]),
    )
    stock_drift = drift_lines(3, 0.002)
    stock = write_run(  # scored during training, but a stock trainer keeps no ledger: no supervised tokens
        tmp_path / "stock",
        results=results_json("sft", "SFTTrainer", "stock", "stock-sft", STOCK_BEFORE, STOCK_AFTER, stock_drift),
        log_history=scored([(2, 0.45)]),
    )
    base_scores = {"gsm8k": 0.44, "truthfulqa": 0.3, "mmlu": 0.43}
    base = write_run(tmp_path / "base-eval", results={"run_name": "base", "after": evaluation(*base_scores.values())})

    def ledger_tokens(run_dir):
        lines = (run_dir / "statelens" / "steps.jsonl").read_text().splitlines()
        return np.cumsum([json.loads(line)["supervised_tokens"] for line in lines])  # steps 1..6

    sft_tokens, opd_tokens = ledger_tokens(sft), ledger_tokens(opd)
    x, y = sample_efficiency_curve(load_run(sft), base_scores)
    assert x.tolist() == [0, sft_tokens[1], sft_tokens[3], sft_tokens[5], sft_tokens[5]]  # before, 2, 4, 6, after
    assert y.tolist() == [BASE["scores"]["gsm8k"], 0.46, 0.49, 0.5, SFT_AFTER["scores"]["gsm8k"]]  # its own before
    opd_run = load_run(opd)
    x, y = sample_efficiency_curve(opd_run, base_scores)
    assert x.tolist() == [0, opd_tokens[2], opd_tokens[5], opd_tokens[5]]
    assert y.tolist() == [0.44, 0.455, 0.46, 0.47]
    assert "target scores at steps [8] are past the ledger's last step" in opd_run.notes[-1]
    assert sample_efficiency_curve(load_run(stock), base_scores) is None

    out = tmp_path / "report"
    text = write_report([sft, opd, stock], out, base=base).read_text()
    assert "](sample_efficiency.png)" in text and "How many states each method needed" in text
    assert "target scores during training but no per-step supervised tokens" in text  # the stock run's note
    assert_not_blank(out / "sample_efficiency.png")
    drawn = [path.name for path in out.glob("*.png")]
    assert (out / "report.html").read_text().count('src="data:image/png;base64,') == len(drawn)

    # no run scored during training: no figure, a note instead
    text = write_report([stock], tmp_path / "no-scores").read_text()
    assert "No plot 'Target score vs supervised tokens'" in text
    assert not (tmp_path / "no-scores" / "sample_efficiency.png").exists()


def test_runs_with_several_teachers_get_a_row_and_curves_per_teacher(runs, tmp_path):
    steps = step_lines(6, sources={"dataset": 0.0, "learner": 0.5, "teacher": 0.5}, teacher=True, seed=2)
    for line in steps:  # the ledger's per-teacher aggregates: math answers about 3 rows in 4
        line["supervised_tokens/math"] = line["supervised_tokens"] - line["supervised_tokens"] // 4
        line["supervised_tokens/kb"] = line["supervised_tokens"] // 4
        line["source_frac/teacher/math"], line["source_frac/teacher/kb"] = 0.4 - 0.01 * line["step"], 0.1
    log_history = [
        {"step": s, "loss": 1.0, "teacher_kl/sampled/math": 0.1 * s, "teacher_kl/sampled/kb": 0.5} for s in range(1, 7)
    ]
    routed = write_run(tmp_path / "routed", steps=steps, log_history=log_history)
    text = write_report([runs["opd"], routed], tmp_path / "out").read_text()

    lines = text.split("## Teachers", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    first_table = itertools.takewhile(lambda line: line.startswith("|"), lines[start:])
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in first_table]
    table = {(row[0], row[1]): dict(zip(rows[0], row)) for row in rows[2:]}
    assert list(table) == [("routed", "math"), ("routed", "kb")]  # the single-teacher run has no teacher rows
    tokens = np.array([line["supervised_tokens"] for line in steps])
    math_tokens = sum(line["supervised_tokens/math"] for line in steps)
    assert int(table["routed", "math"]["Supervised tokens"].replace(",", "")) == math_tokens
    close(table["routed", "math"]["share"], math_tokens / tokens.sum(), 3)
    close(table["routed", "kb"]["share"], 1 - math_tokens / tokens.sum(), 3)
    written = np.average([line["source_frac/teacher/math"] for line in steps], weights=tokens)
    close(table["routed", "math"]["teacher-written share"], written, 3)
    close(table["routed", "math"]["teacher_kl/sampled"], 0.35, 4)  # the mean of 0.1 ... 0.6
    close(table["routed", "kb"]["teacher_kl/sampled"], 0.5, 4)
    assert "](teachers.png)" in text
    assert_not_blank(tmp_path / "out" / "teachers.png")

    text = write_report([runs["opd"]], tmp_path / "single").read_text()
    assert "## Teachers" not in text
    assert "No plot 'Teacher KL and supervised tokens per teacher': no run has several teachers" in text


def test_teacher_disagreement_has_a_target_panel_only_when_a_run_scored_the_target(tmp_path, monkeypatch):
    """The probe's exact KL to the teacher in three panels; the fourth, the target score during training, only for
    runs evaluated during training (`--target_eval_steps`): the demo's report has no empty axis."""
    from trl_statelens.reports import plots

    drift = [
        {**line, "teacher_kl/exact": 0.3 / (1 + i), "teacher_kl/exact_fixed": 0.3, "teacher_kl/exact_number": 0.5,
         "teacher_kl/exact_other": 0.2, "number_frac": 0.2, "probe_tokens": 40.0}
        for i, line in enumerate(drift_lines(4, 0.002))
    ]  # fmt: skip
    figures = {}
    save = plots.save
    monkeypatch.setattr(
        plots, "save", lambda figure, out, name: (figures.update({name: figure}), save(figure, out, name))[1]
    )
    for name, log_history in (
        ("unscored", [{"step": s, "loss": 1.0} for s in range(1, 16)]),
        ("scored", [{"step": s, "eval/gsm8k/accuracy_strict": 0.4 + 0.01 * s} for s in (5, 10, 15)]),
    ):
        run = write_run(tmp_path / name, drift=drift, log_history=log_history)
        write_report([run], tmp_path / f"{name}-report")
        axes = figures.pop("teacher_disagreement.png").axes
        titles = [ax.get_title() for ax in axes]
        assert all(ax.lines for ax in axes), titles  # no empty panel
        assert len(axes) == (4 if name == "scored" else 3), titles
        assert any(title.startswith("Target during training") for title in titles) == (name == "scored")


def test_a_run_whose_flops_are_unknown_is_left_out_of_the_compute_plot_with_a_note(tmp_path):
    """A served teacher's size is unknown: results.json counts no FLOPs (`None`), and the report says so instead of
    drawing the student's share alone."""
    from trl_statelens.reports.run_folders import compute_curve

    compute = {"student_parameters": 100, "teacher_parameters": None, "flops_per_token": None,
               "flops_per_supervised_token": None, "tokens": 50.0, "flops": None}  # fmt: skip
    run_dir = write_run(
        tmp_path / "served",
        results={"recipe": "opd", "run_name": "served", "after": evaluation(0.5, 0.3, 0.4), "compute": compute},
        log_history=[{"step": 1, "num_tokens": 50.0, "eval/gsm8k/accuracy": 0.45}],
    )
    run = load_run(run_dir)
    assert compute_curve(run) is None
    assert any("counts no FLOPs (a served teacher's size is unknown)" in note for note in run.notes)


def test_the_training_cost_table_reads_the_ledgers_teacher_tokens_and_last_flops_by_part(tmp_path):
    """One row per run whose ledger counts its cost: the teacher tokens summed over steps and the last step's
    `flops_total/*`; a served teacher's unknown FLOPs (`null`) and a run without the counts (no row) stay apart."""
    results = {"recipe": "opd", "after": evaluation(0.5, 0.3, 0.4)}
    lines = step_lines(2, sources={"learner": 1.0}, teacher=True)
    local, served = ([{**line} for line in lines] for _ in range(2))
    for step, (a, b) in enumerate(zip(local, served), start=1):
        parts = {"student_generation": 2e6 * step, "student_training": 6e6 * step, "teacher_scoring": 3e6 * step,
                 "teacher_writing": 1e6 * step}  # fmt: skip
        a.update({"teacher_tokens": 100.0 + step, **{f"flops_total/{k}": v for k, v in parts.items()}})
        a["flops_total/total"] = sum(parts.values())
        b.update({"teacher_tokens": 10.0, **{f"flops_total/{k}": v for k, v in parts.items()}})
        b["flops_total/teacher_scoring"] = b["flops_total/teacher_writing"] = b["flops_total/total"] = None
    runs = [
        write_run(tmp_path / name, results={**results, "run_name": name}, steps=steps)
        for name, steps in (("local", local), ("served", served), ("plain", lines))
    ]
    write_report(runs, tmp_path / "report")
    table = (tmp_path / "report" / "report.md").read_text().split("## Training cost")[1].split("\n## ")[0]
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in table.splitlines() if line.startswith("| ")}
    assert rows["local"] == ["203", "4.00e+06", "1.20e+07", "6.00e+06", "2.00e+06", "2.40e+07 |"]
    assert rows["served"] == ["20", "4.00e+06", "1.20e+07", "-", "-", "- |"]
    assert "plain" not in rows


def test_the_reward_signal_plot_reads_the_groups_by_step_and_by_solution_steps(tmp_path, monkeypatch):
    """GRPO's reward signal: the share of groups whose rewards differ per step (the ledger's aggregate) and, over the
    run, by the problems' `solution_steps` from `groups.jsonl`, an unscorable rollout (`null`) left out."""
    from trl_statelens.reports import plots

    groups = [
        {"step": 1, "prompt_id": "a", "rewards": [0.0, 0.0], "solution_steps": 1},
        {"step": 1, "prompt_id": "b", "rewards": [0.0, 1.0], "solution_steps": 1},
        {"step": 2, "prompt_id": "c", "rewards": [1.0, None], "solution_steps": 3},
        {"step": 2, "prompt_id": "d", "rewards": [0.0, 1.0], "solution_steps": 3},
        {"step": 2, "prompt_id": "e", "rewards": [0.5, 0.0], "solution_steps": 3},
    ]
    steps = [
        {**line, "reward_groups/spread_frac": share, "weight/nonzero_frac": share / 2}
        for line, share in zip(step_lines(2, sources={"learner": 1.0}), (0.5, 2 / 3))
    ]
    run = write_run(tmp_path / "grpo", steps=steps)
    (run / "statelens" / "groups.jsonl").write_text("".join(json.dumps(g) + "\n" for g in groups))
    figures = {}
    save = plots.save
    monkeypatch.setattr(
        plots, "save", lambda figure, out, name: (figures.update({name: figure}), save(figure, out, name))[1]
    )
    write_report([run], tmp_path / "report")
    by_step, by_difficulty = figures["reward_signal.png"].axes
    groups_line, tokens_line = by_step.lines
    assert list(groups_line.get_ydata()) == [0.5, 2 / 3] and list(tokens_line.get_ydata()) == [0.25, 1 / 3]
    (difficulty_line,) = by_difficulty.lines
    assert list(difficulty_line.get_xdata()) == [1.0, 3.0]
    assert list(difficulty_line.get_ydata()) == [0.5, 2 / 3]  # 3 steps: c has one scored reward, so no spread
    assert imread(tmp_path / "report" / "reward_signal.png").shape[0] > 100


def test_the_teacher_tokens_plot_reads_each_evaluation_at_the_teacher_tokens_spent_by_then(tmp_path, monkeypatch):
    """Issue 36's plot: each OPD run's target score against the ledger's `teacher_tokens_total` at the evaluation's
    step (a lever that skips teacher work moves its curve left); a run without a teacher (SFT) is not drawn."""
    from trl_statelens.reports import plots

    figures = {}
    save = plots.save
    monkeypatch.setattr(
        plots, "save", lambda figure, out, name: (figures.update({name: figure}), save(figure, out, name))[1]
    )
    scored = [{"step": s, "eval/gsm8k/accuracy": 0.30 + 0.02 * s} for s in (2, 4)]
    before = {"recipe": "opd", "before": evaluation(0.25, 0.3, 0.4), "after": evaluation(0.4, 0.3, 0.4)}
    folders = []
    for name, per_step in (("plain", 100.0), ("skipping", 60.0)):
        lines = step_lines(4, sources={"learner": 1.0}, teacher=True)
        for line in lines:
            line.update({"teacher_tokens": per_step, "teacher_tokens_total": per_step * line["step"]})
        folders.append(write_run(tmp_path / name, results={**before, "run_name": name}, steps=lines,
                                 log_history=scored))  # fmt: skip
    folders.append(
        write_run(
            tmp_path / "sft",
            results={**before, "recipe": "sft", "run_name": "sft"},
            steps=step_lines(4, sources={"dataset": 1.0}),
            log_history=scored,
        )  # fmt: skip
    )
    tokens, scores = teacher_tokens_curve(load_run(folders[1]))
    assert tokens.tolist() == [0.0, 120.0, 240.0] and scores.tolist() == pytest.approx([0.25, 0.34, 0.38])
    assert teacher_tokens_curve(load_run(folders[2])) is None
    write_report(folders, tmp_path / "report")
    (ax,) = figures["teacher_tokens.png"].axes
    assert sorted(line.get_label() for line in ax.lines) == ["plain", "skipping"]
    assert [line.get_xdata().tolist() for line in ax.lines if line.get_label() == "plain"] == [[0.0, 200.0, 400.0]]
    assert "teacher_tokens.png" in (tmp_path / "report" / "report.md").read_text()


def test_the_alignment_plot_draws_the_exact_share_of_all_tokens_and_of_digits_per_step(runs, tmp_path, monkeypatch):
    """A teacher of another tokenizer: `alignment/exact` and `alignment/exact/numbers` as logged, each in its colour
    and the run's line style, a step without digits left out of the digits' line; runs that never logged them get no
    line."""
    from trl_statelens.reports import plots

    log_history = [
        {"step": 1, "loss": 1.0, "alignment/exact": 0.9, "alignment/exact/numbers": 0.4},
        {"step": 2, "loss": 1.0, "alignment/exact": 0.95},
        {"step": 3, "loss": 1.0, "alignment/exact": 0.8, "alignment/exact/numbers": 0.5},
    ]
    cross = write_run(tmp_path / "cross", steps=step_lines(3, sources={"learner": 1.0}), log_history=log_history)
    figures = {}
    save = plots.save
    monkeypatch.setattr(
        plots, "save", lambda figure, out, name: (figures.update({name: figure}), save(figure, out, name))[1]
    )
    text = write_report([runs["opd"], cross], tmp_path / "report").read_text()
    (ax,) = figures["alignment.png"].axes
    all_tokens, digits = ax.lines
    assert list(all_tokens.get_xdata()) == [1, 2, 3] and list(all_tokens.get_ydata()) == [0.9, 0.95, 0.8]
    assert list(digits.get_xdata()) == [1, 3] and list(digits.get_ydata()) == [0.4, 0.5]
    assert all_tokens.get_label() == "cross: all tokens" and all_tokens.get_color() != digits.get_color()
    assert all_tokens.get_linestyle() == digits.get_linestyle()
    assert "](alignment.png)" in text
    assert_not_blank(tmp_path / "report" / "alignment.png")
    text = write_report([runs["opd"]], tmp_path / "same").read_text()
    assert "No plot 'Where a teacher of another tokenizer is exact'" in text


def test_a_panel_of_several_metrics_per_run_colours_the_metrics_and_styles_the_runs(tmp_path, monkeypatch):
    """endings.png draws three shares of each run in one panel: one run's metrics have distinct colours, the same
    metric of two runs has one colour and distinct line styles, and the legend names the metrics and the runs."""
    from trl_statelens.reports import endings

    ends = [{"ends/length_limit": 0.5, "ends/end_token": 0.5, "ends/repeats": 0.1 * i} for i in range(4)]
    folders = [
        write_run(
            tmp_path / name,
            steps=[{**line, **end} for line, end in zip(step_lines(4, sources={"learner": 1.0}), ends)],
        )  # fmt: skip
        for name in ("first", "second")
    ]
    figures = {}
    save = endings.save
    monkeypatch.setattr(
        endings, "save", lambda figure, out, name: (figures.update({name: figure}), save(figure, out, name))[1]
    )
    write_report(folders, tmp_path / "report")
    top = figures["endings.png"].axes[0]
    lines = {line.get_label(): line for line in top.lines}
    metrics = ("cut at the limit", "ended (end token)", "repeating")
    for run in ("first", "second"):
        colours = {lines[f"{run}: {what}"].get_color() for what in metrics}
        assert len(colours) == len(metrics), f"{run}'s metrics share a colour"
    for what in metrics:
        first, second = lines[f"first: {what}"], lines[f"second: {what}"]
        assert first.get_color() == second.get_color()
        assert first.get_linestyle() != second.get_linestyle()
    legend = [text.get_text() for text in top.get_legend().get_texts()]
    assert legend == [*metrics, "first", "second"]


def test_guard_firings_are_a_section_near_the_top_and_lines_at_their_steps(runs, tmp_path, monkeypatch):
    """`statelens/guards.jsonl`: each firing is a row of the Guards section (beside the preflight's, before Table 2)
    and a vertical line at its step on the per-step plots; a run whose guards stayed quiet says so, one without the
    file is left out."""
    from trl_statelens.reports import plots

    firing = {"step": 12, "guard": "loop", "metric": "statelens/ends/repeats", "value": 0.5, "reference": 0.1,
              "threshold": 0.25, "message": "repeats rose from 0.1 to 0.5", "action": "warn"}  # fmt: skip
    (runs["opd"] / "statelens" / "guards.jsonl").write_text(json.dumps(firing) + "\n")
    (runs["sft"] / "statelens" / "guards.jsonl").write_text("")
    figures = {}
    save = plots.save
    monkeypatch.setattr(
        plots, "save", lambda figure, out, name: (figures.update({name: figure}), save(figure, out, name))[1]
    )
    text = write_report([runs["sft"], runs["stock"], runs["opd"]], tmp_path / "report").read_text()
    assert text.index("## Guards (during training)") < text.index("## Scores, drift and retention")
    table = markdown_table(text, "Guards (during training)")
    assert list(table) == ["mild-sft", "opd"]
    assert table["mild-sft"]["guard"] == "no guard fired"
    assert (table["opd"]["step"], table["opd"]["guard"], table["opd"]["action"]) == ("12", "loop", "warn")
    assert table["opd"]["message"] == firing["message"]
    assert "mark the steps at which its guards fired" in text

    def vertical_lines_at(ax):
        return [line for line in ax.lines if list(line.get_xdata()) == [12, 12]]

    for name in ("state_curves.png", "drift.png", "teacher_kl.png"):
        for ax in figures[name].axes:
            assert len(vertical_lines_at(ax)) == 1, name  # the opd run's firing; the quiet run draws none
    opd_colour = figures["teacher_kl.png"].axes[0].lines[0].get_color()
    assert vertical_lines_at(figures["teacher_kl.png"].axes[0])[0].get_color() == opd_colour
