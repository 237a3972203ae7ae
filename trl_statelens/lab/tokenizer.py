"""A byte-level BPE tokenizer trained offline on the lab world's text, wrapped as a ``PreTrainedTokenizerFast``."""

from __future__ import annotations

import random
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from .world import LabWorld

EOS = "<|endoftext|>"  # end of document; the base model's eos, as in Qwen3-Base
PAD = "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"

# ChatML with `{% generation %}` around what the assistant writes, so TRL's `assistant_only_loss=True` can build
# assistant masks. Adding the generation prompt gives a prefix of the full conversation, which SFT and GRPO need.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def training_texts(world: LabWorld, num_documents: int = 20000, seed: int = 0) -> Iterable[str]:
    rng = random.Random(f"{world.seed}-tokenizer-{seed}")
    for _ in range(num_documents):
        yield world.corpus_document(rng)
    # Every evaluation string, so no held-out word falls back to single bytes.
    for row in world.math("test") + world.math("dev"):
        yield row["question"] + "\n" + row["answer"]
    for row in world.kb("test"):
        yield row["question"] + " " + " ".join(row["choices"])
    for row in world.truth("test"):
        yield row["question"] + " " + " ".join(row["mc2_targets"]["choices"])
    yield "system user assistant"


def build_tokenizer(
    world: LabWorld, vocab_size: int = 1024, num_documents: int = 20000, individual_digits: bool = True
) -> PreTrainedTokenizerFast:
    """Train the lab tokenizer (a few seconds). Digits are split one by one so arithmetic stays learnable;
    `individual_digits=False` keeps runs of digits together for the merges to join (a second lab tokenizer, for a
    teacher of another tokenizer)."""
    tok = Tokenizer(models.BPE())  # no unk token: the byte-level alphabet covers every string
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=individual_digits), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(training_texts(world, num_documents), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="left",  # batched generation (GRPO, evaluation) left-pads prompts
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )
