"""What every teacher answers with, and the interface [`OnPolicyDistillTrainer`] calls (see the package docstring)."""

from __future__ import annotations

from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import PreTrainedModel
from trl.trainer.utils import pad

from .. import collective
from ..heads import Divergence
from .server_client import TeacherServerError

CACHE_SLOT = "teacher_cache"  # the key of a micro-batch's [`CacheSlot`], in each micro-batch the teacher cache serves


@dataclass
class CacheSlot:
    """A buffered micro-batch's entry in the offline teacher cache (`teacher_cache_steps`: opd/cache.py), which the
    cache puts in the micro-batch (under `CACHE_SLOT`) on each step it serves it: its `age` (0 on the refresh that
    sampled it, n on its n-th reuse), the sampling policy's log-probs of its completion tokens (`sampling_logps`
    `(B, T)`, kept by the refresh step's loss) and an in-process teacher's final hidden states at its completion
    positions (`teacher_hidden` `(B, T, H)`, kept by that teacher's `divergence_loss` on the refresh, projected again
    on each reuse).

    One object that the batch dict holds, not keys written into the dict: a shallow copy of the dict (`{**batch}`, as
    a self teacher makes) holds the same slot, so what is kept on a copy still reaches the reuses. A part of the rows
    (a router's, state selection's) must not keep its own hidden states in the whole batch's slot: the config refuses
    the cache with several teachers and with state selection."""

    age: int
    sampling_logps: torch.Tensor | None = None
    teacher_hidden: torch.Tensor | None = None


class TeacherRow(NamedTuple):
    """Row `index` of a batch the teacher scored, or is scoring: `scores` is answered (maybe later, from a background
    request) with one [`RowScores`] per row of that batch. A batch's teacher scores are a list of these, one per
    row: GRPO shuffles and splits lists with the batch's tensors, so each micro-batch keeps its rows' handles."""

    scores: Future
    index: int


class RowScores(NamedTuple):
    """A row's teacher scores over its completion tokens: `logps` `(n,)`, and with a distribution asked for, the
    teacher's `top_ids` and `top_logps` `(n, k)` per position (`-inf` where absent). A teacher of another tokenizer
    (`cross_tokenizer.py`) adds `signal` `(n,)`: how each token's log-prob was carried over
    (`alignment.TeacherSignal`: exact, or the last or an inner token of a chunk), and `decision` `(n,)`: whether that
    value is the teacher's probability of the student's decision (`decisions.Decision`)."""

    logps: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logps: torch.Tensor | None = None
    signal: torch.Tensor | None = None
    decision: torch.Tensor | None = None


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


def answers_on_every_rank(accelerator, rows: list[TeacherRow]) -> list[RowScores]:
    """The answers of `rows` (this process's own, maybe none), once every one is in. A failed background request
    (a served teacher's) raises its error here, in the training thread, and on every process at once
    ([`collective.raise_together`]): a process that raised alone would leave the others waiting in their next
    collective. Every process calls it as often as the others, rows or none (one all-gather of a failure flag)."""
    scores, error = [], None
    try:
        scores = [row.scores.result()[row.index] for row in rows]
    except Exception as raised:  # noqa: BLE001 (raised on every process below)
        error = raised
    collective.raise_together(accelerator, error, "a request to the teacher server failed", TeacherServerError)
    return scores


def resolve_rows(
    rows: list[TeacherRow], completion_ids: torch.Tensor, completion_mask: torch.Tensor, accelerator=None
):
    """The scores of `rows` as [`ResolvedScores`] on `completion_ids`' device, once every answer is in (a failed
    background request raises its error here, in the training thread). With the trainer's `accelerator`, a call that
    every process makes as often as the others: a request failed on any process raises on all of them
    ([`answers_on_every_rank`])."""
    if accelerator is not None:
        scores = answers_on_every_rank(accelerator, rows)
    else:
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


def resolved_signal(rows: list[TeacherRow], completion_ids: torch.Tensor, kind: str = "signal") -> torch.Tensor:
    """How a teacher of another tokenizer carried each completion token's log-prob over (`alignment.TeacherSignal`
    `(B, T)`, `EXACT` on padding and on the rows of a routed teacher of the student's tokenizer, which with
    `divergence` has no row to read: `None`); with `kind="decision"`, whether it is the teacher's probability of the
    student's decision (`decisions.Decision`, `EXACT` there too). Read after [`resolve_rows`] or the `divergence`
    loss (the answers are in: no wait, no collective)."""
    signal = torch.zeros(completion_ids.shape, dtype=torch.long, device=completion_ids.device)  # 0: EXACT
    for i, row in enumerate(rows or []):
        answer = None if row is None else row.scores.result()[row.index]
        carried = None if answer is None else getattr(answer, kind)
        if carried is not None:
            signal[i, : carried.size(0)] = carried.to(completion_ids.device)
    return signal


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
    reads_student_ids: bool = True  # False for a teacher of another tokenizer, which reads text (no probe teacher)
    crosses_tokenizers: bool = False  # a teacher of another tokenizer (or a router with one): its rows carry `signal`

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
