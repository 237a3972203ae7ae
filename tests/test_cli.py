"""The `statelens` command imports only what each command needs; `import trl_statelens` still gives every name."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import trl_statelens
from trl_statelens import lab
from trl_statelens.cli import main as statelens

HEAVY = ("torch", "transformers", "trl", "datasets", "accelerate", "pandas", "matplotlib", "peft", "deepspeed")

# Runs the CLI in a fresh interpreter and prints which heavy top-level packages it imported.
PROBE = """
import contextlib, io, json, sys
from trl_statelens.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        code = main({argv!r})
    except SystemExit as exit:
        code = exit.code
heavy = sorted({{name.split(".")[0] for name in sys.modules}} & set({heavy!r}))
print(json.dumps({{"code": code, "heavy": heavy, "out": out.getvalue()}}))
"""

INFO = {
    "size": "test",
    "parameters": 123456,
    "pretrain_steps": 20,
    "build_seconds": 12.0,
    "test_scores": {"math": 0.2, "kb": 1.0, "truth": 0.9},
    "in_band": True,
}


def run_cli(argv, env_home):
    code = PROBE.format(argv=argv, heavy=HEAVY)
    env = {"STATELENS_HOME": str(env_home), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = str(Path(trl_statelens.__file__).parents[1])  # this checkout, not an installed copy
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--help"], "{lab,eval,report,preflight,guards}"),
        (["preflight", "--help"], "1 when a check fails"),
        (["report", "--help"], "--base RUN_DIR"),
        (["lab", "info"], "math 0.200  kb (MMLU analog) 1.000"),
        (["lab", "info", "--json"], '"pretrain_steps": 20'),
    ],
)
def test_light_commands_import_no_heavy_package(tmp_path, argv, expect):
    (tmp_path / "lab" / "v2" / "seed0").mkdir(parents=True)
    (tmp_path / "lab" / "v2" / "seed0" / "info.json").write_text(json.dumps(INFO))
    result = run_cli(argv, tmp_path)
    assert result["code"] in (0, None)
    assert expect in result["out"]
    assert result["heavy"] == [], f"`statelens {' '.join(argv)}` imported {result['heavy']}"


def test_eval_arguments_still_parse(capsys):
    with pytest.raises(SystemExit) as exit:
        statelens(["eval", "--help"])
    assert exit.value.code == 0
    assert "--model MODEL" in capsys.readouterr().out


@pytest.mark.parametrize("module", [trl_statelens, lab])
def test_every_public_name_resolves(module):
    for name in module.__all__:
        assert getattr(module, name) is not None, name
        assert name in dir(module)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        module.not_a_name  # noqa: B018


def test_import_star_and_from_import():
    namespace = {}
    exec("from trl_statelens import *", namespace)
    assert {"StateLensSFTTrainer", "OnPolicyDistillTrainer", "StateLoggingCallback"} <= set(namespace)
    from trl_statelens import StateLensGRPOTrainer, StateRecorderMixin

    assert issubclass(StateLensGRPOTrainer, StateRecorderMixin)


# ----- statelens preflight ---------------------------------------------------------------------------------------------
LAB_CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "lab"
SMALL_RUN = ["--num_probes", "0", "--per_device_train_batch_size", "4"]


def test_preflight_builds_the_recipes_trainer_and_exits_with_its_verdict(
    tmp_path, capsys, math_trained_path, math_teacher_path
):
    models = ["--model_name_or_path", str(math_trained_path), "--teacher_model_name_or_path", str(math_teacher_path)]
    config = str(LAB_CONFIGS / "opd.yaml")
    few = ["--preflight_prompts", "4"]  # OPD's config field (the SFT and GRPO trainers take it as a keyword)
    code = statelens(["preflight", config, *models, "--output_dir", str(tmp_path / "ok"), *SMALL_RUN, *few])
    printed = capsys.readouterr().out
    written = json.loads((tmp_path / "ok" / "statelens" / "preflight.json").read_text())
    assert written["trainer"] == "OnPolicyDistillTrainer" and written["prompts"] == 4
    assert written["verdict"] in ("pass", "warn") and code == 0
    assert "teacher/end_after_answer" in printed and str(tmp_path / "ok") in printed
    # an answer budget of 2 tokens cuts every rollout: the teacher's cut answers fail (the student's warn: the teacher
    # is there to fix those), and so does the command
    cut = ["--max_completion_length", "2", "--output_dir", str(tmp_path / "cut")]
    assert statelens(["preflight", config, *models, *cut, *SMALL_RUN, *few]) == 1
    written = json.loads((tmp_path / "cut" / "statelens" / "preflight.json").read_text())
    verdicts = {c["name"]: c["verdict"] for c in written["checks"]}
    assert written["verdict"] == "fail" and verdicts["teacher/length_limit_share"] == "fail"
    assert verdicts["student/length_limit_share"] == "warn"
    assert not (tmp_path / "cut" / "statelens" / "steps.jsonl").exists()  # nothing trained


def test_preflight_names_the_recipe_by_the_config_and_runs_sft(tmp_path, capsys, student_path):
    out = tmp_path / "sft"
    code = statelens(["preflight", str(LAB_CONFIGS / "sft.yaml"), "--model_name_or_path", str(student_path),
                      "--output_dir", str(out), *SMALL_RUN])  # fmt: skip
    written = json.loads((out / "statelens" / "preflight.json").read_text())
    assert written["trainer"] == "StateLensSFTTrainer"
    assert code == (1 if written["verdict"] == "fail" else 0)
    assert "data/ends_with_end_token" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        ([str(LAB_CONFIGS / "eval.yaml")], "--recipe opd|self_distill|grpo|sft"),
        ([str(LAB_CONFIGS / "grpo.yaml"), "--baseline", "stock"], "leave --baseline at 'statelens'"),
        (["no-such.yaml", "--recipe", "sft"], "no config file no-such.yaml"),
        ([str(LAB_CONFIGS / "sft.yaml"), "--preflight", "loud"], "preflight='loud' is not one of"),
    ],
)
def test_preflight_refuses_what_it_cannot_build_with_exit_2(tmp_path, capsys, argv, message):
    assert statelens(["preflight", *argv, "--output_dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "statelens").exists()


def test_preflight_leaves_a_trained_runs_folder_alone(tmp_path, capsys):
    ledger = tmp_path / "statelens" / "steps.jsonl"
    ledger.parent.mkdir()
    ledger.write_text('{"step": 1}\n')
    assert statelens(["preflight", str(LAB_CONFIGS / "sft.yaml"), "--output_dir", str(tmp_path)]) == 2
    assert "holds a trained run's records" in capsys.readouterr().err
    assert not (tmp_path / "statelens" / "preflight.json").exists()
