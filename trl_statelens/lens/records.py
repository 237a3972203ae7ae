"""State records: what one optimizer step supervised, token by token, and the per-step metrics computed from them.

A trainer that mixes in :class:`~.recorder.StateRecorderMixin` calls its ``_record_states`` from its loss
path with tensors the loss already computed (no extra forward pass). At the end of each optimizer step
:class:`~trl_statelens.lens.callback.StateLoggingCallback` calls its ``_collect_state_records``, which
concatenates the step's micro-batches, gathers them from every rank and returns a :class:`StateRecords`;
:func:`aggregate_states` turns that into the metrics of DESIGN.md.

One record per supervised token holds:

- ``rank`` and ``sequence``: where it comes from (the sequence index is local to the rank and the step);
- ``prefix_len``: tokens between the end of the prompt and this token (0 for the first answer token);
- ``source``: index into :data:`STATE_SOURCES`, where the state (the prefix) came from;
- ``logp`` and ``entropy``: the learner's log-probability of the supervised token and the entropy of its next-token
  distribution at the state;
- ``teacher_logp``: the teacher's log-probability of the token (NaN without a teacher);
- ``weight``: what the loss multiplies the token by (1 for SFT, the advantage for GRPO);
- ``teacher``: with several teachers, which one answers the token's row (an index into the trainer's
  ``state_teacher_names``), -1 otherwise;
- ``selection``: with state selection (``skip_correct_rollouts``), whether the teacher scored the token's row
  (:data:`SCORED`, ``RECHECKED``) or skipped it as correct (``SKIPPED``: recorded with weight 0 and no teacher
  log-prob, and left out of every supervised-token metric); 0 (scored) otherwise.

A sequence sampled for the ledger whose teacher read a prompt of its own (a self teacher shown privileged context)
also carries that ``teacher_prompt`` and ``teacher_context_len``, its tokens over the student's prompt; its
``teacher_logp`` values are the teacher's log-probs under that prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

STATE_SOURCES = ("dataset", "learner", "teacher")
TOKEN_FIELDS = (
    "rank", "sequence", "prefix_len", "source", "logp", "entropy", "teacher_logp", "weight", "teacher", "selection"
)  # fmt: skip
INTEGER_FIELDS = ("rank", "sequence", "prefix_len", "source", "teacher", "selection")
PREFIX_QUANTILES = (0.1, 0.5, 0.9)

# A row's state-selection code (`skip_correct_rollouts`: opd/selection.py), in the batch (`teacher_selection`) and
# the records
SCORED, SKIPPED, RECHECKED = 0, 1, 2
SELECTION_FIELDS = {  # what a ledger sequence says about each code
    SCORED: {"teacher_scored": True, "skipped": None, "recheck": False},
    SKIPPED: {"teacher_scored": False, "skipped": "correct", "recheck": False},
    RECHECKED: {"teacher_scored": True, "skipped": None, "recheck": True},
}


def source_code(source: str) -> int:
    """The integer code of a state source name."""
    if source not in STATE_SOURCES:
        raise ValueError(f"unknown state source {source!r}: use one of {STATE_SOURCES}")
    return STATE_SOURCES.index(source)


@dataclass
class StateRecords:
    """Per-token state records (1-D tensors of equal length, one entry per supervised token) and sampled sequences.

    ``samples`` holds a few whole sequences with their text and per-token values, for the ledger; which ones is
    decided by the sample rate given to :meth:`StateRecorderMixin._collect_state_records`.
    """

    rank: torch.Tensor
    sequence: torch.Tensor
    prefix_len: torch.Tensor
    source: torch.Tensor
    logp: torch.Tensor
    entropy: torch.Tensor
    teacher_logp: torch.Tensor
    weight: torch.Tensor
    teacher: torch.Tensor | None = None  # None: no teacher routing, every entry -1
    selection: torch.Tensor | None = None  # None: no state selection, every entry SCORED (0)
    samples: list[dict] = field(default_factory=list)
    teacher_tokens: int | None = None  # positions the teacher scored or wrote (all ranks); None: no teacher
    teacher_context_tokens: int = 0  # tokens the teacher reads beyond the student's rollouts, signed (all ranks)

    def __post_init__(self):
        if self.teacher is None:
            self.teacher = torch.full_like(self.source, -1)
        if self.selection is None:
            self.selection = torch.zeros_like(self.source)

    def __len__(self) -> int:
        return self.logp.numel()

    def supervised(self) -> StateRecords:
        """The records of the tokens the loss supervises: all of them, less the rows state selection skipped (which
        are recorded for the ledger only)."""
        skipped = self.selection == SKIPPED
        if not skipped.any():
            return self
        keep = ~skipped
        return StateRecords(
            **{name: getattr(self, name)[keep] for name in TOKEN_FIELDS},
            samples=self.samples,
            teacher_tokens=self.teacher_tokens,
            teacher_context_tokens=self.teacher_context_tokens,
        )

    @classmethod
    def empty(cls, device=None) -> StateRecords:
        long, float_ = torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, device=device)
        return cls(long, long, long, long, float_, float_, float_, float_)

    @classmethod
    def cat(cls, parts: list[StateRecords]) -> StateRecords:
        if not parts:
            return cls.empty()
        columns = {name: torch.cat([getattr(part, name) for part in parts]) for name in TOKEN_FIELDS}
        return cls(**columns, samples=[sample for part in parts for sample in part.samples])

    def cpu(self) -> StateRecords:
        """The same records with every column on the CPU."""
        columns = {name: getattr(self, name).cpu() for name in TOKEN_FIELDS}
        return StateRecords(
            **columns,
            samples=self.samples,
            teacher_tokens=self.teacher_tokens,
            teacher_context_tokens=self.teacher_context_tokens,
        )

    def gather(self, accelerator) -> StateRecords:
        """The records of every rank, on every rank (a no-op with one process).

        Ranks hold different numbers of tokens, so the columns travel as one padded `(tokens, fields)` table next to
        each rank's count; the sampled sequences travel as Python objects.
        """
        if accelerator.num_processes == 1:
            return self
        from accelerate.utils import gather_object

        table = torch.stack([getattr(self, name).double() for name in TOKEN_FIELDS], dim=1).to(accelerator.device)
        counts = accelerator.gather(torch.tensor([len(self)], device=accelerator.device)).tolist()
        padded = accelerator.gather(accelerator.pad_across_processes(table, dim=0))
        rows_per_rank = padded.size(0) // accelerator.num_processes
        table = torch.cat([padded[r * rows_per_rank : r * rows_per_rank + n] for r, n in enumerate(counts)])
        columns = {
            name: table[:, i].long() if name in INTEGER_FIELDS else table[:, i].float()
            for i, name in enumerate(TOKEN_FIELDS)
        }
        return StateRecords(**columns, samples=gather_object(self.samples))


def aggregate_states(records: StateRecords, teacher_names: tuple[str, ...] = ()) -> dict[str, float]:
    """The per-step metrics of DESIGN.md from one step's records (all ranks).

    ``supervised_tokens`` and ``sequences`` are always there, and ``teacher_tokens`` (the positions the teacher
    scored or wrote, see :meth:`StateRecorderMixin._count_teacher_tokens`) with a teacher; the rest only when the step
    supervised any token.
    With several teachers (``teacher_names``, the order the records' ``teacher`` codes index), per teacher
    ``supervised_tokens/<name>`` (the supervised tokens of its rows) and ``source_frac/teacher/<name>`` (the share of
    all supervised tokens whose prefix it wrote: they sum to ``source_frac/teacher``).
    ``teacher_nll`` and ``teacher_kl/supervised`` (the sampled reverse KL, ``log p_student - log p_teacher``) are means
    over the supervised tokens the learner sampled itself that have a teacher log-prob: on tokens the teacher wrote,
    that difference is not an estimate of any KL. (The trainer's ``teacher_kl/sampled`` averages it over every token
    the learner sampled, supervised or not; the probe's ``drift/teacher_kl/exact`` is the exact full-vocabulary KL.) The records move to the CPU once and are reduced there in float64 (some devices, such
    as Apple MPS, have no float64).
    """
    records = records.cpu().supervised()
    num_tokens = len(records)
    num_sequences = torch.unique(records.rank * (records.sequence.max() + 1 if num_tokens else 1) + records.sequence)
    metrics = {"supervised_tokens": float(num_tokens), "sequences": float(num_sequences.numel())}
    if records.teacher_tokens is not None:
        metrics["teacher_tokens"] = float(records.teacher_tokens)
    if records.teacher_context_tokens:
        metrics["teacher_context_tokens"] = float(records.teacher_context_tokens)
    for code, name in enumerate(teacher_names):
        metrics[f"supervised_tokens/{name}"] = float((records.teacher == code).sum())
    if num_tokens == 0:
        return metrics

    logp, entropy = records.logp.double(), records.entropy.double()
    prefix_len = records.prefix_len.double()
    names = ["state_nll", "state_entropy", "offpolicy_gap"]
    values = [-logp.mean(), entropy.mean(), -logp.mean() - entropy.mean()]
    for code, source in enumerate(STATE_SOURCES):
        names.append(f"source_frac/{source}")
        values.append((records.source == code).double().mean())
    written_by_teacher = records.source == source_code("teacher")
    for code, name in enumerate(teacher_names):
        names.append(f"source_frac/teacher/{name}")
        values.append((written_by_teacher & (records.teacher == code)).double().mean())
    names += [f"prefix_len/p{round(q * 100)}" for q in PREFIX_QUANTILES] + ["prefix_len/mean", "prefix_len/max"]
    values += list(_quantiles(prefix_len, PREFIX_QUANTILES)) + [
        prefix_len.mean(),
        prefix_len.max(),
    ]
    weight = records.weight.double()
    names += ["weight/mean", "weight/abs_mean", "weight/positive_frac", "weight/nonzero_frac"]
    values += [weight.mean(), weight.abs().mean(), (weight > 0).double().mean(), (weight != 0).double().mean()]
    sampled_by_learner = ~torch.isnan(records.teacher_logp) & (records.source == source_code("learner"))
    if sampled_by_learner.any():
        teacher_logp = records.teacher_logp.double()[sampled_by_learner]
        names += ["teacher_nll", "teacher_kl/supervised"]
        values += [-teacher_logp.mean(), (logp[sampled_by_learner] - teacher_logp).mean()]
    metrics.update(zip(names, torch.stack(values).tolist()))
    return metrics


def has_spread(rewards: list[float | None]) -> bool:
    """Whether a group's rewards differ (unscorable rollouts, `None`, left out): only then does GRPO give its
    tokens a non-zero advantage."""
    scored = [r for r in rewards if r is not None]
    return len(scored) > 1 and max(scored) - min(scored) > 1e-6 * max(1.0, abs(max(scored)))


def _quantiles(values: torch.Tensor, quantiles: tuple[float, ...]) -> torch.Tensor:
    """`torch.quantile(values, quantiles)` (linear interpolation), computed the same way, for any number of values:
    `torch.quantile` refuses more than 2**24 (16.7M tokens in one step is a few hundred long sequences)."""
    ordered = values.sort().values
    ranks = torch.tensor(quantiles, dtype=values.dtype) * (values.numel() - 1)
    below, above = ranks.long(), ranks.ceil().long()
    return torch.lerp(ordered[below], ordered[above], ranks - below)


def prefix_len_histogram(records: StateRecords) -> list[int]:
    """Supervised tokens per prefix-length bin; bin ``k`` holds prefix lengths in ``[2**k - 1, 2**(k+1) - 1)``."""
    records = records.supervised()
    if len(records) == 0:
        return []
    bins = torch.log2(records.prefix_len.cpu().double() + 1).floor().long()
    return torch.bincount(bins).tolist()
