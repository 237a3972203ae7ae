"""Kill and resume through the recipes: a run killed with SIGKILL and resumed from its last checkpoint ends exactly
as the uninterrupted run does (training losses, final weights, and the ledger's steps, states and drift files).

Each case trains 5 steps with checkpoints at steps 2 and 4, on `test`-size models, in three runs: uninterrupted;
killed during step 4 (once inside the step, after the backward pass; once halfway through writing step 4's ledger
line, which leaves a torn line); then resumed with `--resume_from_checkpoint <run>/checkpoint-2`. The killed run is
a forked copy of the test process that sends itself SIGKILL, so nothing runs after the kill: no `finally`, no
flush, no atexit, as with `kill -9`. All runs are on CPU with one thread, where training is deterministic, so the
comparison is exact: byte-identical ledger files and weights, equal floats in the log history.
"""

import json
import os
import runpy
import signal
import sys
from pathlib import Path

import pytest
import yaml
from launching import free_port, launch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
LEDGER = ("steps.jsonl", "states.jsonl", "drift.jsonl", "groups.jsonl")  # groups: GRPO's only
KILL_STEP = 4  # the last checkpoint before it is checkpoint-2: steps 3 (in the ledger) and 4 are redone
RUN = {
    "max_steps": 5, "save_strategy": "steps", "save_steps": 2, "logging_steps": 1, "seed": 0,
    "eval_tasks": "", "eval_before": False, "num_probes": 2, "probe_steps": 2, "ledger_sample_rate": 0.5,
    "train_size": 24, "use_cpu": True, "bf16": False, "gradient_checkpointing": False, "report_to": "none",
    "dataloader_num_workers": 0, "disable_tqdm": True, "learning_rate": 1e-3, "per_device_train_batch_size": 4,
}  # fmt: skip
GENERATE = {"num_generations": 2, "max_completion_length": 8}
MIX = {"learner": 0.5, "dataset": 0.25, "teacher": 0.25}
CASES = {
    "sft": ("sft", {"max_length": 160}),
    "grpo": ("grpo", GENERATE),
    "opd_reverse_kl": ("opd", {**GENERATE, "signal": "reverse_kl", "state_source_mix": MIX}),
    "opd_continuation": ("opd", {**GENERATE, "signal": "continuation", "continuation_length": 4, "state_source_mix": MIX}),
    "opd_divergence": ("opd", {**GENERATE, "signal": "divergence", "state_source_mix": MIX}),
}  # fmt: skip


def write_config(path: Path, recipe: str, settings: dict, student_path, teacher_path) -> Path:
    config = {**RUN, **settings, "model_name_or_path": str(student_path)}
    if recipe == "opd":
        config["teacher_model_name_or_path"] = str(teacher_path)
    path.write_text(yaml.safe_dump(config))
    return path


def run_recipe(recipe: str, config: Path, output_dir: Path, *flags: str) -> None:
    script = RECIPES / f"{recipe}.py"
    saved = sys.argv
    sys.argv = [str(script), "--config", str(config), "--output_dir", str(output_dir), *flags]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def arm_kill(where: str) -> None:
    """In the forked child: SIGKILL this process during step `KILL_STEP`, `where` = "step" (after its backward pass,
    before the optimizer step) or "ledger" (halfway through writing its line of steps.jsonl)."""
    from transformers import TrainerCallback

    import trl_statelens.reports.runs
    from trl_statelens.lens.callback import StateLoggingCallback

    if where == "step":

        class KillInStep(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                if state.global_step == KILL_STEP - 1:  # global_step counts finished steps
                    kill_self()

        run = trl_statelens.reports.runs.run_recipe

        def run_with_kill(recipe, trainer, *args, **kwargs):
            trainer.add_callback(KillInStep())
            return run(recipe, trainer, *args, **kwargs)

        trl_statelens.reports.runs.run_recipe = run_with_kill  # the recipe script imports it when it runs
    else:
        append = StateLoggingCallback._append

        def torn_append(self, name, rows):
            if name == "steps.jsonl" and rows[0]["step"] == KILL_STEP:
                line = json.dumps(rows[0])
                with open(self.ledger_dir / name, "a") as f:
                    f.write(line[: len(line) // 2])
                kill_self()
            append(self, name, rows)

        StateLoggingCallback._append = torn_append


def run_killed(recipe: str, config: Path, output_dir: Path, where: str) -> None:
    """Run the recipe in a forked child that kills itself with SIGKILL at `where`; check that it died that way."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            arm_kill(where)
            run_recipe(recipe, config, output_dir)
        finally:
            os._exit(1)  # reached only if the kill point never came
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"child exited with status {status}"


def step_logs(output_dir: Path) -> list[dict]:
    """The per-step entries of the log history (loss, grad_norm, learning_rate, rewards, statelens/*, ...), without
    GRPO's `step_time` (wall clock) and SFT's `num_tokens`: TRL's SFTTrainer counts it in memory from the start of
    each process, so a resumed run's count starts again at 0 (TRL 1.16 keeps it out of checkpoints)."""
    history = json.loads((output_dir / "log_history.json").read_text())
    unrepeatable = ("step_time", "num_tokens")
    return [{k: v for k, v in entry.items() if k not in unrepeatable} for entry in history if "loss" in entry]


def assert_same_run(resumed: Path, uninterrupted: Path) -> None:
    for name in LEDGER:
        if name == "groups.jsonl" and not (uninterrupted / "statelens" / name).exists():
            assert not (resumed / "statelens" / name).exists()
            continue
        assert (resumed / "statelens" / name).read_bytes() == (uninterrupted / "statelens" / name).read_bytes(), name
    assert step_logs(resumed) == step_logs(uninterrupted)
    weights, reference = load_file(resumed / "model.safetensors"), load_file(uninterrupted / "model.safetensors")
    assert weights.keys() == reference.keys()
    for key in weights:
        assert weights[key].equal(reference[key]), key


@pytest.fixture(scope="module")
def uninterrupted_runs(tmp_path_factory, student_path, teacher_path):
    """Each case's uninterrupted run, shared by both kill points."""
    runs = {}

    def get(case):
        if case not in runs:
            folder = tmp_path_factory.mktemp(case)
            recipe, settings = CASES[case]
            config = write_config(folder / "config.yaml", recipe, settings, student_path, teacher_path)
            run_recipe(recipe, config, folder / "run")
            runs[case] = (config, folder / "run")
        return runs[case]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("where", ["step", "ledger"])
@pytest.mark.parametrize("case", list(CASES))
def test_killed_run_resumes_as_if_uninterrupted(tmp_path, uninterrupted_runs, case, where):
    config, uninterrupted = uninterrupted_runs(case)
    recipe = CASES[case][0]
    out = tmp_path / "run"
    run_killed(recipe, config, out, where)
    steps = (out / "statelens" / "steps.jsonl").read_text()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert steps.count("\n") == KILL_STEP - 1 and steps.endswith("\n") == (where == "step")  # torn line

    run_recipe(recipe, config, out, "--resume_from_checkpoint", str(out / "checkpoint-2"))
    assert json.loads((out / "results.json").read_text())["global_steps"] == 5
    assert (out / "statelens" / "groups.jsonl").exists() == (recipe == "grpo")
    assert_same_run(out, uninterrupted)


@pytest.mark.multiproc
@pytest.mark.slow
def test_two_ranks_resumed_with_max_flops_stop_at_the_same_step(tmp_path, student_path):
    """A run with the teacher cache resumed on two ranks from its step-2 checkpoint, with `max_flops` just under its
    step-3 count (tests/scripts/max_flops_resume_two_ranks.py): both ranks count on from the ledger's totals, which the
    main process reads back and sends to the other, and both stop after step 3. Without them the other rank counts
    step 2's reused batch as nothing, trains into step 4 alone and waits there. (Review 2026-12-04, 1.)"""
    accelerate = Path(sys.executable).parent / "accelerate"
    command = [
        str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        str(Path(__file__).parent / "scripts" / "max_flops_resume_two_ranks.py"), str(student_path), str(tmp_path),
    ]  # fmt: skip
    launch(command, {"TOKENIZERS_PARALLELISM": "false"}, timeout=240, hang="the ranks stopped at different steps",
           outputs=tmp_path)  # fmt: skip
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert [rank["world_size"] for rank in ranks] == [2, 2]
    assert [rank["stopped_at"] for rank in ranks] == [3, 3]
    assert ranks[0]["flops_at_resume"] == ranks[1]["flops_at_resume"] == pytest.approx(ranks[0]["flops_at_step_2"])
