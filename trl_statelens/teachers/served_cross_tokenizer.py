"""A teacher of another tokenizer behind a vLLM server (issue 45, [`ServedCrossTokenizerTeacher`]): it reads the rows
as text like the in-process [`CrossTokenizerTeacher`] (`cross_tokenizer.py`, whose docstring says how), the server
scores the teacher's own tokens, and the answers are carried back onto the student's tokens on the training side. Its
"ends here" is moved from the server's top-k log-probs per position (docs/cross-tokenizer.md, "A served teacher").
"""

from __future__ import annotations

import logging

import torch

from .base import RowScores, answered, batch_rows
from .cross_tokenizer_checks import refuse_unsupported
from .reads_text import ReadsText
from .served import ServedTeacher
from .server_client import TeacherServerClient
from .vocabulary import read_tokenizer, token_id_mismatch

logger = logging.getLogger(__name__)

# The top-k per position at which a served teacher's moved ends (`ServedCrossTokenizerTeacher`) kept the carried
# log-probs within ENDS_MEAN_ERROR nats of the in-process teacher's, on average, on the lab pair with a teacher trained
# on math text (`bench/bench_served_ends.py`, BENCHMARKS.md 5.7; a flat, untrained teacher needs its whole
# vocabulary): below it, `connect` warns
ENDS_TOP_K = 32
ENDS_MEAN_ERROR = 0.01


def served_teacher(trainer, path: str | None, url: str | None = None) -> ServedTeacher:
    """The teacher served at `url` (default: `teacher_model_server_url`): a [`ServedCrossTokenizerTeacher`] when the
    tokenizer saved at `path` maps tokens to ids otherwise than the student's, else a [`ServedTeacher`] (whose client
    compares the server's own tokenization with the student's: `TeacherServerClient`)."""
    teacher_tokenizer = read_tokenizer(path)
    if teacher_tokenizer is None or token_id_mismatch(trainer._tokenizer, teacher_tokenizer, path) is None:
        return ServedTeacher.connect(trainer, path, url)
    return ServedCrossTokenizerTeacher.connect(trainer, teacher_tokenizer, url)


class ServedCrossTokenizerTeacher(ReadsText, ServedTeacher):
    """A teacher of another tokenizer behind a vLLM server (see the module docstring): the server reads the teacher's
    tokens, and the log-probs it answers are carried back on the training side, in the background worker when
    `teacher_server_overlap` is on. The teacher's path (its tokenizer) is needed: the server's own is not read.

    Args:
        trainer: the [`OnPolicyDistillTrainer`] it serves.
        server ([`TeacherServerClient`]): the checked client, speaking the teacher's ids.
        tokenizer: the teacher's tokenizer, as for [`CrossTokenizerTeacher`].
        **served: [`ServedTeacher`]'s other arguments.
    """

    def __init__(self, trainer, server, tokenizer, top_k: int = 0, **served):
        ServedTeacher.__init__(self, server, **served)
        self.trainer = trainer
        self._read_as_text(trainer._tokenizer, tokenizer)
        # The top-k log-probs per position that move the teacher's "ends here" (`_end_logmass_in_top_k`): none where
        # nothing moves (one spelling of every token on both sides)
        self.top_k = top_k if self.moves_ends else 0

    @classmethod
    def connect(cls, trainer, tokenizer, url: str | None = None) -> ServedCrossTokenizerTeacher:
        """The server at `url` (default: `teacher_model_server_url`) checked against the teacher's `tokenizer` (its
        largest id scored, with as many top log-probs as scoring will ask for), after the settings and the end tokens'
        roles. Warns where `teacher_top_k` is below what kept the moved ends' error small on the lab
        (`ENDS_TOP_K`)."""
        args = trainer.args
        refuse_unsupported(args, tokenizer.name_or_path, served=True)
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        teacher = cls(
            trainer,
            None,  # the client, made below: its start-up probe asks for as many log-probs as the pair needs
            tokenizer,
            top_k=args.teacher_top_k,
            sampling={name: getattr(trainer, name) for name in names},
            eos_token_ids=trainer.eos_token_ids,
            seed_generator=trainer._source_generator,
            accelerator=trainer.accelerator,
            overlap=args.teacher_server_overlap,
        )
        teacher._refuse_unmapped_ends(trainer.eos_token_ids)
        # Checked up to its largest id that spells text: a special token past the model's rows (Gemma 3's
        # `<image_soft_token>`, at its 262,144) is never sent to it
        specials = {token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special}
        scored_ids = max(token_id for token_id in tokenizer.get_vocab().values() if token_id not in specials) + 1
        if teacher.top_k > scored_ids:
            raise ValueError(
                f"teacher_top_k={teacher.top_k} is more than the teacher's vocabulary ({scored_ids} ids that spell "
                f"text): set it to at most {scored_ids} (that many moves every end exactly)"
            )
        teacher.server = TeacherServerClient(
            url or args.teacher_model_server_url,
            tokenizer,
            scored_ids,
            timeout=args.teacher_server_timeout,
            max_retries=args.teacher_server_max_retries,
            retry_backoff=args.teacher_server_retry_backoff,
            chunk_size=args.teacher_server_chunk_size,
            top_k=teacher.top_k,
        )
        if teacher.moves_ends and teacher.top_k < ENDS_TOP_K:
            logger.warning(
                "teacher_top_k=%d: a served teacher of another tokenizer moves its 'ends here' off the student's "
                "tokens whose end only its longer tokens can say (a digit against whole numbers) with the mass of "
                "those longer tokens among its top-k log-probs per position; %s. On the lab pair, with a teacher trained "
                "on math text, teacher_top_k >= %d kept the carried log-probs within %.2f nats of the same teacher's "
                "in the process on average, and a flatter teacher needs more (docs/cross-tokenizer.md): set "
                "teacher_top_k=%d or more (above 20 the server needs --max-logprobs).",
                teacher.top_k,
                "with 0 nothing moves, and each such token keeps the teacher's 'ends here'"
                if teacher.top_k == 0
                else "fewer leave more of it out",
                ENDS_TOP_K,
                ENDS_MEAN_ERROR,
                ENDS_TOP_K,
            )
        return teacher

    def generate(self, prompts, max_new_tokens, prefixes=None, teachers=None):
        """As [`CrossTokenizerTeacher.generate`], from the server: its continuations stop at the teacher's tokens that
        stand for the student's ends and are given back in the student's tokens ([`student_continuation`]; the
        server is not kept from writing a token the student cannot read: the text ends before it)."""

        def written():
            sequences = self._teacher_sequences(prompts, prefixes)
            rows = self._continuations(sequences, max_new_tokens, self.teacher_ends)
            # (only the continuation is tokenized for the student, as in the process)
            return [self.student_continuation(row, max_new_tokens) for row in rows]

        # Asked on every rank, rows or none: a failed request, or a prefix that cannot be respelled, raises on all
        return self._on_every_rank(written)

    def score(self, prompts, completions, distribution=False, teachers=None):
        """As [`ServedTeacher.score`], on the teacher's spelling of the completions after its own prompts, carried
        back onto the student's tokens."""
        # Respelled on every rank, rows or none: a row that cannot be read raises on all of them
        teacher_completions = self._read_on_every_rank(lambda: self._respelled(completions))
        sequences = [p + c for p, c in zip(prompts, teacher_completions)]
        lengths = [len(p) for p in prompts]

        def carried():
            scores = self._scores(sequences, lengths, self.top_k)
            if not self.top_k:
                return self._carry(completions, teacher_completions, scores)
            terms = [self._end_logmass_in_top_k(row, ids) for row, ids in zip(scores, teacher_completions)]
            moved, whole = [t for t, _ in terms], [w for _, w in terms]
            return self._carry(completions, teacher_completions, scores, moved, whole)

        if self._requests is None:  # at once, asked on every rank, rows or none: a failure raises on all of them
            scores = self._on_every_rank(lambda: carried() if sequences else [])
            return batch_rows(answered(scores), len(sequences)) if sequences else []
        if not sequences:
            return []
        return batch_rows(self._requests.submit(carried), len(sequences))

    def _end_logmass_in_top_k(self, row: RowScores, tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """[`CrossTokenizerTeacher`]'s ends terms from the server's answer `row` (its top-k per position) over the
        teacher tokens `tokens`: per token, the log-prob of itself or any token among the top-k whose bytes start with
        its bytes, less its own (0 where none longer does), a lower bound of the term in the process (the longer
        tokens outside the top-k are left out); and whether the term is whole (every longer token among the
        top-k). Both `(n,)`."""
        moved, whole = torch.zeros(len(tokens)), torch.ones(len(tokens), dtype=torch.bool)
        for j, token_id in enumerate(tokens):
            longer = self.extensions(token_id)
            if len(longer) < 2:
                continue
            top_ids, top_logps = row.top_ids[j], row.top_logps[j]
            # (a padded answer's `-inf` entries, and the token itself, counted once from `logps`)
            found = torch.isin(top_ids, longer) & (top_ids != token_id) & top_logps.isfinite()
            moved[j] = torch.cat([row.logps[j : j + 1].float(), top_logps[found]]).logsumexp(0) - row.logps[j]
            whole[j] = int(found.sum()) == len(longer) - 1
        return moved, whole
