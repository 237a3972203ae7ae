"""A teacher of another tokenizer that writes (`teachers/cross_tokenizer.py`): `signal="continuation"` and `teacher`
states. It reads the student's prefix in its own tokens, writes in its own tokens, and the student receives the same
text in the student's tokens, its end token as the student's; one tokenizer sent through this path writes exactly
what the direct path writes."""

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from launching import free_port, launch
from test_cross_tokenizer_teacher import opd_config as teacher_opd_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_statelens import OnPolicyDistillTrainer
from trl_statelens.lab.model import build_qwen3
from trl_statelens.teachers import CrossTokenizerTeacher, InProcessTeacher


def opd_config(tmp_path, **kwargs):
    """The cross-tokenizer tests' settings, writing: `continuation`, 16 tokens."""
    return teacher_opd_config(tmp_path, **{"max_completion_length": 16, "signal": "continuation", **kwargs})


def spelled(vocab, ids) -> bytes:
    """The text of `ids` in `vocab`'s bytes, special tokens left out."""
    return b"".join(vocab.token_bytes[i] for i in ids if vocab.token_bytes[i] is not None)


def student_prefixes(tokenizer, rows):
    """Each row's reference answer in the student's tokens, cut after 0, 3, 6, ... tokens (inside numbers too)."""
    answers = [tokenizer(" " + row["answer"], add_special_tokens=False)["input_ids"] for row in rows]
    return [answer[: 3 * i] for i, answer in enumerate(answers)]


def end_likelier(model, end_id: int, boost: float = 5.0):
    """A hook that makes `model` write `end_id` more often (a random-init one, with `boost` 5, about one time in five;
    it almost never does)."""

    def hook(module, inputs, logits):
        logits[..., end_id] += boost
        return logits

    return model.get_output_embeddings().register_forward_hook(hook)


def check_read_back(teacher, student_tokenizer, prompts, prefixes, sequences, teacher_rows, written, max_new_tokens):
    """What the teacher read (`sequences`: its prompt and the student's prefix in its tokens), what it wrote
    (`teacher_rows`, its own tokens) and what the student received (`written`), row by row: the same prefix text, the
    same continuation text (a prefix of it where the student's tokens of a text the teacher did not end were cut at
    `max_new_tokens`), the student's
    tokenizer's tokens of that text, and the student's end token where the teacher wrote its own. Returns how many
    rows were respelled to other ids, ended, and were cut."""
    student_vocab, teacher_vocab = teacher.student_vocab, teacher.teacher_vocab
    respelled = ended = cut = 0
    assert len(written) == len(teacher_rows) == len(prompts)
    for prompt, prefix, sequence, row, continuation in zip(prompts, prefixes, sequences, teacher_rows, written):
        assert sequence[: len(prompt)] == prompt
        assert spelled(teacher_vocab, sequence[len(prompt) :]) == spelled(student_vocab, prefix)
        respelled += sequence[len(prompt) :] != prefix
        ends = [j for j, token in enumerate(row) if token in teacher.teacher_ends]
        text = spelled(teacher_vocab, row[: ends[0]] if ends else row)
        received = spelled(student_vocab, continuation)
        if continuation and continuation[-1] in teacher.student_ends:  # the teacher ended its text here: kept whole
            assert ends and received == text
            assert continuation[-1] == teacher.student_specials[row[ends[0]]]
            ended += 1
        elif len(continuation) < max_new_tokens:  # the teacher's whole text, which it did not end
            assert len(continuation) <= max_new_tokens
            assert not ends and received == text
        else:  # cut to `max_new_tokens` of the student's tokens
            assert len(continuation) == max_new_tokens and text.startswith(received)
            cut += received != text
        body = [t for t in continuation if t not in teacher.student_ends]
        if all(student_vocab.token_bytes[t] is not None for t in body):
            try:  # where the text is whole UTF-8, the student's tokens are its tokenizer's of the text as one run
                tokens = student_tokenizer(text.decode("utf-8"), add_special_tokens=False)["input_ids"]
            except UnicodeDecodeError:
                continue
            assert body == tokens[: len(body)] and (len(body) == len(tokens) or len(continuation) == max_new_tokens)
    return respelled, ended, cut


def test_same_tokenizer_through_the_cross_tokenizer_path_writes_as_the_direct_path(
    tmp_path, math_trained_path, math_teacher_path, math_dataset, tokenizer
):
    """One teacher as an `InProcessTeacher` and behind `CrossTokenizerTeacher` with its own (the same) tokenizer:
    seeded alike, both write the same continuation ids, from student prefixes and from the prompt alone."""
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=str(math_teacher_path),
        args=opd_config(tmp_path),
        train_dataset=math_dataset,
    )
    direct = trainer.teacher
    assert type(direct) is InProcessTeacher
    cross = CrossTokenizerTeacher(trainer, direct.model, AutoTokenizer.from_pretrained(math_teacher_path))
    rows = [math_dataset[i] for i in range(6)]
    student_prompts = [tokenizer(row["prompt"])["input_ids"] for row in rows]
    prompts = cross.prompts(student_prompts, rows)
    assert prompts == student_prompts
    prefixes = student_prefixes(tokenizer, rows)
    assert [cross.respell(prefix) for prefix in prefixes] == prefixes
    end_likelier(trainer.accelerator.unwrap_model(direct.model), tokenizer.eos_token_id, boost=2.0)
    for row_prefixes in (prefixes, None):
        torch.manual_seed(0)
        expected = direct.generate(prompts, 24, row_prefixes)
        torch.manual_seed(0)
        assert cross.generate(prompts, 24, row_prefixes) == expected
        ends = [c[-1] in trainer.eos_token_ids for c in expected]
        assert all(expected) and any(ends) and not all(ends)  # what ran: texts that end and texts cut at 24


def test_teacher_of_another_tokenizer_writes_text_the_student_receives_byte_for_byte(
    tmp_path, math_trained_path, other_teacher_path, math_dataset, tokenizer, monkeypatch, caplog
):
    """The teacher keeps numbers whole, the student writes one digit a token: the teacher reads each student prefix in
    its own tokens, and what it writes reaches the student as the same bytes, in the student's tokenizer's tokens,
    ending with the student's end token where the teacher wrote its own, at most `max_new_tokens` long."""
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=str(other_teacher_path),
        args=opd_config(tmp_path),
        train_dataset=math_dataset,
    )
    teacher = trainer.teacher
    assert isinstance(teacher, CrossTokenizerTeacher)
    teacher_end = teacher.tokenizer.eos_token_id
    # it stops at its tokens that stand for the student's ends (the lab's end of text and of turn), read back as those
    assert len(trainer.eos_token_ids) == 2 and teacher_end in teacher.teacher_ends
    assert teacher.teacher_ends == sorted(teacher.specials[end] for end in trainer.eos_token_ids)
    assert all(teacher.student_specials[teacher.specials[end]] == end for end in trainer.eos_token_ids)
    recorded, write = [], teacher._written

    def written(sequences, *args):
        rows = write(sequences, *args)
        recorded.append((sequences, rows))
        return rows

    monkeypatch.setattr(teacher, "_written", written)
    rows = [math_dataset[i] for i in range(8)]
    prompts = teacher.prompts([tokenizer(row["prompt"])["input_ids"] for row in rows], rows)
    prefixes = student_prefixes(tokenizer, rows)
    hook = end_likelier(trainer.accelerator.unwrap_model(teacher.model), teacher_end, boost=3.0)
    torch.manual_seed(0)
    continuations = teacher.generate(prompts, 10, prefixes)
    hook.remove()
    ((sequences, teacher_rows),) = recorded
    respelled, ended, cut = check_read_back(
        teacher, tokenizer, prompts, prefixes, sequences, teacher_rows, continuations, 10
    )
    assert respelled and ended and cut  # what ran: prefixes in other ids, ends carried back, texts cut to 10 tokens
    # Without prefixes (`teacher` states), from the prompt alone
    torch.manual_seed(1)
    alone = teacher.generate(prompts, 10)
    assert check_read_back(teacher, tokenizer, prompts, [[]] * 8, *recorded[-1], alone, 10)[0] == 0
    # A token the student cannot read (here an id past the teacher's tokenizer) ends the text before it
    text = teacher.tokenizer(" 12 apples", add_special_tokens=False)["input_ids"]
    with caplog.at_level(logging.WARNING):
        got = teacher.student_continuation(text + [len(teacher.teacher_vocab)] + text, 20)
    assert got == tokenizer(" 12 apples", add_special_tokens=False)["input_ids"] and "no counterpart" in caplog.text


def test_a_teacher_of_another_tokenizer_in_the_process_never_writes_what_the_student_cannot_read(
    tmp_path, math_trained_path, other_teacher_path, math_dataset, tokenizer, monkeypatch
):
    """A teacher whose output layer has rows past its tokenizer (ids no token spells), drawn to them: it is kept from
    writing them, as a same-tokenizer teacher is kept from its padding rows, and writes text the student reads."""
    other_tokenizer = AutoTokenizer.from_pretrained(other_teacher_path)
    padded, width = tmp_path / "padded-teacher", len(other_tokenizer) + 20
    build_qwen3(other_tokenizer, 64, 2, 128, vocab_size=width, seed=3).save_pretrained(padded)
    other_tokenizer.save_pretrained(padded)
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=str(padded),
        args=opd_config(tmp_path),
        train_dataset=math_dataset,
    )
    teacher = trainer.teacher
    assert isinstance(teacher, CrossTokenizerTeacher)
    assert teacher.unreadable == list(range(len(teacher.teacher_vocab), width))
    recorded, write = [], teacher._written
    monkeypatch.setattr(teacher, "_written", lambda *args: recorded.append(write(*args)) or recorded[-1])

    def padding_first(module, inputs, logits):  # a teacher that would pick its padding rows if it could
        logits[..., len(teacher.teacher_vocab) :] += 1e4
        return logits

    teacher_model = trainer.accelerator.unwrap_model(teacher.model)
    hook = teacher_model.get_output_embeddings().register_forward_hook(padding_first)
    rows = [math_dataset[i] for i in range(4)]
    prompts = teacher.prompts([tokenizer(row["prompt"])["input_ids"] for row in rows], rows)
    continuations = teacher.generate(prompts, 6)
    hook.remove()
    assert all(max(row) < len(teacher.teacher_vocab) for row in recorded[0]) and all(continuations)


@pytest.mark.parametrize("signal", ["continuation", "reverse_kl"])
def test_teacher_of_another_tokenizer_trains_on_its_own_writing(
    tmp_path, math_trained_path, other_teacher_path, math_dataset, signal
):
    """A short run with the other tokenizer's teacher writing: `teacher` states in `state_source_mix`, and with
    `continuation` its continuations of the student's prefixes. It writes, trains and logs the alignment."""
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=str(other_teacher_path),
        args=opd_config(tmp_path, max_steps=2, signal=signal, state_source_mix={"learner": 0.5, "teacher": 0.5}),
        train_dataset=math_dataset,
    )
    teacher = trainer.teacher
    assert isinstance(teacher, CrossTokenizerTeacher)
    calls, generate = [], teacher.generate

    def counted(prompts, max_new_tokens, prefixes=None, teachers=None):
        written = generate(prompts, max_new_tokens, prefixes, teachers)
        calls.append((prefixes is not None, len(written), sum(map(len, written))))
        return written

    teacher.generate = counted
    trainer.train()
    assert any(not continues and rows and tokens for continues, rows, tokens in calls)  # teacher states written
    if signal == "continuation":
        assert any(continues and tokens for continues, rows, tokens in calls)
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 2 and all(torch.isfinite(torch.tensor(e["loss"])) for e in logged)
    assert all(0.0 < e["alignment/exact"] <= 1.0 for e in logged)
    before = dict(AutoModelForCausalLM.from_pretrained(math_trained_path).named_parameters())
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_a_served_teacher_of_another_tokenizer_writes_text_the_student_receives_byte_for_byte(
    tmp_path, math_trained_path, other_teacher_path, math_dataset, tokenizer
):
    """The same teacher behind a (test) vLLM server: its continuations stop at its end token and reach the student as
    the same text in the student's tokens, with the student's end token; a `continuation` step trains."""
    from vllm_test_server import TestTeacherServer

    from trl_statelens.teachers import ServedCrossTokenizerTeacher

    with TestTeacherServer(other_teacher_path) as server:
        trainer = OnPolicyDistillTrainer(
            model=str(math_trained_path),
            teacher_model=str(other_teacher_path),
            args=opd_config(tmp_path, teacher_model_server_url=server.url),
            train_dataset=math_dataset,
        )
        served = trainer.teacher
        assert isinstance(served, ServedCrossTokenizerTeacher)
        recorded, continuations_of = [], served._continuations

        def asked(sequences, max_new_tokens, eos_token_ids=None):
            rows = continuations_of(sequences, max_new_tokens, eos_token_ids)
            recorded.append((sequences, rows))
            return rows

        served._continuations = asked
        rows = [math_dataset[i] for i in range(8)]
        prompts = served.prompts([tokenizer(row["prompt"])["input_ids"] for row in rows], rows)
        prefixes = student_prefixes(tokenizer, rows)
        hook = end_likelier(server.model, served.tokenizer.eos_token_id)
        written = served.generate(prompts, 10, prefixes)
        hook.remove()
        ((sequences, teacher_rows),) = recorded
        respelled, ended, _ = check_read_back(
            served, tokenizer, prompts, prefixes, sequences, teacher_rows, written, 10
        )
        assert respelled and ended
        trainer.train()
    assert [e["alignment/exact"] for e in trainer.state.log_history if "loss" in e]


@pytest.mark.multiproc
@pytest.mark.slow
def test_routed_teachers_of_two_tokenizers_write_on_two_ranks(
    tmp_path, math_trained_path, math_teacher_path, other_teacher_path
):
    """A router with a teacher of the student's tokenizer and one of another, on two DDP ranks, with `continuation`
    and `teacher` states: each teacher writes on every rank while any rank has rows of it (a rank without rows of it
    joins on a stand-in row), so a step where one rank holds only one teacher's rows still runs, and training goes on."""
    accelerate = Path(sys.executable).parent / "accelerate"
    settings = {
        "signal": "continuation",
        "continuation_length": 6,
        "state_source_mix": {"learner": 0.5, "teacher": 0.5},
    }
    command = [
        str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        str(Path(__file__).parent / "scripts" / "opd_cross_tokenizer_two_ranks.py"), str(math_trained_path),
        str(other_teacher_path), str(tmp_path), str(math_teacher_path), json.dumps(settings),
    ]  # fmt: skip
    launch(command, {"TOKENIZERS_PARALLELISM": "false"}, timeout=300, outputs=tmp_path)
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for rank in ranks:
        assert (rank["world_size"], rank["backend"], rank["teacher"]) == (2, "gloo", "TeacherRouter")
        assert len(rank["counts"]) == 2
    # what ran: at some step the ranks held different teachers' rows
    assert any({*ranks[0]["teachers"][s]} != {*ranks[1]["teachers"][s]} for s in range(2))
    logged = [e for e in ranks[0]["log_history"] if "loss" in e]
    assert len(logged) == 2 and all(torch.isfinite(torch.tensor(e["loss"])) for e in logged)


def test_a_teacher_of_another_tokenizer_keeps_its_end_and_counts_its_own_tokens_written(
    tmp_path, student_path, other_teacher_path, math_dataset, tokenizer, monkeypatch
):
    """The teacher keeps numbers whole, the student writes one digit a token: an answer the teacher ended within its
    `max_new_tokens` tokens takes the student more, and keeps its end token (cut to `max_new_tokens` student tokens
    it would train as unfinished); one it did not end is cut there. The ledger's `teacher_written_tokens` counts the
    tokens the teacher wrote `teacher` states in, its own, not the student's they were given back as."""
    args = opd_config(
        tmp_path, signal="reverse_kl", state_source_mix={"learner": 0.5, "teacher": 0.5}, per_device_train_batch_size=8
    )
    trainer = OnPolicyDistillTrainer(
        model=str(student_path), teacher_model=str(other_teacher_path), args=args, train_dataset=math_dataset
    )
    teacher = trainer.teacher
    end = teacher.tokenizer.eos_token_id
    answer = " 3 + 4 = 7\n#### 1234567"
    written = teacher.tokenizer(answer, add_special_tokens=False)["input_ids"] + [end]
    received = tokenizer(answer, add_special_tokens=False)["input_ids"]
    assert len(received) + 1 > len(written)  # more tokens for the student
    assert teacher.student_continuation(written, len(written)) == received + [teacher.student_specials[end]]
    assert teacher.student_continuation(written[:-1], len(written)) == received[: len(written)]  # not ended: cut

    end_likelier(trainer.accelerator.unwrap_model(teacher.model), end, boost=3.0)  # texts it ends, counted apart
    recorded, write = [], teacher._written
    monkeypatch.setattr(teacher, "_written", lambda *a: recorded.append(write(*a)) or recorded[-1])
    given_back, generate = [], teacher.generate
    monkeypatch.setattr(teacher, "generate", lambda *a, **k: given_back.append(generate(*a, **k)) or given_back[-1])
    trainer.train()
    (line,) = [json.loads(x) for x in (tmp_path / "statelens" / "steps.jsonl").read_text().splitlines()]

    def own(row):  # the teacher's tokens up to its first end
        ends = [j for j, token in enumerate(row) if token in teacher.teacher_ends]
        return ends[0] + 1 if ends else len(row)

    own_tokens = sum(own(row) for rows in recorded for row in rows)
    student_tokens = sum(len(row) for rows in given_back for row in rows)
    assert own_tokens and own_tokens != student_tokens
    assert line["teacher_written_tokens"] == own_tokens
