"""The student as its own teacher, reading a privileged prompt: [`SelfTeacher`]."""

from __future__ import annotations

import copy

import torch
from accelerate.utils import is_peft_model
from trl.data_utils import is_conversational
from trl.trainer.utils import selective_log_softmax

from ..checks import check_lengths, context_length, named_splits
from .base import RowScores, answered, batch_rows, completion_padded, left_padded
from .in_process import InProcessTeacher
from .self_teacher_weights import (
    EMA_FILE,
    AdapterAverage,
    AveragedCopy,
    CopiedWeights,
    MovingAverage,
    SharedStudent,
    TeacherWeights,
    is_zero3,
    refuse_average_under_fsdp,
    refuse_copying_sharded,
)

# Shortest prompt start shared by every row that is run once for the batch (few-shot examples as privileged context:
# hundreds of tokens); below it the one extra forward saves too little
SHARED_PREFIX_MIN_TOKENS = 64
# The optimizer step's counts of that forward in `trainer.step_counts`, for the FLOPs (`lens.compute.ComputeCounter`):
# scoring's: the rows' prompt positions it stood in for, and its own tokens each time it ran; writing's: the positions
# it stood in for less its own tokens each time it ran
SHARED_PREFIX_COUNTS = ("teacher_prefix_shared_tokens", "teacher_prefix_run_tokens", "teacher_writing_prefix_saved")


class SelfTeacher(InProcessTeacher):
    """The student as its own teacher, reading a privileged prompt (self-distillation with privileged context, as
    TRL's experimental `SDFTTrainer`): each row's `args.teacher_prompt_template` filled with its prompt and its
    `privileged_context`, tokenised as the student's prompt is (GRPO's `_tokenize_prompts`: the chat template for a
    conversational prompt, whose last user message the filled template replaces, as TRL does).

    The trainer hands it these prompts in place of the student's (`prompts`), so it scores and writes as an
    in-process teacher does, after its own prompt: a completion token's teacher log-prob is read at the same
    completion position whatever the two prompts' lengths, since each side left-pads its prompts before the shared,
    right-padded completion.

    The weights, by `args.teacher_model_kind` ([`TeacherWeights`], in place for each call):

    - `"base"`: a frozen copy of the student made here, before any step ([`CopiedWeights`]); a PEFT student: its own
      base model with the adapter disabled, no copy ([`SharedStudent`]);
    - `"live"`: the student itself under `no_grad`, no copy ([`SharedStudent`]; generation through the trainer's
      wrapped model, which under ZeRO-3 gathers the student's shards as GRPO's own generation does);
    - `"ema"`: a frozen copy moved toward the student after every optimizer step by `args.teacher_update_rate`,
      written into each checkpoint and read back on resume ([`AveragedCopy`]); for a PEFT student, an average of its
      trained (adapter) parameters only, swapped into the student module for the teacher's calls ([`AdapterAverage`]).
      The average is kept in fp32 whatever the weights' dtype, and cast into the teacher's weights (or, for each call,
      the adapter's dtype).

    Under DeepSpeed ZeRO-3 a copy is loaded again from the student's path (a student given as a model instance is
    refused there), and each process averages its own partitions; a PEFT student's `"ema"` is refused there, and
    `"ema"` of either kind under accelerate's FSDP (the student's parameters become DTensor shards). A full-weight
    student that FSDP2 has already sharded when the trainer is made (`from_pretrained(distributed_config=...)`,
    `fully_shard`) cannot be copied: `"base"` and `"ema"` are refused there.

    Args:
        trainer: the [`OnPolicyDistillTrainer`] whose student teaches itself.
        student_path (`str`, *optional*): where the student was loaded from (its path or hub id), to load the copy
            under ZeRO-3; `None` for a student given as a model instance.
    """

    reads_own_prompts = True
    EMA_FILE = EMA_FILE

    def __init__(self, trainer, student_path: str | None = None):
        args = trainer.args
        self.kind, self.template = args.teacher_model_kind, args.teacher_prompt_template
        self._check_prompt_lengths(trainer)  # before any copy of the student is made
        self.weights = _weights(self.kind, trainer, student_path)
        super().__init__(trainer, self.weights.model)
        self._prefix_cache = None  # (shared prompt start, its keys and values): `_score_after_shared_prefix`'s
        if self.kind == "ema":
            trainer.add_callback(MovingAverage(self.weights, args.teacher_update_rate))

    @property
    def generation_model(self):
        return self.weights.generation_model

    def _check_prompt_lengths(self, trainer) -> None:
        """Each row's teacher prompt (`fill`: the template and its privileged context, or the solved exchanges before
        it) plus the tokens written after it (`max_completion_length`, and `continuation_length` for continuations)
        fits the model's context, in the training and evaluation data, as the student's prompts are checked
        (`checks.check_prompt_lengths`); an `IterableDataset`'s rows are not known ahead."""
        context = context_length(trainer.model)
        if context is None:
            return
        for what, dataset in named_splits(trainer.train_dataset, trainer.eval_dataset).items():
            if dataset is None or not hasattr(dataset, "__len__"):
                continue
            prompts = [self.fill(p, c) for p, c in zip(dataset["prompt"], dataset["privileged_context"])]
            check_lengths(
                prompts, trainer._tokenizer, context, trainer._tokens_after_prompt(), what,
                kind="self-teacher prompt(s)",
                fix="A self teacher's prompt is the row's prompt with its privileged_context (teacher_prompt_template, "
                "or solved exchanges): shorten those contexts (fewer solved problems) or drop those rows",
            )  # fmt: skip

    def prompts(self, student_prompts, rows):
        # The trainer checked these rows before the batch's rollouts (`opd_checks.check_rows`, on every process): a
        # privileged_context in each, and a conversational prompt ending with the user message `fill` replaces
        texts = [self.fill(row["prompt"], row["privileged_context"]) for row in rows]
        return [list(ids) for ids in self.trainer._tokenize_prompts(texts)[0]]

    def fill(self, prompt, privileged_context):
        return with_context(prompt, privileged_context, self.template)

    def generate(self, prompts, max_new_tokens, prefixes=None, teachers=None):
        with self.weights.applied():
            return super().generate(prompts, max_new_tokens, prefixes, teachers)

    @torch.no_grad()
    def score(self, prompts, completions, distribution=False, teachers=None):
        with self.weights.applied():
            shared = 0 if distribution else self._shared_prefix_length(prompts)
            if shared:
                return self._score_after_shared_prefix(prompts, completions, shared)
            return super().score(prompts, completions, distribution, teachers)

    def _shared_prefix_length(self, prompts: list[list[int]]) -> int:
        """How many first tokens every row's prompt shares, when `score` runs them once (0: it does not). Never a whole
        prompt (its last token predicts the first completion token), and in one process only: under ZeRO-3 or FSDP
        every forward is a collective each rank must make as often as the others, and a rank's rows may share less
        than another's (not yet made to agree across ranks); never with gradient checkpointing (no key-value cache)."""
        model = self.trainer.accelerator.unwrap_model(self.model)
        one_process = self.trainer.accelerator.num_processes == 1 and not is_zero3(self.trainer)
        if len(prompts) == 0 or not one_process or getattr(model, "is_gradient_checkpointing", False):
            return 0
        length = min(len(p) for p in prompts) - 1
        first = prompts[0]
        for prompt in prompts[1:]:
            length = next((i for i in range(length) if prompt[i] != first[i]), length)
        return length if length >= SHARED_PREFIX_MIN_TOKENS else 0

    def _score_after_shared_prefix(self, prompts, completions, length: int):
        """`score` with the rows' shared first `length` prompt tokens run once: their keys and values, computed once
        per call (once per run for the frozen `"base"` teacher, whose weights never change), are what each chunk of
        rows attends to while it runs only its own tokens. The same log-probs as the plain forward up to float
        rounding: each row's positions count on from the shared start, across its left padding."""
        trainer = self.trainer
        model = trainer.accelerator.unwrap_model(self.model)
        device = trainer.accelerator.device
        cached, ran = self._shared_prefix_keys_values(model, prompts[0][:length])
        if trainer.step_counts is not None and trainer.model.training:  # the FLOPs count what ran, once
            trainer.step_counts.add(**dict(zip(SHARED_PREFIX_COUNTS[:2], (length * len(prompts), length * ran))))
        args = trainer.args
        batch_size = args.per_device_train_batch_size if trainer.model.training else args.per_device_eval_batch_size
        pad_id = trainer._tokenizer.pad_token_id
        scores = []
        for start in range(0, len(prompts), batch_size):
            rest, chunk = (
                [p[length:] for p in prompts[start : start + batch_size]],
                completions[start : start + batch_size],
            )
            rest_ids, rest_mask = left_padded(rest, pad_id)
            completion_ids, completion_mask = completion_padded(chunk, pad_id)
            mask = torch.cat([torch.ones(len(chunk), length, dtype=torch.long), rest_mask, completion_mask], 1)
            positions = (mask.cumsum(1) - 1).clamp(min=0)[:, length:]
            past = copy.deepcopy(cached)
            past.batch_repeat_interleave(len(chunk))
            with trainer.accelerator.autocast():
                logits = model(
                    input_ids=torch.cat([rest_ids, completion_ids], 1).to(device),
                    attention_mask=mask.to(device),
                    position_ids=positions.to(device),
                    past_key_values=past,
                    logits_to_keep=completion_ids.size(1) + 1,
                ).logits[:, :-1]
            logps = selective_log_softmax(logits.float() / trainer.temperature, completion_ids.to(device))
            scores += [RowScores(logps[i, : len(c)]) for i, c in enumerate(chunk)]
        return batch_rows(answered(scores), len(scores))

    def _shared_prefix_keys_values(self, model, prefix: list[int]):
        """The keys and values of `prefix` (a start every row shares) and whether its forward ran for them: once per
        call, once per run for the frozen `"base"` teacher while the start stays the same."""
        prefix, cached = tuple(prefix), self._prefix_cache
        ran = cached is None or cached[0] != prefix or self.kind != "base"
        if ran:
            device = self.trainer.accelerator.device
            with torch.no_grad(), self.trainer.accelerator.autocast():
                cached = (prefix, model(torch.tensor([prefix], device=device), use_cache=True).past_key_values)
            self._prefix_cache = cached if self.kind == "base" else None
        return cached[1], ran

    def _generation_inputs(self, sequences, pad_id) -> dict:
        """As [`InProcessTeacher`]'s, with the start every row shares (the solved examples before each question) run
        once: its keys and values as the cache `generate` goes on from, each row's own tokens after it, the padding
        between the two (its positions count on across it, as in `_score_after_shared_prefix`). The teacher's
        writing then counts that start each time its forward ran (`teacher_writing_prefix_saved`: the positions it
        stood in for, less its own tokens when it ran)."""
        length = self._shared_prefix_length(sequences)
        if not length:
            return super()._generation_inputs(sequences, pad_id)
        trainer = self.trainer
        model = trainer.accelerator.unwrap_model(self.generation_model)
        cached, ran = self._shared_prefix_keys_values(model, sequences[0][:length])
        if trainer.step_counts is not None and trainer.model.training:
            trainer.step_counts.add(teacher_writing_prefix_saved=length * len(sequences) - length * ran)
        past = copy.deepcopy(cached)
        past.batch_repeat_interleave(len(sequences))
        rest_ids, rest_mask = left_padded([row[length:] for row in sequences], pad_id)
        start = torch.tensor([sequences[0][:length]] * len(sequences), dtype=torch.long)
        return {
            "input_ids": torch.cat([start, rest_ids], 1),
            "attention_mask": torch.cat([torch.ones_like(start), rest_mask], 1),
            "past_key_values": past,
        }

    def divergence_loss(self, student, student_hidden, batch, loss_mask, normalizer, beta, temperature):
        """As [`InProcessTeacher`]'s, on the batch's teacher prompts (`teacher_prompt_ids`, one list per row)."""
        if batch["teacher_prompt_ids"]:
            pad_id, multiple = self.trainer._tokenizer.pad_token_id, self.trainer.pad_to_multiple_of
            device = batch["prompt_ids"].device
            prompt_ids, prompt_mask = left_padded(batch["teacher_prompt_ids"], pad_id, multiple)
            batch = {**batch, "prompt_ids": prompt_ids.to(device), "prompt_mask": prompt_mask.to(device)}
        # Only the teacher's forward and its output layer are read with the teacher's weights in place
        # (`_teacher_applied`): the student is projected with its own output layer, which a PEFT student's teacher
        # shares (a trained `modules_to_save` head: the base's with the adapter disabled, the average's under "ema")
        return super().divergence_loss(student, student_hidden, batch, loss_mask, normalizer, beta, temperature)

    def _teacher_applied(self):
        return self.weights.applied()

    def _teacher_output_layer(self, teacher):
        return self.weights.output_layer(teacher)

    def save_state(self, output_dir):
        self.weights.save(output_dir)

    def load_state(self, checkpoint):
        self.weights.load(checkpoint)


def _weights(kind: str, trainer, student_path: str | None) -> TeacherWeights:
    """The weights of a self teacher of `kind` (see [`SelfTeacher`]): a PEFT student's, and the live student's, are
    the student module's own; a full-weight student's `"base"` and `"ema"` are a copy."""
    shared = kind == "live" or is_peft_model(trainer.model)
    if not shared:
        refuse_copying_sharded(trainer.model, kind)
    if kind == "ema":
        refuse_average_under_fsdp(trainer)
    if shared:
        if kind == "ema":
            return AdapterAverage(trainer)
        return SharedStudent(trainer, adapter_off=kind == "base")
    if kind == "ema":
        return AveragedCopy(trainer, student_path)
    return CopiedWeights(trainer, student_path)


def with_context(prompt, privileged_context, template: str):
    """A teacher's prompt (text or conversation) for a row: its `prompt` shown `privileged_context`. Solved exchanges
    (`is_exchanges`: user and assistant turns, as `load_gsm8k(..., context_format="chat")` writes them) before a
    conversational prompt are read as those turns, after the prompt's system message if it has one: each shot's answer
    is then closed by the chat template's end token, as the student's answers are, and `template` is not used. Any
    other context is text, filled into `template` (`{prompt}`: the prompt, or a conversation's last user message,
    which the filled template replaces)."""
    if is_exchanges(privileged_context) and is_conversational({"prompt": prompt}):
        system = [message for message in prompt[:1] if message.get("role") == "system"]
        return [*system, *privileged_context, *prompt[len(system) :]]
    context = _as_text(privileged_context)
    if not is_conversational({"prompt": prompt}):
        return template.format(prompt=prompt, privileged_context=context)
    last = prompt[-1]
    text = template.format(prompt=_as_text([last]), privileged_context=context)
    return [*prompt[:-1], {**last, "content": text}]


def is_exchanges(value) -> bool:
    """Whether a privileged context is whole chat exchanges: messages alternating user, assistant, ..., assistant."""
    if not isinstance(value, list) or not value or not all(isinstance(message, dict) for message in value):
        return False
    roles = [message.get("role") for message in value]
    return len(roles) % 2 == 0 and roles == ["user", "assistant"] * (len(roles) // 2)


def _as_text(value) -> str:
    """A privileged context or a user message as text: a string as it is, messages by their text contents joined by
    newlines (as TRL's SDFT does)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for message in value:
            content = message.get("content", "") if isinstance(message, dict) else message
            if isinstance(content, list):
                content = " ".join(part.get("text", "") for part in content if part.get("type") == "text")
            if content:
                parts.append(str(content))
        return "\n".join(parts)
    return str(value)
