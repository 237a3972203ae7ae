"""How completions end, and what a teacher wants once the final answer is written.

A metric that reads the first ``#### N`` (the format share, strict accuracy) cannot tell a clean answer from one that
goes on repeating itself, and TRL's ``completions/clipped_ratio`` says how many rollouts hit the length limit but not
what the rest did or what the teacher asked for there. Per optimizer step the lens records, for the rollouts of the
GRPO-family trainers (``ends/*`` in the logs and ``steps.jsonl``) and for the probe completions of every trainer
(``drift/ends_*``):

- how each completion ended (:data:`END_KINDS`): with the end-of-sequence token, cut at the length limit, or stopped
  short of both (a stop string);
- the share that repeats itself (:func:`~trl_statelens.answers.repeats_itself`);
- with a teacher, its log-probability of the end token at the student's ends (``teacher_end/logp_at_student_ends``)
  and, on probes, at the state right after a final-answer line, the student's beside it
  (``teacher_end/logp_after_answer``, ``student_end/logp_after_answer``): a teacher that wants the next question
  there (log-prob far below 0) teaches the student to go on.
"""

from __future__ import annotations

import math

import torch

from ..answers import STRICT_PATTERN, repeats_itself

END_KINDS = ("end_token", "length_limit", "stop")


def end_token_ids(tokenizer, model=None) -> list[int]:
    """The ids that end a completion: the tokenizer's eos and the model's generation config's eos ids."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return sorted(ids)


def end_kinds(completion_ids: torch.Tensor, end_ids: list[int], limit: int, pad_id: int | None = None) -> list[str]:
    """Each row's end (:data:`END_KINDS`): the end token among its tokens, else cut if it holds ``limit`` tokens (its
    `pad_id` padding left out; when the padding is an end token itself, a padded row has ended), else stopped short
    (a stop string or another stopping rule)."""
    padded = pad_id is not None and pad_id not in end_ids
    kept = completion_ids != pad_id if padded else torch.ones_like(completion_ids, dtype=torch.bool)
    ended = (torch.isin(completion_ids, torch.tensor(end_ids, device=completion_ids.device)) & kept).any(dim=1)
    lengths = kept.sum(dim=1)
    return [
        "end_token" if e else "length_limit" if n >= limit else "stop"
        for e, n in zip(ended.tolist(), lengths.tolist())
    ]


def answer_end_position(token_texts: list[str]) -> int | None:
    """How many tokens of a completion (given as each token's text) it takes to finish its first ``#### N``: the
    index of the state right after the final answer, or None without one. The number must be followed by a
    non-digit or the end, so a longer number still being written does not count."""
    text, ends = "", []
    for piece in token_texts:
        text += piece
        ends.append(len(text))
    found = STRICT_PATTERN.search(text)
    if found is None or (found.end() < len(text) and text[found.end()].isdigit()):
        return None
    return next(i + 1 for i, end in enumerate(ends) if end >= found.end())


def ending_metrics(kinds: list[str], texts: list[str], prefix: str) -> dict[str, float]:
    """The share of each end kind and of completions that repeat themselves, as ``{prefix}{kind}`` and
    ``{prefix}repeats``."""
    count = max(len(kinds), 1)
    metrics = {f"{prefix}{kind}": sum(k == kind for k in kinds) / count for kind in END_KINDS}
    metrics[f"{prefix}repeats"] = sum(map(repeats_itself, texts)) / max(len(texts), 1)
    return metrics


def mean_or_nan(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
