"""ForgettingForecast: the distance from the starting weights against a direct computation, the forecast against
its calibration by hand, the one-time warning, bad input; and the shipped calibration against the study's runs."""

import json
import logging
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from cpu_settings import CPU
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import SFTConfig, SFTTrainer

from trl_statelens import ForgettingForecast, StateLensSFTTrainer
from trl_statelens.lens.forecast import DEFAULT_CALIBRATION, forecast_line, load_calibration, time_point_steps

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes" / "studies"))
import forgetting_study as fs  # noqa: E402

KEYS = [f"statelens/forecast/{name}" for name in ("param_distance", "forgetting", "forgetting_low",
        "forgetting_high", "retention", "retention_low", "retention_high")]  # fmt: skip


class LogCatcher(TrainerCallback):
    """What report_to backends receive: the `logs` of `on_log`."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def synthetic_calibration(retention_a=0.5):
    """Three time points; Retention flat at `retention_a` (every bootstrap line too), Forgetting = 0.01 + 0.1 d."""
    line = {"a": retention_a, "b": 0.0, "bootstrap": [[retention_a, 0.0]] * 4}
    forgetting = {"a": 0.01, "b": 0.1, "bootstrap": [[0.0, 0.1], [0.02, 0.1]]}
    return {"time_points": {label: {"fraction": f, "forgetting": forgetting, "retention": line}
                            for label, f in (("10%", 0.1), ("25%", 0.25), ("100%", 1.0))}}  # fmt: skip


def sft_run(tmp_path, student_path, tokenizer, math_dataset, callback, stock=False, **overrides):
    args = SFTConfig(**{**CPU, "output_dir": str(tmp_path), "max_steps": 1, "per_device_train_batch_size": 4,
                        "learning_rate": 1e-2, "max_length": 128, **overrides})  # fmt: skip
    catcher = LogCatcher()
    kind = SFTTrainer if stock else StateLensSFTTrainer
    trainer = kind(model=str(student_path), args=args, train_dataset=math_dataset, processing_class=tokenizer,
                   callbacks=[catcher])  # fmt: skip
    callback.trainer = trainer
    trainer.add_callback(callback)
    trainer.train()
    return trainer, catcher.logs


def test_param_distance_after_one_step_equals_a_direct_computation(tmp_path, student_path, tokenizer, math_dataset):
    callback = ForgettingForecast(every_steps=1)
    trainer, logs = sft_run(tmp_path, student_path, tokenizer, math_dataset, callback)
    initial = dict(AutoModelForCausalLM.from_pretrained(student_path).named_parameters())
    trained = trainer.accelerator.unwrap_model(trainer.model)
    expected = math.sqrt(
        sum(
            float((p.detach().double() - initial[n].detach().double()).pow(2).sum())
            for n, p in trained.named_parameters()
        )
    )
    assert expected > 1e-3  # the step moved the weights
    assert callback.last["param_distance"] == pytest.approx(expected, rel=1e-6)
    # the study's definition: every tensor of the saved checkpoints (tied weights saved once)
    trainer.save_model(str(tmp_path / "saved"))
    study = fs.parameter_distance(tmp_path / "saved" / "model.safetensors", student_path / "model.safetensors")
    assert callback.last["param_distance"] == pytest.approx(study, rel=1e-6)
    (train_logs,) = [entry for entry in logs if "loss" in entry]
    assert train_logs["statelens/forecast/param_distance"] == pytest.approx(expected, rel=1e-6)
    assert set(KEYS) <= train_logs.keys()  # step 1 of 1 is 100% of training: a forecast with its interval


def test_zero_distance_at_lr_0_measured_at_the_time_points_and_every_steps(
    tmp_path, student_path, tokenizer, math_dataset, caplog
):
    callback = ForgettingForecast(every_steps=4)  # no min_retention: never a warning
    with caplog.at_level(logging.INFO, logger="trl_statelens.lens.forecast"):
        trainer, _ = sft_run(tmp_path, student_path, tokenizer, math_dataset, callback, stock=True, max_steps=10,
                          per_device_train_batch_size=2, learning_rate=0.0)  # fmt: skip
    measured = {entry["step"]: entry for entry in trainer.state.log_history if KEYS[0] in entry}
    # 10%, 25%, 100% of 10 steps: 1, round(2.5) = 2, 10; and every 4 steps
    assert sorted(measured) == sorted({*time_point_steps(10, fs.FRACTIONS).values(), 4, 8}) == [1, 2, 4, 8, 10]
    assert all(entry[KEYS[0]] == 0.0 for entry in measured.values())
    calibration = load_calibration()
    retention = calibration["time_points"]["100%"]["retention"]
    assert measured[10]["statelens/forecast/retention"] == pytest.approx(retention["a"])  # a + b * 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("lab calibration" in r.getMessage() for r in caplog.records) == 1


def test_warning_fires_once_when_the_forecast_falls_below_min_retention(
    tmp_path, student_path, tokenizer, math_dataset, caplog
):
    callback = ForgettingForecast(calibration=synthetic_calibration(0.5), every_steps=1, min_retention=0.9)
    with caplog.at_level(logging.WARNING, logger="trl_statelens.lens.forecast"):
        sft_run(tmp_path, student_path, tokenizer, math_dataset, callback, stock=True, max_steps=3,
                per_device_train_batch_size=2)  # fmt: skip
    (warning,) = [r.getMessage() for r in caplog.records if "min_retention" in r.getMessage()]
    assert "at step 1" in warning and "Retention of 0.500 [95%: 0.500, 0.500]" in warning


def test_forecast_is_the_point_line_and_the_interval_the_bootstrap_percentiles():
    line = {"a": 0.3, "b": -0.05, "bootstrap": [[i, 0.1 * i] for i in range(5)]}
    value, low, high = forecast_line(line, 2.0)
    assert value == pytest.approx(0.3 - 0.05 * 2.0)
    # bootstrap predictions i + 0.2 i = 0, 1.2, 2.4, 3.6, 4.8; linear percentiles at positions 0.1 and 3.9
    assert low == pytest.approx(0.12) and high == pytest.approx(4.68)
    callback = ForgettingForecast(calibration=synthetic_calibration())
    assert [callback.nearest_time_point(f) for f in (0.1, 0.17, 0.18, 0.6, 0.7, 1.0)] == [
        "10%", "10%", "25%", "25%", "100%", "100%"]  # fmt: skip


def test_shipped_calibration_is_the_studys_lines(tmp_path):
    shipped = json.loads(DEFAULT_CALIBRATION.read_text())
    rows = json.loads((REPO / "docs" / "study" / "forgetting" / "forecast.json").read_text())["runs"]
    again = fs.calibration(rows, tmp_path / "calibration.json")
    assert json.loads((tmp_path / "calibration.json").read_text())["time_points"] == again["time_points"]
    assert shipped["statistic"] == "param_distance" and shipped["provenance"]["runs"] == len(rows) == 31
    for label, point in shipped["time_points"].items():
        x = np.array([row["stats"][label]["param_distance"] for row in rows])
        for target in ("forgetting", "retention"):
            b, a = np.polyfit(x, [row[target] for row in rows], 1)
            assert point[target]["a"] == pytest.approx(a) and point[target]["b"] == pytest.approx(b)
            # the same fits to the last few bits: a numpy release can move least squares by an ulp
            np.testing.assert_allclose(
                point[target]["bootstrap"], again["time_points"][label][target]["bootstrap"], rtol=1e-12
            )
            assert len(point[target]["bootstrap"]) == fs.CALIBRATION_SAMPLES
    assert shipped["time_points"]["10%"]["forgetting"]["b"] > 0  # moving further forecasts more forgetting


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"every_steps": 0}, "every_steps"),
        ({"every_steps": 2.5}, "every_steps"),
        ({"min_retention": 0.0}, "min_retention"),
        ({"min_retention": 1.5}, "min_retention"),
        ({"min_retention": -0.2}, "min_retention"),
        ({"calibration": {"time_points": {}}}, "time_points"),
        ({"calibration": {"time_points": {"10%": {"fraction": 0.1, "forgetting": {"a": 0, "b": 1}}}}}, "bootstrap"),
    ],
)
def test_bad_input_is_refused_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ForgettingForecast(**kwargs)


def test_needs_the_trainer(tmp_path, student_path, tokenizer, math_dataset):
    args = SFTConfig(**{**CPU, "output_dir": str(tmp_path), "max_steps": 1, "per_device_train_batch_size": 2})
    trainer = SFTTrainer(model=str(student_path), args=args, train_dataset=math_dataset, processing_class=tokenizer,
                         callbacks=[ForgettingForecast()])  # fmt: skip
    with pytest.raises(ValueError, match="needs the trainer"):
        trainer.train()


def test_param_distance_after_a_resume_is_measured_from_the_start_of_training(
    tmp_path, student_path, tokenizer, math_dataset, caplog
):
    """Four steps straight against two steps, a new trainer and callback (a new process would have nothing else),
    and a resume from checkpoint-2 of the same output_dir: the same distance at step 4. theta_0 is written once
    in output_dir; each checkpoint names it by its run."""

    class StopAfter2(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 2

    def distance_at_4(out, *extra, resume=None):
        args = SFTConfig(**{**CPU, "output_dir": str(out), "max_steps": 4, "per_device_train_batch_size": 4,
                            "learning_rate": 1e-2, "max_length": 128, "save_strategy": "steps", "save_steps": 2})  # fmt: skip
        trainer = StateLensSFTTrainer(model=str(student_path), args=args, train_dataset=math_dataset,
                                      processing_class=tokenizer, callbacks=list(extra), state_logging=False)  # fmt: skip
        forecast = ForgettingForecast(trainer, every_steps=1)
        trainer.add_callback(forecast)
        trainer.train(resume_from_checkpoint=resume)
        return trainer, forecast.last

    straight, straight_last = distance_at_4(tmp_path / "straight")
    assert straight_last["step"] == 4 and straight_last["param_distance"] > 0
    out = tmp_path / "resumed"
    stopped, _ = distance_at_4(out, StopAfter2())
    assert stopped.state.global_step == 2 and sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    with caplog.at_level(logging.WARNING, logger="trl_statelens.lens.forecast"):
        resumed, resumed_last = distance_at_4(out, resume=str(out / "checkpoint-2"))
    assert resumed_last["step"] == 4
    assert resumed_last["param_distance"] == pytest.approx(straight_last["param_distance"], rel=1e-6)
    assert not [r for r in caplog.records if "resumed run" in r.getMessage()]
    start = out / "forecast_start.safetensors"
    assert json.loads((out / "checkpoint-2" / "forecast_start.json").read_text())["start"] == start.name
    assert (out / "checkpoint-4" / "forecast_start.json").read_text() == (
        out / "checkpoint-2" / "forecast_start.json"
    ).read_text()  # the same start file, written once

    # A start file another run wrote over: measured from the resumed weights, with a warning
    other, _ = distance_at_4(tmp_path / "other", StopAfter2())
    start.write_bytes((tmp_path / "other" / "forecast_start.safetensors").read_bytes())
    with caplog.at_level(logging.WARNING, logger="trl_statelens.lens.forecast"):
        _, last = distance_at_4(out, resume=str(out / "checkpoint-2"))
    assert last["param_distance"] < straight_last["param_distance"]
    assert [r for r in caplog.records if "without its starting weights" in r.getMessage()]
