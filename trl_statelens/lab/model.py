"""Tiny ``Qwen3ForCausalLM`` models built from a config: the same architecture as Qwen3-0.6B-Base, scaled down."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM

# name -> (hidden_size, num_hidden_layers, intermediate_size). Heads: 4 query, 2 key/value, as in Qwen3's GQA.
MODEL_SIZES = {
    "test": (64, 2, 128),  # about 0.1M parameters: builds and trains a few steps in seconds
    "lab": (128, 4, 512),  # about 1.1M parameters: pretrained into the lab base model in minutes
}


def build_model(size: str, tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 of the named size whose vocabulary and special ids match ``tokenizer``."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}: choose one of {sorted(MODEL_SIZES)}")
    hidden, layers, ffn = MODEL_SIZES[size]
    return build_qwen3(tokenizer, hidden, layers, ffn, seed=seed)


def build_qwen3(
    tokenizer: PreTrainedTokenizerBase,
    hidden: int,
    layers: int,
    ffn: int,
    vocab_size: int | None = None,
    seed: int = 0,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 of any width with ``tokenizer``'s special ids (the benchmarks' models too).

    ``vocab_size`` defaults to the tokenizer's. A larger one is allowed: ids past the tokenizer only need to decode (to
    nothing), and full-vocabulary losses and projections pay for every row of the embedding. ``heads`` query and
    ``kv_heads`` key/value heads of width ``head_dim`` (default ``hidden // heads``); Qwen3-0.6B has 16, 8 and 128."""
    eos_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    config = Qwen3Config(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden // heads,  # Qwen3Config defaults to 128, far too wide for the lab's models
        max_position_embeddings=tokenizer.model_max_length,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    # Stop at the end of a document (plain format) or of an assistant turn (chat format), as Qwen3 does.
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id)
    return model
