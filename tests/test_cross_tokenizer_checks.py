"""A teacher of another tokenizer: what is refused before any model loads, how rows it would misread are read, and
that a row it cannot read stops every rank together."""

import runpy
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_alignment import CHATML, GEMMA_STYLE, byte_level_tokenizer, sentencepiece_style_tokenizer
from test_collective import TwoRanks
from test_cross_tokenizer_teacher import opd_config
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from trl import ModelConfig
from vllm_test_server import TestTeacherServer

from trl_statelens import OnPolicyDistillTrainer, collective, load_gsm8k
from trl_statelens.lab import build_model, build_tokenizer
from trl_statelens.opd import trainer as opd_trainer
from trl_statelens.teachers import CrossTokenizerTeacher, ServedCrossTokenizerTeacher, check_before_loading
from trl_statelens.teachers.alignment import align_token_ids
from trl_statelens.teachers.server_client import TeacherServerError


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


def test_a_tokenizer_that_writes_a_space_before_the_text_is_refused_before_any_model_loads(
    tmp_path, student_path, math_dataset, monkeypatch
):
    """Llama 2's layout (Metaspace, `prepend_scheme="first"`): "the 12" reads back as " the 12", so every row would
    misalign. Refused from its tokenizer alone; `"never"` spells text back and passes the same check."""
    for scheme in ("first", "never"):
        metaspace_tokenizer(scheme).save_pretrained(tmp_path / scheme)
    student = AutoTokenizer.from_pretrained(student_path)
    assert check_before_loading(opd_config(tmp_path), student, str(tmp_path / "never")) is True
    no_loading(monkeypatch)
    with pytest.raises(ValueError, match=r"does not spell text back.*prepend_scheme='first'"):
        OnPolicyDistillTrainer(
            model=str(student_path),
            teacher_model=str(tmp_path / "first"),
            args=opd_config(tmp_path / "run"),
            train_dataset=math_dataset,
        )


def test_generation_config_ends_chat_templates_and_unknown_paths_are_refused_before_any_model_loads(
    tmp_path, split, whole, student_path, other_teacher_path, teacher_path, math_dataset, monkeypatch
):
    """What the tokenizers decide is decided before any model loads: a student end token from its generation config
    (Llama 3's `<|eom_id|>`) with no counterpart by role, a teacher of another tokenizer without a chat template on
    conversational rows, `teacher_reads_student_text` with a teacher of the student's tokenizer, and a teacher path
    that names nothing (a dict's later teacher too, before the first loads)."""
    whole.save_pretrained(tmp_path / "whole")
    tool = split.convert_tokens_to_ids("<tool>")
    with pytest.raises(ValueError, match=r"'<tool>'.*no role.*generation_config.eos_token_id"):
        check_before_loading(opd_config(tmp_path), split, str(tmp_path / "whole"), end_token_ids=[tool])
    no_loading(monkeypatch)
    no_template = tmp_path / "no-template"
    shutil.copytree(other_teacher_path, no_template)
    for name in ("chat_template.jinja", "chat_template.json"):
        (no_template / name).unlink(missing_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(no_template)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(no_template)
    chat = load_gsm8k("lab", "train", prompt_format="chat", limit=8)
    with pytest.raises(ValueError, match="has no chat template"):
        OnPolicyDistillTrainer(
            model=str(student_path), teacher_model=str(no_template), args=opd_config(tmp_path), train_dataset=chat
        )
    with pytest.raises(ValueError, match="teacher_reads_student_text=True, but no teacher has another tokenizer"):
        OnPolicyDistillTrainer(
            model=str(student_path),
            teacher_model=str(teacher_path),
            args=opd_config(tmp_path, teacher_reads_student_text=True),
            train_dataset=math_dataset,
        )
    for teacher_model in (str(tmp_path / "nowhere"), {"a": str(teacher_path), "b": "no-such-owner/no-such-model"}):
        with pytest.raises(ValueError, match="is not a folder, and no hub model of that name could be read"):
            OnPolicyDistillTrainer(
                model=str(student_path),
                teacher_model=teacher_model,
                args=opd_config(tmp_path),
                train_dataset=math_dataset,
            )


# ----- finding 2: a teacher of another tokenizer is read as one, whatever way it is given ----------------------------


@pytest.fixture(scope="module")
def big_teacher_path(tmp_path_factory, world):
    """A lab teacher with its own 1,500-token tokenizer (its output layer has more rows than the student's 1,024)."""
    path = tmp_path_factory.mktemp("big-teacher")
    big = build_tokenizer(world, vocab_size=1500, num_documents=500, individual_digits=False)
    build_model("test", big, seed=3).save_pretrained(path)
    big.save_pretrained(path)
    return path


def test_an_instance_teacher_of_another_tokenizer_is_read_as_a_cross_tokenizer_teacher(
    tmp_path, student_path, big_teacher_path, math_dataset
):
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=AutoModelForCausalLM.from_pretrained(big_teacher_path),
        args=opd_config(tmp_path, max_completion_length=8),
        train_dataset=math_dataset.select(range(8)),
        state_logging=False,
    )
    assert trainer.teacher.crosses_tokenizers


def test_an_instance_whose_tokenizer_cannot_be_read_and_whose_vocabulary_differs_is_refused(
    tmp_path, student_path, big_teacher_path, math_dataset
):
    teacher = AutoModelForCausalLM.from_pretrained(big_teacher_path)
    teacher.name_or_path = teacher.config._name_or_path = ""  # built in memory: nowhere to read a tokenizer from
    with pytest.raises(ValueError, match=r"tokenizer could not be read .* far more than the student's 1024"):
        OnPolicyDistillTrainer(
            model=str(student_path),
            teacher_model=teacher,
            args=opd_config(tmp_path, max_completion_length=8),
            train_dataset=math_dataset.select(range(8)),
        )


def test_a_served_teacher_of_another_tokenizer_in_a_dict_is_refused(
    tmp_path, student_path, big_teacher_path, math_dataset
):
    """A URL in a `teacher_model` dict gives no path to read the teacher's tokenizer from: the server's own tokenization
    is compared with the student's (vLLM's /tokenize), or, on a server without it, its vocabulary's size."""
    for tokenize, match in [(True, "tokenize.* differently"), (False, r"id 1152, far past .* no /tokenize")]:
        with TestTeacherServer(big_teacher_path, tokenize=tokenize) as server:
            with pytest.raises(TeacherServerError, match=match):
                OnPolicyDistillTrainer(
                    model=str(student_path),
                    teacher_model={"kb": server.url},
                    args=opd_config(tmp_path, max_completion_length=8),
                    train_dataset=math_dataset.select(range(8)),
                )


def test_the_recipe_reads_a_served_teachers_short_name_for_its_tokenizer(
    tmp_path, student_path, big_teacher_path, math_dataset, monkeypatch
):
    """`--teacher_model_name_or_path gemma3-270m --teacher_model_server_url URL`: the short name is resolved to its
    folder before the served teacher is made, so the teacher is read as one of another tokenizer (here a lab teacher
    of its own tokenizer stands for Gemma, which is not converted in tests)."""
    recipe = runpy.run_path(str(Path(__file__).parents[1] / "recipes" / "opd.py"))
    main, arguments = recipe["main"], recipe["OPDScriptArguments"]
    resolved = {"gemma3-270m": str(big_teacher_path), str(student_path): str(student_path)}
    monkeypatch.setitem(main.__globals__, "resolve_model", lambda name, seed=0: resolved[name])
    made = {}

    def stop(name, trainer, *args):
        made["teacher"] = trainer.teacher

    monkeypatch.setitem(main.__globals__, "run_recipe", stop)
    with TestTeacherServer(big_teacher_path) as server:
        main(
            arguments(teacher_model_name_or_path="gemma3-270m"),
            opd_config(tmp_path, max_completion_length=8, teacher_model_server_url=server.url),
            ModelConfig(model_name_or_path=str(student_path)),
            dataset=math_dataset.select(range(8)),
        )
    assert isinstance(made["teacher"], ServedCrossTokenizerTeacher)


def test_the_student_is_kept_from_sampling_what_a_teacher_of_another_tokenizer_cannot_read(
    tmp_path, student_path, big_teacher_path, math_dataset
):
    """A student special token of no role (SmolLM2's `<file_sep>`) and its output layer's rows past its tokenizer are
    suppressed in its generation, as the teacher is kept from writing ids the student cannot read."""
    student = tmp_path / "student"
    tokenizer = AutoTokenizer.from_pretrained(student_path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<file_sep>"]})
    tokenizer.save_pretrained(student)
    model = AutoModelForCausalLM.from_pretrained(student_path)
    model.resize_token_embeddings(len(tokenizer) + 15)
    model.save_pretrained(student)
    trainer = OnPolicyDistillTrainer(
        model=str(student),
        teacher_model=str(big_teacher_path),
        args=opd_config(tmp_path / "run", max_completion_length=8),
        train_dataset=math_dataset.select(range(8)),
        state_logging=False,
    )
    file_sep = tokenizer.convert_tokens_to_ids("<file_sep>")
    expected = [file_sep, *range(len(tokenizer), len(tokenizer) + 15)]
    assert trainer.generation_config.suppress_tokens == trainer.generation_kwargs["suppress_tokens"] == expected
    trainer.train()  # and it trains


def test_tokenizer_ids_past_the_teachers_output_layer_carry_no_mass(split, whole):
    """A tokenizer with ids past its model's rows (Gemma 3's `<image_soft_token>` at 262,144): the distribution carried
    to the student is padded with zeros there, not refused."""
    teacher = reading_teacher(split, whole)
    rows = len(teacher.teacher_vocab) - 3
    probs = teacher._full_width(torch.randn(2, rows).log_softmax(-1))
    assert probs.shape == (2, len(teacher.teacher_vocab)) and (probs[:, rows:] == 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))
