"""ForgettingForecast: the distance a run has moved in weights, and the forgetting and retention it forecasts."""

from __future__ import annotations

import json
import logging
import math
import uuid
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

logger = logging.getLogger(__name__)

METRIC_PREFIX = "statelens/forecast/"
START_FILE = "forecast_start.safetensors"  # theta_0, once per run in output_dir (with checkpointing)
START_REFERENCE = "forecast_start.json"  # in each checkpoint: which start file it belongs to
DEFAULT_CALIBRATION = Path(__file__).with_name("forgetting_calibration.json")
TIME_POINTS = {"10%": 0.10, "25%": 0.25, "100%": 1.00}  # the study's time points (recipes/studies/forgetting_study.py)


def load_calibration(calibration: str | Path | dict | None = None) -> dict:
    """A calibration as a dict (the default: the lab's, shipped with the package), checked for the fields the
    forecast reads: `time_points` -> label -> {`fraction`, `forgetting` and `retention` -> {`a`, `b`, `bootstrap`}}."""
    if calibration is None:
        calibration = DEFAULT_CALIBRATION
    if not isinstance(calibration, dict):
        calibration = json.loads(Path(calibration).read_text())
    points = calibration.get("time_points")
    if not isinstance(points, dict) or not points:
        raise ValueError("calibration needs 'time_points': {label: {fraction, forgetting, retention}}, got none")
    for label, point in points.items():
        if not isinstance(point.get("fraction"), (int, float)) or not 0 < point["fraction"] <= 1:
            raise ValueError(f"calibration time point {label!r}: 'fraction' must be a share of training in (0, 1]")
        for target in ("forgetting", "retention"):
            line = point.get(target)
            if not isinstance(line, dict) or not {"a", "b", "bootstrap"} <= line.keys() or not line["bootstrap"]:
                raise ValueError(
                    f"calibration time point {label!r}: {target!r} needs 'a', 'b' and a non-empty 'bootstrap' list of "
                    "[a, b] pairs"
                )
    return calibration


def forecast_line(line: dict, distance: float) -> tuple[float, float, float]:
    """The line's prediction a + b * distance, and the 95% percentile interval of the bootstrap lines' predictions."""
    pairs = np.asarray(line["bootstrap"], dtype=float)
    predictions = pairs[:, 0] + pairs[:, 1] * distance
    low, high = np.percentile(predictions, [2.5, 97.5])
    return float(line["a"] + line["b"] * distance), float(low), float(high)


def time_point_steps(max_steps: int, fractions: dict[str, float]) -> dict[str, int]:
    """The optimizer step of each time point: max(1, round(fraction * max_steps)), as in the study."""
    return {label: max(1, round(fraction * max_steps)) for label, fraction in fractions.items()}


def _refuse_sharded(accelerator, model) -> None:
    """ZeRO-3 and FSDP leave each process a shard of the weights: refuse rather than measure a wrong distance."""
    from accelerate.utils import DistributedType

    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    zero3 = accelerator.distributed_type == DistributedType.DEEPSPEED and getattr(plugin, "zero_stage", None) == 3
    if zero3 or any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ValueError(
            "ForgettingForecast does not support DeepSpeed ZeRO-3: each process holds only a shard of the weights, so "
            "the distance from the start would be wrong. Use ZeRO-1/2 or DDP."
        )
    if accelerator.distributed_type == DistributedType.FSDP or any(
        type(p).__name__ in ("DTensor", "FlatParameter") for p in model.parameters()
    ):
        raise ValueError(
            "ForgettingForecast does not support FSDP: each process holds only a shard of the weights, so the distance "
            "from the start would be wrong. Use DDP or DeepSpeed ZeRO-1/2."
        )


class ForgettingForecast(TrainerCallback):
    r"""Logs how far the weights have moved from the start of training, and the Forgetting and Retention that distance
    forecasts, with a 95% interval; warns once when the run is on course below a Retention you set.

    Why this statistic: in the forgetting-forecast study (issue 29, STUDY.md: 31 lab runs of SFT, GRPO and OPD),
    `param_distance` was the statistic that forecast a run's final Forgetting by the pre-registered rule, from 10% of
    training on (pooled Spearman +0.79 [+0.53, +0.93] at 10%, +0.80 [+0.55, +0.94] at 25%, +0.80 [+0.55, +0.93] at
    100%); `base_kl` did not pass at 25%.

    What it logs, at every `every_steps` optimizer steps and at 10%, 25% and 100% of `max_steps` (steps
    max(1, round(fraction * max_steps)), as in the study):

    - `statelens/forecast/param_distance`: $\lVert \theta_t - \theta_0 \rVert_2$ over every parameter of the
      (unwrapped) model, trainable or frozen, each shared (tied) tensor once, as in a saved checkpoint; buffers are
      not counted. $\theta_0$ is a float32 copy of the weights taken on CPU at the start of training. With a PEFT
      model the base weights are frozen, so this is the distance the adapter's own parameters (LoRA A and B) moved,
      *not* the distance of the merged weights ($\lVert s B A \rVert$ per layer), and not what the lab calibration
      was fitted on (full fine-tuning).
    - From the first time point on (10% of training with the default calibration), `statelens/forecast/forgetting`
      and `statelens/forecast/retention`, each with `_low`/`_high`: the calibration's line $a + b\,d$ at the time point
      nearest the current share of training, evaluated at the current distance $d$; the interval is the 2.5 and 97.5
      percentiles of the same prediction by the calibration's bootstrap lines (runs resampled with replacement).

    Metrics go to the trainer's own metric store like [`StateLoggingCallback`]'s (TRL trainers: averaged over the
    measurements since the last logged step and reported with it); a trainer without one (transformers' `Trainer`)
    gets them through `trainer.log`. Like `StateLoggingCallback`, it needs the trainer:
    `trainer.add_callback(ForgettingForecast(trainer, min_retention=0.9))`.

    **Calibration.** The default, `trl_statelens/lens/forgetting_calibration.json`, is **lab-calibrated**: fitted on the
    study's 31 runs of the lab's 1.1M-parameter Qwen3 (lab seed 0, full fine-tuning), written by
    `recipes/studies/forgetting_study.py` (`calibration()`). A distance's scale depends on the model (its size, its
    initialization, the tasks), so these numbers forecast nothing on another model: calibrate on yours (run a few
    trainings of your own, measure their Forgetting and Retention, and write the same JSON with
    `forgetting_study.calibration`) and pass it as `calibration=`. The study's own caveat stands: it showed that the
    distance *ranks* runs by forgetting on one instrument, not a transferable scale.

    **Cost.** A copy of the model's parameters in float32 on CPU, for the whole run (4 bytes a parameter of host
    memory); at each forecast step one pass over the parameters: each is copied to CPU, subtracted from its copy and
    squared. Nothing on the accelerator beyond one parameter at a time; no forward pass.

    **Resume.** With checkpoints (`save_strategy` other than `"no"`), $\theta_0$ is written once, at the start of
    training, to `<output_dir>/forecast_start.safetensors` (each tensor in its parameter's dtype: the size of one
    model checkpoint, not one per checkpoint), and every checkpoint gets a small `forecast_start.json` naming that
    file's run. A run resumed in the same `output_dir` reads $\theta_0$ back, so its distances and forecasts are
    those of an uninterrupted run. Without the file (a checkpoint copied elsewhere, or a start file another run
    overwrote), the start is the resumed weights and a warning says the forecast underestimates.

    Not supported: DeepSpeed ZeRO-3 and FSDP (each process holds a shard; the callback refuses at the start of
    training).

    Args:
        trainer (`transformers.Trainer`):
            The trainer it measures and logs through (may be set later as `callback.trainer`, before training).
        calibration (`str`, `Path` or `dict`, *optional*):
            A calibration in the format of `trl_statelens/lens/forgetting_calibration.json`: `time_points` -> label ->
            `{"fraction": float, "forgetting": {"a", "b", "bootstrap": [[a, b], ...]}, "retention": {...}}`. Defaults
            to the lab's.
        every_steps (`int`, *optional*, defaults to `50`):
            Measure every this many optimizer steps (the same default as `StateLoggingCallback`'s `probe_steps`), as
            well as at each of the calibration's time points.
        min_retention (`float`, *optional*):
            A Retention in (0, 1]. When the upper end of the forecast Retention's 95% interval falls below it, a
            warning (once per run) names the step, the distance, the forecast and its interval. Unset: no warning.
    """

    def __init__(
        self,
        trainer=None,
        calibration: str | Path | dict | None = None,
        every_steps: int = 50,
        min_retention: float | None = None,
    ):
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
            raise ValueError(f"every_steps must be a positive whole number of steps, got {every_steps!r}")
        if min_retention is not None and not (
            isinstance(min_retention, (int, float)) and not isinstance(min_retention, bool) and 0 < min_retention <= 1
        ):
            raise ValueError(
                f"min_retention is a Retention (post / base score), in (0, 1]; got {min_retention!r}. Leave it unset "
                "for no warning."
            )
        self.is_default_calibration = calibration is None
        self.calibration = load_calibration(calibration)
        self.every_steps = every_steps
        self.min_retention = min_retention
        self.trainer = trainer
        self._start: dict[str, torch.Tensor] | None = None
        self._run_id: str | None = None  # names this run's start file in its checkpoints
        self._warned = False
        self.last: dict[str, float] = {}  # the latest measurement, for the user and for tests

    # ----- training events --------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.trainer is None:
            raise ValueError(
                "ForgettingForecast needs the trainer: create it with ForgettingForecast(trainer, ...) and "
                "trainer.add_callback it, or set callback.trainer before training."
            )
        model = self._model(model)
        _refuse_sharded(self.trainer.accelerator, model)
        self._start = self._saved_start(args, state) if state.global_step > 0 else None
        if self._start is None:
            self._start = {
                name: p.detach().to("cpu", torch.float32, copy=True) for name, p in model.named_parameters()
            }
        if state.global_step == 0:
            self._save_start(args, state, model)
        self._warned = False
        fractions = {label: point["fraction"] for label, point in self.calibration["time_points"].items()}
        self._forecast_steps = time_point_steps(state.max_steps, fractions)
        self._first_forecast_step = min(self._forecast_steps.values())
        if state.is_world_process_zero:
            if self.is_default_calibration:
                logger.info(
                    "ForgettingForecast uses the lab calibration (31 runs of the lab's 1.1M-parameter Qwen3): the "
                    "scale of param_distance depends on the model, so its forecasts only mean something on the lab. "
                    "Pass calibration= fitted on your own model for a forecast elsewhere."
                )

    def on_save(self, args, state, control, **kwargs):
        checkpoint = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if self._run_id is not None and state.is_world_process_zero and checkpoint.is_dir():
            (checkpoint / START_REFERENCE).write_text(json.dumps({"start": START_FILE, "run_id": self._run_id}))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        if step % self.every_steps and step not in self._forecast_steps.values():
            return
        distance = self.param_distance(self._model(model))
        metrics = {"param_distance": distance}
        if step >= self._first_forecast_step:
            label = self.nearest_time_point(step / max(state.max_steps, 1))
            point = self.calibration["time_points"][label]
            for target in ("forgetting", "retention"):
                value, low, high = forecast_line(point[target], distance)
                metrics.update({target: value, f"{target}_low": low, f"{target}_high": high})
            metrics_time_point = label
            if (
                self.min_retention is not None
                and not self._warned
                and metrics["retention_high"] < self.min_retention
                and state.is_world_process_zero
            ):
                self._warned = True
                logger.warning(
                    "ForgettingForecast: at step %d the weights have moved %.4g from the start; the %s calibration "
                    "forecasts a Retention of %.3f [95%%: %.3f, %.3f], below min_retention=%.3f (and Forgetting "
                    "%.3f [%.3f, %.3f]).",
                    step, distance, metrics_time_point, metrics["retention"], metrics["retention_low"],
                    metrics["retention_high"], self.min_retention, metrics["forgetting"], metrics["forgetting_low"],
                    metrics["forgetting_high"],
                )  # fmt: skip
        self.last = {"step": step, **metrics}
        self._log_metrics(metrics)

    # ----- the start across a resume ----------------------------------------------------------------------------
    def _save_start(self, args, state, model) -> None:
        """Writes theta_0 to output_dir once, when the run can be resumed (it saves checkpoints)."""
        if args.save_strategy == "no":
            return
        self._run_id = uuid.uuid4().hex
        if state.is_world_process_zero:
            dtypes = {name: p.dtype for name, p in model.named_parameters()}  # theta_0 came from them: exact
            tensors = {name: start.to(dtypes[name]).contiguous() for name, start in self._start.items()}
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            save_file(tensors, Path(args.output_dir) / START_FILE, metadata={"run_id": self._run_id})

    def _saved_start(self, args, state) -> dict[str, torch.Tensor] | None:
        """theta_0 from output_dir on a resumed run, if the checkpoint resumed from names that file's run."""
        path = Path(args.output_dir) / START_FILE
        reference = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}" / START_REFERENCE
        run_id = json.loads(reference.read_text())["run_id"] if reference.is_file() else None
        if run_id is not None and path.is_file():
            with safe_open(path, framework="pt") as f:
                if (f.metadata() or {}).get("run_id") == run_id:
                    self._run_id = run_id  # later checkpoints name the same file
                    return {name: f.get_tensor(name).to(torch.float32) for name in f.keys()}
        if state.is_world_process_zero:
            logger.warning(
                "ForgettingForecast on a resumed run without its starting weights (%s is missing or was written by "
                "another run than the checkpoint of step %d): param_distance is measured from the weights at step "
                "%d, not from the start of training, so the forecast underestimates.",
                path, state.global_step, state.global_step,
            )  # fmt: skip
        return None

    # ----- measurement ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def param_distance(self, model) -> float:
        """L2 norm over every parameter of the model minus its copy from the start of training (float64 sum)."""
        total = 0.0
        for name, parameter in model.named_parameters():
            start = self._start.get(name)
            if start is None:
                raise ValueError(f"parameter {name!r} was not in the model at the start of training")
            difference = parameter.detach().to("cpu", torch.float32) - start
            total += float(difference.square_().sum(dtype=torch.float64))
        return math.sqrt(total)

    def _model(self, model):
        model = self.trainer.model if model is None else model
        return self.trainer.accelerator.unwrap_model(model)

    def nearest_time_point(self, fraction: float) -> str:
        """The calibration's time point whose share of training is nearest `fraction` (the earlier on a tie)."""
        points = self.calibration["time_points"]
        return min(points, key=lambda label: (abs(points[label]["fraction"] - fraction), points[label]["fraction"]))

    def _log_metrics(self, metrics: dict[str, float]) -> None:
        """Queue metrics in the trainer's own metric store, which its next `log()` averages and reports (as
        StateLoggingCallback does); a trainer without one (transformers' `Trainer`) gets them through `trainer.log`."""
        metrics = {METRIC_PREFIX + name: value for name, value in metrics.items() if math.isfinite(value)}
        store = getattr(self.trainer, "_metrics", None)
        if store is None:
            self.trainer.log(metrics)
            return
        for name, value in metrics.items():
            store["train"][name].append(value)
