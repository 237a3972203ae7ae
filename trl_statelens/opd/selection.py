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

# This rank's counts of an optimizer step in `trainer.step_counts` (`lens.step_counts.StepCounts`), which its ledger
# line reads: the rollouts skipped as correct, those rechecked, and the prompt and completion tokens of the skipped ones
SELECTION_COUNTS = ("selection_skipped", "selection_rechecked", "selection_skipped_tokens")


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
    tokens (the scored rows' completions) and the selection in the step's counts (`trainer.step_counts`,
    `SELECTION_COUNTS`) for the ledger, and logs its shares. Returns the batch's teacher scores: one [`TeacherRow`] per
    row (a skipped row's holds zeros), or `None` where the teacher computes its distributions within the loss (an
    in-process `divergence`)."""
    args, counts = trainer.args, trainer.step_counts
    counts.add(selection_batches=1)  # the generation batches drawn in this step: this one's index, from 0
    index = counts.peek("selection_batches") - 1
    generator = selection_generator(args.seed, trainer.accelerator.process_index, trainer.state.global_step, index)
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
    counts.add(
        selection_skipped=len(skipped), selection_rechecked=num_rechecked, selection_skipped_tokens=skipped_tokens
    )
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
    on a stand-in row, [`collective.stand_in_row`]), and the per-token values the records need for every row. The
    student's log-probs and entropies of the skipped rows come from its output layer ([`_head_logps`], as a served
    teacher's rows do): one call on every rank per micro-batch (a ZeRO-3-sharded layer is gathered), on one stand-in
    position where a rank skipped none."""
    args = trainer.args
    selection = batch["teacher_selection"]
    kept = (selection != SKIPPED).nonzero().flatten()
    skipped = (selection == SKIPPED).nonzero().flatten()
    if len(kept):
        part, hidden, mask = rows_of(batch, kept), student_hidden[kept], loss_mask[kept]
    else:
        part, hidden, mask = collective.stand_in_row(batch, student_hidden, trainer._tokenizer.pad_token_id)
    out = trainer.teacher.divergence_loss(student, hidden, part, mask, normalizer, args.jsd_beta, trainer.temperature)
    tokens = batch["completion_ids"]
    teacher_logps = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    leftover = None if out.leftover is None else torch.full_like(teacher_logps, float("nan"))
    if len(kept):
        teacher_logps[kept] = out.teacher_logps.detach().float()
        if leftover is not None:
            leftover[kept] = out.leftover.float()
    with torch.no_grad():
        hidden = student_hidden.detach()
        if out.logps is None:  # a served teacher's loss gives none: the student's layer over every row, as for it
            logps, entropies = _head_logps(student, hidden, tokens, trainer.temperature, True)
            return Divergence(out.loss, teacher_logps, logps, entropies, leftover)
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
    return Divergence(out.loss, teacher_logps, logps, entropies, leftover)
