"""The run guards (`trl_statelens/guards.py`): each fires on a constructed bad sequence of logged metrics and stays
quiet on a good one; a guard in `stop` mode stops a lab run with a checkpoint, from which the run resumes without the
guard firing again; two ranks follow the main process's decision; a training metric keeps the best checkpoint."""

import json
import math

import pytest
from cpu_settings import CPU
from datasets import Dataset
from transformers import TrainerControl, TrainerState, TrainingArguments

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, RunGuards, StateLensSFTTrainer, guards
from trl_statelens.guards import Guards
from trl_statelens.guards_replay import replay_guards
from trl_statelens.lab import format_plain

STEPS = range(1, 31)


def fired(sequence, **thresholds) -> dict[str, int]:
    """guard -> the step it fired at, over `sequence(step) -> metrics`."""
    rules = Guards(**thresholds)
    return {alarm["guard"]: alarm["step"] for step in STEPS for alarm in rules.observe(step, sequence(step))}


GOOD = {
    "loop": lambda s: {"statelens/ends/repeats": 0.1, "statelens/ends/length_limit": 0.3},
    "end_collapse": lambda s: {"statelens/ends/end_token": 0.6 + 0.01 * s},
    "teacher_kl": lambda s: {"statelens/teacher_kl/supervised": 0.3 / s},
    "forgetting": lambda s: {"statelens/drift/base_kl": 0.005 * s},
    "reward_spread": lambda s: {"frac_reward_zero_std": 0.4},
    "non_finite": lambda s: {"loss": 1.0 / s, "grad_norm": 2.0},
}
BAD = {
    "loop": lambda s: {"statelens/ends/repeats": 0.1 if s < 12 else 0.5, "statelens/ends/length_limit": 0.3},
    "end_collapse": lambda s: {"statelens/drift/ends_end_token": 0.6 if s < 12 else 0.2},
    "teacher_kl": lambda s: {"statelens/teacher_kl/supervised": 0.3 if s < 12 else 0.6},
    "forgetting": lambda s: {"statelens/drift/base_kl": 0.05 * s},
    "reward_spread": lambda s: {"statelens/reward_groups/spread_frac": 0.5 if s < 12 else 0.0},
    "non_finite": lambda s: {"loss": math.nan if s == 17 else 1.0},
}
WHEN = {"loop": 15, "end_collapse": 15, "teacher_kl": 14, "forgetting": 5, "reward_spread": 16, "non_finite": 17}


@pytest.mark.parametrize("guard", list(BAD))
def test_each_guard_fires_on_a_bad_sequence_and_not_on_a_good_one(guard):
    budget = {"max_base_kl": 0.2}  # the forgetting guard is off without a budget
    assert fired(BAD[guard], **budget) == {guard: WHEN[guard]}
    assert fired(GOOD[guard], **budget) == {}


def test_a_stalled_teacher_kl_fires_from_kl_stall_steps_and_no_threshold_no_guard():
    flat = lambda s: {"statelens/teacher_kl/supervised": 0.3}  # noqa: E731
    assert fired(flat) == {"teacher_kl": 20}
    assert fired(flat, kl_stall=None) == {}
    assert fired(lambda s: {"statelens/drift/base_kl": 5.0}) == {}  # no budget given: no forgetting guard


def test_replay_reads_a_ledger_under_its_log_names(tmp_path):
    ledger = tmp_path / "statelens"
    ledger.mkdir()
    rows = [{"step": s, "epoch": 0.1, "ends/repeats": 0.0 if s < 10 else 0.75} for s in range(1, 16)]
    (ledger / "steps.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (ledger / "drift.jsonl").write_text(json.dumps({"step": 10, "base_kl": 0.4}) + "\n")
    (tmp_path / "log_history.json").write_text(json.dumps([{"step": 3, "loss": None}, {"step": 4, "loss": 1e999}]))
    alarms = replay_guards(tmp_path, max_base_kl=0.3)
    assert [(a["step"], a["guard"]) for a in alarms] == [(4, "non_finite"), (10, "forgetting"), (11, "loop")]


def opd_run(out, student_path, teacher_path, max_steps, callbacks, resume=None):
    rows = [{"prompt": format_plain(f"What is {i} + {i}?")} for i in range(8)]
    args = OnPolicyDistillConfig(
        **{**CPU, "save_strategy": "steps", "save_steps": 100},
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        num_generations=1,
        max_completion_length=4,
        learning_rate=1e-3,
    )
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(teacher_path),
        args=args,
        train_dataset=Dataset.from_list(rows),
        callbacks=callbacks,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_stop_mode_stops_with_a_checkpoint_and_the_run_resumes(tmp_path, student_path, teacher_path):
    # kl_rise 0: any teacher KL "rises" once the two windows (one step each) no longer share a step, at step 2
    forced = dict(baseline_steps=1, window=1, kl_rise=0.0)
    trainer = opd_run(tmp_path, student_path, teacher_path, 5, [RunGuards(mode="stop", **forced)])
    assert trainer.state.global_step == 2
    assert (tmp_path / "checkpoint-2").is_dir()
    record = [json.loads(line) for line in (tmp_path / "statelens" / "guards.jsonl").read_text().splitlines()]
    assert [(r["step"], r["guard"], r["action"]) for r in record] == [(2, "teacher_kl", "stop")]

    resumed = opd_run(
        tmp_path, student_path, teacher_path, 4, [RunGuards(mode="stop", **forced)], resume=tmp_path / "checkpoint-2"
    )
    assert resumed.state.global_step == 4  # the fired guard came back with the checkpoint: it does not fire again
    assert (tmp_path / "statelens" / "guards.jsonl").read_text().count("\n") == 1


def test_warn_is_the_trainers_default_and_off_attaches_none(student_path, math_dataset, tmp_path):
    from trl import SFTConfig

    args = SFTConfig(**CPU, output_dir=str(tmp_path), max_steps=1)
    default = StateLensSFTTrainer(model=str(student_path), args=args, train_dataset=math_dataset)
    [attached] = [cb for cb in default.callback_handler.callbacks if isinstance(cb, RunGuards)]
    assert attached.mode == "warn"
    off = StateLensSFTTrainer(model=str(student_path), args=args, train_dataset=math_dataset, guards="off")
    assert not any(isinstance(cb, RunGuards) for cb in off.callback_handler.callbacks)
    with pytest.raises(ValueError, match="guards must be one of"):
        StateLensSFTTrainer(model=str(student_path), args=args, train_dataset=math_dataset, guards="halt")


def test_distill_config_refuses_an_unknown_guards_mode(tmp_path):
    """The config refuses its `guards` field as it does `preflight`: when it is made (a YAML or a command line read
    into it), not only once a trainer is built from it."""
    with pytest.raises(ValueError, match=r"guards must be one of \('warn', 'stop', 'off'\).*got 'halt'"):
        OnPolicyDistillConfig(output_dir=str(tmp_path), guards="halt", **CPU)
    assert OnPolicyDistillConfig(output_dir=str(tmp_path), guards="off", **CPU).guards == "off"


class MainProcessBroadcast:
    """Two ranks' `from_main_process`: the main process's value, sent first, is what every rank gets."""

    def __init__(self):
        self.sent = None

    def __call__(self, state, value):
        if state.is_main_process:
            self.sent = value
        return self.sent


def test_two_ranks_follow_the_main_process_decision(tmp_path, monkeypatch):
    broadcast = MainProcessBroadcast()
    monkeypatch.setattr(guards, "PartialState", lambda: type("S", (), {"is_main_process": broadcast.rank == 0})())
    monkeypatch.setattr(guards.collective, "from_main_process", broadcast)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none")
    for nan_on in (0, 1):  # the rank whose own logs hold a NaN loss (logged values may differ by rank)
        stops = []
        for rank in (0, 1):
            broadcast.rank = rank
            callback, control = RunGuards(mode="stop"), TrainerControl()
            state = TrainerState(global_step=3, is_world_process_zero=rank == 0)
            callback.on_train_begin(args, state, control)
            callback.on_log(args, state, control, logs={"loss": math.nan if rank == nan_on else 1.0})
            stops.append(control.should_training_stop)
        assert stops == [nan_on == 0] * 2


def test_a_training_metric_keeps_the_best_checkpoint(tmp_path, student_path, math_dataset):
    from trl import SFTConfig

    args = SFTConfig(
        **{**CPU, "save_strategy": "steps"},
        output_dir=str(tmp_path),
        max_steps=4,
        save_steps=1,
        save_total_limit=1,
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        metric_for_best_model="statelens/state_nll",
        greater_is_better=False,
    )
    trainer = StateLensSFTTrainer(model=str(student_path), args=args, train_dataset=math_dataset)
    trainer.train()
    nll = {row["step"]: row["statelens/state_nll"] for row in trainer.state.log_history if "loss" in row}
    best = min(nll, key=nll.get)
    assert trainer.state.best_global_step == best and trainer.state.best_metric == nll[best]
    assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{best}")
    kept = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
    assert f"checkpoint-{best}" in kept  # save_total_limit deletes the others, never the best
