"""A teacher behind a vLLM server: [`ServedTeacher`]."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .. import collective, heads
from ..heads import Divergence, topk_tail_divergence
from .base import ResolvedScores, RowScores, Teacher, answered, answers_on_every_rank, batch_rows, joined, resolve_rows
from .loading import connect_served_teacher
from .server_client import BackgroundRequests, TeacherServerError


class ServedTeacher(Teacher):
    """A teacher behind a vLLM server, through [`TeacherServerClient`]; every rank asks for its own rows (its requests
    need no collective; vLLM batches the ranks' concurrent requests itself). A request that fails on one rank raises
    on every rank, where its answer is waited for ([`collective.raise_together`]: one all-gather of a failure flag per
    `generate`, per `score` made at once, and per micro-batch whose answers are read), so that no rank is left
    waiting for the failed one in a collective.

    Args:
        server ([`TeacherServerClient`]): the checked client.
        sampling (`dict`): `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` of its continuations.
        eos_token_ids (`list[int]`): where a continuation ends.
        seed_generator (`torch.Generator`): draws one seed per continuation (vLLM would sample a request's identical
            prefixes alike).
        accelerator: the trainer's, whose ranks agree on how often `divergence_loss` calls the student's output layer.
        overlap (`bool`): send scoring requests from a background thread during `session()`.
        top_k (`int`): the top log-probs per position that `score(..., distribution=True)` asks for.
    """

    def __init__(
        self, server, sampling: dict, eos_token_ids, seed_generator, accelerator, overlap: bool = True, top_k: int = 0
    ):
        self.server, self.sampling, self.eos_token_ids = server, sampling, eos_token_ids
        self.seed_generator, self.overlap, self.top_k = seed_generator, overlap, top_k
        self.accelerator = accelerator
        self._requests = None

    @classmethod
    def connect(cls, trainer, path: str | None = None, url: str | None = None) -> ServedTeacher:
        """The teacher at `url` (default: `trainer.args.teacher_model_server_url`), checked now by
        [`connect_served_teacher`]; with `divergence` it must answer `teacher_top_k` log-probs per position."""
        args = trainer.args
        top_k = args.teacher_top_k if args.signal == "divergence" else 0
        url = url or args.teacher_model_server_url
        server = connect_served_teacher(url, trainer.model, trainer._tokenizer, path, args, top_k)
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        sampling = {name: getattr(trainer, name) for name in names}
        return cls(
            server,
            sampling,
            trainer.eos_token_ids,
            trainer._source_generator,
            trainer.accelerator,
            args.teacher_server_overlap,
            top_k,
        )

    @contextmanager
    def session(self):
        if not self.overlap:
            yield
            return
        # One worker: a rank's scoring requests go out one at a time, in the order the batches were made. Shut down
        # when training ends or fails, so that a crash does not leave the process waiting for a request in flight.
        self._requests = BackgroundRequests("teacher-server")
        try:
            yield
        finally:
            self._requests.shutdown()
            self._requests = None

    def generate(self, prompts, max_new_tokens, prefixes=None, teachers=None):
        sequences = joined(prompts, prefixes)
        # Asked on every rank, rows or none: a request failed on any rank raises on all of them
        return self._on_every_rank(lambda: self._continuations(sequences, max_new_tokens))

    def _continuations(self, sequences, max_new_tokens, eos_token_ids=None) -> list[list[int]]:
        """Each sequence's continuation, ending at its first token in `eos_token_ids` (default: the teacher's
        `eos_token_ids`)."""
        if not sequences:
            return []
        # A seed per row (vLLM would sample a request's identical prefixes alike), drawn from the run's seed
        seeds = torch.randint(2**31 - 1, (len(sequences),), generator=self.seed_generator).tolist()
        ends = self.eos_token_ids if eos_token_ids is None else eos_token_ids
        return self.server.generate(sequences, max_new_tokens, ends, **self.sampling, seeds=seeds)

    def score(self, prompts, completions, distribution=False, teachers=None):
        """One request for the batch (each row without its padding), from the background worker during an
        overlapped `session()` (its errors are raised where the answer is read), else at once. With `distribution`,
        the teacher's `top_k` log-probs per position (vLLM's `prompt_logprobs=top_k`)."""
        sequences, lengths = [p + c for p, c in zip(prompts, completions)], [len(p) for p in prompts]
        top_k = self.top_k if distribution else 0
        if self._requests is None:  # at once, asked on every rank, rows or none: a failure raises on all of them
            scores = self._on_every_rank(lambda: self._scores(sequences, lengths, top_k) if sequences else [])
            return batch_rows(answered(scores), len(sequences)) if sequences else []
        if not sequences:
            return []
        return batch_rows(self._requests.submit(self._scores, sequences, lengths, top_k), len(sequences))

    def _on_every_rank(self, request):
        """`request()`, a call every rank makes as often as the others: when it fails on any rank, every rank raises
        (its own error where it failed, a `TeacherServerError` naming that rank elsewhere)."""
        answer, error = None, None
        try:
            answer = request()
        except Exception as raised:  # noqa: BLE001 (raised on every rank below)
            error = raised
        what = "a request to the teacher server failed"
        collective.raise_together(self.accelerator, error, what, TeacherServerError)
        return answer

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
        """The generalised JSD on the teacher's top-k tokens plus a tail bucket ([`topk_tail_divergence`]). It calls
        the student's output layer once per `heads.POSITION_CHUNK` supervised positions, a collective under ZeRO-3
        (forward and backward): every rank makes as many calls as the rank with the most positions, the ones past its
        own on empty chunks, and at least one, so that the layer is used on every rank (as DDP requires of an untied
        head) even where a router sent this rank's rows to other teachers or every position is masked."""
        chunks = collective.agreed_chunks(self.accelerator, int((loss_mask != 0).sum()), heads.POSITION_CHUNK) or [
            slice(0, 0)
        ]
        # Every rank waits for its answers here, rows or none: a request failed on any rank raises on all of them
        answers_on_every_rank(self.accelerator, batch["teacher_scores"] or [])
        if batch["teacher_scores"]:
            scores = resolve_rows(batch["teacher_scores"], batch["completion_ids"], batch["completion_mask"])
        else:  # no rows of this teacher here
            ids = torch.zeros((*batch["completion_ids"].shape, self.top_k), dtype=torch.long)
            no_logps = torch.zeros_like(batch["completion_ids"], dtype=torch.float32)
            scores = ResolvedScores(no_logps, ids, torch.full(ids.shape, float("-inf")))
        loss = topk_tail_divergence(
            student, student_hidden, scores.top_ids, scores.top_logps, loss_mask, beta, normalizer, temperature, chunks
        )
        return Divergence(loss, scores.logps)  # the student's per-token values: the trainer projects them
