"""A teacher of another tokenizer (issue 45): in the training processes [`CrossTokenizerTeacher`], behind a vLLM
server [`ServedCrossTokenizerTeacher`]; both read the rows as text ([`ReadsText`], `reads_text.py`).

The teacher reads each row as text in its own tokens: the prompt rendered by its own chat template (a plain-text
prompt tokenized as it is), the student's completion spelled out in bytes and tokenized again, its special tokens
(end of turn, end of text) carried over by role. Its log-probs come back on the student's tokens through
[`alignment.student_token_teacher_logprobs`]: exact where a student token starts and ends on teacher boundaries, and
for a chunk (the smallest run of student tokens that does) the teacher's log-prob of the whole run on the run's last
token, with `RowScores.signal` saying which. The `reverse_kl` loss (`opd/loss.py`) compares the student's log-prob of
each chunk with the teacher's and gives every token of the chunk the chunk's advantage.

The teacher writes in its own tokens (`signal="continuation"`, and `teacher` states in `state_source_mix`): it
reads its own prompt and the student's prefix respelled, stops at its tokens that stand for the student's end tokens,
and its text is tokenized again for the student, special tokens carried back by role
([`ReadsText.student_continuation`]).

`divergence`, in-process only ([`CrossTokenizerTeacher.divergence_loss`]): at each supervised student position that
starts on a boundary both tokenizations share, the teacher's next-token distribution (one forward over its own tokens)
carried onto the student's vocabulary by [`alignment.map_next_token_distribution`] (with the text going on inside
the teacher's previous token, where the student's previous token ends freely); at a position inside a teacher token,
the rest of the teacher's tokens that start with the part written; both compared with the student's by
[`heads.mapped_jsd`]. A served teacher answers top-k
log-probs, not the full distribution the mapping needs: refused. Several routed teachers may include such teachers
([`TeacherRouter`]: each row is read in its own teacher's tokens).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from .. import collective, heads
from ..heads import Divergence, _student_log_probs, mapped_jsd
from .alignment import (
    MappedDistribution,
    NextTokenMap,
    TokenAlignment,
    align_token_ids,
    chunks_resolved,
    first_student_token,
    inner_prefixes,
    map_next_token_distribution,
    next_token_map,
    starts_inside,
    written_student_tokens,
)
from .base import RowScores, answered, batch_rows
from .cross_tokenizer_checks import refuse_unsupported
from .in_process import InProcessTeacher, prepare_teacher_model, stand_in_chunk
from .reads_text import ReadsText
from .vocabulary import model_path, read_tokenizer, token_id_mismatch, vocab_size

# Generation settings whose values are token ids (of the student's tokenizer, in the trainer's settings)
ID_SETTINGS = (
    "bad_words_ids",
    "force_words_ids",
    "sequence_bias",
    "suppress_tokens",
    "begin_suppress_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "bos_token_id",
)


def teacher_in_process(trainer, model, path: str | None) -> InProcessTeacher:
    """The in-process teacher for `model` (loaded from `path`; an instance's tokenizer is read from where it was
    loaded, its `name_or_path`): a [`CrossTokenizerTeacher`] when that tokenizer maps tokens to ids otherwise than the
    student's, else an [`InProcessTeacher`] (which refuses a teacher whose tokenizer was not read and whose output
    layer clearly differs from the student's: `check_same_vocabulary`)."""
    path = path or model_path(model)
    teacher_tokenizer = read_tokenizer(path)
    if teacher_tokenizer is None or token_id_mismatch(trainer._tokenizer, teacher_tokenizer, path) is None:
        return InProcessTeacher.prepared(trainer, model, path)
    return CrossTokenizerTeacher.prepared(trainer, model, teacher_tokenizer)


class TextReading(NamedTuple):
    """A row as a [`CrossTokenizerTeacher`] reads it for the `divergence` loss, made when the batch is scored: its
    prompt and its spelling of the student's completion in the teacher's tokens, and how that spelling aligns with the
    student's tokens. Its `signal` and `decision` are read as a [`RowScores`]' are (`resolved_signal`)."""

    prompt: list[int]
    completion: list[int]
    alignment: TokenAlignment
    decision: torch.Tensor

    @property
    def signal(self) -> torch.Tensor:
        return self.alignment.signal


class CrossTokenizerTeacher(ReadsText, InProcessTeacher):
    """An in-process teacher whose tokenizer differs from the student's (see the module docstring).

    Args:
        trainer: the [`OnPolicyDistillTrainer`] it serves.
        model: the teacher, prepared as an [`InProcessTeacher`]'s is (without the same-vocabulary check).
        tokenizer: the teacher's tokenizer (a fast one that spells every text in bytes: byte-level BPE, or
            SentencePiece with byte fallback).
    """

    def __init__(self, trainer, model, tokenizer):
        InProcessTeacher.__init__(self, trainer, model)
        self._read_as_text(trainer._tokenizer, tokenizer)
        # What it is kept from writing, as a same-tokenizer teacher is kept from its padding ids: the ids the student
        # could not read (rows of its output layer its tokenizer has no token at, special tokens of no role the
        # student has); its distribution is renormalised over the rest
        spelled = self.teacher_vocab.token_bytes
        self.unreadable = [
            i
            for i in range(vocab_size(self.model))
            if (i >= len(spelled) or spelled[i] is None) and i not in self.student_specials
        ]
        self._next_token_map = None  # built on the first `divergence` step (`_mapping`)
        self._student_written = None  # the student token written for each spelling (`_going_on`)
        self._going_on_from = {}  # bytes -> the teacher tokens starting with them and going on (`_going_on`)

    @classmethod
    def prepared(cls, trainer, model, tokenizer) -> CrossTokenizerTeacher:
        """Checked before any model work (`refuse_unsupported`, again: a teacher given as a path was checked before it
        loaded, by `check_before_loading`), then made; the student's end-of-sequence tokens, generation config's
        included, must have counterparts by role."""
        refuse_unsupported(trainer.args, getattr(tokenizer, "name_or_path", "the teacher's"))
        teacher = cls(trainer, prepare_teacher_model(trainer, model, same_vocabulary=False), tokenizer)
        teacher._refuse_unmapped_ends(trainer.eos_token_ids)
        return teacher

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, prefixes=None, teachers=None):
        """The teacher's continuation after its own prompt (`prompts` are the teacher's, from `prompts`) and each
        student prefix, if any, respelled in its tokens; written in its tokens with its own padding, ending at its
        tokens that stand for the student's ends, and given back in the student's ([`student_continuation`]). One
        call on every rank while any rank has rows, as [`InProcessTeacher.generate`] (collective under ZeRO-3)."""
        # Only the continuation is tokenized for the student: the prefix's own tokens are the states supervised, and
        # tokenizing prefix and continuation together could merge tokens across the cut and change them
        # Respelled on every rank before the collective generation: a prefix that cannot be read raises on all
        sequences = self._read_on_every_rank(lambda: self._teacher_sequences(prompts, prefixes))
        written = self._written(sequences, max_new_tokens, self.pad_id, self.teacher_ends, self.unreadable)
        return [self.student_continuation(row, max_new_tokens) for row in written]

    def _generation_config(self):
        """The trainer's sampling settings, less those that name token ids (`generation_kwargs` such as
        `bad_words_ids`): they name the student's ids, which mean other text to this teacher. Its own padding, ends and
        the ids it is kept from writing are set by `generate`."""
        config = super()._generation_config()
        for name in ID_SETTINGS:
            setattr(config, name, None)
        return config

    @torch.no_grad()
    def score(self, prompts, completions, distribution=False, teachers=None):
        """The teacher's log-probs of its own spelling of each completion after its own prompt (`prompts` are the
        teacher's, from `prompts`), carried onto the student's tokens with each token's `signal`.

        With `distribution=True` (the `divergence` signal) no forward runs: each row's [`TextReading`], whose
        distributions `divergence_loss` computes and carries over within the loss."""
        # Respelled (and, for `divergence`, aligned) on every rank before any forward: a row that cannot be read
        # raises on all of them
        teacher_completions = self._read_on_every_rank(lambda: self._respelled(completions))
        if distribution:
            readings = self._read_on_every_rank(
                lambda: [
                    self._reading(prompt, ids, teacher_ids)
                    for prompt, ids, teacher_ids in zip(prompts, completions, teacher_completions, strict=True)
                ]
            )
            return batch_rows(answered(readings), len(readings))
        if not self.moves_ends:
            scores = self._score_rows(prompts, teacher_completions)
            return batch_rows(answered(self._carry(completions, teacher_completions, scores)), len(scores))
        alignments = self._read_on_every_rank(
            lambda: [
                align_token_ids(ids, teacher_ids, self.student_vocab, self.teacher_vocab)
                for ids, teacher_ids in zip(completions, teacher_completions, strict=True)
            ]
        )
        scores, end_logmass, inner_logmass = [], [], []
        for i, logps in self._completion_log_probs(prompts, teacher_completions, self.trainer.temperature):
            token_logps, moved, inner = self._carried_terms(logps.cpu(), teacher_completions[i], alignments[i])
            scores.append(RowScores(token_logps))
            end_logmass.append(moved)
            inner_logmass.append(inner)
        carried = self._carry(
            completions, teacher_completions, scores, end_logmass, inner_logmass=inner_logmass, alignments=alignments
        )
        return batch_rows(answered(carried), len(carried))

    def _reading(self, prompt, student_ids, teacher_ids) -> TextReading:
        alignment = align_token_ids(student_ids, teacher_ids, self.student_vocab, self.teacher_vocab)
        if self.moves_ends:  # its chunks are resolved as `score` resolves them
            alignment = chunks_resolved(alignment)
        decision = self._decisions(alignment, student_ids, teacher_ids, ends_moved=self.moves_ends)
        return TextReading(prompt, teacher_ids, alignment, decision)

    def _carried_terms(self, logps, tokens, alignment: TokenAlignment):
        """From one row's full log-probs `(n, V)` at the run's temperature (one forward over the whole vocabulary, in
        the agreed chunks of `_completion_log_probs`), what `_carry` needs for a pair of tokenizers that differ
        (`moves_ends`): each teacher token's log-prob and its ends term (`_token_logps_and_end_logmass`), and the
        log-prob of a token starting with each of [`inner_prefixes`]' parts at its position: the chunk resolved token
        by token."""
        token_logps, moved = self._token_logps_and_end_logmass(logps, tokens)
        inner = [
            logps[j, ids[ids < logps.size(-1)].to(logps.device)].logsumexp(0)
            for j, part in inner_prefixes(alignment, tokens, self.teacher_vocab)
            for ids in (self.ids_starting_with(part),)
        ]
        return token_logps, moved, torch.stack(inner).cpu() if inner else torch.zeros(0)

    def _completion_log_probs(self, prompts, teacher_completions, temperature: float):
        """Yields `(i, log-probs (n_i, V))` for each row `i` of this rank: the teacher's next-token log-probs over its
        whole vocabulary at each position of its completion, at `temperature`, from one forward per agreed
        chunk of rows (collective under ZeRO-3: every rank runs as many, those past its rows on a stand-in whose
        answer is dropped, [`InProcessTeacher._scoring_batch`]). Iterated to the end on every rank, rows or none."""
        batch = self._scoring_batch(prompts, teacher_completions)
        if batch is None:
            return
        input_ids, attention_mask, width, chunks, _ = batch
        for chunk in chunks:
            stand_in = chunk.start >= len(prompts)
            rows = stand_in_chunk(chunk, input_ids)
            with torch.no_grad():
                logits = self.model(
                    input_ids=input_ids[rows], attention_mask=attention_mask[rows], logits_to_keep=width + 1
                ).logits
            if stand_in:
                continue
            logps = (logits[:, :-1].float() / temperature).log_softmax(-1)
            for offset in range(logps.size(0)):
                i = rows.start + offset
                yield i, logps[offset, : len(teacher_completions[i])]

    def _token_logps_and_end_logmass(self, logps, tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """From one row's full log-probs `(n, V)` and its teacher tokens: each token's log-prob, and its term of
        `move_teacher_ends` (the log-prob of any token starting with its bytes, less its own; 0 where none longer
        does), both `(n,)` on the CPU."""
        positions = torch.arange(len(tokens), device=logps.device)
        values = logps[positions, torch.tensor(tokens, dtype=torch.long, device=logps.device)]
        moved = torch.zeros(len(tokens), device=logps.device)
        for j, token_id in enumerate(tokens):
            longer = self.extensions(token_id)
            longer = longer[longer < logps.size(-1)]  # a tokenizer's ids past the model's rows have no log-prob
            if len(longer) > 1:
                moved[j] = logps[j, longer.to(logps.device)].logsumexp(0) - values[j]
        return values.cpu(), moved.cpu()

    def _full_width(self, logps: torch.Tensor) -> torch.Tensor:
        """Probabilities from the teacher's log-probs `(n, rows)`, one per id of its tokenizer at least: the ids past
        the model's rows (Gemma 3's `<image_soft_token>`, at its 262,144) carry none."""
        missing = len(self.teacher_vocab) - logps.size(-1)
        return torch.nn.functional.pad(logps.exp(), (0, max(missing, 0)))

    def _mapping(self, device) -> NextTokenMap:
        """This pair's [`NextTokenMap`], built on first use (about a second for a Gemma 3 teacher and a SmolLM2
        student) and kept on `device`."""
        if self._next_token_map is None:
            table = next_token_map(self.teacher_vocab, self.student_vocab)
            tables = ("student_of_teacher", "prefix_pairs", "proper_prefix_pairs")
            self._next_token_map = dataclasses.replace(
                table, **{name: getattr(table, name).to(device) for name in tables}
            )
        return self._next_token_map

    def _going_on(self, spelled: bytes, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The teacher tokens (below the model's `rows`) whose bytes start with `spelled`; whether each goes on past
        it; and for each the student token its remaining bytes start with (-1: none, or it does not go on). Kept."""
        if spelled not in self._going_on_from:
            if self._student_written is None:
                self._student_written = written_student_tokens(self.student_vocab)
            ids = self.ids_starting_with(spelled)
            ids = ids[ids < rows]
            rests = [self.teacher_vocab.token_bytes[i][len(spelled) :] for i in ids.tolist()]
            receivers = [first_student_token(rest, self._student_written) if rest else -1 for rest in rests]
            longer = torch.tensor([bool(rest) for rest in rests], dtype=torch.bool)
            self._going_on_from[spelled] = (ids, longer, torch.tensor(receivers, dtype=torch.long))
        return self._going_on_from[spelled]

    def _carried_on(self, logps, spelled: bytes, ended: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """At one teacher decision (its log-probs `(V,)`), the text going on past `spelled` inside a token that
        starts with it: each longer token's probability on the student token its remaining bytes start with, over
        the mass of `ended` and the longer tokens (`ended` `None`: every token starting with `spelled`). Returns that
        `(V_s,)`, the part of it that reaches no student token, and their total (the share that goes on)."""
        ids, longer, receivers = self._going_on(spelled, logps.size(-1))
        probs = logps[ids.to(logps.device)].exp()
        going = probs.masked_fill(~longer.to(probs.device), 0.0)
        whole = probs.sum() if ended is None else logps[ended].exp() + going.sum()
        whole = whole.clamp_min(torch.finfo(whole.dtype).tiny)  # (all of it underflowed: nothing goes on, no NaN)
        reached = receivers >= 0
        carried = going.new_zeros(len(self.student_vocab))
        carried.index_add_(0, receivers[reached].to(going.device), going[reached.to(going.device)] / whole)
        share = going.sum() / whole
        return carried, share - carried.sum(), share

    def _ends_carried_forward(
        self, carried: MappedDistribution, logps, teacher_ids, student_ids, student_at, teacher_at
    ) -> MappedDistribution:
        """The ends defect of `divergence` removed (docs/cross-tokenizer.md). `carried` holds the teacher's next-token
        distributions at synchronised positions (`student_at`, `teacher_at`), each conditioned on the teacher's
        previous token `u` having ended there. Where the student's previous token ends freely
        (`DecisionTable.free_ends`: a digit, against a teacher that writes `51`), the student's next token must also
        hold the text going on inside a longer teacher token: at `u`'s decision (`logps` `(n, V)`), each longer token's
        probability, over that of `u` and all of them, goes to the student token its remaining bytes start with (or
        to the leftover), and the distribution after `u` is weighted by what is left (`u`'s share). As
        `move_teacher_ends` does for a token's log-prob, and nothing moves where no teacher token goes on from `u`."""
        probs, leftover = carried.student_probs.clone(), carried.leftover.clone()
        free = self.decision_table.free_ends
        for row, (s, t) in enumerate(zip(student_at, teacher_at, strict=True)):
            if s == 0 or t == 0 or not free[int(student_ids[s - 1])]:  # (the prompt's last decision is not at hand)
                continue
            ended = int(teacher_ids[t - 1])
            spelled = self.teacher_vocab.token_bytes[ended]
            if spelled is None:
                continue
            going, unread, share = self._carried_on(logps[t - 1], spelled, ended)
            probs[row] = probs[row] * (1 - share) + going.to(probs.dtype)
            leftover[row] = leftover[row] * (1 - share) + unread
        return MappedDistribution(probs, leftover)

    def _carried_inside(self, logps, inside) -> MappedDistribution:
        """At each student position that starts inside a teacher token (`inside`: [`starts_inside`]' entries), the
        teacher's distribution of the rest of its token: at that token's decision (`logps` `(n, V)`), each token
        starting with the part written so far and going on past it, on the student token its rest starts with, over
        every token starting with that part. The mass of the tokens that end with the part (the teacher's token ends
        there: what follows it is another decision, not at hand) is left over, with the rest that reaches no student
        token: the loss compares the student with it over the tokens it reaches (which digit, inside a number)."""
        rows = [self._carried_on(logps[j], part, None) for _, j, part in inside]
        probs = torch.stack([going for going, _, _ in rows])
        leftover = torch.stack([unread + 1 - share for _, unread, share in rows])
        return MappedDistribution(probs, leftover)

    def divergence_loss(self, student, student_hidden, batch, loss_mask, normalizer, beta, temperature):
        """The generalised JSD with `beta` at every supervised position, against the teacher's distribution carried
        onto the student's vocabulary from one forward over its own tokens of the row ([`TextReading`], made by
        `score`): where the student's token starts on a boundary both tokenizations share
        (`TokenAlignment.synchronised`), its next-token distribution ([`map_next_token_distribution`],
        `_ends_carried_forward`); inside a teacher token, the rest of its tokens that start with the part written
        (`_carried_inside`). Compared with the student's at the run's temperature ([`heads.mapped_jsd`]: over the
        student tokens it reaches, both renormalised there); `leftover` is NaN at the positions not supervised. Summed
        and divided by `normalizer`, as the same-tokenizer loss.

        Also each token's teacher log-prob carried as `score` carries it (ends moved), for the metrics and records;
        the student's own per-token values are left to the trainer (`logps` `None`). The teacher's forwards run in
        agreed chunks of rows, the student's output layer in agreed chunks of positions, at least one: every rank
        makes as many calls, rows or none (collective under ZeRO-3). The teacher cache keeps nothing of these
        forwards: a reused batch runs them again."""
        readings = [row.scores.result()[row.index] for row in batch["teacher_scores"] or []]
        completion_ids = batch["completion_ids"]
        device = student_hidden.device
        teacher_logps = torch.zeros(completion_ids.shape, dtype=torch.float32, device=device)
        leftover = torch.full(completion_ids.shape, float("nan"), device=device)
        positions, mapped = [], []
        prompts, teacher_completions = [r.prompt for r in readings], [r.completion for r in readings]
        for i, logps in self._completion_log_probs(prompts, teacher_completions, temperature):
            alignment = readings[i].alignment
            student_ids = completion_ids[i, : len(alignment.signal)].tolist()
            if self.moves_ends:
                token_logps, moved, inner = self._carried_terms(logps, teacher_completions[i], alignment)
                values, _ = self._carried_row(alignment, student_ids, token_logps, moved, inner)
            else:
                token_logps, _ = self._token_logps_and_end_logmass(logps, teacher_completions[i])
                values, _ = self._carried_row(alignment, student_ids, token_logps)
            teacher_logps[i, : len(values)] = values.to(device)
            student_at, teacher_at = alignment.synchronised.T.to(device)
            supervised = loss_mask[i, student_at] != 0
            student_at, teacher_at = student_at[supervised], teacher_at[supervised]
            if len(student_at):
                carried = map_next_token_distribution(self._mapping(logps.device), self._full_width(logps[teacher_at]))
                carried = self._ends_carried_forward(
                    carried, logps, teacher_completions[i], student_ids, student_at.tolist(), teacher_at.tolist()
                )
                leftover[i, student_at] = carried.leftover.to(device)
                positions += [(i, s) for s in student_at.tolist()]
                mapped.append(carried.student_probs)
            inside = [
                entry
                for entry in starts_inside(alignment, teacher_completions[i], self.teacher_vocab)
                if loss_mask[i, entry[0]] != 0
            ]
            if inside:
                carried = self._carried_inside(logps, inside)
                at = torch.tensor([k for k, _, _ in inside], device=device)
                leftover[i, at] = carried.leftover.to(device)
                positions += [(i, k) for k, _, _ in inside]
                mapped.append(carried.student_probs)
        rows, at = torch.tensor(positions, dtype=torch.long, device=device).reshape(-1, 2).T
        hidden = student_hidden[rows, at]
        teacher_probs = torch.cat(mapped).to(device) if mapped else hidden.new_zeros(0, len(self.student_vocab))
        # The student's output layer once per chunk of positions, as many on every rank and at least one, so that it
        # is used everywhere (as DDP requires of an untied head) even where this rank maps nothing
        chunks = collective.agreed_chunks(self.trainer.accelerator, len(rows), heads.POSITION_CHUNK) or [slice(0, 0)]
        losses = [
            mapped_jsd(_student_log_probs(student, hidden[c], temperature), teacher_probs[c], beta) for c in chunks
        ]
        loss = torch.cat(losses).sum()
        if isinstance(normalizer, torch.Tensor):
            normalizer = normalizer.to(loss.device)
        return Divergence(loss / normalizer, teacher_logps, leftover=leftover)
