"""Preflight: measured checks of a run's setting before its first step (docs/preflight.md).

Each StateLens trainer runs [`run_preflight`] at the start of training (the [`PreflightCallback`] its `__init__`
attaches: after the models are loaded and prepared, before step 1; not on a resume from a checkpoint, which continues
a run the preflight already read), on its first `preflight_prompts` training rows, and

- `preflight="warn"` (the default): writes `<output_dir>/statelens/preflight.json` (main process), logs a readable
  block, and trains;
- `preflight="strict"`: the same, then raises [`PreflightFailed`] listing each failing check and its fix when any
  check fails;
- `preflight="off"`: runs nothing, writes nothing.

Every rank runs the same work on the same rows (generation and forwards are collective under ZeRO-3) and takes the
main process's result ([`collective.from_main_process`]), so every rank reaches the same verdict.
"""

from __future__ import annotations

import logging
import time

import torch
from transformers import TrainerCallback

from .. import collective
from .sampling import first_rows, forked_rng, student_answers
from .verdicts import (
    PREFLIGHT_FILE,
    PREFLIGHT_MODES,
    Check,
    PreflightFailed,
    read_summary,
    readable_block,
    refusal_message,
    summary,
    write_summary,
)

__all__ = [
    "PREFLIGHT_FILE",
    "PREFLIGHT_MODES",
    "Check",
    "PreflightCallback",
    "PreflightFailed",
    "attach_preflight",
    "check_preflight_settings",
    "read_summary",
    "run_preflight",
]

logger = logging.getLogger(__name__)


def check_preflight_settings(mode: str, prompts: int) -> None:
    if mode not in PREFLIGHT_MODES:
        raise ValueError(f"preflight={mode!r} is not one of {PREFLIGHT_MODES}: 'warn' (default), 'strict' or 'off'")
    if prompts < 1:
        raise ValueError(f"preflight_prompts must be at least 1 training prompt, got {prompts}")


def measure(trainer, prompts: int) -> list[Check]:
    """Every check that applies to `trainer`, on its first `prompts` training rows."""
    from ..trainers.grpo import StateLensGRPOTrainer
    from ..trainers.sft import StateLensSFTTrainer

    if isinstance(trainer, StateLensSFTTrainer):
        from .sft import sft_checks

        return sft_checks(trainer, prompts)
    if not isinstance(trainer, StateLensGRPOTrainer):
        raise TypeError(f"the preflight runs on StateLens trainers, not {type(trainer).__name__}")
    from .grpo import end_token_checks, reward_spread, rollout_checks

    checks = end_token_checks(trainer)
    distills = hasattr(trainer, "teacher")
    # GRPO needs groups for its spread: the rows' prompts repeated `num_generations` times, `prompts` rollouts in all
    group = 1 if distills else trainer.num_generations
    rows = [row for row in first_rows(trainer.train_dataset, max(prompts // group, 1)) for _ in range(group)]
    prompt_ids = [list(ids) for ids in trainer._tokenize_prompts([row["prompt"] for row in rows])[0]]
    answers = student_answers(trainer, prompt_ids)
    texts = trainer._tokenizer.batch_decode(answers, skip_special_tokens=True)
    # A group of cut rollouts has reward std 0, so GRPO learns nothing from it; OPD's teacher is there to teach a cut
    # student to end (a cut answer is supervised like any other unless `mask_truncated_completions`): a warning
    cut_fail = None if distills else 0.9
    checks += rollout_checks(
        trainer, "student", answers, texts, repeats_warn=0.5, repeats_fail=None, cut_fail=cut_fail
    )
    if not distills or trainer.args.reward_weight != 0:
        prompts_given = [row["prompt"] for row in rows]
        checks += reward_spread(trainer, rows, prompts_given, answers, texts)
    if distills:
        from .opd import teacher_checks

        with forked_rng(trainer):
            torch.manual_seed(trainer.args.seed)
            checks += teacher_checks(trainer, rows, prompt_ids, answers, texts)
    return checks


def run_preflight(trainer, mode: str | None = None, prompts: int | None = None) -> dict | None:
    """Run the preflight of `trainer` (its own `preflight` and `preflight_prompts` unless given): write, log and,
    with `mode="strict"` and a failing check, raise [`PreflightFailed`]. Returns what `preflight.json` holds (the same
    on every rank), or `None` with `mode="off"`. Every rank calls it."""
    mode = mode or trainer._preflight
    prompts = prompts or trainer._preflight_prompts
    check_preflight_settings(mode, prompts)
    if mode == "off":
        return None
    start = time.perf_counter()
    checks = measure(trainer, prompts)
    result = summary(type(trainer).__name__, checks, time.perf_counter() - start, prompts)
    result = collective.from_main_process(trainer.accelerator, result)
    if trainer.accelerator.is_main_process:
        write_summary(trainer.args.output_dir, result)
        log = logger.info if result["verdict"] == "pass" else logger.warning
        log(readable_block(result))
    if mode == "strict" and result["verdict"] == "fail":
        raise PreflightFailed(refusal_message(result))
    return result


class PreflightCallback(TrainerCallback):
    """Runs [`run_preflight`] at the start of a fresh run (step 0), before the first step."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            run_preflight(self.trainer)


def attach_preflight(trainer, preflight: str, preflight_prompts: int) -> None:
    """Check the settings and put a [`PreflightCallback`] first among `trainer`'s callbacks (so that `strict`
    refuses before any other callback's start-of-training work); none with `preflight="off"`."""
    check_preflight_settings(preflight, preflight_prompts)
    trainer._preflight, trainer._preflight_prompts = preflight, preflight_prompts
    if preflight != "off":
        trainer.callback_handler.callbacks.insert(0, PreflightCallback(trainer))
