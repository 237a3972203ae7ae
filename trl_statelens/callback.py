"""`StateLoggingCallback`: per-step state metrics, an on-disk state ledger and probe drift, for any TRL trainer."""

from __future__ import annotations

import json
import logging
import math
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list
from transformers import GenerationConfig, TrainerCallback
from trl.models.utils import unwrap_model_for_generation

from .checks import check_probe_lengths, context_length
from .drift import PrefixFeatures, probe_drift
from .records import StateRecorderMixin, aggregate_states, prefix_len_histogram

logger = logging.getLogger(__name__)

METRIC_PREFIX = "statelens/"
LEDGER_FILES = ("steps.jsonl", "states.jsonl", "drift.jsonl")
DRIFT_REFERENCE_FILE = "drift_reference.json"
DEFAULT_PROBE_MAX_NEW_TOKENS = 64


class StateLoggingCallback(TrainerCallback):
    r"""Logs which states a trainer supervises, keeps a ledger of them on disk, and measures probe drift.

    At the end of every optimizer step:

    - with a StateLens trainer ([`StateLensSFTTrainer`], [`StateLensGRPOTrainer`] or any trainer using
      [`StateRecorderMixin`]), the step's state records are gathered from every rank and aggregated (`state_nll`,
      `state_entropy`, `offpolicy_gap`, `source_frac/*`, `prefix_len/*`, `weight/*`, and `teacher_nll`/`teacher_kl`
      when a teacher scored the tokens). The aggregates go into the trainer's metrics under the `statelens/` prefix,
      so they are logged (and reach `report_to` backends) with the trainer's own metrics;
    - every `probe_steps` steps, the current policy samples the probe prompts and the drift of its prefix states
      against step 0 is logged as `statelens/drift/{mmd,centroid,sliced_wasserstein,jaccard}`;
    - with a teacher in the trainer's process (`trainer.teacher_model`: [`OnPolicyDistillTrainer`], TRL's
      `DistillationTrainer`), the same probe step also measures where the student still disagrees with it, whatever
      the training signal: the exact per-token reverse KL $\mathrm{KL}(p_S \| p_T)$ over the whole vocabulary at
      every completion position, averaged over the probe completion tokens, as `statelens/drift/teacher_kl` on the
      student's current samples (its own states now), `teacher_kl_fixed` on the step-0 samples (fixed states:
      a fall there is agreement, not a change of states), `teacher_kl_number` / `teacher_kl_other` on tokens whose
      text holds a digit / the rest, with `number_frac` (the share of number tokens) and `probe_tokens` (mean
      completion tokens per probe; rollouts getting shorter lower a summed KL without any agreement). `drift.jsonl`
      adds `teacher_kl_by_prefix`: `[tokens, mean KL]` per prefix-length bin (the bins of `prefix_len_hist`).

    Attached to a stock TRL trainer (`SFTTrainer`, `GRPOTrainer`, `DistillationTrainer`, ...) it runs probe drift only
    and says so once in the log.

    The ledger, written by the main process under `<output_dir>/statelens/` and flushed every step:

    - `steps.jsonl`: one line per optimizer step with the aggregates and `prefix_len_hist` (supervised tokens per
      prefix-length bin `k`, covering prefix lengths `[2**k - 1, 2**(k+1) - 1)`);
    - `states.jsonl`: the sampled sequences (a `sample_rate` share of them), with prompt and completion text and
      per-token `prefix_len`, `logp`, `entropy`, `teacher_logp` and `weight`, plus `reward` when there is one;
    - `drift.jsonl`: one line per probe step with the four drift distances and the number of probe states;
    - `drift_reference.json`: the step-0 probe completions, so a resumed run measures drift against the same
      reference.

    A run resumed from a checkpoint drops the ledger lines after the checkpoint's step, so each step appears once.

    Args:
        trainer (`transformers.Trainer`, *optional*):
            Trainer to observe. StateLens trainers attach themselves; pass it when adding the callback to a stock
            trainer (`trainer.add_callback(StateLoggingCallback(trainer, probe_prompts=...))`).
        probe_prompts (`list[str]` or `list[list[dict]]`, *optional*):
            Fixed prompts for probe drift: plain strings, or conversations (lists of `{"role", "content"}` messages)
            formatted with the tokenizer's chat template. Without them there is no drift.
        probe_steps (`int`, *optional*, defaults to `50`):
            Measure drift every this many optimizer steps.
        sample_rate (`float`, *optional*, defaults to `0.05`):
            Share of the supervised sequences written with their text to `states.jsonl`.
        probe_max_new_tokens (`int`, *optional*):
            Tokens sampled per probe prompt. Defaults to the trainer's own generation length (`max_completion_length`
            of GRPO-like trainers), else 64.
        probe_seed (`int`, *optional*, defaults to `0`):
            Seed of the probe sampling. Probe sampling is seeded (and leaves the training RNG untouched), so the drift
            of an unchanged policy is exactly 0.
    """

    def __init__(
        self,
        trainer=None,
        probe_prompts: list | None = None,
        probe_steps: int = 50,
        sample_rate: float = 0.05,
        probe_max_new_tokens: int | None = None,
        probe_seed: int = 0,
    ):
        if probe_steps < 1:
            raise ValueError(f"probe_steps must be a positive number of steps, got {probe_steps}")
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"sample_rate is a share of sequences, between 0 and 1; got {sample_rate}")
        if probe_prompts is not None and len(probe_prompts) == 0:
            raise ValueError("probe_prompts is empty: pass some prompts, or None to turn probe drift off")
        self.trainer = trainer
        self.probe_prompts = probe_prompts
        self.probe_steps = probe_steps
        self.sample_rate = sample_rate
        self.probe_max_new_tokens = probe_max_new_tokens
        self.probe_seed = probe_seed
        self._reference_features = None

    # ----- training events --------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise ValueError(
                "StateLoggingCallback needs the trainer: create it with StateLoggingCallback(trainer, ...) or use a "
                "StateLens trainer, which attaches it."
            )
        self.ledger_dir = Path(args.output_dir) / "statelens"
        self.records_states = isinstance(self.trainer, StateRecorderMixin)
        if self.records_states:
            self.trainer._start_state_recording()
        elif state.is_world_process_zero:
            logger.warning(
                "StateLoggingCallback on %s: per-step state records need a StateLens trainer (StateLensSFTTrainer, "
                "StateLensGRPOTrainer); this run logs probe drift only.",
                type(self.trainer).__name__,
            )
        if state.global_step == 0:
            self._check_no_ledger_on_every_rank(state)
        if state.is_world_process_zero:
            self._prepare_ledger(resumed_at=state.global_step)
        if self.probe_prompts is not None:
            self._check_probe_lengths()
            self._reference_texts = self._reference_completions(state)
            self._reference_features = PrefixFeatures(self._reference_texts)

    def on_step_end(self, args, state, control, **kwargs):
        if self.records_states:
            records = self.trainer._collect_state_records(self.sample_rate, seed=args.seed)
            metrics = aggregate_states(records)
            self._log_metrics(metrics)
            if state.is_world_process_zero:
                line = {"step": state.global_step, "epoch": state.epoch, **metrics}
                line["prefix_len_hist"] = prefix_len_histogram(records)
                self._append("steps.jsonl", [line])
                self._append("states.jsonl", records.samples)
        if self.probe_prompts is not None and state.global_step % self.probe_steps == 0:
            completions = self._sample_probes()
            states = PrefixFeatures(completions)
            drift = probe_drift(self._reference_features, states)
            by_prefix = None
            if self._has_teacher():
                own, by_prefix = self._teacher_disagreement(completions)
                fixed, _ = self._teacher_disagreement(self._reference_texts)
                drift.update({**own, "teacher_kl_fixed": fixed["teacher_kl"]})
            self._log_metrics({f"drift/{name}": value for name, value in drift.items()})
            if state.is_world_process_zero:
                line = {"step": state.global_step, **drift, "num_states": states.num_states}
                if by_prefix is not None:
                    line["teacher_kl_by_prefix"] = by_prefix
                self._append("drift.jsonl", [line])

    # ----- logging and ledger ----------------------------------------------------------------------------------
    def _log_metrics(self, metrics: dict[str, float]) -> None:
        """Queue metrics in the trainer's own metric store, which its next `log()` averages and reports."""
        store = getattr(self.trainer, "_metrics", None)
        if store is None:
            return
        for name, value in metrics.items():
            if math.isfinite(value):
                store["train"][METRIC_PREFIX + name].append(value)

    def _check_no_ledger_on_every_rank(self, state) -> None:
        """A fresh run refuses a folder holding another run's ledger (it would be lost). The main process, which owns
        the ledger, checks; every rank raises its verdict, so none is left waiting in a collective for the others."""
        refusal = None
        if state.is_world_process_zero:
            try:
                check_no_ledger(self.ledger_dir.parent)
            except ValueError as error:
                refusal = str(error)
        if self.trainer.accelerator.num_processes > 1:
            refusal = broadcast_object_list([refusal])[0]
        if refusal is not None:
            raise ValueError(refusal)

    def _prepare_ledger(self, resumed_at: int) -> None:
        """A fresh run starts an empty ledger (another run's was refused on every rank first); a resumed one keeps the
        lines up to the checkpoint's step, dropping a torn last line, which a run killed while writing leaves behind.
        """
        self.ledger_dir.mkdir(parents=True, exist_ok=True)
        if resumed_at == 0:
            (self.ledger_dir / DRIFT_REFERENCE_FILE).unlink(missing_ok=True)
        for name in LEDGER_FILES:
            path = self.ledger_dir / name
            if resumed_at == 0 or not path.exists():
                path.unlink(missing_ok=True)  # empty files only: check_no_ledger refused any other
                continue
            rows = [line for line in path.read_text().splitlines() if line]
            if rows and not _parses(rows[-1]):
                logger.warning("%s: dropping a torn last line (a run killed while writing it): %r", path, rows.pop())
            kept = [line for line in rows if json.loads(line)["step"] <= resumed_at]
            path.write_text("".join(line + "\n" for line in kept))

    def _append(self, name: str, rows: list[dict]) -> None:
        if not rows:
            return
        with open(self.ledger_dir / name, "a", encoding="utf-8") as f:  # closing flushes: the ledger survives a crash
            for row in rows:
                f.write(json.dumps(_json_safe(row), allow_nan=False) + "\n")

    # ----- probe drift -----------------------------------------------------------------------------------------
    def _reference_completions(self, state) -> list[str]:
        """Step-0 probe completions: sampled now on a fresh run, read back from the ledger on a resumed one."""
        path = self.ledger_dir / DRIFT_REFERENCE_FILE
        if state.global_step > 0 and path.exists():
            return json.loads(path.read_text())["completions"]
        if state.global_step > 0:
            logger.warning("Resumed without %s: probe drift is measured against the resumed policy.", path)
        completions = self._sample_probes()
        if state.is_world_process_zero:
            partial = path.with_suffix(".partial")  # written whole, then renamed: a kill never leaves half of it
            partial.write_text(json.dumps({"step": state.global_step, "completions": completions}))
            partial.replace(path)
        return completions

    def _probe_texts(self, tokenizer) -> list[str]:
        """The probe prompts as text: conversations formatted with the tokenizer's chat template."""
        return [
            p if isinstance(p, str) else tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
            for p in self.probe_prompts
        ]

    def _probe_generation_config(self, model) -> GenerationConfig:
        """The trainer's sampling settings when it has them (GRPO-like trainers), else the model's, with sampling."""
        config = trainer_generation_config(self.trainer)
        if config is None:
            config = GenerationConfig.from_dict(model.generation_config.to_dict())
            config.do_sample = True
            config.max_new_tokens = DEFAULT_PROBE_MAX_NEW_TOKENS
        if self.probe_max_new_tokens is not None:
            config.max_new_tokens = self.probe_max_new_tokens
        return config

    def _check_probe_lengths(self) -> None:
        tokenizer = getattr(self.trainer.processing_class, "tokenizer", self.trainer.processing_class)
        prompts = self._probe_texts(tokenizer)
        model = self.trainer.model
        max_new_tokens = self._probe_generation_config(model).max_new_tokens
        check_probe_lengths(tokenizer, prompts, max_new_tokens, context_length(model))

    @torch.no_grad()
    def _sample_probes(self) -> list[str]:
        """Completions of the current policy on the probe prompts, sampled with a fixed seed.

        Every rank samples the same completions (same seed, same weights), which keeps sharded models (ZeRO-3) in
        step; the training RNG is forked, so probing does not change the training run.
        """
        trainer = self.trainer
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        prompts = self._probe_texts(tokenizer)
        device = trainer.accelerator.device
        inputs = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        inputs = inputs.to(device)
        with (
            unwrap_model_for_generation(
                trainer.model_wrapped,
                trainer.accelerator,
                # GRPO-like trainers' setting: False samples from the ZeRO-3 shards, without gathering the whole model
                gather_deepspeed3_params=getattr(trainer.args, "ds3_gather_for_generation", True),
                generation_kwargs=getattr(trainer, "generation_kwargs", None),
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,  # re-enabled as it was
            ) as model,
            seeded_rng(device, self.probe_seed),
        ):
            was_training = model.training
            model.eval()
            output = model.generate(**inputs, generation_config=self._probe_generation_config(model))
            model.train(was_training)
        return tokenizer.batch_decode(output[:, inputs["input_ids"].size(1) :], skip_special_tokens=True)

    # ----- teacher disagreement on probe states ----------------------------------------------------------------
    def _has_teacher(self) -> bool:
        return getattr(self.trainer, "teacher_model", None) is not None

    @torch.no_grad()
    def _teacher_disagreement(self, completions: list[str]) -> tuple[dict[str, float], list[list[float]]]:
        """Exact reverse KL of the student from the teacher at every token of the probe completions (each probe
        prompt followed by its completion), overall, by token kind and by prefix-length bin.

        Every rank scores the same rows (ZeRO-3 forwards are collective); four rows at a time bound the
        `(rows, length, vocabulary)` logits.
        """
        trainer = self.trainer
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        prompts = self._probe_texts(tokenizer)
        temperature = getattr(trainer, "temperature", 1.0) or 1.0
        digit = self._number_token_table(tokenizer)
        device = trainer.accelerator.device
        student, teacher = trainer.model, trainer.teacher_model
        student_was_training = student.training
        student.eval()
        kls, numbers, prefix = [], [], []
        try:
            for start in range(0, len(prompts), 4):
                rows = []
                for prompt, completion in zip(prompts[start : start + 4], completions[start : start + 4]):
                    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
                    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
                    rows.append((prompt_ids, completion_ids))
                width = max(len(p) + len(c) for p, c in rows)
                input_ids = torch.full((len(rows), width), tokenizer.pad_token_id or 0, dtype=torch.long)
                attention_mask = torch.zeros_like(input_ids)
                for i, (p, c) in enumerate(rows):
                    input_ids[i, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
                    attention_mask[i, : len(p) + len(c)] = 1
                input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
                student_logits = student(input_ids=input_ids, attention_mask=attention_mask).logits.float()
                teacher_logits = teacher(input_ids=input_ids, attention_mask=attention_mask).logits.float()
                vocab = min(student_logits.size(-1), teacher_logits.size(-1), len(digit))  # padded heads: real ids
                student_logp = torch.log_softmax(student_logits[..., :vocab] / temperature, dim=-1)
                teacher_logp = torch.log_softmax(teacher_logits[..., :vocab] / temperature, dim=-1)
                kl = (student_logp.exp() * (student_logp - teacher_logp)).sum(-1).cpu()
                for i, (p, c) in enumerate(rows):
                    # the token at position len(p) + k is predicted from position len(p) + k - 1
                    kls.append(kl[i, len(p) - 1 : len(p) + len(c) - 1])
                    numbers.append(digit[torch.tensor(c, dtype=torch.long)])
                    prefix.append(torch.arange(len(c)))
        finally:
            student.train(student_was_training)
        kl, number, prefix_len = torch.cat(kls).double(), torch.cat(numbers), torch.cat(prefix)
        tokens = max(kl.numel(), 1)
        metrics = {
            "teacher_kl": kl.sum().item() / tokens,
            "teacher_kl_number": kl[number].mean().item() if number.any() else float("nan"),
            "teacher_kl_other": kl[~number].mean().item() if (~number).any() else float("nan"),
            "number_frac": number.double().sum().item() / tokens,
            "probe_tokens": kl.numel() / len(prompts),
        }
        bins = torch.log2(prefix_len.double() + 1).floor().long()
        by_prefix = [
            [int((bins == b).sum()), kl[bins == b].mean().item() if (bins == b).any() else None]
            for b in range(int(bins.max()) + 1 if bins.numel() else 0)
        ]
        return metrics, by_prefix

    def _number_token_table(self, tokenizer) -> torch.Tensor:
        """`table[id]`: whether token `id`'s text holds a digit (built once per run)."""
        if getattr(self, "_number_tokens", None) is None:
            pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
            self._number_tokens = torch.tensor([any(ch.isdigit() for ch in str(p)) for p in pieces])
        return self._number_tokens


@contextmanager
def seeded_rng(device: torch.device, seed: int):
    """Inside, the CPU generator and `device`'s (CUDA, MPS, ...) are seeded with `seed`; on exit both are as they were.
    No other generator is touched: `torch.manual_seed` would also reseed every other device type's (MPS's on a Mac)
    without restoring it."""
    accelerated = device.type != "cpu"
    with torch.random.fork_rng(
        devices=[device] if accelerated else [], device_type=device.type if accelerated else None
    ):
        torch.default_generator.manual_seed(seed)
        if accelerated:
            torch.get_device_module(device.type).manual_seed(seed)
        yield


def check_no_ledger(output_dir) -> None:
    """Refuse to start a fresh run in a folder whose state ledger already holds another run's steps.

    Called before any work starts (the recipes call it before evaluating); a resumed run is not checked.
    """
    ledger_dir = Path(output_dir) / "statelens"
    held = [name for name in LEDGER_FILES if (ledger_dir / name).exists() and (ledger_dir / name).stat().st_size]
    if held:
        raise ValueError(
            f"{ledger_dir} holds another run's state ledger ({', '.join(held)}): a fresh run would overwrite it. "
            "Continue that run with --resume_from_checkpoint (resume_from_checkpoint= in trainer.train()), or choose "
            "another output_dir, or delete the folder."
        )


def trainer_generation_config(trainer) -> GenerationConfig | None:
    """A copy of the sampling settings a GRPO-like trainer generates with; `None` for a trainer that does not sample.

    With `use_vllm=True` GRPO keeps no `generation_config`: the same settings are then built from the trainer's own
    fields (temperature, top_p, top_k, min_p, repetition_penalty, max_completion_length, eos and pad tokens), the
    ones GRPO builds its `generate` settings from.
    """
    config = getattr(trainer, "generation_config", None)
    if config is not None:
        return GenerationConfig.from_dict(config.to_dict())
    if getattr(trainer, "max_completion_length", None) is None or getattr(trainer, "temperature", None) is None:
        return None
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    return GenerationConfig(
        max_new_tokens=trainer.max_completion_length,
        do_sample=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=getattr(trainer, "eos_token_ids", tokenizer.eos_token_id),
        temperature=trainer.temperature,
        top_p=getattr(trainer, "top_p", 1.0),
        top_k=getattr(trainer, "top_k", 0),
        min_p=getattr(trainer, "min_p", None),
        repetition_penalty=getattr(trainer, "repetition_penalty", 1.0),
        disable_compile=True,
    )


def attach_state_logging(trainer, state_logging: bool = True) -> None:
    """Point every `StateLoggingCallback` of `trainer` without a trainer at it; add a default one if there is none.

    Args:
        trainer: the trainer whose callbacks to attach.
        state_logging: add a default `StateLoggingCallback` (records and ledger, no probes) when none was passed.
    """
    callbacks = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, StateLoggingCallback)]
    for callback in callbacks:
        if callback.trainer is None:
            callback.trainer = trainer
    if not callbacks and state_logging:
        trainer.add_callback(StateLoggingCallback(trainer))


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _json_safe(value):
    """NaN and infinities become null, which strict JSON readers accept."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value
