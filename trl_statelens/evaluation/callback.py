"""The evaluation during training: :class:`RetentionEvalCallback`."""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback
from transformers.utils import logging

from .runner import RETENTION_TASKS, build_tasks, retention_summary, run_tasks, scalar_metrics, write_items

logger = logging.get_logger(__name__)


class RetentionEvalCallback(TrainerCallback):
    """Run evaluation tasks on the training model every ``eval_steps`` steps and log the scores.

    Scores are logged as ``eval/<task>/<metric>``; with ``eval_on_start`` the step-0 scores become the base and
    every later evaluation also logs ``eval/forgetting`` and ``eval/retention`` against them. Pass ``trainer`` (TRL's
    convention for callbacks that log, e.g. ``callback = RetentionEvalCallback(...); trainer.add_callback(callback);
    callback.trainer = trainer``) so scores go through ``trainer.log`` to every reporting integration; without it
    they are appended to ``state.log_history`` only. Every process evaluates (ZeRO-3 needs all ranks in the forward
    pass); the trainer reports from the main process. Keep ``limit`` small: this runs inside the training loop.

    Args:
        tasks: task names (built with ``data_dir``, ``limit``, ``seed``, ``protocol``, ``task_kwargs``) or task
            instances; their data is loaded here, before training starts.
        eval_steps: evaluate when ``global_step`` is a multiple of this.
        eval_on_start: also evaluate before the first step (the base for forgetting and retention).
        tokenizer: defaults to the trainer's ``processing_class``.
        items_dir: also write each evaluation's per-item scores to ``<items_dir>/step<N>.items.jsonl`` (from the
            main process), for intervals over items on the curve; ``None`` (default) keeps the scores only.
    """

    def __init__(
        self,
        tasks=RETENTION_TASKS,
        eval_steps: int = 100,
        *,
        trainer=None,
        tokenizer=None,
        data_dir: str | Path | None = None,
        limit: int | dict | None = 50,
        seed: int = 0,
        batch_size: int = 16,
        protocol: str = "statelens",
        task_kwargs: dict | None = None,
        eval_on_start: bool = True,
        prefix: str = "eval/",
        items_dir: str | Path | None = None,
    ):
        if eval_steps < 1:
            raise ValueError(f"eval_steps must be a positive number of steps, got {eval_steps}")
        self.tasks = build_tasks(
            tasks,
            data_dir=data_dir,
            limit=limit,
            seed=seed,
            batch_size=batch_size,
            protocol=protocol,
            task_kwargs=task_kwargs,
        )
        self.eval_steps, self.trainer, self.tokenizer = eval_steps, trainer, tokenizer
        self.eval_on_start, self.prefix = eval_on_start, prefix
        self.items_dir = None if items_dir is None else Path(items_dir)
        self.base_scores: dict | None = None
        self.history: list[dict] = []

    def _tokenizer(self, kwargs):
        tokenizer = self.tokenizer or kwargs.get("processing_class")
        if tokenizer is None and self.trainer is not None:
            tokenizer = self.trainer.processing_class
        if tokenizer is None:
            raise ValueError("RetentionEvalCallback has no tokenizer: pass tokenizer=... or a trainer")
        return getattr(tokenizer, "tokenizer", tokenizer)  # a processor wraps its tokenizer

    def evaluate(self, state, model, tokenizer) -> dict[str, float]:
        was_training = getattr(model, "training", False)
        model.eval()
        try:
            outputs = run_tasks(model, tokenizer, self.tasks, progress=False)
            scores = {t.name: outputs[t.name]["metrics"][t.primary_metric] for t in self.tasks}
            logs = {
                f"{self.prefix}{name}/{key}": value
                for name, output in outputs.items()
                for key, value in scalar_metrics(output["metrics"]).items()
            }
            if self.items_dir is not None and state.is_world_process_zero:
                records = {name: output["records"] for name, output in outputs.items()}
                write_items(records, self.items_dir / f"step{state.global_step}.items.jsonl")
            if self.base_scores is None:
                self.base_scores = scores
            elif any(t in scores for t in RETENTION_TASKS):
                try:
                    summary = retention_summary(self.base_scores, scores)
                    logs.update({f"{self.prefix}{key}": value for key, value in summary.items()})
                except ValueError as err:  # a base score of 0 leaves retention undefined: log the scores only
                    logger.warning_once(f"RetentionEvalCallback logs no forgetting/retention: {err}")
            self.history.append({"step": state.global_step, **logs})
            if self.trainer is not None:
                # Logged while the model is still in eval mode: TRL trainers' `log()` adds (and clears) the metrics
                # queued for the mode the model is in, so in train mode these scores would take the step's training
                # metrics (loss parts, rewards, `statelens/*`) away from the trainer's own log entry.
                # `log()` also ends in the callbacks' `on_log`, which clears `should_log`: restored, so the trainer
                # still writes its own log entry of this step (loss, learning rate) after the step-end callbacks.
                should_log = self.trainer.control.should_log
                self.trainer.log(logs)
                self.trainer.control.should_log = should_log
            else:
                state.log_history.append({**logs, "step": state.global_step})
        finally:
            model.train(was_training)
        return logs

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.eval_on_start and model is not None:
            self.evaluate(state, model, self._tokenizer(kwargs))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is not None and state.global_step % self.eval_steps == 0:
            self.evaluate(state, model, self._tokenizer(kwargs))
