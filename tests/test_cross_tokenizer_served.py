"""A served teacher of another tokenizer moves its "ends here" from its top-k log-probs (`ServedCrossTokenizerTeacher`,
`teachers/served_cross_tokenizer.py`): with every longer teacher token among them it carries what the same teacher carries in
the process, with none (k=0) it moves nothing, and in between its terms are lower bounds of the in-process ones."""

import logging

import pytest
import torch
from cpu_settings import CPU
from datasets import Dataset
from vllm_test_server import TestTeacherServer

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer
from trl_statelens.teachers import CrossTokenizerTeacher, ServedCrossTokenizerTeacher
from trl_statelens.teachers.alignment import TeacherSignal, chunk_totals
from trl_statelens.teachers.decisions import Decision
from trl_statelens.teachers.served_cross_tokenizer import ENDS_TOP_K


def opd_config(path, **kwargs):
    defaults = dict(output_dir=str(path), max_steps=1, per_device_train_batch_size=4, num_generations=2,
                    max_completion_length=128, temperature=1.0, preflight="off")  # fmt: skip
    return OnPolicyDistillConfig(**{**defaults, **CPU, **kwargs})


@pytest.fixture(scope="module")
def lab_pair(tmp_path_factory, math_trained_path, other_teacher_path, math_dataset):
    """The in-process teacher of the second lab tokenizer, four reference answers in its prompts and the student's
    completions, and the same teacher behind a test server."""
    rows = [dict(math_dataset[i]) for i in range(4)]
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=str(other_teacher_path),
        args=opd_config(tmp_path_factory.mktemp("served_ends")),
        train_dataset=Dataset.from_list(rows),
    )
    teacher, tokenizer = trainer.teacher, trainer.processing_class
    assert isinstance(teacher, CrossTokenizerTeacher)
    prompts = teacher.prompts([tokenizer(row["prompt"])["input_ids"] for row in rows], rows)
    completions = [tokenizer(row["completion"], add_special_tokens=False)["input_ids"] for row in rows]
    with TestTeacherServer(other_teacher_path) as server:
        yield trainer, prompts, completions, server


def served_at(trainer, server, k) -> ServedCrossTokenizerTeacher:
    trainer.args.teacher_top_k = k
    return ServedCrossTokenizerTeacher.connect(trainer, trainer.teacher.tokenizer, server.url)


def carried(teacher, prompts, completions):
    """The rows' carried values, decisions and signals, each concatenated over the rows (a row ends a chunk)."""
    rows = [row.scores.result()[row.index] for row in teacher.score(prompts, completions)]
    return tuple(torch.cat([getattr(row, name) for row in rows]) for name in ("logps", "decision", "signal"))


def test_served_ends_with_every_longer_token_in_the_top_k_are_the_in_process_ones(lab_pair):
    """At k = the teacher's vocabulary every longer token is among the top-k: the carried values and their decisions
    are the in-process teacher's on every token outside a chunk, and each chunk's value is the sum of the in-process
    teacher's over its tokens (which it resolves token by token, the served one not). At k=0 nothing moves: they
    differ where the in-process teacher moved an end."""
    trainer, prompts, completions, server = lab_pair
    in_process = trainer.teacher
    reference, reference_decisions, reference_signal = carried(in_process, prompts, completions)
    whole, whole_decisions, signal = carried(
        served_at(trainer, server, len(in_process.teacher_vocab)), prompts, completions
    )
    outside = signal == TeacherSignal.EXACT
    assert (reference_signal[~outside] == TeacherSignal.RESOLVED).all() and (~outside).any()
    torch.testing.assert_close(whole[outside], reference[outside], atol=1e-5, rtol=0)
    assert torch.equal(whole_decisions[outside], reference_decisions[outside])
    ends = signal == TeacherSignal.CHUNK_END
    torch.testing.assert_close(whole[ends], chunk_totals(reference, signal)[ends], atol=1e-4, rtol=0)
    unmoved, unmoved_decisions, _ = carried(served_at(trainer, server, 0), prompts, completions)
    moved = ((unmoved - reference).abs() > 1e-3) & outside
    assert moved.any()
    # a value whose end the in-process teacher moved is the decision's there, and a bound served without it
    assert (unmoved_decisions[moved] != Decision.EXACT).any() and (reference_decisions[moved] == Decision.EXACT).any()


def test_served_ends_terms_are_lower_bounds_of_the_in_process_ones(lab_pair):
    """At a k that leaves longer tokens out, each term is at most the in-process one (and below it somewhere), and
    whole only where it equals it."""
    trainer, prompts, completions, server = lab_pair
    in_process = trainer.teacher
    respelled = [in_process.respell(c) for c in completions]
    reference = [
        in_process._token_logps_and_end_logmass(logps.cpu(), respelled[i])[1]
        for i, logps in in_process._completion_log_probs(prompts, respelled, trainer.temperature)
    ]
    served = served_at(trainer, server, 20)
    sequences, lengths = [p + c for p, c in zip(prompts, respelled)], [len(p) for p in prompts]
    answers = served._scores(sequences, lengths, served.top_k)
    terms = [served._end_logmass_in_top_k(row, ids) for row, ids in zip(answers, respelled)]
    moved, whole = torch.cat([t for t, _ in terms]), torch.cat([w for _, w in terms])
    reference = torch.cat(reference)
    assert (moved <= reference + 1e-5).all() and (moved < reference - 1e-3).any()
    torch.testing.assert_close(moved[whole], reference[whole], atol=1e-5, rtol=0)


def test_a_served_teacher_warns_below_the_top_k_that_kept_its_ends_close(lab_pair, caplog):
    """Below `ENDS_TOP_K` (and at 0, where nothing moves) `connect` warns with the k to use; at it, not."""
    trainer, _, _, server = lab_pair
    for k, warned in ((0, "nothing moves"), (ENDS_TOP_K - 1, "fewer leave more of it out"), (ENDS_TOP_K, None)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trl_statelens.teachers.served_cross_tokenizer"):
            served_at(trainer, server, k)
        if warned is None:
            assert "teacher_top_k=" not in caplog.text
        else:
            assert f"teacher_top_k={k}:" in caplog.text and warned in caplog.text
            assert f"set teacher_top_k={ENDS_TOP_K} or more" in caplog.text


def test_teacher_top_k_without_a_served_teacher_of_another_tokenizer_to_read_it_is_refused(tmp_path, student_path):
    """With reverse_kl, only a served teacher of another tokenizer reads teacher_top_k: one given by URL alone shares
    the student's tokenizer, so a value set away from the default is refused before anything loads; 0 is accepted
    outside divergence, refused with it."""
    with pytest.raises(ValueError, match="teacher_top_k=8 .*shares the student's tokenizer"):
        OnPolicyDistillTrainer(
            model=str(student_path),
            args=opd_config(tmp_path, teacher_model_server_url="http://127.0.0.1:1", teacher_top_k=8),
            train_dataset=Dataset.from_list([{"prompt": "1 + 1 ="}]),
        )
    assert opd_config(tmp_path, teacher_model_server_url="http://127.0.0.1:1", teacher_top_k=0).teacher_top_k == 0
    with pytest.raises(ValueError, match="teacher_top_k must be at least 1 .*with signal='divergence'.*got 0"):
        opd_config(tmp_path, signal="divergence", teacher_top_k=0, teacher_model_server_url="http://127.0.0.1:1")


def test_a_top_k_beyond_the_teachers_vocabulary_is_refused(lab_pair):
    """More log-probs per position than the teacher has tokens is refused, naming the most that can be asked; its
    whole vocabulary is allowed (every end moved exactly)."""
    trainer, _, _, server = lab_pair
    size = len(trainer.teacher.teacher_vocab)
    with pytest.raises(ValueError, match=rf"teacher_top_k={size + 1} is more than the teacher's vocabulary \({size} "):
        served_at(trainer, server, size + 1)
    assert served_at(trainer, server, size).top_k == size
