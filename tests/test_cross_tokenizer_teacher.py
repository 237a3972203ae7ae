"""A teacher of another tokenizer in the trainer (`teachers/cross_tokenizer.py`, issue 45): the same tokenizer sent
through the cross-tokenizer path trains exactly as the direct path does, with `reverse_kl` and with `divergence`;
another lab tokenizer's teacher gives the student's tokens its own log-probs of the same text, chunk by chunk, and
its next-token distributions where both tokenizations cut."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from cpu_settings import CPU
from launching import free_port, launch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLoggingCallback, load_gsm8k
from trl_statelens.opd import trainer as opd_trainer
from trl_statelens.reports.states_data import sequence_entry
from trl_statelens.teachers import CrossTokenizerTeacher, InProcessTeacher
from trl_statelens.teachers.alignment import (
    TeacherSignal,
    align_token_ids,
    chunk_totals,
    shared_out_over_chunks,
    spread_over_chunks,
)
from trl_statelens.teachers.decisions import Decision


def opd_config(tmp_path, **kwargs):
    defaults = dict(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=24,
        learning_rate=1e-3,
        temperature=1.0,
    )
    defaults["preflight"] = (
        "off"  # these tests count training's own teacher calls and forwards; the preflight's are tested in test_preflight.py
    )
    return OnPolicyDistillConfig(**{**defaults, **CPU, **kwargs})


def test_chunk_helpers_sum_and_spread_within_chunks():
    signal = torch.tensor([[0, 2, 2, 1, 0, 2, 1]])
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]])
    assert chunk_totals(values, signal).tolist() == [[1.0, 0.0, 0.0, 9.0, 5.0, 0.0, 13.0]]
    assert spread_over_chunks(torch.tensor([[1.0, 0.0, 0.0, 9.0, 5.0, 0.0, 13.0]]), signal).tolist() == [
        [1.0, 9.0, 9.0, 9.0, 5.0, 13.0, 13.0]
    ]
    exact = torch.zeros_like(signal)
    assert torch.equal(chunk_totals(values, exact), values) and torch.equal(spread_over_chunks(values, exact), values)
    # the records' per-token values: the chunk [2, 3, 4] (teacher -12 on its last token) shares -12 - (2 + 3 + 4) = -21
    teacher = torch.tensor([[-1.0, 0.0, 0.0, -12.0, -5.0, 0.0, -2.0]])
    shared = shared_out_over_chunks(teacher, values, signal)
    torch.testing.assert_close(shared, torch.tensor([[-1.0, -5.0, -4.0, -3.0, -5.0, -1.5, -0.5]]))
    assert torch.equal(shared_out_over_chunks(values, values + 1, exact), values)


def assert_trained_alike(direct, direct_log, cross, cross_log, student_path):
    """One step through the direct and the cross-tokenizer path: the same loss and teacher KL, and the same parameters
    after it (the step having moved them)."""
    assert cross_log["loss"] == pytest.approx(direct_log["loss"], abs=1e-6)
    assert cross_log["teacher_kl/sampled"] == pytest.approx(direct_log["teacher_kl/sampled"], abs=1e-6)
    before = {n: p for n, p in AutoModelForCausalLM.from_pretrained(student_path).named_parameters()}
    assert any(not torch.equal(direct[n], before[n]) for n in direct)  # the step moved the student
    for name in direct:
        torch.testing.assert_close(cross[name], direct[name], rtol=1e-5, atol=1e-6)


def _trained_parameters(trainer):
    trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_same_tokenizer_through_the_cross_tokenizer_path_trains_as_the_direct_path(
    tmp_path, math_trained_path, math_teacher_path, math_dataset
):
    """One step with the teacher as an `InProcessTeacher` and one with the same model and tokenizer behind
    `CrossTokenizerTeacher` (prompts re-rendered from the rows, completions spelled out and tokenized again): the
    same rollouts, the same loss and the same parameters after the step, to float precision."""
    runs = {}
    for kind in ("direct", "cross"):
        trainer = OnPolicyDistillTrainer(
            model=str(math_trained_path),
            teacher_model=str(math_teacher_path),
            args=opd_config(tmp_path / kind),
            train_dataset=math_dataset,
        )
        assert type(trainer.teacher) is InProcessTeacher
        if kind == "cross":
            teacher_tokenizer = AutoTokenizer.from_pretrained(math_teacher_path)
            trainer.teacher = CrossTokenizerTeacher(trainer, trainer.teacher.model, teacher_tokenizer)
        runs[kind] = (_trained_parameters(trainer), trainer.state.log_history[0])
    (direct, direct_log), (cross, cross_log) = runs["direct"], runs["cross"]
    assert cross_log["alignment/exact"] == 1.0 and "alignment/exact" not in direct_log
    assert cross_log["alignment/per_decision_exact"] == 1.0  # one vocabulary: every value is the decision's
    assert_trained_alike(direct, direct_log, cross, cross_log, math_trained_path)


def test_teacher_of_another_tokenizer_scores_the_same_text_chunk_by_chunk(
    tmp_path, math_trained_path, other_teacher_path, math_dataset, tokenizer
):
    """The teacher path names a tokenizer of other merges: the trainer builds a `CrossTokenizerTeacher`. On real
    rollouts, each row's carried log-probs are the teacher's log-probs of its own tokenization of the completion text,
    chunk by chunk, with its "its token ends here" moved off every student token no other student token goes on from
    (the student's digits, and words the teacher ends with a token that goes on); the student's single digits
    against the teacher's whole numbers are chunks, and a step trains."""
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=str(other_teacher_path),
        args=opd_config(tmp_path, max_steps=2),
        train_dataset=math_dataset,
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
    )
    teacher = trainer.teacher
    assert isinstance(teacher, CrossTokenizerTeacher) and trainer.probe_teacher_model is None
    # the student's digits end where only the teacher's tokens (whole numbers) can say so
    digits = tokenizer.convert_tokens_to_ids([str(d) for d in range(10)])
    numbers = [b for b in teacher.teacher_vocab.token_bytes if b and b.isdigit() and len(b) > 1]
    starting = {i for i, d in zip(digits, range(10)) if any(b.startswith(str(d).encode()) for b in numbers)}
    assert starting and all(teacher.decision_table.free_ends[i] for i in starting)
    assert not teacher.decision_table.free_ends[tokenizer.eos_token_id]
    rows = [math_dataset[i] for i in range(4)]
    completions = [tokenizer(" " + r["answer"], add_special_tokens=False)["input_ids"] for r in rows]
    completions[0] = completions[0] + [tokenizer.eos_token_id]
    # words the teacher ends with a token that goes on (` stones` as ` st`, `on`, `es`), as the student's rollouts write
    completions[1] += tokenizer(" 4 stones, 7 fish and a clock.", add_special_tokens=False)["input_ids"]
    student_prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    prompts = teacher.prompts(student_prompts, rows)
    teacher_tokenizer = teacher.tokenizer
    assert prompts[0] == teacher_tokenizer(rows[0]["prompt"])["input_ids"] != student_prompts[0]
    scores = [row.scores.result()[row.index] for row in teacher.score(prompts, completions)]
    own = [row.logps for row in teacher._score_rows(prompts, [teacher.respell(c) for c in completions])]
    teacher_model = AutoModelForCausalLM.from_pretrained(other_teacher_path)
    spelled_by_teacher = teacher.teacher_vocab.token_bytes
    spelled_by_student = sorted(b for b in teacher.student_vocab.token_bytes if b)
    free_ends = {  # (no other student token starts with its bytes)
        b for b, following in zip(spelled_by_student, spelled_by_student[1:] + [b""]) if not following.startswith(b)
    }
    moved, moved_off_words = 0, 0
    for prompt, completion, carried, teacher_logps in zip(prompts, completions, scores, own):
        assert carried.logps.shape == carried.signal.shape == (len(completion),)
        assert not (carried.signal == TeacherSignal.CHUNK_INSIDE).any()  # every chunk resolved token by token
        # Checked against a forward of the teacher: the teacher's log-prob of the text up to each student boundary
        # (inside a teacher token: its tokens before it, then any token starting with the part written), each token
        # given the difference across it; then each value that ends where a teacher token ends, on a token the
        # student cannot go on from, given the log-prob of any token starting with that token's bytes, moved from the
        # next value
        spelled = teacher.respell(completion)
        with torch.no_grad():
            logps = teacher_model(torch.tensor([prompt + spelled])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        terms = []
        for j, token in enumerate(spelled):
            mine = spelled_by_teacher[token]
            longer = [v for v, b in enumerate(spelled_by_teacher) if mine and b and b.startswith(mine)]
            terms.append(float(logps[j, longer].logsumexp(0) - logps[j, token]) if mine else 0.0)
        alignment = align_token_ids(completion, spelled, teacher.student_vocab, teacher.teacher_vocab)
        cuts = alignment.teacher_boundaries.tolist()
        levels = []
        for x in alignment.student_boundaries.tolist():
            j = max(i for i, c in enumerate(cuts) if c <= x)
            level = float(teacher_logps[:j].double().sum())
            if x != cuts[j]:
                part = spelled_by_teacher[spelled[j]][: x - cuts[j]]
                level += float(
                    logps[j, [v for v, b in enumerate(spelled_by_teacher) if b and b.startswith(part)]].logsumexp(0)
                )
            levels.append(level)
        expected = torch.tensor(levels).diff()
        for k in range(len(completion)):
            if (
                teacher.student_vocab.token_bytes[completion[k]] in free_ends
                and int(alignment.student_boundaries[k + 1]) in cuts
            ):
                j = cuts.index(int(alignment.student_boundaries[k + 1])) - 1
                expected[k] += terms[j]
                moved += terms[j] > 0
                moved_off_words += terms[j] > 0 and not tokenizer.decode([completion[k]]).isdigit()
                if k + 1 < len(completion):
                    expected[k + 1] -= terms[j]
        torch.testing.assert_close(carried.logps, expected, rtol=1e-4, atol=1e-4)
        digit_runs = [
            i for i, t in enumerate(completion[:-1]) if tokenizer.decode([t]).isdigit()
            and tokenizer.decode([completion[i + 1]]).isdigit()
        ]  # fmt: skip
        assert digit_runs and all(carried.signal[i] == TeacherSignal.RESOLVED for i in digit_runs)
        # inside a teacher number the student's digits are the teacher's decisions where the part written is itself a
        # teacher token (the lab's numbers tokenizer keeps whole the numbers it has seen)
        assert any(carried.decision[i] == Decision.EXACT for i in digit_runs)
    assert moved > moved_off_words > 0
    assert teacher.respell(completions[0])[-1] == teacher_tokenizer.eos_token_id  # by role
    # What the teacher's forwards run over beyond the student's rollouts, per step: its own tokens of each prompt and
    # completion against the student's, signed (the ledger's `teacher_context_tokens`, in the teacher's FLOPs)
    extra_tokens, prompts_of, score = [], teacher.prompts, teacher.score

    def prompts_counted(student_prompts, rows):
        prompts = prompts_of(student_prompts, rows)
        extra_tokens.append(sum(len(t) - len(s) for t, s in zip(prompts, student_prompts)))
        return prompts

    def score_counted(prompts, completions, *args, **kwargs):
        extra_tokens[-1] += sum(len(teacher.respell([int(t) for t in c])) - len(c) for c in completions)
        return score(prompts, completions, *args, **kwargs)

    teacher.prompts, teacher.score = prompts_counted, score_counted
    trainer.train()
    ledger = [json.loads(line) for line in (tmp_path / "statelens" / "steps.jsonl").read_text().splitlines()]
    assert [line.get("teacher_context_tokens", 0) for line in ledger] == extra_tokens
    assert any(extra_tokens)
    exact = [e["alignment/exact"] for e in trainer.state.log_history if "alignment/exact" in e]
    assert len(exact) == 2 and all(0.0 < share < 1.0 for share in exact)
    # `alignment/per_decision_exact`: the values that are the teacher's probability of the student's decision
    # (teachers/decisions.py): exact values, and tokens of resolved chunks, so more than the exact share
    per_decision = [e["alignment/per_decision_exact"] for e in trainer.state.log_history if "alignment/exact" in e]
    assert all(whole < share <= 1.0 for share, whole in zip(per_decision, exact, strict=True))
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert all(torch.isfinite(torch.tensor(losses)))
    # The ledger: per supervised token, whether the teacher's value is exact; a chunk's shared-out values sum to the
    # teacher's; the states page marks the tokens that are not exact
    samples = [json.loads(line) for line in (tmp_path / "statelens" / "states.jsonl").read_text().splitlines()]
    flags = [flag for sample in samples for flag in sample["teacher_exact"]]
    assert len(flags) == sum(len(sample["logp"]) for sample in samples) and 0 < flags.count(False) < len(flags)
    runs = 0
    for sample in samples:  # inside a run of digits the student's single digits are chunks against whole numbers
        tokens, marked = sample["tokens"], sequence_entry(sample, 0)["ne"] or []
        digit_runs = [i for i in range(len(tokens) - 1) if tokens[i].isdigit() and tokens[i + 1].isdigit()]
        assert set(digit_runs) <= set(marked)
        runs += len(digit_runs)
    assert runs > 0
    # `alignment/exact/numbers`: the exact share among supervised tokens that spell a digit, as the ledger's sequences
    # (every one sampled here) count it; the student's digits ending inside the teacher's numbers pull it below the rest
    logged = [e["alignment/exact/numbers"] for e in trainer.state.log_history if "alignment/exact/numbers" in e]
    for step, share in zip((1, 2), logged, strict=True):
        flags = [flag for s in samples if s["step"] == step for token, flag in zip(s["tokens"], s["teacher_exact"])
                 if any(ch.isdigit() for ch in token)]  # fmt: skip
        assert share == pytest.approx(sum(flags) / len(flags))
        assert share < exact[step - 1]


def test_divergence_from_a_served_teacher_of_another_tokenizer_is_refused_before_any_model_loads(
    tmp_path, student_path, other_teacher_path, math_dataset, monkeypatch
):
    """A server answers top-k log-probs, not the distribution `divergence` carries across tokenizers: refused before
    anything loads or connects, with the way out. (In the process `divergence` is carried, above; `continuation` and
    teacher-written states are carried from either: `tests/test_cross_tokenizer_writing.py`.)"""
    monkeypatch.setattr(opd_trainer, "load_teacher", lambda *a: pytest.fail("the teacher loaded before the refusal"))
    with pytest.raises(ValueError, match="server answers top-k.*'continuation'"):
        OnPolicyDistillTrainer(
            model=str(student_path),
            teacher_model=str(other_teacher_path),
            args=opd_config(tmp_path, signal="divergence", teacher_model_server_url="http://127.0.0.1:9"),
            train_dataset=math_dataset,
        )


def test_a_teacher_tokenizer_that_cannot_spell_its_tokens_in_bytes_is_refused_before_any_model_loads(
    tmp_path, student_path, math_dataset, monkeypatch
):
    """A WordPiece tokenizer (no byte alphabet, no byte fallback) saved where the teacher's path points, with no model
    beside it: the refusal names the tokenizer kind, and nothing was loaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.train_from_iterator(
        ["twelve apples cost 3 dollars"] * 4, trainers.WordPieceTrainer(special_tokens=["[UNK]"])
    )
    teacher_path = tmp_path / "wordpiece-teacher"
    PreTrainedTokenizerFast(tokenizer_object=wordpiece, unk_token="[UNK]", eos_token="[UNK]").save_pretrained(
        teacher_path
    )
    monkeypatch.setattr(opd_trainer, "load_teacher", lambda *a: pytest.fail("the teacher loaded before the refusal"))
    with pytest.raises(ValueError, match="cannot give its tokens bytes"):
        OnPolicyDistillTrainer(
            model=str(student_path),
            teacher_model=str(teacher_path),
            args=opd_config(tmp_path, signal="reverse_kl"),
            train_dataset=math_dataset,
        )


@pytest.mark.multiproc
@pytest.mark.slow
def test_alignment_share_is_summed_over_two_ranks(tmp_path, math_trained_path, other_teacher_path):
    """Two DDP ranks, each with its own rows: `alignment/exact` is the exact share of both ranks' supervised tokens
    together, as each rank counted them from its own batch."""
    accelerate = Path(sys.executable).parent / "accelerate"
    command = [
        str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        str(Path(__file__).parent / "scripts" / "opd_cross_tokenizer_two_ranks.py"), str(math_trained_path),
        str(other_teacher_path), str(tmp_path),
    ]  # fmt: skip
    launch(command, {"TOKENIZERS_PARALLELISM": "false"}, timeout=300, outputs=tmp_path)
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for rank in ranks:  # what ran: two gloo processes, each with the cross-tokenizer teacher, two steps
        assert (rank["world_size"], rank["backend"], rank["teacher"]) == (2, "gloo", "CrossTokenizerTeacher")
        assert len(rank["counts"]) == 2
    logged = [e["alignment/exact"] for e in ranks[0]["log_history"] if "alignment/exact" in e]
    per_rank = [[exact / total for exact, total in rank["counts"]] for rank in ranks]
    assert per_rank[0] != per_rank[1]  # the ranks' rows differ, so the sum over both is not either one's share
    for step in range(2):
        exact = sum(rank["counts"][step][0] for rank in ranks)
        total = sum(rank["counts"][step][1] for rank in ranks)
        assert logged[step] == pytest.approx(exact / total)


@pytest.mark.multiproc
@pytest.mark.slow
def test_routed_teachers_of_two_tokenizers_on_two_ranks(
    tmp_path, math_trained_path, math_teacher_path, other_teacher_path
):
    """A router with a teacher of the student's tokenizer and one of another, on two DDP ranks: a step where one rank
    holds only the same-tokenizer teacher's rows still sums the alignment over both (every rank counts it, because
    the teachers, not the rows, decide), and training goes on."""
    accelerate = Path(sys.executable).parent / "accelerate"
    command = [
        str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        str(Path(__file__).parent / "scripts" / "opd_cross_tokenizer_two_ranks.py"), str(math_trained_path),
        str(other_teacher_path), str(tmp_path), str(math_teacher_path),
    ]  # fmt: skip
    launch(command, {"TOKENIZERS_PARALLELISM": "false"}, timeout=300, outputs=tmp_path)
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for rank in ranks:
        assert (rank["world_size"], rank["backend"], rank["teacher"]) == (2, "gloo", "TeacherRouter")
        assert len(rank["counts"]) == 2
    # what ran: at some step one rank held only the same-tokenizer teacher's rows and the other the other teacher's
    assert any({*ranks[0]["teachers"][s]} != {*ranks[1]["teachers"][s]} for s in range(2))
    logged = [e["alignment/exact"] for e in ranks[0]["log_history"] if "alignment/exact" in e]
    assert len(logged) == 2
    for step in range(2):
        exact = sum(rank["counts"][step][0] for rank in ranks)
        total = sum(rank["counts"][step][1] for rank in ranks)
        assert logged[step] == pytest.approx(exact / total)


@pytest.mark.multiproc
@pytest.mark.slow
def test_routed_divergence_of_two_tokenizers_on_two_ranks(
    tmp_path, math_trained_path, math_teacher_path, other_teacher_path
):
    """`divergence` from a router with a teacher of the student's tokenizer and one of another, on two DDP ranks
    whose rows differ (at a step one rank may hold only one teacher's rows): every rank makes as many calls of each
    collective (the teachers' agreed forwards included), training goes on, every supervised position is given a
    distribution (`alignment/mapped` 1), and `alignment/exact` is the share of both ranks' supervised tokens, as each
    rank counted them from its own batch."""
    accelerate = Path(sys.executable).parent / "accelerate"
    command = [
        str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        str(Path(__file__).parent / "scripts" / "opd_cross_tokenizer_two_ranks.py"), str(math_trained_path),
        str(other_teacher_path), str(tmp_path), str(math_teacher_path), json.dumps({"signal": "divergence"}),
    ]  # fmt: skip
    environment = {"TOKENIZERS_PARALLELISM": "false"}
    launch(command, environment, timeout=300, outputs=tmp_path)
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for rank in ranks:
        assert (rank["world_size"], rank["backend"], rank["teacher"]) == (2, "gloo", "TeacherRouter")
        assert len(rank["counts"]) == 2
    assert any({*ranks[0]["teachers"][s]} != {*ranks[1]["teachers"][s]} for s in range(2))
    logged = [e for e in ranks[0]["log_history"] if "alignment/mapped" in e]
    assert len(logged) == 2 and all(e["alignment/mapped"] == 1.0 for e in logged)  # every position given one
    for step, entry in enumerate(logged):
        exact = sum(rank["counts"][step][0] for rank in ranks)
        total = sum(rank["counts"][step][1] for rank in ranks)
        assert entry["alignment/exact"] == pytest.approx(exact / total)


def test_routed_teachers_of_two_tokenizers_each_score_their_own_rows(
    tmp_path, math_trained_path, math_teacher_path, other_teacher_path, math_dataset
):
    """Two routed teachers, one of the student's tokenizer and one of another: each row is read in its teacher's
    tokens and scored as that teacher alone scores it; the same-tokenizer rows are exact throughout, the others chunk
    the student's digits; a step trains and logs the alignment and each teacher's KL."""
    from trl_statelens.teachers import TeacherRouter, resolve_rows, resolved_signal

    dataset = math_dataset.add_column("teacher_id", ["math", "other"] * (len(math_dataset) // 2))
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model={"math": str(math_teacher_path), "other": str(other_teacher_path)},
        args=opd_config(tmp_path, max_steps=2, per_device_train_batch_size=8, signal="reverse_kl"),
        train_dataset=dataset,
    )
    router = trainer.teacher
    assert isinstance(router, TeacherRouter) and router.crosses_tokenizers and not router.reads_student_ids
    assert isinstance(router.teachers["other"], CrossTokenizerTeacher)
    assert not isinstance(router.teachers["math"], CrossTokenizerTeacher)
    rows = [dict(row) for row in dataset.select(range(4)) for _ in range(2)]
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows)
    assert batch["teacher"] == ["math", "math", "other", "other"] * 2
    ids, mask = batch["completion_ids"], batch["completion_mask"]
    logps = resolve_rows(batch["teacher_scores"], ids, mask).logps
    signal = resolved_signal(batch["teacher_scores"], ids)
    prompts = [p[m.bool()].tolist() for p, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
    completions = [c[m.bool()].tolist() for c, m in zip(ids, mask)]
    for name, teacher in router.teachers.items():
        mine = [i for i, routed in enumerate(batch["teacher"]) if routed == name]
        own_prompts = teacher.prompts([prompts[i] for i in mine], [rows[i] for i in mine])
        alone = resolve_rows(teacher.score(own_prompts, [completions[i] for i in mine]), ids[mine], mask[mine])
        torch.testing.assert_close(logps[mine], alone.logps, atol=1e-5, rtol=1e-5)
    math_rows = [i for i, routed in enumerate(batch["teacher"]) if routed == "math"]
    other_rows = [i for i, routed in enumerate(batch["teacher"]) if routed == "other"]
    assert (signal[math_rows] == TeacherSignal.EXACT).all()
    assert (signal[other_rows][mask[other_rows].bool()] != TeacherSignal.EXACT).any()
    trainer.train()
    logged = [e for e in trainer.state.log_history if "alignment/exact" in e]
    shares = [e["alignment/exact"] for e in logged]  # (a step whose routed rows wrote no number can be all exact)
    assert len(shares) == 2 and all(0.0 < share <= 1.0 for share in shares) and min(shares) < 1.0
    assert all("teacher_kl/sampled/math" in e and "teacher_kl/sampled/other" in e for e in logged)


def test_a_served_teacher_of_another_tokenizer_scores_as_the_same_teacher_in_process(
    tmp_path, math_trained_path, other_teacher_path, math_dataset, caplog
):
    """The other-tokenizer teacher behind a (test) vLLM server, named by its path for its tokenizer: the rows it
    scores carry the same log-probs and signal onto the student's tokens as the same model in the process does, and
    training runs with the alignment logged."""
    from vllm_test_server import TestTeacherServer

    from trl_statelens.teachers import ServedCrossTokenizerTeacher, resolve_rows, resolved_signal
    from trl_statelens.teachers.base import answered, batch_rows

    with TestTeacherServer(other_teacher_path) as server:
        trainer = OnPolicyDistillTrainer(
            model=str(math_trained_path),
            teacher_model=str(other_teacher_path),
            args=opd_config(tmp_path, max_steps=2, teacher_model_server_url=server.url, teacher_top_k=0),
            train_dataset=math_dataset,
        )
        served = trainer.teacher
        assert isinstance(served, ServedCrossTokenizerTeacher) and trainer.teacher_model is None
        # this pair's digits end where only the teacher's numbers can say, and k=0 moves nothing
        assert "teacher_top_k=0" in caplog.text and "nothing moves" in caplog.text
        rows = [dict(row) for row in math_dataset.select(range(2)) for _ in range(2)]
        trainer.model.train()
        batch = trainer._generate_and_score_completions(rows)
        ids, mask = batch["completion_ids"], batch["completion_mask"]
        prompts = [p[m.bool()].tolist() for p, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
        completions = [c[m.bool()].tolist() for c, m in zip(ids, mask)]
        assert served.prompts(prompts, rows) != prompts  # the server reads the teacher's tokens
        in_process = CrossTokenizerTeacher.prepared(
            trainer,
            AutoModelForCausalLM.from_pretrained(other_teacher_path),
            AutoTokenizer.from_pretrained(other_teacher_path),
        )
        # (the in-process teacher's values before the ends are moved: with teacher_top_k=0 a served teacher answers
        # the actual tokens' log-probs only, and says so when it is made; moved ends: test_cross_tokenizer_served.py)
        respelled = [in_process.respell(c) for c in completions]
        unmoved = in_process._carry(
            completions, respelled, in_process._score_rows(in_process.prompts(prompts, rows), respelled)
        )
        alone = [row for row in batch_rows(answered(unmoved), len(unmoved))]
        torch.testing.assert_close(
            resolve_rows(batch["teacher_scores"], ids, mask).logps,
            resolve_rows(alone, ids, mask).logps,
            atol=1e-5,
            rtol=1e-5,
        )
        signal = resolved_signal(batch["teacher_scores"], ids)
        assert torch.equal(signal, resolved_signal(alone, ids)) and (signal[mask.bool()] != TeacherSignal.EXACT).any()
        trainer.train()
    shares = [e["alignment/exact"] for e in trainer.state.log_history if "alignment/exact" in e]
    assert len(shares) == 2 and all(0.0 < share <= 1.0 for share in shares)


def _batch_and_hidden(trainer, rows):
    """A generation batch of `rows` (two rollouts each) and the student's final hidden states at its completion
    positions, a leaf that collects the gradient."""
    from trl_statelens.heads import _completion_hidden_states

    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows)
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        hidden = _completion_hidden_states(trainer.model, input_ids, attention_mask, batch["completion_ids"].size(1))
    return batch, hidden.detach().requires_grad_(True)


def _loss_and_gradients(teacher, student, hidden, batch, beta, temperature):
    """`teacher.divergence_loss` on `batch` (a mean over its tokens, as a step's) and its gradients in the student's
    hidden states and output layer."""
    mask = batch["completion_mask"].float()
    out = teacher.divergence_loss(student, hidden, batch, mask, mask.sum(), beta, temperature)
    head = student.get_output_embeddings().weight
    return (out.loss.detach(), *torch.autograd.grad(out.loss, (hidden, head))), out


def test_same_tokenizer_through_the_cross_tokenizer_path_gives_the_same_divergence(
    tmp_path, math_trained_path, math_teacher_path, math_dataset
):
    """`divergence` with one tokenizer on both sides: through `CrossTokenizerTeacher` every position is synchronised
    and each distribution is carried over whole (nothing left over), so the loss and its gradient on one batch equal
    the same-tokenizer path's (TRL's kernel) at forward KL, JSD and reverse KL, at another temperature too, and after
    a training step the parameters are the same, to float precision."""
    runs, teachers = {}, {}
    for kind in ("direct", "cross"):
        trainer = OnPolicyDistillTrainer(
            model=str(math_trained_path),
            teacher_model=str(math_teacher_path),
            # (plain SGD: a step moves each parameter by its gradient; Adam's first step, about lr * sign(gradient),
            # magnifies float noise in a gradient near 0)
            args=opd_config(tmp_path / kind, signal="divergence", optim="sgd", learning_rate=0.01),
            train_dataset=math_dataset,
        )
        if kind == "cross":
            teacher_tokenizer = AutoTokenizer.from_pretrained(math_teacher_path)
            trainer.teacher = CrossTokenizerTeacher(trainer, trainer.teacher.model, teacher_tokenizer)
        teachers[kind] = trainer.teacher
        runs[kind] = (_trained_parameters(trainer), trainer.state.log_history[0])
    # One batch of the trained student's rollouts (the cross trainer's: its rows carry the teacher's readings)
    rows = [dict(row) for row in math_dataset.select(range(2)) for _ in range(2)]
    cross_batch, hidden = _batch_and_hidden(trainer, rows)
    batch, mask = {**cross_batch, "teacher_scores": None}, cross_batch["completion_mask"]
    # (the rollouts are the tokenizer's own spelling of their text, which the teacher's reading gives back)
    completions = [c[m.bool()].tolist() for c, m in zip(batch["completion_ids"], mask)]
    assert all(trainer.teacher.respell(c) == c for c in completions)
    student = trainer.model
    for beta, temperature in ((0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (1.0, 0.7)):
        direct, _ = _loss_and_gradients(teachers["direct"], student, hidden, batch, beta, temperature)
        cross, out = _loss_and_gradients(teachers["cross"], student, hidden, cross_batch, beta, temperature)
        assert direct[0] > 0
        torch.testing.assert_close(cross[0], direct[0], rtol=1e-5, atol=1e-6)
        for cross_grad, direct_grad in zip(cross[1:], direct[1:]):
            torch.testing.assert_close(cross_grad, direct_grad, rtol=1e-4, atol=1e-6)
        assert (out.leftover[mask.bool()] == 0).all()  # every position carried over, nothing left over
    (direct, direct_log), (cross, cross_log) = runs["direct"], runs["cross"]
    assert cross_log["alignment/mapped"] == 1.0 and cross_log["alignment/leftover"] == 0.0
    assert cross_log["alignment/exact"] == 1.0 and "alignment/mapped" not in direct_log
    assert_trained_alike(direct, direct_log, cross, cross_log, math_trained_path)


def test_divergence_from_a_teacher_of_another_tokenizer_is_its_mapped_distribution_where_both_cut(
    tmp_path, math_trained_path, other_teacher_path, math_dataset, tokenizer
):
    """`divergence` from the other lab tokenizer's teacher on a small batch (reference answers, whose numbers the
    student writes digit by digit and the teacher whole): the loss is, computed here by hand, the generalised JSD
    between the student's next-token distribution and the teacher's (a forward over its own tokens of the row) with
    each teacher token's mass on the longest student token its bytes start with, both renormalised over the student
    tokens that get some, over the supervised positions where both tokenizations cut; after a digit, the teacher's
    probability that its previous token went on (`5` -> `51`) is on the student's next digit (the ends defect: without
    it the carried distribution says every number ends after its first digit). At a position inside a teacher token
    (the digits after a number's first), the teacher's tokens starting with the part written so far, each on the
    student token its rest starts with: every supervised position is compared."""
    from trl_statelens.heads import _completion_hidden_states
    from trl_statelens.teachers.base import completion_padded, left_padded

    beta = 0.5
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=str(other_teacher_path),
        args=opd_config(tmp_path, signal="divergence", jsd_beta=beta),
        train_dataset=math_dataset,
    )
    teacher, student = trainer.teacher, trainer.model
    assert isinstance(teacher, CrossTokenizerTeacher)
    rows = [math_dataset[i] for i in range(3)]
    completions = [tokenizer(" " + r["answer"], add_special_tokens=False)["input_ids"] for r in rows]
    completions[0] = completions[0] + [tokenizer.eos_token_id]
    student_prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    prompt_ids, prompt_mask = left_padded(student_prompts, tokenizer.pad_token_id)
    completion_ids, completion_mask = completion_padded(completions, tokenizer.pad_token_id)
    loss_mask = completion_mask.float()
    loss_mask[1, :3] = 0  # a row whose first tokens are not supervised
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "teacher_scores": teacher.score(teacher.prompts(student_prompts, rows), completions, True),
    }
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    hidden = _completion_hidden_states(student, input_ids, attention_mask, completion_ids.size(1))
    normalizer = loss_mask.sum()
    out = teacher.divergence_loss(student, hidden, batch, loss_mask, normalizer, beta, 1.0)

    # By hand: the teacher's own tokens of each row, its forward, the byte-prefix mapping, the divergence
    teacher_tokenizer = AutoTokenizer.from_pretrained(other_teacher_path)
    teacher_model = AutoModelForCausalLM.from_pretrained(other_teacher_path)
    student_bytes, teacher_bytes = teacher.student_vocab.token_bytes, teacher.teacher_vocab.token_bytes
    student_roles, teacher_roles = teacher.student_vocab.roles, teacher.teacher_vocab.roles
    receiver = []  # each teacher token's student token, or None (its mass is left over)
    for token_id, spelled in enumerate(teacher_bytes):
        if spelled is None:
            same_role = [s for s, roles in student_roles.items() if set(roles) & set(teacher_roles.get(token_id, ()))]
            receiver.append(same_role[0] if same_role else None)
            continue
        prefixes = [(len(b), s) for s, b in enumerate(student_bytes) if b and spelled.startswith(b)]
        receiver.append(max(prefixes)[1] if prefixes else None)
    with torch.no_grad():
        student_logps = student(input_ids, attention_mask=attention_mask).logits[:, prompt_ids.size(1) - 1 : -1]
        student_logps = student_logps.float().log_softmax(-1)
    total, compared, inside_digits = 0.0, torch.zeros_like(loss_mask, dtype=torch.bool), 0
    digits_after_numbers = 0  # longer numbers carried onto the student's next digit
    for i, (row, completion) in enumerate(zip(rows, completions)):
        teacher_prompt = teacher_tokenizer(row["prompt"])["input_ids"]
        spelled = teacher_tokenizer(" " + row["answer"], add_special_tokens=False)["input_ids"]
        spelled += [teacher_tokenizer.eos_token_id] if i == 0 else []
        assert spelled == teacher.respell(completion)
        with torch.no_grad():
            logits = teacher_model(torch.tensor([teacher_prompt + spelled])).logits[0, len(teacher_prompt) - 1 : -1]
        teacher_probs = logits.float().softmax(-1)

        def starts(ids, spelled_as):
            lengths = [len(spelled_as[t]) if spelled_as[t] is not None else 1 for t in ids]
            return [sum(lengths[:k]) for k in range(len(ids))]

        teacher_starts = starts(spelled, teacher_bytes)
        for s, start in enumerate(starts(completion, student_bytes)):
            if not loss_mask[i, s]:
                continue
            compared[i, s] = True
            mapped = torch.zeros(student_logps.size(-1))
            if start not in teacher_starts:  # inside a teacher token: the rest of the tokens starting with its part
                j = max(k for k, at in enumerate(teacher_starts) if at < start)
                part = teacher_bytes[spelled[j]][: start - teacher_starts[j]]
                starting = [t for t, b in enumerate(teacher_bytes) if b and b.startswith(part)]
                for t in starting:
                    rest = teacher_bytes[t][len(part) :]
                    firsts = [(len(b), v) for v, b in enumerate(student_bytes) if b and rest and rest.startswith(b)]
                    if firsts:
                        mapped[max(firsts)[1]] += teacher_probs[j, t] / teacher_probs[j, starting].sum()
                inside_digits += tokenizer.decode([completion[s]]).isdigit()
            else:
                at = teacher_starts.index(start)
                for token_id, mass in enumerate(teacher_probs[at].tolist()):
                    if receiver[token_id] is not None:
                        mapped[receiver[token_id]] += mass
            # After a student token no other starts with (a digit), the teacher's previous token `u` may have gone on
            # (`5` -> `51`): each longer token's share at u's decision goes to the student token its rest starts with
            previous = student_bytes[completion[s - 1]] if s else None
            if (
                start in teacher_starts
                and at
                and previous
                and not any(b != previous and b and b.startswith(previous) for b in student_bytes)
            ):
                ended = teacher_bytes[spelled[at - 1]] or b""
                longer = [t for t, b in enumerate(teacher_bytes) if ended and b and len(b) > len(ended)]
                longer = [t for t in longer if teacher_bytes[t].startswith(ended)]
                before = teacher_probs[at - 1]
                whole = before[spelled[at - 1]] + before[longer].sum()
                mapped *= before[spelled[at - 1]] / whole
                for t in longer:
                    rest = teacher_bytes[t][len(ended) :]
                    firsts = [(len(b), v) for v, b in enumerate(student_bytes) if b and rest.startswith(b)]
                    if firsts:
                        mapped[max(firsts)[1]] += before[t] / whole
                        digits_after_numbers += rest[:1].isdigit() and ended[-1:].isdigit()
            # over the student tokens the teacher reaches: the student conditioned on them, the teacher renormalised
            p = student_logps[i, s].exp()
            reached = mapped > 0
            p_cat, q_cat = p[reached] / p[reached].sum(), mapped[reached] / mapped.sum()
            m = (1 - beta) * p_cat + beta * q_cat
            total += beta * (q_cat * (q_cat / m).log()).sum() + (1 - beta) * (p_cat * (p_cat / m).log()).sum()
    assert inside_digits > 0 and digits_after_numbers > 0
    assert torch.equal(torch.isfinite(out.leftover), compared) and torch.equal(compared, loss_mask.bool())
    torch.testing.assert_close(out.loss.detach(), total / normalizer, rtol=1e-4, atol=1e-6)


def test_a_part_whose_tokens_all_underflow_carries_nothing_and_no_nan(
    tmp_path, math_trained_path, other_teacher_path, math_dataset
):
    """Inside a teacher token whose every continuation has probability 0 at the run's precision (a very peaked
    teacher, a low temperature), the carried distribution is empty (the loss adds 0 there) and all of it is left
    over: a NaN there would reach the loss and every gradient."""
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=str(other_teacher_path),
        args=opd_config(tmp_path, signal="divergence"),
        train_dataset=math_dataset,
    )
    teacher = trainer.teacher
    rows = teacher.model.get_output_embeddings().weight.size(0)
    starting = set(teacher.ids_starting_with(b"1").tolist())
    elsewhere = next(i for i in range(rows) if i not in starting)
    logps = torch.full((1, rows), -float("inf"))
    logps[0, elsewhere] = 0.0  # the teacher is sure of a token that does not start with `1`
    carried = teacher._carried_inside(logps, [(0, 0, b"1")])
    assert carried.student_probs.sum() == 0 and carried.leftover.tolist() == [1.0]
    going, unread, share = teacher._carried_on(logps[0], b"1", ended=next(iter(starting)))
    assert going.sum() == 0 and unread == 0 and share == 0


def test_divergence_from_a_teacher_of_another_tokenizer_trains_and_logs_what_was_mapped(
    tmp_path, math_trained_path, other_teacher_path, math_dataset
):
    """Two `divergence` steps from the other lab tokenizer's teacher: the loss is finite, and each step logs the
    share of supervised positions compared with a carried distribution (`alignment/mapped`: all of them, the student's
    digits inside the teacher's numbers included), the leftover mass there and the exact share; the ledger's
    sequences mark the tokens whose teacher value is not exact."""
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=str(other_teacher_path),
        args=opd_config(tmp_path, max_steps=2, signal="divergence"),
        train_dataset=math_dataset,
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
    )
    assert isinstance(trainer.teacher, CrossTokenizerTeacher)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "alignment/mapped" in e]
    assert len(logged) == 2
    for entry in logged:
        assert entry["alignment/mapped"] == 1.0 and 0.0 < entry["alignment/exact"] < 1.0
        assert entry["alignment/exact"] < entry["alignment/per_decision_exact"] <= 1.0  # chunks resolved too
        # every teacher token reaches a student token on this pair: what is left over is, inside a teacher token, the
        # mass of its tokens that end with the part written
        assert 0.0 < entry["alignment/leftover"] < 0.5
        assert torch.isfinite(torch.tensor(entry["loss"])) and entry["loss"] > 0
    samples = [json.loads(line) for line in (tmp_path / "statelens" / "states.jsonl").read_text().splitlines()]
    assert samples and all(len(s["teacher_exact"]) == len(s["logp"]) for s in samples)


def test_teacher_reads_the_students_text_when_asked(tmp_path, math_trained_path, other_teacher_path):
    """`teacher_reads_student_text`: the teacher of another tokenizer reads the student's prompt tokens decoded, the
    student's chat markup included, as GOLD's teacher does; by default it renders the conversation in its own chat
    template (here a plain `User:`/`Assistant:` layout, turns ended by the eos, saved with a copy of the teacher, so
    the two differ)."""
    teacher_copy = tmp_path / "teacher"
    shutil.copytree(other_teacher_path, teacher_copy)
    (teacher_copy / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}Assistant:{% endif %}"
    )
    data = load_gsm8k("lab", "train", prompt_format="chat", limit=8)
    rows = [dict(row) for row in data.select(range(2))]
    read = {}
    for as_text in (False, True):
        trainer = OnPolicyDistillTrainer(
            model=str(math_trained_path),
            teacher_model=str(teacher_copy),
            args=opd_config(tmp_path / str(as_text), teacher_reads_student_text=as_text),
            train_dataset=data,
            state_logging=False,
        )
        student_ids = [list(ids) for ids in trainer._tokenize_prompts([row["prompt"] for row in rows])[0]]
        read[as_text] = trainer.teacher.prompts(student_ids, rows)
        teacher_tokenizer = trainer.teacher.tokenizer
    student_text = [trainer._tokenizer.decode(ids) for ids in student_ids]
    assert read[True] == [teacher_tokenizer(text)["input_ids"] for text in student_text]
    own = [teacher_tokenizer.decode(ids) for ids in read[False]]
    assert all(text.startswith("User: ") and text.endswith("Assistant:") for text in own)
    assert all(text not in mine for text, mine in zip(student_text, own))


def test_reading_the_students_text_without_a_teacher_of_another_tokenizer_is_refused(
    tmp_path, math_trained_path, math_teacher_path, math_dataset
):
    with pytest.raises(ValueError, match="teacher_reads_student_text=True, but no teacher has another tokenizer"):
        OnPolicyDistillTrainer(
            model=str(math_trained_path),
            teacher_model=str(math_teacher_path),
            args=opd_config(tmp_path, teacher_reads_student_text=True),
            train_dataset=math_dataset,
        )
