"""What every teacher answers with, and the interface [`OnPolicyDistillTrainer`] calls (see the package docstring)."""

from __future__ import annotations

from concurrent.futures import Future
from contextlib import nullcontext
from typing import NamedTuple

import torch
from transformers import PreTrainedModel
from trl.trainer.utils import pad

from ..heads import Divergence

# The offline teacher cache's keys in a micro-batch (`teacher_cache_steps`: opd/cache.py), which an in-process teacher
# reads and writes
CACHE_AGE = "teacher_cache_age"  # in each micro-batch the cache serves: 0 on a refresh, n on its n-th reuse
TEACHER_HIDDEN = "teacher_cache_teacher_hidden"  # an in-process teacher's final hidden states, kept for `divergence`


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


def batch_rows(scores: Future, num_rows: int) -> list[TeacherRow]:
    """One [`TeacherRow`] per row of a batch whose [`RowScores`] `scores` answers (now or later)."""
    return [TeacherRow(scores, i) for i in range(num_rows)]


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


def left_padded(rows: list[list[int]], pad_id: int, pad_to_multiple_of: int | None = None):
    """Token rows as `(ids, mask)` tensors, left-padded as GRPO pads its prompts (each row ends where the completion
    that follows it starts)."""
    tensors = [torch.tensor(row, dtype=torch.long) for row in rows]
    ids = pad(tensors, padding_value=pad_id, padding_side="left", pad_to_multiple_of=pad_to_multiple_of)
    mask = pad([torch.ones_like(t) for t in tensors], 0, "left", pad_to_multiple_of=pad_to_multiple_of)
    return ids, mask


def completion_padded(completions: list[list[int]], pad_id: int, pad_to_multiple_of: int | None = None):
    """Completion rows as `(ids, mask)` tensors, right-padded as GRPO pads its completions; an empty completion (a
    rollout masked whole) is one masked padding token."""
    rows = [torch.tensor(c or [pad_id], dtype=torch.long) for c in completions]
    ids = pad(rows, padding_value=pad_id, pad_to_multiple_of=pad_to_multiple_of)
    masks = [torch.full_like(r, int(bool(c))) for r, c in zip(rows, completions)]
    return ids, pad(masks, padding_value=0, pad_to_multiple_of=pad_to_multiple_of)


def joined(prompts: list[list[int]], prefixes: list[list[int]] | None) -> list[list[int]]:
    """Each prompt followed by its prefix (a student prefix the teacher continues), or the prompts alone."""
    return [p + q for p, q in zip(prompts, prefixes, strict=True)] if prefixes is not None else list(prompts)


class Teacher:
    """What [`OnPolicyDistillTrainer`] asks of a teacher (see the package docstring). `model` is the teacher model in
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
        """The `divergence` loss of a micro-batch (`batch`: its prompt and completion tensors, its `teacher_scores`
        rows from `score(..., distribution=True)`, and with a router each row's `teacher`) given the student's
        (unwrapped `student`) final hidden states `(B, T, H)` at its completion positions, summed over positions with
        `loss_mask != 0` and divided by `normalizer`; and the teacher's log-prob of each completion token `(B, T)`,
        for the metrics and records (with the student's log-probs and entropies, when its pass gives them:
        [`Divergence`])."""
        raise NotImplementedError
