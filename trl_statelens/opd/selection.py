"""State selection (issue 36, `skip_correct_rollouts`): which rollouts the teacher scores.

A rollout the student sampled whose reward reaches `correct_reward` is skipped: the teacher does not score it and the
loss gives it no weight. A `recheck_fraction` share of those is scored anyway, chosen by a generator seeded from the
run's seed, the rank, the optimizer step and the generation batch within that step, so a resumed run rechecks the
same rows. [`OnPolicyDistillTrainer`] asks [`choose_rows`] once per training generation batch, after GRPO computed
the rewards and before any teacher call; [`rows_of`] cuts a micro-batch down to the rows the teacher sees.
"""

from __future__ import annotations

import math

import torch

from .. import collective
from ..heads import Divergence, _head_logps
from ..lens.records import RECHECKED, SCORED, SKIPPED  # a row's selection code, in the batch and the records
from ..teachers.base import RowScores, TeacherRow, answered


def selection_generator(seed: int, rank: int, step: int, batch_in_step: int) -> torch.Generator:
    """The generator of one generation batch's rechecks: a function of where the batch sits in the run only (no state
    to save), so an uninterrupted and a resumed run draw alike (a run resumes at a generation batch's start)."""
    return torch.Generator().manual_seed(
        (seed * 1_000_003 + rank * 7_919 + step * 104_729 + batch_in_step * 31) % (2**63 - 1)
    )


def choose_rows(
    rewards: torch.Tensor,
    eligible: list[bool],
    correct_reward: float,
    recheck_fraction: float,
    generator: torch.Generator,
) -> list[int]:
    """Each row's selection code: `SKIPPED` for an `eligible` row (the student's own rollout) whose reward is at least
    `correct_reward` (a NaN reward, unscorable, is never correct), except `RECHECKED` for
    `floor(recheck_fraction * n + u)` of those `n` rows (`u` uniform in [0, 1)) chosen uniformly; `SCORED` for the
    rest."""
    rewards = rewards.detach().float().cpu()
    correct = [i for i, (r, e) in enumerate(zip(rewards.tolist(), eligible, strict=True)) if e and r >= correct_reward]
    codes = [SCORED] * len(eligible)
    if not correct:
        return codes
    draw = torch.rand(1, generator=generator).item()
    num_rechecks = min(math.floor(recheck_fraction * len(correct) + draw), len(correct))
    order = torch.randperm(len(correct), generator=generator).tolist()
    rechecked = {correct[j] for j in order[:num_rechecks]}
    for i in correct:
        codes[i] = RECHECKED if i in rechecked else SKIPPED
    return codes


def rows_of(batch: dict, rows: torch.Tensor) -> dict:
    """The micro-batch `batch` cut down to `rows` (indices): each tensor and list with one entry per row, indexed;
    anything else (a scalar such as `num_items_in_batch`, a `None`) kept."""
    num_rows = batch["completion_ids"].size(0)
    index = rows.tolist()
    cut = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == num_rows:
            cut[key] = value[rows.to(value.device)]
        elif isinstance(value, list) and len(value) == num_rows:
            cut[key] = [value[i] for i in index]
        else:
            cut[key] = value
    return cut


def _unscored_row(num_tokens: int):
    """A skipped row's place in the batch's teacher scores: log-probs of 0, which its zero loss weight never reads."""
    return TeacherRow(answered([RowScores(torch.zeros(num_tokens))]), 0)


def select_and_score(trainer, batch, output: dict) -> list | None:
    """Choose which rows of a training generation batch the teacher scores, from the rewards GRPO just computed
    (`output["rewards"]`), and start scoring those (`teacher.score`, on every rank, none included: its collectives stay
    matched). Sets the batch's `teacher_selection` (each row's code), its `loss_mask` (a skipped row's is zero) and
    `num_items_in_batch` (the loss's token normaliser, without the skipped rows: all ranks); counts the teacher's
    tokens (the scored rows' completions) and the selection for the ledger and metrics. Returns the batch's teacher
    scores: one [`TeacherRow`] per row (a skipped row's holds zeros), or `None` where the teacher computes its
    distributions within the loss (an in-process `divergence`)."""
    args = trainer.args
    step = trainer.state.global_step
    index = trainer._selection_batch[1] if trainer._selection_batch[0] == step else 0
    trainer._selection_batch = (step, index + 1)
    rank = trainer.accelerator.process_index
    generator = selection_generator(args.seed, rank, step, index)
    eligible = [source == "learner" for source in batch.sources]
    codes = choose_rows(output["rewards"], eligible, args.correct_reward, args.recheck_fraction, generator)
    kept = [i for i, code in enumerate(codes) if code != SKIPPED]
    prompts, completions = batch.teacher_prompts, batch.completion_ids
    distribution = args.signal == "divergence"
    scores = trainer.teacher.score(
        [prompts[i] for i in kept],
        [completions[i] for i in kept],
        distribution,
        teachers=[batch.teachers[i] for i in kept],
    )
    trainer._count_teacher_tokens([completions[i] for i in kept])

    device = output["completion_ids"].device
    output["teacher_selection"] = selection = torch.tensor(codes, device=device)
    output["loss_mask"] = output["completion_mask"] * (selection != SKIPPED).int()[:, None]
    counted = output["loss_mask"] if output.get("tool_mask") is None else output["loss_mask"] * output["tool_mask"]
    output["num_items_in_batch"] = trainer.accelerator.gather(counted.sum()).sum()

    skipped = [i for i, code in enumerate(codes) if code == SKIPPED]
    num_rechecked = codes.count(RECHECKED)
    # What the teacher did not read: each skipped row's prompt (its own, with a self teacher's context) and completion
    skipped_tokens = sum(len(prompts[i]) + len(completions[i]) for i in skipped)
    counts = trainer._selection_counts
    trainer._selection_counts = [counts[0] + len(skipped), counts[1] + num_rechecked, counts[2] + skipped_tokens]
    totals = torch.tensor([len(skipped), num_rechecked, len(codes)])
    total_skipped, total_rechecked, rollouts = collective.sum_over_ranks(trainer.accelerator, totals)
    trainer._metrics["train"]["teacher/skipped_frac"].append(total_skipped / rollouts)
    trainer._metrics["train"]["teacher/rechecked_frac"].append(total_rechecked / rollouts)

    if scores is None and distribution:
        return None
    answers = iter(scores or [None] * len(kept))
    return [_unscored_row(len(completions[i])) if code == SKIPPED else next(answers) for i, code in enumerate(codes)]


def divergence_on_scored_rows(trainer, student, student_hidden, batch: dict, loss_mask, normalizer) -> Divergence:
    """The `divergence` loss of a micro-batch whose skipped rows (`batch["teacher_selection"]`) carry no loss: the
    teacher's `divergence_loss` on the other rows only (on every rank, none included: it joins the others' collectives
    on its stand-ins), and the per-token values the records need for every row. The student's log-probs and entropies
    of the skipped rows come from its output layer ([`_head_logps`], as a served teacher's rows do): one call on every
    rank per micro-batch (a ZeRO-3-sharded layer is gathered), on one stand-in position where a rank skipped none."""
    args = trainer.args
    selection = batch["teacher_selection"]
    kept = (selection != SKIPPED).nonzero().flatten()
    skipped = (selection == SKIPPED).nonzero().flatten()
    if len(kept):
        part, hidden, mask = rows_of(batch, kept), student_hidden[kept], loss_mask[kept]
    else:
        part, hidden, mask = _stand_in(batch, student_hidden, trainer._tokenizer.pad_token_id)
    out = trainer.teacher.divergence_loss(student, hidden, part, mask, normalizer, args.jsd_beta, trainer.temperature)
    tokens = batch["completion_ids"]
    teacher_logps = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    if len(kept):
        teacher_logps[kept] = out.teacher_logps.detach().float()
    with torch.no_grad():
        hidden = student_hidden.detach()
        if out.logps is None:  # a served teacher's loss gives none: the student's layer over every row, as for it
            logps, entropies = _head_logps(student, hidden, tokens, trainer.temperature, True)
            return Divergence(out.loss, teacher_logps, logps, entropies)
        logps, entropies = torch.zeros_like(teacher_logps), torch.zeros_like(teacher_logps)
        if len(kept):
            logps[kept], entropies[kept] = out.logps.detach().float(), out.entropies.detach().float()
        if len(skipped):
            logps[skipped], entropies[skipped] = (
                values.float()
                for values in _head_logps(student, hidden[skipped], tokens[skipped], trainer.temperature, True)
            )
        else:  # the same call on a stand-in position
            _head_logps(student, hidden[:1, :1], tokens[:1, :1], trainer.temperature, True)
    return Divergence(out.loss, teacher_logps, logps, entropies)


def _stand_in(batch: dict, student_hidden, pad_id: int):
    """For a rank whose rows were all skipped: one pad-token row with a zero loss mask for the teacher's
    `divergence_loss`, whose student hidden state is zeros inside the student's graph. The teacher's forward (one pad
    token) joins the other ranks' as its own stand-in would; the graph makes the student's output layer take part in
    the backward as on the ranks with rows (under ZeRO-3 its gradient is collective: a rank without it hangs the
    others)."""
    first = torch.zeros(1, dtype=torch.long, device=batch["completion_ids"].device)
    part = rows_of(batch, first)  # the first row's teacher name (a router sends the stand-in to that teacher)
    ids = torch.full((1, 1), pad_id, dtype=torch.long, device=first.device)
    part.update(
        prompt_ids=ids, prompt_mask=torch.ones_like(ids), completion_ids=ids, completion_mask=torch.ones_like(ids)
    )
    part["teacher_scores"] = None  # no scores: a served teacher compares nothing on it
    if part.get("teacher_prompt_ids") is not None:  # a self teacher's prompt
        part["teacher_prompt_ids"] = [[pad_id]]
    hidden = student_hidden[:1, :1] * 0.0
    return part, hidden, torch.zeros((1, 1), device=student_hidden.device)
