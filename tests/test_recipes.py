"""The recipes end to end on `test`-size lab models: one process, DDP, DeepSpeed ZeRO-2 and ZeRO-3, stock baselines."""

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
import yaml
from launching import free_port, launch
from trl import DistillationConfig, GRPOConfig, ModelConfig, SFTConfig, TrlParser

from trl_statelens import OnPolicyDistillConfig
from trl_statelens.evaluation import item_scores
from trl_statelens.evaluation.gsm8k import GSM8KTask
from trl_statelens.reports.runs import RecipeArguments, print_summary, target_change

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
TINY_RUN = ["--eval_limit", "8", "--eval_max_new_tokens", "8", "--num_probes", "2", "--probe_steps", "1",
            "--ledger_sample_rate", "1.0", "--logging_steps", "1", "--max_steps", "2"]  # fmt: skip
RECIPE_FLAGS = {
    "sft": ["--per_device_train_batch_size", "4", "--max_length", "160"],
    "grpo": ["--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "8"],
    "opd": ["--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "8"],
}


def run_in_process(recipe: str, argv: list[str], monkeypatch) -> dict:
    monkeypatch.setattr(sys, "argv", [str(RECIPES / f"{recipe}.py"), *argv])
    runpy.run_path(str(RECIPES / f"{recipe}.py"), run_name="__main__")
    return json.loads((Path(argv[argv.index("--output_dir") + 1]) / "results.json").read_text())


def model_flags(recipe, student_path, teacher_path):
    flags = ["--model_name_or_path", str(student_path)]
    return flags + (["--teacher_model_name_or_path", str(teacher_path)] if recipe == "opd" else [])


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["sft", "grpo", "opd"])
@pytest.mark.parametrize("baseline", ["statelens", "stock"])
def test_recipe_writes_results_and_ledger(tmp_path, monkeypatch, capsys, student_path, teacher_path, recipe, baseline):
    out = tmp_path / f"{recipe}_{baseline}"
    argv = [*model_flags(recipe, student_path, teacher_path), "--output_dir", str(out), "--baseline", baseline]
    results = run_in_process(recipe, argv + TINY_RUN + RECIPE_FLAGS[recipe], monkeypatch)

    stock = {"sft": "SFTTrainer", "grpo": "GRPOTrainer", "opd": "DistillationTrainer"}[recipe]
    assert (results["trainer"] == stock) == (baseline == "stock")
    assert results["global_steps"] == 2 and results["distributed"]["num_processes"] == 1
    for when in ("before", "after"):
        assert set(results[when]["scores"]) == {"gsm8k", "truthfulqa", "mmlu"}
        assert (out / "eval" / f"{when}.json").exists() and (out / "eval" / f"{when}.items.jsonl").exists()
    assert set(results["retention"]) == {"forgetting", "retention"}
    # the same layout for both baselines: drift always, per-step state records only from a StateLens trainer
    drift = [json.loads(line) for line in (out / "statelens" / "drift.jsonl").read_text().splitlines()]
    assert [d["step"] for d in drift] == [1, 2] and results["final_drift"] == drift[-1]
    steps_file = out / "statelens" / "steps.jsonl"
    assert steps_file.exists() == (baseline == "statelens")
    if baseline == "statelens":
        assert [json.loads(line)["step"] for line in steps_file.read_text().splitlines()] == [1, 2]
    assert (out / "model.safetensors").exists() and json.loads((out / "log_history.json").read_text())
    # the summary's target change: after - before on the same problems, inside its bootstrap interval
    change = results["target_change"]
    items = {when: [json.loads(line) for line in (out / "eval" / f"{when}.items.jsonl").read_text().splitlines()]
             for when in ("before", "after")}  # fmt: skip
    correct = {w: [i["correct_strict"] for i in items[w] if i["task"] == "gsm8k"] for w in items}
    assert change["num_items"] == 8
    assert change["change"] == pytest.approx((sum(correct["after"]) - sum(correct["before"])) / 8)
    assert change["ci95"][0] <= change["change"] <= change["ci95"][1]
    # the teacher scored on the target beside the student (OPD), and the run's own report and states page
    assert (results["teacher_eval"] is not None) == (recipe == "opd")
    if recipe == "opd":
        assert set(results["teacher_eval"]["scores"]) == {"gsm8k"}
    assert (out / "report" / "report.html").exists() and (out / "report" / "states.html").exists()
    printed = capsys.readouterr().out
    assert f"report: {out / 'report' / 'report.html'}" in printed and "95% interval" in printed


@pytest.mark.slow
def test_recipe_evaluates_under_the_lm_eval_protocol(tmp_path, monkeypatch, student_path, teacher_path):
    out = tmp_path / "sft_lm_eval"
    argv = [*model_flags("sft", student_path, teacher_path), "--output_dir", str(out), "--eval_protocol", "lm-eval"]
    run_in_process("sft", argv + TINY_RUN + ["--eval_tasks", "gsm8k,truthfulqa"] + RECIPE_FLAGS["sft"], monkeypatch)
    for when in ("before", "after"):
        evaluation = json.loads((out / "eval" / f"{when}.json").read_text())
        assert evaluation["protocol"] == "lm-eval"
        assert {s["protocol"] for s in evaluation["settings"].values()} == {"lm-eval"}
        assert evaluation["settings"]["gsm8k"]["num_shots"] == 5  # lm-eval's GSM8K default, not ours (0)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("recipe", "baseline"), [("sft", "statelens"), ("grpo", "statelens"), ("opd", "statelens"), ("sft", "stock")]
)
def test_recipe_scores_the_target_during_training(tmp_path, monkeypatch, student_path, teacher_path, recipe, baseline):
    from trl_statelens.reports.pages import write_report
    from trl_statelens.reports.run_folders import compute_curve, load_run, sample_efficiency_curve

    out = tmp_path / f"{recipe}_{baseline}"
    argv = [*model_flags(recipe, student_path, teacher_path), "--output_dir", str(out), "--baseline", baseline]
    during = ["--max_steps", "5", "--target_eval_steps", "2", "--target_eval_limit", "4", "--eval_tasks", "gsm8k"]
    results = run_in_process(recipe, argv + TINY_RUN + RECIPE_FLAGS[recipe] + during, monkeypatch)

    log_history = json.loads((out / "log_history.json").read_text())
    scored = [entry for entry in log_history if "eval/gsm8k/accuracy_strict" in entry]
    assert [entry["step"] for entry in scored] == [2, 4]  # every 2 steps of 5, no step-0 evaluation (`before` is it)
    for entry in scored:
        for metric in ("accuracy_strict", "accuracy_flexible", "answer_found"):
            assert 0.0 <= entry[f"eval/gsm8k/{metric}"] <= 1.0
            assert (entry[f"eval/gsm8k/{metric}"] * 4).is_integer()  # 4 items (--target_eval_limit)
        # the scores' own entry: the step's training metrics stay in the trainer's entry
        assert {key for key in entry if not key.startswith("eval/")} <= {"step", "epoch"}
        # each evaluation's items beside it, scoring what was logged (an interval over items needs them)
        items = item_scores(out / "eval" / "steps" / f"step{entry['step']}.items.jsonl", "gsm8k", "correct_strict")
        assert len(items) == 4 and sum(items.values()) / 4 == entry["eval/gsm8k/accuracy_strict"]
    assert sorted(p.name for p in (out / "eval" / "steps").iterdir()) == ["step2.items.jsonl", "step4.items.jsonl"]
    trained = [entry["step"] for entry in log_history if "loss" in entry]
    assert trained == [1, 2, 3, 4, 5]
    if baseline == "statelens":
        assert [entry["step"] for entry in log_history if "statelens/supervised_tokens" in entry] == trained
    assert 0.0 <= results["after"]["scores"]["gsm8k"] <= 1.0 and results["before"]["settings"]["gsm8k"]["limit"] == 8

    run = load_run(out)
    curve = sample_efficiency_curve(run, None)
    if baseline == "stock":  # no ledger, so no supervised tokens to plot against
        assert curve is None and "not in the sample-efficiency plot" in "; ".join(run.notes)
        return
    ledger = [json.loads(line) for line in (out / "statelens" / "steps.jsonl").read_text().splitlines()]
    tokens = [line["supervised_tokens"] for line in ledger]
    assert [line["step"] for line in ledger] == [1, 2, 3, 4, 5] and min(tokens) > 0
    x, y = curve
    assert x.tolist() == [0.0, sum(tokens[:2]), sum(tokens[:4]), sum(tokens)]  # before, step 2, step 4, after
    before, after = results["before"]["scores"]["gsm8k"], results["after"]["scores"]["gsm8k"]
    assert y.tolist() == [before, *(entry["eval/gsm8k/accuracy_strict"] for entry in scored), after]
    write_report([out], tmp_path / "report")
    assert (tmp_path / "report" / "sample_efficiency.png").stat().st_size > 0
    assert (tmp_path / "report" / "compute.png").stat().st_size > 0

    # compute: parameters that multiply (an untied input embedding is a lookup) x the tokens TRL counted
    compute = results["compute"]
    n_student, n_teacher = matmul_parameters_of(student_path), matmul_parameters_of(teacher_path)
    assert compute["student_parameters"] == n_student
    per_token = {"sft": 6 * n_student, "grpo": 10 * n_student, "opd": 8 * n_student + 2 * n_teacher}[recipe]
    assert compute["flops_per_token"] == per_token  # grpo: the lab config's beta 0.04 adds a reference forward
    logged_tokens = {entry["step"]: entry["num_tokens"] for entry in log_history if "num_tokens" in entry}
    assert compute["tokens"] == logged_tokens[5] and compute["flops"] == per_token * logged_tokens[5]
    flops, scores = compute_curve(run)
    assert flops.tolist() == [0.0, per_token * logged_tokens[2], per_token * logged_tokens[4], compute["flops"]]
    # the ledger's running count by part ends at results.json's; the teacher's tokens are the ledger's
    assert ledger[-1]["flops_total/total"] == pytest.approx(compute["flops"])
    for part in ("teacher_scoring", "teacher_writing"):
        assert ledger[-1][f"flops_total/{part}"] == compute["flops_by_part"][part]
    assert compute["teacher_tokens"] == (sum(line["teacher_tokens"] for line in ledger) if recipe == "opd" else None)
    assert scores.tolist() == y.tolist()
    # the report's compute table: the first evaluation reaching start + 0.05 (here, a 4-item score moves by 0.25)
    gained = [i for i, score in enumerate(scores) if score >= scores[0] + 0.05 - 1e-9]
    expected = f"{flops[gained[0]]:.2e}" if gained else "not reached"
    table = (tmp_path / "report" / "report.md").read_text().split("## Compute to reach a target score")[1]
    row = next(line for line in table.splitlines() if line.startswith(f"| {run.label} |"))
    assert row.split(" | ")[1:3] == [f"{scores[0]:.3f}", expected]


def matmul_parameters_of(path) -> int:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight
    return sum(p.numel() for p in model.parameters()) - (0 if tied else embedding.numel())


def test_target_eval_flags_are_checked():
    assert RecipeArguments().target_eval_steps == 0  # off unless asked: it runs inside the training loop
    with pytest.raises(ValueError, match="--target_eval_steps is a number of steps"):
        RecipeArguments(target_eval_steps=-1)
    with pytest.raises(ValueError, match="--target_eval_limit must be a positive number"):
        RecipeArguments(target_eval_steps=5, target_eval_limit=0)


def test_target_change_reads_the_chosen_per_problem_score(tmp_path, capsys):
    """`--target_metric answer_found` (the real-model demo's target): the change line is the share of answers with a
    `#### N` line, paired by question, from the records GSM8KTask.score wrote."""
    task = GSM8KTask(source="lab", split="test")
    outputs = {
        "before": ["It is 3.", "#### 4", "so 5", "7 then 8", "9"],
        "after": ["#### 3", "#### 4", "#### 6", "7 then 8", "#### 9\n#### 9\n#### 9"],  # q4 loops on its answer
    }
    (tmp_path / "eval").mkdir()
    for when, texts in outputs.items():
        records = [{"task": "gsm8k", "question": f"q{i}", "output": text, **task.score(text, {"ground_truth": "4"})}
                   for i, text in enumerate(texts)]  # fmt: skip
        (tmp_path / "eval" / f"{when}.items.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    found = target_change(tmp_path, "answer_found")
    assert found["metric"] == "answer_found" and found["num_items"] == 5
    assert found["change"] == pytest.approx(3 / 5)  # q0, q2 and q4 gained a `#### N` line
    assert found["ci95"][0] <= 0.6 <= found["ci95"][1]
    assert target_change(tmp_path)["change"] == 0.0  # strict accuracy: q1 right before and after, the rest wrong
    # clean format (the demo's target since 2026-12-05): q0 and q2 end on their one answer line, q4's loop does not
    assert target_change(tmp_path, "clean_format")["change"] == pytest.approx(2 / 5)
    print_summary({"recipe": "x", "trainer": "T", "global_steps": 1, "train_seconds": 1.0, "before": None,
                   "after": None, "target_change": found, "retention": None, "final_drift": None}, [], tmp_path)  # fmt: skip
    assert "gsm8k answer_found change +0.600, 95% interval" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--target_metric must be one of"):
        RecipeArguments(target_metric="accuracy")


def test_recipe_rejects_an_unknown_eval_protocol(tmp_path, monkeypatch, student_path, teacher_path):
    argv = [*model_flags("sft", student_path, teacher_path), "--output_dir", str(tmp_path / "x")]
    with pytest.raises(ValueError, match="--eval_protocol must be"):
        run_in_process("sft", argv + TINY_RUN + ["--eval_protocol", "lm_eval"], monkeypatch)
    assert not (tmp_path / "x" / "eval").exists()  # refused before any work


@pytest.mark.parametrize("recipe", ["sft", "grpo"])
def test_recipe_sets_the_trainers_guards_and_preflight(tmp_path, student_path, teacher_path, recipe):
    """`guards`, `preflight` and `preflight_prompts` are the StateLens trainers' keywords, not TRL config fields: the
    SFT and GRPO recipes take them as their own arguments. With `--guards off --preflight off` the trainer holds no
    guard and a step writes no preflight.json; by default it holds both; a bad mode is refused as it is read."""
    from trl_statelens import RunGuards
    from trl_statelens.preflight import PreflightCallback

    namespace = runpy.run_path(str(RECIPES / f"{recipe}.py"))  # the recipe's functions, as `statelens preflight` does

    def build(*flags):
        out = ["--output_dir", str(tmp_path / "_".join(flags or ("default",))), "--max_steps", "1", "--use_cpu"]
        argv = [*model_flags(recipe, student_path, teacher_path), *out, *RECIPE_FLAGS[recipe], *flags]
        return namespace["build_trainer"](*namespace["parse_arguments"](argv))[0]

    def held(trainer, kind):
        return any(isinstance(callback, kind) for callback in trainer.callback_handler.callbacks)

    off = build("--guards", "off", "--preflight", "off")
    assert not held(off, RunGuards) and not held(off, PreflightCallback)
    off.train()
    assert (Path(off.args.output_dir) / "statelens" / "steps.jsonl").exists()  # it trained, with its records
    assert not (Path(off.args.output_dir) / "statelens" / "preflight.json").exists()
    default = build()
    assert held(default, RunGuards) and held(default, PreflightCallback)
    assert build("--preflight_prompts", "4")._preflight_prompts == 4
    if recipe == "sft":  # the forgetting guard's budget: one RunGuards, in the run's mode, with that budget
        (guards,) = [cb for cb in build("--guards", "stop", "--max_base_kl", "0.1").callback_handler.callbacks
                     if isinstance(cb, RunGuards)]  # fmt: skip
        assert guards.mode == "stop" and guards.guards.max_base_kl == 0.1
    with pytest.raises(ValueError, match="guards must be one of"):
        namespace["parse_arguments"](["--output_dir", str(tmp_path / "bad"), "--guards", "halt"])


def test_resolve_model_passes_hub_ids_and_refuses_missing_paths(tmp_path):
    from trl_statelens.reports.runs import resolve_model

    for hub_id in ("Qwen/Qwen3-0.6B-Base", "HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2"):  # the study configs' ids
        assert resolve_model(hub_id) == hub_id
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    for missing in ("./runs/none", "runs/study/mild_sft", str(tmp_path / "none"), "~/no/such/model"):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            resolve_model(missing)


# ----- configs ---------------------------------------------------------------------------------------------------
CONFIG_TYPES = {
    "eval": None,
    "sft": SFTConfig,
    "stress_sft": SFTConfig,
    "mild_sft": SFTConfig,
    "grpo": GRPOConfig,
    "opd": OnPolicyDistillConfig,
}


def recipe_of(config_path: Path) -> str:
    name = config_path.stem
    if name.startswith(("opd", "self_distill")):
        return "self_distill" if name.startswith("self_distill") else "opd"
    return "eval" if "eval" in name else ("grpo" if "grpo" in name else "sft")


@pytest.mark.parametrize(
    "config", sorted((RECIPES / "configs").rglob("*.yaml")), ids=lambda p: p.parent.name + "/" + p.name
)
def test_every_config_parses_into_its_recipe_types(config):
    recipe = recipe_of(config)
    namespace = runpy.run_path(str(RECIPES / f"{recipe}.py"))
    script_type = next((v for k, v in namespace.items() if k.endswith("ScriptArguments")), RecipeArguments)
    training_type = {"sft": SFTConfig, "grpo": GRPOConfig, "opd": OnPolicyDistillConfig,
                     "self_distill": OnPolicyDistillConfig}.get(recipe)  # fmt: skip
    types = (script_type, training_type, ModelConfig) if training_type else (script_type, ModelConfig)
    raw = yaml.safe_load(config.read_text())
    # GPU configs ask for bf16, which TrainingArguments refuses on a machine without a GPU: parse them as on CPU
    on_cpu = ["--bf16", "false", "--use_cpu", "true"] if raw.get("bf16") and training_type else []
    parsed = TrlParser(types).parse_args_and_config(args=["--config", str(config), *on_cpu])
    assert isinstance(parsed[0], RecipeArguments)
    if on_cpu:
        del raw["bf16"]
    normalised = {("report_to", "none"): []}  # TrainingArguments turns "none" into an empty list
    for key, value in raw.items():  # every key landed in a field with the YAML's value
        holder = next(p for p in parsed if hasattr(p, key))
        expected = normalised.get((key, value), value)
        assert getattr(holder, key) == expected or str(getattr(holder, key)) == str(expected), key


def test_study_configs_state_the_papers_numbers():
    study = RECIPES / "configs" / "study"
    stress = yaml.safe_load((study / "stress_sft.yaml").read_text())
    assert (stress["num_train_epochs"], stress["learning_rate"]) == (5, 5.0e-4)
    assert (stress["use_peft"], stress["lora_r"], stress["lora_alpha"]) == (True, 64, 128)
    for path in study.glob("*.yaml"):
        config = yaml.safe_load(path.read_text())
        assert config["model_name_or_path"] == "Qwen/Qwen3-0.6B-Base" or "runs/study" in config["model_name_or_path"]
        assert config.get("dataset_name", "openai/gsm8k") == "openai/gsm8k" and config["prompt_format"] == "plain"
    opd = yaml.safe_load((study / "opd_from_stress_sft.yaml").read_text())
    assert opd["signal"] == "continuation" and opd["teacher_model_name_or_path"] == "runs/study/stress_sft"


def test_stock_distillation_config_copies_the_run(tmp_path):
    ours = OnPolicyDistillConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, learning_rate=3e-4, max_steps=7,
                                 per_device_train_batch_size=8, max_completion_length=32, jsd_beta=1.0, seed=5)  # fmt: skip
    stock = ours.to_distillation_config()
    assert isinstance(stock, DistillationConfig) and stock.beta == 1.0
    for name in ("learning_rate", "max_steps", "per_device_train_batch_size", "max_completion_length", "seed"):
        assert getattr(stock, name) == getattr(ours, name)


# ----- bad configs fail at start, with the reason ------------------------------------------------------------------
def test_unknown_config_field_is_named(tmp_path, monkeypatch):
    config = tmp_path / "bad.yaml"
    config.write_text("learning_rate: 1.0e-4\nlearning_rat: 3\nuse_cpu: true\nbf16: false\n")
    with pytest.raises(ValueError, match="learning_rat"):
        run_in_process("sft", ["--config", str(config), "--output_dir", str(tmp_path / "out")], monkeypatch)


def test_missing_teacher_and_missing_model_fail_before_training(tmp_path, monkeypatch, student_path):
    argv = ["--output_dir", str(tmp_path / "out")]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run_in_process("opd", ["--model_name_or_path", str(student_path), "--teacher_model_name_or_path",
                               str(tmp_path / "no_teacher"), *argv], monkeypatch)  # fmt: skip
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run_in_process("sft", ["--model_name_or_path", "./runs/nothing-here", *argv], monkeypatch)
    assert not (tmp_path / "out").exists()


# ----- several processes: assert what actually ran --------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(
    "accelerate_config, recipe, expected",
    [
        ("ddp", "sft", {"type": "MULTI_CPU", "zero_stage": None, "engine": "DistributedDataParallel"}),
        ("zero2", "grpo", {"type": "DEEPSPEED", "zero_stage": 2, "engine": "DeepSpeedEngine"}),
        ("zero3", "opd", {"type": "DEEPSPEED", "zero_stage": 3, "engine": "DeepSpeedEngine",
                          "teacher_engine": "DeepSpeedEngine"}),
    ],
)  # fmt: skip
def test_recipe_under_accelerate_launch(tmp_path, student_path, teacher_path, accelerate_config, recipe, expected):
    out = tmp_path / "run"
    command = [
        str(Path(sys.executable).parent / "accelerate"), "launch",
        "--config_file", str(RECIPES / "accelerate" / f"{accelerate_config}.yaml"),
        "--num_processes", "2", "--main_process_port", str(free_port()),
        str(RECIPES / f"{recipe}.py"), *model_flags(recipe, student_path, teacher_path),
        "--output_dir", str(out), *TINY_RUN, *RECIPE_FLAGS[recipe],
        "--target_eval_steps", "1", "--target_eval_limit", "2",  # every rank generates: ZeRO-3 needs them all
    ]  # fmt: skip
    launch(command, {"DS_ACCELERATOR": "cpu"}, timeout=600, outputs=out)
    results = json.loads((out / "results.json").read_text())
    ran = results["distributed"]
    assert ran["num_processes"] == 2
    for key, value in expected.items():
        assert ran[key] == value, (key, ran)
    steps = [json.loads(line) for line in (out / "statelens" / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    states = [json.loads(line) for line in (out / "statelens" / "states.jsonl").read_text().splitlines()]
    assert {s["rank"] for s in states} == {0, 1}  # both ranks' states reached the ledger
    assert results["after"]["scores"]
    log_history = json.loads((out / "log_history.json").read_text())
    scored = [e for e in log_history if "eval/gsm8k/accuracy_strict" in e]
    assert [e["step"] for e in scored] == [1, 2]
    for entry in scored:  # one writer: the main process's items, whole
        items = item_scores(out / "eval" / "steps" / f"step{entry['step']}.items.jsonl", "gsm8k", "correct_strict")
        assert len(items) == 2 and sum(items.values()) / 2 == entry["eval/gsm8k/accuracy_strict"]


# ----- the study chain: LoRA SFT -> its adapter folder as the OPD teacher, both arms -------------------------------------
STUDY = RECIPES / "configs" / "study"
ON_CPU_TINY = ["--use_cpu", "true", "--bf16", "false", "--dataset_name", "lab", "--eval_tasks", "", "--num_probes",
               "0", "--max_steps", "1", "--logging_steps", "1", "--lora_r", "4", "--lora_alpha", "8"]  # fmt: skip


@pytest.mark.slow
def test_study_configs_chain_lora_sft_into_both_opd_arms(tmp_path, monkeypatch, student_path):
    sft_out = tmp_path / "mild_sft"
    run_in_process("sft", ["--config", str(STUDY / "mild_sft.yaml"), "--model_name_or_path", str(student_path),
                           "--output_dir", str(sft_out), "--per_device_train_batch_size", "4", "--max_length", "96",
                           *ON_CPU_TINY], monkeypatch)  # fmt: skip
    assert (sft_out / "adapter_config.json").exists() and not (sft_out / "model.safetensors").exists()
    for config, baseline in (("opd_from_mild_sft", "statelens"), ("opd_from_stress_sft", "stock")):
        out = tmp_path / config
        argv = ["--config", str(STUDY / f"{config}.yaml"), "--model_name_or_path", str(student_path),
                "--teacher_model_name_or_path", str(sft_out), "--output_dir", str(out), "--baseline", baseline,
                "--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "8",
                "--continuation_length", "4", *ON_CPU_TINY]  # fmt: skip
        results = run_in_process("opd", argv, monkeypatch)
        assert results["global_steps"] == 1 and results["teacher"] == str(sft_out)
        assert results["trainer"] == ("DistillationTrainer" if baseline == "stock" else "OnPolicyDistillTrainer")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("config", "baseline"), [("opd_from_mild_sft", "statelens"), ("opd_from_stress_sft", "stock")]
)
def test_lora_sft_teacher_under_zero3(tmp_path, monkeypatch, student_path, config, baseline):
    """The README's multi-GPU line: a LoRA SFT run's adapter folder as the OPD teacher of 2 ZeRO-3 processes. The
    adapter is merged into whole weights, then partitioned: gathered, they equal a one-process merge of the folder."""
    from safetensors.torch import load_file

    from trl_statelens.teachers import load_teacher

    sft_out = tmp_path / "mild_sft"
    run_in_process("sft", ["--config", str(STUDY / "mild_sft.yaml"), "--model_name_or_path", str(student_path),
                           "--output_dir", str(sft_out), "--per_device_train_batch_size", "4", "--max_length", "96",
                           *ON_CPU_TINY], monkeypatch)  # fmt: skip
    out = tmp_path / config
    command = [
        str(Path(sys.executable).parent / "accelerate"), "launch",
        "--config_file", str(RECIPES / "accelerate" / "zero3.yaml"), "--num_processes", "2",
        "--main_process_port", str(free_port()), str(ROOT / "tests" / "scripts" / "opd_recipe_teacher_weights.py"),
        str(tmp_path), "--config", str(STUDY / f"{config}.yaml"), "--model_name_or_path", str(student_path),
        "--teacher_model_name_or_path", str(sft_out), "--output_dir", str(out), "--baseline", baseline,
        "--per_device_train_batch_size", "2", "--num_generations", "2", "--max_completion_length", "4",
        "--continuation_length", "2", *ON_CPU_TINY,
    ]  # fmt: skip
    launch(command, {"DS_ACCELERATOR": "cpu"}, timeout=300, outputs=out)
    results = json.loads((out / "results.json").read_text())
    assert results["global_steps"] == 1 and results["teacher"] == str(sft_out)
    assert results["trainer"] == ("DistillationTrainer" if baseline == "stock" else "OnPolicyDistillTrainer")
    assert (results["distributed"]["zero_stage"], results["distributed"]["teacher_engine"]) == (3, "DeepSpeedEngine")

    merged = load_teacher(str(sft_out), OnPolicyDistillConfig(str(tmp_path / "one_process"), use_cpu=True))
    expected = {name: p.detach() for name, p in merged.named_parameters()}
    base = load_file(student_path / "model.safetensors")
    assert not torch.equal(expected["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])  # fmt: skip  # the adapter changed it
    for rank in range(2):
        saved = torch.load(tmp_path / f"teacher_rank{rank}.pt", weights_only=True)
        assert saved["engine"] == "DeepSpeedEngine" and any(saved["partitioned"])  # ZeRO-3 shards, gathered
        assert saved["weights"].keys() == expected.keys()
        for name, weight in expected.items():
            assert torch.equal(saved["weights"][name], weight), name


@pytest.mark.slow
@pytest.mark.parametrize("baseline", ["statelens", "stock"])
def test_self_distill_recipe_writes_results_and_ledger(tmp_path, monkeypatch, student_path, baseline):
    """recipes/self_distill.py: the student as its own teacher behind the reference solution (the data's
    `privileged_context`), or TRL's SDFTTrainer on the same run; every signal it maps runs stock."""
    out = tmp_path / f"self_distill_{baseline}"
    argv = ["--model_name_or_path", str(student_path), "--output_dir", str(out), "--baseline", baseline,
            *TINY_RUN, "--per_device_train_batch_size", "4", "--num_generations", "1",
            "--max_completion_length", "8"]  # fmt: skip
    results = run_in_process("self_distill", argv, monkeypatch)
    assert results["trainer"] == ("SDFTTrainer" if baseline == "stock" else "OnPolicyDistillTrainer")
    assert results["recipe"] == "self_distill" and results["global_steps"] == 2
    assert set(results["after"]["scores"]) == {"gsm8k", "truthfulqa", "mmlu"} and results["retention"]
    drift = [json.loads(line) for line in (out / "statelens" / "drift.jsonl").read_text().splitlines()]
    assert [d["step"] for d in drift] == [1, 2] and drift[-1]["base_kl"] is not None
    history = json.loads((out / "log_history.json").read_text())
    if baseline == "stock":  # TRL's own loss metric, no ledger
        assert any("self_distillation/distillation_loss" in entry for entry in history)
        assert not (out / "statelens" / "steps.jsonl").exists()
        return
    steps = [json.loads(line) for line in (out / "statelens" / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["source_frac/learner"] == 1.0 for s in steps)
    assert any("teacher_kl/sampled" in entry for entry in history)
    # the ledger's sequences carry the teacher's privileged prompt: the config's one-shot of the same problem
    states = [json.loads(line) for line in (out / "statelens" / "states.jsonl").read_text().splitlines()]
    with_prompt = [s for s in states if "teacher_prompt" in s]
    assert with_prompt and all(s["teacher_context_len"] > 0 for s in with_prompt)
    first = with_prompt[0]
    assert first["teacher_prompt"].count("Question:") == 2 and "####" in first["teacher_prompt"]
