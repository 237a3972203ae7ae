"""State records from hand-made micro-batches: prefix lengths, counts, sources, sampling and the aggregates."""

from types import SimpleNamespace

import pytest
import torch

from trl_statelens.lens.recorder import StateRecorderMixin
from trl_statelens.lens.records import STATE_SOURCES, StateRecords, aggregate_states, prefix_len_histogram


class Recorder(StateRecorderMixin):
    """The mixin on a stand-in for a one-process trainer."""

    def __init__(self, tokenizer, step=1):
        self.accelerator = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"))
        self.state = SimpleNamespace(global_step=step)
        self.processing_class = tokenizer
        self._start_state_recording()


def per_token(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_prefix_lengths_and_counts_match_the_masks(tokenizer):
    # Two right-padded rows: prompt of 2 and 3 tokens, then 3 and 2 supervised tokens, then padding
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 7, 8, 9, 0]])
    supervised = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 0]], dtype=torch.bool)
    attention = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0]])
    logps = -torch.arange(12, dtype=torch.float32).view(2, 6) / 10
    entropy = torch.ones(2, 6)
    recorder = Recorder(tokenizer)
    recorder._record_states(input_ids, supervised, logps, entropy, "dataset", attention_mask=attention)
    records = recorder._collect_state_records(sample_rate=1.0)

    assert len(records) == supervised.sum()
    assert records.sequence.tolist() == [0, 0, 0, 1, 1]
    assert records.prefix_len.tolist() == [0, 1, 2, 0, 1]
    assert records.logp.tolist() == pytest.approx(logps[supervised].tolist())
    assert torch.isnan(records.teacher_logp).all()
    assert records.weight.tolist() == [1.0] * 5
    assert [s["num_supervised"] for s in records.samples] == [3, 2]
    assert records.samples[0]["prompt"] == tokenizer.decode([5, 6])
    assert records.samples[0]["completion"] == tokenizer.decode([7, 8, 9])
    assert records.samples[1]["completion"] == tokenizer.decode([8, 9])
    assert recorder._collect_state_records(sample_rate=1.0).logp.numel() == 0  # the buffer was cleared


def test_packed_rows_split_at_position_ids(tokenizer):
    # One padding-free row holding three sequences (positions restart at 0), supervised after their prompts
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
    supervised = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 0, 0, 0, 1, 1]], dtype=torch.bool)
    input_ids = torch.arange(20, 32)[None]
    recorder = Recorder(tokenizer)
    recorder._record_states(
        input_ids, supervised, torch.zeros(1, 12), torch.zeros(1, 12), "dataset", position_ids=position_ids
    )
    records = recorder._collect_state_records(sample_rate=1.0)
    assert records.sequence.tolist() == [0, 0, 1, 1, 2, 2]
    assert records.prefix_len.tolist() == [0, 1, 0, 1, 0, 1]
    assert [s["prompt"] for s in records.samples] == [
        tokenizer.decode([20, 21]),
        tokenizer.decode([24]),
        tokenizer.decode([27, 28, 29]),
    ]


def test_micro_batches_of_a_step_are_concatenated_with_distinct_sequences(tokenizer):
    recorder = Recorder(tokenizer)
    for _ in range(2):  # gradient accumulation: two micro-batches before the optimizer step
        recorder._record_states(
            torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), "learner"
        )
    records = recorder._collect_state_records(sample_rate=0.0)
    assert len(records) == 12 and records.samples == []
    assert records.sequence.unique().tolist() == [0, 1, 2, 3]
    assert aggregate_states(records)["sequences"] == 4


def test_sources_weights_teacher_and_explicit_prefix_len(tokenizer):
    recorder = Recorder(tokenizer)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    recorder._record_states(
        torch.ones(2, 2, dtype=torch.long),
        mask,
        per_token([-1.0, -2.0], [-3.0, 0.0]),
        per_token([0.5, 0.5], [1.0, 0.0]),
        torch.tensor([STATE_SOURCES.index("teacher"), STATE_SOURCES.index("learner")]),
        prefix_len=torch.tensor([[4, 5], [7, 8]]),
        teacher_logps=per_token([-1.5, -1.0], [-2.0, 0.0]),
        weights=torch.tensor([2.0, -1.0]),
        rewards=torch.tensor([1.0, 0.0]),
    )
    records = recorder._collect_state_records(sample_rate=1.0)
    assert records.prefix_len.tolist() == [4, 5, 7]
    assert records.source.tolist() == [2, 2, 1]
    assert records.weight.tolist() == [2.0, 2.0, -1.0]
    assert [s["reward"] for s in records.samples] == [1.0, 0.0]
    assert records.samples[0]["source"] == "teacher"

    metrics = aggregate_states(records)
    assert metrics["state_nll"] == pytest.approx(2.0)
    assert metrics["state_entropy"] == pytest.approx(2 / 3)
    assert metrics["offpolicy_gap"] == pytest.approx(2.0 - 2 / 3)
    assert metrics["source_frac/teacher"] == pytest.approx(2 / 3)
    assert metrics["source_frac/learner"] == pytest.approx(1 / 3)
    assert metrics["source_frac/dataset"] == 0.0
    # only the learner's own token counts: on the teacher-written row, logp - teacher_logp estimates no KL
    assert metrics["teacher_nll"] == pytest.approx(2.0)
    assert metrics["teacher_kl/supervised"] == pytest.approx(-3 + 2)
    assert metrics["weight/mean"] == pytest.approx(1.0)
    assert metrics["weight/positive_frac"] == pytest.approx(2 / 3)
    assert metrics["prefix_len/max"] == 7.0
    assert metrics["supervised_tokens"] == 3.0


def test_teacher_written_share_is_broken_down_by_teacher(tokenizer):
    """Several teachers: each row's teacher is recorded per token; `source_frac/teacher/<name>` counts the tokens of
    teacher-written rows by teacher, over all supervised tokens, so the shares sum to `source_frac/teacher`."""
    recorder = Recorder(tokenizer)
    recorder.state_teacher_names = ("math", "kb", "idle")
    teacher, learner = STATE_SOURCES.index("teacher"), STATE_SOURCES.index("learner")
    # 4 rows of 3 tokens, 2 + 3 + 1 + 3 supervised: math/teacher, kb/teacher, math/learner, kb/teacher
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    recorder._record_states(
        torch.ones(4, 3, dtype=torch.long), mask, torch.zeros(4, 3), torch.zeros(4, 3),
        torch.tensor([teacher, teacher, learner, teacher]), teachers=["math", "kb", "math", "kb"],
    )  # fmt: skip
    records = recorder._collect_state_records(sample_rate=1.0)
    assert records.teacher.tolist() == [0, 0, 1, 1, 1, 0, 1, 1, 1]
    assert [sample["teacher"] for sample in records.samples] == ["math", "kb", "math", "kb"]
    metrics = aggregate_states(records, recorder.state_teacher_names)
    assert metrics["supervised_tokens/math"] == 3.0 and metrics["supervised_tokens/kb"] == 6.0
    assert metrics["source_frac/teacher/math"] == pytest.approx(2 / 9)
    assert metrics["source_frac/teacher/kb"] == pytest.approx(6 / 9)
    assert metrics["supervised_tokens/idle"] == metrics["source_frac/teacher/idle"] == 0.0
    assert metrics["source_frac/teacher"] == pytest.approx(8 / 9)
    assert "source_frac/teacher/math" not in aggregate_states(records)  # a single teacher: no breakdown


def test_aggregate_without_tokens_and_histogram():
    empty = StateRecords.empty()
    assert aggregate_states(empty) == {"supervised_tokens": 0.0, "sequences": 0.0}
    assert prefix_len_histogram(empty) == []
    prefix_len = torch.tensor([0, 1, 2, 3, 6, 7])
    zeros = torch.zeros(6)
    records = StateRecords(prefix_len * 0, prefix_len * 0, prefix_len, prefix_len * 0, zeros, zeros, zeros, zeros)
    assert prefix_len_histogram(records) == [1, 2, 2, 1]  # bins [0,1), [1,3), [3,7), [7,15)


def test_nothing_is_kept_before_recording_starts_and_bad_input_raises(tokenizer):
    recorder = Recorder(tokenizer)
    recorder._state_buffer = None  # no callback started the recording
    recorder._record_states(
        torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), "dataset"
    )
    assert recorder._state_buffer is None
    recorder._start_state_recording()
    with pytest.raises(ValueError, match="same"):
        recorder._record_states(
            torch.ones(1, 2, dtype=torch.long), torch.ones(1, 3), torch.zeros(1, 2), torch.zeros(1, 2), "dataset"
        )
    with pytest.raises(ValueError, match="unknown state source"):
        recorder._record_states(
            torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), "human"
        )


class NoFloat64Tensor(torch.Tensor):
    """A tensor that behaves like one on Apple MPS, which has no float64: converting it to float64 raises, and
    `.cpu()` gives an ordinary CPU tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func is torch.Tensor.cpu:
            return out.as_subclass(torch.Tensor)
        if isinstance(out, torch.Tensor) and out.dtype == torch.float64:
            raise TypeError(
                "Cannot convert a MPS Tensor to float64 dtype as the MPS framework doesn't support float64"
            )
        return out


def test_aggregation_runs_on_the_cpu_not_in_float64_on_the_device():
    n = 6
    columns = dict(
        rank=torch.zeros(n, dtype=torch.long), sequence=torch.tensor([0, 0, 0, 1, 1, 1]),
        prefix_len=torch.tensor([0, 1, 2, 0, 1, 2]), source=torch.ones(n, dtype=torch.long),
        logp=-torch.rand(n), entropy=torch.rand(n), teacher_logp=-torch.rand(n), weight=torch.randn(n),
    )  # fmt: skip
    on_cpu = StateRecords(**columns)
    on_device = StateRecords(**{name: value.as_subclass(NoFloat64Tensor) for name, value in columns.items()})
    with pytest.raises(TypeError, match="float64"):  # the stand-in device really refuses float64
        on_device.logp.double()
    assert aggregate_states(on_device) == pytest.approx(aggregate_states(on_cpu))
    assert prefix_len_histogram(on_device) == prefix_len_histogram(on_cpu) == [2, 4]


def records_with_prefix_lengths(prefix_len):
    n = prefix_len.numel()
    zeros, ones = torch.zeros(1).expand(n), torch.ones(1, dtype=torch.long).expand(n)
    return StateRecords(
        ones * 0, ones * 0, prefix_len, ones, zeros, zeros, zeros.new_full((1,), torch.nan).expand(n), zeros
    )


def test_prefix_length_quantiles_are_torch_quantiles_and_have_no_size_limit():
    generator = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 1000):
        prefix_len = torch.randint(0, 50, (n,), generator=generator)  # ties included
        metrics = aggregate_states(records_with_prefix_lengths(prefix_len))
        expected = torch.quantile(prefix_len.double(), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
        assert [metrics["prefix_len/p10"], metrics["prefix_len/p50"], metrics["prefix_len/p90"]] == expected
    # One step with more than 2**24 supervised tokens, where torch.quantile refuses its input
    n = 2**24 + 1
    prefix_len = torch.arange(n).flip(0)
    with pytest.raises(RuntimeError, match="too large"):
        torch.quantile(prefix_len.double(), 0.5)
    metrics = aggregate_states(records_with_prefix_lengths(prefix_len))
    assert metrics["prefix_len/p50"] == 2**23  # the values are 0..2**24, so quantile q is q * 2**24
    assert metrics["prefix_len/p10"] == pytest.approx(0.1 * 2**24, abs=1e-6)
    assert metrics["prefix_len/p90"] == pytest.approx(0.9 * 2**24, abs=1e-6)
