"""Scoring shared by the tasks: log-likelihood of continuations, greedy generation, subsets and small reductions.

Tokenization and context windows follow lm-evaluation-harness 0.4.x (``HFLM``) under every protocol, so
log-likelihoods do not depend on the protocol, only prompts do:

- a ``(context, continuation)`` pair moves the context's trailing whitespace to the continuation, encodes
  ``context + continuation`` and ``context`` with the tokenizer's default special tokens, and scores the tokens of
  the joined text past the context's length (an empty context is replaced by the bos or eos token);
- a sequence longer than the model's window keeps its last ``window + 1`` tokens and feeds all but the last;
- generation prompts keep their last ``window - max_new_tokens`` tokens.

The window is the config's ``n_positions``, ``max_position_embeddings`` or ``n_ctx``, else the tokenizer's
``model_max_length`` when it is set, else 2048.
"""

from __future__ import annotations

import hashlib

import torch
from tqdm.auto import tqdm

from ..checks import context_length

DEFAULT_WINDOW = 2048
_UNSET_TOKENIZER_LENGTH = 10**20  # transformers' "no limit" model_max_length is ~1e30


def model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def pad_token_id(tokenizer) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token: set tokenizer.pad_token")
    return pad


def context_window(model, tokenizer=None) -> int:
    """Tokens the model attends to: its config's position limit, else the tokenizer's, else 2048."""
    value = context_length(model)
    if value is not None:
        return value
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and value < _UNSET_TOKENIZER_LENGTH:
        return value
    return DEFAULT_WINDOW


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], int]:
    """Token ids of ``context + continuation`` and how many of the last ones are the continuation."""
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped) :] + continuation
    if not context:
        start = getattr(tokenizer, "bos_token_id", None)
        start = start if start is not None else tokenizer.eos_token_id
        continuation_ids = list(tokenizer(continuation)["input_ids"])
        return [start] + continuation_ids, len(continuation_ids)
    full_ids = list(tokenizer(context + continuation)["input_ids"])
    context_length = len(tokenizer(context)["input_ids"])
    return full_ids, len(full_ids) - context_length


@torch.no_grad()
def continuation_logprobs(
    model,
    tokenizer,
    requests: list[tuple[str, str]],
    batch_size: int = 16,
    desc: str = "log-likelihood",
    progress: bool = True,
) -> list[tuple[float, int]]:
    """Summed log-probability and token count of each ``continuation`` given its ``context``.

    Several sequences share a forward pass (right-padded, longest first so batches pad little); log-softmax is taken
    in fp32 and only at the scored positions, so a large vocabulary costs no full ``batch x length x vocab`` copy.
    """
    window = context_window(model, tokenizer)
    encoded = []
    for context, continuation in requests:
        ids, num_scored = encode_pair(tokenizer, context, continuation)
        if num_scored > window:
            raise ValueError(f"a continuation of {num_scored} tokens does not fit the model's {window}-token window")
        encoded.append((ids[-(window + 1) :], num_scored))  # the last token is scored, never fed
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i][0]))
    pad, device = pad_token_id(tokenizer), model_device(model)
    results: list[tuple[float, int]] = [(0.0, 0)] * len(encoded)
    for start in tqdm(range(0, len(order), batch_size), desc=desc, disable=not progress, leave=False):
        batch = order[start : start + batch_size]
        lengths = torch.tensor([len(encoded[i][0]) - 1 for i in batch])  # fed tokens
        num_scored = torch.tensor([encoded[i][1] for i in batch])
        width = int(lengths.max())
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        targets = torch.full((len(batch), width), pad, dtype=torch.long)
        for row, i in enumerate(batch):
            ids = torch.tensor(encoded[i][0])
            input_ids[row, : lengths[row]], targets[row, : lengths[row]] = ids[:-1], ids[1:]
        positions = torch.arange(width)
        attention_mask = (positions[None, :] < lengths[:, None]).long()
        logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
        # The logit at position t predicts targets[t]; the continuation is the last n targets of each row.
        scored = (positions[None, :] >= (lengths - num_scored)[:, None]) & (positions[None, :] < lengths[:, None])
        scored = scored.to(logits.device)
        picked = targets.to(logits.device)[scored]
        token_logps = logits[scored].float().log_softmax(-1).gather(-1, picked[:, None]).squeeze(-1)
        rows = scored.nonzero()[:, 0]
        sums = torch.zeros(len(batch), dtype=torch.float32, device=logits.device).index_add_(0, rows, token_logps)
        for row, i in enumerate(batch):
            results[i] = (float(sums[row]), int(num_scored[row]))
    return results


def choice_logprobs(
    model,
    tokenizer,
    items: list[tuple[str, list[str]]],
    batch_size: int = 16,
    desc: str = "log-likelihood",
    progress: bool = True,
) -> list[list[tuple[float, int]]]:
    """For each ``(context, continuations)`` item, ``(summed log-prob, tokens)`` of every continuation."""
    requests = [(context, continuation) for context, continuations in items for continuation in continuations]
    flat = continuation_logprobs(model, tokenizer, requests, batch_size, desc, progress)
    out, at = [], 0
    for _, continuations in items:
        out.append(flat[at : at + len(continuations)])
        at += len(continuations)
    return out


@torch.no_grad()
def greedy_generate(
    model,
    tokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int,
    stop_strings: tuple[str, ...] = (),
    add_special_tokens: bool = True,
    batch_size: int = 16,
    desc: str = "generating",
    progress: bool = True,
    sample_temperature: float | None = None,
) -> list[str]:
    """Greedy completions of ``prompts`` (left-padded batches, each prompt cut to its last ``window -
    max_new_tokens`` tokens), decoded without special tokens and cut at the first of each stop string in turn.

    With ``sample_temperature`` the completions are sampled at that temperature instead (plain softmax sampling: no
    top-p/top-k), from the global torch RNG: seed it, and fork it if the caller's randomness must not move."""
    if getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None) is not None:
        tokenizer.pad_token = tokenizer.eos_token  # batched generation needs a pad token; eos is the usual one
    keep = context_window(model, tokenizer) - max_new_tokens
    if keep <= 0:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} leaves no room for the prompt in the model's "
            f"{context_window(model, tokenizer)}-token window: lower max_new_tokens"
        )
    stop = {"stop_strings": list(stop_strings), "tokenizer": tokenizer} if stop_strings else {}
    device, outputs = model_device(model), []
    for start in tqdm(range(0, len(prompts), batch_size), desc=desc, disable=not progress):
        encoded = tokenizer(
            prompts[start : start + batch_size],
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=add_special_tokens,
        )
        encoded = {key: value[:, -keep:].to(device) for key, value in encoded.items()}
        decoding = (
            {"do_sample": False}
            if sample_temperature is None
            else {"do_sample": True, "temperature": sample_temperature, "top_p": 1.0, "top_k": 0}
        )
        generated = model.generate(
            **encoded, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id(tokenizer), **decoding, **stop
        )
        texts = tokenizer.batch_decode(generated[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
        outputs += [cut_at_stops(text, stop_strings) for text in texts]
    return outputs


def cut_at_stops(text: str, stop_strings) -> str:
    """The text before each stop string in turn (lm-eval cuts the same way)."""
    for stop in stop_strings:
        if stop:
            text = text.split(stop, 1)[0]
    return text


def question_subset(rows: list[dict], limit: int | None, seed: int, key: str = "question") -> list[dict]:
    """``limit`` rows chosen by a seeded hash of their question text, kept in source order: the same questions
    whatever the order or layout of the source (hub or CSV); all rows when ``limit`` is None."""
    if limit is None or limit >= len(rows):
        return list(rows)
    if limit < 0:
        raise ValueError(f"limit must be a positive number of rows, got {limit}")

    def rank(index: int) -> tuple[str, int]:
        digest = hashlib.sha256(f"{seed}\0{rows[index][key].strip()}".encode()).hexdigest()
        return digest, index

    keep = sorted(sorted(range(len(rows)), key=rank)[:limit])
    return [rows[i] for i in keep]


def first_rows(rows: list[dict], limit: int | None) -> list[dict]:
    """The first ``limit`` rows, as lm-eval's ``--limit`` takes them."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be a positive number of rows, got {limit}")
    return list(rows if limit is None else rows[:limit])


def subset_rows(rows: list[dict], limit: int | None, seed: int, rule: str) -> list[dict]:
    """``limit`` rows by a protocol's subset rule: ``"first"`` (:func:`first_rows`) or ``"question-hash"``
    (:func:`question_subset`)."""
    return first_rows(rows, limit) if rule == "first" else question_subset(rows, limit, seed)


def argmax(values: list[float]) -> int:
    """Index of the largest value; the first on ties (as ``numpy.argmax``)."""
    return max(range(len(values)), key=lambda i: values[i])


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def true_mass(logprobs: list[float], labels: list[int]) -> float:
    """Share of probability on the true answers (label 1) among all answers (MC2), computed as a float64 softmax,
    so it stays finite when every log-likelihood is below about -745 (where ``exp`` underflows to 0)."""
    values = torch.tensor(logprobs, dtype=torch.float64).softmax(0)
    return float(values[torch.tensor(labels) == 1].sum())
