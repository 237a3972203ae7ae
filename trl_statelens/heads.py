"""LM-head arithmetic shared by the student's loss and the teachers: hidden states at the completion positions,
log-probs through TRL's chunked kernel, and the generalised JSD on a teacher's top-k support plus a tail bucket."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from trl.kernels import ChunkedLogProbFunction
from trl.kernels.chunked_divergence import TOKEN_CHUNK_SIZE, ChunkedDivergenceFunction, _compute_dtype
from trl.kernels.chunked_logprob import _torch_transform, _use_triton
from trl.trainer.utils import maybe_gather_lm_head_ctx

# Vocabulary columns per projection tile in the completion log-prob path (TRL's fused head uses 32768). On CPU a
# 4096-wide tile is as fast, and at V=32k it cuts the step's peak memory by about a third (BENCHMARKS.md).
VOCAB_CHUNK = 4096
# Completion positions whose full student log-softmax is formed at once in the top-k divergence
POSITION_CHUNK = 1024
# Smallest teacher tail mass when the top-k does not cover the vocabulary: the top-k probabilities, summed in float32,
# can reach 1 while the teacher's true tail is tiny, and a zero tail would make the reverse-KL term infinite.
TAIL_FLOOR = 1e-7


def _completion_hidden_states(unwrapped_model, input_ids, attention_mask, num_completion):
    """Final hidden states at the positions that predict the completion tokens, `(B, T, H)`."""
    decoder = unwrapped_model.get_decoder()
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return hidden[:, -num_completion - 1 : -1]


def _completion_hidden_states_and_aux_loss(unwrapped_model, input_ids, attention_mask, num_completion):
    """`_completion_hidden_states` and, from the same forward's router logits, a MoE model's load-balancing loss,
    computed as TRL's fused LM head computes it for GRPO (Mixtral's `load_balancing_loss_func`, padding excluded)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config = unwrapped_model.config.get_text_config()
    out = unwrapped_model.get_decoder()(
        input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_router_logits=True
    )
    aux_loss = load_balancing_loss_func(
        out.router_logits, config.num_experts, config.num_experts_per_tok, attention_mask
    )
    return out.last_hidden_state[:, -num_completion - 1 : -1], aux_loss


def _logit_post_processing(unwrapped_model) -> tuple[float, float | None]:
    """The logit scale and final soft-cap the model applies after its LM head, read from its config under the names
    TRL's fused head and `DistillationTrainer` read (`logit_scale`, `output_multiplier`, `lm_head_multiplier`, or
    `logits_scaling`, a divisor except for HyperCLOVA X)."""
    config = unwrapped_model.config.get_text_config()
    names = ("logit_scale", "output_multiplier", "lm_head_multiplier")
    scale = next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        scale = config.logits_scaling if config.model_type == "hyperclovax" else 1 / config.logits_scaling
    return (1.0 if scale is None else scale), getattr(config, "final_logit_softcapping", None)


def _head_logps(unwrapped_model, hidden, tokens, temperature, entropy):
    """Log-prob of `tokens` (and, if `entropy`, the entropy of the next-token distribution) from final hidden states
    `(B, T, H)`, with TRL's chunked kernel: the model's LM-head bias, logit scale and soft-cap applied, a ZeRO-3-sharded
    head gathered, and at most `VOCAB_CHUNK` vocabulary columns projected at a time."""
    head = unwrapped_model.get_output_embeddings()
    scale, softcap = _logit_post_processing(unwrapped_model)
    with maybe_gather_lm_head_ctx(head.weight, head.bias):
        logps, entropies, *_ = ChunkedLogProbFunction.apply(
            hidden.reshape(-1, hidden.size(-1)).to(head.weight.device),
            head.weight,
            head.bias,
            tokens.reshape(-1).to(head.weight.device),
            temperature,
            VOCAB_CHUNK,
            softcap,
            scale,
            ("log_probs", "entropy") if entropy else ("log_probs",),
        )
    return logps.view_as(tokens), None if entropies is None else entropies.view_as(tokens)


def _completion_logps_and_entropies(unwrapped_model, input_ids, attention_mask, num_completion, temperature, entropy):
    """Log-prob of each completion token and (if `entropy`) the entropy at its state, `(B, T)`, projecting the
    completion positions only; 0 at padding, as TRL's fused head gives."""
    hidden = _completion_hidden_states(unwrapped_model, input_ids, attention_mask, num_completion)
    logps, entropies = _head_logps(unwrapped_model, hidden, input_ids[:, -num_completion:], temperature, entropy)
    padding = attention_mask[:, -num_completion:] == 0
    return logps.masked_fill(padding, 0.0), None if entropies is None else entropies.masked_fill(padding, 0.0)


class _DivergenceAndLogNormalizers(ChunkedDivergenceFunction):
    """TRL's chunked divergence (`ChunkedDivergenceFunction`, what `DistillationTrainer` runs), also handing back what
    its forward keeps for the backward anyway: each position's student and teacher log-normalizer (the log-sum-exp of
    its logits after scale, soft-cap and temperature). A token's log-prob under either model is then one logit minus
    its normalizer, so the ledger's values need no second pass over the vocabulary. Same forward, same backward."""

    @staticmethod
    def forward(ctx, *args):
        divergence, entropy = ChunkedDivergenceFunction.forward(ctx, *args)
        # TRL 1.16 saves (student hidden, weight, bias, teacher hidden, weight, bias, student log-normalizer, teacher
        # log-normalizer, aux); copies, so that nothing done to an output can touch what the backward reads
        student_log_z, teacher_log_z = (t.clone() for t in ctx.to_save[6:8])
        ctx.mark_non_differentiable(entropy, student_log_z, teacher_log_z)
        return divergence, entropy, student_log_z, teacher_log_z

    @staticmethod
    def backward(ctx, grad_divergence, *unused):
        return ChunkedDivergenceFunction.backward(ctx, grad_divergence, None)


class Divergence(NamedTuple):
    """A micro-batch's `divergence` loss, and per completion position `(B, T)` the teacher's log-prob of the token,
    and the student's log-prob of it and entropy there when the loss's own pass gives them (`None` otherwise: the
    trainer projects them itself). From a teacher of another tokenizer, `leftover`: at each position where its
    distribution was carried onto the student's vocabulary, the mass that reached no student token; NaN where none was
    (the position was left out of the loss)."""

    loss: torch.Tensor
    teacher_logps: torch.Tensor
    logps: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    leftover: torch.Tensor | None = None


def divergence_and_token_logps(
    student,
    student_hidden: torch.Tensor,
    teacher,
    teacher_hidden: torch.Tensor,
    tokens: torch.Tensor,
    loss_mask: torch.Tensor,
    token_mask: torch.Tensor,
    beta: float,
    normalizer,
    temperature: float = 1.0,
    teacher_head: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> Divergence:
    """TRL's exact generalised JSD between the student's and the teacher's next-token distributions over the full
    vocabulary, computed as `DistillationTrainer`'s `_chunked_divergence_loss` computes it (summed over the positions
    with `loss_mask != 0`, divided by `normalizer`), plus the per-token values the state records need, from that pass.

    Args:
        student, teacher: the unwrapped models whose output layers project `student_hidden` and `teacher_hidden`
            `(B, T, H)`, the final hidden states at the completion positions, with their logit scale and soft-cap.
        tokens (`torch.Tensor`): `(B, T)` the completion tokens, whose log-probs are returned.
        loss_mask (`torch.Tensor`): `(B, T)`, non-zero at the positions the loss sums.
        token_mask (`torch.Tensor`): `(B, T)`, non-zero where the per-token values are wanted too (the completion:
            the metrics read the tokens the student sampled, supervised or not).
        teacher_head (`tuple`, *optional*): the teacher's output layer as `(weight, bias)`, read where the teacher's
            weights were in place (a self teacher sharing the student's module: [`SelfTeacher`]); by default
            `teacher.get_output_embeddings()`'s. The student's is always read here, as it is now.
    """
    weights, biases = [], []
    for model, hidden, head in ((student, student_hidden, None), (teacher, teacher_hidden, teacher_head)):
        if head is None:
            layer = model.get_output_embeddings()
            head = layer.weight, layer.bias
        weight, bias = head
        if isinstance(weight, DTensor):  # FSDP2: one gather for every chunk, as `_chunked_divergence_loss` does
            weight = weight.full_tensor().to(hidden.dtype)
            bias = bias.full_tensor() if bias is not None else None
        weights.append(weight)
        biases.append(bias)
    (student_scale, student_softcap), (teacher_scale, teacher_softcap) = map(
        _logit_post_processing, (student, teacher)
    )
    loss_positions = loss_mask.reshape(-1) != 0
    positions = loss_positions | (token_mask.reshape(-1) != 0)
    h_s = student_hidden.reshape(-1, student_hidden.size(-1))
    h_t = teacher_hidden.reshape(-1, teacher_hidden.size(-1))
    flat_tokens = tokens.reshape(-1)
    # As TRL: only the wanted positions are projected on Triton devices; elsewhere every position is (static shapes)
    compact = _use_triton(student_hidden.device)
    if compact:
        h_s, h_t, flat_tokens, loss_positions = (x[positions] for x in (h_s, h_t, flat_tokens, loss_positions))
    with maybe_gather_lm_head_ctx(*weights, *biases):  # gathered once for the kernel's forward and the tokens' logits
        divergence, entropy, student_log_z, teacher_log_z = _DivergenceAndLogNormalizers.apply(
            h_s,
            weights[0],
            biases[0],
            h_t,
            weights[1],
            biases[1],
            beta,
            temperature,
            student_scale,
            student_softcap,
            teacher_scale,
            teacher_softcap,
        )
        with torch.no_grad():
            student_logits = _token_logits(
                h_s, weights[0], biases[0], flat_tokens, student_scale, student_softcap, temperature
            )
            teacher_logits = _token_logits(
                h_t, weights[1], biases[1], flat_tokens, teacher_scale, teacher_softcap, temperature
            )
    loss = divergence.masked_fill(~loss_positions, 0).sum()
    if isinstance(normalizer, torch.Tensor):
        normalizer = normalizer.to(loss.device)
    per_token = []  # (B, T), 0 where no value was asked for
    for values in (teacher_logits - teacher_log_z, student_logits - student_log_z, entropy):
        full = torch.zeros(positions.shape, dtype=values.dtype, device=values.device)
        full[positions] = values if compact else values[positions]
        per_token.append(full.view_as(tokens))
    return Divergence(loss / normalizer, *per_token)


def _token_logits(hidden, weight, bias, tokens, scale, softcap, temperature) -> torch.Tensor:
    """The logit of each position's token `(N,)`, after scale, soft-cap and temperature, projected as the divergence
    kernel projects (the hidden states and weight rows in its compute dtype, products summed in float32), a chunk of
    positions at a time."""
    dtype = _compute_dtype(hidden)
    logits = []
    for start in range(0, hidden.size(0), TOKEN_CHUNK_SIZE):
        rows = slice(start, start + TOKEN_CHUNK_SIZE)
        ids = tokens[rows].to(weight.device)
        logit = (hidden[rows].to(dtype).float() * weight[ids].to(dtype).float()).sum(-1)
        if bias is not None:
            logit = logit + bias[ids].float()
        logits.append(logit)
    logits = torch.cat(logits) if logits else hidden.new_zeros(0, dtype=torch.float32)
    return _torch_transform(logits, scale, softcap or 1.0, 1 / temperature, softcap is not None)


def _student_log_probs(unwrapped_model, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
    """Full next-token log-probs `(N, V)` in float32 from final hidden states `(N, H)`, through the model's own
    output layer (called as a module, so ZeRO-3 gathers its weights for the forward and the backward) with its logit
    scale and soft-cap, at `temperature`."""
    scale, softcap = _logit_post_processing(unwrapped_model)
    logits = unwrapped_model.get_output_embeddings()(hidden).float() * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return (logits / temperature).log_softmax(-1)


def _kl_terms(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """`p * (log p - log q)` per category (inputs finite; absent categories are masked by the caller)."""
    return log_p.exp() * (log_p - log_q)


def topk_tail_divergence(
    unwrapped_model,
    student_hidden: torch.Tensor,
    top_ids: torch.Tensor,
    top_logps: torch.Tensor,
    loss_mask: torch.Tensor,
    beta: float,
    normalizer,
    temperature: float = 1.0,
    chunks: list[slice] | None = None,
) -> torch.Tensor:
    """Generalised JSD between student and teacher restricted to the teacher's top-k tokens plus a tail bucket.

    At each position with `loss_mask != 0`, the categories are the teacher's top-k ids `v_1..v_k` (`top_ids`, with
    log-probs `top_logps`; entries at `-inf` are absent, and so are ids past the student's vocabulary, whose teacher
    mass stays in the tail) and one tail bucket: `p~_T = (p_T(v_1), ..., p_T(v_k), 1 - sum_i p_T(v_i))` and
    `p~_S = (p_S(v_1), ..., p_S(v_k), 1 - sum_i p_S(v_i))`, the student's from its full log-softmax. The loss is
    TRL's generalised JSD on these k+1 categories: `KL(p~_T || p~_S)` at `beta=0`, `KL(p~_S || p~_T)` at `beta=1`,
    else `beta KL(p~_T || m) + (1 - beta) KL(p~_S || m)` with `m = (1 - beta) p~_S + beta p~_T`; summed over
    positions and divided by `normalizer`. When the top-k covers the student's whole vocabulary there is no tail
    and the loss is the exact divergence. The teacher's tail is floored at `TAIL_FLOOR` otherwise.

    Args:
        unwrapped_model: the student, whose output layer projects `student_hidden`.
        student_hidden (`torch.Tensor`): `(B, T, H)` final hidden states at the completion positions.
        top_ids (`torch.Tensor`): `(B, T, k)` the teacher's top-k token ids per position.
        top_logps (`torch.Tensor`): `(B, T, k)` their teacher log-probs (`-inf` where absent).
        loss_mask (`torch.Tensor`): `(B, T)`, non-zero at the supervised positions.
        chunks (`list[slice]`, *optional*): the supervised positions (in row order) projected per call of the output
            layer; by default `POSITION_CHUNK` at a time. Under ZeRO-3 each call gathers the layer's shards: the
            caller passes as many as every rank makes ([`agreed_chunks`]), empty ones included.
    """
    valid = loss_mask != 0
    hidden = student_hidden[valid]
    ids, teacher = top_ids[valid].to(hidden.device), top_logps[valid].to(hidden.device, torch.float32)
    if chunks is None:
        chunks = [slice(i, i + POSITION_CHUNK) for i in range(0, hidden.size(0), POSITION_CHUNK)]
    losses = [
        topk_tail_jsd(_student_log_probs(unwrapped_model, hidden[c], temperature), ids[c], teacher[c], beta)
        for c in chunks
    ]
    total = torch.cat(losses).sum() if losses else student_hidden.sum() * 0.0
    if isinstance(normalizer, torch.Tensor):
        normalizer = normalizer.to(total.device)
    return total / normalizer


def topk_tail_jsd(
    student_log_probs: torch.Tensor, top_ids: torch.Tensor, top_logps: torch.Tensor, beta: float
) -> torch.Tensor:
    """Per position, the generalised JSD of [`topk_tail_divergence`] from the student's full log-probs `(N, V)` and
    the teacher's top-k ids and log-probs `(N, k)`: `(N,)`."""
    vocab = student_log_probs.size(-1)
    present = torch.isfinite(top_logps) & (top_ids < vocab) & (top_ids >= 0)
    ids = torch.where(present, top_ids, torch.zeros_like(top_ids))
    # Each id once: vLLM lists each at most once, but the padding of a short answer repeats id 0
    in_set = torch.zeros_like(student_log_probs).scatter_add_(1, ids, present.to(student_log_probs.dtype)) > 0
    has_tail = ~in_set.all(-1)
    student = student_log_probs.gather(1, ids)
    # Outside the set; a row whose set is the whole vocabulary gets a finite stand-in (masked below), since the
    # gradient of a log-sum-exp over nothing is NaN
    outside = torch.where(has_tail[:, None], student_log_probs.masked_fill(in_set, -math.inf), 0.0)
    student_tail = torch.logsumexp(outside, dim=-1)
    teacher_mass = (top_logps.double().exp() * present).sum(-1)
    teacher_tail = torch.log((1.0 - teacher_mass).clamp(min=TAIL_FLOOR)).to(top_logps.dtype)
    log_s = torch.cat([student, student_tail[:, None]], dim=1)
    log_t = torch.cat([top_logps, teacher_tail[:, None]], dim=1)
    keep = torch.cat([present, has_tail[:, None]], dim=1)
    return _generalised_jsd(log_s, log_t, keep, beta)


def mapped_jsd(student_log_probs: torch.Tensor, teacher_probs: torch.Tensor, beta: float) -> torch.Tensor:
    """Per position `(N,)`, the generalised JSD with `beta` (as [`topk_tail_jsd`]'s) between the student's full
    log-probs `(N, V)` and a teacher distribution carried onto the student's vocabulary, `teacher_probs` `(N, V_s)`,
    `V_s <= V` (`alignment.MappedDistribution.student_probs`: each teacher token's mass on the student token that
    spells its bytes, or the longest one they start with).

    The categories are the student tokens the carried distribution gives mass (the reached ones); both sides are
    renormalised over them: the teacher over its mass the student can read (what reached no student token, a
    special token without a counterpart or a padding row, is left out, as generation leaves it out), the student
    conditioned on writing one of them. A student token no teacher token reaches (one the teacher only writes as
    several tokens, as a student's `ab` against a teacher's `a`, `b`; an output layer's padding rows) has no teacher
    mass in one distribution: it is left out on both sides, so the loss neither pushes the student off it nor toward
    it. So the loss is a divergence between two distributions over the same categories: never negative, 0 where the
    student's conditional equals the carried teacher's. A position where no teacher mass reaches the student adds 0.
    With one tokenizer on both sides every token is reached and nothing is left out: the exact divergence over the
    vocabulary."""
    vocab = student_log_probs.size(-1)
    teacher = F.pad(teacher_probs.to(student_log_probs.dtype), (0, vocab - teacher_probs.size(-1)))
    reached = teacher > 0
    # (a row with nothing reached conditions on the whole vocabulary instead, a finite stand-in masked below: the
    # gradient of a log-sum-exp over nothing is NaN)
    conditioned_on = reached | ~reached.any(-1, keepdim=True)
    student_reached = torch.logsumexp(student_log_probs.masked_fill(~conditioned_on, -math.inf), -1, keepdim=True)
    readable = teacher.sum(-1, keepdim=True)
    log_t = teacher.log() - torch.where(readable > 0, readable, 1.0).log()
    return _generalised_jsd(student_log_probs - student_reached, log_t, reached, beta)


def _generalised_jsd(log_s: torch.Tensor, log_t: torch.Tensor, keep: torch.Tensor, beta: float) -> torch.Tensor:
    """TRL's generalised JSD per position over the categories `keep` marks `(N, C)`, from the student's and the
    teacher's log-probs of them: `KL(t || s)` at `beta=0`, `KL(s || t)` at `beta=1`, else `beta KL(t || m) +
    (1 - beta) KL(s || m)` with `m = (1 - beta) s + beta t`."""
    # Absent categories get finite stand-ins (their terms are masked out), so no NaN reaches the gradient
    log_s, log_t = torch.where(keep, log_s, 0.0), torch.where(keep, log_t, 0.0)
    if beta == 0.0:
        terms = _kl_terms(log_t, log_s)
    elif beta == 1.0:
        terms = _kl_terms(log_s, log_t)
    else:
        log_m = torch.logaddexp(log_s + math.log(1 - beta), log_t + math.log(beta))
        terms = beta * _kl_terms(log_t, log_m) + (1 - beta) * _kl_terms(log_s, log_m)
    return (terms * keep).sum(-1)
