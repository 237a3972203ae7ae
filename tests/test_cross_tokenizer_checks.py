"""A teacher of another tokenizer: what is refused before any model loads, how rows it would misread are read, and
that a row it cannot read stops every rank together."""

import threading
from types import SimpleNamespace

import pytest
from test_alignment import CHATML, GEMMA_STYLE, byte_level_tokenizer, sentencepiece_style_tokenizer
from test_collective import TwoRanks
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from trl_statelens import collective
from trl_statelens.opd import trainer as opd_trainer
from trl_statelens.teachers import CrossTokenizerTeacher
from trl_statelens.teachers.alignment import align_token_ids


def no_loading(monkeypatch):
    monkeypatch.setattr(opd_trainer, "load_teacher", lambda *a: pytest.fail("the teacher loaded before the refusal"))


def reading_teacher(student_tokenizer, teacher_tokenizer, accelerator=None) -> CrossTokenizerTeacher:
    """A teacher of another tokenizer with no model: enough to read rows as text (`score(..., distribution=True)`
    runs no forward)."""
    teacher = CrossTokenizerTeacher.__new__(CrossTokenizerTeacher)
    teacher.trainer = SimpleNamespace(
        accelerator=accelerator,
        eos_token_ids=[student_tokenizer.eos_token_id],
        _count_teacher_context=lambda *args: None,
    )
    teacher._read_as_text(student_tokenizer, teacher_tokenizer)
    return teacher


@pytest.fixture(scope="module")
def split():
    return byte_level_tokenizer(False, 380, ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<tool>"], CHATML)


@pytest.fixture(scope="module")
def whole():
    return byte_level_tokenizer(
        True, 420, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<unused0>"], GEMMA_STYLE
    )


def metaspace_tokenizer(prepend_scheme: str, normalizer=None):
    """Llama 2's layout in miniature: Metaspace pre-tokenizer and decoder (`prepend_scheme="first"` writes a `▁`
    before the text), byte fallback."""
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{byte:02X}>" for byte in range(256))]
    pieces += ["▁", "t", "h", "e", "he", "the", "▁the", "1", "2", "12"]
    model = models.BPE(
        vocab={piece: i for i, piece in enumerate(pieces)},
        merges=[("h", "e"), ("t", "he"), ("▁", "the"), ("1", "2")],
        byte_fallback=True,
        unk_token="<unk>",
    )
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme, split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Metaspace(prepend_scheme=prepend_scheme), decoders.ByteFallback()])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


# ----- finding 1: rows a teacher of another tokenizer would misread or cannot read ------------------------------------


def test_a_row_the_teacher_cannot_read_stops_both_ranks(split, whole, monkeypatch):
    """Rank 0's row holds the student's `<tool>`, a special token of no role: the teacher cannot read it. Both ranks
    raise there, rank 1 naming rank 0, instead of rank 1 going on alone to its next collective."""
    ranks = TwoRanks(timeout=20)
    monkeypatch.setattr(collective, "gather_counts", ranks.gather_counts)
    teachers = [reading_teacher(split, whole, SimpleNamespace(num_processes=2)) for _ in range(2)]
    text = split("the 12 apples", add_special_tokens=False)["input_ids"]
    rows = ([text + [split.convert_tokens_to_ids("<tool>")]], [text])
    errors = [None, None]

    def run(rank):
        ranks.local.rank = rank
        try:  # the teacher reads its rows for `divergence` (no forward)
            teachers[rank].score([[0]], rows[rank], distribution=True)
        except BaseException as error:  # noqa: BLE001 (asserted below)
            errors[rank] = error
        ranks.finish(rank)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert isinstance(errors[0], ValueError) and "no role" in str(errors[0])
    assert isinstance(errors[1], ValueError) and "process 0: a row could not be read" in str(errors[1])


def test_text_a_teacher_would_rewrite_is_read_as_the_bytes_written(split, whole):
    """A literal `▁` (a Gemma-style teacher reads it as a space), a special token's string (matched as the token), and
    decomposed or compatibility characters (rewritten by an NFC teacher, Qwen's): each teacher reads the student's
    bytes, and the alignment holds."""
    nfc = byte_level_tokenizer(True, 420, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<unused0>"], None)
    nfc.backend_tokenizer.normalizer = normalizers.NFC()
    for teacher_tokenizer, text in [
        (sentencepiece_style_tokenizer(), "the \u2581 12"),
        (sentencepiece_style_tokenizer(), "the <eos> 12"),
        (nfc, "caf" + "e\u0301 costs 5 \u2126"),
    ]:
        teacher = reading_teacher(split, teacher_tokenizer)
        student_ids = split(text, add_special_tokens=False)["input_ids"]
        teacher_ids = teacher.respell(student_ids)
        assert b"".join(teacher.teacher_vocab.token_bytes[i] for i in teacher_ids) == text.encode()
        align_token_ids(student_ids, teacher_ids, teacher.student_vocab, teacher.teacher_vocab)
        # and back: what such a teacher writes reaches the student as the same text
        assert split.decode(teacher.student_continuation(teacher_ids, 64)) == text
