"""Configuration of :class:`~trl_statelens.OnPolicyDistillTrainer`: the options, grouped by what they control, each
documented in the class docstring. The checks of their values are in :mod:`.config_checks`."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

from trl import DistillationConfig, GRPOConfig

from ..guards import check_mode
from ..preflight import check_preflight_settings
from .config_checks import MIX_SOURCES, SIGNALS, TEACHER_MODEL_KINDS, ConfigChecks


@dataclass
class OnPolicyDistillConfig(ConfigChecks, GRPOConfig):
    r"""
    Configuration class for [`OnPolicyDistillTrainer`]: the student samples, a teacher supervises the states.

    It extends [`~trl.GRPOConfig`] (generation, batching, `use_vllm`, logging: all fields keep their meaning) with
    the fields below. GRPO's policy-loss settings do not apply: the teacher, not a reference model, is what the student
    is pulled toward, and the loss is a token mean over the generation batch as GRPO's `"dapo"`. So `beta` must stay
    `0.0` (no reference model is loaded), `loss_type` `"dapo"` and `num_iterations` `1`; with `signal="reverse_kl"`,
    `steps_per_generation` must divide `gradient_accumulation_steps` (each rollout trains the policy that sampled it:
    there is no clipped importance ratio to correct staleness). GRPO settings no OPD loss reads are refused at config
    time: `top_entropy_quantile` below 1, the entropy bonus (`entropy_coef`, `use_adaptive_entropy`),
    `off_policy_mask_threshold`, and the ratio-clipping settings (`epsilon`, `epsilon_high`, `delta`,
    `importance_sampling_level`) away from their defaults. So are this config's own settings where the run never reads
    them (set away from their defaults): `kl_discount` without `reverse_kl`, `jsd_beta` without `divergence`,
    `continuation_length` without `continuation`, `teacher_update_rate` without `teacher_model_kind="ema"`,
    `teacher_prompt_template` without a `teacher_model_kind`, `teacher_model_init_kwargs` without a teacher loaded
    from a path, `teacher_top_k` and the `teacher_server_*` settings without a served teacher (checked here where the
    teacher is known, by the trainer otherwise), `skip_correct_rollouts` and `teacher_cache_max_staleness` with no
    `learner` share in `state_source_mix` (only learner rollouts are skipped, only their tokens measure the cache's
    staleness). A Mixture-of-Experts student's router load-balancing loss
    (`router_aux_loss_coef`, or the model config's) is added to every signal's loss as GRPO adds it. The teacher
    scores the generation batch in chunks of `per_device_train_batch_size` rows (`per_device_eval_batch_size` in
    evaluation), as GRPO scores its reference model. With vLLM, the `reverse_kl` loss applies GRPO's vLLM
    importance-sampling correction (`vllm_importance_sampling_correction`); `continuation` (teacher-written tokens)
    and `divergence` (full-vocabulary, as TRL's `DistillationTrainer`) have no sampled-token gradient to correct.

    A truncated rollout (no eos within `max_completion_length`: the student's, the teacher's with the `teacher` state
    source, or a `dataset` reference too long to fit with its eos, cut at the limit without one) is, with
    `mask_truncated_completions=True`, masked whole as GRPO masks it and supervises nothing under any signal:
    `reverse_kl` gives its tokens no advantage and no loss term, `continuation` neither cuts it nor asks the teacher to
    continue it, `divergence` compares no distribution at its states. Without the flag it is supervised like any other
    rollout (`continuation` cuts it anywhere in its tokens).

    Notation: $s_t$ is a state (prompt plus prefix), $y_t$ the token that follows it, $p_S$ the student and $p_T$ the
    teacher.

    `num_generations` may be `1` (GRPO requires at least 2 for its group advantage): with the teacher's per-token
    signal no group is needed, and one rollout per prompt puts as many distinct prompts in a step as rollouts, as TRL's
    `DistillationTrainer` does (the lab diagnosis in STUDY.md measured what that changes). It needs
    `reward_weight=0`.

    Parameters:
        signal (`str`, *optional*, defaults to `"reverse_kl"`):
            What the teacher supplies at each supervised state:

            - `"reverse_kl"`: the sampled-token reverse KL as a per-token advantage,
              $A_t = -\sum_{k \ge 0} \gamma^k \,(\log p_S(y_{t+k}|s_{t+k}) - \log p_T(y_{t+k}|s_{t+k}))$ with
              $\gamma$ = `kl_discount`, in a policy-gradient loss $-\frac{1}{N}\sum_t A_t \log p_S(y_t|s_t)$
              (stop-gradient on $A_t$). One teacher forward per rollout; the student's log-probs come from the loss's
              own forward.
            - `"continuation"`: cut each rollout at a prefix length drawn uniformly from its tokens, let the teacher
              write `continuation_length` tokens from that student state, and train the student with cross-entropy
              on the teacher's tokens, $-\frac{1}{N}\sum_t \log p_S(c_t | s, c_{<t})$. The first teacher token sits
              on a `learner` state, the following ones on `teacher` states.
            - `"divergence"`: the full-vocabulary generalised JSD with `jsd_beta` between student and teacher
              next-token distributions at every completion state, computed in chunks over positions with TRL's
              kernel (the `(B, T, V)` logits are never materialised); `jsd_beta=1` is TRL's
              `DistillationTrainer(beta=1)` loss. With a served teacher, the same divergence on the teacher's
              top-k tokens plus a tail bucket (see `teacher_top_k`); there the student's full log-softmax at the
              supervised positions is formed (in chunks of 1024 positions) and kept for the backward. From an
              in-process teacher of another tokenizer, the same divergence with the teacher's distribution carried
              onto the student's vocabulary, at the positions where both tokenizations cut only
              (docs/cross-tokenizer.md).
        kl_discount (`float`, *optional*, defaults to `0.0`):
            Discount $\gamma$ of future per-token reverse KL in the `reverse_kl` advantage; `0` uses each token's
            own KL only.
        continuation_length (`int`, *optional*, defaults to `16`):
            Most tokens the teacher writes from each cut point with `signal="continuation"`, sampled with the
            student's settings (temperature, top-p/k, min-p, repetition penalty); a continuation ends at the
            teacher's eos, whatever `min_new_tokens` the rollouts are held to.
        jsd_beta (`float`, *optional*, defaults to `1.0`):
            Interpolation of the generalised JSD with `signal="divergence"`: `0.0` forward KL, `1.0` reverse KL.
            (GRPO's own `beta`, the KL coefficient against a reference model, must stay `0.0`: see above.)
        state_source_mix (`dict[str, float]` or `str`, *optional*):
            Per-sample probabilities of where a rollout's states come from: `"learner"` (the student's own rollout),
            `"dataset"` (the reference answer in `reference_column`, teacher-forced) or `"teacher"` (the teacher's
            own rollout). Every sample is supervised with the same `signal`. Defaults to `{"learner": 1.0}`. On the
            command line, a JSON string: `--state_source_mix '{"learner": 0.8, "teacher": 0.2}'`. `reverse_kl` is a
            reverse-KL policy gradient only on the student's own samples: on `dataset` or `teacher` tokens $y_t$ its
            gradient is that of $\frac{1}{2}(\log p_S(y_t|s_t) - \log p_T(y_t|s_t))^2$ (with `kl_discount=0`), a
            heuristic that matches the two log-probs of the given token, not a KL (a warning says so); `continuation`
            and `divergence` mean the same at any state.
        reference_column (`str`, *optional*, defaults to `"completion"`):
            Dataset column with the reference answer used by the `"dataset"` state source.
        reward_weight (`float`, *optional*, defaults to `0.0`):
            Weight of GRPO's group-normalised reward advantage (from `reward_funcs`) added to the `reverse_kl`
            advantage. `0` ignores rewards (they are still computed and logged when reward functions are given).
            Only `signal="reverse_kl"` has an advantage to add it to: other signals refuse a non-zero weight.
        constant_advantage (`float`, *optional*):
            A teacher-free control for `signal="reverse_kl"`: every supervised token of the student's rollouts gets
            this advantage instead of the teacher's (negative: each sampled token pushed down, the control of "Does
            OPD Really Distill?", arXiv 2608.31046). The teacher still scores the rollouts, so the lens shows how far
            the student moves toward it without its signal. `None` (default) trains on the teacher's advantage.
        teacher_row_shift (`int`, *optional*, defaults to `0`):
            A control for the teacher's information: each rollout is trained against the teacher's values for another
            rollout of the same micro-batch, the one `teacher_row_shift` rows on (cyclically), position `t` taking
            that rollout's position `t` modulo its length (`reverse_kl`: the teacher's log-probs; `divergence`: its
            distributions), on the student's own rollouts. A wrong teacher rather than an absent one: on the lab its
            `divergence` was 90x the real teacher's and the student collapsed (STUDY.md, "OPD against RL from the
            same start"). The records hold the values trained on. `0` (default) is off. An in-process teacher of the
            student's tokenizer only.
        teacher_model_init_kwargs (`dict[str, Any]` or `str`, *optional*):
            Keyword arguments for `from_pretrained` when the teacher is given as a path or hub id (a JSON string on the
            command line). `dtype` defaults to `"auto"` (the checkpoint's own dtype), as in TRL's `DistillationTrainer`.
            Refused when no teacher is loaded from a path (a model instance, a served or a self teacher).
        teacher_reads_student_text (`bool`, *optional*, defaults to `False`):
            For a teacher of another tokenizer (docs/cross-tokenizer.md): it reads each prompt as the student's text,
            the student's prompt tokens decoded (its chat template's markup included) and tokenized by the teacher's
            tokenizer with its BOS, as TRL's GOLD gives its teacher the decoded text. By default it reads a
            conversation through its own chat template. Refused when no teacher has another tokenizer.

        > Teacher budget: where the teacher's compute goes

        horizon (`int`, *optional*):
            Tokens sampled per rollout (so supervised, and scored or written by the teacher): each rollout is the
            first `horizon` tokens of what `max_completion_length` would sample, as in rollout-horizon control
            (truncated OPD). `None` (the default) samples `max_completion_length`. A `teacher` state source's rollout
            and a `dataset` reference are cut at the same length. A rollout cut at the horizon counts as truncated, so
            `mask_truncated_completions=True` (which would mask every one of them) is refused with it. Each step's
            horizon is in the records (`horizon` in `steps.jsonl`); the probes keep sampling `max_completion_length`
            tokens, so drift and the teacher's disagreement stay measured past the horizon.
        horizon_growth (`int`, *optional*, defaults to `0`):
            Tokens the horizon grows by after every optimizer step: the rollouts of step $k$ (from 0) are
            $\min(\text{horizon} + k \cdot \text{horizon\_growth}, \text{max\_completion\_length})$ tokens long
            (progressive OPD). `0` keeps the horizon fixed. Needs `horizon`.
        skip_correct_rollouts (`bool`, *optional*, defaults to `False`):
            State selection: a rollout the student sampled whose reward (the trainer's `reward_funcs`, weighted by
            `reward_weights` and summed as GRPO sums them) is at least `correct_reward` is not scored by the teacher
            and carries no teacher signal: its tokens get zero loss weight and do not count in the loss's token
            normaliser. The teacher's guidance aligns with the ideal gradient far better on incorrect rollouts
            ("Unmasking OPD", arXiv 2605.10889); skipping the correct ones saves the teacher's forward on them. The
            rewards are then computed before the teacher scores the batch (so a served teacher's request overlaps
            less of GRPO's work). Training only: evaluation scores every rollout. Rows whose states come from the
            `dataset` or the `teacher` (`state_source_mix`) are always scored, as are unscorable rollouts (every reward
            function returned `None`). Needs `reward_funcs`; refused with `signal="continuation"` (see below) and
            with `reward_weight != 0` (a skipped rollout would lose its reward advantage too). The ledger says which
            rollouts were skipped or rechecked: `selection/skipped`, `selection/rechecked` and `selection/correct`
            (rollouts, all ranks) and `teacher_skipped_tokens` (the prompt and completion tokens the teacher did not
            read, left out of the teacher FLOPs) in `steps.jsonl`; each sequence in `states.jsonl` says whether the
            teacher scored it (`teacher_scored`) and why not (`skipped: "correct"`) or that it was a `recheck`; the
            skipped sequences' tokens are recorded with weight 0 but count in no supervised-token metric.
            `statelens/teacher_tokens` counts the scored rows only. The trainer logs `teacher/skipped_frac` and
            `teacher/rechecked_frac` (shares of all rollouts); its `teacher_kl/sampled` and the records'
            `teacher_kl/supervised` then average over the scored rollouts only (mostly incorrect ones), so they do
            not compare with a run without the lever. `continuation` is refused: there the teacher writes
            the supervised tokens from a cut point of the rollout, so a skipped rollout would have to be cut and
            recorded differently; not supported yet.
        correct_reward (`float`, *optional*, defaults to `1.0`):
            With `skip_correct_rollouts`, the reward at or above which a rollout counts as correct.
        recheck_fraction (`float`, *optional*, defaults to `0.1`):
            With `skip_correct_rollouts`, the share of each generation batch's correct rollouts (on each rank) that
            the teacher scores anyway, an exploration floor that keeps re-checking the skipped regions: $n$ correct
            rollouts give $\lfloor f n + u \rfloor$ rechecks with $u$ uniform in $[0, 1)$ (exactly $f n$ when that is
            a whole number, $f n$ on average otherwise), chosen at random. The draws come from a generator seeded with
            the run's `seed`, the rank, the optimizer step and the generation batch within it: the same rows again
            after a resume. `0` skips every correct rollout, `1` skips none (the rewards are still computed first).
        teacher_cache_steps (`int`, *optional*, defaults to `1`):
            Offline teacher cache: a generation batch's rollouts and the teacher's signal on them are reused for up to
            this many optimizer steps (`1`, the default, samples and scores anew every step: the cache is off). A
            *refresh* samples the batch and has the teacher score it; the next steps train on the same micro-batches
            without sampling or calling the teacher: `reverse_kl` reuses the teacher's per-token log-probs, a served
            teacher's `divergence` its top-k log-probs, an in-process teacher's `divergence` its final hidden states at
            the completion positions (kept by the refresh step's loss; on a reused step only the teacher's output
            layer projects them again, counted in the teacher FLOPs). Those hidden states stay on the device until
            the next refresh, beside training: on each rank, `gradient_accumulation_steps` micro-batches of
            `per_device_train_batch_size` x T x H values in the teacher's dtype (T: the micro-batch's padded completion
            length, up to `max_completion_length`; H: the teacher's hidden size), e.g. 8 x 4 x 8192 x 4096 in bf16,
            2 GiB. Valid while the student stays close to the policy that sampled the batch (Lightning OPD, arXiv
            2604.13010): see `teacher_cache_max_staleness`.
            Each step's ledger line says whether it refreshed and why (`refreshed`: `"first"`, `"age"`,
            `"staleness"`, or `None` when served from the cache), the batch's `cache_age` (0 on a refresh) and its
            `teacher_cache/staleness` (also logged by the trainer); each sequence in `states.jsonl` carries
            `from_cache` and `cache_age`. `statelens/teacher_tokens`, the teacher FLOPs and the student's generation
            FLOPs count the refresh steps only; the student's training FLOPs count the reused tokens
            (`cache_reused_tokens`) and the staleness check's forward (`cache_checked_tokens`). The data loader's
            prompts of a reused step are not used. A resumed run holds no cache (GRPO keeps its generation batch in
            memory only), so its first step refreshes. Needs `steps_per_generation` equal to
            `gradient_accumulation_steps` (one generation batch per optimizer step). Refused with
            `signal="continuation"` (the teacher writes the supervised tokens from a fresh cut of each rollout: not
            supported yet), `skip_correct_rollouts` (not supported yet), a `teacher_model_kind` (a `live` or `ema` self
            teacher moves with the student, so its cached signal would go stale in a way the staleness does not
            measure; `base` is not supported yet), several teachers (a `teacher_model` dict: not supported yet),
            `use_vllm` (GRPO's vLLM importance-sampling ratio is computed for the sampling policy only) and the stock
            baselines (no stock trainer reuses a batch). With `signal="reverse_kl"` the config warns: a reused batch's
            rollouts get a policy gradient from a student that did not sample them, with no importance ratio (the
            staleness `steps_per_generation` is refused for above), a bias `teacher_cache_max_staleness` only bounds;
            `divergence` has no sampled-token gradient.
        teacher_cache_max_staleness (`float`, *optional*):
            With `teacher_cache_steps > 1`, refresh the cache before its age limit when its staleness exceeds this:
            a sampled estimate of KL(sampling policy ‖ current student) over the cached rollouts' sampled completion
            tokens, the mean of $r_t - 1 - \log r_t$ with $r_t = p_S(y_t|s_t) / p_{\text{sampling}}(y_t|s_t)$
            (non-negative at every token; the plain mean of $-\log r_t$, logged as `teacher_cache/log_ratio`, goes
            negative as the student trains on these very tokens and raises their probability), measured before every reuse with a no-grad forward of the student on the cached batch and summed over
            every rank (so every rank decides alike). The sampling log-probs are the refresh step's own loss forward
            (the policy that sampled the batch, before its update). `None` (the default) refreshes by age only (the
            staleness is still logged, from each step's loss forward).

        > The student as its own teacher (self-distillation with privileged context; TRL's `SDFTConfig` names)

        teacher_model_kind (`str`, *optional*):
            `None` (the default): the teacher is a separate model, `teacher_model` or a server. Set, the teacher is the
            student itself reading a privileged prompt (`teacher_prompt_template`), and `teacher_model` must be
            omitted:

            - `"base"`: the student's weights frozen at the start of training (one copy; a PEFT student's own base
              with its adapter disabled, no copy);
            - `"live"`: the current student weights, without gradient (no copy; in the student's own train/eval mode,
              so with its dropout unless `disable_dropout`);
            - `"ema"`: an exponential moving average of the student's weights (one copy; for a PEFT student, of its
              adapter only), started at the student's and updated after every optimizer step with
              `teacher_update_rate`; saved in each checkpoint and restored on resume (so refused with
              `save_only_model=True`, whose checkpoints skip it).

            Under DeepSpeed ZeRO-3 the copy of a full-weight student (`"base"`, `"ema"`) is loaded again from the
            student's path (a student given as an instance is refused there); a PEFT student's `"ema"` is refused, and
            so is `"ema"` with hpZ, NVMe parameter offload, MiCS or ZeRO++ quantized frozen weights.

            The training dataset needs a `privileged_context` column. Every signal and state source works: the teacher
            scores (`reverse_kl`, `divergence`) or writes (`continuation`, the `teacher` state source) after its own
            prompt what the student scores after its own.
        teacher_update_rate (`float`, *optional*, defaults to `0.05`):
            With `teacher_model_kind="ema"`, the share of the student's weights mixed into the teacher's after every
            optimizer step: $\theta_T \leftarrow (1 - r)\,\theta_T + r\,\theta_S$. `1.0` makes the teacher the
            student after each step.
        teacher_prompt_template (`str`, *optional*, defaults to `"{prompt}\n\n{privileged_context}"`):
            With a `teacher_model_kind`, the teacher's prompt: `{prompt}` is the row's prompt (for a conversational
            prompt, the text of its last user message, which the filled template replaces, as TRL's `SDFTTrainer`
            does) and `{privileged_context}` the row's `privileged_context`. It is tokenised as the student's prompt
            is (the chat template for conversational prompts).
        teacher_reads_context (`bool`, *optional*, defaults to `False`):
            A separate teacher (`teacher_model`, in the process or served, of the student's tokenizer or another)
            reads each row's `privileged_context` before its prompt, as a self teacher does: solved exchanges (user
            and assistant turns, `load_gsm8k(..., context_format="chat")`) before a conversational prompt as turns of
            its chat template, other context filled into `teacher_prompt_template`. The student never sees it. The
            training dataset needs a `privileged_context` column; the teacher's extra prompt tokens count in its
            FLOPs (`statelens/teacher_context_tokens`). Probes measure no teacher disagreement then (their prompts
            have no context).

        > Teacher behind a vLLM server

        teacher_model_server_url (`str`, *optional*):
            Base URL of a `vllm serve` server running the teacher (TRL's name, as in its `ServerDistillationConfig`),
            e.g. `"http://localhost:8000"`. Set, no teacher weights are loaded in the training processes: each rank
            asks the server for the teacher log-probs of its own rows (`reverse_kl`: exact, from vLLM's prompt
            log-probs of the actual tokens), for the teacher's tokens (`continuation`, the `teacher` state source)
            sampled with this config's `temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty`, and
            (`divergence`) for its `teacher_top_k` most likely tokens at each completion position. Needs
            `temperature=1.0` (vLLM scores prompts with unscaled logits). With several teachers (a `teacher_model`
            dict) leave it unset and give each served teacher's URL as its value; the `teacher_server_*` settings
            and `teacher_top_k` below apply to each of them.
        teacher_top_k (`int`, *optional*, defaults to `32`):
            Teacher tokens per position that `signal="divergence"` uses with a served teacher (TRL's name, as in its
            `AsyncDistillationConfig`): the server returns the teacher's top-k log-probs (vLLM's
            `prompt_logprobs=teacher_top_k`; above 20 the server needs `--max-logprobs teacher_top_k` or `-1`,
            checked at start-up), and the divergence is the generalised JSD with `jsd_beta` on k+1 categories, the
            teacher's top-k token set $K_t$ at the state plus one tail bucket holding the rest of each model's mass:
            $\tilde p(v) = p(v|s_t)$ for $v \in K_t$ and $\tilde p(\mathrm{tail}) = 1 - \sum_{v \in K_t} p(v|s_t)$, for
            the teacher and the student alike (the student's from its full softmax, so its gradient reaches every
            logit through the normaliser). Then $D = KL(\tilde p_T \| \tilde p_S)$ at `jsd_beta=0`,
            $KL(\tilde p_S \| \tilde p_T)$ at `jsd_beta=1`, and
            $\beta\,KL(\tilde p_T \| m) + (1-\beta)\,KL(\tilde p_S \| m)$ with $m = (1-\beta)\tilde p_S + \beta \tilde p_T$
            otherwise, summed over supervised states and normalised as the exact loss. The teacher's tail is
            floored at 1e-7 (float rounding of its top-k sum), ids past the student's vocabulary count in its tail,
            and with `teacher_top_k` equal to the vocabulary size there is no tail: the exact divergence. How the
            loss and gradient at each k compare with the exact ones on the lab: BENCHMARKS.md, "Top-k divergence
            from a served teacher". An in-process teacher always gives the exact full-vocabulary divergence (and
            does not read `teacher_top_k`). A served teacher of another tokenizer (`reverse_kl`, `continuation`)
            reads it too: its top-k log-probs per position move its "ends here" off the student's tokens whose end
            only its longer tokens can say (docs/cross-tokenizer.md), exact where every such longer token is among
            them, a lower bound otherwise; 0 (allowed there) moves nothing. It warns below the k that kept the error
            small on the lab.
        teacher_server_timeout (`float`, *optional*, defaults to `300.0`):
            Seconds to wait for the server at start-up, and for each answer.
        teacher_server_max_retries (`int`, *optional*, defaults to `3`):
            Retries of a request that failed in a way that can pass (no connection, timeout, HTTP 5xx or 429) before
            training stops with a `TeacherServerError`.
        teacher_server_retry_backoff (`float`, *optional*, defaults to `2.0`):
            Seconds before the first retry, doubled for each further one.
        teacher_server_chunk_size (`int`, *optional*, defaults to `0`):
            Rows per scoring request, sent concurrently (TRL's `chunk_size`); `0` sends each rank's rows in one
            request.
        teacher_server_overlap (`bool`, *optional*, defaults to `True`):
            Send a batch's scoring request from a background thread as soon as its tokens exist (`reverse_kl`: right
            after sampling; `continuation`: after the teacher's continuations) and wait for the answer only where the
            loss reads it, after the student's forward on the first micro-batch. The round trip then overlaps GRPO's
            rewards and bookkeeping and that forward. The request, hence every log-prob and the loss, is the same
            either way; a failed request raises its `TeacherServerError` in the training loop all the same. `False`
            waits for the answer before the batch is returned.
        merge_lora_for_sampling (`bool`, *optional*, defaults to `True`):
            A LoRA student samples its rollouts, probes and preflight answers through its adapter merged into a copy
            of each adapted weight, the original weights put back after (bit for bit): a quarter less sampling time
            for SmolLM2-135M on a CPU (BENCHMARKS.md 6.1), at the price of that copy while `generate` runs. The
            sampled policy is the adapter's without its dropout (as vLLM samples it). Not under ZeRO-3, FSDP or vLLM,
            nor for DoRA, `modules_to_save` or non-linear adapted layers, which sample through the adapter as before.
            `False` where memory is tight.
        guards (`str`, *optional*, defaults to `"warn"`):
            The run guards' mode ([`~trl_statelens.guards.RunGuards`], docs/guards.md): `"warn"` logs and records
            each guard that fires (a loop, the end token's share collapsing, the teacher KL stalling or rising,
            non-finite losses...), `"stop"` also stops training with a checkpoint saved, `"off"` attaches none.

        > Preflight

        preflight (`str`, *optional*, defaults to `"warn"`):
            Measured checks of the setting before the first step, on `preflight_prompts` training prompts
            (docs/preflight.md): the end tokens, how the student's and the teacher's own sampled answers end, the
            teacher's probability of ending right after its `#### N` line, its prompt frame and context, the
            student-teacher KL by position, the alignment of a teacher of another tokenizer. `"warn"` writes
            `statelens/preflight.json` and logs the result, `"strict"` also refuses to train when a check fails,
            `"off"` runs none. Not run on a resume from a checkpoint.
        preflight_prompts (`int`, *optional*, defaults to `16`):
            Training prompts the preflight samples.
    """

    # ----- the signal and whose states it supervises -----------------------------------------------------------------
    signal: str = field(default="reverse_kl", metadata={"help": f"One of {SIGNALS}."})
    kl_discount: float = field(default=0.0, metadata={"help": "Discount of future reverse KL in the advantage."})
    continuation_length: int = field(default=16, metadata={"help": "Teacher tokens written per cut point."})
    jsd_beta: float = field(default=1.0, metadata={"help": "Generalised JSD interpolation for `divergence`."})
    state_source_mix: dict | str | None = field(
        default=None, metadata={"help": 'Per-sample state sources, e.g. {"learner": 0.8, "dataset": 0.2}.'}
    )
    reference_column: str = field(default="completion", metadata={"help": "Reference answers for `dataset`."})
    reward_weight: float = field(default=0.0, metadata={"help": "Weight of the reward advantage."})
    constant_advantage: float | None = field(
        default=None,
        metadata={"help": "reverse_kl only: this advantage on every supervised token instead of the teacher's."},
    )
    teacher_row_shift: int = field(
        default=0,
        metadata={"help": "A control: each rollout trained on the teacher's values for the rollout this many on."},
    )
    teacher_model_init_kwargs: dict | str | None = field(
        default=None, metadata={"help": "from_pretrained kwargs for a teacher given by path or hub id."}
    )
    teacher_reads_student_text: bool = field(
        default=False,
        metadata={
            "help": "A teacher of another tokenizer reads prompts as the student's decoded text, not its template."
        },
    )

    # ----- teacher budget: where the teacher's compute goes (rollout horizon, state selection, teacher cache) --------
    horizon: int | None = field(default=None, metadata={"help": "Tokens sampled and supervised per rollout."})
    horizon_growth: int = field(default=0, metadata={"help": "Tokens the horizon grows by each optimizer step."})
    skip_correct_rollouts: bool = field(
        default=False, metadata={"help": "Do not have the teacher score rollouts whose reward is >= correct_reward."}
    )
    correct_reward: float = field(
        default=1.0, metadata={"help": "Reward at or above which a rollout counts as correct (skip_correct_rollouts)."}
    )
    recheck_fraction: float = field(
        default=0.1,
        metadata={"help": "Share of the correct rollouts the teacher scores anyway (skip_correct_rollouts)."},
    )
    teacher_cache_steps: int = field(
        default=1,
        metadata={"help": "Optimizer steps a generation batch and its teacher signal are reused for (1: off)."},
    )
    teacher_cache_max_staleness: float | None = field(
        default=None,
        metadata={"help": "Refresh the teacher cache early when its sampled KL to the current student exceeds this."},
    )

    # ----- the student as its own teacher ----------------------------------------------------------------------------
    teacher_model_kind: str | None = field(
        default=None,
        metadata={"help": f"The student as its own teacher: one of {TEACHER_MODEL_KINDS}; unset: a separate teacher."},
    )
    teacher_update_rate: float = field(
        default=0.05, metadata={"help": 'EMA rate of the teacher with teacher_model_kind="ema".'}
    )
    teacher_prompt_template: str = field(
        default="{prompt}\n\n{privileged_context}",
        metadata={"help": "The self teacher's prompt, from the row's {prompt} and its {privileged_context}."},
    )
    teacher_reads_context: bool = field(
        default=False,
        metadata={"help": "A separate teacher reads each row's privileged_context before its prompt."},
    )

    # ----- a teacher behind a vLLM server ----------------------------------------------------------------------------
    teacher_model_server_url: str | None = field(
        default=None, metadata={"help": 'Base URL of a vLLM server running the teacher, e.g. "http://localhost:8000".'}
    )
    teacher_top_k: int = field(
        default=32,
        metadata={
            "help": "Teacher top-k log-probs per position for `divergence` with a served teacher (plus a tail), and "
            "for the moved ends of a served teacher of another tokenizer."
        },
    )
    teacher_server_timeout: float = field(
        default=300.0, metadata={"help": "Seconds to wait for the teacher server at start-up and for each answer."}
    )
    teacher_server_max_retries: int = field(
        default=3, metadata={"help": "Retries of a teacher request after a failure that can pass."}
    )
    teacher_server_retry_backoff: float = field(
        default=2.0, metadata={"help": "Seconds before the first retry, doubled for each further one."}
    )
    teacher_server_chunk_size: int = field(
        default=0, metadata={"help": "Rows per teacher scoring request (0: all of a rank's rows in one)."}
    )
    teacher_server_overlap: bool = field(
        default=True,
        metadata={"help": "Score each batch on the teacher server in the background, overlapping the student's work."},
    )
    merge_lora_for_sampling: bool = field(
        default=True, metadata={"help": "Sample a LoRA student through its adapter merged into a copy of its weights."}
    )
    guards: str = field(default="warn", metadata={"help": "Run guards: 'warn', 'stop' or 'off'."})

    # ----- preflight ----------------------------------------------------------------------------------------------
    preflight: str = field(
        default="warn", metadata={"help": "Checks before step 1: 'warn', 'strict' (refuse on a failure) or 'off'."}
    )
    preflight_prompts: int = field(default=16, metadata={"help": "Training prompts the preflight samples."})

    # JSON strings from the command line become dicts in `TrainingArguments.__post_init__`, as TRL's dict fields do
    _VALID_DICT_FIELDS = GRPOConfig._VALID_DICT_FIELDS + ["state_source_mix", "teacher_model_init_kwargs"]

    def __post_init__(self):
        if isinstance(self.state_source_mix, str):  # parsed early: it is checked before GRPO's own checks
            self.state_source_mix = json.loads(self.state_source_mix)
        check_mode(self.guards)
        check_preflight_settings(self.preflight, self.preflight_prompts)
        if self.signal not in SIGNALS:
            raise ValueError(f"signal={self.signal!r} is not one of {SIGNALS}")
        if self.continuation_length <= 0:
            raise ValueError(
                f"continuation_length must be a positive number of tokens, got {self.continuation_length}"
            )
        if not 0.0 <= self.kl_discount <= 1.0:
            raise ValueError(f"kl_discount must be in [0, 1], got {self.kl_discount}")
        if self.teacher_top_k < (1 if self.signal == "divergence" else 0):
            raise ValueError(
                f"teacher_top_k must be at least 1 teacher token per position with signal='divergence' (the divergence "
                "from a served teacher is computed on its top-k tokens plus a tail bucket), and at least 0 otherwise "
                f"(a served teacher of another tokenizer then moves no ends), got {self.teacher_top_k}"
            )
        if not 0.0 <= self.jsd_beta <= 1.0:
            raise ValueError(f"jsd_beta must be in [0, 1] (0 forward KL, 1 reverse KL), got {self.jsd_beta}")
        mix = {"learner": 1.0} if self.state_source_mix is None else dict(self.state_source_mix)
        unknown = sorted(set(mix) - set(MIX_SOURCES))
        if unknown:
            raise ValueError(f"state_source_mix has unknown sources {unknown}: use {MIX_SOURCES}")
        if any(p < 0 for p in mix.values()) or not math.isclose(sum(mix.values()), 1.0, abs_tol=1e-6):
            raise ValueError(
                f"state_source_mix must hold non-negative probabilities that sum to 1, got {mix} "
                f"(sum {sum(mix.values()):.4f})"
            )
        self.state_source_mix = mix
        if self.beta != 0.0:
            raise ValueError(
                f"beta={self.beta}: GRPO's KL penalty against a reference model is not used by on-policy distillation "
                "(the teacher is the target; the loss would ignore it and a reference model would be loaded for "
                "nothing). Set beta=0.0; to stay closer to the start, lower the learning rate or use LoRA"
            )
        if self.loss_type != "dapo":
            raise ValueError(
                f"loss_type={self.loss_type!r}: on-policy distillation normalises its loss as GRPO's 'dapo' (a token "
                "mean over the generation batch) and has no other GRPO loss; leave loss_type='dapo'"
            )
        if self.num_iterations != 1:
            raise ValueError(
                f"num_iterations={self.num_iterations}: on-policy distillation trains on each rollout once; reusing "
                "rollouts needs GRPO's clipped importance ratios, which its losses do not have. Set num_iterations=1"
            )
        self._check_grpo_loss_settings()
        self._check_horizon()
        self._check_state_selection()
        self._check_teacher_cache()
        self._check_self_teacher_settings()
        # Which teacher reads the teacher settings is known here for a self teacher or teacher_model_server_url;
        # otherwise the trainer checks them once its teacher_model is given
        if self.teacher_model_kind is not None or self.teacher_model_server_url is not None:
            self.check_settings_are_read(served=self.teacher_model_server_url is not None, loads_a_path=False)
        else:
            self.check_settings_are_read()
        self._warn_about_reverse_kl_off_policy()
        if self.teacher_model_server_url is not None:
            self._check_teacher_server_settings()
        # One rollout per prompt (TRL's DistillationTrainer draws one): GRPO refuses fewer than 2 because its
        # advantage needs a group; distillation's teacher supplies a per-token signal with no group to compare to
        one_rollout_per_prompt = self.num_generations == 1
        if one_rollout_per_prompt:
            given_generation_batch_size = self._count_batches_in_pairs_for_grpo()
        super().__post_init__()
        if one_rollout_per_prompt:
            self._count_batches_in_ones_again(given_generation_batch_size)
        if self.signal == "reverse_kl" and self.gradient_accumulation_steps % self.steps_per_generation != 0:
            raise ValueError(
                f"steps_per_generation={self.steps_per_generation} does not divide gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps}: later optimizer steps would take a reverse_kl policy gradient on "
                "rollouts an older policy sampled, which GRPO corrects with clipped importance ratios and on-policy "
                "distillation does not. Make steps_per_generation divide gradient_accumulation_steps, or use "
                "signal='continuation' or 'divergence' (supervision at given states, no sampled-token gradient)"
            )
        if self.teacher_cache_steps > 1 and self.steps_per_generation != self.gradient_accumulation_steps:
            raise ValueError(
                f"teacher_cache_steps={self.teacher_cache_steps} with steps_per_generation={self.steps_per_generation} "
                f"and gradient_accumulation_steps={self.gradient_accumulation_steps}: the cache holds one generation "
                "batch per optimizer step, so the two must be equal. Leave steps_per_generation unset (it defaults to "
                "gradient_accumulation_steps), or leave teacher_cache_steps=1"
            )

    def to_distillation_config(self) -> DistillationConfig:
        """The same run for TRL's stock `DistillationTrainer`: every shared field copied, `beta` = `jsd_beta`.

        TRL's trainer draws one rollout per prompt, so `per_device_train_batch_size` (rollouts per device) keeps the
        number of supervised rollouts per step equal.
        """
        return self._stock_config(DistillationConfig, beta=self.jsd_beta)

    def to_server_distillation_config(self):
        """The same run for TRL's experimental `ServerDistillationTrainer` (a teacher on a vLLM server): every shared
        field copied (`teacher_model_server_url` included), `beta` = `jsd_beta`, and the top-k support its config
        allows. With `jsd_beta=0` that is `loss_top_k` = `teacher_top_k` with the tail bucket (`loss_add_tail=True`),
        the same k+1 categories as our `divergence`. With `jsd_beta > 0` TRL only takes `loss_top_k=1`: its loss
        is then the divergence on the teacher's top-1 token, the sampled token and a tail, not ours on the teacher's
        top-k (README, "Compare with stock TRL").
        """
        from trl.experimental.server_distillation import ServerDistillationConfig

        loss_top_k = self.teacher_top_k if self.jsd_beta == 0 else 1
        return self._stock_config(
            ServerDistillationConfig, beta=self.jsd_beta, loss_top_k=loss_top_k, loss_add_tail=True
        )

    def _stock_config(self, config_class, skip=(), **fields):
        """A `config_class` with every field both configs have copied from this one (but those in `skip`), and
        `fields` on top (`trl_statelens.opd.stock_sdft` builds TRL's `SDFTConfig` with it too)."""
        if self.horizon is not None:
            raise ValueError(
                f"horizon={self.horizon}: TRL's {config_class.__name__} samples max_completion_length tokens per "
                "rollout and has no horizon; for the stock baseline of a run with a horizon, leave horizon unset and "
                "set max_completion_length to it (a fixed horizon is that run)"
            )
        if self.skip_correct_rollouts:
            raise ValueError(
                f"skip_correct_rollouts=True: TRL's {config_class.__name__} has the teacher score every rollout; for "
                "the stock baseline, leave skip_correct_rollouts at False (the run without state selection)"
            )
        if self.teacher_cache_steps > 1:
            raise ValueError(
                f"teacher_cache_steps={self.teacher_cache_steps}: TRL's {config_class.__name__} samples and scores a new "
                "batch every step; for the stock baseline, leave teacher_cache_steps at 1 (the run without the cache)"
            )
        stock_fields = {f.name for f in dataclasses.fields(config_class) if f.init} - set(skip)
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init and f.name in stock_fields}
        return config_class(**{**shared, **fields})
