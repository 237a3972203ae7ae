"""A teacher whose tokenizer differs from the student's: its signal carried onto the student's tokens, exactly where
the two tokenizations allow it, with what cannot be carried exactly said, never hidden (issue 45).

Both tokenizers spell the same text as bytes (`byte_vocab.py`), cut at different places. Offsets count bytes, and a
special token (which spells none) as one unit; a place where both cut is a shared boundary.

- The teacher's log-prob of each student token ([`align_token_ids`], [`student_token_teacher_logprobs`]): a student
  token that starts and ends on teacher boundaries is `EXACT`: its log-prob is the sum of those of the teacher tokens
  that spell exactly its bytes ("1234" against "1","2","3","4"). Any other student token lies in a chunk, the
  smallest run of student tokens that starts and ends on shared boundaries: the teacher's log-prob of the run's bytes
  (the sum over its teacher tokens) goes to the run's last token (`CHUNK_END`), and the others get 0
  (`CHUNK_INSIDE`), so that a loss summing the student's log-probs over a chunk compares like with like.
- A chunk resolved token by token ([`resolved_logprobs`], for a teacher whose whole next-token distribution is at
  hand): inside a teacher token, the teacher's log-prob of the text so far is that of its tokens before it plus the
  log of its byte-prefix mass there (every token at that position whose bytes start with the part written so far),
  and each student token of the chunk gets the difference across it (`RESOLVED`); over the chunk they sum to its
  value.
- The teacher's next-token distribution at a synchronised position (both tokenizations cut there) over the student's
  vocabulary ([`next_token_map`], [`map_next_token_distribution`]): each teacher token's mass goes to the student
  token that spells its bytes, or the longest one they start with, and mass that reaches no student token is reported
  as `leftover`. [`continuation_mass`] bounds the teacher's probability of each student token's bytes (for analysis:
  the loss does not need it).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import torch

from .byte_vocab import ByteVocabulary, special_token_map, unmapped_special_message


class TeacherSignal(IntEnum):
    """How a student token's teacher log-prob was obtained (see the module docstring)."""

    EXACT = 0  # its own bytes, summed over the teacher tokens that spell exactly them
    CHUNK_END = 1  # the last token of a chunk: the teacher's log-prob of the whole chunk
    CHUNK_INSIDE = 2  # an earlier token of a chunk: 0, its part is on the chunk's last token
    RESOLVED = 3  # a chunk's token given its own part, from byte-prefix masses ([`resolved_logprobs`])


@dataclass(frozen=True)
class TokenAlignment:
    """One text as tokenized by the student and by the teacher. `*_boundaries` are the offsets of every token boundary
    (`n + 1` of them, from 0 to the text's length); `*_chunk` is each token's chunk (tokens between two consecutive
    shared boundaries); `signal` is each student token's [`TeacherSignal`]; `synchronised` pairs (student index,
    teacher index) of the tokens that start each chunk: there both tokenizations cut, so the teacher's next-token
    distribution for its token maps onto the student's for its token ([`map_next_token_distribution`])."""

    student_boundaries: torch.Tensor
    teacher_boundaries: torch.Tensor
    student_chunk: torch.Tensor
    teacher_chunk: torch.Tensor
    signal: torch.Tensor
    synchronised: torch.Tensor

    @property
    def exact_share(self) -> float:
        """The share of student tokens whose teacher log-prob is `EXACT` (1.0 for an empty text)."""
        return (self.signal == TeacherSignal.EXACT).float().mean().item() if len(self.signal) else 1.0


def spelled_units(ids, vocab: ByteVocabulary, specials: dict[int, int] | None, other: ByteVocabulary) -> list:
    """Each token of `ids` as its bytes, or a special token as the id it stands for on the teacher's side (`specials`
    maps the student's; `None` keeps the teacher's own)."""
    units = []
    for token_id in ids:
        if not 0 <= token_id < len(vocab) or (vocab.token_bytes[token_id] is None and token_id not in vocab.roles):
            raise ValueError(
                f"id {token_id} is no token of tokenizer {vocab.name!r} (its vocabulary has {len(vocab)})"
            )
        spelled = vocab.token_bytes[token_id]
        if spelled == b"":
            raise ValueError(f"token {token_id} of tokenizer {vocab.name!r} spells no bytes: it cannot be aligned")
        if spelled is not None:
            units.append(spelled)
        elif specials is None:
            units.append(token_id)
        elif token_id in specials:
            units.append(specials[token_id])
        else:
            raise ValueError(unmapped_special_message(vocab, other, token_id))
    return units


def stream_pieces(units: list) -> list:
    """The units with consecutive bytes joined: equal for two tokenizations of one text."""
    pieces: list = []
    for unit in units:
        if isinstance(unit, bytes) and pieces and isinstance(pieces[-1], bytes):
            pieces[-1] += unit
        else:
            pieces.append(unit)
    return pieces


def first_difference(student_units: list, teacher_units: list, teacher_vocab: ByteVocabulary) -> str:
    """Where the two spellings part, for the error message: the offset and a few units of each side from there."""

    def symbols(units):
        flat = []
        for unit in units:
            flat.extend(unit if isinstance(unit, bytes) else [teacher_vocab.special_contents.get(unit, unit)])
        return flat

    student, teacher = symbols(student_units), symbols(teacher_units)
    offset = next((i for i, (a, b) in enumerate(zip(student, teacher)) if a != b), min(len(student), len(teacher)))

    def shown(flat):
        text = "".join(
            chr(s) if isinstance(s, int) and 32 <= s < 127 else (f"\\x{s:02x}" if isinstance(s, int) else s)
            for s in flat[offset : offset + 24]
        )
        return repr(text) if text else "the end"

    return f"offset {offset}: the student's text has {shown(student)}, the teacher's {shown(teacher)}"


def align_token_ids(
    student_ids, teacher_ids, student_vocab: ByteVocabulary, teacher_vocab: ByteVocabulary
) -> TokenAlignment:
    """The [`TokenAlignment`] of one text tokenized by the student (`student_ids`) and by the teacher
    (`teacher_ids`). Both must spell the same bytes, and the same special tokens by role at the same places: a
    ValueError says where they part, and names a special token that has no counterpart."""
    student_ids, teacher_ids = [int(i) for i in student_ids], [int(i) for i in teacher_ids]
    specials = special_token_map(student_vocab, teacher_vocab)
    student_units = spelled_units(student_ids, student_vocab, specials, teacher_vocab)
    teacher_units = spelled_units(teacher_ids, teacher_vocab, None, student_vocab)
    if stream_pieces(student_units) != stream_pieces(teacher_units):
        raise ValueError(
            f"the student's tokens ({student_vocab.name!r}) and the teacher's ({teacher_vocab.name!r}) do not spell the "
            f"same text; they part at {first_difference(student_units, teacher_units, teacher_vocab)}. Tokenize one "
            "text with both tokenizers, with the same special tokens (each in a role both have), and without "
            "special tokens that only one side adds (pass add_special_tokens=False). A tokenizer that rewrites "
            "text (adds a prefix space, normalises Unicode) spells other bytes than the text's: it cannot be aligned"
        )
    student_boundaries = boundaries(student_units)
    teacher_boundaries = boundaries(teacher_units)
    starts_shared = torch.isin(student_boundaries[:-1], teacher_boundaries)
    ends_shared = torch.isin(student_boundaries[1:], teacher_boundaries)
    signal = torch.full_like(student_boundaries[1:], TeacherSignal.CHUNK_INSIDE)
    signal[ends_shared] = TeacherSignal.CHUNK_END
    signal[starts_shared & ends_shared] = TeacherSignal.EXACT
    teacher_starts_shared = torch.isin(teacher_boundaries[:-1], student_boundaries)
    synchronised = torch.stack([starts_shared.nonzero()[:, 0], teacher_starts_shared.nonzero()[:, 0]], dim=1)
    return TokenAlignment(
        student_boundaries=student_boundaries,
        teacher_boundaries=teacher_boundaries,
        student_chunk=starts_shared.long().cumsum(0) - 1,
        teacher_chunk=teacher_starts_shared.long().cumsum(0) - 1,
        signal=signal,
        synchronised=synchronised,
    )


def boundaries(units: list) -> torch.Tensor:
    """The offsets of every boundary of a tokenization: 0, then the end of each token."""
    lengths = torch.tensor([len(unit) if isinstance(unit, bytes) else 1 for unit in units], dtype=torch.long)
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


def student_token_teacher_logprobs(
    alignment: TokenAlignment, teacher_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's per-token log-probs `(n_teacher,)` carried onto the student's tokens: `(values, signal)`, both
    `(n_student,)`. An `EXACT` token gets the sum over the teacher tokens that spell exactly its bytes; a chunk's last
    token (`CHUNK_END`) the sum over the chunk, its other tokens (`CHUNK_INSIDE`) 0."""
    n_teacher = len(alignment.teacher_chunk)
    if teacher_logprobs.shape != (n_teacher,):
        raise ValueError(
            f"teacher_logprobs has shape {tuple(teacher_logprobs.shape)}, but the alignment has {n_teacher} teacher "
            "tokens: pass one log-prob per teacher token of the aligned text, for one text at a time"
        )
    device = teacher_logprobs.device
    n_chunks = len(alignment.synchronised)
    chunk_sums = teacher_logprobs.new_zeros(n_chunks).index_add_(
        0, alignment.teacher_chunk.to(device), teacher_logprobs
    )
    signal = alignment.signal.to(device)
    values = chunk_sums[alignment.student_chunk.to(device)].masked_fill(signal == TeacherSignal.CHUNK_INSIDE, 0.0)
    return values, signal


def starts_inside(
    alignment: TokenAlignment, teacher_ids, teacher_vocab: ByteVocabulary
) -> list[tuple[int, int, bytes]]:
    """For each student token that starts inside a teacher token, in order: its index, that teacher token's index and
    the teacher token's bytes written before it (the part whose byte-prefix mass `divergence` reads the rest of the
    teacher's token from)."""
    teacher_cuts = alignment.teacher_boundaries
    starts = alignment.student_boundaries[:-1]
    inside = (~torch.isin(starts, teacher_cuts)).nonzero()[:, 0].tolist()
    containing = (torch.searchsorted(teacher_cuts, starts[inside], right=True) - 1).tolist()
    return [
        (k, j, teacher_vocab.token_bytes[int(teacher_ids[j])][: int(starts[k] - teacher_cuts[j])])
        for k, j in zip(inside, containing, strict=True)
    ]


def inner_prefixes(alignment: TokenAlignment, teacher_ids, teacher_vocab: ByteVocabulary) -> list[tuple[int, bytes]]:
    """For each student token that ends inside a teacher token, in order: that teacher token's index and its bytes up
    to the student token's end (what [`resolved_logprobs`] needs the byte-prefix mass of). The next student token
    starts there: [`starts_inside`]'s entries."""
    return [(j, part) for _, j, part in starts_inside(alignment, teacher_ids, teacher_vocab)]


def chunks_resolved(alignment: TokenAlignment) -> TokenAlignment:
    """The alignment with every chunk's tokens `RESOLVED` (the values [`resolved_logprobs`] gives)."""
    signal = alignment.signal.masked_fill(alignment.signal != TeacherSignal.EXACT, TeacherSignal.RESOLVED)
    return dataclasses.replace(alignment, signal=signal)


def resolved_logprobs(
    alignment: TokenAlignment, teacher_logps: torch.Tensor, inner_logmass: torch.Tensor
) -> torch.Tensor:
    """The teacher's per-token log-probs `(n_teacher,)` carried onto the student's tokens `(n_student,)`, every token
    of a chunk given its own part. `inner_logmass` `(n_inner,)`: for each of [`inner_prefixes`]' entries, the log of
    the teacher's probability, at that teacher token's position, of a token whose bytes start with the prefix.

    With `L(x)` the teacher's log-prob of the text up to offset `x` (at a teacher boundary, the sum of its tokens'
    log-probs before it; inside a teacher token, that of the tokens before the token plus the log of the prefix mass
    there), each student token gets `L(end) - L(start)`: an `EXACT` token the sum over the teacher tokens spelling it,
    as [`student_token_teacher_logprobs`] gives it, and a chunk's tokens values summing to the chunk's log-prob."""
    n_teacher = len(alignment.teacher_chunk)
    if teacher_logps.shape != (n_teacher,):
        raise ValueError(
            f"teacher_logps has shape {tuple(teacher_logps.shape)}, but the alignment has {n_teacher} teacher tokens"
        )
    cut_sums = torch.cat([teacher_logps.new_zeros(1, dtype=torch.float64), teacher_logps.double().cumsum(0)])
    teacher_cuts, boundaries = alignment.teacher_boundaries, alignment.student_boundaries
    containing = torch.searchsorted(teacher_cuts, boundaries, right=True) - 1
    levels = cut_sums[containing.clamp(max=n_teacher)]
    inside = ~torch.isin(boundaries, teacher_cuts)
    if int(inside.sum()) != len(inner_logmass):
        raise ValueError(
            f"inner_logmass has {len(inner_logmass)} entries, but {int(inside.sum())} student tokens end inside a "
            "teacher token: pass one per entry of inner_prefixes(alignment, ...)"
        )
    levels[inside] += inner_logmass.double().cpu()
    return (levels[1:] - levels[:-1]).to(teacher_logps.dtype)


def move_teacher_ends(
    alignment: TokenAlignment,
    values: torch.Tensor,
    student_ids,
    movable: torch.Tensor,
    end_logmass: torch.Tensor,
) -> torch.Tensor:
    """`values` from [`student_token_teacher_logprobs`] (or [`resolved_logprobs`], on an alignment with its chunks
    resolved) with the teacher's "its token ends here" moved to where the
    student says it (docs/cross-tokenizer.md, "A defect found, and fixed"). `end_logmass` `(n_teacher,)`: per
    teacher token, the log-prob of the teacher writing, at that decision, any token whose bytes start with its bytes,
    less the log-prob of that token (0 where no longer token does). For each student token that carries a value and
    ends where a teacher token `u` ends, if the student's vocabulary cannot go on from that token (`movable[id]`,
    e.g. a single digit), `u`'s term is added to it and taken from the next carrying token: the row's sum is kept.

    The moved value, where the carrier's bytes (its chunk's, for a `CHUNK_END`) are the one teacher token `u`: the
    teacher's probability that its next token starts with them, whatever follows; exact (spellings that split them
    over several teacher tokens, which its tokenizer does not write, aside). Where they are several teacher tokens
    `u_1 .. u_m`: the teacher's probability of `u_1 .. u_{m-1}`, then of any token starting with `u_m`'s bytes, a
    lower bound of its probability of those bytes: a teacher token that starts at an earlier decision and runs past
    the carrier's end is left out (the chunk `ab`, `c` against a teacher `abcd`). The next carrier gets the rest of
    the row's log-prob. With one tokenizer on both sides no movable token has a longer teacher token, so nothing
    moves."""
    values = values.clone()
    carriers = (alignment.signal != TeacherSignal.CHUNK_INSIDE).nonzero()[:, 0].tolist()
    ends = alignment.student_boundaries[1:]
    on_teacher_cut = torch.isin(ends, alignment.teacher_boundaries)  # (a resolved chunk's inner tokens are not)
    for place, k in enumerate(carriers):
        if not movable[int(student_ids[k])] or not on_teacher_cut[k]:
            continue
        j = int(torch.searchsorted(alignment.teacher_boundaries, ends[k])) - 1  # the teacher token ending there
        term = end_logmass[j].to(values.dtype)
        values[k] += term
        if place + 1 < len(carriers):
            values[carriers[place + 1]] -= term
    return values


@dataclass(frozen=True)
class NextTokenMap:
    """Index tables, built once per tokenizer pair ([`next_token_map`]), that carry a teacher next-token distribution
    onto the student's vocabulary. `student_of_teacher` `(V_teacher,)`: the student token each teacher token's mass
    goes to (the longest whose bytes start the teacher token's; a special token's counterpart by role), -1 for
    leftover. `prefix_pairs` `(2, n)`: student pairs (v, w) where v's bytes start w's. `proper_prefix_pairs` `(2, n)`:
    (student v, teacher t) where t's bytes are a proper prefix of v's."""

    student_of_teacher: torch.Tensor
    prefix_pairs: torch.Tensor
    proper_prefix_pairs: torch.Tensor
    student_size: int
    teacher_size: int


class MappedDistribution(NamedTuple):
    """A teacher next-token distribution over the student's vocabulary, at a synchronised position.

    - `student_probs` `(..., V_student)`: the teacher's next token as the student's first token of it: each teacher
      token's mass on the student token that spells its bytes, or the longest one they start with (a special token's
      on its counterpart by role). It sums with `leftover` to the teacher's total, and is the teacher distribution
      itself when both tokenizers are one. A student token the teacher only writes as several tokens gets none.
    - `leftover` `(...)`: the mass that reaches no student token (a teacher special token without a counterpart, a
      teacher token starting with a byte the student cannot spell, rows past the teacher's tokenizer).
    """

    student_probs: torch.Tensor
    leftover: torch.Tensor


class ContinuationMass(NamedTuple):
    """Bounds, at a synchronised position, on the teacher's probability that the text goes on with each student
    token v's bytes ([`continuation_mass`]).

    - `prefix_mass` `(..., V_student)`: the mass of teacher tokens whose bytes start with v's. The probability is at
      least this and at most `prefix_mass + unresolved_mass`, so it is exact where `unresolved_mass` is 0 (always,
      for a one-byte or special v).
    - `unresolved_mass` `(..., V_student)`: the mass of teacher tokens whose bytes are a proper prefix of v's: whether
      the text goes on to spell v depends on the teacher's next distributions, which this position does not give.
    """

    prefix_mass: torch.Tensor
    unresolved_mass: torch.Tensor


def student_tokens_the_teacher_extends(student_vocab: ByteVocabulary, teacher_vocab: ByteVocabulary) -> list[bytes]:
    """The student's tokens whose end the per-token signal misplaces (docs/cross-tokenizer.md, "A defect found, and fixed"): no
    other student token starts with their bytes, so the student's log-prob of one says nothing of where the text's
    token ends, while a longer teacher token does start with them, so the teacher's log-prob there does. Sorted."""
    student = sorted({spelled for spelled in student_vocab.token_bytes if spelled})
    teacher = sorted({spelled for spelled in teacher_vocab.token_bytes if spelled})
    extended = []
    for i, spelled in enumerate(student):
        if i + 1 < len(student) and student[i + 1].startswith(spelled):  # (the next in byte order, if any extends it)
            continue
        after = bisect.bisect_right(teacher, spelled)
        if after < len(teacher) and teacher[after].startswith(spelled):
            extended.append(spelled)
    return extended


def ids_by_bytes(vocab: ByteVocabulary) -> dict[bytes, list[int]]:
    """The ids spelling each byte string (several, as Gemma's `<0x0A>` and `\\n`)."""
    found = defaultdict(list)
    for token_id, spelled in enumerate(vocab.token_bytes):
        if spelled:
            found[spelled].append(token_id)
    return found


def written_student_tokens(student_vocab: ByteVocabulary) -> dict[bytes, int]:
    """The student token its tokenizer writes for each spelling (of several, not the byte fallback: Gemma's `\\n`
    rather than `<0x0A>`)."""
    return {
        spelled: min(ids, key=lambda token_id: (token_id in student_vocab.byte_fallback_ids, token_id))
        for spelled, ids in ids_by_bytes(student_vocab).items()
    }


def first_student_token(spelled: bytes, written: dict[bytes, int]) -> int:
    """The longest student token (of [`written_student_tokens`]) that `spelled` starts with, -1 if none: where text
    that goes on with `spelled` puts its mass in the student's next-token distribution."""
    for length in range(len(spelled), 0, -1):
        if spelled[:length] in written:
            return written[spelled[:length]]
    return -1


def next_token_map(teacher_vocab: ByteVocabulary, student_vocab: ByteVocabulary) -> NextTokenMap:
    """The [`NextTokenMap`] of a tokenizer pair. Loops over both vocabularies once (about a second for 262k teacher
    and 49k student tokens); every later mapping is a few tensor operations. When several student tokens spell the
    same bytes (Gemma's `<0x0A>` and `\\n`), mass goes to the one the tokenizer writes: not the byte fallback."""
    student_by_bytes, teacher_by_bytes = ids_by_bytes(student_vocab), ids_by_bytes(teacher_vocab)
    written = written_student_tokens(student_vocab)
    specials = special_token_map(teacher_vocab, student_vocab)
    student_of_teacher = [
        specials.get(token_id, -1) if spelled is None else first_student_token(spelled, written)
        for token_id, spelled in enumerate(teacher_vocab.token_bytes)
    ]
    prefix_pairs = [(token_id, token_id) for token_id in student_vocab.roles]  # a special token is its own only prefix
    for spelled, token_id in written.items():
        for length in range(1, len(spelled) + 1):
            prefix_pairs.extend((shorter, token_id) for shorter in student_by_bytes.get(spelled[:length], ()))
    proper_prefix_pairs = [
        (student_id, teacher_id)
        for spelled, student_ids in student_by_bytes.items()
        for length in range(1, len(spelled))
        for teacher_id in teacher_by_bytes.get(spelled[:length], ())
        for student_id in student_ids
    ]
    return NextTokenMap(
        student_of_teacher=torch.tensor(student_of_teacher, dtype=torch.long),
        prefix_pairs=torch.tensor(prefix_pairs, dtype=torch.long).reshape(-1, 2).T.contiguous(),
        proper_prefix_pairs=torch.tensor(proper_prefix_pairs, dtype=torch.long).reshape(-1, 2).T.contiguous(),
        student_size=len(student_vocab),
        teacher_size=len(teacher_vocab),
    )


def pair_matrix_product(pairs: torch.Tensor, shape: tuple[int, int], dense: torch.Tensor) -> torch.Tensor:
    """`dense @ M.T` for the 0/1 matrix M of `shape` whose ones are at `pairs`: (..., shape[1]) -> (..., shape[0])."""
    pairs = pairs.to(dense.device)
    matrix = torch.sparse_coo_tensor(pairs, dense.new_ones(pairs.shape[1]), shape, check_invariants=False)
    return torch.sparse.mm(matrix, dense.T).T


def map_next_token_distribution(table: NextTokenMap, teacher_probs: torch.Tensor) -> MappedDistribution:
    """The teacher's next-token probabilities `(..., V)` at synchronised positions (`V` at least its tokenizer's
    size: an output layer's padding rows count as leftover) as a [`MappedDistribution`] over the student's
    vocabulary. Vectorised over positions: one scatter."""
    width = teacher_probs.shape[-1]
    if width < table.teacher_size:
        raise ValueError(
            f"teacher_probs has {width} entries per position, fewer than the teacher tokenizer's {table.teacher_size}: "
            "pass the teacher's full next-token distribution (softmax over its whole output layer), built from the "
            "same tokenizer as the table"
        )
    batch_shape = teacher_probs.shape[:-1]
    flat = teacher_probs.reshape(-1, width)
    known = flat[:, : table.teacher_size]
    receivers = table.student_of_teacher.to(flat.device)
    kept = receivers >= 0
    student_probs = flat.new_zeros(len(flat), table.student_size).index_add_(1, receivers[kept], known[:, kept])
    leftover = known[:, ~kept].sum(-1) + flat[:, table.teacher_size :].sum(-1)
    return MappedDistribution(student_probs.reshape(*batch_shape, -1), leftover.reshape(batch_shape))


def continuation_mass(table: NextTokenMap, teacher_probs: torch.Tensor) -> ContinuationMass:
    """The [`ContinuationMass`] of the teacher's next-token probabilities `(..., V)`, as for
    [`map_next_token_distribution`]: two sparse products over the student's vocabulary."""
    student_probs = map_next_token_distribution(table, teacher_probs).student_probs
    batch_shape = student_probs.shape[:-1]
    student_probs = student_probs.reshape(-1, table.student_size)
    known = teacher_probs.reshape(-1, teacher_probs.shape[-1])[:, : table.teacher_size]
    prefix_mass = pair_matrix_product(table.prefix_pairs, (table.student_size,) * 2, student_probs)
    unresolved_mass = pair_matrix_product(
        table.proper_prefix_pairs, (table.student_size, table.teacher_size), known.contiguous()
    )
    return ContinuationMass(prefix_mass.reshape(*batch_shape, -1), unresolved_mass.reshape(*batch_shape, -1))


def chunk_index(signal: torch.Tensor) -> torch.Tensor:
    """Each token's chunk, counted from 0 along the last dimension, from its [`TeacherSignal`] `(..., T)`: a chunk
    ends at each token that is not `CHUNK_INSIDE`."""
    ends = (signal != TeacherSignal.CHUNK_INSIDE).long()
    return ends.cumsum(-1) - ends


def chunk_totals(values: torch.Tensor, signal: torch.Tensor) -> torch.Tensor:
    """`values` `(B, T)` summed over each chunk, on the chunk's last token (0 on its other tokens): the student's
    log-probs laid out as [`student_token_teacher_logprobs`] lays out the teacher's. The identity when every token is
    `EXACT`."""
    index = chunk_index(signal)
    sums = torch.zeros_like(values).scatter_add(-1, index, values)
    return sums.gather(-1, index).masked_fill(signal == TeacherSignal.CHUNK_INSIDE, 0.0)


def spread_over_chunks(values: torch.Tensor, signal: torch.Tensor) -> torch.Tensor:
    """Each token given the value on its chunk's last token `(B, T)`: a chunk's advantage for every token that
    wrote it. The identity when every token is `EXACT`."""
    index = chunk_index(signal)
    at_ends = values.masked_fill(signal == TeacherSignal.CHUNK_INSIDE, 0.0)
    return torch.zeros_like(values).scatter_add(-1, index, at_ends).gather(-1, index)


def shared_out_over_chunks(teacher_logps: torch.Tensor, student_logps: torch.Tensor, signal: torch.Tensor):
    """Per-token teacher log-probs `(B, T)` for the records from chunk values (`teacher_logps` as
    [`student_token_teacher_logprobs`] lays them out): each token of a chunk gets its own student log-prob plus an
    equal share of the chunk's log-ratio, so that over a chunk they sum to the teacher's log-prob of it (and the
    per-token reverse KL to the chunk's). The teacher's values where every token is `EXACT`."""
    index = chunk_index(signal)
    sizes = torch.zeros_like(student_logps).scatter_add(-1, index, torch.ones_like(student_logps)).gather(-1, index)
    gaps = teacher_logps - chunk_totals(student_logps, signal)
    return student_logps + spread_over_chunks(gaps, signal) / sizes
