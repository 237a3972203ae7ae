"""Offline teacher cache (issue 36, `teacher_cache_steps`): a generation batch and the teacher's signal on it reused
for several optimizer steps.

With `teacher_cache_steps=K > 1`, [`OnPolicyDistillTrainer`] samples a generation batch and has the teacher score it
(a *refresh*), then trains on the same micro-batches for up to `K` optimizer steps without sampling or asking the
teacher again: `reverse_kl` reuses the per-token teacher log-probs `teacher.score` returned (in-process or served),
a served teacher's `divergence` its top-k rows, and an in-process teacher's `divergence` the teacher's final hidden
states at the completion positions, kept by the first pass's loss ([`InProcessTeacher.divergence_loss`]) in the
micro-batch's [`CacheSlot`]; on a reused step only the teacher's output layer projects them again (the kernel never
holds the `(B, T, V)` logits).

The cache is refreshed early when the student has moved too far from the policy that sampled it: the *staleness*,
a sampled estimate of KL(p_sampling || p_current) over the cached rollouts' sampled completion tokens, is measured
before each reuse with a no-grad forward of the current student, summed over every rank (so every rank decides
alike), and a value above `teacher_cache_max_staleness` refreshes. The estimate is the mean of
`r - 1 - log r` with `r = p_current / p_sampling` at each token (Schulman's k3: non-negative at every token, 0 only
where the token's probability did not move), not the plain mean of `log p_sampling - log p_current` (k1, also logged
as `teacher_cache/log_ratio`): the student trains on these very tokens, which can raise their probability, so k1 can
go negative while the student moves (on the tests' tiny model with `reverse_kl` at a learning rate of 1e-3: -0.01 and
-0.02 after one and two reuses), where k3 only grows with the movement. On the lab (`divergence`, one rollout per
prompt, learning rate 3e-4) the two agreed within about 20%: k3 0.004-0.022 after one step, 0.015-0.043 after two,
0.029-0.068 after three. The sampling
log-probs are the refresh step's own loss forward (the policy that sampled the batch, before its update): no extra
forward. A resumed run holds no cache (GRPO keeps its generation batch in memory only): its first step refreshes.
"""

from __future__ import annotations

import torch

from .. import collective
from ..teachers.base import CACHE_SLOT, CacheSlot  # each micro-batch's entry: its age, what is kept for its reuses
from ..teachers.cross_tokenizer import TextReading

# This rank's sums of an optimizer step in `trainer.step_counts` (`lens.step_counts.StepCounts`), one float tensor:
# the k3 and k1 sums and their tokens (all ranks); the reused, reused completion, checked and reused teacher tokens
# (this rank's)
CACHE_COUNTS = "teacher_cache"
REFRESH_REASONS = ("first", "age", "staleness")


def staleness_terms(sampling_logps, logps, mask) -> torch.Tensor:
    """`[sum of k3, sum of k1, number of tokens]` over the tokens where `mask` is non-zero: with `log r = log
    p_current - log p_sampling` at each token, k3 = `r - 1 - log r` (the staleness) and k1 = `-log r`."""
    mask = mask.float()
    log_ratio = (logps.detach().float() - sampling_logps.float()) * mask
    k3 = (torch.expm1(log_ratio) - log_ratio) * mask
    return torch.stack([k3.sum(), -log_ratio.sum(), mask.sum()])


def staleness_mask(inputs: dict, learner_code: int) -> torch.Tensor:
    """The tokens the staleness averages over: completion tokens the student sampled itself (not a `dataset`
    reference or a `teacher` rollout, nor a tool's output)."""
    mask = inputs["completion_mask"] * (inputs["row_source"] == learner_code)[:, None]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask


def rerun_tokens(inputs: dict) -> int:
    """The tokens the teacher's forward runs over again when a reused micro-batch's `divergence` loss is computed: a
    teacher of another tokenizer keeps nothing of that forward in the slot (its rows' readings, [`TextReading`], are
    its prompt and completion in its own tokens), where one of the student's tokenizer keeps its hidden states."""
    readings = [row.scores.result()[row.index] for row in inputs.get("teacher_scores") or []]
    return sum(len(r.prompt) + len(r.completion) for r in readings if isinstance(r, TextReading))


class TeacherCache:
    """Decides at each optimizer step's first micro-batch whether the trainer reuses its buffered generation batch
    (`GRPOTrainer._buffered_inputs`) or refreshes it ([`advance_or_refresh`]), gives each micro-batch its slot
    ([`attach`]), and counts the step for the ledger ([`step_trace`]) in the trainer's `step_counts`.

    Every rank makes the same decision: the age is the same everywhere, and the staleness is summed over the ranks
    before it is compared.
    """

    def __init__(self, trainer, learner_code: int):
        self.trainer, self.learner_code = trainer, learner_code
        args = trainer.args
        self.steps, self.max_staleness = args.teacher_cache_steps, args.teacher_cache_max_staleness
        self.age: int | None = None  # of the buffered batch; None: no batch yet (a new or resumed run)
        self.refreshed: str | None = None  # why this step refreshed (`REFRESH_REASONS`), None when it reused
        self.measured: float | None = None  # the staleness measured before this step's decision (all ranks)

    def advance_or_refresh(self, buffered: list[dict] | None) -> bool:
        """At a step's first micro-batch (GRPO's `_step` at a generation boundary), on every rank: advance the cache
        to this step, which reuses the buffered generation batch `buffered` (GRPO's `_buffered_inputs`; returns
        True, the batch one step older), or refresh it (returns False: the trainer drops `buffered`, so that GRPO
        samples and scores a new batch; age 0). Before a reuse within the age limit, with
        `teacher_cache_max_staleness`, it measures the staleness: a no-grad forward of the student over every
        micro-batch of `buffered`, and a collective."""
        self.measured = None
        if self.age is None or buffered is None:
            reason = "first"
        elif self.age + 1 >= self.steps:
            reason = "age"
        else:
            reason = None
            if self.max_staleness is not None:
                self.measured = self._measure_staleness(buffered)
                if self.measured > self.max_staleness:
                    reason = "staleness"
        self.refreshed = reason
        if reason is None:
            self.age += 1
            return True
        self.age = 0
        return False

    def attach(self, inputs: dict) -> None:
        """Give a training micro-batch of this step its slot (`CACHE_SLOT`): a new one on a refresh, its own one step
        older on a reuse."""
        slot = inputs.get(CACHE_SLOT)
        if self.age == 0 or slot is None:
            inputs[CACHE_SLOT] = CacheSlot(self.age)
        else:
            slot.age = self.age

    @torch.no_grad()
    def _measure_staleness(self, buffered: list[dict]) -> float:
        """The staleness of the buffered batch under the current student (a no-grad forward over each micro-batch,
        on every rank: each rank holds as many), summed over the ranks."""
        trainer = self.trainer
        sums = torch.zeros(3, device=trainer.accelerator.device)
        checked = 0
        for inputs in buffered:
            input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, input_ids, attention_mask, inputs["completion_ids"].size(1)
            )
            slot = inputs[CACHE_SLOT]
            sums += staleness_terms(slot.sampling_logps, logps, staleness_mask(inputs, self.learner_code))
            checked += int(attention_mask.sum())
        self._count(checked=checked)  # this rank's: the ledger gathers them
        k3, _, count = collective.sum_over_ranks(trainer.accelerator, sums)
        return k3 / count if count else 0.0

    def observe(self, inputs: dict, logps: torch.Tensor) -> None:
        """In the loss of a training micro-batch, with the student's log-probs of its completion tokens from the
        loss's own forward: on a refresh they are the sampling policy's, kept in its slot for the later reuses (the
        staleness is 0 there by definition); on a reuse, the staleness of this micro-batch is added to the step's and
        logged (`teacher_cache/staleness`, all ranks), and its tokens counted as reused."""
        trainer, slot = self.trainer, inputs[CACHE_SLOT]
        if slot.age == 0:
            slot.sampling_logps = logps.detach()
        terms = staleness_terms(slot.sampling_logps, logps, staleness_mask(inputs, self.learner_code))
        k3, k1, count = collective.sum_over_ranks(trainer.accelerator, terms)
        self._count(k3=k3, k1=k1, tokens=count)
        trainer._metrics["train"]["teacher_cache/staleness"].append(k3 / count if count else 0.0)
        trainer._metrics["train"]["teacher_cache/log_ratio"].append(k1 / count if count else 0.0)
        if slot.age > 0:
            prompt, completion = int(inputs["prompt_mask"].sum()), int(inputs["completion_mask"].sum())
            self._count(reused=prompt + completion, reused_completion=completion, reused_teacher=rerun_tokens(inputs))

    def _count(self, k3=0.0, k1=0.0, tokens=0.0, reused=0, reused_completion=0, checked=0, reused_teacher=0) -> None:
        """Add to the step's sums (`CACHE_COUNTS`, float32)."""
        sums = torch.tensor([k3, k1, tokens, reused, reused_completion, checked, reused_teacher], dtype=torch.float32)
        self.trainer.step_counts.add(**{CACHE_COUNTS: sums})

    def step_trace(self) -> dict:
        """The optimizer step's ledger fields (on every rank: the token counts are gathered): `cache_age` (0 on a
        refresh), `refreshed` (`"first"`, `"age"`, `"staleness"`, or `None` for a step served from the cache),
        `teacher_cache/staleness` (of the batch trained on, all ranks; 0 on a refresh) and its k1 `teacher_cache/log_ratio`,
        `teacher_cache/measured`
        (the staleness measured before the decision, with `teacher_cache_max_staleness`: on a staleness refresh, the
        value that triggered it), and the counts the FLOPs read: `cache_reused_tokens` (the prompt and completion tokens
        trained from the cache, all ranks), `cache_reused_completion_tokens` and `cache_checked_tokens` (those the
        staleness check's forward read) and `cache_reused_teacher_tokens` (the tokens a teacher of another tokenizer ran
        its forward over again on the reused rows: `rerun_tokens`)."""
        (sums,) = self.trainer.step_counts.take(CACHE_COUNTS)
        sums = torch.zeros(7) + sums  # (zeros where nothing was counted)
        local = sums.clone()
        local[:3] = 0  # already summed over the ranks
        gathered = collective.sum_over_ranks(self.trainer.accelerator, local)
        k3, k1, count = sums[:3].tolist()
        trace = {
            "cache_age": self.age,
            "refreshed": self.refreshed,
            "teacher_cache/staleness": k3 / count if count else 0.0,
            "teacher_cache/log_ratio": k1 / count if count else 0.0,
            "cache_reused_tokens": gathered[3],
            "cache_reused_completion_tokens": gathered[4],
            "cache_checked_tokens": gathered[5],
            "cache_reused_teacher_tokens": gathered[6],
        }
        if self.measured is not None:
            trace["teacher_cache/measured"] = self.measured
        return trace
