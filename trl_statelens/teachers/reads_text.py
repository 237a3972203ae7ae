"""What a teacher of another tokenizer does on the trainer's side, in the process or behind a server (issue 45):
[`ReadsText`] reads each row as text in the teacher's tokens (its prompt through the teacher's own chat template, the
student's completion spelled out in bytes and tokenized again, special tokens carried over by role), carries the
teacher's log-probs back onto the student's tokens ([`alignment.student_token_teacher_logprobs`], or token by token
from its byte-prefix masses where its whole distribution is at hand, [`alignment.resolved_logprobs`]; its "ends here"
moved by [`alignment.move_teacher_ends`]) and gives what the teacher writes back in the student's tokens. The
teachers that mix it in are in `cross_tokenizer.py`.
"""

from __future__ import annotations

import bisect
import logging
import re

import torch

from .. import collective
from .alignment import (
    TokenAlignment,
    align_token_ids,
    chunks_resolved,
    move_teacher_ends,
    resolved_logprobs,
    student_token_teacher_logprobs,
)
from .base import RowScores, joined
from .byte_vocab import ByteVocabulary, byte_vocabulary, special_token_map, unmapped_special_message
from .decisions import decision_kinds, decision_table

logger = logging.getLogger(__name__)


def one_byte_tokens(vocab: ByteVocabulary) -> dict[bytes, int]:
    """One token per byte, for bytes that are no whole UTF-8 text (a text cut inside a character): the tokenizer's
    `<0xNN>` token where it has one, else a token that spells that byte alone."""
    byte_ids = {}
    for token_id, spelled in enumerate(vocab.token_bytes):
        if spelled is not None and len(spelled) == 1:
            if spelled not in byte_ids or token_id in vocab.byte_fallback_ids:
                byte_ids[spelled] = token_id
    return byte_ids


def tokenized_bytes(data: bytes, tokenizer, byte_ids: dict[bytes, int], vocab: ByteVocabulary) -> list[int]:
    """`data` as `tokenizer` tokenizes text, each run of bytes that is no whole UTF-8 text as its one-byte tokens.

    The text is read as text only: a special token's string in it (`"<eos>"`) is tokenized as the characters it
    holds, not matched as the special token. A word the tokenizer would not spell back byte for byte (a literal `▁`,
    which a SentencePiece tokenizer reads as a space) is given as its one-byte tokens: the teacher then reads the
    bytes the student wrote, in a spelling its tokenizer would not choose."""
    ids = []
    while data:
        try:
            text, data = data.decode("utf-8"), b""
        except UnicodeDecodeError as error:
            text = data[: error.start].decode("utf-8")
            bad, data = data[error.start : error.end], data[error.end :]
            ids += _text_ids(text, tokenizer, byte_ids, vocab) if text else []
            ids += [byte_ids[bytes([b])] for b in bad]
            continue
        ids += _text_ids(text, tokenizer, byte_ids, vocab)
    return ids


def _tokenized(text: str, tokenizer) -> list[int]:
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def bytes_of(ids: list[int], vocab: ByteVocabulary) -> bytes | None:
    """The bytes `ids` spell, or `None` if one of them spells none (a special token, an id past the tokenizer)."""
    parts = [vocab.token_bytes[i] if i < len(vocab) else None for i in ids]
    return None if None in parts else b"".join(parts)


def _text_ids(text: str, tokenizer, byte_ids: dict[bytes, int], vocab: ByteVocabulary) -> list[int]:
    ids = _tokenized(text, tokenizer)
    if bytes_of(ids, vocab) == text.encode("utf-8"):
        return ids
    ids = []  # word by word (a word with the spaces before it), each word spelled back or given as its bytes
    for word in re.findall(r"\s*\S+|\s+", text):
        word_ids = _tokenized(word, tokenizer)
        data = word.encode("utf-8")
        ids += word_ids if bytes_of(word_ids, vocab) == data else [byte_ids[bytes([b])] for b in data]
    return ids


# Plain text a tokenizer must spell back as it is, and text it reads only through `tokenized_bytes` (a combining
# accent and the OHM SIGN, which a Unicode normaliser rewrites; a literal `▁`; special tokens' strings)
PLAIN_PROBE = "The 12 apples cost $3.50, said Ann."
HARD_PROBE = "e\u0301 5 \u2126 a\u2581b <eos> <|im_end|> x"


def check_spells_text_back(tokenizer, vocab: ByteVocabulary, whose: str) -> None:
    """Refuse a tokenizer whose tokens do not spell plain text back as it was (`whose`: `"the teacher's"` or `"the
    student's"`, for the message): one that adds a space before the text (SentencePiece's `prepend_scheme="first"`,
    the Llama 2 and Mistral v0.1 layout) or lowercases it. Across tokenizers each side reads the other's text in its
    own tokens: a word its tokenizer rewrites is read as its one-byte tokens (`tokenized_bytes`), so that a tokenizer
    rewriting every text would read nothing but bytes. A rarer rewrite (a Unicode normaliser's, a literal `▁`) is read
    that way, word by word; a tokenizer without a one-byte token for some byte cannot, and is refused too."""
    normalizer = tokenizer.backend_tokenizer.normalizer
    pre_tokenizer = tokenizer.backend_tokenizer.pre_tokenizer
    layout = (
        f"normalizer: {type(normalizer).__name__ if normalizer else None}, "
        f"pre-tokenizer: {type(pre_tokenizer).__name__ if pre_tokenizer else None}"
    )
    read = bytes_of(_tokenized(PLAIN_PROBE, tokenizer), vocab)
    if read != PLAIN_PROBE.encode("utf-8"):
        raise ValueError(
            f"{whose} tokenizer ({vocab.name}) does not spell text back: {PLAIN_PROBE!r} becomes {read!r} in its "
            f"tokens ({layout}). Across tokenizers each side reads the other's text in its own tokens, which must "
            "spell the same bytes; a tokenizer that adds a space before the text (SentencePiece's "
            "prepend_scheme='first', Llama 2's layout) or rewrites it cannot. Use another teacher, or remove the "
            "rewriting from the tokenizer and save it with the model (a Metaspace pre-tokenizer's "
            "prepend_scheme='never', no Prepend normalizer)"
        )
    try:
        read = bytes_of(tokenized_bytes(HARD_PROBE.encode("utf-8"), tokenizer, one_byte_tokens(vocab), vocab), vocab)
    except KeyError as error:
        read = f"no one-byte token for {error.args[0]!r}"
    if read != HARD_PROBE.encode("utf-8"):
        raise ValueError(
            f"{whose} tokenizer ({vocab.name}) cannot spell {HARD_PROBE!r} in its tokens ({read!r}; {layout}): a "
            "word it rewrites is read as its one-byte tokens, and it lacks some. Use a byte-level or byte-fallback "
            "tokenizer with a token for every byte"
        )


def refuse_unmapped_ends(student_vocab, teacher_vocab, tokenizer_eos: int | None, end_ids) -> None:
    """Refuse a student end token (`end_ids`: its tokenizer's eos, `tokenizer_eos`, and its generation config's) with
    no counterpart by role among the teacher's: the teacher could not read it, nor stop where the student stops."""
    specials = special_token_map(student_vocab, teacher_vocab)
    for token_id in end_ids:
        if token_id in specials:
            continue
        message = unmapped_special_message(student_vocab, teacher_vocab, token_id)
        if token_id != tokenizer_eos:
            message += (
                ". It is one of the student's end tokens from its generation config (generation_config.eos_token_id): "
                "leave it out of them (set the student's `generation_config.eos_token_id` without it, and save it with "
                "the model or pass the model so changed)"
            )
        raise ValueError(message)


class ReadsText:
    """What a teacher of another tokenizer does on the trainer's side, in-process or served: each row's prompt and
    the student's completion in the teacher's tokens, and the teacher's log-probs carried back onto the student's
    tokens. Set up by `_read_as_text`; the class it is mixed into gives `trainer`."""

    reads_student_ids = False
    crosses_tokenizers = True

    def _read_as_text(self, student_tokenizer, tokenizer) -> None:
        self.tokenizer, self.student_tokenizer = tokenizer, student_tokenizer
        self.student_vocab = byte_vocabulary(student_tokenizer, "the student's")
        self.teacher_vocab = byte_vocabulary(tokenizer)
        check_spells_text_back(student_tokenizer, self.student_vocab, "the student's")
        check_spells_text_back(tokenizer, self.teacher_vocab, "the teacher's")
        self.specials = special_token_map(self.student_vocab, self.teacher_vocab)
        # The student's ids this teacher cannot read (special tokens of no role the teacher has; the trainer keeps the
        # student from sampling them, with the rows of its output layer past its tokenizer)
        self.unreadable_student_ids = [
            i for i, spelled in enumerate(self.student_vocab.token_bytes) if spelled is None and i not in self.specials
        ]
        # which carried values are the teacher's probability of the student's decision (`alignment/per_decision_exact`)
        self.decision_table = decision_table(self.student_vocab, self.teacher_vocab)
        # An in-process teacher moves its "goes on" mass onto every student token whose end the student does not
        # choose (`free_ends`: a digit against whole numbers, and a word the teacher ends with a token that goes on);
        # with one tokenizer on both sides that mass is always 0, and it is not computed
        self.moves_ends = self.student_vocab.token_bytes != self.teacher_vocab.token_bytes
        self._teacher_sorted = None  # the teacher's spellings in order, with their ids: sorted on first use (the ends
        # terms and prefix masses, `ids_starting_with`)
        self._starting_with = {}  # bytes -> ids of the teacher tokens whose bytes start with them
        # per student token, whether it spells a digit: the lens's `alignment/exact/numbers` counts these apart
        self.number_tokens = torch.tensor(
            [
                spelled is not None and any(48 <= byte <= 57 for byte in spelled)
                for spelled in self.student_vocab.token_bytes
            ]
        )
        self.pad_id = next(
            i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None
        )  # rows are padded with the teacher's own ids
        self.byte_ids = one_byte_tokens(self.teacher_vocab)
        self.student_byte_ids = one_byte_tokens(self.student_vocab)
        # What the teacher writes, read back: its special tokens as the student's of the same role, and each of its
        # tokens that stands for a student end token back as that end token (not as another token of a shared role),
        # so that the student's text ends where the teacher's does. The teacher stops at every token that reads back
        # as a student end: where the student would stop. (A student end without a counterpart is refused when the
        # teacher is made.)
        self.student_ends = list(self.trainer.eos_token_ids)
        mapped_ends = [token_id for token_id in self.student_ends if token_id in self.specials]
        self.student_specials = special_token_map(self.teacher_vocab, self.student_vocab)
        self.student_specials.update({self.specials[token_id]: token_id for token_id in reversed(mapped_ends)})
        self.teacher_ends = sorted(
            {self.specials[token_id] for token_id in mapped_ends}
            | {t for t, s in self.student_specials.items() if s in self.student_ends}
        )
        self._unreadable_warned = set()
        self.own_tokens_written = 0  # the tokens it has written, in its own tokens (`student_continuation`)

    def extensions(self, token_id: int) -> torch.Tensor:
        """The teacher tokens whose bytes start with `token_id`'s (itself included; itself only for a special token)."""
        spelled = self.teacher_vocab.token_bytes[token_id]
        return self.ids_starting_with(spelled) if spelled else torch.tensor([token_id])

    def ids_starting_with(self, spelled: bytes) -> torch.Tensor:
        """The teacher tokens whose bytes start with `spelled` (a contiguous run of its spellings in byte order)."""
        if spelled not in self._starting_with:
            if self._teacher_sorted is None:
                order = sorted((s, i) for i, s in enumerate(self.teacher_vocab.token_bytes) if s)
                self._teacher_sorted = ([s for s, _ in order], [i for _, i in order])
            spellings, sorted_ids = self._teacher_sorted
            start = bisect.bisect_left(spellings, spelled)
            end = bisect.bisect_right(spellings, spelled, lo=start, key=lambda s: s[: len(spelled)])
            self._starting_with[spelled] = torch.tensor(sorted_ids[start:end], dtype=torch.long)
        return self._starting_with[spelled]

    def _refuse_unmapped_ends(self, eos_token_ids) -> None:
        refuse_unmapped_ends(
            self.student_vocab, self.teacher_vocab, self.student_tokenizer.eos_token_id, eos_token_ids
        )

    def prompts(self, student_prompts, rows):
        """Each row's prompt in the teacher's tokens: a conversation through the teacher's chat template (with the
        generation prompt), a plain-text prompt tokenized as the teacher's tokenizer tokenizes text; with
        `teacher_reads_student_text`, the student's prompt tokens (`student_prompts`) decoded, markup included, and
        tokenized as text."""
        if self.trainer.args.teacher_reads_student_text:
            texts = [self.student_tokenizer.decode(ids, skip_special_tokens=False) for ids in student_prompts]
            return [self.tokenizer(text)["input_ids"] for text in texts]
        prompts = []
        for row in rows:
            prompt = row["prompt"]
            if isinstance(prompt, list):
                if not self.tokenizer.chat_template:
                    raise ValueError(
                        f"the teacher's tokenizer ({self.tokenizer.name_or_path}) has no chat template, so it cannot "
                        "read a conversational prompt in its own layout: give it one (`tokenizer.chat_template = ...`, "
                        "saved with the teacher) or train on plain-text prompts"
                    )
                prompt = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
                prompts.append(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
            else:
                prompts.append(self.tokenizer(prompt)["input_ids"])
        return prompts

    def respell(self, student_ids: list[int]) -> list[int]:
        """The student's tokens as the teacher's: each run of text tokenized by the teacher, each special token by
        its counterpart of the same role, bytes that are no whole UTF-8 text as the teacher's one-byte tokens."""
        out, text = [], b""
        for token_id in student_ids:
            if token_id >= len(self.student_vocab):
                raise ValueError(
                    f"the student wrote id {token_id}, past its tokenizer's {len(self.student_vocab)} tokens (a "
                    "padding row of its output layer): no text to read"
                )
            spelled = self.student_vocab.token_bytes[token_id]
            if spelled is not None:
                text += spelled
                continue
            out += tokenized_bytes(text, self.tokenizer, self.byte_ids, self.teacher_vocab)
            text = b""
            if token_id not in self.specials:
                raise ValueError(unmapped_special_message(self.student_vocab, self.teacher_vocab, token_id))
            out.append(self.specials[token_id])
        return out + tokenized_bytes(text, self.tokenizer, self.byte_ids, self.teacher_vocab)

    def student_continuation(self, teacher_ids: list[int], max_new_tokens: int) -> list[int]:
        """What the teacher wrote (its new tokens, `teacher_ids`, at most `max_new_tokens` of them) as the student's
        tokens: each run of its text spelled in bytes and tokenized by the student's tokenizer, each special token as
        the student's of the same role, ending after the first student end token. A text the teacher ended is given
        whole, its end token kept, though it may take the student more than `max_new_tokens` tokens (the teacher
        ended within its own); one it did not end is cut to `max_new_tokens` of the student's tokens. A token with no
        student counterpart (a special token of no role the student has, an id the teacher's tokenizer has no token
        at) ends the text before it, with a warning: the student cannot read it, and what follows was written after
        it. (An in-process teacher is kept from writing those; a served one is not.) The teacher's own tokens read
        up to there (what it wrote: the padding after its end left out) are added to `own_tokens_written`."""
        out, text, vocab = [], b"", self.teacher_vocab.token_bytes
        read = 0
        for token_id in teacher_ids:
            read += 1
            spelled = vocab[token_id] if token_id < len(vocab) else None
            if spelled is not None:
                text += spelled
                continue
            if token_id not in self.student_specials:
                self._warn_unreadable(token_id)
                break
            out += tokenized_bytes(text, self.student_tokenizer, self.student_byte_ids, self.student_vocab)
            text = b""
            out.append(self.student_specials[token_id])
            if out[-1] in self.student_ends:
                self.own_tokens_written += read
                return out
        self.own_tokens_written += read
        return (out + tokenized_bytes(text, self.student_tokenizer, self.student_byte_ids, self.student_vocab))[
            :max_new_tokens
        ]

    def _warn_unreadable(self, token_id: int) -> None:
        if token_id in self._unreadable_warned:
            return
        self._unreadable_warned.add(token_id)
        name = self.teacher_vocab.special_contents.get(token_id, "no token of its tokenizer")
        logger.warning(
            "The teacher of another tokenizer wrote id %d (%r), which has no counterpart among the student's tokens: "
            "its text ends before it (said once per id).",
            token_id,
            name,
        )

    def _teacher_sequences(self, prompts, prefixes) -> list[list[int]]:
        """Each teacher prompt followed by the student's prefix, if any, in the teacher's tokens."""
        return joined(prompts, None if prefixes is None else [self.respell(prefix) for prefix in prefixes])

    def _carry(
        self,
        completions,
        teacher_completions,
        scores: list[RowScores],
        end_logmass=None,
        whole_terms=None,
        inner_logmass=None,
        alignments=None,
    ) -> list[RowScores]:
        """The teacher's log-probs of its own tokens (`scores`, one row per completion) on the student's tokens, with
        each token's `signal`; with `end_logmass` (one `(n_teacher,)` row per completion), each teacher token's "ends
        here" moved where the student says it ([`move_teacher_ends`]). `whole_terms` (rows alike, `None`: all whole):
        per teacher token, whether its term holds every longer token (a served teacher's holds those among its
        top-k only); a value moved with a partial term is not the decision's. `inner_logmass` (rows alike, `None`:
        chunks are not resolved): the prefix masses of each row's [`alignment.inner_prefixes`], its chunks resolved
        token by token. `alignments`: the rows' alignments where they were made already."""
        carried = []
        for i, (student_ids, teacher_ids, row) in enumerate(
            zip(completions, teacher_completions, scores, strict=True)
        ):
            alignment = (
                alignments[i]
                if alignments is not None
                else align_token_ids(student_ids, teacher_ids, self.student_vocab, self.teacher_vocab)
            )
            moved = None if end_logmass is None else end_logmass[i]
            inner = None if inner_logmass is None else inner_logmass[i]
            if inner is not None:
                alignment = chunks_resolved(alignment)
            values, signal = self._carried_row(alignment, student_ids, row.logps, moved, inner)
            whole = None if whole_terms is None else whole_terms[i]
            decision = self._decisions(alignment, student_ids, teacher_ids, moved is not None, whole)
            carried.append(RowScores(values, signal=signal, decision=decision))
        return carried

    def _decisions(
        self, alignment: TokenAlignment, student_ids, teacher_ids, ends_moved: bool, whole_terms=None
    ) -> torch.Tensor:
        """Per student token, whether its carried value is the teacher's probability of the student's decision
        ([`decisions.decision_kinds`]; `ends_moved`: whether `move_teacher_ends` ran on the row, `whole_terms` as in
        `_carry`)."""
        moved = self.decision_table.free_ends if ends_moved else None
        return decision_kinds(alignment, student_ids, teacher_ids, self.decision_table, moved, whole_terms)

    def _carried_row(
        self, alignment: TokenAlignment, student_ids, teacher_logps, end_logmass=None, inner_logmass=None
    ):
        """One row of `_carry`, its alignment made (its chunks resolved where `inner_logmass` is given): `(values,
        signal)` on the student's tokens."""
        if inner_logmass is None:
            values, signal = student_token_teacher_logprobs(alignment, teacher_logps.float().cpu())
        else:
            values, signal = resolved_logprobs(alignment, teacher_logps.float().cpu(), inner_logmass), alignment.signal
        if end_logmass is not None:
            values = move_teacher_ends(alignment, values, student_ids, self.decision_table.free_ends, end_logmass)
        return values, signal

    def _read_on_every_rank(self, read):
        """`read()`, the row-dependent part of a call every rank makes as often as the others (respelling the rows, their
        alignment): when it fails on any rank (a row the teacher cannot read), every rank raises, its own error where
        it failed, so that none is left waiting for it in a collective."""
        answer, error = None, None
        try:
            answer = read()
        except (ValueError, KeyError, IndexError) as raised:
            error = raised
        what = "a row could not be read in the teacher's tokens"
        collective.raise_together(self.trainer.accelerator, error, what, ValueError)
        return answer

    def _respelled(self, completions) -> list[list[int]]:
        teacher_completions = [self.respell([int(t) for t in c]) for c in completions]
        # Its forward runs over its own spelling of the completions: the FLOPs count the difference as its context
        self.trainer._count_teacher_context(teacher_completions, completions)
        return teacher_completions
