"""The checks of [`OnPolicyDistillConfig`]'s settings, mixed into the config: which values each option takes, which
GRPO settings no OPD loss reads, which combinations are refused (and why), and the batch sizes of one rollout per
prompt. Each error names the setting and the fix."""

from __future__ import annotations

import dataclasses
import math
import warnings

SIGNALS = ("reverse_kl", "continuation", "divergence")
MIX_SOURCES = ("learner", "dataset", "teacher")
TEACHER_MODEL_KINDS = ("base", "live", "ema")
SERVER_SETTINGS = (  # read by served teachers only
    "teacher_server_timeout",
    "teacher_server_max_retries",
    "teacher_server_retry_backoff",
    "teacher_server_chunk_size",
    "teacher_server_overlap",
)


class ConfigChecks:
    """Mixed into [`OnPolicyDistillConfig`] (before `GRPOConfig`): its `__post_init__` calls these."""

    def _count_batches_in_pairs_for_grpo(self) -> int | None:
        """GRPO checks that its generation batch holds whole groups of at least 2 rollouts. Groups of one rollout fit
        any batch, so GRPO is shown groups of 2 in a generation batch of twice the micro-batches (or rollouts), which
        always holds whole pairs, and evaluation in groups of one; `_count_batches_in_ones_again` puts the real
        sizes back. Only GRPO's own fields change: the per-device batch sizes, which TrainingArguments hands to
        DeepSpeed, stay as given. Returns the `generation_batch_size` the user gave, if any."""
        if self.reward_weight != 0.0:
            raise ValueError(
                "num_generations=1 with reward_weight != 0: GRPO's reward advantage compares rollouts of the same "
                "prompt, so it needs num_generations >= 2; use num_generations >= 2 or reward_weight=0.0"
            )
        self.num_generations = 2
        if self.num_generations_eval is None:
            self.num_generations_eval = 1  # any global eval batch holds whole groups of one
        given = self.generation_batch_size
        if given is not None:
            self.generation_batch_size = 2 * given
        else:
            self.steps_per_generation = 2 * (self.steps_per_generation or self.gradient_accumulation_steps)
        return given

    def _count_batches_in_ones_again(self, given_generation_batch_size: int | None) -> None:
        self.num_generations = 1
        global_batch = self.per_device_train_batch_size * self.world_size
        if given_generation_batch_size is not None and given_generation_batch_size % global_batch != 0:
            # GRPO checked the doubled size, which twice an indivisible one may pass
            raise ValueError(
                f"generation_batch_size ({given_generation_batch_size}) must be divisible by the global batch size "
                f"({global_batch})."
            )
        self.generation_batch_size //= 2
        self.steps_per_generation = self.generation_batch_size // global_batch

    def _check_grpo_loss_settings(self):
        """GRPO loss settings the on-policy distillation losses have no place for: refused, never silently ignored."""
        if self.top_entropy_quantile < 1.0:
            raise ValueError(
                f"top_entropy_quantile={self.top_entropy_quantile}: GRPO's high-entropy token mask is not applied by "
                "on-policy distillation, which supervises every state of a rollout (and the reverse-KL advantage "
                "already weighs each token by how far the teacher disagrees there). Leave top_entropy_quantile=1.0"
            )
        if self.entropy_coef != 0.0 or self.use_adaptive_entropy:
            raise ValueError(
                f"entropy_coef={self.entropy_coef}, use_adaptive_entropy={self.use_adaptive_entropy}: GRPO's entropy "
                "bonus is not part of the on-policy distillation losses, where the teacher sets how spread the "
                "student's distribution should be (the reverse KL holds the student's own entropy term). Leave "
                "entropy_coef=0.0 and use_adaptive_entropy=False"
            )
        if self.off_policy_mask_threshold is not None:
            raise ValueError(
                f"off_policy_mask_threshold={self.off_policy_mask_threshold}: GRPO's off-policy sequence mask drops "
                "negative-advantage rollouts an older policy sampled; on-policy distillation trains each rollout "
                "with the policy that sampled it (reverse_kl) or at given states (continuation, divergence), and "
                "applies no such mask. Leave off_policy_mask_threshold unset"
            )
        clip = {"epsilon": 0.2, "epsilon_high": None, "delta": None, "importance_sampling_level": "token"}
        changed = {name: getattr(self, name) for name, default in clip.items() if getattr(self, name) != default}
        if changed:
            raise ValueError(
                f"{changed}: these shape GRPO's clipped importance ratio between the policy that sampled a rollout "
                "and the one trained on it, which on-policy distillation's losses do not have (see signal). Leave "
                "them at GRPO's defaults"
            )
        if self.constant_advantage is not None and self.signal != "reverse_kl":
            raise ValueError(
                f"constant_advantage={self.constant_advantage} with signal={self.signal!r}: the constant replaces the "
                "reverse_kl advantage; continuation and divergence have no sampled-token advantage to replace. Use "
                "signal='reverse_kl' or leave constant_advantage unset"
            )
        if self.teacher_row_shift < 0:
            raise ValueError(
                f"teacher_row_shift must be 0 (off) or a positive number of rows, got {self.teacher_row_shift}"
            )
        if self.teacher_row_shift and (self.signal == "continuation" or self.constant_advantage is not None):
            raise ValueError(
                f"teacher_row_shift={self.teacher_row_shift} with "
                + ("signal='continuation'" if self.signal == "continuation" else "constant_advantage")
                + ": the shift moves the teacher's values on the student's rollouts between rows, which this "
                "trains on none of. Use signal='reverse_kl' or 'divergence' without constant_advantage, or leave "
                "teacher_row_shift=0"
            )
        if self.teacher_row_shift and (self.teacher_model_kind is not None or self.teacher_model_server_url):
            raise ValueError(
                f"teacher_row_shift={self.teacher_row_shift} needs an in-process teacher of the student's tokenizer, "
                "not a self or served teacher: load the teacher in process, or leave teacher_row_shift=0"
            )
        if self.reward_weight != 0.0 and self.signal != "reverse_kl":
            raise ValueError(
                f"reward_weight={self.reward_weight} with signal={self.signal!r}: the reward advantage is added to the "
                "reverse_kl advantage only; continuation and divergence train on the teacher's tokens or "
                "distributions, with no sampled-token policy gradient to weight. Use signal='reverse_kl' or leave "
                "reward_weight=0.0"
            )

    def check_settings_are_read(self, served: bool | None = None, loads_a_path: bool | None = None) -> None:
        """OPD's own settings that the run never reads, refused when set away from their defaults (as the GRPO
        settings above are): `served` says whether a teacher runs on a server, `loads_a_path` whether one is loaded
        from a path or hub id; `None` while the teachers are unknown (the trainer checks again with its
        `teacher_model`)."""
        divergence, maybe_served = self.signal == "divergence", served is not False
        # State selection skips `learner` rollouts only, and the cache's staleness is measured on `learner` tokens
        learner = self.state_source_mix.get("learner", 0.0) > 0
        readers = {  # setting: (what reads it, whether this run has that)
            "kl_discount": ("signal='reverse_kl'", self.signal == "reverse_kl"),
            "jsd_beta": ("signal='divergence'", divergence),
            "continuation_length": ("signal='continuation'", self.signal == "continuation"),
            "skip_correct_rollouts": ("learner states in state_source_mix", learner),
            "correct_reward": ("skip_correct_rollouts=True", self.skip_correct_rollouts),
            "recheck_fraction": ("skip_correct_rollouts=True", self.skip_correct_rollouts),
            "teacher_cache_max_staleness": (
                "teacher_cache_steps > 1 and learner states in state_source_mix",
                self.teacher_cache_steps > 1 and learner,
            ),
            "teacher_update_rate": ("teacher_model_kind='ema'", self.teacher_model_kind == "ema"),
            "teacher_prompt_template": (
                "a teacher_model_kind or teacher_reads_context",
                self.teacher_model_kind is not None or self.teacher_reads_context,
            ),
            "teacher_model_init_kwargs": ("a teacher loaded from a path or hub id", loads_a_path is not False),
            # (a served teacher of another tokenizer reads it under any signal, one of the student's with divergence
            # only: `refuse_unread_top_k` once the teachers' tokenizers are known)
            "teacher_top_k": ("a served teacher, with signal='divergence' or another tokenizer", maybe_served),
            **{name: ("a served teacher", maybe_served) for name in SERVER_SETTINGS},
        }
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        unread = [
            f"{name}={getattr(self, name)!r} (read only with {reader}; default {defaults[name]!r})"
            for name, (reader, read) in readers.items()
            if not read and getattr(self, name) != defaults[name]
        ]
        if unread:
            raise ValueError(
                f"{'; '.join(unread)}: this run (signal={self.signal!r}, teacher_model_kind="
                f"{self.teacher_model_kind!r}) never reads it, so it would train exactly as with the default. Leave it "
                "at its default, or choose the signal or teacher that reads it"
            )

    def _warn_about_reverse_kl_off_policy(self):
        given = [source for source in ("dataset", "teacher") if self.state_source_mix.get(source, 0.0) > 0]
        if self.signal == "reverse_kl" and given:
            warnings.warn(
                f"signal='reverse_kl' with {' and '.join(given)} states in state_source_mix: the reverse_kl loss is a "
                "reverse-KL policy gradient only on tokens the student sampled. On given tokens y_t its gradient is "
                "that of (log p_S(y_t) - log p_T(y_t))^2 / 2 (with kl_discount=0): it pulls the student's log-prob of "
                "each given token toward the teacher's, a heuristic rather than a KL. For a divergence at those "
                "states, use signal='divergence'",
                UserWarning,
                stacklevel=4,  # the caller of the config's __init__
            )

    def _check_horizon(self):
        if self.horizon_growth < 0:
            raise ValueError(
                f"horizon_growth must be a number of tokens (0 for a fixed horizon), got {self.horizon_growth}"
            )
        if self.horizon is None:
            if self.horizon_growth:
                raise ValueError(
                    f"horizon_growth={self.horizon_growth} grows the rollout horizon, which is unset: give the first "
                    "horizon too (horizon=16 starts at 16 tokens), or leave horizon_growth at 0"
                )
            return
        if not 1 <= self.horizon <= self.max_completion_length:
            raise ValueError(
                f"horizon={self.horizon} must be between 1 and max_completion_length={self.max_completion_length} "
                "tokens (unset samples max_completion_length)"
            )
        if self.mask_truncated_completions:
            raise ValueError(
                "mask_truncated_completions=True masks every rollout cut at the horizon (it ends without eos), so a "
                "horizon would supervise almost nothing: leave mask_truncated_completions at False with a horizon"
            )

    def _check_state_selection(self):
        if not 0.0 <= self.recheck_fraction <= 1.0:
            raise ValueError(
                f"recheck_fraction must be a share in [0, 1] of the correct rollouts the teacher scores anyway, got "
                f"{self.recheck_fraction}"
            )
        if not self.skip_correct_rollouts:
            return
        if not math.isfinite(self.correct_reward):
            raise ValueError(f"correct_reward must be a finite reward, got {self.correct_reward}")
        if self.signal == "continuation":
            raise ValueError(
                "skip_correct_rollouts=True with signal='continuation': there the teacher writes the supervised tokens "
                "from a cut point of each rollout rather than scoring the rollout's own tokens, and skipping is not "
                "supported for it yet. Use signal='reverse_kl' or 'divergence', or leave skip_correct_rollouts=False"
            )
        if self.reward_weight != 0.0:
            raise ValueError(
                f"skip_correct_rollouts=True with reward_weight={self.reward_weight}: a skipped rollout carries no loss "
                "weight, so it would lose its reward advantage too (and the correct rollouts are the ones GRPO's "
                "advantage favours). Leave reward_weight=0.0 with skip_correct_rollouts"
            )

    def _check_teacher_cache(self):
        if self.teacher_cache_steps < 1:
            raise ValueError(
                f"teacher_cache_steps must be a number of optimizer steps (1: no cache), got {self.teacher_cache_steps}"
            )
        staleness = self.teacher_cache_max_staleness
        if staleness is not None and not (math.isfinite(staleness) and staleness >= 0):
            raise ValueError(
                f"teacher_cache_max_staleness must be a non-negative sampled KL in nats (None: refresh by age only), got "
                f"{staleness}"
            )
        if self.teacher_cache_steps == 1:
            return
        refused = {
            "signal='continuation'": (
                self.signal == "continuation",
                "the teacher writes the supervised tokens from a fresh cut of each rollout, which the cache does not "
                "keep (not supported yet). Use signal='reverse_kl' or 'divergence'",
            ),
            "skip_correct_rollouts=True": (
                self.skip_correct_rollouts,
                "state selection decides per generation batch which rollouts the teacher scores; combining it with a "
                "reused batch is not supported yet. Use one lever at a time",
            ),
            f"teacher_model_kind={self.teacher_model_kind!r}": (
                self.teacher_model_kind is not None,
                "a 'live' or 'ema' self teacher moves with the student, so its cached signal would go stale in a way "
                "the cache's staleness (the student's own drift) does not measure; 'base' is not supported yet. Use a "
                "separate teacher",
            ),
            "use_vllm=True": (
                self.use_vllm,
                "GRPO's vLLM importance-sampling ratio is computed for the policy that sampled the batch only, and "
                "would be wrong on its reuses. Sample with the trainer's own generate",
            ),
        }
        for setting, (applies, why) in refused.items():
            if applies:
                raise ValueError(
                    f"teacher_cache_steps={self.teacher_cache_steps} with {setting}: {why}, or leave "
                    "teacher_cache_steps=1"
                )
        if self.signal == "reverse_kl":
            warnings.warn(
                f"teacher_cache_steps={self.teacher_cache_steps} with signal='reverse_kl': a reused batch's rollouts get "
                "a policy gradient from a student that did not sample them, with no importance ratio to correct it (the "
                "staleness GRPO clips and this config otherwise refuses: see steps_per_generation), so the gradient is "
                "biased, more so as the student moves; teacher_cache_max_staleness bounds how far. On the lab one "
                "16-step run with teacher_cache_steps=4 and teacher_cache_max_staleness=0.03 saw the teacher KL on "
                "fresh rollouts rise from 0.34 to 0.56, where the run without the cache stayed within 0.29-0.41. "
                "signal='divergence' has no sampled-token gradient",
                UserWarning,
                stacklevel=4,  # the caller of the config's __init__
            )

    def _check_self_teacher_settings(self):
        if self.teacher_model_kind is not None and self.teacher_reads_context:
            raise ValueError(
                f"teacher_reads_context=True with teacher_model_kind={self.teacher_model_kind!r}: a self teacher always "
                "reads the row's privileged_context (teacher_prompt_template); teacher_reads_context is for a "
                "separate teacher. Leave it False"
            )
        if self.teacher_reads_context or self.teacher_model_kind is not None:
            self._check_context_template()
        if self.teacher_model_kind is None:
            return
        if self.teacher_model_kind not in TEACHER_MODEL_KINDS:
            raise ValueError(
                f"teacher_model_kind={self.teacher_model_kind!r} is not one of {TEACHER_MODEL_KINDS} (or None for a "
                "separate teacher model)"
            )
        if self.teacher_model_server_url is not None:
            raise ValueError(
                f"teacher_model_kind={self.teacher_model_kind!r} makes the student its own teacher, but "
                f"teacher_model_server_url={self.teacher_model_server_url!r} names a served one: set only one"
            )
        if not 0.0 < self.teacher_update_rate <= 1.0:
            raise ValueError(f"teacher_update_rate must be in (0, 1], got {self.teacher_update_rate}")
        if self.teacher_model_kind == "ema" and self.save_only_model:
            raise ValueError(
                "teacher_model_kind='ema' with save_only_model=True: the EMA teacher is saved beside the RNG states, "
                "which save_only_model skips, so no checkpoint could resume the teacher it averaged (a resume would "
                "start a new average). Leave save_only_model=False, or use teacher_model_kind='base' or 'live'"
            )

    def _check_context_template(self):
        missing = [p for p in ("{prompt}", "{privileged_context}") if p not in self.teacher_prompt_template]
        if missing:
            raise ValueError(
                f"teacher_prompt_template={self.teacher_prompt_template!r} lacks {' and '.join(missing)}: the "
                "teacher's prompt is built from both the row's prompt and its privileged context"
            )

    def _check_teacher_server_settings(self):
        if self.temperature != 1.0:
            raise ValueError(
                f"temperature={self.temperature} with teacher_model_server_url: vLLM scores given tokens at "
                "temperature 1 whatever the request says (prompt log-probs come from unscaled logits), so the "
                "teacher would be compared at another temperature than the student; set temperature=1.0 or load the "
                "teacher in the training processes"
            )
        if self.teacher_server_timeout <= 0:
            raise ValueError(f"teacher_server_timeout must be positive seconds, got {self.teacher_server_timeout}")
        if self.teacher_server_max_retries < 0 or self.teacher_server_retry_backoff < 0:
            raise ValueError("teacher_server_max_retries and teacher_server_retry_backoff must not be negative")
        if self.teacher_server_chunk_size < 0:
            raise ValueError(f"teacher_server_chunk_size must be >= 0, got {self.teacher_server_chunk_size}")
