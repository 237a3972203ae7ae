"""`StateLensGRPOTrainer`: TRL's `GRPOTrainer`, plus a record of the learner states each step supervises."""

from __future__ import annotations

import hashlib
import json
import math

import torch
import torch.nn.functional as F
from accelerate.utils import gather_object
from trl import GRPOTrainer

from .. import collective
from ..answers import repeats_itself
from ..checks import (
    FiniteGradientsMixin,
    bound_arguments,
    check_prompt_lengths,
    check_tokenizer,
    check_train_dataset,
    context_length,
    load_safetensors_only,
    tokenizer_of,
)
from ..guards import attach_guards, check_mode
from ..lens.callback import attach_state_logging
from ..lens.endings import END_KINDS, answer_end_position, end_kinds
from ..lens.recorder import StateRecorderMixin
from ..preflight import attach_preflight, check_preflight_settings


class StateLensGRPOTrainer(StateRecorderMixin, FiniteGradientsMixin, GRPOTrainer):
    """[`~trl.GRPOTrainer`] that records, for every optimizer step, which states it supervised.

    Same arguments, same training: the records reuse the per-token log-probs and entropies the GRPO loss computes,
    with no extra forward pass. Every completion token the policy loss counts (its completion and tool masks, and the
    `top_entropy_quantile`, `off_policy_mask_threshold` and vLLM importance-sampling masks when set) is a `learner`
    state; its prefix length is its position in the completion, its weight the advantage the loss applies, and each
    sequence carries its reward. Each prompt's group of rollouts is recorded too (`groups.jsonl`: a hash of the
    prompt, the group's rewards and, when the data has the column, its `solution_steps`): where the reward signal is,
    since a group whose rewards are all equal gives every one of its tokens a zero advantage.

    Bad input (an empty dataset, no `prompt` column, a tokenizer without eos, a prompt that leaves no room for
    `max_completion_length` tokens in the model's context) is refused before training, with the fix in the message; a
    reward function that raises stops training with the step named, and a non-finite gradient stops it before the
    optimizer applies it, except an fp16 overflow step, which the loss scaler skips: counted in
    `statelens/skipped_overflow_steps` (docs/bad-input.md).

    Args:
        *args, **kwargs: the arguments of [`~trl.GRPOTrainer`].
        state_logging (`bool`, *optional*, defaults to `True`):
            Attach a default [`StateLoggingCallback`] (records and ledger, no probe drift) unless `callbacks` already
            holds one. With `False` and no such callback, nothing is recorded.
        guards (`str`, *optional*, defaults to `"warn"`):
            Attach a [`~trl_statelens.guards.RunGuards`] in this mode unless `callbacks` already holds one: `"warn"`
            (log and record each guard that fires), `"stop"` (also stop training with a checkpoint saved) or `"off"`
            (docs/guards.md).
        preflight (`str`, *optional*, defaults to `"warn"`):
            Measured checks before the first step (docs/preflight.md): the end tokens, how the student's own rollouts
            end (cut share, repeats) and the reward spread of its groups. `"warn"` writes `statelens/preflight.json`
            and logs the result, `"strict"` also refuses to train when a check fails, `"off"` runs none.
        preflight_prompts (`int`, *optional*, defaults to `16`):
            Rollouts the preflight samples (`preflight_prompts // num_generations` prompts, each `num_generations`
            times).
    """

    _has_rewards = True  # a subclass may train without reward functions (OnPolicyDistillTrainer): no reward groups

    def __init__(
        self,
        *args,
        state_logging: bool = True,
        guards: str = "warn",
        preflight: str = "warn",
        preflight_prompts: int = 16,
        **kwargs,
    ):
        check_mode(guards)
        check_preflight_settings(preflight, preflight_prompts)
        given = bound_arguments(GRPOTrainer, args, kwargs)
        what = type(self).__name__
        check_train_dataset(given.get("train_dataset"), ("prompt",), what)
        check_tokenizer(tokenizer_of(given.get("processing_class"), given["model"]))
        load_safetensors_only(given.get("args"))
        super().__init__(*args, **kwargs)
        context = context_length(self.model)
        check_prompt_lengths(self.train_dataset, self._tokenizer, context, self._tokens_after_prompt(), what)
        self._loss_logps_and_entropies = None
        self._loss_masks = []
        self._reward_groups = []
        # This step's rollouts as (end kind, text), and the teacher's log-probs of the end tokens the student
        # sampled (OnPolicyDistillTrainer): `_collect_rollout_endings` turns them into `ends/*`
        self._rollout_endings: list[tuple[str, str]] = []
        self._teacher_end_logps: list[float] = []
        self._advantages_after_answer: list[tuple[bool, float]] = []  # (ended there, teacher - student log-prob)
        self._end_ids = list(self.eos_token_ids)  # GRPO's own: what its generation stops at
        attach_state_logging(self, state_logging)
        attach_guards(self, guards)
        attach_preflight(self, preflight, preflight_prompts)

    def _tokens_after_prompt(self) -> int:
        """The most tokens a training sequence holds after its prompt: the completion."""
        return self.args.max_completion_length

    def _rollout_limit(self) -> int:
        """The most tokens this generation batch's rollouts were sampled with: a rollout that holds as many without
        an end token was cut there."""
        return self.max_completion_length

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        try:
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        except Exception as error:
            raise RuntimeError(
                f"a reward function ({', '.join(self.reward_func_names)}) raised {type(error).__name__} in step "
                f"{self.state.global_step + 1}: {error}. Training stopped; finished steps are in the ledger and the "
                "last checkpoint. Return None (or NaN) for a completion the function cannot score: GRPO then ignores "
                "it for that function."
            ) from error
        self._rewards_per_func = rewards_per_func  # all processes' completions
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        # The weighted reward sum TRL logs as `reward`, for this process's completions; it rides along with the
        # batch (shuffled and split with it) to the loss, where the states are recorded
        weights = self.reward_weights.to(self._rewards_per_func.device)
        rewards = (self._rewards_per_func * weights).nansum(dim=1)
        rewards[torch.isnan(self._rewards_per_func).all(dim=1)] = torch.nan
        num_local = output["prompt_ids"].size(0)
        start = self.accelerator.process_index * num_local
        output["rewards"] = rewards[start : start + num_local]
        # recording, with rewards, and not an evaluation's rollouts
        if self._state_buffer is not None and self._has_rewards and self.model.training:
            self._reward_groups += self._group_rewards(inputs, rewards)
        # Each rollout's end (an index into END_KINDS), judged here where the rollout's limit is known: it rides
        # along with the batch to the loss, where the ledger's sequences are recorded
        completion_ids = output["completion_ids"]
        kinds = end_kinds(completion_ids, self._end_ids, self._rollout_limit(), self._tokenizer.pad_token_id)
        output["end_kind"] = torch.tensor([END_KINDS.index(k) for k in kinds], device=completion_ids.device)
        if self._state_buffer is not None and self.model.training:
            texts = self._tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            self._rollout_endings += list(zip(kinds, texts))
        return output

    def _collect_rollout_endings(self) -> dict[str, float]:
        """`ends/*` over this step's rollouts on every rank (a collective: every rank calls it): the share ending
        with the end token, cut at the length limit and stopped short, the share repeating itself and the share
        writing a final-answer line; and with a teacher, over the states the student sampled in the step's
        micro-batches, its mean log-prob of the end tokens there and its advantage right after the answer. A step
        that samples no rollouts (`steps_per_generation` > `gradient_accumulation_steps`: a later step of the same
        generation batch) logs no `ends/*`, but its `teacher_end/*` still."""
        endings, self._rollout_endings = self._rollout_endings, []
        teacher, self._teacher_end_logps = self._teacher_end_logps, []
        after, self._advantages_after_answer = self._advantages_after_answer, []
        ending = [advantage for ended, advantage in after if ended]
        going_on = [advantage for ended, advantage in after if not ended]
        counts = [sum(k == kind for k, _ in endings) for kind in END_KINDS] + [
            sum(repeats_itself(t) for _, t in endings),
            sum(answer_end_position([t]) is not None for _, t in endings),
        ]
        totals = collective.sum_over_ranks(
            self.accelerator,
            torch.tensor(
                [
                    *counts,
                    len(endings),
                    sum(ending),
                    len(ending),
                    sum(going_on),
                    len(going_on),
                    sum(teacher),
                    len(teacher),
                ],
                dtype=torch.float64,
            ),
        )
        metrics = {}
        rollouts = totals[len(END_KINDS) + 2]
        if rollouts:
            metrics.update({f"ends/{kind}": totals[i] / rollouts for i, kind in enumerate(END_KINDS)})
            metrics["ends/repeats"] = totals[len(END_KINDS)] / rollouts
            metrics["ends/after_answer"] = totals[len(END_KINDS) + 1] / rollouts
        after_answer_ending, ended_count, after_answer_going_on, going_on_count, at_ends, ends_count = totals[-6:]
        if ends_count:
            metrics["teacher_end/logp_at_student_ends"] = at_ends / ends_count
        if ended_count:
            metrics["teacher_end/advantage_after_answer_end"] = after_answer_ending / ended_count
        if going_on_count:
            metrics["teacher_end/advantage_after_answer_go_on"] = after_answer_going_on / going_on_count
        return metrics

    def _group_rewards(self, inputs: list[dict], rewards: torch.Tensor) -> list[dict]:
        """Each prompt's group of rollouts in this generation batch, all processes' (every rank holds the same)."""
        size = self.num_generations
        prompts = list(self._logs["prompt"])[-len(rewards) :]  # TRL's log of this batch's gathered prompts
        # the same column on every rank (one data set), so every rank gathers or none does
        steps = gather_object([row["solution_steps"] for row in inputs]) if "solution_steps" in inputs[0] else None
        groups = []
        for start in range(0, len(rewards), size):
            prompt = json.dumps(prompts[start], sort_keys=True)
            group = {
                "prompt_id": hashlib.sha1(prompt.encode()).hexdigest()[:12],
                "rewards": [None if math.isnan(r) else r for r in rewards[start : start + size].tolist()],
            }
            if steps is not None:
                group["solution_steps"] = steps[start]
            groups.append(group)
        return groups

    def _collect_reward_groups(self) -> list[dict]:
        groups, self._reward_groups = self._reward_groups, []
        return groups

    def _get_per_token_logps_and_entropies(self, *args, compute_entropy=False, **kwargs):
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
            *args, compute_entropy=compute_entropy, **kwargs
        )
        if compute_entropy:  # only the loss asks for entropies: keep its tensors for the records
            self._loss_logps_and_entropies = (logps, entropies)
        return logps, entropies, aux_loss

    # GRPO's loss drops tokens beyond its completion and tool masks: the high-entropy mask (`top_entropy_quantile`)
    # and the off-policy sequence mask (`off_policy_mask_threshold`). The loss computes them once; keep them for the
    # records, which count only the tokens the policy loss counts.
    def get_high_entropy_mask(self, entropies, mask, threshold):
        self._loss_masks.append(super().get_high_entropy_mask(entropies, mask, threshold))
        return self._loss_masks[-1]

    def get_off_policy_mask(self, **kwargs):
        self._loss_masks.append(super().get_off_policy_mask(**kwargs))
        return self._loss_masks[-1]

    def _compute_loss(self, model, inputs):
        self._loss_masks = []
        loss = super()._compute_loss(model, inputs)
        if self.model.training and self._loss_logps_and_entropies is not None:
            logps, entropies = self._loss_logps_and_entropies
            prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
            num_prompt, num_completion = prompt_ids.size(1), completion_ids.size(1)
            mask = (
                inputs["completion_mask"]
                if "tool_mask" not in inputs
                else inputs["completion_mask"] * inputs["tool_mask"]
            )
            for loss_mask in self._loss_masks:
                mask = mask * loss_mask  # (B, T) entropy mask, (B, 1) off-policy mask
            if self.use_vllm and self.vllm_importance_sampling_correction and self.loss_type != "vespo":
                # vLLM's "token_mask"/"sequence_mask" modes zero the ratio of the tokens they drop
                mask = mask * (inputs["importance_sampling_ratio"] != 0)

            def align(completion_values):  # (B, T) completion values -> (B, P + T), zero over the prompt
                return F.pad(completion_values, (num_prompt, 0))

            advantages = inputs["advantages"]
            self._record_states(
                input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
                supervised_mask=align(mask.bool()),
                logps=align(logps),
                entropy=align(entropies),
                source="learner",
                prefix_len=align(torch.arange(num_completion, device=logps.device).expand_as(logps)),
                attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
                weights=advantages if advantages.dim() == 1 else align(advantages),
                rewards=inputs.get("rewards"),
                end_kinds=inputs.get("end_kind"),
            )
        self._loss_logps_and_entropies = None
        return loss
