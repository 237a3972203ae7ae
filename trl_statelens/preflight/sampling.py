"""What the preflight samples and measures for the GRPO-family trainers: the first training prompts, the student's own
answers to them as training would sample them (`trainer_generation_config`: temperature, top-p/k, end tokens,
`max_completion_length`), how answers end, and the student's log-probs of its answers.

Every rank samples the same prompts with the same seed (the run's `seed`, in a forked RNG, so training's random
state is untouched); generation is collective under ZeRO-3, so every rank makes the same calls."""

from __future__ import annotations

import torch
from trl.models.utils import unwrap_model_for_generation

from ..answers import repeats_itself
from ..lens.endings import END_KINDS
from ..lens.probes import trainer_generation_config
from ..merged_lora import student_sampling
from ..teachers.base import left_padded


def first_rows(dataset, count: int) -> list[dict]:
    """The dataset's first `count` rows (an iterable dataset's first ones read)."""
    rows = []
    for row in dataset:
        if len(rows) >= count:
            break
        rows.append(dict(row))
    return rows


def forked_rng(trainer):
    """A random state of its own for the preflight's sampling, seeded with the run's `seed` on every rank."""
    device = trainer.accelerator.device
    devices = [device] if device.type == "cuda" else []
    return torch.random.fork_rng(devices=devices)


def first_end(row: list[int], end_ids: list[int]) -> list[int]:
    """A completion up to and with its first end token, as GRPO's completion mask keeps it."""
    end = next((i for i, token in enumerate(row) if token in end_ids), None)
    return row if end is None else row[: end + 1]


@torch.no_grad()
def student_answers(trainer, prompt_ids: list[list[int]]) -> list[list[int]]:
    """The student's sampled completion of each prompt (its tokens up to its first end token), as a rollout."""
    config = trainer_generation_config(trainer)
    pad_id = trainer._tokenizer.pad_token_id
    input_ids, attention_mask = (t.to(trainer.accelerator.device) for t in left_padded(prompt_ids, pad_id))
    with (
        forked_rng(trainer),
        unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
        ) as model,
        student_sampling(trainer, model),
    ):
        torch.manual_seed(trainer.args.seed)
        was_training = model.training
        model.eval()
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
        model.train(was_training)
    return [first_end(row, trainer.eos_token_ids) for row in out[:, input_ids.size(1) :].tolist()]


def ending(row: list[int], end_ids: list[int], limit: int) -> str:
    """How a completion (up to its first end token) ended (`lens.endings.END_KINDS`)."""
    if row and row[-1] in end_ids:
        return "end_token"
    return "length_limit" if len(row) >= limit else "stop"


def ending_shares(rows: list[list[int]], texts: list[str], end_ids: list[int], limit: int) -> dict[str, float]:
    """The share of each end kind and of answers that repeat themselves (`answers.repeats_itself`)."""
    count = max(len(rows), 1)
    kinds = [ending(row, end_ids, limit) for row in rows]
    shares = {kind: sum(k == kind for k in kinds) / count for kind in END_KINDS}
    shares["repeats"] = sum(map(repeats_itself, texts)) / count
    return shares


@torch.no_grad()
def student_log_probs(trainer, prompt_ids: list[list[int]], completions: list[list[int]]) -> list[torch.Tensor]:
    """The student's log-prob of each completion token after its prompt, at the run's temperature (as the loss reads
    them), four rows at a time. Every rank scores the same rows."""
    temperature = getattr(trainer, "temperature", 1.0) or 1.0
    pad_id = trainer._tokenizer.pad_token_id
    device = trainer.accelerator.device
    logps = []
    with unwrap_model_for_generation(
        trainer.model_wrapped, trainer.accelerator, gather_deepspeed3_params=trainer.args.ds3_gather_for_generation
    ) as model:
        for start in range(0, len(prompt_ids), 4):
            rows = [p + c for p, c in zip(prompt_ids[start : start + 4], completions[start : start + 4])]
            ids = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, row in enumerate(rows):
                ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float() / temperature
            for i, (p, c) in enumerate(zip(prompt_ids[start : start + 4], completions[start : start + 4])):
                span = logits[i, len(p) - 1 : len(p) + len(c) - 1].log_softmax(-1)
                logps.append(span.gather(-1, torch.tensor(c, device=device)[:, None])[:, 0].cpu())
    return logps
