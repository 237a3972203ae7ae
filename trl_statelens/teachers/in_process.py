"""A teacher model in the training processes: [`InProcessTeacher`]."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel
from trl.models import prepare_deepspeed, unwrap_model_for_generation
from trl.trainer.utils import add_fused_lm_head

from .. import collective
from ..heads import Divergence, _completion_hidden_states, divergence_and_token_logps
from ..lens.probes import trainer_generation_config
from .base import (
    CACHE_SLOT,
    RowScores,
    Teacher,
    answered,
    batch_rows,
    completion_padded,
    joined,
    left_padded,
)
from .vocabulary import check_same_vocabulary, vocab_size


def prepare_teacher_model(trainer, model: PreTrainedModel, path: str | None = None, same_vocabulary: bool = True):
    """`model` made a teacher for `trainer`: its vocabulary checked against the student's (and its tokenizer, saved at
    `path`; not for a teacher of another tokenizer, `same_vocabulary=False`), frozen, in eval mode, with the trainer's
    fused LM head, prepared as the student is (device, DDP, DeepSpeed). Under FSDP it is moved to the accelerator's
    device here: accelerate's `prepare_model` places a model only when the run is not FSDP (it leaves that to the
    sharding, which a model prepared for evaluation never gets), so the teacher would stay on the CPU where it was
    loaded or copied, beside a student on the GPU. A teacher sharded at load (DTensors) keeps its own placement."""
    args = trainer.args
    if same_vocabulary:
        check_same_vocabulary(trainer.model, trainer._tokenizer, model, path, args.signal)
    model.eval()
    model.requires_grad_(False)
    add_fused_lm_head(model, temperature=trainer.temperature, cast_lm_head_to_fp32=args.cast_lm_head_to_fp32)
    if trainer.is_deepspeed_enabled:
        return prepare_deepspeed(model, trainer.accelerator)
    accelerator = trainer.accelerator
    device_placement = None  # accelerate's default
    if accelerator.distributed_type == DistributedType.FSDP:
        device_placement = accelerator.device_placement and not any(isinstance(p, DTensor) for p in model.parameters())
    return accelerator.prepare_model(model, evaluation_mode=True, device_placement=device_placement)


def stand_in_chunk(rows: slice, input_ids: torch.Tensor) -> slice:
    """`rows`, or the first row again when the chunk lies past this rank's rows (a stand-in for the collective)."""
    return slice(0, 1) if rows.start >= input_ids.size(0) else rows


def rows_shifted(values: torch.Tensor, completion_mask: torch.Tensor, shift: int) -> torch.Tensor:
    """`values` (`(B, T, ...)`, per completion position) with row `i` taken from row `(i + shift) % B`, its position `t`
    from that row's position `t` modulo the row's completion length (`completion_mask`'s count; at least 1): the
    shuffled-teacher control (`teacher_row_shift`)."""
    rows = values.size(0)
    source = (torch.arange(rows, device=values.device) + shift) % rows
    lengths = completion_mask.sum(1).clamp(min=1).to(values.device)[source]
    positions = torch.arange(values.size(1), device=values.device)[None, :] % lengths[:, None]
    return values[source[:, None], positions]


class InProcessTeacher(Teacher):
    """A teacher model in the training processes, scored through `trainer`'s chunked LM-head path, generating with
    `trainer`'s sampling settings.

    Every rank calls every method with its own rows, none included: under ZeRO-3 each forward and generation gathers
    the model's parameters collectively, so every rank makes as many as the others ([`agreed_calls`],
    [`agreed_chunks`]), a rank with fewer rows making the rest on a stand-in row whose answer it drops.

    Args:
        trainer: the [`OnPolicyDistillTrainer`] it serves (its accelerator, forward path and sampling settings).
        model: the teacher, as [`prepare_teacher_model`] prepares it (see [`InProcessTeacher.prepared`]).
    """

    def __init__(self, trainer, model):
        self.trainer, self.model = trainer, model
        self.pad_id = trainer._tokenizer.pad_token_id  # what pads the rows it reads (ids of its vocabulary)

    @classmethod
    def prepared(cls, trainer, model: PreTrainedModel, path: str | None = None) -> InProcessTeacher:
        """The teacher `model` (loaded from `path`, if any, whose tokenizer is checked), prepared for `trainer`."""
        return cls(trainer, prepare_teacher_model(trainer, model, path))

    @property
    def generation_model(self):
        """The model `generate` unwraps (gathering ZeRO-3 shards): the prepared teacher."""
        return self.model

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, prefixes=None, teachers=None):
        trainer = self.trainer
        # A teacher whose output layer is padded past the student's vocabulary never writes those ids (the student
        # could not read them): its distribution is renormalised over the ids both share
        student_vocab, teacher_vocab = map(vocab_size, (trainer.model, self.model))
        written = self._written(
            joined(prompts, prefixes),
            max_new_tokens,
            trainer._tokenizer.pad_token_id,
            trainer.eos_token_ids,
            list(range(student_vocab, teacher_vocab)),
        )
        return _first_eos(written, trainer.eos_token_ids)

    def _written(self, sequences, max_new_tokens, pad_id, eos_token_ids, suppress_tokens) -> list[list[int]]:
        """The new tokens the teacher writes after each of this rank's `sequences` (its own ids), sampled with the
        trainer's settings, padded with `pad_id`, ending at `eos_token_ids`, never one of `suppress_tokens`."""
        # Generation is collective under ZeRO-3 (parameter gathers, synced decoding steps): one call on every rank
        # while any rank has rows, a rank without any on a stand-in row whose continuation it drops.
        trainer = self.trainer
        if not collective.any_rank_has(trainer.accelerator, len(sequences)):
            return []
        device = trainer.accelerator.device
        inputs = self._generation_inputs(sequences or [[pad_id]], pad_id)
        inputs = {name: value.to(device) if torch.is_tensor(value) else value for name, value in inputs.items()}
        generation_config = self._generation_config()
        generation_config.max_new_tokens = max_new_tokens
        generation_config.pad_token_id, generation_config.eos_token_id = pad_id, list(eos_token_ids)
        # A length floor in `generation_kwargs` (`min_new_tokens`) shapes the student's rollouts; the teacher's
        # continuation ends at its own eos, as a served teacher's does
        generation_config.min_new_tokens, generation_config.min_length = None, 0
        if suppress_tokens:
            generation_config.suppress_tokens = suppress_tokens
        # A teacher that shares the student turns its gradient checkpointing back on after generating: with the run's
        # kwargs, as GRPO's own generation does (TRL forces `use_reentrant=True` for PEFT under ZeRO-3). It writes
        # under the trainer's autocast, the precision it scores in (`_get_per_token_logps_and_entropies`)
        with (
            unwrap_model_for_generation(
                self.generation_model,
                trainer.accelerator,
                gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
            ) as teacher,
            trainer.accelerator.autocast(),
        ):
            out = teacher.generate(**inputs, generation_config=generation_config)
        return out[:, inputs["input_ids"].size(1) :].tolist()[: len(sequences)]

    def _generation_inputs(self, sequences, pad_id) -> dict:
        """`generate`'s inputs for the rows: the ids left-padded and their mask."""
        input_ids, attention_mask = left_padded(sequences, pad_id)
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def _generation_config(self):
        """The settings it writes with: a copy of the trainer's sampling settings."""
        return trainer_generation_config(self.trainer)

    @torch.no_grad()
    def score(self, prompts, completions, distribution=False, teachers=None):
        """Log-probs through the trainer's fused LM head, in chunks of the per-device batch size (as GRPO scores its
        reference model), on the rows padded as GRPO pads a batch; the full distribution is not fetched ahead:
        `divergence_loss` projects it within the loss's forward. Each chunk is a forward, collective under ZeRO-3:
        every rank runs as many as the rank with the most rows of this teacher (a router splits rows unevenly), the
        ones past its own rows on a stand-in row whose answer it drops.

        With `distribution=True` (the `divergence` signal) it scores nothing and returns `None` (no forward, no
        collective): this teacher's distributions are computed within the loss, by `divergence_loss`, on the
        student's hidden states of the same rows."""
        if distribution:
            return None
        scores = self._score_rows(prompts, completions)
        return batch_rows(answered(scores), len(scores))

    def _scoring_batch(self, prompts, completions):
        """The rows padded as GRPO pads a batch, on the device, and the chunks of the per-device batch size that
        every rank agrees on: `(input_ids, attention_mask, completion width, chunks, batch size)`, or `None` when
        no rank has rows. A rank with no rows gets one stand-in row; each chunk past its rows is a stand-in too
        (`stand_in_chunk`): its forward is every rank's collective turn under ZeRO-3, its answer dropped."""
        trainer = self.trainer
        args = trainer.args
        batch_size = args.per_device_train_batch_size if trainer.model.training else args.per_device_eval_batch_size
        chunks = collective.agreed_chunks(trainer.accelerator, len(prompts), batch_size)
        if not chunks:
            return None
        pad_id, multiple = self.pad_id, trainer.pad_to_multiple_of
        prompts, completions = (prompts, completions) if prompts else ([[pad_id]], [[pad_id]])
        device = trainer.accelerator.device
        prompt_ids, prompt_mask = left_padded(prompts, pad_id, multiple)
        completion_ids, completion_mask = completion_padded(completions, pad_id, multiple)
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1).to(device)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).to(device)
        return input_ids, attention_mask, completion_ids.size(1), chunks, batch_size

    def _score_rows(self, prompts, completions) -> list[RowScores]:
        """`score`'s [`RowScores`], one per row of this rank, computed now (none when no rank has rows)."""
        batch = self._scoring_batch(prompts, completions)
        if batch is None:
            return []
        input_ids, attention_mask, width, chunks, batch_size = batch
        logps = []
        for rows in chunks:
            rows = stand_in_chunk(rows, input_ids)
            chunk_logps, _, _ = self.trainer._get_per_token_logps_and_entropies(
                self.model, input_ids[rows], attention_mask[rows], width, batch_size=batch_size
            )
            logps.append(chunk_logps)
        logps = torch.cat(logps)  # this rank's rows first, then any stand-ins
        return [RowScores(logps[i, : len(c)]) for i, c in enumerate(completions)]

    def divergence_loss(self, student, student_hidden, batch, loss_mask, normalizer, beta, temperature):
        """TRL's exact generalised JSD over the full vocabulary, in chunks (its divergence kernel, as
        `DistillationTrainer` runs it; ZeRO-3-sharded heads gathered once each way), from the teacher's hidden states
        of the same tokens, with the per-token log-probs and entropies from the same pass
        ([`divergence_and_token_logps`]): one call on every rank while any rank has rows, a rank without rows on a
        stand-in row that supervises nothing.

        With the teacher cache (`opd/cache.py`), a micro-batch's first pass keeps the teacher's hidden states in the
        micro-batch's cache slot (`base.CacheSlot`, under `CACHE_SLOT`) and its reuses project those with the
        teacher's output layer, without the teacher's forward (on every rank alike: the cache decides the same
        everywhere)."""
        # The micro-batch's cache slot, taken before `batch` may become a stand-in row below (a stand-in's hidden
        # states are kept there too); age: None without the cache, 0 on its refresh
        slot = batch.get(CACHE_SLOT)
        age = None if slot is None else slot.age
        num_rows = batch["completion_ids"].size(0)
        no_logps = torch.zeros_like(batch["completion_ids"], dtype=torch.float32)
        if not collective.any_rank_has(self.trainer.accelerator, num_rows):
            return Divergence(student_hidden.sum() * 0.0, no_logps, no_logps, no_logps)
        if num_rows == 0:  # zeros inside the student's graph: its backward reaches the parameters the others' do
            batch, student_hidden, loss_mask = collective.stand_in_row(
                batch, student_hidden, self.trainer._tokenizer.pad_token_id
            )
        trainer = self.trainer
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        num_completion = batch["completion_ids"].size(1)
        teacher = trainer.accelerator.unwrap_model(self.model)
        # The teacher's forward and its output layer inside `_teacher_applied()`; the student's projection outside
        with self._teacher_applied():
            if age:  # a reuse: the refresh's hidden states (a stand-in row's included)
                teacher_hidden = slot.teacher_hidden
            else:
                with torch.no_grad():
                    teacher_hidden = trainer._forward_redirection(
                        self.model, teacher, _completion_hidden_states, teacher, input_ids, attention_mask,
                        num_completion,
                    )  # fmt: skip
                if age == 0:
                    slot.teacher_hidden = teacher_hidden
            if trainer.args.teacher_row_shift:  # the shuffled-teacher control: another rollout's distributions
                teacher_hidden = rows_shifted(teacher_hidden, batch["completion_mask"], trainer.args.teacher_row_shift)
            teacher_head = self._teacher_output_layer(teacher)
        # The loss and the records' per-token values (both models' token log-probs, the student's entropy) in one
        # pass over the vocabulary
        out = divergence_and_token_logps(
            student,
            student_hidden,
            teacher,
            teacher_hidden,
            batch["completion_ids"],
            loss_mask,
            batch["completion_mask"],
            beta,
            normalizer,
            temperature,
            teacher_head=teacher_head,
        )
        if num_rows == 0:  # the stand-in row's loss is 0 (nothing supervised), in the student's graph
            return Divergence(out.loss, no_logps, no_logps, no_logps)
        return out

    def _teacher_applied(self):
        """Where `divergence_loss` runs the teacher's own part (its forward, reading its output layer): as it is here;
        a [`SelfTeacher`] puts its weights in place, and the student is projected after, with its own."""
        return nullcontext()

    def _teacher_output_layer(self, teacher) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The unwrapped `teacher`'s output layer `(weight, bias)`, read inside `_teacher_applied()`."""
        head = teacher.get_output_embeddings()
        return head.weight, head.bias


def _first_eos(rows: list[list[int]], eos_token_ids) -> list[list[int]]:
    ends = [next((j for j, t in enumerate(row) if t in eos_token_ids), None) for row in rows]
    return [row if end is None else row[: end + 1] for row, end in zip(rows, ends)]
