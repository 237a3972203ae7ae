"""Preflight checks of a `StateLensSFTTrainer`: whether the data's answers end with an end token *after the
collator* (what the loss actually sees: a collator that masks padding by id hides an eos that is also the padding),
and the data's off-policy gap against the model (nll - entropy on the supervised tokens, as the lens's
`offpolicy_gap`: how far the data is from what the model would write)."""

from __future__ import annotations

import torch
from trl.models.utils import unwrap_model_for_generation

from ..lens.endings import end_token_ids
from .sampling import first_rows
from .verdicts import Check, graded, skipped


@torch.no_grad()
def sft_checks(trainer, count: int) -> list[Check]:
    if getattr(trainer.args, "packing", False):
        return [skipped("data/ends_with_end_token", "packed rows join several examples: their ends are not rows'")]
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    # the tokenized columns the collator reads (the text columns beside them are dropped as training drops them)
    rows = [
        {k: v for k, v in row.items() if not isinstance(v, str)} for row in first_rows(trainer.train_dataset, count)
    ]
    batch = trainer.data_collator(rows)
    labels = batch["labels"]
    end_ids = end_token_ids(tokenizer, trainer.model)
    supervised = labels != -100
    last = [row[mask][-1].item() if mask.any() else None for row, mask in zip(labels, supervised)]
    ends = sum(token in end_ids for token in last if token is not None) / max(len(last), 1)
    details = {
        "end_tokens": tokenizer.convert_ids_to_tokens(end_ids),
        "pad_is_eos": tokenizer.pad_token_id in end_ids,
        "last_supervised_tokens": tokenizer.convert_ids_to_tokens([t for t in last[:4] if t is not None]),
    }
    checks = [
        graded(
            "data/ends_with_end_token",
            ends,
            0.9,
            0.5,
            "the supervised answers do not end with an end token, so the model never learns to stop: end each "
            "completion with the eos (the chat template's end of turn), and do not pad with the eos when the "
            "collator masks padding by id",
            higher_is_worse=False,
            details=details,
        )
    ]
    return checks + [off_policy_gap(trainer, batch)]


@torch.no_grad()
def off_policy_gap(trainer, batch: dict) -> Check:
    """Mean nll - mean entropy of the model on the batch's supervised tokens (the lens's `offpolicy_gap`)."""
    device = trainer.accelerator.device
    inputs = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
    labels = batch["labels"].to(device)
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
        was_training = model.training
        model.eval()
        logits = model(**inputs).logits.float()
        model.train(was_training)
    logps = logits[:, :-1].log_softmax(-1)
    target = labels[:, 1:]
    mask = target != -100
    nll = -logps.gather(-1, target.clamp(min=0)[..., None])[..., 0]
    entropy = -(logps.exp() * logps).sum(-1)
    tokens = max(int(mask.sum()), 1)
    state_nll, state_entropy = (nll[mask].sum() / tokens).item(), (entropy[mask].sum() / tokens).item()
    return graded(
        "data/offpolicy_gap",
        state_nll - state_entropy,
        1.0,
        None,
        "the data's answers are far from what the model would write (nll well above its entropy): expect large "
        "early losses and forgetting; a lower learning rate, or data closer to the model's style",
        details={"state_nll": state_nll, "state_entropy": state_entropy, "tokens": tokens},
    )
