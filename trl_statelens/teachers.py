"""The teacher of on-policy distillation, behind one interface whatever runs it.

[`OnPolicyDistillTrainer`] asks its teacher for three things, and calls nothing else:

- `generate(prompts, max_new_tokens, prefixes)`: the teacher's own tokens after each prompt (and student prefix),
  for the `teacher` state source and the `continuation` signal;
- `score(prompts, completions, distribution)`: start scoring a batch's rows, the teacher's log-prob of each
  completion token and, with `distribution`, its next-token distribution at each completion position where it
  gives one ahead of the loss; the answer may come later ([`TeacherRow`], read with [`resolve_rows`]);
- `divergence_loss(...)`: the `divergence` loss between the student's next-token distributions and its own;

and, around those, `prompts(student_prompts, rows)`: the prompt it reads for each row (the student's, unless it is
shown more), which the trainer then passes to the three methods above; `save_state`/`load_state` with each checkpoint.

Its vocabulary and tokenizer are checked against the student's when it is made. Three kinds:

- [`InProcessTeacher`]: a model in the training processes (DDP, DeepSpeed ZeRO-3 and all), scored with the
  trainer's chunked LM-head path; its `divergence_loss` is TRL's exact full-vocabulary generalised JSD;
- [`RemoteTeacher`]: a vLLM server reached through [`ServedTeacher`], whose scoring requests can run in the background
  while the student works (`teacher_server_overlap`); its `divergence_loss` uses the teacher's top-k log-probs plus a
  tail bucket ([`topk_tail_divergence`]);
- [`SelfTeacher`]: the student itself (its weights at the start, live, or an exponential average) reading a prompt
  built from the row's prompt and its `privileged_context`: self-distillation with privileged context.

Every rank calls every method with its own rows, none included: an in-process teacher under ZeRO-3 gathers its
parameters collectively, so each rank must join while any rank has rows (a served teacher is asked for a rank's own
rows only). Every method takes prompts and completions apart, and each row is answered on its own: so a
[`TeacherRouter`] sends each row to the teacher of its `teacher_id` (several teachers, in-process and served mixed),
and a [`SelfTeacher`] is handed its own prompts in place of the student's.
"""

from __future__ import annotations

import copy
import logging
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import NamedTuple

import torch
from accelerate.utils import is_peft_model
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoTokenizer, PreTrainedModel, TrainerCallback
from transformers.utils.peft_utils import find_adapter_config_file
from trl.data_utils import is_conversational
from trl.models import prepare_deepspeed, unwrap_model_for_generation
from trl.trainer.utils import add_fused_lm_head, create_model_from_path, pad

from .callback import trainer_generation_config
from .heads import Divergence, _completion_hidden_states, divergence_and_token_logps, topk_tail_divergence

logger = logging.getLogger(__name__)


class TeacherRow(NamedTuple):
    """Row `index` of a batch the teacher scored, or is scoring: `scores` is answered (maybe later, from a background
    request) with one [`RowScores`] per row of that batch. A batch's teacher scores are a list of these, one per
    row: GRPO shuffles and splits lists with the batch's tensors, so each micro-batch keeps its rows' handles."""

    scores: Future
    index: int


class RowScores(NamedTuple):
    """A row's teacher scores over its completion tokens: `logps` `(n,)`, and with a distribution asked for, the
    teacher's `top_ids` and `top_logps` `(n, k)` per position (`-inf` where absent)."""

    logps: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logps: torch.Tensor | None = None


class ResolvedScores(NamedTuple):
    """A micro-batch's teacher scores as tensors like its `completion_ids` `(B, T)`, 0 where `completion_mask` is 0;
    `top_ids`/`top_logps` `(B, T, k)` or `None`."""

    logps: torch.Tensor
    top_ids: torch.Tensor | None
    top_logps: torch.Tensor | None


def answered(value) -> Future:
    future = Future()
    future.set_result(value)
    return future


def resolve_rows(rows: list[TeacherRow], completion_ids: torch.Tensor, completion_mask: torch.Tensor):
    """The scores of `rows` as [`ResolvedScores`] on `completion_ids`' device, once every answer is in (a failed
    background request raises its error here, in the training thread)."""
    scores = [row.scores.result()[row.index] for row in rows]
    device, shape = completion_ids.device, completion_ids.shape
    logps = torch.zeros(shape, dtype=scores[0].logps.dtype, device=device)
    has_top = scores[0].top_ids is not None
    if has_top:
        k = scores[0].top_ids.size(-1)
        top_ids = torch.zeros((*shape, k), dtype=torch.long, device=device)
        top_logps = torch.full((*shape, k), float("-inf"), device=device)
    for i, row in enumerate(scores):
        n = row.logps.size(0)
        logps[i, :n] = row.logps.to(device)
        if has_top:
            top_ids[i, :n], top_logps[i, :n] = row.top_ids.to(device), row.top_logps.to(device)
    mask = completion_mask.bool()
    logps = torch.where(mask, logps, torch.zeros_like(logps))
    if not has_top:
        return ResolvedScores(logps, None, None)
    return ResolvedScores(logps, top_ids, top_logps.masked_fill(~mask[..., None], float("-inf")))


class Teacher:
    """What [`OnPolicyDistillTrainer`] asks of a teacher (see the module docstring). `model` is the teacher model in
    the training processes (prepared for their device/DeepSpeed setup), `None` when it runs elsewhere."""

    model: PreTrainedModel | None = None
    names: tuple[str, ...] = ()  # the teachers a [`TeacherRouter`] sends rows to; none for a single teacher
    reads_own_prompts: bool = False  # its prompts differ from the student's (recorded in the ledger)

    def prompts(self, student_prompts: list[list[int]], rows: list[dict]) -> list[list[int]]:
        """The prompt this teacher reads for each row (`rows`: the dataset rows, one per rollout), given the
        student's: the same ones, unless the teacher is shown more."""
        return student_prompts

    def save_state(self, output_dir: str) -> None:
        """Write what the teacher changes during training into a checkpoint folder (nothing for a frozen one)."""

    def load_state(self, checkpoint: str) -> None:
        """Restore what `save_state` wrote into `checkpoint`."""

    def route(self, teacher_ids: list[str | None]) -> list[str | None]:
        """The name of the teacher each row goes to, from the rows' `teacher_id` values (`None` for a single
        teacher, which answers every row)."""
        return [None] * len(teacher_ids)

    def session(self):
        """A context manager around training (the background requests of a served teacher)."""
        return nullcontext()

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        prefixes: list[list[int]] | None = None,
        teachers: list[str | None] | None = None,
    ) -> list[list[int]]:
        """Up to `max_new_tokens` teacher tokens after each prompt (followed by its prefix, if given), sampled with
        the student's settings but not its length floor; each ends at (and includes) its first eos. `teachers`: each
        row's teacher, from `route` (a single teacher ignores it)."""
        raise NotImplementedError

    def score(
        self,
        prompts: list[list[int]],
        completions: list[list[int]],
        distribution: bool = False,
        teachers: list[str | None] | None = None,
    ) -> list[TeacherRow | None] | None:
        """Start scoring each completion after its prompt; with `distribution`, the next-token distribution at each
        completion position too, or `None` when this teacher computes it within the loss instead (`None` rows, from
        a router, where only some rows' teachers do)."""
        raise NotImplementedError

    def divergence_loss(
        self, student, student_hidden, batch: dict, loss_mask, normalizer, beta: float, temperature: float
    ) -> Divergence:
        """The `divergence` loss of a micro-batch (`batch`: its prompt and completion tensors, and its `teacher_logps`
        rows from `score(..., distribution=True)`, and with a router each row's `teacher`) given the student's (unwrapped `student`) final hidden states
        `(B, T, H)` at its completion positions, summed over positions with `loss_mask != 0` and divided by
        `normalizer`; and the teacher's log-prob of each completion token `(B, T)`, for the metrics and records (with the
        student's log-probs and entropies, when its pass gives them: [`Divergence`])."""
        raise NotImplementedError


def _join(prompts, prefixes):
    return [p + q for p, q in zip(prompts, prefixes, strict=True)] if prefixes is not None else list(prompts)


def _first_eos(rows: list[list[int]], eos_token_ids) -> list[list[int]]:
    ends = [next((j for j, t in enumerate(row) if t in eos_token_ids), None) for row in rows]
    return [row if end is None else row[: end + 1] for row, end in zip(rows, ends)]


class InProcessTeacher(Teacher):
    """A teacher model in the training processes: frozen, in eval mode, prepared as the student is (device, DDP,
    DeepSpeed), scored through `trainer`'s chunked LM-head path, generating with `trainer`'s sampling settings.

    Args:
        trainer: the [`OnPolicyDistillTrainer`] it serves (its accelerator, forward path and sampling settings).
        model (`PreTrainedModel`): the teacher.
        path (`str`, *optional*): where it was loaded from, to check its tokenizer against the student's.
    """

    def __init__(self, trainer, model: PreTrainedModel, path: str | None = None):
        args = trainer.args
        _check_same_vocabulary(trainer.model, trainer._tokenizer, model, path, args.signal)
        model.eval()
        model.requires_grad_(False)
        add_fused_lm_head(model, temperature=trainer.temperature, cast_lm_head_to_fp32=args.cast_lm_head_to_fp32)
        if trainer.is_deepspeed_enabled:
            self.model = prepare_deepspeed(model, trainer.accelerator)
        else:
            self.model = trainer.accelerator.prepare_model(model, evaluation_mode=True)
        self.trainer = trainer

    @property
    def generation_model(self):
        """The model `generate` unwraps (gathering ZeRO-3 shards): the prepared teacher."""
        return self.model

    def _any_rank_has(self, rows: list) -> bool:
        accelerator = self.trainer.accelerator
        if accelerator.num_processes == 1:
            return bool(rows)
        return accelerator.gather(torch.tensor([len(rows)], device=accelerator.device)).sum().item() > 0

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, prefixes=None, teachers=None):
        # Generation is collective under ZeRO-3 (parameter gathers, synced decoding steps): while any rank has rows,
        # every rank generates, a rank without any on a stand-in row whose continuation it drops.
        sequences = _join(prompts, prefixes)
        if not self._any_rank_has(sequences):
            return []
        trainer = self.trainer
        pad_id = trainer._tokenizer.pad_token_id
        rows = [torch.tensor(s, dtype=torch.long) for s in sequences or [[pad_id]]]
        device = trainer.accelerator.device
        input_ids = pad(rows, padding_value=pad_id, padding_side="left").to(device)
        attention_mask = pad([torch.ones_like(r) for r in rows], padding_value=0, padding_side="left").to(device)
        generation_config = trainer_generation_config(trainer)
        generation_config.max_new_tokens = max_new_tokens
        # A length floor in `generation_kwargs` (`min_new_tokens`) shapes the student's rollouts; the teacher's
        # continuation ends at its own eos, as a served teacher's does
        generation_config.min_new_tokens, generation_config.min_length = None, 0
        # A teacher whose output layer is padded past the student's vocabulary never writes those ids (the student
        # could not read them): its distribution is renormalised over the ids both share
        student_vocab, teacher_vocab = map(_vocab_size, (trainer.model, self.model))
        if teacher_vocab > student_vocab:
            generation_config.suppress_tokens = list(range(student_vocab, teacher_vocab))
        with unwrap_model_for_generation(
            self.generation_model, trainer.accelerator, gather_deepspeed3_params=trainer.args.ds3_gather_for_generation
        ) as teacher:
            out = teacher.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config
            )
        return _first_eos(out[:, input_ids.size(1) :].tolist(), trainer.eos_token_ids)[: len(sequences)]

    @torch.no_grad()
    def score(self, prompts, completions, distribution=False, teachers=None):
        """Log-probs through the trainer's fused LM head, in chunks of the per-device batch size (as GRPO scores its
        reference model), on the rows padded as GRPO pads a batch; the full distribution is not fetched ahead:
        `divergence_loss` projects it within the loss's forward. A rank without rows (a router sent them all to
        other teachers) scores a stand-in row while any rank has some: the forward is collective under ZeRO-3."""
        if distribution:
            return None
        if not self._any_rank_has(prompts):
            return []
        trainer = self.trainer
        pad_id, multiple = trainer._tokenizer.pad_token_id, trainer.pad_to_multiple_of
        num_rows = len(prompts)
        prompts, completions = (prompts, completions) if num_rows else ([[pad_id]], [[pad_id]])
        device = trainer.accelerator.device
        prompt_rows = [torch.tensor(p, dtype=torch.long) for p in prompts]
        prompt_ids = pad(prompt_rows, padding_value=pad_id, padding_side="left", pad_to_multiple_of=multiple)
        prompt_mask = pad([torch.ones_like(r) for r in prompt_rows], 0, "left", pad_to_multiple_of=multiple)
        # An empty completion (a rollout masked whole) is one masked padding token
        completion_rows = [torch.tensor(c or [pad_id], dtype=torch.long) for c in completions]
        completion_ids = pad(completion_rows, padding_value=pad_id, pad_to_multiple_of=multiple)
        masks = [torch.full_like(r, int(bool(c))) for r, c in zip(completion_rows, completions)]
        completion_mask = pad(masks, padding_value=0, pad_to_multiple_of=multiple)
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1).to(device)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).to(device)
        args = trainer.args
        batch_size = args.per_device_train_batch_size if trainer.model.training else args.per_device_eval_batch_size
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            self.model, input_ids, attention_mask, completion_ids.size(1), batch_size=batch_size
        )
        return _rows_answered([RowScores(logps[i, : len(c)]) for i, c in enumerate(completions)][:num_rows])

    def divergence_loss(self, student, student_hidden, batch, loss_mask, normalizer, beta, temperature):
        """TRL's exact generalised JSD over the full vocabulary, in chunks (its divergence kernel, as
        `DistillationTrainer` runs it; ZeRO-3-sharded heads gathered), from the teacher's hidden states of the same
        tokens, with the per-token log-probs and entropies from the same pass ([`divergence_and_token_logps`]). A
        rank without rows joins the collectives on a stand-in row that supervises nothing while any rank has some."""
        num_rows = batch["completion_ids"].size(0)
        no_logps = torch.zeros_like(batch["completion_ids"], dtype=torch.float32)
        if not self._any_rank_has(range(num_rows)):
            return Divergence(student_hidden.sum() * 0.0, no_logps, no_logps, no_logps)
        if num_rows == 0:
            batch, student_hidden, loss_mask = _stand_in_row(
                batch, student_hidden, self.trainer._tokenizer.pad_token_id
            )
        trainer = self.trainer
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        num_completion = batch["completion_ids"].size(1)
        teacher = trainer.accelerator.unwrap_model(self.model)
        with torch.no_grad():
            teacher_hidden = trainer._forward_redirection(
                self.model, teacher, _completion_hidden_states, teacher, input_ids, attention_mask, num_completion
            )
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
        )
        if num_rows == 0:  # the stand-in row's loss is 0 (nothing supervised); keep the student's graph whole
            return Divergence(out.loss + student_hidden.sum() * 0.0, no_logps, no_logps, no_logps)
        return out


def _stand_in_row(batch: dict, student_hidden, pad_id: int):
    """One pad-token prompt and completion with a zero loss mask, for a rank with no rows of its own to join a
    teacher's collectives with (its student hidden state is zeros, outside the student's graph)."""
    device = batch["completion_ids"].device
    ids, ones = torch.full((1, 1), pad_id, dtype=torch.long, device=device), torch.ones((1, 1), device=device)
    stand_in = {"prompt_ids": ids, "prompt_mask": ones.long(), "completion_ids": ids, "completion_mask": ones.long()}
    hidden = student_hidden.new_zeros((1, 1, student_hidden.size(-1)))
    return stand_in, hidden, torch.zeros((1, 1), device=device)


def _rows_answered(scores: list[RowScores]) -> list[TeacherRow]:
    batch = answered(scores)
    return [TeacherRow(batch, i) for i in range(len(scores))]


class SelfTeacher(InProcessTeacher):
    """The student as its own teacher, reading a privileged prompt (self-distillation with privileged context, as
    TRL's experimental `SDFTTrainer`): each row's `args.teacher_prompt_template` filled with its prompt and its
    `privileged_context`, tokenised as the student's prompt is (GRPO's `_tokenize_prompts`: the chat template for a
    conversational prompt, whose last user message the filled template replaces, as TRL does).

    The trainer hands it these prompts in place of the student's (`prompts`), so it scores and writes as an
    in-process teacher does, after its own prompt: a completion token's teacher log-prob is read at the same
    completion position whatever the two prompts' lengths, since each side left-pads its prompts before the shared,
    right-padded completion.

    The weights, by `args.teacher_model_kind`:

    - `"base"`: a frozen copy of the student made here, before any step (a PEFT student: its own base model with the
      adapter disabled, no copy);
    - `"live"`: the student itself under `no_grad`, no copy (generation through the trainer's wrapped model, which
      under ZeRO-3 gathers the student's shards as GRPO's own generation does);
    - `"ema"`: a frozen copy moved toward the student after every optimizer step by `args.teacher_update_rate`,
      written into each checkpoint and read back on resume; for a PEFT student, an average of its trained (adapter)
      parameters only, swapped into the student module for the teacher's calls (the base is shared and frozen).

    Under DeepSpeed ZeRO-3 the student is partitioned before this is made, so a deep copy would hold empty shards:
    the copy (`"base"`, `"ema"` of a full-weight student) is loaded again from the student's path, as the student was
    (partitioned as it loads, as TRL loads GRPO's reference model), and prepared as an in-process teacher is; the
    average is then taken on gathered parameters. A student given as a model instance has no path to load: refused
    there. A PEFT student's `"ema"` is refused under ZeRO-3 (its adapter is partitioned too: the swap needs it whole).

    Args:
        trainer: the [`OnPolicyDistillTrainer`] whose student teaches itself.
        student_path (`str`, *optional*): where the student was loaded from (its path or hub id), to load the copy
            under ZeRO-3; `None` for a student given as a model instance.
    """

    reads_own_prompts = True
    EMA_FILE = "statelens_ema_teacher.safetensors"

    def __init__(self, trainer, student_path: str | None = None):
        args = trainer.args
        self.kind, self.template = args.teacher_model_kind, args.teacher_prompt_template
        student = trainer.model
        peft = is_peft_model(student)
        zero3 = trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3
        self.zero3 = zero3
        self._adapter_average = None  # name -> averaged tensor, for a PEFT student's "ema"
        # No copy: the teacher is the student module itself (the one every wrapper holds), read without gradient; a
        # PEFT student's "ema" keeps one copy of its adapter only
        self.shares_student = self.kind == "live" or peft
        if self.shares_student:
            self.trainer, self.model = trainer, student
            if self.kind == "ema":
                if zero3:
                    raise ValueError(
                        "teacher_model_kind='ema' with a PEFT student under DeepSpeed ZeRO-3: the averaged adapter is "
                        "swapped into the student module for the teacher's calls, which needs the adapter whole, and "
                        "ZeRO-3 partitions it. Use ZeRO-2 (an adapter is small: partitioning it saves little), or "
                        "teacher_model_kind='base' (adapter disabled) or 'live'"
                    )
                # The parameters the optimizer trains (the adapter, and any `modules_to_save` copies); the base is
                # frozen, so it is the same for student and teacher and is not copied
                self._trained = [(name, p) for name, p in student.named_parameters() if p.requires_grad]
                self._adapter_average = {name: p.detach().clone() for name, p in self._trained}
                trainer.add_callback(_MovingAverage(self, args.teacher_update_rate))
            return
        if zero3:
            if student_path is None:
                raise ValueError(
                    f"teacher_model_kind={self.kind!r} under DeepSpeed ZeRO-3 with a student given as a model "
                    "instance: the student is already partitioned across processes, so the teacher's copy is loaded "
                    "again from the student's path, and an instance has none. Pass the student as a path or hub id "
                    "(model='path/to/model'), or use teacher_model_kind='live' (no copy)"
                )
            teacher = _load_like_student(student_path, args)
        else:
            teacher = copy.deepcopy(student)
            # GRPO patched the student's forward with its fused LM head, a closure over the student's own forward:
            # the copy would call the student's. Drop it; `InProcessTeacher` adds the head to the copy itself.
            teacher.__dict__.pop("forward", None)
        super().__init__(trainer, teacher)
        if self.kind == "ema":
            trainer.add_callback(_MovingAverage(self, args.teacher_update_rate))

    @property
    def generation_model(self):
        # The student as the trainer wrapped it (DDP, DeepSpeed engine): what GRPO itself generates with
        return self.trainer.model_wrapped if self.shares_student else self.model

    def _weights(self):
        """The teacher's weights for the call: a PEFT student's base with its adapter off for `"base"`, its averaged
        adapter swapped in for `"ema"`."""
        if self.kind == "base" and self.shares_student:
            return self.trainer.accelerator.unwrap_model(self.model).disable_adapter()
        if self._adapter_average is not None:
            return self._averaged_adapter()
        return nullcontext()

    @contextmanager
    def _averaged_adapter(self):
        """The averaged adapter in the student's parameters for the duration, the student's own back after.

        The tensors are exchanged (`param.data` re-pointed, nothing copied, so no second adapter copy is made) rather
        than written in place: in the `divergence` loss the teacher runs while the student's graph is alive, and an
        in-place write would bump the parameters' version counters and fail its backward. The student's values are
        back before that backward runs."""
        average = self._adapter_average
        with torch.no_grad():
            for name, param in self._trained:
                param.data, average[name] = average[name], param.data
        try:
            yield
        finally:
            with torch.no_grad():
                for name, param in self._trained:
                    param.data, average[name] = average[name], param.data

    def update_average(self, rate: float) -> None:
        """`teacher <- (1 - rate) * teacher + rate * student`, after an optimizer step (on every process: each holds
        its own copy, or its partitions of it under ZeRO-3)."""
        with torch.no_grad():
            if self._adapter_average is not None:
                for name, param in self._trained:
                    self._adapter_average[name].lerp_(param.detach(), rate)
                return
            student = self.trainer.accelerator.unwrap_model(self.trainer.model)
            # The copy holds the student's parameters in the same order (tied ones once)
            pairs = zip(self._unwrapped().named_parameters(), student.named_parameters(), strict=True)
            for (name, averaged), (student_name, current) in pairs:
                assert name == student_name, (name, student_name)
                # Under ZeRO-3, one pair of parameters gathered at a time (never two whole models on a process); the
                # main process's result is broadcast back into every process's partition of the teacher
                with self._gathered(current), self._gathered(averaged, modifier_rank=0):
                    if not self.zero3 or self.trainer.accelerator.is_main_process:
                        averaged.lerp_(current.detach().to(averaged.dtype), rate)

    def _gathered(self, param, modifier_rank=None):
        """`param` whole on every process for the duration under ZeRO-3 (a collective); nothing otherwise."""
        if not self.zero3:
            return nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters([param], modifier_rank=modifier_rank)

    def prompts(self, student_prompts, rows):
        missing = [i for i, row in enumerate(rows) if row.get("privileged_context") is None]
        if missing:
            raise ValueError(
                f"{len(missing)} row(s) of this batch have no privileged_context (None): the self teacher's prompt "
                f"is {self.template!r}; give every row a privileged_context (an empty string for none)"
            )
        texts = [self.fill(row["prompt"], row["privileged_context"]) for row in rows]
        return [list(ids) for ids in self.trainer._tokenize_prompts(texts)[0]]

    def fill(self, prompt, privileged_context):
        """The teacher's prompt (text or conversation) for a row."""
        context = _as_text(privileged_context)
        if not is_conversational({"prompt": prompt}):
            return self.template.format(prompt=prompt, privileged_context=context)
        last = prompt[-1]
        if last.get("role") != "user":
            raise ValueError(
                f"a conversational prompt for the self teacher must end with a user message, whose text "
                f"teacher_prompt_template fills in; this one ends with a {last.get('role')!r} message"
            )
        text = self.template.format(prompt=_as_text([last]), privileged_context=context)
        return [*prompt[:-1], {**last, "content": text}]

    def generate(self, prompts, max_new_tokens, prefixes=None, teachers=None):
        with self._weights():
            return super().generate(prompts, max_new_tokens, prefixes, teachers)

    @torch.no_grad()
    def score(self, prompts, completions, distribution=False, teachers=None):
        with self._weights():
            return super().score(prompts, completions, distribution, teachers)

    def divergence_loss(self, student, student_hidden, batch, loss_mask, normalizer, beta, temperature):
        """As [`InProcessTeacher`]'s, on the batch's teacher prompts (`teacher_prompt_ids`, one list per row)."""
        rows = [torch.tensor(p, dtype=torch.long) for p in batch["teacher_prompt_ids"]]
        if rows:
            pad_id, multiple = self.trainer._tokenizer.pad_token_id, self.trainer.pad_to_multiple_of
            device = batch["prompt_ids"].device
            prompt_ids = pad(rows, padding_value=pad_id, padding_side="left", pad_to_multiple_of=multiple)
            prompt_mask = pad([torch.ones_like(r) for r in rows], 0, "left", pad_to_multiple_of=multiple)
            batch = {**batch, "prompt_ids": prompt_ids.to(device), "prompt_mask": prompt_mask.to(device)}
        with self._weights():
            return super().divergence_loss(student, student_hidden, batch, loss_mask, normalizer, beta, temperature)

    def _averaged_weights(self):
        """`(name, tensor)` of what the average holds: the adapter's average, or the copy's parameters."""
        if self._adapter_average is not None:
            return list(self._adapter_average.items())
        return list(self._unwrapped().named_parameters())

    def save_state(self, output_dir):
        if self.kind != "ema":
            return
        should_save = self.trainer.args.should_save  # every process holds the same average: one writes it
        weights = {}
        for name, param in self._averaged_weights():
            with self._gathered(param):  # collective under ZeRO-3: every process joins, one keeps the whole tensor
                if should_save:
                    weights[name] = param.detach().to("cpu", copy=True).contiguous()
        if should_save:
            save_file(weights, str(Path(output_dir) / self.EMA_FILE))

    def load_state(self, checkpoint):
        if self.kind != "ema":
            return
        path = Path(checkpoint) / self.EMA_FILE
        if not path.is_file():
            raise ValueError(
                f"{path} not found: {checkpoint} holds no EMA teacher, so this run cannot resume the one it averaged "
                "(a checkpoint from a run without teacher_model_kind='ema'?)"
            )
        # Under ZeRO-3 the main process reads each tensor into the gathered parameter and it is broadcast into every
        # process's partition; otherwise each process reads it into its own copy
        reads = not self.zero3 or self.trainer.accelerator.is_main_process
        saved = safe_open(str(path), framework="pt") if reads else nullcontext()
        with saved as tensors, torch.no_grad():
            for name, param in self._averaged_weights():
                with self._gathered(param, modifier_rank=0):
                    if reads:
                        param.copy_(tensors.get_tensor(name))

    def _unwrapped(self):
        return self.trainer.accelerator.unwrap_model(self.model)


class _MovingAverage(TrainerCallback):
    """After every optimizer step, `teacher <- (1 - rate) * teacher + rate * student`
    ([`SelfTeacher.update_average`])."""

    def __init__(self, teacher: SelfTeacher, rate: float):
        self.teacher, self.rate = teacher, rate

    def on_step_end(self, args, state, control, **kwargs):
        self.teacher.update_average(self.rate)


def _load_like_student(path: str, args) -> PreTrainedModel:
    """The student's weights loaded again from `path` with the student's own settings (`args.model_init_kwargs`, as
    GRPO loaded it), for a self teacher's copy under ZeRO-3. Loaded inside the run's ZeRO-3 init, as TRL loads GRPO's
    reference model: partitioned as it loads (a collective; every process builds the trainer), so no process ever
    holds a whole second model."""
    kwargs = dict(args.model_init_kwargs or {})
    kwargs["device_map"] = None  # ZeRO-3 rejects a device map
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return create_model_from_path(path, **kwargs)


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


class RemoteTeacher(Teacher):
    """A teacher behind a vLLM server, through [`ServedTeacher`]; every rank asks for its own rows (no collective;
    vLLM batches the ranks' concurrent requests itself).

    Args:
        server ([`ServedTeacher`]): the checked client.
        sampling (`dict`): `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` of its continuations.
        eos_token_ids (`list[int]`): where a continuation ends.
        seed_generator (`torch.Generator`): draws one seed per continuation (vLLM would sample a request's identical
            prefixes alike).
        overlap (`bool`): send scoring requests from a background thread during `session()`.
        top_k (`int`): the top log-probs per position that `score(..., distribution=True)` asks for.
    """

    def __init__(self, server, sampling: dict, eos_token_ids, seed_generator, overlap: bool = True, top_k: int = 0):
        self.server, self.sampling, self.eos_token_ids = server, sampling, eos_token_ids
        self.seed_generator, self.overlap, self.top_k = seed_generator, overlap, top_k
        self._requests = None

    @classmethod
    def connect(cls, trainer, path: str | None = None, url: str | None = None) -> RemoteTeacher:
        """The teacher at `url` (default: `trainer.args.teacher_model_server_url`), checked now by
        [`connect_served_teacher`]; with `divergence` it must answer `teacher_top_k` log-probs per position."""
        args = trainer.args
        top_k = args.teacher_top_k if args.signal == "divergence" else 0
        url = url or args.teacher_model_server_url
        server = connect_served_teacher(url, trainer.model, trainer._tokenizer, path, args, top_k)
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        sampling = {name: getattr(trainer, name) for name in names}
        return cls(
            server, sampling, trainer.eos_token_ids, trainer._source_generator, args.teacher_server_overlap, top_k
        )

    @contextmanager
    def session(self):
        if not self.overlap:
            yield
            return
        from .served_teacher import BackgroundRequests

        # One worker: a rank's scoring requests go out one at a time, in the order the batches were made. Shut down
        # when training ends or fails, so that a crash does not leave the process waiting for a request in flight.
        self._requests = BackgroundRequests("teacher-server")
        try:
            yield
        finally:
            self._requests.shutdown()
            self._requests = None

    def generate(self, prompts, max_new_tokens, prefixes=None, teachers=None):
        sequences = _join(prompts, prefixes)
        if not sequences:
            return []
        # A seed per row (vLLM would sample a request's identical prefixes alike), drawn from the run's seed
        seeds = torch.randint(2**31 - 1, (len(sequences),), generator=self.seed_generator).tolist()
        return self.server.generate(sequences, max_new_tokens, self.eos_token_ids, **self.sampling, seeds=seeds)

    def score(self, prompts, completions, distribution=False, teachers=None):
        """One request for the batch (each row without its padding), from the background worker during an
        overlapped `session()` (its errors are raised where the answer is read), else at once. With `distribution`,
        the teacher's `top_k` log-probs per position (vLLM's `prompt_logprobs=top_k`)."""
        sequences, lengths = [p + c for p, c in zip(prompts, completions)], [len(p) for p in prompts]
        if not sequences:
            return []
        top_k = self.top_k if distribution else 0
        if self._requests is not None:
            batch = self._requests.submit(self._scores, sequences, lengths, top_k)
        else:
            batch = answered(self._scores(sequences, lengths, top_k))
        return [TeacherRow(batch, i) for i in range(len(sequences))]

    def _scores(self, sequences, lengths, top_k) -> list[RowScores]:
        if not top_k:
            return [RowScores(torch.tensor(row)) for row in self.server.logps(sequences, lengths)]
        return [
            RowScores(
                torch.tensor(row["actual_logprobs"]),
                torch.tensor(row["logprob_token_ids"], dtype=torch.long).view(-1, top_k),
                torch.tensor(row["logprobs"], dtype=torch.float32).view(-1, top_k),
            )
            for row in self.server.top_logps(sequences, lengths, top_k)
        ]

    def divergence_loss(self, student, student_hidden, batch, loss_mask, normalizer, beta, temperature):
        """The generalised JSD on the teacher's top-k tokens plus a tail bucket ([`topk_tail_divergence`])."""
        if not batch["teacher_logps"]:  # a router sent this rank's rows to other teachers
            return Divergence(
                student_hidden.sum() * 0.0, torch.zeros_like(batch["completion_ids"], dtype=torch.float32)
            )
        scores = resolve_rows(batch["teacher_logps"], batch["completion_ids"], batch["completion_mask"])
        loss = topk_tail_divergence(
            student, student_hidden, scores.top_ids, scores.top_logps, loss_mask, beta, normalizer, temperature
        )
        return Divergence(loss, scores.logps)


class TeacherRouter(Teacher):
    """Several teachers, each row answered by the one its `teacher_id` names (rows without one, or with `None`, by
    `default`): every method splits the rows by teacher, asks each teacher for its own, and puts the answers back in
    row order. Every teacher is asked on every rank, with or without rows of its own there (an in-process teacher's
    calls are collective under ZeRO-3, and it joins them on a stand-in row when it has none).

    Args:
        teachers (`dict[str, Teacher]`): the teachers by name, in-process and served mixed.
        default (`str`): the teacher of rows without a `teacher_id`.
    """

    def __init__(self, teachers: dict[str, Teacher], default: str):
        self.teachers, self.default, self.names = teachers, default, tuple(teachers)

    @classmethod
    def connect(cls, trainer, loaded: dict[str, tuple]) -> TeacherRouter:
        """The teachers from [`load_teachers`], each prepared (in-process) or reached and checked (served) as a single
        teacher is; the first is the default. A check that fails names its teacher."""
        teachers = {}
        for name, (model, path, url) in loaded.items():
            try:
                if url is not None:
                    teachers[name] = RemoteTeacher.connect(trainer, path, url)
                else:
                    teachers[name] = InProcessTeacher(trainer, model, path)
            except ValueError as error:
                raise ValueError(f"teacher {name!r}: {error}") from error
        return cls(teachers, default=next(iter(teachers)))

    def route(self, teacher_ids):
        names = [self.default if teacher_id is None else teacher_id for teacher_id in teacher_ids]
        unknown = sorted(set(names) - set(self.names))
        if unknown:
            raise ValueError(f"teacher_id {unknown} names no teacher; the teachers are {list(self.names)}")
        return names

    @contextmanager
    def session(self):
        with ExitStack() as stack:
            for teacher in self.teachers.values():
                stack.enter_context(teacher.session())
            yield

    def _rows_by_teacher(self, teachers: list[str] | None, num_rows: int) -> dict[str, list[int]]:
        teachers = teachers if teachers is not None else [self.default] * num_rows
        return {name: [i for i, t in enumerate(teachers) if t == name] for name in self.names}

    def generate(self, prompts, max_new_tokens, prefixes=None, teachers=None):
        written = [None] * len(prompts)
        for name, rows in self._rows_by_teacher(teachers, len(prompts)).items():
            row_prefixes = None if prefixes is None else [prefixes[i] for i in rows]
            answers = self.teachers[name].generate([prompts[i] for i in rows], max_new_tokens, row_prefixes)
            for i, answer in zip(rows, answers, strict=True):
                written[i] = answer
        return written

    def score(self, prompts, completions, distribution=False, teachers=None):
        scored = [None] * len(prompts)
        for name, rows in self._rows_by_teacher(teachers, len(prompts)).items():
            answers = self.teachers[name].score(
                [prompts[i] for i in rows], [completions[i] for i in rows], distribution
            )
            for i, answer in zip(rows, answers or [None] * len(rows), strict=True):
                scored[i] = answer
        return None if all(row is None for row in scored) else scored

    def divergence_loss(self, student, student_hidden, batch, loss_mask, normalizer, beta, temperature):
        """The sum of each teacher's loss on its rows (each already divided by the whole `normalizer`); the student's
        per-token values only when every teacher gave them."""
        total = student_hidden.sum() * 0.0
        per_token = {
            field: torch.zeros_like(batch["completion_ids"], dtype=torch.float32)
            for field in ("teacher_logps", "logps", "entropies")
        }
        for name, rows in self._rows_by_teacher(batch["teacher"], len(batch["teacher"])).items():
            index = torch.tensor(rows, dtype=torch.long, device=student_hidden.device)
            part = {
                key: batch[key][index] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
            }
            scores = batch["teacher_logps"]
            part["teacher_logps"] = [scores[i] for i in rows] if scores is not None else None
            answer = self.teachers[name].divergence_loss(
                student, student_hidden[index], part, loss_mask[index], normalizer, beta, temperature
            )
            total = total + answer.loss
            for field, values in per_token.items():
                if values is not None and getattr(answer, field) is not None:
                    values[index] = getattr(answer, field).to(values.dtype)
                else:
                    per_token[field] = None
        return Divergence(total, **per_token)


def load_teachers(teacher_models: dict, args) -> dict[str, tuple]:
    """`(model, path, url)` for each named teacher of [`OnPolicyDistillTrainer`]'s `teacher_model` dict: a string
    starting with `http://` or `https://` is a vLLM server's URL (nothing loaded), another string a path, hub id or
    LoRA folder loaded with [`load_teacher`], anything else a model instance."""
    if not teacher_models:
        raise ValueError(
            "teacher_model is an empty dict: give at least one teacher, name -> model, path or server URL"
        )
    loaded = {}
    for name, teacher in teacher_models.items():
        if isinstance(teacher, str) and teacher.startswith(("http://", "https://")):
            try:  # the settings a served teacher needs, checked in the config only for teacher_model_server_url
                args._check_teacher_server_settings()
            except ValueError as error:
                raise ValueError(f"teacher {name!r} is served at {teacher}: {error}") from error
            loaded[name] = (None, None, teacher)
        elif isinstance(teacher, str):
            loaded[name] = (load_teacher(teacher, args), teacher, None)
        else:
            loaded[name] = (teacher, None, None)
    return loaded


def load_teacher(name_or_path: str, args) -> PreTrainedModel:
    """Load a teacher given by path or hub id as TRL's trainers load theirs, for inference.

    `args.teacher_model_init_kwargs` go to `from_pretrained`; the dtype defaults to `"auto"` (a bf16 checkpoint
    stays bf16, as in TRL's `DistillationTrainer`) and, under multi-GPU DDP or DeepSpeed, `device_map` is `None` (as
    TRL's GRPO/Distillation trainers set it: ZeRO-3 rejects a device map and "auto" would put every rank's copy on
    the first GPU). A PEFT adapter folder (`adapter_config.json` plus adapter weights, what a LoRA SFT run saves)
    is loaded as its base model plus the adapter, merged: the teacher only runs inference.

    `args` is an [`OnPolicyDistillConfig`] or TRL's `DistillationConfig` (the recipes' stock arm loads its teacher
    here too, so both arms accept the same teacher folders).
    """
    kwargs = dict(args.teacher_model_init_kwargs or {})
    kwargs.setdefault("dtype", "auto")
    kwargs.setdefault("use_safetensors", True)  # no pickle files: weights only
    if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
        kwargs["device_map"] = None
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    if find_adapter_config_file(name_or_path, revision=kwargs.get("revision")) is None:
        return create_model_from_path(name_or_path, **kwargs)
    from peft import PeftConfig, PeftModel

    revision = kwargs.pop("revision", None)  # the adapter's revision; its base model's is in adapter_config.json
    adapter = PeftConfig.from_pretrained(name_or_path, revision=revision)
    if adapter.revision is not None:
        kwargs["revision"] = adapter.revision
    # Under ZeRO-3, from_pretrained would partition the base as it loads, and PEFT would add the adapter's delta to
    # the empty shards: load and merge a whole model on each process; preparing the teacher partitions it after.
    with without_zero3_init():
        base = create_model_from_path(adapter.base_model_name_or_path, **kwargs)
        return PeftModel.from_pretrained(base, name_or_path, revision=revision).merge_and_unload()


@contextmanager
def without_zero3_init():
    """Load whole models, not ZeRO-3 partitions, even inside a ZeRO-3 run.

    Under ZeRO-3, `from_pretrained` partitions the weights across processes as it loads them (`zero.Init`, set up by
    `TrainingArguments` whatever accelerate's `zero3_init_flag` says, so accelerate's
    `zero3_init_context_manager(enable=False)` changes nothing then), a collective call: done by the main process
    alone (evaluation) it would wait forever for the others, and a LoRA adapter cannot be merged into empty shards.
    """
    from transformers.integrations import deepspeed

    saved = deepspeed._hf_deepspeed_config_weak_ref
    deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        deepspeed._hf_deepspeed_config_weak_ref = saved


def connect_served_teacher(url: str, student, student_tokenizer, path: str | None, args, top_k: int):
    """A [`ServedTeacher`] at `url`, checked before any training work: reachable, serving a model with the student's
    vocabulary (and, when `path` names the teacher, the student's tokenizer), answering `top_k` log-probs per
    position. `args` (an [`OnPolicyDistillConfig`]) gives the `teacher_server_*` settings. The recipes' stock arm
    checks its server here too, since TRL's `ServerDistillationTrainer` checks none of this."""
    from .served_teacher import ServedTeacher

    teacher_tokenizer = _read_tokenizer(path)  # without one, the served vocabulary size is checked all the same
    student_vocab = _vocab_size(student)
    if top_k > student_vocab:
        raise ValueError(
            f"teacher_top_k={top_k} is more than the student's vocabulary ({student_vocab} ids): set it to at most "
            f"{student_vocab} (that many is the exact divergence)"
        )
    return ServedTeacher(
        url,
        student_tokenizer,
        student_vocab,
        teacher_tokenizer=teacher_tokenizer,
        timeout=args.teacher_server_timeout,
        max_retries=args.teacher_server_max_retries,
        retry_backoff=args.teacher_server_retry_backoff,
        chunk_size=args.teacher_server_chunk_size,
        top_k=top_k,
    )


def _read_tokenizer(path: str | None):
    """The tokenizer saved with the teacher at `path`, or `None` (no path, or a checkpoint without a tokenizer)."""
    if path is None:
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def _vocab_size(model) -> int:
    """Rows of the model's output layer, from its config (unwrapped from PEFT/DDP/DeepSpeed; ZeRO-3-safe)."""
    model = getattr(model, "module", model)  # DDP, DeepSpeed engine
    model = model.get_base_model() if is_peft_model(model) else model
    return model.config.get_text_config().vocab_size


def _check_same_vocabulary(student, student_tokenizer, teacher, teacher_path: str | None, signal: str) -> None:
    """The teacher must read the student's token ids as the student does. Its output layer may have more rows than the
    student's, as when a larger model of a family is padded further (Qwen2.5-7B: 152064, Qwen2.5-0.5B: 151936, one
    tokenizer): `reverse_kl` and `continuation` score the student's ids, all below the student's vocab_size, under
    the teacher's softmax over its whole output layer (the teacher as it is: padding rows no tokenizer id reaches
    carry next to no mass in a trained model), and the teacher never writes a padding id. `divergence` compares whole
    next-token distributions, which needs the same width."""
    student_vocab, teacher_vocab = _vocab_size(student), _vocab_size(teacher)
    hint = "Use a teacher with the student's tokenizer, or TRL's GOLDTrainer for cross-tokenizer distillation."
    if teacher_vocab < student_vocab:
        raise ValueError(
            f"the teacher's vocab_size ({teacher_vocab}) is smaller than the student's ({student_vocab}): on-policy "
            f"distillation scores the student's tokens with the teacher, so every student id must be one of the "
            f"teacher's. {hint}"
        )
    if teacher_vocab > student_vocab and signal == "divergence":
        raise ValueError(
            f"signal='divergence' compares the student's and the teacher's full next-token distributions, but the "
            f"teacher's output layer has {teacher_vocab} rows and the student's {student_vocab}. If the extra rows are "
            "padding (the same tokenizer), drop them from the teacher before training, "
            f"`teacher.resize_token_embeddings({student_vocab})` (its distribution renormalised over the shared ids), "
            "or use signal='reverse_kl' or 'continuation', which score the student's ids under the whole teacher"
        )
    teacher_tokenizer = _read_tokenizer(teacher_path)  # without one, the vocab_size checks above are all we can do
    if teacher_tokenizer is None:
        if teacher_vocab != student_vocab:
            logger.warning(
                "The teacher's output layer has %d rows, the student's %d, and no teacher tokenizer was read to check "
                "that both map ids alike: the extra rows are taken as padding of the same tokenizer. Pass the "
                "teacher as a path or hub id to have its tokenizer checked.",
                teacher_vocab,
                student_vocab,
            )
        return
    if teacher_tokenizer.get_vocab() != student_tokenizer.get_vocab():
        raise ValueError(
            f"the teacher's tokenizer ({teacher_path}) maps tokens to ids differently from the student's: the same "
            f"ids would mean different text to each model. {hint}"
        )
    if teacher_tokenizer.chat_template != student_tokenizer.chat_template:
        logger.warning(
            "The teacher's chat template (%s) differs from the student's: prompts are formatted with the student's "
            "template and the teacher scores those tokens, so on conversational data the teacher reads a layout it "
            "was not trained on. Use a teacher fine-tuned with the student's template, or plain-text prompts.",
            teacher_path,
        )
