"""Does the teacher read the student's token ids as the student does? The checks every teacher passes when it is
made: in-process ([`check_same_vocabulary`], on the models) and served (the client's start-up checks, on the
server's answers); both compare tokenizers with [`token_id_mismatch`]."""

from __future__ import annotations

import logging
from pathlib import Path

from accelerate.utils import is_peft_model
from transformers import AutoTokenizer

logger = logging.getLogger(__name__)

CROSS_TOKENIZER_HINT = (
    "Use a teacher with the student's tokenizer; or, for signal='reverse_kl' or 'continuation', a teacher given by a "
    "path that holds its own tokenizer (in the training processes, one or several routed, or behind a server with "
    "teacher_model_server_url; read as text in its tokens: docs/cross-tokenizer.md); or TRL's GOLDTrainer."
)


def read_tokenizer(path: str | None):
    """The tokenizer saved at `path`, or `None` when none was read (no path, a checkpoint without a tokenizer): not
    known, which says nothing about whether it is the student's (the callers compare output layers then)."""
    if not path:
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def read_teacher_tokenizer(path: str):
    """`read_tokenizer(path)` for a teacher about to be loaded from `path`: a path that is no folder and names no hub
    model that can be read here is refused now, before any model loads, rather than by the loading."""
    if Path(path).expanduser().exists():
        return read_tokenizer(path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"the teacher {path!r} is not a folder, and no hub model of that name could be read ({error}). Check the "
            "path (a saved model folder) or the hub id; offline (HF_HUB_OFFLINE=1), a hub model must be in the cache"
        ) from error


def model_path(model) -> str | None:
    """Where a model instance was loaded from (its `name_or_path`, set by `from_pretrained`), or `None`."""
    model = getattr(model, "module", model)
    config = getattr(model, "config", None)
    return getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", None) or None


def padding_allowance(rows: int) -> int:
    """How many rows past `rows` (the student's output layer) a teacher of the same tokenizer may have as padding
    (Qwen2.5-7B pads 128 past Qwen2.5-0.5B's 151,936): more, and its tokenizer is taken to be another."""
    return max(128, rows // 100)


def vocab_size(model) -> int:
    """Rows of the model's output layer, from its config (unwrapped from PEFT/DDP/DeepSpeed; ZeRO-3-safe)."""
    model = getattr(model, "module", model)  # DDP, DeepSpeed engine
    model = model.get_base_model() if is_peft_model(model) else model
    return model.config.get_text_config().vocab_size


def token_id_mismatch(student_tokenizer, teacher_tokenizer, name) -> str | None:
    """Why the teacher's tokenizer (`name`, for the message) cannot teach the student's, or `None` when both map every
    token to the same id."""
    if teacher_tokenizer.get_vocab() == student_tokenizer.get_vocab():
        return None
    return (
        f"the teacher's tokenizer ({name}) maps tokens to ids differently from the student's: the same ids would mean "
        "different text to each model."
    )


def check_same_vocabulary(student, student_tokenizer, teacher, teacher_path: str | None, signal: str) -> None:
    """The teacher must read the student's token ids as the student does. Its output layer may have more rows than the
    student's, as when a larger model of a family is padded further (Qwen2.5-7B: 152064, Qwen2.5-0.5B: 151936, one
    tokenizer): `reverse_kl` and `continuation` score the student's ids, all below the student's vocab_size, under
    the teacher's softmax over its whole output layer (the teacher as it is: padding rows no tokenizer id reaches
    carry next to no mass in a trained model), and the teacher never writes a padding id. `divergence` compares whole
    next-token distributions, which needs the same width."""
    student_vocab, teacher_vocab = vocab_size(student), vocab_size(teacher)
    if teacher_vocab < student_vocab:
        raise ValueError(
            f"the teacher's vocab_size ({teacher_vocab}) is smaller than the student's ({student_vocab}): on-policy "
            f"distillation scores the student's tokens with the teacher, so every student id must be one of the "
            f"teacher's. {CROSS_TOKENIZER_HINT}"
        )
    if teacher_vocab > student_vocab and signal == "divergence":
        raise ValueError(
            f"signal='divergence' compares the student's and the teacher's full next-token distributions, but the "
            f"teacher's output layer has {teacher_vocab} rows and the student's {student_vocab}. If the extra rows are "
            "padding (the same tokenizer), drop them from the teacher before training, "
            f"`teacher.resize_token_embeddings({student_vocab})` (its distribution renormalised over the shared ids), "
            "or use signal='reverse_kl' or 'continuation', which score the student's ids under the whole teacher"
        )
    teacher_tokenizer = read_tokenizer(teacher_path)  # without one, the output layers are all we can compare
    if teacher_tokenizer is None:
        if teacher_vocab - student_vocab > padding_allowance(student_vocab):
            raise ValueError(
                f"the teacher's tokenizer could not be read ({teacher_path or 'a model with no name_or_path'}) and its "
                f"output layer has {teacher_vocab} rows, far more than the student's {student_vocab}: it is most likely "
                "another tokenizer's, whose ids mean other text. Save the teacher's tokenizer with it "
                "(`tokenizer.save_pretrained(folder)`) and pass the folder, or load the instance from it, so that it "
                "is read as a teacher of another tokenizer (docs/cross-tokenizer.md)"
            )
        if teacher_vocab != student_vocab:
            logger.warning(
                "The teacher's output layer has %d rows, the student's %d, and no teacher tokenizer was read to check "
                "that both map ids alike: the extra rows are taken as padding of the same tokenizer. Save its "
                "tokenizer with it to have it checked.",
                teacher_vocab,
                student_vocab,
            )
        return
    mismatch = token_id_mismatch(student_tokenizer, teacher_tokenizer, teacher_path)
    if mismatch:
        raise ValueError(f"{mismatch} {CROSS_TOKENIZER_HINT}")
    if teacher_tokenizer.chat_template != student_tokenizer.chat_template:
        logger.warning(
            "The teacher's chat template (%s) differs from the student's: prompts are formatted with the student's "
            "template and the teacher scores those tokens, so on conversational data the teacher reads a layout it "
            "was not trained on. Use a teacher fine-tuned with the student's template, or plain-text prompts.",
            teacher_path,
        )
