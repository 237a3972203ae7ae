"""How a trainer records its states: :class:`StateRecorderMixin`, mixed into a trainer, keeps each training
micro-batch's state records from its loss path (no extra forward pass) and hands the optimizer step's, gathered from
every rank, to [`StateLoggingCallback`] as :class:`~.records.StateRecords`, with a few whole sequences sampled for the
ledger (`states.jsonl`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import collective
from ..answers import repeats_itself
from .endings import END_KINDS
from .records import SELECTION_FIELDS, STATE_SOURCES, StateRecords, source_code
from .step_counts import StepCounts


def _per_row(value, batch_size: int, seq_len: int, device, dtype) -> torch.Tensor:
    """Broadcast a scalar, a `(B,)` or a `(B, L)` value to `(B, L)`."""
    value = torch.as_tensor(value, device=device, dtype=dtype)
    if value.ndim == 1:
        value = value[:, None]
    return value.expand(batch_size, seq_len)


@dataclass
class _MicroBatchStates:
    """One micro-batch's records plus what it takes to decode its sequences if they are sampled for the ledger."""

    records: StateRecords  # rank column filled in at collection time
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    supervised_mask: torch.Tensor  # (B, L)
    sequence_row: torch.Tensor  # (S,) row of each recorded sequence
    sequence_start: torch.Tensor  # (S,) first position of the sequence in its row (packed rows hold several)
    sequence_first: torch.Tensor  # (S,) first supervised position: the prompt ends just before it
    sequence_last: torch.Tensor  # (S,) last supervised position
    sequence_ids: torch.Tensor  # (S,) sequence index of each
    rewards: torch.Tensor | None  # (B,) reward of each row, when the trainer has one
    teachers: list[str] | None = None  # (B,) the teacher of each row, when the trainer has several
    teacher_prompts: list[list[int]] | None = (
        None  # (B,) each row's teacher prompt, when it differs from the student's
    )
    selection: torch.Tensor | None = None  # (B,) each row's state-selection code, with state selection
    teacher_exact: torch.Tensor | None = None  # (B, L) a teacher of another tokenizer: whose log-prob is exact
    end_kinds: torch.Tensor | None = None  # (B,) how each row's completion ended, an index into END_KINDS


class StateRecorderMixin:
    """Adds state recording to a trainer. Mix it in before the TRL trainer class.

    The trainer calls :meth:`_record_states` from its loss path on every training micro-batch; nothing is kept until a
    :class:`~trl_statelens.lens.callback.StateLoggingCallback` starts the recording (so a trainer without the callback
    pays nothing). A third trainer (for example on-policy distillation with a mix of learner, dataset and teacher
    states) records through the same method, passing `source` per row or per token and `teacher_logps`.
    """

    _state_buffer: list[_MicroBatchStates] | None = None
    _state_sequences_in_step: int = 0
    # With several teachers, their names, the same on every rank: each row's teacher is recorded as its index here
    state_teacher_names: tuple[str, ...] = ()
    # A trainer with a teacher sets it: this rank's counts of the optimizer step in progress, among them the positions
    # its teacher scored or wrote (`teacher_tokens`: `_count_teacher_tokens`) and the tokens a self teacher's prompts
    # held beyond the student's, the privileged context it reads at every position it scores
    # (`teacher_context_tokens`: `_count_teacher_context`)
    step_counts: StepCounts | None = None

    def _collect_reward_groups(self) -> list[dict]:
        """The groups of rollouts since the last call, each `{"prompt_id", "rewards", ...}`; GRPO's (every rank holds
        all of them). Trainers without reward groups have none."""
        return []

    def _collect_rollout_endings(self) -> dict[str, float]:
        """`ends/*`: how this step's rollouts ended (`lens.endings`); trainers that sample no rollouts have none."""
        return {}

    def _sample_ending(self, completion_ids: torch.Tensor, end_kind: int | None) -> dict:
        """A ledger sequence's end (`lens.endings.END_KINDS`, as the trainer that sampled it judged it against the
        row's real limit) and whether it repeats itself; nothing for sequences nobody sampled (SFT's dataset
        states)."""
        if end_kind is None or not len(completion_ids):
            return {}
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        text = tokenizer.decode(completion_ids, skip_special_tokens=True)
        return {"end": END_KINDS[end_kind], "repeats": repeats_itself(text)}

    def _start_state_recording(self) -> None:
        self._state_buffer = []
        self._state_sequences_in_step = 0
        if self.step_counts is not None:
            self.step_counts.clear()

    @torch.no_grad()
    def _record_states(
        self,
        input_ids: torch.Tensor,
        supervised_mask: torch.Tensor,
        logps: torch.Tensor,
        entropy: torch.Tensor,
        source: str | torch.Tensor,
        *,
        prefix_len: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        teacher_logps: torch.Tensor | None = None,
        weights: float | torch.Tensor | None = None,
        rewards: torch.Tensor | None = None,
        teachers: list[str] | None = None,
        teacher_prompts: list[list[int]] | None = None,
        selection: torch.Tensor | None = None,
        teacher_exact: torch.Tensor | None = None,
        end_kinds: torch.Tensor | None = None,
    ) -> None:
        """Record the supervised states of one micro-batch.

        Every per-token tensor has shape `(B, L)` and is aligned with `input_ids`: entry `[b, i]` is about token
        `input_ids[b, i]`, scored from the prefix `input_ids[b, :i]`.

        Args:
            input_ids (`torch.Tensor` of shape `(B, L)`): prompt and answer tokens.
            supervised_mask (`torch.Tensor` of shape `(B, L)`): which tokens the loss supervises.
            logps, entropy (`torch.Tensor` of shape `(B, L)`): the learner's log-prob of each token and the entropy
                of its next-token distribution, as the loss computed them.
            source (`str`, or integer codes into `STATE_SOURCES` of shape `(B,)` or `(B, L)`): state source.
            prefix_len (`torch.Tensor` of shape `(B, L)`, *optional*): tokens since the end of the prompt. Defaults
                to the distance from the sequence's first supervised token, which is the end of the prompt when
                the prompt is the unsupervised part.
            attention_mask (`torch.Tensor` of shape `(B, L)`, *optional*): padding to leave out of the ledger text.
            position_ids (`torch.Tensor` of shape `(B, L)`, *optional*): for packed / padding-free rows, where each
                sequence restarts at position 0.
            teacher_logps (`torch.Tensor` of shape `(B, L)`, *optional*): the teacher's log-prob of each token.
            weights (`float` or `torch.Tensor` of shape `(B,)` or `(B, L)`, *optional*): per-token weight or
                advantage the loss applies; defaults to 1.
            rewards (`torch.Tensor` of shape `(B,)`, *optional*): reward of each row, written to the ledger.
            teachers (`list[str]` of length `B`, *optional*): the teacher of each row (several teachers), one of
                `state_teacher_names`: written to the ledger, and counted per teacher in the step's metrics.
            teacher_prompts (`list[list[int]]` of length `B`, *optional*): the token ids of the prompt each row's
                teacher read, when it is not the student's (a self teacher's privileged prompt), written to the ledger
                with its length over the student's prompt.
            teacher_exact (`torch.Tensor` of shape `(B, L)`, *optional*): from a teacher of another tokenizer, whether
                each token's teacher log-prob is exact (else it is its chunk's, shared out: `teachers/alignment.py`);
                the ledger's sampled sequences list it per supervised token.
            selection (`torch.Tensor` of shape `(B,)`, *optional*): each row's state-selection code
                (`selection.SCORED`, `SKIPPED`, `RECHECKED`); a skipped row's tokens are passed in `supervised_mask`
                to be recorded, and are left out of the supervised-token metrics.
            end_kinds (`torch.Tensor` of shape `(B,)`, *optional*): for sampled completions, how each row's ended (an
                index into `lens.endings.END_KINDS`), judged when it was sampled, against its real limit: the
                ledger's sampled sequences carry it as `end`.
        """
        if self._state_buffer is None:
            return
        if supervised_mask.shape != input_ids.shape or logps.shape != input_ids.shape:
            raise ValueError(
                f"input_ids, supervised_mask and logps must have the same (B, L) shape, got {tuple(input_ids.shape)}, "
                f"{tuple(supervised_mask.shape)} and {tuple(logps.shape)}"
            )
        batch_size, seq_len = input_ids.shape
        device = input_ids.device
        supervised_mask = supervised_mask.bool()
        positions = torch.arange(seq_len, device=device).expand(batch_size, seq_len)

        # Sequence of each position: one per row, or one per run of positions starting at position_ids == 0
        if position_ids is None:
            sequence_in_row = torch.zeros_like(positions)
        else:
            sequence_in_row = ((position_ids == 0).long().cumsum(dim=1) - 1).clamp(min=0)
        sequences_per_row = sequence_in_row[:, -1] + 1
        row_offset = F.pad(sequences_per_row.cumsum(0)[:-1], (1, 0))
        sequence = (sequence_in_row + row_offset[:, None]).flatten()
        num_sequences = int(sequences_per_row.sum())

        flat_supervised = supervised_mask.flatten()
        supervised_sequence = sequence[flat_supervised]
        supervised_position = positions.flatten()[flat_supervised]
        first = torch.full((num_sequences,), seq_len, device=device).scatter_reduce(
            0, supervised_sequence, supervised_position, reduce="amin"
        )
        last = torch.full((num_sequences,), -1, device=device).scatter_reduce(
            0, supervised_sequence, supervised_position, reduce="amax"
        )
        if prefix_len is None:
            token_prefix_len = supervised_position - first[supervised_sequence]
        else:
            token_prefix_len = prefix_len.flatten()[flat_supervised].long()

        if isinstance(source, str):
            token_source = torch.full_like(supervised_position, source_code(source))
        else:
            token_source = _per_row(source, batch_size, seq_len, device, torch.long).flatten()[flat_supervised]
        if teacher_logps is None:
            token_teacher = torch.full(supervised_position.shape, float("nan"), device=device)
        else:
            token_teacher = teacher_logps.detach().float().flatten()[flat_supervised]
        weights = 1.0 if weights is None else weights
        token_weight = _per_row(weights, batch_size, seq_len, device, torch.float32).flatten()[flat_supervised]
        token_teacher_code = None
        if teachers is not None:
            codes = torch.tensor([self.state_teacher_names.index(t) for t in teachers], device=device)
            token_teacher_code = _per_row(codes, batch_size, seq_len, device, torch.long).flatten()[flat_supervised]
        token_selection = None
        if selection is not None:
            token_selection = _per_row(selection, batch_size, seq_len, device, torch.long).flatten()[flat_supervised]

        offset = self._state_sequences_in_step
        records = StateRecords(
            rank=torch.zeros_like(supervised_position),
            sequence=supervised_sequence + offset,
            prefix_len=token_prefix_len,
            source=token_source,
            logp=logps.detach().float().flatten()[flat_supervised],
            entropy=entropy.detach().float().flatten()[flat_supervised],
            teacher_logp=token_teacher,
            weight=token_weight.detach().float(),
            teacher=token_teacher_code,
            selection=token_selection,
        )
        recorded = last >= 0  # sequences with at least one supervised token
        start = torch.full((num_sequences,), seq_len, device=device).scatter_reduce(
            0, sequence, positions.flatten(), reduce="amin"
        )
        row = torch.arange(batch_size, device=device).repeat_interleave(sequences_per_row)
        self._state_buffer.append(
            _MicroBatchStates(
                records=records,
                input_ids=input_ids.detach(),
                attention_mask=None if attention_mask is None else attention_mask.detach(),
                supervised_mask=supervised_mask,
                sequence_row=row[recorded],
                sequence_start=start[recorded],
                sequence_first=first[recorded],
                sequence_last=last[recorded],
                sequence_ids=torch.arange(num_sequences, device=device)[recorded] + offset,
                rewards=None if rewards is None else rewards.detach().float(),
                teachers=teachers,
                teacher_prompts=teacher_prompts,
                selection=None if selection is None else selection.detach(),
                teacher_exact=None if teacher_exact is None else teacher_exact.detach().bool(),
                end_kinds=None if end_kinds is None else end_kinds.detach(),
            )
        )
        self._state_sequences_in_step += num_sequences

    def _step_trace(self) -> dict[str, float]:
        """Settings of the optimizer step that just ended to write beside its records (`steps.jsonl`); none here."""
        return {}

    def _count_teacher_tokens(self, rows: list[list[int]]) -> None:
        """Count the token positions of `rows` (this rank's own: a stand-in row or chunk that only joins the other ranks'
        collectives is never passed) as teacher work of the current optimizer step: the positions it scores (each
        completion it is asked for log-probs of or a distribution over, prompt tokens not counted) or writes (a
        `teacher` state source's rollout, a `continuation`). Training only."""
        if self.step_counts is not None and self.model.training:
            self.step_counts.add(teacher_tokens=sum(len(row) for row in rows))

    def _count_teacher_context(self, teacher_prompts: list[list[int]], student_prompts: list[list[int]]) -> None:
        """Count how many more tokens the teacher's rows hold than the student's (this rank's rows; none unless the
        teacher reads its own prompts, as a self teacher does, or its own tokenization of the prompts and completions,
        as a teacher of another tokenizer does, where it can be fewer: the count is signed): its forward runs over
        them too, which the FLOPs count (`ComputeCounter`) adds to the rollout tokens. Training only."""
        if self.step_counts is not None and self.model.training:
            self.step_counts.add(
                teacher_context_tokens=sum(len(t) - len(s) for t, s in zip(teacher_prompts, student_prompts))
            )

    def _collect_state_records(self, sample_rate: float, seed: int = 0) -> StateRecords:
        """The records of the optimizer step that just ended, from every rank; clears the buffer.

        Each recorded sequence goes to ``samples`` (with its text) with probability ``sample_rate``, drawn from a
        generator seeded with the step and rank, so sampling never touches the training RNG.
        """
        accelerator = self.accelerator
        buffer, self._state_buffer = self._state_buffer or [], []
        self._state_sequences_in_step = 0
        step, rank = self.state.global_step, accelerator.process_index
        generator = torch.Generator().manual_seed(seed + 1_000_003 * step + 7919 * rank)
        parts = []
        for part in buffer:
            records = part.records
            records.rank = torch.full_like(records.sequence, rank)
            chosen = torch.rand(len(part.sequence_ids), generator=generator) < sample_rate
            if chosen.any():
                records.samples = self._sample_sequences(part, chosen.nonzero().flatten().tolist(), step, rank)
            parts.append(records)
        records = StateRecords.cat(parts).gather(accelerator)
        if self.step_counts is not None:
            tokens, context = self.step_counts.take("teacher_tokens", "teacher_context_tokens")
            records.teacher_tokens = sum(collective.gather_counts(accelerator, tokens))
            records.teacher_context_tokens = sum(collective.gather_counts(accelerator, context))
        return records

    def _sample_sequences(self, part: _MicroBatchStates, indices: list[int], step: int, rank: int) -> list[dict]:
        """Ledger entries of the chosen sequences: text and per-token values (a loop over a few sequences only)."""
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        records = part.records
        samples = []
        for index in indices:
            sequence_id = part.sequence_ids[index].item()
            row, start, first, last = (
                t[index].item()
                for t in (part.sequence_row, part.sequence_start, part.sequence_first, part.sequence_last)
            )
            ids = part.input_ids[row]
            keep = (
                torch.ones_like(ids, dtype=torch.bool)
                if part.attention_mask is None
                else part.attention_mask[row].bool()
            )
            prompt_ids = ids[start:first][keep[start:first]]
            completion_ids = ids[first : last + 1][keep[first : last + 1]]
            supervised_ids = ids[first : last + 1][part.supervised_mask[row, first : last + 1]]
            tokens = records.sequence == sequence_id
            teacher = records.teacher_logp[tokens]
            prefix_len = records.prefix_len[tokens].tolist()
            if part.teacher_prompts is not None:
                # The ledger's prompt runs to the first supervised token, past the student's prompt by its prefix_len
                student_prompt_len = len(prompt_ids) - prefix_len[0]
                teacher_prompt = part.teacher_prompts[row]
                teacher_fields = {
                    "teacher_prompt": tokenizer.decode(teacher_prompt),
                    "teacher_context_len": len(teacher_prompt) - student_prompt_len,
                }
            else:
                teacher_fields = {}
            samples.append(
                {
                    "step": step,
                    "rank": rank,
                    "sequence": sequence_id,
                    "source": STATE_SOURCES[records.source[tokens][0].item()],
                    "prompt": tokenizer.decode(prompt_ids),
                    "completion": tokenizer.decode(completion_ids),
                    "reward": None if part.rewards is None else _finite_or_none(part.rewards[row].item()),
                    **({} if part.teachers is None else {"teacher": part.teachers[row]}),
                    **teacher_fields,
                    **({} if part.selection is None else SELECTION_FIELDS[int(part.selection[row])]),
                    "num_supervised": int(tokens.sum()),
                    "tokens": tokenizer.batch_decode(supervised_ids[:, None]),
                    "prefix_len": prefix_len,
                    "logp": records.logp[tokens].tolist(),
                    "entropy": records.entropy[tokens].tolist(),
                    "teacher_logp": None if torch.isnan(teacher).all() else teacher.tolist(),
                    "weight": records.weight[tokens].tolist(),
                    **(
                        {}
                        if part.teacher_exact is None
                        else {
                            "teacher_exact": part.teacher_exact[row, first : last + 1][
                                part.supervised_mask[row, first : last + 1]
                            ].tolist()
                        }
                    ),
                    **self._sample_ending(
                        completion_ids, None if part.end_kinds is None else int(part.end_kinds[row])
                    ),
                }
            )
        return samples


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None
