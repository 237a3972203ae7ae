"""Checks of a run's inputs, done before training starts: each names the problem and the fix (docs/bad-input.md).

TRL would otherwise fail later with a `KeyError`, a `TypeError` from inside generation, or not at all: an empty
dataset trains zero steps, and a prompt longer than the model's context is run past the positions the model knows.
"""

from __future__ import annotations

import inspect
import math

from transformers import AutoTokenizer
from trl.data_utils import maybe_apply_chat_template

SFT_COLUMNS = ("messages", "prompt", "input_ids")  # besides `dataset_text_field`


def bound_arguments(trainer_class, args: tuple, kwargs: dict) -> dict:
    """The arguments of `trainer_class(*args, **kwargs)` by name, however they were passed."""
    bound = inspect.signature(trainer_class.__init__).bind_partial(None, *args, **kwargs)
    return bound.arguments


def load_safetensors_only(args) -> None:
    """Models given by path load from safetensors files only (no pickle), unless `model_init_kwargs` says otherwise;
    `trust_remote_code` stays TRL's default, `False`."""
    if args is not None and not isinstance(args.model_init_kwargs, str):
        args.model_init_kwargs = {"use_safetensors": True, **(args.model_init_kwargs or {})}


def check_train_dataset(dataset, required: tuple[str, ...], what: str) -> None:
    """A training set with rows, holding one of the `required` columns (which the trainer `what` reads)."""
    if dataset is None or isinstance(dataset, dict):  # dicts of datasets are for evaluation only
        return
    if hasattr(dataset, "__len__") and len(dataset) == 0:
        raise ValueError(f"{what}: train_dataset has no rows; check the data source or the filter that emptied it.")
    columns = getattr(dataset, "column_names", None)
    if columns is not None and not set(required) & set(columns):
        raise ValueError(
            f"{what}: train_dataset has no {' or '.join(repr(c) for c in required)} column (found {columns}); "
            "rename your column (dataset.rename_column(...)) or build the rows in TRL's prompt/completion layout."
        )


def tokenizer_of(processing_class, model):
    """The tokenizer the trainer will use: the one passed, else the model's (what TRL loads for a model path)."""
    if processing_class is None:
        name = model if isinstance(model, str) else model.config._name_or_path
        processing_class = AutoTokenizer.from_pretrained(name)
    return getattr(processing_class, "tokenizer", processing_class)


def check_tokenizer(tokenizer, eos_token: str | None = None) -> None:
    """An end-of-sequence token: completions end with it, and TRL pads with it when there is no pad token."""
    if (eos_token or tokenizer.eos_token) is None:
        pad = "" if tokenizer.pad_token is None else f" (its pad token is {tokenizer.pad_token!r})"
        raise ValueError(
            f"the tokenizer has no eos token{pad}: completions could never end and there is nothing to pad with. "
            "Set one before training, e.g. tokenizer.eos_token = '<|endoftext|>' (a token of its vocabulary)."
        )


def context_length(model) -> int | None:
    """Tokens the model attends to, from its config's position limit (`None` when the config states none)."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):  # GPT-2 style names first
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    return None


def check_prompt_lengths(dataset, tokenizer, context: int | None, completion_length: int, what: str) -> None:
    """Every prompt plus `completion_length` tokens after it fits in the model's context."""
    if context is None or not hasattr(dataset, "__len__") or "prompt" not in (dataset.column_names or ()):
        return
    check_lengths(dataset["prompt"], tokenizer, context, completion_length, what)


def named_splits(train_dataset, eval_dataset) -> dict:
    """The training data and each evaluation split by the name an error gives it (`eval_dataset['name']` for a dict of
    them), `None` where absent."""
    splits = {"train_dataset": train_dataset}
    if isinstance(eval_dataset, dict):
        splits.update({f"eval_dataset[{name!r}]": split for name, split in eval_dataset.items()})
    else:
        splits["eval_dataset"] = eval_dataset
    return splits


def check_lengths(
    prompts: list,
    tokenizer,
    context: int,
    completion_length: int,
    what: str,
    kind: str = "prompt(s)",
    fix: str = "Filter or shorten those prompts",
) -> None:
    """`prompts` (texts or conversations, through the chat template as the trainers apply it), each plus
    `completion_length` tokens after it, fit the model's `context`; `kind` and `fix` word the error."""
    texts = [maybe_apply_chat_template({"prompt": p}, tokenizer)["prompt"] for p in prompts]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else [0]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] + completion_length > context:
        too_long = sum(length + completion_length > context for length in lengths)
        raise ValueError(
            f"{what}: {too_long} {kind} do not fit the model's context of {context} tokens with "
            f"{completion_length} tokens after them (max_completion_length, plus continuation_length for OPD "
            f"continuations; the longest {kind.removesuffix('(s)')}, row {longest}, has {lengths[longest]} tokens). "
            f"{fix}, or generate fewer tokens."
        )


def check_sequence_lengths(dataset, context: int | None, max_length: int | None, what: str) -> None:
    """Tokenized SFT rows fit the model's context (TRL truncates them to `max_length`, when set)."""
    if context is None or (max_length is not None and max_length <= context) or not hasattr(dataset, "__len__"):
        return
    if "input_ids" not in (dataset.column_names or ()):
        return
    longest = max(len(ids) for ids in dataset["input_ids"])
    if longest > context:
        raise ValueError(
            f"{what}: training sequences of up to {longest} tokens do not fit the model's context of {context} "
            f"tokens (max_length={max_length}). Set max_length to at most {context}, or shorten the rows."
        )


def check_probe_lengths(tokenizer, prompts: list[str], max_new_tokens: int, context: int | None) -> None:
    """Probe prompts plus their sampled tokens fit the model's context."""
    if context is None:
        return
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    if max(lengths) + max_new_tokens > context:
        raise ValueError(
            f"StateLoggingCallback: a probe prompt of {max(lengths)} tokens plus probe_max_new_tokens={max_new_tokens} "
            f"does not fit the model's context of {context} tokens; use shorter probe prompts or fewer new tokens."
        )


OVERFLOW_METRIC = "statelens/skipped_overflow_steps"


class FiniteGradientsMixin:
    """Stops training with a clear error at the first non-finite gradient that would reach the weights.

    A NaN or infinite loss gives non-finite gradients, so this catches both. The norm is the one the trainer computes
    anyway (for clipping and logging), the same on every rank, so all ranks stop together. Without a loss scaler the
    error comes before the optimizer applies the step: the weights keep the last finite step, checkpoints and the
    ledger hold every finished step, and the run can resume from its last checkpoint (with, for example, a lower
    learning rate).

    fp16 training scales the loss, and a step whose scaled gradients overflow is skipped by the loss scaler (which then
    halves the scale): that is how fp16 finds its scale (PyTorch's `GradScaler` starts at 2**16), not an error. Such a
    step is let through to the scaler, which skips it, and counted: `statelens/skipped_overflow_steps` in the training
    logs is the number of steps skipped since the previous log (logged in every fp16 run). Training stops only once the scale is below 1: there the
    gradients overflow without any scaling, as DeepSpeed stops at its minimum loss scale (1 by default). Under DeepSpeed
    the engine has already stepped when the norm is known (accelerate steps it inside `backward`): a step it skipped is
    counted; a non-finite step it applied (no overflow check, as in bf16) stops training, with the weights no longer
    finite.
    """

    _skipped_overflow_steps = 0  # since the last training log
    _overflow_steps_in_run = 0

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        if grad_norm is None or math.isfinite(float(grad_norm)):
            return grad_norm
        step = self.state.global_step + 1
        engine = getattr(self.accelerator, "deepspeed_engine_wrapped", None)
        scaler = self.accelerator.scaler
        if engine is not None:
            if not engine.engine.was_step_applied():
                self._count_overflow_step()
                return grad_norm
            raise FloatingPointError(
                f"non-finite gradient norm ({float(grad_norm)}) in step {step}, from a NaN or infinite loss or "
                "gradient, and DeepSpeed applied the step (its engine steps inside backward, before the norm is known): "
                f"the weights are no longer finite. Training stopped; the ledger and the last checkpoint hold the steps "
                "before. Resume from that checkpoint with a lower learning_rate, max_grad_norm clipping or fp32."
            )
        if scaler is not None and scaler.is_enabled():
            scale = scaler.get_scale()
            if scale >= 1.0:  # the scaler skips this step (the optimizer never sees it) and halves its scale
                self._count_overflow_step()
                return grad_norm
            raise FloatingPointError(
                f"non-finite gradient norm ({float(grad_norm)}) in step {step} with the fp16 loss scale already down "
                f"to {scale}, after {self._overflow_steps_in_run} overflow steps skipped: the gradients are not "
                "finite even unscaled (a NaN or infinite loss, or values beyond fp16's range). Training stopped before "
                f"the optimizer step, so the weights are those after step {step - 1}. Resume from the last checkpoint "
                "with a lower learning_rate, or train in bf16 or fp32."
            )
        raise FloatingPointError(
            f"non-finite gradient norm ({float(grad_norm)}) in step {step}, from a NaN or infinite loss or gradient: "
            f"training stopped before the optimizer step, so the weights are those after step {step - 1}. Finished "
            "steps are in the ledger and the last checkpoint; resume from it with a lower learning_rate, max_grad_norm "
            "clipping, or fp32 instead of fp16."
        )

    def _count_overflow_step(self) -> None:
        self._skipped_overflow_steps += 1
        self._overflow_steps_in_run += 1

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and (self.args.fp16 or self._skipped_overflow_steps):  # training logs of fp16 runs
            logs[OVERFLOW_METRIC] = self._skipped_overflow_steps
            self._skipped_overflow_steps = 0
        super().log(logs, start_time)
