"""Sampling from a LoRA student with its adapter merged into the weights, which are then restored bit for bit.

A LoRA layer that is not merged runs two more small matmuls per token (`x A`, then `B`): at every decoding step of
`generate`, where a step's rows are few, that is a quarter of a real-size rollout's time on a CPU (SmolLM2-135M,
8 rollouts of 128 tokens: 21 s against 15.5 s merged, BENCHMARKS.md 6.1). TRL merges the adapter in place before it
sends weights to vLLM and subtracts it after; in float32 (and more so in bf16) `W + dW - dW` is not `W`, so the frozen
base would drift a rounding error a step. Here each adapted weight is swapped for a merged copy while sampling and
the original tensor is put back: the base is untouched, at the price of one copy of the adapted weights while
`generate` runs.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor


def _mergeable_layers(model) -> list | None:
    """The LoRA linear layers of `model` whose merged weight replaces the adapter exactly, or `None` where the model
    is not a PEFT LoRA model whose every adapted layer is one (DoRA, embeddings, convolutions, `modules_to_save`, an
    adapter already merged or disabled, weights sharded into DTensors: those keep sampling through the adapter)."""
    try:
        from peft import PeftModel
        from peft.tuners.lora import Linear, LoraLayer
    except ImportError:
        return None
    if not isinstance(model, PeftModel):
        return None
    adapters = model.active_adapters
    for name in adapters:
        config = model.peft_config[name]
        if getattr(config, "peft_type", None) != "LORA" or getattr(config, "modules_to_save", None):
            return None
    layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    for layer in layers:
        if type(layer) is not Linear or layer.merged or layer.disable_adapters:
            return None
        if isinstance(layer.get_base_layer().weight, DTensor):  # sharded at load (FSDP2 without accelerate's plugin)
            return None
        if any(layer.use_dora.get(name, False) for name in adapters):
            return None
    return layers or None


@contextmanager
def merged_lora_for_sampling(trainer, model):
    """While the block runs, `model` (the trainer's student, unwrapped for generation) samples through merged weights
    where `trainer.args.merge_lora_for_sampling` is set and the merge is exact (see `_mergeable_layers`); otherwise
    nothing changes. Not under ZeRO-3 or FSDP, whose weights are shards, nor with vLLM, which merges on its own."""
    from .teachers.self_teacher_weights import is_zero3  # the teachers import the lens, which samples through this

    args = trainer.args
    sharded = is_zero3(trainer) or getattr(trainer, "is_fsdp_enabled", False)
    if not getattr(args, "merge_lora_for_sampling", False) or getattr(args, "use_vllm", False) or sharded:
        yield
        return
    layers = _mergeable_layers(model)
    if layers is None:
        yield
        return
    originals = []
    with torch.no_grad():
        for layer in layers:
            weight = layer.get_base_layer().weight
            delta = sum(layer.get_delta_weight(name) for name in model.active_adapters if name in layer.lora_A)
            originals.append((weight, weight.data))
            weight.data = weight.data + delta.to(weight.dtype)
    try:
        with model.disable_adapter():
            yield
    finally:
        for weight, original in originals:
            weight.data = original


@contextmanager
def student_sampling(trainer, model):
    """How the student samples its rollouts, probes and preflight answers: through merged LoRA weights where they
    apply ([`merged_lora_for_sampling`]), under the trainer's mixed-precision autocast, the precision its loss's
    forward runs in. With `bf16=True` on a CPU an fp32 model then decodes in bf16, as it trains (1.5x faster decoding
    for SmolLM2-135M on a CPU with bf16 instructions, BENCHMARKS.md 6.3); TRL's own generation decodes in fp32 there.
    Without mixed precision nothing changes."""
    with merged_lora_for_sampling(trainer, model), trainer.accelerator.autocast():
        yield
