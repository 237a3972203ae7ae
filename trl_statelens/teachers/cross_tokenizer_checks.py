"""What a teacher of another tokenizer cannot do, refused before any model loads: the settings it cannot serve, the
tokenizers that cannot be read as text, end tokens without a counterpart (issue 45). [`CrossTokenizerTeacher`] and
[`ServedCrossTokenizerTeacher`] check again when they are made."""

from __future__ import annotations

from .byte_vocab import byte_vocabulary
from .reads_text import check_spells_text_back, refuse_unmapped_ends
from .vocabulary import read_teacher_tokenizer, token_id_mismatch


def refuse_unsupported(args, name: str, served: bool = False) -> None:
    """What a teacher of another tokenizer (`name`, for the message; `served`: behind a server) cannot do, refused
    with the way out."""
    if args.signal == "divergence" and served:
        raise ValueError(
            f"the teacher's tokenizer ({name}) differs from the student's, and signal='divergence' from a served "
            "teacher is not carried across tokenizers: the server answers top-k log-probs, and carrying the teacher's "
            "distribution onto the student's vocabulary needs all of it (docs/cross-tokenizer.md). Run the teacher "
            "in the training processes (teacher_model without teacher_model_server_url), or use signal='reverse_kl' "
            "or 'continuation'"
        )


def check_before_loading(
    args, student_tokenizer, path: str, served: bool = False, end_token_ids=(), conversational: bool = False
) -> bool | None:
    """Before any model loads (Gemma 3 270M takes over a minute on 2 cores), what the tokenizer saved at the teacher's
    `path` (`served`: the tokenizer of a teacher behind a server) decides; a path that is neither a folder nor a hub
    model that can be read is refused. If it differs from `student_tokenizer` (`None`: not known yet, nothing more
    checked), the settings it cannot serve, tokenizers that cannot spell their tokens in bytes or do not spell text
    back, a student end token (its eos and `end_token_ids`, its generation config's) with no counterpart by role, and,
    on `conversational` data, a teacher tokenizer without a chat template are refused, as
    `CrossTokenizerTeacher.prepared` (or `ServedCrossTokenizerTeacher.connect`) and the first batch would refuse them
    after loading. Returns whether the teacher has another tokenizer (`None`: not known)."""
    teacher_tokenizer = read_teacher_tokenizer(path)
    if student_tokenizer is None or teacher_tokenizer is None:
        return None
    if token_id_mismatch(student_tokenizer, teacher_tokenizer, path) is None:
        return False
    refuse_unsupported(args, path, served)
    student_vocab = byte_vocabulary(student_tokenizer, "the student's")
    teacher_vocab = byte_vocabulary(teacher_tokenizer)
    check_spells_text_back(student_tokenizer, student_vocab, "the student's")
    check_spells_text_back(teacher_tokenizer, teacher_vocab, "the teacher's")
    if conversational and not args.teacher_reads_student_text and not teacher_tokenizer.chat_template:
        raise ValueError(
            f"the teacher's tokenizer ({path}) differs from the student's and has no chat template, so it cannot read "
            "the dataset's conversational prompts in its own layout: give it one (`tokenizer.chat_template = ...`, "
            "saved with the teacher), set teacher_reads_student_text=True (it reads the student's prompt as text, "
            "markup included) or train on plain-text prompts"
        )
    tokenizer_eos = student_tokenizer.eos_token_id
    ends = [token_id for token_id in dict.fromkeys([tokenizer_eos, *end_token_ids]) if token_id is not None]
    refuse_unmapped_ends(student_vocab, teacher_vocab, tokenizer_eos, ends)
    return True
