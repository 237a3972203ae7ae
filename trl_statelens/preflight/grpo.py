"""Preflight checks every GRPO-family trainer runs (`StateLensGRPOTrainer`, and `OnPolicyDistillTrainer` on top):
the end tokens generation stops at, how the student's own rollouts end, and GRPO's reward spread at step 0."""

from __future__ import annotations

import math
import statistics

import torch

from ..teachers.byte_vocab import chat_turn_tokens, special_token_ids
from .sampling import ending_shares
from .verdicts import Check, graded, skipped

RAISE_LENGTH = (
    "raise max_completion_length (or teach the model to end sooner): a rollout cut at the limit has no end token to "
    "learn, and with mask_truncated_completions=True it supervises nothing"
)


def end_token_checks(trainer) -> list[Check]:
    """The end token of an assistant turn in the chat template is one generation stops at; pad == eos and several
    end ids are named (GRPO's completion mask keeps the first end token whatever the padding, so they are notes)."""
    tokenizer = trainer._tokenizer
    end_ids = list(trainer.eos_token_ids)
    declared = getattr(getattr(trainer.model, "generation_config", None), "eos_token_id", None)
    details = {
        "end_ids": end_ids,
        "end_tokens": tokenizer.convert_ids_to_tokens(end_ids),
        "tokenizer_eos": tokenizer.eos_token,
        "generation_config_eos": declared,
        "pad_is_eos": tokenizer.pad_token_id in end_ids,
    }
    turn_end = None
    if getattr(tokenizer, "chat_template", None):
        turn_end = chat_turn_tokens(tokenizer, special_token_ids(tokenizer)).get("end_of_turn")
    if turn_end is None:
        return [skipped("end_tokens/turn_end_stops", "no chat template with an end-of-turn special token to compare")]
    details["turn_end"] = tokenizer.convert_ids_to_tokens(turn_end)
    stops = float(turn_end in end_ids)
    fix = (
        f"the chat template closes an assistant turn with {details['turn_end']!r}, which is none of the end tokens "
        f"{details['end_tokens']}: rollouts never stop at the end of their turn. Set the tokenizer's eos_token (or the "
        "model's generation_config.eos_token_id) to it"
    )
    return [graded("end_tokens/turn_end_stops", stops, 0.5, 0.5, fix, higher_is_worse=False, details=details)]


def rollout_checks(
    trainer, side: str, rows: list[list[int]], texts: list[str], repeats_warn: float, repeats_fail, cut_fail=0.9
):
    """How `side`'s answers (`student` or `teacher`) end: the share cut at `max_completion_length` (failing at
    `cut_fail`; `None`: never) and the share that repeats itself, each graded; the share ending on an end token and
    stopped short beside them."""
    limit = trainer.max_completion_length
    shares = ending_shares(rows, texts, list(trainer.eos_token_ids), limit)
    lengths = [len(row) for row in rows]
    details = {
        **shares,
        "mean_tokens": statistics.mean(lengths) if lengths else 0.0,
        "example": texts[0] if texts else "",
    }
    loops = f"{side}'s answers repeat themselves: " + (
        "the student learns to go on after its answer from such a teacher; read the teacher in a frame where its "
        "turn ends after the answer (chat shots), or choose another teacher"
        if side == "teacher"
        else "the signal must teach it to stop; check that the teacher's answers end (teacher/* checks)"
    )
    return [
        graded(f"{side}/length_limit_share", shares["length_limit"], 0.5, cut_fail, RAISE_LENGTH, details=details),
        graded(f"{side}/repeats_share", shares["repeats"], repeats_warn, repeats_fail, loops),
    ]


def reward_spread(trainer, rows: list[dict], prompts: list, completions: list[list[int]], texts: list[str]):
    """GRPO's signal at step 0: rewards of `num_generations` rollouts per prompt (`rows`, `prompts`, `completions`
    grouped so), the share of groups whose rewards differ (the others give every token a zero advantage) and the
    share of all-wrong groups (no reward above 0). Reward models are not run (skipped with the reason)."""
    if any(isinstance(func, torch.nn.Module) for func in trainer.reward_funcs):
        return [skipped("rewards/spread_share", "a reward model is not run by the preflight (only reward functions)")]
    conversational = isinstance(prompts[0], list)
    shown = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    columns = {key: [row.get(key) for row in rows] for key in rows[0] if key not in ("prompt", "completion")}
    total = torch.zeros(len(texts))
    for func, weight in zip(trainer.reward_funcs, trainer.reward_weights.tolist()):
        values = func(
            prompts=prompts, completions=shown, completion_ids=completions, trainer_state=trainer.state, **columns
        )
        total += weight * torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float)
    size = trainer.num_generations
    groups = [total[i : i + size] for i in range(0, len(total) - size + 1, size)]
    spread = [
        bool((g[~g.isnan()].max() > g[~g.isnan()].min()).item()) if (~g.isnan()).sum() > 1 else False for g in groups
    ]
    all_wrong = [bool((g.nan_to_num(0.0) <= 0).all().item()) for g in groups]
    details = {"groups": len(groups), "group_size": size, "mean_reward": float(total.nanmean())}
    spread_share = sum(spread) / max(len(groups), 1)
    wrong_share = sum(all_wrong) / max(len(groups), 1)
    return [
        graded(
            "rewards/spread_share",
            spread_share,
            0.25,
            0.0,
            "few groups' rewards differ: GRPO's advantage is zero in the others, so they teach nothing. Make the task "
            "easier for the start (an SFT warm-up, easier prompts), a denser reward, or a larger num_generations",
            higher_is_worse=False,
            details=details,
        ),
        graded(
            "rewards/all_wrong_share",
            wrong_share,
            0.75,
            None,
            "most groups earn no reward at all: check the reward function against a right answer, and the cut share",
        ),
    ]
