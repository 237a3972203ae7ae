"""[`OnPolicyDistillTrainer`]'s rollouts: whose states each row supervises (`state_source_mix`: the student's own
rollout, the dataset's reference or the teacher's rollout), the rollout length (`horizon`), the teacher's prompts and
continuations (`signal="continuation"`), and when the teacher is asked to score them (at once, or once the rewards
are in with state selection). Mixed into the trainer, before `StateLensGRPOTrainer`: the GRPO methods overridden here
(`_generate_and_score_completions`, `_generate`) reach GRPO's own through `super()`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl.trainer.utils import pad

from .. import collective
from ..lens.endings import END_KINDS
from ..lens.records import source_code
from ..merged_lora import student_sampling
from ..teachers.self_teacher import with_context
from ..teachers.vocabulary import vocab_size
from .checks import check_rows, row_columns
from .config import MIX_SOURCES
from .selection import select_and_score

LEARNER, DATASET, TEACHER = (source_code(s) for s in ("learner", "dataset", "teacher"))


@dataclass
class RolloutBatch:
    """One generation batch on its way through GRPO's `_generate_and_score_completions`, row by row: what this
    trainer decided for each row before the rollouts (`rows`, the dataset rows; `sources`, whose states it
    supervises; `references`, its reference answer, for `dataset` states; `teachers`, its teacher from
    `Teacher.route`), and what `_generate` adds (`teacher_prompts`, the prompt the teacher reads; `teacher_scores`,
    the teacher's [`TeacherRow`]s, asked for as soon as the tokens are final; `scoring_rollouts`, set once GRPO goes
    on to score the rollouts with the student, a forward no OPD loss reads)."""

    rows: list[dict]
    sources: list[str]
    references: list
    teachers: list[str | None]
    teacher_prompts: list[list[int]] | None = None
    teacher_scores: list | None = None
    scoring_rollouts: bool = False
    completion_ids: list[list[int]] | None = None  # kept for the teacher until the rewards are in (state selection)


def no_reward(completions, **kwargs) -> list[float]:
    """Reward of 0 for every completion: GRPO needs a reward function, pure distillation has none."""
    return [0.0] * len(completions)


# What GRPO logs from the rewards each generation batch; with `no_reward` only, constants (0, 0, 1) that say nothing
REWARD_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "rewards/no_reward/mean", "rewards/no_reward/std")


class RolloutsMixin:
    """The rollout side of [`OnPolicyDistillTrainer`], mixed in before [`StateLensGRPOTrainer`]."""

    # ----- rollouts: whose states ------------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        draws = torch.multinomial(self._source_probs, len(inputs), replacement=True, generator=self._source_generator)
        batch = RolloutBatch(
            rows=inputs,
            sources=[MIX_SOURCES[i] for i in draws.tolist()],
            references=[row.get(self.args.reference_column) for row in inputs],
            teachers=self._check_rows_on_every_rank(inputs),
        )
        # GRPO calls `_generate(prompts)` and `_get_per_token_logps_and_entropies` from inside its own method, with
        # arguments it fixes: the batch reaches them through this one attribute, held for the duration of the call
        self._rollout_batch = batch
        try:
            output = super()._generate_and_score_completions(inputs)  # calls `_generate` below, then the rewards
        finally:
            self._rollout_batch = None
        if not self._has_rewards:  # GRPO scored the rollouts with `no_reward`: drop what it logged of those zeros
            for key in REWARD_METRICS:
                self._metrics["train" if self.model.training else "eval"].pop(key, None)
            self._logs["rewards"].pop(no_reward.__name__, None)
            output.pop("rewards", None)  # the ledger's sequences then carry no reward
        device = output["completion_ids"].device
        output["row_source"] = torch.tensor([source_code(s) for s in batch.sources], device=device)
        output["teacher"] = batch.teachers  # a list: GRPO shuffles and splits it with the rows
        output["teacher_prompt_ids"] = batch.teacher_prompts  # the prompt the teacher reads, per row (a list too)
        if self.args.signal == "continuation":
            return self._continue_with_teacher(output)
        # One `TeacherRow` per row (read in the loss), or None: an in-process teacher's divergence is computed there
        if self._selects_states():  # the rewards are in: the teacher scores the rows not skipped
            output["teacher_scores"] = select_and_score(self, batch, output)
        else:
            output["teacher_scores"] = batch.teacher_scores
        return output

    def _selects_states(self) -> bool:
        """Whether this batch's rollouts are selected for the teacher by their rewards (`skip_correct_rollouts`; in
        training only, evaluation scores every rollout)."""
        return self.args.skip_correct_rollouts and self.model.training

    def _check_rows_on_every_rank(self, inputs: list[dict]) -> list[str | None]:
        """Each row's teacher, once this batch's rows hold what the run reads (`check_rows`). A bad row stops every
        process here, before the batch's first collective: raised on its own process only, it would leave the others
        waiting in the next one until the launcher's timeout. A map dataset's rows were checked when the trainer was
        built; this is what catches an IterableDataset's (one flag per process gathered, once per generation batch)."""
        error, teachers = None, None
        try:
            check_rows({name: [row.get(name) for row in inputs] for name in row_columns(self.args)}, self.args)
            teachers = self.teacher.route([row.get("teacher_id") for row in inputs])
        except ValueError as raised:
            error = raised
        collective.raise_together(self.accelerator, error, "a bad row in its batch", ValueError)
        return teachers

    def _teacher_prompts(self, prompt_ids, rows):
        """The prompt the teacher reads for each row; with `teacher_reads_context`, the row's prompt shown its
        privileged context (`with_context`), which a teacher of the student's tokenizer reads in the student's
        tokenization and one of another tokenizer renders in its own chat template (`ReadsText.prompts`)."""
        if self.args.teacher_reads_context and rows:
            rows = [
                {
                    **row,
                    "prompt": with_context(
                        row["prompt"], row["privileged_context"], self.args.teacher_prompt_template
                    ),
                }
                for row in rows
            ]
            prompt_ids = [list(ids) for ids in self._tokenize_prompts([row["prompt"] for row in rows])[0]]
        # On every rank, rows or none: a row its teacher cannot read (a teacher of another tokenizer reads it as text,
        # through its own chat template) stops every rank here, before the generation's collectives
        prompts, error = None, None
        try:
            prompts = self.teacher.prompts(prompt_ids, rows)
        except ValueError as raised:
            error = raised
        collective.raise_together(self.accelerator, error, "a row its teacher could not read", ValueError)
        return prompts

    def _suppress_unreadable_ids(self) -> None:
        """Keep the student from sampling ids a teacher of another tokenizer cannot read: its special tokens of no role
        that teacher has (SmolLM2's `<file_sep>`, ...) and the rows of its output layer past its tokenizer. They join
        the `suppress_tokens` of its generation, as the teacher is kept from writing ids the student cannot read.
        (Under vLLM they are not suppressed: a row holding one stops every process where it is read.)"""
        if self.use_vllm:
            return
        teachers = getattr(self.teacher, "teachers", {"teacher": self.teacher}).values()
        unreadable = set()
        for teacher in teachers:
            if teacher.crosses_tokenizers:
                rows = vocab_size(self.model)
                unreadable |= {i for i in teacher.unreadable_student_ids if i < rows}
                unreadable |= set(range(len(teacher.student_vocab), rows))
        if not unreadable:
            return
        suppressed = sorted(set(self.generation_kwargs.get("suppress_tokens") or []) | unreadable)
        self.generation_kwargs["suppress_tokens"] = self.generation_config.suppress_tokens = suppressed

    def _generate(self, prompts):
        length = self._set_rollout_length()
        with student_sampling(self, self.accelerator.unwrap_model(self.model)):
            output = super()._generate(prompts)
        prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images = output
        batch = self._rollout_batch
        # The teacher reads its own prompts (a self teacher's hold the row's privileged context), the student its own
        batch.teacher_prompts = teacher_prompts = self._teacher_prompts(prompt_ids, batch.rows)
        self._count_teacher_context(teacher_prompts, prompt_ids)
        swap = [i for i, s in enumerate(batch.sources) if s != "learner"]
        teacher_rows = [i for i in swap if batch.sources[i] == "teacher"]
        # Asked on every rank, with or without rows of its own (an in-process teacher's generation is collective)
        writers = [batch.teachers[i] for i in teacher_rows]
        own_written = self._own_tokens_written()
        rollouts = self.teacher.generate([teacher_prompts[i] for i in teacher_rows], length, teachers=writers)
        own_written = self._own_tokens_written() - own_written
        self._count_teacher_tokens(rollouts)
        self._count_teacher_generation([teacher_prompts[i] for i in teacher_rows], rollouts, writers, own_written)
        replacement = dict(zip(teacher_rows, rollouts))
        if swap:
            for i in swap:
                ids = replacement[i] if i in replacement else self._reference_ids(batch.references[i], length)
                completion_ids[i] = ids
                text = self._tokenizer.decode(ids, skip_special_tokens=True)
                completions[i] = [{"role": "assistant", "content": text}] if isinstance(prompts[i], list) else text
        if self.args.signal != "continuation" and self._selects_states():
            batch.completion_ids = completion_ids  # scored once GRPO has the rewards (`selection.select_and_score`)
        elif self.args.signal != "continuation":
            # The tokens to score are final here: start scoring now, so that a served teacher's round trip (with
            # `teacher_server_overlap`) runs while GRPO pads the batch, computes rewards (and, under vLLM, the
            # student's old log-probs) and the first micro-batch's forward runs. Rows GRPO masks later (truncated
            # completions) are zeroed when the answer is read.
            distribution = self.args.signal == "divergence"
            batch.teacher_scores = self.teacher.score(
                teacher_prompts, completion_ids, distribution, teachers=batch.teachers
            )
            # (an in-process teacher's `divergence` scores them in the loss: the same rows, counted here)
            self._count_teacher_tokens(completion_ids)
        # From here until the batch is returned GRPO scores the rollouts with the student (its old log-probs), which
        # no OPD loss reads: `_get_per_token_logps_and_entropies` skips that forward. (The teacher's scoring above
        # runs first: a live self teacher is the student.)
        batch.scoring_rollouts = True
        return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images

    def _reference_ids(self, reference, length: int) -> list[int]:
        """The dataset's reference answer as completion tokens, ended by eos like a finished rollout; one that does not
        fit in the rollout `length` with its eos is cut there without one, like a rollout that hit the limit (so
        `mask_truncated_completions` masks it as GRPO masks those)."""
        text = reference[-1]["content"] if isinstance(reference, list) else reference
        ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            return ids[:length]
        return ids + [self.eos_token_ids[0]]

    def _set_rollout_length(self) -> int:
        """This generation batch's tokens per rollout, set where GRPO's generation reads it: `max_completion_length`,
        or the `horizon` grown by `horizon_growth` per optimizer step so far, up to it. The same on every rank (it
        depends on the step only), and again after a resume."""
        length = self.max_completion_length
        if self.args.horizon is not None:
            length = min(self.args.horizon + self.args.horizon_growth * self.state.global_step, length)
        if self.use_vllm:
            self.vllm_generation.max_completion_length = length
        else:
            self.generation_config.max_new_tokens = self.generation_kwargs["max_new_tokens"] = length
        self._rollout_length = length
        return length

    def _rollout_limit(self) -> int:
        """This generation batch's rollout length (`_set_rollout_length`): a rollout cut at the `horizon` is cut at its
        length limit."""
        return self._rollout_length

    def _continue_with_teacher(self, output: dict) -> dict:
        """Cut each rollout at a uniformly drawn prefix length and append a teacher continuation from there. A rollout
        GRPO masked whole (truncated, with `mask_truncated_completions`) is neither cut nor continued: it supervises
        nothing, as in GRPO, and is left as one masked padding token."""
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        lengths = completion_mask.sum(1).cpu()
        cuts = (torch.rand(len(lengths), generator=self._source_generator) * lengths.clamp(min=1)).long()
        cuts = torch.minimum(cuts, lengths)
        prefixes = [completion_ids[i, : cuts[i]].tolist() for i in range(len(cuts))]
        prompts = output["teacher_prompt_ids"]  # the teacher continues the student's prefix after its own prompt
        # Every rollout holds at least its first token (or eos) unless GRPO masked it whole
        kept = [i for i in range(len(cuts)) if lengths[i] > 0]
        continuations = [[] for _ in cuts]
        # Asked on every rank, even one whose rows are all masked (an in-process teacher's generation is collective)
        written = self.teacher.generate(
            [prompts[i] for i in kept],
            self.args.continuation_length,
            prefixes=[prefixes[i] for i in kept],
            teachers=[output["teacher"][i] for i in kept],
        )
        ends = output["end_kind"].tolist()  # the ledger's sequence of a continued row is the teacher's continuation
        for i, continuation in zip(kept, written):
            continuations[i] = continuation
            ends[i] = END_KINDS.index(
                "end_token"
                if continuation and continuation[-1] in self.eos_token_ids
                else "length_limit"
                if len(continuation) >= self.args.continuation_length
                else "stop"
            )
        output["end_kind"] = torch.tensor(ends, device=output["end_kind"].device)
        self._count_teacher_tokens(written)

        device = completion_ids.device
        pad_id = self._tokenizer.pad_token_id
        sequences = [p + c for p, c in zip(prefixes, continuations)]
        rows = [torch.tensor(s or [pad_id], dtype=torch.long) for s in sequences]  # an empty row: one masked pad
        output["completion_ids"] = pad(rows, padding_value=pad_id).to(device)
        masks = [torch.full_like(r, int(bool(s))) for r, s in zip(rows, sequences)]
        output["completion_mask"] = pad(masks, padding_value=0).to(device)
        positions = torch.arange(output["completion_ids"].size(1), device=device)
        cut = cuts.to(device)[:, None]
        ends = cut + torch.tensor([len(c) for c in continuations], device=device)[:, None]
        output["loss_mask"] = ((positions >= cut) & (positions < ends)).long()
        # The first teacher token is predicted from the rollout's own state; later ones from states the teacher wrote
        output["token_source"] = torch.where(positions > cut, TEACHER, output["row_source"][:, None])
        output["num_items_in_batch"] = self.accelerator.gather(output["loss_mask"].sum()).sum()
        for stale in (
            "old_per_token_logps",
            "sampling_per_token_logps",
            "importance_sampling_ratio",
            "ref_per_token_logps",
        ):
            output.pop(stale, None)  # computed for the rollouts before the cut; the loss here does not use them
        output["teacher_scores"] = self.teacher.score(prompts, sequences, teachers=output["teacher"])
        self._count_teacher_tokens(sequences)
        return output
