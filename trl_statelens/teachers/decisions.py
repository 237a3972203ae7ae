"""Which carried teacher values are the teacher's probability of the student's decision (docs/cross-tokenizer.md,
"What is exact, what is bounded").

The student's decision at a token is which token comes next, given the text so far. Its teacher counterpart, `D`:
the teacher's probability that the text goes on with the token's bytes, summed over its spellings in teacher tokens,
continuations included, given the text so far and where the student chose to end its tokens. A student token that
another student token starts with (`ab` beside `abc`) ends by the student's choice: there the teacher must end a token
too (in `D`'s event, and in what it is conditioned on, where the teacher's own tokens of the text end there too: a
cut the teacher's tokenizer never makes conditions on nothing). Any other student token (a digit against a teacher that keeps
numbers whole) ends where the next one starts, so `D` counts every teacher token that goes on past it. Spellings are
those the teacher's tokenizer writes: a teacher writing the text's bytes otherwise (`a`, `b` where its tokenizer writes
`ab`) is given no mass, and a tokenizer is taken to spell a text's beginning as it spells the whole text's up to
where their tokens part (a longest-match tokenizer does; BPE nearly does).

[`decision_kinds`] says, per student token, which of the values [`alignment.student_token_teacher_logprobs`] or
[`alignment.resolved_logprobs`] (with [`alignment.move_teacher_ends`], where it ran) gives is `D` itself
(`Decision.EXACT`), a value of the token's own bytes that is not `D` (`Decision.BOUND`) or a chunk's share
(`Decision.CHUNK_SHARE`). A token of a resolved chunk that ends inside teacher token `u` has the value of the
teacher's log-prob of the text up to there, `u`'s prefix mass included, less that up to its start: at its end that
is `D`'s where the part of `u` written is itself a teacher token (else the tokenizer may write a shorter token first,
whose mass the prefix mass leaves out) and no teacher token from an earlier cut runs past it. The sums of values from the last
place `a` where the teacher's state is settled (its own tokens of the text so far, nothing of it pending) up to each
boundary equal the teacher's log-probability of the text from `a` to there exactly where no teacher token that starts
at one of its cuts since `a` runs past that boundary while spelling the text up to it, unless the student ended its
token there by choice, or the teacher's last token's "goes on" mass was moved onto the value; a value is `D` where
that holds at both of its ends. `tests/test_decisions.py` checks every `EXACT` value against `D` enumerated by brute
force over every teacher tokenization, and that every other value of a token's own bytes differs from it somewhere.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from enum import IntEnum

import torch

from .alignment import TeacherSignal, TokenAlignment
from .byte_vocab import ByteVocabulary


class Decision(IntEnum):
    """What a carried teacher value is, per student token (see the module docstring)."""

    EXACT = 0  # the teacher's probability of the student's decision, given the text so far
    BOUND = 1  # the teacher's probability of the token's bytes along its own spelling: a lower bound of the decision's
    # where the text so far is settled, an upper one where only the token's end is
    CHUNK_SHARE = 2  # a chunk's log-prob on its last token, 0 on the others (chunks not resolved: a served teacher)


@dataclass(frozen=True)
class DecisionTable:
    """What [`decision_kinds`] reads of a tokenizer pair, built once ([`decision_table`]). `chosen_end` `(V_student,)`:
    whether the student ended a token of that id by choice (another student token starts with its bytes; a special
    token). `teacher_bytes`: each teacher id's bytes (`None` for a special token); `teacher_sorted`: every teacher
    spelling, sorted; `teacher_longest`: the longest one's length."""

    chosen_end: torch.Tensor
    teacher_bytes: tuple[bytes | None, ...]
    teacher_sorted: list[bytes]
    teacher_longest: int

    @property
    def free_ends(self) -> torch.Tensor:
        """The student ids whose end the student does not choose (no other student token starts with their bytes):
        where [`alignment.move_teacher_ends`] moves the teacher's "goes on" mass onto a value, it is the decision's."""
        return ~self.chosen_end

    def teacher_spells(self, spelled: bytes) -> bool:
        """Whether a teacher token's bytes are `spelled`."""
        at = bisect.bisect_left(self.teacher_sorted, spelled)
        return at < len(self.teacher_sorted) and self.teacher_sorted[at] == spelled

    def teacher_goes_on(self, spelled: bytes) -> bool:
        """Whether a teacher token's bytes start with `spelled` and are longer."""
        after = bisect.bisect_right(self.teacher_sorted, spelled)
        return after < len(self.teacher_sorted) and self.teacher_sorted[after].startswith(spelled)


def decision_table(student_vocab: ByteVocabulary, teacher_vocab: ByteVocabulary) -> DecisionTable:
    student = sorted({spelled for spelled in student_vocab.token_bytes if spelled})
    goes_on = {s for s, following in zip(student, student[1:]) if following.startswith(s)}
    chosen_end = torch.tensor([spelled is None or spelled in goes_on for spelled in student_vocab.token_bytes])
    teacher_sorted = sorted({spelled for spelled in teacher_vocab.token_bytes if spelled})
    return DecisionTable(
        chosen_end=chosen_end,
        teacher_bytes=teacher_vocab.token_bytes,
        teacher_sorted=teacher_sorted,
        teacher_longest=max(map(len, teacher_sorted), default=0),
    )


def decision_kinds(
    alignment: TokenAlignment,
    student_ids,
    teacher_ids,
    table: DecisionTable,
    moved: torch.Tensor | None = None,
    whole_terms: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each student token's [`Decision`] `(n_student,)` for the values carried over `alignment` (of `student_ids` and
    `teacher_ids`), with the teacher's ends moved for the ids `moved` marks ([`alignment.move_teacher_ends`]'s
    `movable`; `None` where nothing was moved). `whole_terms` `(n_teacher,)` (`None`: all): per teacher token, whether
    the term moved at its end held the mass of every longer teacher token (a served teacher's holds those among its
    top-k only: a lower bound). One pass over the row; the only lookups are in the teacher's sorted spellings."""
    student_ends = alignment.student_boundaries[1:].tolist()
    teacher_offsets = alignment.teacher_boundaries.tolist()
    teacher_cut = {offset: j for j, offset in enumerate(teacher_offsets)}
    pieces = [table.teacher_bytes[int(t)] if int(t) < len(table.teacher_bytes) else None for t in teacher_ids]
    signal = alignment.signal.tolist()
    kinds = [Decision.CHUNK_SHARE] * len(signal)
    settled_at = 0  # the teacher cut (an index into its boundaries) since which values are summed
    start_resolved = True  # whether the values summed since `settled_at` are exact at this token's start
    for k, student_id in enumerate(int(i) for i in student_ids):
        j = teacher_cut.get(student_ends[k])
        chosen = bool(table.chosen_end[student_id])
        if j is None and signal[k] == TeacherSignal.RESOLVED:
            # inside teacher token `inner` (a cut the student chose here is not in `D`'s event or condition): the
            # prefix mass there is the teacher's probability of the text so far where the part written is itself a
            # teacher token (the tokenizer then writes no shorter token first) and no teacher token from an earlier
            # cut since the settled one spells the text up to here and runs past it
            inner = bisect.bisect_right(teacher_offsets, student_ends[k]) - 1
            part = pieces[inner][: student_ends[k] - teacher_offsets[inner]]
            earliest = bisect.bisect_right(teacher_offsets, student_ends[k] - table.teacher_longest, settled_at)
            crossing = any(
                None not in pieces[i:inner] and table.teacher_goes_on(b"".join(pieces[i:inner]) + part)
                for i in range(earliest, inner)
            )
            resolved, settled = table.teacher_spells(part) and not crossing, False
        elif j is None:  # inside a teacher token, its chunk's share on the chunk's last token
            resolved = settled = False
        elif chosen:  # the teacher's token ends here too, and D's event says so: nothing runs past
            resolved = settled = True
        else:
            last = pieces[j - 1]
            last_goes_on = last is not None and table.teacher_goes_on(last)
            # a teacher token from an earlier cut since the settled one, spelling the text up to here and more (no
            # teacher token is long enough to, from a cut further back than its longest)
            earliest = bisect.bisect_right(teacher_offsets, student_ends[k] - table.teacher_longest, settled_at)
            crossing = any(
                None not in pieces[i:j] and table.teacher_goes_on(b"".join(pieces[i:j]))
                for i in range(earliest, j - 1)
            )
            whole = whole_terms is None or bool(whole_terms[j - 1])
            covered = not last_goes_on or (moved is not None and bool(moved[student_id]) and whole)
            resolved, settled = not crossing and covered, not crossing and not last_goes_on
        if signal[k] in (TeacherSignal.EXACT, TeacherSignal.RESOLVED):
            kinds[k] = Decision.EXACT if start_resolved and resolved else Decision.BOUND
        start_resolved = resolved
        if settled:
            settled_at = j
    return torch.tensor([int(kind) for kind in kinds], dtype=torch.long)
