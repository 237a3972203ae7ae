"""[`OnPolicyDistillTrainer`]'s loss: the student's log-probs at the completion positions, and what the teacher
says there under each `signal` (`reverse_kl`'s advantage, `continuation`'s cross-entropy on the teacher's tokens,
`divergence` inside the student's forward), with the records and teacher metrics each micro-batch logs. Mixed into
the trainer, before `StateLensGRPOTrainer`: the GRPO methods overridden here (`_compute_loss`,
`_get_per_token_logps_and_entropies`) reach GRPO's own through `super()`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from trl.kernels.chunked_logprob import _use_triton

from .. import collective
from ..heads import (
    _completion_hidden_states,
    _completion_hidden_states_and_aux_loss,
    _completion_logps_and_entropies,
    _head_logps,
)
from ..lens.endings import answer_end_position
from ..lens.records import SKIPPED
from ..teachers import resolve_rows, resolved_signal
from ..teachers.alignment import TeacherSignal, chunk_totals, shared_out_over_chunks, spread_over_chunks
from ..teachers.decisions import Decision
from ..teachers.in_process import rows_shifted
from .rollouts import LEARNER
from .selection import divergence_on_scored_rows


class LossMixin:
    """The loss side of [`OnPolicyDistillTrainer`], mixed in before [`StateLensGRPOTrainer`]."""

    # ----- the student's log-probs, the teacher's answer -------------------------------------------------------------
    def _resolve_teacher_logps(self, inputs: dict) -> torch.Tensor:
        """The teacher's log-prob of each completion token, `(B, T)` like `completion_ids`, 0 where `completion_mask`
        is 0, once the teacher's answer is in (a failed served request raises its `TeacherServerError` here, in the
        training thread, and every other process raises one with it: called once per micro-batch on every process)."""
        rows, ids, mask = inputs["teacher_scores"], inputs["completion_ids"], inputs["completion_mask"]
        return resolve_rows(rows, ids, mask, self.accelerator).logps

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        """Log-probs (and entropies) of the completion tokens, `(B, T)`, projecting only the completion positions
        onto the vocabulary.

        On devices without Triton (CPU) TRL's fused LM head projects every position, the prompt's too, though only
        the completion is scored; at a large vocabulary that projection and its recomputation in the backward are
        most of the step (see BENCHMARKS.md). Same kernel, same values (LM-head bias, logit scale and final
        soft-capping included). Triton devices (where TRL's head already skips unscored positions), multimodal or MoE
        calls, heads that upcast their logits and tensor-parallel heads keep TRL's path.

        While GRPO scores freshly sampled rollouts with the student (its old log-probs, for clipped importance ratios
        when `steps_per_generation` does not divide `gradient_accumulation_steps`), no forward runs and `None` is
        returned: no OPD loss reads them. The one exception is the vLLM importance-sampling correction of `reverse_kl`.
        """
        if (
            self._rollout_batch is not None
            and self._rollout_batch.scoring_rollouts
            and model is self.model
            and not (self.use_vllm and self.vllm_importance_sampling_correction)
        ):
            return None, None, None
        unwrapped = self.accelerator.unwrap_model(model)
        if (
            kwargs.get("compute_aux_loss")
            or any(value is not None for key, value in kwargs.items() if key != "compute_aux_loss")
            or self.args.cast_lm_head_to_fp32
            or _use_triton(input_ids.device)  # there TRL's head already projects the scored positions only
            or isinstance(unwrapped.get_output_embeddings().weight, DTensor)
        ):
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                compute_entropy=compute_entropy,
                **kwargs,
            )
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            with self.accelerator.autocast():
                chunk_logps, chunk_entropies = self._forward_redirection(
                    model,
                    unwrapped,
                    _completion_logps_and_entropies,
                    unwrapped,
                    input_ids[rows],
                    attention_mask[rows],
                    logits_to_keep,
                    self.temperature,
                    compute_entropy,
                )
            logps.append(chunk_logps)
            entropies.append(chunk_entropies)
        logps = torch.cat(logps)
        entropies = torch.cat(entropies) if compute_entropy else None
        if compute_entropy:  # as StateLensGRPOTrainer does: the loss's own tensors, for the records
            self._loss_logps_and_entropies = (logps, entropies)
        return logps, entropies, None

    # ----- the loss: what the teacher says there ---------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        completion_mask = inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        num_completion = completion_ids.size(1)
        loss_mask = inputs.get("loss_mask", completion_mask).float()
        if "tool_mask" in inputs:  # tool and environment outputs are not the model's tokens: never supervised
            loss_mask = loss_mask * inputs["tool_mask"]
        token_source = inputs.get("token_source", inputs["row_source"][:, None].expand_as(completion_ids))
        # Token mean over one optimizer step, as GRPO's DAPO loss: `num_items_in_batch` counts the whole generation
        # batch (all processes), which spans steps_per_generation micro-batches, of which one step accumulates
        # gradient_accumulation_steps
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        signal = None  # how a teacher of another tokenizer carried its log-probs over (`teachers/alignment.py`)
        leftover = None  # where such a teacher's distribution was carried over, the mass that reached no student token
        if self.model.training:
            # (the Trainer sets current_gradient_accumulation_steps in its loop; the last window of an epoch is shorter)
            accumulation = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
            normalizer = normalizer * accumulation / self.args.steps_per_generation

        # State selection: each row's code (`selection.SKIPPED` rows have a zero loss_mask and no teacher scores)
        selection = inputs.get("teacher_selection")
        skipped = None if selection is None else (selection == SKIPPED)[:, None]
        if self.args.signal == "divergence":
            unwrapped = self.accelerator.unwrap_model(model)
            loss, logps, entropies, teacher_logps, leftover, aux_loss = self._forward_redirection(
                model,
                unwrapped,
                self._divergence_loss,
                unwrapped,
                inputs,
                input_ids,
                attention_mask,
                loss_mask,
                normalizer,
            )
            weights = 1.0
            compared_logps = logps.detach()  # what the teacher's log-probs are compared with (one token each here)
            if self.teacher.crosses_tokenizers:  # its per-token values for the metrics and records, chunk by chunk
                signal = resolved_signal(inputs["teacher_scores"], completion_ids)
                compared_logps = chunk_totals(compared_logps, signal)
        else:
            logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                num_completion,
                compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled,
            )
            self._loss_logps_and_entropies = None  # recorded below, with per-token sources and teacher log-probs
            teacher_logps = self._resolve_teacher_logps(inputs)  # waits here for a served teacher's answer
            if self.args.teacher_row_shift:  # the shuffled-teacher control: another rollout's log-probs
                teacher_logps = rows_shifted(teacher_logps, completion_mask, self.args.teacher_row_shift)
            if self.teacher.crosses_tokenizers:  # (decided by the teachers, not the rows: the same on every rank)
                signal = resolved_signal(inputs["teacher_scores"], completion_ids)
            compared_logps = logps.detach()
            if signal is not None:  # a teacher of another tokenizer: compared chunk by chunk (teachers/alignment.py)
                compared_logps = chunk_totals(compared_logps, signal)
            if self.args.signal == "reverse_kl":
                if self.args.constant_advantage is None:
                    weights = self._reverse_kl_advantages(compared_logps, teacher_logps, loss_mask, signal)
                else:  # the teacher-free control: the teacher scored the rollouts for the lens only
                    weights = torch.full_like(logps, self.args.constant_advantage) * loss_mask
                if self.args.reward_weight:
                    weights = weights + self.args.reward_weight * inputs["advantages"][:, None] * loss_mask
                per_token_loss = -weights * logps * loss_mask
                if self.use_vllm and self.vllm_importance_sampling_correction:  # as GRPO: vLLM sampled the tokens
                    per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
                loss = per_token_loss.sum() / normalizer
            else:  # continuation: cross-entropy on the teacher's tokens
                weights = 1.0
                loss = -(logps * loss_mask).sum() / normalizer
        if self.aux_loss_enabled:  # a MoE student's router load-balancing loss, added and logged as GRPO does
            loss = loss + self.router_aux_loss_coef * aux_loss / (accumulation if self.model.training else 1.0)
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        if self.teacher_cache is not None and self.model.training:  # the staleness of the batch trained on
            self.teacher_cache.observe(inputs, logps)
        scored = completion_mask.bool() if skipped is None else completion_mask.bool() & ~skipped
        numbers = None if signal is None else self.teacher.number_tokens.to(completion_ids.device)[completion_ids]
        decision = None if signal is None else resolved_signal(inputs["teacher_scores"], completion_ids, "decision")
        self._log_teacher_metrics(
            compared_logps,
            teacher_logps,
            entropies,
            scored,
            loss_mask,
            token_source,
            inputs["teacher"],
            signal,
            numbers,
            leftover,
            decision,
        )
        if self.model.training and teacher_logps is not None and self.args.signal != "continuation":
            # The teacher's view of the student's ends: its log-prob of each end token the student sampled (`ends/*`)
            # (the states the student sampled: a `teacher` state's end is the teacher's own, a `dataset` one's the
            # reference's)
            ends = torch.isin(completion_ids, torch.tensor(self._end_ids, device=completion_ids.device))
            sampled = scored & loss_mask.bool() & (token_source == LEARNER)
            at_ends = teacher_logps.detach()[ends & sampled]
            self._teacher_end_logps += at_ends[torch.isfinite(at_ends)].tolist()
            self._advantages_after_answer += after_answer_advantages(
                self._tokenizer, completion_ids, sampled, ends, compared_logps, teacher_logps
            )
        if signal is not None:  # the records keep per-token values: each chunk's log-ratio shared out over its tokens
            teacher_logps = shared_out_over_chunks(teacher_logps, logps.detach(), signal)
        if self.model.training:
            align = lambda x: F.pad(x, (prompt_ids.size(1), 0))  # noqa: E731 (completion -> full sequence)
            recorded = loss_mask.bool()
            if skipped is not None:  # a skipped rollout's states are recorded too, with weight 0 and no teacher
                model_tokens = completion_mask * inputs.get("tool_mask", torch.ones_like(completion_mask))
                recorded = recorded | (skipped & model_tokens.bool())
                weights = torch.as_tensor(weights, device=logps.device).expand_as(logps).masked_fill(skipped, 0.0)
                teacher_logps = teacher_logps.masked_fill(skipped, float("nan"))
            self._record_states(
                input_ids=input_ids,
                supervised_mask=align(recorded),
                logps=align(logps),
                entropy=align(entropies),
                source=align(token_source),
                prefix_len=align(torch.arange(num_completion, device=input_ids.device).expand_as(completion_ids)),
                attention_mask=attention_mask,
                # Continuation tokens are the teacher's own samples: the records' `teacher_kl/supervised` (over
                # tokens the learner sampled) has nothing to average there; `teacher_kl/sampled` covers the prefix.
                teacher_logps=None if self.args.signal == "continuation" else align(teacher_logps),
                weights=weights if isinstance(weights, float) else align(weights),
                rewards=inputs.get("rewards"),
                teachers=inputs["teacher"] if self.teacher.names else None,
                teacher_prompts=inputs["teacher_prompt_ids"] if self.teacher.reads_own_prompts else None,
                selection=selection,
                teacher_exact=None if signal is None else align((signal == TeacherSignal.EXACT).float()),
                end_kinds=inputs.get("end_kind"),
            )
        return loss

    def _reverse_kl_advantages(self, logps, teacher_logps, mask, signal=None):
        """`A_t = -sum_k gamma^k (log p_S - log p_T)_{t+k}` over the valid tokens of each row. From a teacher of another
        tokenizer (`signal`), `logps` and `teacher_logps` hold each chunk's log-prob on its last token, and every
        token of a chunk gets the chunk's advantage (one token per chunk where the tokenizations agree: unchanged)."""
        kl = (logps - teacher_logps) * mask
        if self.args.kl_discount > 0:
            kl = _discounted_reverse_cumsum(kl, self.args.kl_discount)
        advantages = -kl * mask
        return advantages if signal is None else spread_over_chunks(advantages, signal) * mask

    def _divergence_loss(self, unwrapped, inputs, input_ids, attention_mask, loss_mask, normalizer):
        """Runs inside the student wrapper's forward (so DDP/DeepSpeed see one forward): the teacher's divergence loss
        on the student's final hidden states (full-vocabulary generalised JSD in-process, top-k plus tail from a
        server), plus the per-token log-probs and entropies the records need (an in-process teacher's pass gives them),
        the leftover of a teacher of another tokenizer (`Divergence.leftover`), and a MoE student's router
        load-balancing loss (`None` unless GRPO's `aux_loss_enabled`)."""
        num_completion = inputs["completion_ids"].size(1)
        if self.aux_loss_enabled:
            student_hidden, aux_loss = _completion_hidden_states_and_aux_loss(
                unwrapped, input_ids, attention_mask, num_completion
            )
        else:
            student_hidden = _completion_hidden_states(unwrapped, input_ids, attention_mask, num_completion)
            aux_loss = None
        if "teacher_selection" in inputs:  # state selection: only the rows not skipped reach the teacher
            out = divergence_on_scored_rows(self, unwrapped, student_hidden, inputs, loss_mask, normalizer)
        else:
            out = self.teacher.divergence_loss(
                unwrapped, student_hidden, inputs, loss_mask, normalizer, self.args.jsd_beta, self.temperature
            )
        logps, entropies = out.logps, out.entropies
        if logps is None:  # a served teacher's loss projects the supervised positions only: one more pass here
            with torch.no_grad():
                tokens = inputs["completion_ids"]
                logps, entropies = _head_logps(unwrapped, student_hidden.detach(), tokens, self.temperature, True)
        return out.loss, logps, entropies, out.teacher_logps, out.leftover, aux_loss

    def _log_teacher_metrics(
        self,
        logps,
        teacher_logps,
        entropies,
        scored,
        loss_mask,
        token_source,
        teachers,
        signal,
        numbers=None,
        leftover=None,
        decision=None,
    ):
        """`teacher_kl/sampled` (the sampled reverse KL `log p_S - log p_T`, a one-sample estimate of KL(p_S || p_T))
        and `teacher_nll`, means over every completion token the student sampled itself (supervised or not) in the
        rows the teacher scored (`scored`: the completion mask, less the rows state selection skipped); with
        several teachers, `teacher_kl/sampled/<name>` per teacher too (each row's `teachers` entry). Supervised
        tokens per teacher are counted per optimizer step by the state records (`StateLoggingCallback`). From a
        teacher of another tokenizer (`signal`), `alignment/exact`: the share of supervised tokens whose teacher
        log-prob is exact (the rest are in chunks: `teachers/alignment.py`), and `alignment/exact/numbers` the same
        among supervised tokens that spell a digit (`numbers`: per token, whether it does), where two tokenizers most
        often split differently; `alignment/per_decision_exact`, the share of supervised tokens whose teacher value is
        the teacher's probability of the student's decision given the text so far (`decision`: per token, a
        `teachers.decisions.Decision`; a chunk's share never is, an exact value or a token of a chunk the in-process
        teacher resolved from its prefix masses sometimes not). With `divergence` from such a teacher (`leftover`, NaN where no distribution was
        carried over), `alignment/mapped`: the share of supervised positions that were compared with a distribution
        of the teacher (the rest are left out of the loss), and `alignment/leftover`: the mean teacher mass that
        reached no student token there. One all-reduce for all of them."""
        mode = "train" if self.model.training else "eval"
        sampled = scored & (token_source == LEARNER)
        if self.args.signal == "continuation":
            sampled &= ~loss_mask.bool()  # the student's own prefix; the rest was written by the teacher
        kl = (logps - teacher_logps) * sampled
        # every rank has the same teacher, so the same entries: none, or the exact supervised tokens
        exact = []
        if signal is not None:  # exact supervised tokens; of them, digits; supervised digits; exact per decision
            exact_supervised = (signal == TeacherSignal.EXACT) & loss_mask.bool()
            per_decision = (decision == Decision.EXACT) & loss_mask.bool()
            counted = (exact_supervised, exact_supervised & numbers, numbers & loss_mask.bool(), per_decision)
            exact = [tokens.sum().float() for tokens in counted]
        mapped = []
        if leftover is not None:  # supervised positions given a distribution; their leftover summed
            compared = torch.isfinite(leftover) & loss_mask.bool()
            mapped = [compared.sum().float(), leftover.nan_to_num(0.0).mul(compared).sum().float()]
        per_teacher = []
        for name in self.teacher.names:
            rows = torch.tensor([t == name for t in teachers], device=kl.device)[:, None]
            per_teacher += [(kl * rows).sum(), (sampled & rows).sum().float()]
        sums = torch.stack(
            [
                kl.sum(),
                (-teacher_logps * sampled).sum(),
                sampled.sum().float(),
                (entropies * loss_mask).sum(),
                loss_mask.sum(),
                *exact,
                *mapped,
                *per_teacher,
            ]
        )
        totals = collective.sum_over_ranks(self.accelerator, sums)
        kl_sum, nll_sum, count, entropy_sum, supervised = totals[:5]
        if exact and supervised > 0:
            self._metrics[mode]["alignment/exact"].append(totals[5] / supervised)
        if exact and totals[7] > 0:
            self._metrics[mode]["alignment/exact/numbers"].append(totals[6] / totals[7])
        if exact and supervised > 0:
            self._metrics[mode]["alignment/per_decision_exact"].append(totals[8] / supervised)
        if mapped and supervised > 0:
            self._metrics[mode]["alignment/mapped"].append(totals[5 + len(exact)] / supervised)
        if mapped and totals[5 + len(exact)] > 0:
            self._metrics[mode]["alignment/leftover"].append(totals[6 + len(exact)] / totals[5 + len(exact)])
        first = 5 + len(exact) + len(mapped)
        for i, name in enumerate(self.teacher.names):
            teacher_kl_sum, teacher_count = totals[first + 2 * i : first + 2 + 2 * i]
            if teacher_count > 0:
                self._metrics[mode][f"teacher_kl/sampled/{name}"].append(teacher_kl_sum / teacher_count)
        if count > 0:
            self._metrics[mode]["teacher_kl/sampled"].append(kl_sum / count)
            self._metrics[mode]["teacher_nll"].append(nll_sum / count)
        if supervised > 0:
            self._metrics[mode]["entropy"].append(entropy_sum / supervised)


def _discounted_reverse_cumsum(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """`y_t = sum_{s >= t} gamma^(s - t) x_s` along dim 1, as `y_t = x_t + gamma y_{t+1}` from the last position:
    O(B*T) memory, where a `(T, T)` discount matrix takes about 1 GiB at T = 16k. (Scaling by `gamma^-t` to use
    `cumsum` would overflow on long rows.)"""
    out = torch.empty_like(x)
    running = torch.zeros_like(x[:, 0])
    for t in range(x.size(1) - 1, -1, -1):
        running = x[:, t] + gamma * running
        out[:, t] = running
    return out


def after_answer_advantages(
    tokenizer, completion_ids, supervised, ends, logps, teacher_logps
) -> list[tuple[bool, float]]:
    """For each rollout that writes a final-answer line, what the sampled-token signal says at the state right after
    it: whether the student ended there, and the teacher's log-prob of the token it sampled less its own (the
    per-token advantage of `reverse_kl`). A teacher that rewards going on after `#### N` teaches a loop
    (`teacher_end/advantage_after_answer_*`, `lens.endings`)."""
    found = []
    for row in range(completion_ids.size(0)):
        kept = supervised[row].nonzero().flatten()
        if not len(kept):
            continue
        pieces = tokenizer.batch_decode(completion_ids[row, : kept[-1] + 1, None])
        state = answer_end_position(pieces)
        if state is None or state > kept[-1] or not supervised[row, state]:
            continue
        advantage = (teacher_logps[row, state] - logps[row, state]).item()
        if math.isfinite(advantage):
            found.append((bool(ends[row, state]), advantage))
    return found
