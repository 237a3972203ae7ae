"""`StateLensSFTTrainer`: TRL's `SFTTrainer`, plus a record of the dataset states each step supervises."""

from __future__ import annotations

import json
from pathlib import Path

import torch.nn.functional as F
from trl import SFTTrainer

from ..checks import (
    SFT_COLUMNS,
    FiniteGradientsMixin,
    bound_arguments,
    check_sequence_lengths,
    check_tokenizer,
    check_train_dataset,
    context_length,
    load_safetensors_only,
    tokenizer_of,
)
from ..guards import attach_guards, check_mode
from ..lens.callback import attach_state_logging
from ..lens.recorder import StateRecorderMixin
from ..preflight import attach_preflight, check_preflight_settings


class StateLensSFTTrainer(StateRecorderMixin, FiniteGradientsMixin, SFTTrainer):
    """[`~trl.SFTTrainer`] that records, for every optimizer step, which states it supervised.

    Same arguments, same training: the records are read off the loss's own forward (TRL's fused LM head already
    returns the per-token log-probs and entropies), so there is no extra forward pass and nothing in the loss changes.
    Every supervised token is a `dataset` state with weight 1; its prefix length counts the tokens since the first
    supervised token of its sequence (the end of the prompt for prompt-completion data; with packing or
    padding-free batches, sequences are split where `position_ids` restart at 0).

    Bad input (an empty dataset, no text/prompt/messages column, a tokenizer without eos, rows longer than the model's
    context) is refused before training, with the fix in the message; a non-finite gradient stops training before the
    optimizer applies it, except an fp16 overflow step, which the loss scaler skips: counted in
    `statelens/skipped_overflow_steps` (docs/bad-input.md).

    Args:
        *args, **kwargs: the arguments of [`~trl.SFTTrainer`].
        state_logging (`bool`, *optional*, defaults to `True`):
            Attach a default [`StateLoggingCallback`] (records and ledger, no probe drift) unless `callbacks` already
            holds one. With `False` and no such callback, nothing is recorded.
        guards (`str`, *optional*, defaults to `"warn"`):
            Attach a [`~trl_statelens.guards.RunGuards`] in this mode unless `callbacks` already holds one: `"warn"`
            (log and record each guard that fires), `"stop"` (also stop training with a checkpoint saved) or `"off"`
            (docs/guards.md).
        preflight (`str`, *optional*, defaults to `"warn"`):
            Measured checks before the first step (docs/preflight.md): whether the data's answers end with an end
            token after the collator, and the data's off-policy gap against the model. `"warn"` writes
            `statelens/preflight.json` and logs the result, `"strict"` also refuses to train when a check fails,
            `"off"` runs none.
        preflight_prompts (`int`, *optional*, defaults to `16`):
            Training rows the preflight reads.
    """

    def __init__(
        self,
        *args,
        state_logging: bool = True,
        guards: str = "warn",
        preflight: str = "warn",
        preflight_prompts: int = 16,
        **kwargs,
    ):
        check_mode(guards)
        check_preflight_settings(preflight, preflight_prompts)
        given = bound_arguments(SFTTrainer, args, kwargs)
        text_field = getattr(given.get("args"), "dataset_text_field", "text")
        check_train_dataset(given.get("train_dataset"), (text_field, *SFT_COLUMNS), "StateLensSFTTrainer")
        tokenizer = tokenizer_of(given.get("processing_class"), given["model"])
        check_tokenizer(tokenizer, getattr(given.get("args"), "eos_token", None))
        load_safetensors_only(given.get("args"))
        super().__init__(*args, **kwargs)
        check_sequence_lengths(self.train_dataset, context_length(self.model), self.args.max_length, "SFT")
        # The hook sees the loss's forward through any wrapper (DDP, DeepSpeed, PEFT): they all call this module
        self.model.register_forward_hook(self._record_fused_outputs, with_kwargs=True)
        attach_state_logging(self, state_logging)
        attach_guards(self, guards)
        attach_preflight(self, preflight, preflight_prompts)

    # SFTTrainer counts the tokens trained on (`num_tokens`, and the run's FLOPs from it) in memory only: a resumed run
    # would count from 0 again. The count travels with each checkpoint's RNG state, one file per process.
    TOKENS_FILE = "statelens_sft_tokens_{rank}.json"

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        path = Path(output_dir) / self.TOKENS_FILE.format(rank=self.args.process_index)
        path.write_text(json.dumps({"total_train_tokens": int(self._total_train_tokens)}))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        path = None if checkpoint is None else Path(checkpoint) / self.TOKENS_FILE.format(rank=self.args.process_index)
        if path is not None and path.is_file():
            self._total_train_tokens = json.loads(path.read_text())["total_train_tokens"]

    def _record_fused_outputs(self, module, args, kwargs, outputs) -> None:
        # Only the training loss: `fused_lm_head=True` marks it, and evaluation runs the model in eval mode
        if not (module.training and kwargs.get("fused_lm_head")) or kwargs.get("input_ids") is None:
            return

        # The fused head scores label t+1 at position t; shift by one so entry i is about token i
        def align(per_token):
            return F.pad(per_token, (1, 0))

        self._record_states(
            input_ids=kwargs["input_ids"],
            supervised_mask=align(outputs.label_mask),
            logps=align(outputs.log_probs),
            entropy=align(outputs.entropy),
            source="dataset",
            attention_mask=kwargs.get("attention_mask"),
            position_ids=kwargs.get("position_ids"),
        )
