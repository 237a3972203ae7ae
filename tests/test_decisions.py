"""Which carried teacher values are the teacher's probability of the student's decision
(`trl_statelens/teachers/decisions.py`), against a brute-force reference.

The toy teacher is an explicit function P(next teacher token | its tokens so far) over a hand-written vocabulary,
writing only the spellings its longest-match tokenizer writes (a next token that would make a spelling it never
writes gets no mass; the text may also end). The reference enumerates every teacher token sequence to compute
`D`, the teacher's probability that the text goes on with a student token's bytes given the text so far (and the
cuts the student chose), and compares it with the values `student_token_teacher_logprobs` and `move_teacher_ends`
carry.
"""

import math
import random
import zlib
from functools import lru_cache

import pytest
import torch

from trl_statelens.teachers.alignment import (
    TeacherSignal,
    align_token_ids,
    chunks_resolved,
    inner_prefixes,
    move_teacher_ends,
    resolved_logprobs,
    student_token_teacher_logprobs,
    student_tokens_the_teacher_extends,
)
from trl_statelens.teachers.byte_vocab import ByteVocabulary
from trl_statelens.teachers.decisions import Decision, decision_kinds, decision_table


def vocabulary(name, tokens) -> ByteVocabulary:
    return ByteVocabulary(name, tuple(tokens), {}, {}, frozenset())


def longest_match(text: bytes, tokens) -> list[int]:
    out, at = [], 0
    while at < len(text):
        out.append(max((i for i, t in enumerate(tokens) if text.startswith(t, at)), key=lambda i: len(tokens[i])))
        at += len(tokens[out[-1]])
    return out


class ToyTeacher:
    """P(next token | tokens so far) from a hash (`seed`), zero for a token after which some token of the sequence
    would have a longer vocabulary token spelling the same bytes (a spelling longest match never writes), with
    `END_WEIGHT` for the text ending."""

    END_WEIGHT = 1

    def __init__(self, tokens, seed):
        self.tokens, self.seed = tokens, seed
        self.next = lru_cache(maxsize=None)(self._next)

    def _written(self, path) -> bool:
        spelled = [self.tokens[t] for t in path]
        for i, token in enumerate(spelled):
            rest = b"".join(spelled[i:])
            if any(len(t) > len(token) and rest.startswith(t) for t in self.tokens):
                return False
        return True

    def _next(self, path: tuple) -> dict:
        weights = {
            t: 1 + zlib.crc32(repr((self.seed, path, t)).encode()) % 7
            for t in range(len(self.tokens))
            if self._written(path + (t,))
        }
        total = sum(weights.values()) + self.END_WEIGHT
        return {t: w / total for t, w in weights.items()}

    def prefix_probability(self, text: bytes, cuts) -> float:
        """P(the text written starts with `text`, a token ending at each offset in `cuts`), every token sequence
        enumerated until it covers `text` or leaves it."""

        def walk(path, at):
            total = 0.0
            for t, p in self.next(path).items():
                token = self.tokens[t]
                end = at + len(token)
                overlap = min(end, len(text)) - at
                if token[:overlap] != text[at : at + overlap] or any(at < c < end for c in cuts):
                    continue
                total += p if end >= len(text) else p * walk(path + (t,), end)
            return total

        return walk((), 0) if text else 1.0

    def carried(self, teacher_ids):
        """Per teacher token of the text: its log-prob, and the log-prob of any token starting with its bytes less it."""
        logps, ends = [], []
        for j, t in enumerate(teacher_ids):
            probs = self.next(tuple(teacher_ids[:j]))
            logps.append(math.log(probs[t]))
            ends.append(
                math.log(sum(p for u, p in probs.items() if self.tokens[u].startswith(self.tokens[t]))) - logps[-1]
            )
        return torch.tensor(logps, dtype=torch.float64), torch.tensor(ends, dtype=torch.float64)

    def prefix_logmass(self, teacher_ids, prefixes):
        """Per (teacher index, bytes) of `inner_prefixes`: the log-prob at that position of a token starting with the
        bytes."""
        return torch.tensor(
            [
                math.log(
                    sum(p for u, p in self.next(tuple(teacher_ids[:j])).items() if self.tokens[u].startswith(part))
                )
                for j, part in prefixes
            ],
            dtype=torch.float64,
        )


def reference(teacher: ToyTeacher, text: bytes, student_ids, student_tokens, chosen_end) -> list[float | None]:
    """`D` per student token: P(text up to its end, chosen cuts up to there) / P(text up to its start, chosen cuts up
    to there), where the chosen cuts are the student's that the teacher's own tokens of the text make too; `None`
    where the condition has no mass."""
    ends, cuts, out = [0], set(), []
    teacher_cuts = {0}
    for t in longest_match(text, teacher.tokens):
        teacher_cuts.add(max(teacher_cuts) + len(teacher.tokens[t]))
    for i in student_ids:
        ends.append(ends[-1] + len(student_tokens[i]))
    for k, i in enumerate(student_ids):
        before = teacher.prefix_probability(text[: ends[k]], frozenset(cuts))
        if chosen_end[i] and ends[k + 1] in teacher_cuts:
            cuts.add(ends[k + 1])
        after = teacher.prefix_probability(text[: ends[k + 1]], frozenset(cuts))
        out.append(after / before if before > 0 else None)
    return out


def carried_values(teacher, teacher_tokens, student_tokens, student_ids, text, moved: bool, resolved: bool = False):
    """As a teacher of another tokenizer carries its values: ends `moved` (in the process; a function of the two
    vocabularies: onto the ids it marks) or not (served), chunks `resolved` from the prefix masses (in the process)."""
    student, teacher_vocab = vocabulary("student", student_tokens), vocabulary("teacher", teacher_tokens)
    teacher_ids = longest_match(text, teacher_tokens)
    alignment = align_token_ids(student_ids, teacher_ids, student, teacher_vocab)
    logps, ends = teacher.carried(teacher_ids)
    if resolved:
        inner = teacher.prefix_logmass(teacher_ids, inner_prefixes(alignment, teacher_ids, teacher_vocab))
        alignment = chunks_resolved(alignment)
        values = resolved_logprobs(alignment, logps, inner)
    else:
        values, _ = student_token_teacher_logprobs(alignment, logps)
    table = decision_table(student, teacher_vocab)
    movable = None
    if moved:  # as an in-process teacher moves them: onto every token whose end the student does not choose
        movable = table.free_ends if moved is True else moved(student, teacher_vocab)
        values = move_teacher_ends(alignment, values, student_ids, movable, ends)
    kinds = decision_kinds(alignment, student_ids, teacher_ids, table, movable)
    return alignment, values, kinds, table


def random_segmentation(text: bytes, tokens, rng) -> list[int]:
    out, at = [], 0
    while at < len(text):
        out.append(rng.choice([i for i, t in enumerate(tokens) if text.startswith(t, at)]))
        at += len(tokens[out[-1]])
    return out


ALPHABET = [b"a", b"b", b"1", b" "]


def random_pair(rng):
    def extra(n):
        return [bytes(rng.choice(b"ab1 ") for _ in range(rng.randint(2, 4))) for _ in range(n)]

    return list(dict.fromkeys(ALPHABET + extra(6))), list(dict.fromkeys(ALPHABET + extra(4)))


DIGITS_TEACHER = [b"1", b"2", b"3", b"+", b" ", b"12", b"123", b"23", b" 1", b"+ "]
DIGITS_STUDENT = [b"1", b"2", b"3", b"+", b" ", b" +", b"3 "]
# a teacher token from an earlier cut that runs past later ones (`abcd` over `ab`, `c`; `abcdy` over `ab`, `c`, `d`)
CROSSING_TEACHER = [b"a", b"b", b"c", b"x", b"ab", b"abcd", b"cx"]
CROSSING_STUDENT = [b"a", b"b", b"c", b"x", b"ab", b"bc"]
# a chunk whose inner part is no teacher token (`ab` inside the teacher's `abc`): the teacher may also write `a`, `b`
INNER_TEACHER = [b"a", b"b", b"c", b"abc", b"ca"]
INNER_STUDENT = [b"a", b"b", b"c", b"ab", b"bca"]
CASES = [
    (DIGITS_TEACHER, DIGITS_STUDENT, [b"12+3 1", b"123 +23", b"1 2+ 13", b"3+12 2"]),
    (INNER_TEACHER, INNER_STUDENT, [b"abcab", b"cabca", b"abcabc"]),
    (CROSSING_TEACHER, CROSSING_STUDENT, [b"abcab", b"xabcabx", b"abcxab"]),
    (CROSSING_TEACHER[:5] + [b"d", b"y", b"abcdy"], CROSSING_STUDENT + [b"d", b"y"], [b"abcdx", b"xabcdab"]),
] + [
    (*random_pair(random.Random(seed)), [bytes(random.Random(seed * 7 + n).choice(b"ab1 ") for _ in range(7)) for n in range(3)])
    for seed in range(10)
]  # fmt: skip


def checked_positions():
    """(teacher tokens, student tokens, student ids, text, moved, resolved) over the cases: each text in 3 student
    spellings (the student's own longest match among them), as the in-process teacher carries values (ends moved,
    chunks resolved), with ends moved alone, and as a served teacher (neither)."""
    for case, (teacher_tokens, student_tokens, texts) in enumerate(CASES):
        for n, text in enumerate(texts):
            rng = random.Random(case * 100 + n)
            spellings = [longest_match(text, student_tokens)] + [
                random_segmentation(text, student_tokens, rng) for _ in range(2)
            ]
            for student_ids in spellings:
                for moved, resolved in ((True, True), (True, False), (False, False)):
                    yield teacher_tokens, student_tokens, student_ids, text, moved, resolved


def test_every_exact_decision_is_the_brute_force_probability_and_every_bound_differs_somewhere():
    """Over hand-written and random vocabulary pairs, texts and student spellings, with the teacher's ends moved (in
    the process) or not (served): every value called `EXACT` is `D` within 1e-6 for three teachers; every value of a
    token's own bytes called `BOUND` differs from `D` for one of them (the classifier is not merely cautious)."""
    counts = {kind: 0 for kind in Decision}
    for teacher_tokens, student_tokens, student_ids, text, moved, resolved in checked_positions():
        teachers = [ToyTeacher(teacher_tokens, seed) for seed in range(3)]
        differs = None
        for teacher in teachers:
            _, values, kinds, table = carried_values(
                teacher, teacher_tokens, student_tokens, student_ids, text, moved, resolved
            )
            truth = reference(teacher, text, student_ids, student_tokens, table.chosen_end)
            gaps = [None if d is None or d == 0 else abs(v - math.log(d)) for v, d in zip(values.tolist(), truth)]
            for k, kind in enumerate(kinds.tolist()):
                if kind == Decision.EXACT:
                    assert truth[k] is not None and gaps[k] is not None and gaps[k] < 1e-6, (text, student_ids, k)
            differs = [
                (a or False) or (g is not None and g > 1e-6) or t is None
                for a, g, t in zip(differs or [False] * len(gaps), gaps, truth)
            ]
        for k, kind in enumerate(kinds.tolist()):
            counts[Decision(kind)] += 1
            if kind == Decision.BOUND:
                assert differs[k], (text, student_ids, k, moved)
    assert all(counts.values()), counts  # each kind occurs


def test_where_both_tokenizations_agree_token_for_token_the_value_is_the_decision():
    """One vocabulary on both sides, the student writing what the teacher's tokenizer writes: every token `EXACT`,
    equal to `D`; and in the digit pair, a token both sides spell alike (`+`, a space) is `EXACT` wherever the text
    around it settles the teacher's state (here: always, ends moved)."""
    tokens = DIGITS_TEACHER
    for text in CASES[0][2]:
        teacher = ToyTeacher(tokens, 0)
        student_ids = longest_match(text, tokens)
        _, values, kinds, table = carried_values(teacher, tokens, tokens, student_ids, text, moved=True)
        assert kinds.tolist() == [Decision.EXACT] * len(student_ids)
        truth = reference(teacher, text, student_ids, tokens, table.chosen_end)
        assert values.tolist() == pytest.approx([math.log(d) for d in truth], abs=1e-9)
    text = b"12+3 1"
    student_ids = longest_match(text, DIGITS_STUDENT)
    alignment, _, kinds, _ = carried_values(
        ToyTeacher(DIGITS_TEACHER, 0), DIGITS_TEACHER, DIGITS_STUDENT, student_ids, text, True
    )
    agree = [
        k
        for k, i in enumerate(student_ids)
        if alignment.signal[k] == TeacherSignal.EXACT and DIGITS_STUDENT[i] in DIGITS_TEACHER
    ]
    assert agree and all(kinds[k] == Decision.EXACT for k in agree)


def test_a_chunk_is_a_share_and_an_unmoved_digit_before_a_longer_teacher_number_is_a_bound():
    """The student's `1` before `+`, against a teacher that has `12` and `123`: its value is the teacher's `1` alone,
    a bound, where nothing was moved (a served teacher); with the teacher's "goes on" mass moved onto it, the
    decision. The student's `1`, `2` against the teacher's `12`: both chunk shares."""
    text = b"1+3"
    student_ids = longest_match(text, DIGITS_STUDENT)
    teacher = ToyTeacher(DIGITS_TEACHER, 1)
    for moved, expected in ((True, Decision.EXACT), (False, Decision.BOUND)):
        _, _, kinds, _ = carried_values(teacher, DIGITS_TEACHER, DIGITS_STUDENT, student_ids, text, moved)
        assert kinds[0] == expected
    _, _, kinds, _ = carried_values(
        teacher, DIGITS_TEACHER, DIGITS_STUDENT, longest_match(b"12", DIGITS_STUDENT), b"12", True
    )
    assert kinds.tolist() == [Decision.CHUNK_SHARE, Decision.CHUNK_SHARE]


def only_tokens_the_teacher_extends(student, teacher_vocab):
    """The ends moved only off the student's tokens that a longer teacher token starts with (its rule until
    2026-12-06)."""
    extended = set(student_tokens_the_teacher_extends(student, teacher_vocab))
    return torch.tensor([t in extended for t in student.token_bytes])


def test_a_word_the_teacher_ends_with_a_token_that_goes_on_is_the_decision_once_its_end_is_moved():
    """The student's ` ladder` (no student token goes on from it) against the teacher's ` lad`, `der`, where the
    teacher also has `ders`: the teacher's probability of ` ladder` is that of ` lad` then any token starting with
    "der". Moved onto every token whose end the student does not choose, the value is that decision; moved only off
    tokens a longer teacher token starts with (no teacher token starts with " ladder"), it stays a bound."""
    teacher_tokens = [b" ", b"l", b"a", b"d", b"e", b"r", b"s", b"x", b" lad", b"der", b"ders"]
    student_tokens = [b" ", b"l", b"a", b"d", b"e", b"r", b"s", b"x", b" ladder"]
    text = b" ladder x"
    student_ids = longest_match(text, student_tokens)
    teacher = ToyTeacher(teacher_tokens, 2)
    _, values, kinds, table = carried_values(teacher, teacher_tokens, student_tokens, student_ids, text, True)
    truth = reference(teacher, text, student_ids, student_tokens, table.chosen_end)
    assert kinds.tolist() == [Decision.EXACT] * 3
    assert values.tolist() == pytest.approx([math.log(d) for d in truth], abs=1e-9)
    _, narrow, kinds, _ = carried_values(
        teacher, teacher_tokens, student_tokens, student_ids, text, only_tokens_the_teacher_extends
    )
    assert kinds[0] == Decision.BOUND and math.exp(narrow[0]) < truth[0] * 0.99
