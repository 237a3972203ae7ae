"""Provenance: the code, library versions and weight hashes that a run folder and every results file record, and
`statelens report`'s warning when runs differ in them."""

import copy
import importlib.metadata
import json
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cpu_settings import CPU
from transformers import AutoModelForCausalLM
from trl import SFTConfig

import trl_statelens
from trl_statelens import StateLensSFTTrainer, evaluate_model
from trl_statelens.provenance import (
    LIBRARIES,
    PROVENANCE_FILE,
    code_provenance,
    files_hash,
    provenance,
    provenance_differences,
    weights_hash,
    write_run_provenance,
)
from trl_statelens.reports.pages import write_report
from trl_statelens.reports.runs import run_provenance

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def installed(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def one_ulp_up(model, name="model.layers.0.mlp.up_proj.weight", index=7):
    """Move one weight to the next float above it, in place; returns how to undo it."""
    flat = model.get_parameter(name).data.view(-1)
    was = flat[index].clone()
    flat[index] = torch.nextafter(was, torch.tensor(float("inf")))
    assert flat[index] != was and (flat[index] - was).abs() < 1e-6

    def undo():
        flat[index] = was

    return undo


def test_a_training_run_writes_its_provenance_at_the_start(tmp_path, student_path, tokenizer, math_dataset):
    args = SFTConfig(
        output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=2, max_length=64, **CPU
    )
    trainer = StateLensSFTTrainer(
        model=str(student_path), args=args, train_dataset=math_dataset.select(range(4)), processing_class=tokenizer
    )
    trainer.train()
    record = json.loads((tmp_path / "run" / "statelens" / PROVENANCE_FILE).read_text())

    assert record["step"] == 0 and set(record) >= {"code", "versions", "models", "written_at"}
    for name in LIBRARIES:
        assert record["versions"][name] == installed(name), name
    code = record["code"]
    assert code["version"] == installed("trl-statelens")
    package = Path(trl_statelens.__file__).parent
    head = subprocess.run(["git", "-C", str(package), "rev-parse", "HEAD"], capture_output=True, text=True)
    tracked = subprocess.run(["git", "-C", str(package), "ls-files", "--error-unmatch", "__init__.py"], text=True,
                             capture_output=True).returncode == 0  # fmt: skip
    if head.returncode == 0 and tracked:
        assert code["commit"] == head.stdout.strip() and isinstance(code["dirty"], bool)
    else:  # an installed wheel: its version says which code
        assert code["commit"] is None and code["dirty"] is None

    # the starting weights (the training step moved them), hashed from the state dict
    student = record["models"]["student"]
    assert student["name"] == str(student_path) and student["method"] == "state_dict"
    assert student["sha256"] == weights_hash(load(student_path))["sha256"]
    assert student["sha256"] != weights_hash(trainer.model)["sha256"]

    # a resume keeps the start's record and adds its own, whose hashes (the checkpoint's) are not compared
    resumed = write_run_provenance(tmp_path / "run" / "statelens", trainer, step=1)
    assert resumed["models"] == record["models"] and [r["step"] for r in resumed["resumed"]] == [1]
    assert provenance_differences({"a": resumed, "b": record}) == []


def test_evaluation_and_results_files_record_provenance(tmp_path, student_path, tokenizer):
    model = load(student_path)
    out = tmp_path / "eval" / "after.json"
    evaluate_model(model, ["truthfulqa"], tokenizer=tokenizer, data_dir="lab", limit=2, out=out, progress=False)
    saved = json.loads(out.read_text())["provenance"]
    assert saved["models"]["model"]["sha256"] == weights_hash(model)["sha256"]
    assert saved["versions"]["transformers"] == installed("transformers")

    # results.json: the ledger's record, else the starting model's files hashed
    assert run_provenance(tmp_path, str(student_path))["models"]["student"]["method"] == "safetensors files"
    (tmp_path / "statelens").mkdir()
    (tmp_path / "statelens" / PROVENANCE_FILE).write_text(json.dumps(saved))
    assert run_provenance(tmp_path, str(student_path)) == saved


def test_the_weights_hash_changes_with_one_ulp_of_one_weight(tmp_path, student_path):
    model = load(student_path)
    start = weights_hash(model)
    assert start["dtypes"] == ["float32"] and weights_hash(load(student_path))["sha256"] == start["sha256"]
    undo = one_ulp_up(model)
    moved = weights_hash(model)["sha256"]
    assert moved != start["sha256"]
    model.save_pretrained(tmp_path / "moved")
    undo()
    assert weights_hash(model)["sha256"] == start["sha256"]

    # the files of a saved model: the same alternative, when the weights are sharded across processes
    on_disk = files_hash(student_path)
    assert on_disk["method"] == "safetensors files" and on_disk["sha256"] == files_hash(student_path)["sha256"]
    assert files_hash(tmp_path / "moved")["sha256"] != on_disk["sha256"]
    assert files_hash("org/not-a-folder")["sha256"] is None

    # a model whose parameters this process holds only part of (ZeRO-3 marks them with `ds_id`): its folder's files
    next(model.parameters()).ds_id = 0
    sharded = weights_hash(model)
    assert sharded.pop("seconds") >= 0 and sharded == {**on_disk, "name": str(student_path)}
    model.config._name_or_path = "org/a-hub-id"
    assert weights_hash(model)["sha256"] is None and "sharded" in weights_hash(model)["method"]


def write_run(folder: Path, record: dict | None, gsm8k: float) -> Path:
    scores = {"gsm8k": gsm8k, "truthfulqa": 0.4, "mmlu": 0.3}
    evaluation = {"scores": scores, "primary_metrics": {"gsm8k": "accuracy", "truthfulqa": "mc1", "mmlu": "accuracy"}}
    (folder / "statelens").mkdir(parents=True)
    (folder / "results.json").write_text(
        json.dumps({"run_name": folder.name, "before": evaluation, "after": evaluation})
    )
    if record is not None:
        (folder / "statelens" / PROVENANCE_FILE).write_text(json.dumps(record))
    return folder


def test_report_warns_when_runs_differ_in_a_version_and_a_weight_hash(tmp_path, student_path, capsys):
    model = load(student_path)
    record = provenance({"student": model})
    undo = one_ulp_up(model)
    other = copy.deepcopy(record)
    other["versions"]["transformers"] = "0.0.1"
    other["models"]["student"] = weights_hash(model)
    undo()
    runs = [write_run(tmp_path / "dec01", record, 0.30), write_run(tmp_path / "dec03", other, 0.31)]

    report = write_report(runs, tmp_path / "report").read_text()
    printed = capsys.readouterr().err
    assert "warning" in printed and "transformers: " in printed and "weights of " in printed
    weights = f"weights of {student_path} (state_dict sha256)"
    assert f"{weights}: {record['models']['student']['sha256'][:12]} (dec01); " in printed
    assert "## Provenance" in report and "> **Warning:**" in report
    rows = {line.split(" | ")[0].strip("| "): line for line in report.splitlines() if line.startswith("| ")}
    assert f"`{installed('transformers')}`" in rows["transformers"] and "`0.0.1`" in rows["transformers"]
    assert weights in rows and "torch" not in rows and "package commit" not in rows  # only what differs
    assert 'class="warning"' in (tmp_path / "report" / "report.html").read_text()


def test_report_says_nothing_when_provenance_agrees(tmp_path, student_path, capsys):
    model = load(student_path)
    first, again = provenance({"student": model}), provenance({"student": model})  # two starts, the same inputs
    again["models"]["teacher"] = weights_hash(torch.nn.Linear(2, 2))  # a model the other run has not: not compared
    runs = [write_run(tmp_path / "a", first, 0.30), write_run(tmp_path / "b", again, 0.30)]
    report = write_report(runs, tmp_path / "report").read_text()
    assert "Provenance" not in report and "warning" not in capsys.readouterr().err

    # a run from before provenance was recorded cannot be compared: a note, not a warning
    report = write_report([*runs, write_run(tmp_path / "old", None, 0.3)], tmp_path / "report2").read_text()
    assert "No provenance recorded" in report and "old" in report and "Warning" not in report


@pytest.mark.parametrize("what", ["commit", "dirty", "changes_sha256", "peft"])
def test_each_code_and_version_field_is_compared(what):
    record = {
        "code": {"commit": "a" * 40, "dirty": True, "changes_sha256": "1" * 64, "version": "0.1.0"},
        "versions": {"torch": "2.9.0", "peft": None},
        "models": {},
    }
    other = copy.deepcopy(record)
    if what == "peft":
        other["versions"]["peft"] = "0.17.1"
    else:
        other["code"][what] = {"commit": "b" * 40, "dirty": False, "changes_sha256": "2" * 64}[what]
    differences = provenance_differences({"x": record, "y": other})
    assert len(differences) == 1 and set(differences[0][1]) == {"x", "y"}
    if what == "peft":
        assert differences[0] == ("peft", {"x": "not installed", "y": "0.17.1"})
    assert provenance_differences({"x": record, "y": copy.deepcopy(record)}) == []


def test_a_served_teacher_is_named_not_hashed(tmp_path):
    trainer = SimpleNamespace(
        model=torch.nn.Linear(2, 2),
        args=SimpleNamespace(teacher_model_server_url="http://localhost:8000"),
    )
    record = write_run_provenance(tmp_path, trainer)
    assert record["models"]["teacher"] == {
        "name": "http://localhost:8000", "sha256": None, "method": "not hashed: a served teacher"
    }  # fmt: skip
    assert record["models"]["student"]["sha256"] is not None


@pytest.mark.slow
def test_a_recipe_run_folder_and_its_results_hold_the_provenance(tmp_path, monkeypatch, student_path, teacher_path):
    out = tmp_path / "opd"
    argv = ["--model_name_or_path", str(student_path), "--teacher_model_name_or_path", str(teacher_path)]
    argv += ["--output_dir", str(out), "--eval_tasks", "truthfulqa", "--eval_limit", "4", "--num_probes", "0"]
    argv += ["--max_steps", "1", "--per_device_train_batch_size", "2", "--num_generations", "2"]
    argv += ["--max_completion_length", "4", "--report_to", "none"]
    monkeypatch.setattr(sys, "argv", [str(RECIPES / "opd.py"), *argv])
    runpy.run_path(str(RECIPES / "opd.py"), run_name="__main__")

    results = json.loads((out / "results.json").read_text())
    assert results["provenance"] == json.loads((out / "statelens" / PROVENANCE_FILE).read_text())
    models = results["provenance"]["models"]
    for role, path in (("student", student_path), ("teacher", teacher_path)):
        assert models[role]["name"] == str(path) and models[role]["sha256"] == weights_hash(load(path))["sha256"]
    # each evaluation file: the weights it scored (the trained model's after training)
    for when, path in (("before", student_path), ("after", out)):
        saved = json.loads((out / "eval" / f"{when}.json").read_text())["provenance"]
        assert saved["models"]["model"]["name"] == str(path) and saved["versions"] == results["provenance"]["versions"]
    assert (
        json.loads((out / "eval" / "after.json").read_text())["provenance"]["models"]["model"]["sha256"]
        == (weights_hash(load(out))["sha256"])
    )


def test_code_outside_a_checkout_is_named_by_its_version(tmp_path):
    package = tmp_path / "repo" / ".venv" / "site-packages" / "trl_statelens"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    assert code_provenance(package)["commit"] is None  # no checkout at all
    git = ["git", "-C", str(tmp_path / "repo"), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "repo" / "README").write_text("x")
    subprocess.run([*git, "add", "README"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    # installed into a venv inside some other checkout: that checkout's commit is not the package's
    record = code_provenance(package)
    assert record["commit"] is None and record["dirty"] is None and record["version"] == installed("trl-statelens")
    # the package tracked in it: its commit, and an edit makes it dirty with a hash of the edit
    subprocess.run([*git, "add", "-f", str(package / "__init__.py")], check=True)
    subprocess.run([*git, "commit", "-qm", "package"], check=True)
    clean = code_provenance(package)
    assert len(clean["commit"]) == 40 and clean["dirty"] is False and clean["changes_sha256"] is None
    (package / "__init__.py").write_text("x = 1\n")
    edited = code_provenance(package)
    (package / "__init__.py").write_text("x = 2\n")
    other_edit = code_provenance(package)
    assert edited["dirty"] and edited["commit"] == clean["commit"]
    assert edited["changes"] == other_edit["changes"] and edited["changes_sha256"] != other_edit["changes_sha256"]
