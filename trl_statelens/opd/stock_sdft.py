r"""The stock arm of self-distillation: an `OnPolicyDistillConfig` with a self teacher mapped onto TRL's
`trl.experimental.sdft.SDFTConfig`, for `recipes/self_distill.py --baseline stock`.

Which of SDFT's modes is which of ours, read from TRL 1.16's `SDFTTrainer` (per completion token $t$, $p_S$ the
student on the student prompt, $p_T$ the self teacher on the teacher prompt, both at `temperature`):

- `signal="reverse_kl"` (with `kl_discount=0`) is `distillation_mode="sampled_token"`, `distillation_alpha=1.0`:
  both minimise $(\log p_S(y_t) - \log p_T(y_t))_{\text{detached}} \cdot \log p_S(y_t)$ on the sampled token,
  so loss values and gradients are the same.
- `signal="divergence"` with `jsd_beta` $\beta$ is `distillation_mode="full_logits"` with `distillation_alpha` =
  $\beta$: the same generalised JSD over the whole vocabulary ($\beta=1$ reverse KL, $0$ forward KL, in between
  $\beta KL(p_T \| m) + (1-\beta) KL(p_S \| m)$ with $m = (1-\beta) p_S + \beta p_T$).
- `teacher_model_kind` ("base", "live", "ema"), `teacher_update_rate` and `teacher_prompt_template` keep their
  names and meaning; the EMA teacher is updated after every optimizer step (`teacher_sync_steps=1`). One exception:
  a PEFT (LoRA) student's `"ema"` starts from another point. TRL's `PEFTAdapterEMACallback` starts the teacher
  adapter and its average at zeros, ours at the student's adapter. Both compute the base model at the start (a
  LoRA's B is 0), but after $t$ updates TRL's average holds $r \sum_k (1-r)^{t-k} \theta_k$ and ours
  $(1-r)^t \theta_0$ more (the student's starting adapter, its random A included), so the two teachers differ
  from the first step on. A full-weight student's `"ema"` starts from the student's weights in both.
- SDFT's importance-sampling clip (`distillation_is_clip`) multiplies the loss by a clipped ratio to the policy
  that sampled the rollout, only when rollouts are reused across optimizer steps; ours applies no ratio, so it is
  off (`None`). Every completion token is supervised (`num_loss_tokens_to_skip=0`), rollouts come from the student
  prompt (`generate_from_teacher=False`) and prompts are not truncated (`max_prompt_length=None`: GRPO's config has
  no such limit).

What differs even in a matching mode: SDFT averages each rollout's tokens, then the rollouts (a sequence mean); ours
averages all supervised tokens of an optimizer step (GRPO's DAPO token mean). The two are equal when every rollout
of a step has the same number of supervised tokens, and otherwise weight long rollouts differently.

Settings with no SDFT counterpart are refused here rather than dropped (see `NO_COUNTERPART`).
"""

from __future__ import annotations

import os

from .config import OnPolicyDistillConfig

# Ours, with nothing like it in SDFTTrainer: what `to_sdft_config` refuses, and what the README lists
NO_COUNTERPART = {
    "signal='continuation'": "the teacher writing tokens from the student's cut states",
    "state_source_mix": "dataset or teacher states (SDFT supervises the student's own rollouts only)",
    "kl_discount": "reverse KL of future tokens in the sampled-token advantage",
    "reward_weight / reward_funcs": "a reward advantage added to the reverse KL",
    "mask_truncated_completions": "SDFT supervises rollouts cut at max_completion_length like any other",
    "teacher_model (a separate model) / teacher_model_server_url": "SDFT's teacher is always the student's own weights",
    "the state ledger (statelens/*)": "the stock arm logs probe drift only (through StateLoggingCallback)",
}

# SDFT refuses generation_batch_size and steps_per_generation together; GRPO's config has filled in both by now
_NOT_COPIED = {"generation_batch_size"}


def to_sdft_config(args: OnPolicyDistillConfig):
    """The same run for TRL's `SDFTTrainer`: every field both configs have copied, the signal as its
    `distillation_mode`, the self teacher's settings under their TRL names. Raises `ValueError` for a setting SDFT
    has no counterpart for (see the module docstring)."""
    # the stock arm asks for the experimental trainer on purpose: no warning about it
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.sdft import SDFTConfig

    problems = []
    if args.teacher_model_kind is None:
        problems.append("teacher_model_kind is None (a separate teacher): SDFT's teacher is the student itself")
    if args.signal == "continuation":
        problems.append("signal='continuation': " + NO_COUNTERPART["signal='continuation'"])
    if args.state_source_mix != {"learner": 1.0}:
        problems.append(f"state_source_mix={args.state_source_mix}: " + NO_COUNTERPART["state_source_mix"])
    if args.kl_discount != 0.0:
        problems.append(f"kl_discount={args.kl_discount}: " + NO_COUNTERPART["kl_discount"])
    if args.reward_weight != 0.0:
        problems.append(f"reward_weight={args.reward_weight}: " + NO_COUNTERPART["reward_weight / reward_funcs"])
    if args.mask_truncated_completions:
        problems.append("mask_truncated_completions=True: " + NO_COUNTERPART["mask_truncated_completions"])
    if args.teacher_model_server_url is not None:
        problems.append("teacher_model_server_url: SDFT serves only a live teacher, from its own vLLM server")
    if args.use_vllm:
        # Ours corrects vLLM's sampling with GRPO's importance ratio (reverse_kl); SDFT does not: not the same run
        problems.append("use_vllm=True: the two trainers treat vLLM's sampled tokens differently")
    if problems:
        raise ValueError("--baseline stock (TRL's SDFTTrainer) has no counterpart for: " + "; ".join(problems))

    sampled_token = args.signal == "reverse_kl"
    return args._stock_config(
        SDFTConfig,
        skip=_NOT_COPIED,
        distillation_mode="sampled_token" if sampled_token else "full_logits",
        distillation_alpha=1.0 if sampled_token else args.jsd_beta,
        distillation_is_clip=None,
        num_loss_tokens_to_skip=0,
        generate_from_teacher=False,
        max_prompt_length=None,
        teacher_model_kind=args.teacher_model_kind,
        teacher_update_rate=args.teacher_update_rate,
        teacher_sync_steps=1,
        teacher_prompt_template=args.teacher_prompt_template,
    )
