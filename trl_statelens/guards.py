"""`RunGuards`: warn about (or stop) a run going wrong, from the metrics the lens and TRL already log.

The guards read each `log` event's metrics (no forward pass of their own) and compare a recent window with the run's
first window. [`Guards`] holds the rules and their state; [`RunGuards`] is the callback every StateLens trainer
attaches (`guards="warn"` by default); `trl_statelens.guards_replay` runs the same rules over a committed ledger.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from accelerate import PartialState
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from . import collective

logger = logging.getLogger(__name__)

MODES = ("warn", "stop", "off")
GUARDS_FILE = "guards.jsonl"

# The log names the guards read (the lens's under `statelens/`; TRL's and transformers' own as they log them)
ROLLOUT_REPEATS, ROLLOUT_CUT, ROLLOUT_END = (
    "statelens/ends/repeats",
    "statelens/ends/length_limit",
    "statelens/ends/end_token",
)
PROBE_REPEATS, PROBE_CUT, PROBE_END = (
    "statelens/drift/ends_repeats",
    "statelens/drift/ends_length_limit",
    "statelens/drift/ends_end_token",
)
TEACHER_KL, PROBE_TEACHER_KL = "statelens/teacher_kl/supervised", "statelens/drift/teacher_kl/exact"
BASE_KL, RETENTION_HIGH = "statelens/drift/base_kl", "statelens/forecast/retention_high"
REWARD_SPREAD, TRL_ZERO_STD = "statelens/reward_groups/spread_frac", "frac_reward_zero_std"
LOSS, GRAD_NORM = "loss", "grad_norm"
WATCHED = (
    ROLLOUT_REPEATS, ROLLOUT_CUT, ROLLOUT_END, PROBE_REPEATS, PROBE_CUT, PROBE_END, TEACHER_KL, PROBE_TEACHER_KL,
    BASE_KL, RETENTION_HIGH, REWARD_SPREAD, LOSS, GRAD_NORM,
)  # fmt: skip


class Guards:
    r"""The guards' rules and what they have seen: feed [`observe`] each step's metrics, in step order.

    Each metric keeps its *first window* (its values at steps `<= baseline_steps`, or its first value when none falls
    there: a probe metric measured every 50 steps) and its *recent window* (its values in the last `window` steps, or
    its last value). A comparison waits until the two windows share no step. Each guard fires once a run.

    - `loop`: the share of rollouts that repeat themselves (`ends/repeats`) or are cut at the length limit
      (`ends/length_limit`), or the same over the probe completions (`drift/ends_*`), rose by `loop_rise` or more
      (absolute) from the first window's mean to the recent window's;
    - `end_collapse`: the share ending with the end token (`ends/end_token`, probes' `drift/ends_end_token`) fell to
      `end_fall` of its first window's mean or below, when that mean was at least 0.1 (something to fall from);
    - `teacher_kl` (with a teacher): the teacher KL (`teacher_kl/supervised` each step, probes' `teacher_kl/exact`)
      rose to `kl_rise` x its first window's mean, or, from step `kl_stall_steps` on, is still above `kl_stall` x it
      (on-policy distillation that does not bring the student closer to its teacher);
    - `forgetting` (off unless a budget is given): probe `base_kl` above `max_base_kl`, or the upper end of
      [`ForgettingForecast`]'s forecast Retention below `min_retention`;
    - `reward_spread` (GRPO): the recent window's mean share of reward groups whose rewards differ
      (`reward_groups/spread_frac`, else 1 - TRL's `frac_reward_zero_std`) below `min_reward_spread`: the groups
      whose rewards are all equal give their tokens no advantage;
    - `non_finite`: a logged `loss` or `grad_norm` that is NaN or infinite, at once.

    A threshold set to `None` turns its guard off.
    """

    def __init__(
        self,
        baseline_steps: int = 5,
        window: int = 5,
        loop_rise: float | None = 0.25,
        end_fall: float | None = 0.5,
        kl_rise: float | None = 1.5,
        kl_stall: float | None = 0.9,
        kl_stall_steps: int = 20,
        max_base_kl: float | None = None,
        min_retention: float | None = None,
        min_reward_spread: float | None = 0.1,
    ):
        if baseline_steps < 1 or window < 1:
            raise ValueError(f"baseline_steps and window are numbers of steps >= 1, got {baseline_steps}, {window}")
        self.baseline_steps, self.window = baseline_steps, window
        self.loop_rise, self.end_fall = loop_rise, end_fall
        self.kl_rise, self.kl_stall, self.kl_stall_steps = kl_rise, kl_stall, kl_stall_steps
        self.max_base_kl, self.min_retention, self.min_reward_spread = max_base_kl, min_retention, min_reward_spread
        self.first: dict[str, list[list[float]]] = {}  # metric -> [[step, value], ...] of its first window
        self.recent: dict[str, list[list[float]]] = {}  # metric -> the same of its last `window` steps
        self.fired: dict[str, int] = {}  # guard -> the step it fired at

    def observe(self, step: int, metrics: dict[str, float]) -> list[dict]:
        """Take a step's metrics; return the alarms of the guards that fire at it (each a dict: `step`, `guard`,
        `metric`, `value`, `reference`, `threshold`, `message`)."""
        metrics = dict(metrics)
        if TRL_ZERO_STD in metrics and REWARD_SPREAD not in metrics:
            metrics[REWARD_SPREAD] = 1.0 - metrics[TRL_ZERO_STD]
        alarms = []
        for name in (LOSS, GRAD_NORM):  # at once: one non-finite step is already a broken run
            value = metrics.get(name)
            if value is not None and not math.isfinite(value):
                alarms.append(self._alarm("non_finite", step, name, value, None, None, f"{name} is {value}"))
        for name in WATCHED:
            value = metrics.get(name)
            if value is not None and math.isfinite(value):
                self._remember(name, step, float(value))
        if "loop" not in self.fired and self.loop_rise is not None:
            for name in (ROLLOUT_REPEATS, ROLLOUT_CUT, PROBE_REPEATS, PROBE_CUT):
                alarms.append(self._compare("loop", step, name, "rose", lambda now, ref: now - ref >= self.loop_rise))
        if "end_collapse" not in self.fired and self.end_fall is not None:
            for name in (ROLLOUT_END, PROBE_END):
                fell = lambda now, ref: ref >= 0.1 and now <= self.end_fall * ref  # noqa: E731
                alarms.append(self._compare("end_collapse", step, name, "fell", fell))
        if "teacher_kl" not in self.fired:
            for name in (TEACHER_KL, PROBE_TEACHER_KL):
                if self.kl_rise is not None:
                    rose = lambda now, ref: ref > 0 and now >= self.kl_rise * ref  # noqa: E731
                    alarms.append(self._compare("teacher_kl", step, name, "rose", rose))
                if self.kl_stall is not None and step >= self.kl_stall_steps:
                    stalled = lambda now, ref: ref > 0 and now > self.kl_stall * ref  # noqa: E731
                    alarms.append(self._compare("teacher_kl", step, name, "stalled", stalled))
        alarms.append(self._over_budget(step, metrics))
        if "reward_spread" not in self.fired and self.min_reward_spread is not None and step >= self.window:
            recent = self._recent_mean(REWARD_SPREAD, step)
            if recent is not None and recent < self.min_reward_spread:
                message = f"reward groups with a spread: {recent:.3f} of them over the last {self.window} steps"
                alarms.append(
                    self._alarm("reward_spread", step, REWARD_SPREAD, recent, None, self.min_reward_spread, message)
                )
        return [alarm for alarm in alarms if alarm is not None]

    # ----- windows --------------------------------------------------------------------------------------------
    def _remember(self, name: str, step: int, value: float) -> None:
        first = self.first.setdefault(name, [])
        if not first or step <= self.baseline_steps:
            first.append([step, value])
        recent = self.recent.setdefault(name, []) + [[step, value]]
        self.recent[name] = [pair for pair in recent if pair[0] > step - self.window] or recent[-1:]

    def _recent_mean(self, name: str, step: int) -> float | None:
        pairs = [pair for pair in self.recent.get(name, []) if pair[0] > step - self.window]
        return sum(value for _, value in pairs) / len(pairs) if pairs else None

    def _compare(self, guard: str, step: int, name: str, verb: str, fires) -> dict | None:
        """The alarm of `guard` on `name` when the recent window's mean against the first window's makes `fires`
        true, the two windows sharing no step (and the guard not fired already)."""
        first, recent = self.first.get(name), self.recent.get(name)
        if guard in self.fired or not first or not recent or recent[0][0] <= first[-1][0] or recent[-1][0] != step:
            return None
        reference = sum(value for _, value in first) / len(first)
        now = sum(value for _, value in recent) / len(recent)
        if not fires(now, reference):
            return None
        message = f"{name} {verb}: {now:.4g} over steps {recent[0][0]}-{step} against {reference:.4g} at the start"
        return self._alarm(guard, step, name, now, reference, None, message)

    def _over_budget(self, step: int, metrics: dict[str, float]) -> dict | None:
        if "forgetting" in self.fired:
            return None
        base_kl, retention = metrics.get(BASE_KL), metrics.get(RETENTION_HIGH)
        if self.max_base_kl is not None and base_kl is not None and base_kl > self.max_base_kl:
            message = f"base_kl {base_kl:.4g} is over the budget {self.max_base_kl}"
            return self._alarm("forgetting", step, BASE_KL, base_kl, None, self.max_base_kl, message)
        if self.min_retention is not None and retention is not None and retention < self.min_retention:
            message = f"forecast Retention's upper end {retention:.3f} is under min_retention {self.min_retention}"
            return self._alarm("forgetting", step, RETENTION_HIGH, retention, None, self.min_retention, message)
        return None

    def _alarm(self, guard, step, metric, value, reference, threshold, message) -> dict:
        self.fired.setdefault(guard, step)
        return {
            "step": step,
            "guard": guard,
            "metric": metric,
            "value": value,
            "reference": reference,
            "threshold": threshold,
            "message": message,
        }

    # ----- state, for checkpoints ------------------------------------------------------------------------------
    def windows(self) -> dict:
        return {"first": self.first, "recent": self.recent, "fired": self.fired}

    def load_windows(self, saved: dict) -> None:
        self.first, self.recent, self.fired = saved["first"], saved["recent"], saved["fired"]


class RunGuards(ExportableState, TrainerCallback):
    r"""Warns about, or stops, a run going wrong, from the metrics the lens and TRL log; keeps the best checkpoint by
    a training metric.

    At every `log` event (every `logging_steps`) the guards of [`Guards`] read the logged metrics. A guard that fires
    is logged as a warning and written to `<output_dir>/statelens/guards.jsonl` (one line: `step`, `guard`, `metric`,
    `value`, `reference`, `threshold`, `message`, `action`); with `mode="stop"` it also stops training with a checkpoint
    saved (`control.should_save`, `control.should_training_stop`). The main process's decision is every process's
    (one broadcast per log event, none in a single process). The guards' windows and the guards already fired are
    saved with each checkpoint (in `trainer_state.json`), so a run resumed from the checkpoint of a stop goes on
    without that guard firing again.

    Best checkpoint: when `args.metric_for_best_model` names a training metric that the logs carry (for instance
    `statelens/ends/end_token`, `greater_is_better=True`) and the run does not evaluate, each log event at which a
    checkpoint is saved updates transformers' `state.best_metric` / `state.best_global_step`; transformers then records
    that checkpoint as `best_model_checkpoint`, keeps it from `save_total_limit`'s deletions and, with
    `load_best_model_at_end`, loads it at the end. With evaluation, transformers' own `eval_` metric decides.

    Args:
        mode (`str`, *optional*, defaults to `"warn"`): `"warn"`, `"stop"` or `"off"` (no guard; the best
            checkpoint is still kept).
        **thresholds: the arguments of [`Guards`] (`baseline_steps`, `window`, `loop_rise`, `end_fall`, `kl_rise`,
            `kl_stall`, `kl_stall_steps`, `max_base_kl`, `min_retention`, `min_reward_spread`).
    """

    def __init__(self, mode: str = "warn", **thresholds):
        check_mode(mode)
        self.mode, self.thresholds = mode, thresholds
        self.guards = Guards(**thresholds)

    def state(self) -> dict:
        return {"args": {"mode": self.mode, **self.thresholds}, "attributes": {"windows": self.guards.windows()}}

    def on_train_begin(self, args, state, control, **kwargs):
        self.record = Path(args.output_dir) / "statelens" / GUARDS_FILE
        if getattr(args, "num_generations", None) == 1:  # groups of one rollout have no spread by construction
            self.guards.min_reward_spread = None
        saved = state.stateful_callbacks.get(type(self).__name__) if state.global_step > 0 else None
        if saved and saved.get("attributes", {}).get("windows"):
            self.guards.load_windows(saved["attributes"]["windows"])
        if state.is_world_process_zero:  # a fresh run starts an empty record; a resumed one keeps its earlier steps
            self.record.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if state.global_step > 0 and self.record.exists():
                lines = [line for line in self.record.read_text().splitlines() if line]
                kept = [line for line in lines if json.loads(line)["step"] <= state.global_step]
            self.record.write_text("".join(line + "\n" for line in kept))

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if self.mode != "off":
            alarms = self.guards.observe(state.global_step, logs) if state.is_world_process_zero else []
            alarms = collective.from_main_process(PartialState(), alarms)
            if state.is_world_process_zero:
                self.guards.fired.update({a["guard"]: a["step"] for a in alarms})
            else:  # the main process's guards are the ones that fired: the other processes follow
                for alarm in alarms:
                    self.guards.fired.setdefault(alarm["guard"], alarm["step"])
            for alarm in alarms:
                self._act(alarm, state, control)
        self._track_best(args, state, control, logs)

    def _act(self, alarm: dict, state, control) -> None:
        action = "stop" if self.mode == "stop" else "warn"
        if state.is_world_process_zero:
            logger.warning("guard %s at step %d: %s (%s)", alarm["guard"], alarm["step"], alarm["message"], action)
            with open(self.record, "a", encoding="utf-8") as f:
                f.write(json.dumps({**alarm, "action": action}) + "\n")
        if action == "stop":
            control.should_save = True  # transformers saves the checkpoint right after this log event
            control.should_training_stop = True

    def _track_best(self, args, state, control, logs: dict) -> None:
        name = args.metric_for_best_model
        if name is None or name not in logs or args.eval_strategy != "no" or not control.should_save:
            return
        value = logs[name]
        better = (lambda a, b: a > b) if args.greater_is_better else (lambda a, b: a < b)
        if math.isfinite(value) and (state.best_metric is None or better(value, state.best_metric)):
            state.best_metric, state.best_global_step = value, state.global_step


def check_mode(mode: str) -> None:
    """Refuse an unknown `guards` mode (before a trainer loads any model)."""
    if mode not in MODES:
        raise ValueError(
            f"guards must be one of {MODES} (warn: log and record; stop: also stop with a checkpoint), got {mode!r}"
        )


def attach_guards(trainer, mode: str) -> None:
    """Give `trainer` a [`RunGuards`] in `mode` (its `guards` keyword), unless its callbacks already hold one, or
    `mode` is `"off"` and no metric names the best checkpoint."""
    check_mode(mode)
    held = any(isinstance(cb, RunGuards) for cb in trainer.callback_handler.callbacks)
    if not held and (mode != "off" or trainer.args.metric_for_best_model is not None):
        trainer.add_callback(RunGuards(mode=mode))
