"""A teacher of another tokenizer in the training processes (`CrossTokenizerTeacher`) on two DeepSpeed ZeRO-3 ranks,
where every teacher forward and generation gathers the teacher's shards from both ranks (a rank that makes fewer
calls leaves the other waiting): `divergence`, `continuation`, and `teacher` states with `reverse_kl`. Launched with
`tests/scripts/opd_cross_tokenizer_two_ranks.py` (as the DDP tests in `test_cross_tokenizer_teacher.py` are)."""

import json
import math

import pytest

SCRIPT = "opd_cross_tokenizer_two_ranks.py"


def zero3_run(tmp_path, student, teacher, settings: dict, hang: str) -> list[dict]:
    """Two ZeRO-3 ranks of `SCRIPT` with `settings`; each rank's report, checked for what ran: two processes at
    ZeRO stage 3, the cross-tokenizer teacher a ZeRO-3 engine, two optimizer steps on each rank."""
    from test_multiprocess import launch_zero3

    launch_zero3(
        SCRIPT, student, teacher, tmp_path, "-", json.dumps(settings), outputs=tmp_path, timeout=300, hang=hang
    )
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for rank in ranks:
        assert (rank["world_size"], rank["zero_stage"], rank["global_step"]) == (2, 3, 2)
        assert (rank["teacher"], rank["teacher_engine"]) == ("CrossTokenizerTeacher", "DeepSpeedEngine")
        assert len(rank["counts"]) == 2  # a loss on each step
    return ranks


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.multiproc
@pytest.mark.slow
def test_zero3_divergence_from_a_teacher_of_another_tokenizer(tmp_path, math_trained_path, other_teacher_path):
    """`divergence` on two ZeRO-3 ranks whose rows differ: the teacher's forwards and the student's output layer run
    as often on both, the run finishes, every supervised position is given a distribution (`alignment/mapped` 1), and
    `alignment/exact` is the share of both ranks' supervised tokens, as each rank counted them from its own batch."""
    ranks = zero3_run(
        tmp_path,
        math_trained_path,
        other_teacher_path,
        {"signal": "divergence"},
        "ZeRO-3 ranks deadlocked in divergence from a teacher of another tokenizer (no exit in 300 s)",
    )
    assert ranks[0]["counts"] != ranks[1]["counts"]  # the ranks' rows differ
    logged = [e for e in ranks[0]["log_history"] if "alignment/mapped" in e]
    assert len(logged) == 2 and all(e["alignment/mapped"] == 1.0 for e in logged)  # every position given one
    for step, entry in enumerate(logged):
        exact = sum(rank["counts"][step][0] for rank in ranks)
        total = sum(rank["counts"][step][1] for rank in ranks)
        assert entry["alignment/exact"] == pytest.approx(exact / total) and entry["alignment/exact"] < 1.0
        assert math.isfinite(entry["loss"])


@pytest.mark.multiproc
@pytest.mark.slow
def test_zero3_continuation_from_a_teacher_of_another_tokenizer(tmp_path, math_trained_path, other_teacher_path):
    """`continuation` on two ZeRO-3 ranks: the teacher writes in its own tokens on both ranks at every step (a
    collective generation), both steps train with a finite loss, and `alignment/exact` and the ledger's supervised
    tokens (the teacher's, given back in the student's) are both ranks', as each rank counted them from its batch."""
    ranks = zero3_run(
        tmp_path,
        math_trained_path,
        other_teacher_path,
        {"signal": "continuation", "continuation_length": 6},
        "ZeRO-3 ranks deadlocked in continuation from a teacher of another tokenizer (no exit in 300 s)",
    )
    assert ranks[0]["counts"] != ranks[1]["counts"]  # the ranks' rows differ
    logged = [e for e in ranks[0]["log_history"] if "alignment/exact" in e]
    assert len(logged) == 2 and all(math.isfinite(e["loss"]) for e in logged)
    steps = read(tmp_path / "statelens" / "steps.jsonl")
    for step, (entry, line) in enumerate(zip(logged, steps, strict=True)):
        exact = sum(rank["counts"][step][0] for rank in ranks)
        total = sum(rank["counts"][step][1] for rank in ranks)
        assert entry["alignment/exact"] == pytest.approx(exact / total)
        assert line["supervised_tokens"] == total > 0


@pytest.mark.multiproc
@pytest.mark.slow
def test_zero3_teacher_states_written_by_a_teacher_of_another_tokenizer(
    tmp_path, math_trained_path, other_teacher_path
):
    """`teacher` states (the teacher writes whole rollouts) with `reverse_kl` on two ZeRO-3 ranks that draw different
    numbers of them: every rank joins each generation, rows or none, the run finishes, and the ledger's
    `teacher_written_tokens` are the tokens both ranks' teacher wrote, in its own tokens."""
    ranks = zero3_run(
        tmp_path,
        math_trained_path,
        other_teacher_path,
        # (no preflight: its writing would count in the teacher's own tokens written, not in the ledger's training steps)
        {"signal": "reverse_kl", "state_source_mix": {"learner": 0.5, "teacher": 0.5}, "preflight": "off"},
        "ZeRO-3 ranks deadlocked writing teacher states in another tokenizer (no exit in 300 s)",
    )
    # as many generations on both ranks; the case under test: one where a rank asked for rows and the other for none
    # (seed 0: rank 0 draws 2 and 1 teacher rows, rank 1 none)
    assert len(ranks[0]["written_rows"]) == len(ranks[1]["written_rows"]) == 2
    assert any(min(pair) == 0 < max(pair) for pair in zip(ranks[0]["written_rows"], ranks[1]["written_rows"]))
    written = [line["teacher_written_tokens"] for line in read(tmp_path / "statelens" / "steps.jsonl")]
    assert sum(written) == sum(rank["own_tokens_written"] for rank in ranks) > 0
    losses = [e["loss"] for e in ranks[0]["log_history"] if "loss" in e]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
