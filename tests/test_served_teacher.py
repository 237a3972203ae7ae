"""The served teacher (`TeacherServerClient`, `ServedTeacher`) against `tests/vllm_test_server.py`, a CPU stand-in for
`vllm serve` speaking vLLM's wire format."""

import json
import os
import runpy
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from cpu_settings import CPU
from launching import free_port, launch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import ModelConfig
from vllm_test_server import TestTeacherServer

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLoggingCallback, collective
from trl_statelens.lens.records import source_code
from trl_statelens.teachers import TeacherServerClient, TeacherServerError

TWO_RANKS = Path(__file__).parent / "scripts" / "served_teacher_two_ranks.py"


@pytest.fixture(scope="module")
def teacher_server(teacher_path):
    with TestTeacherServer(teacher_path) as server:
        yield server


@pytest.fixture(scope="module")
def teacher(teacher_path):
    return AutoModelForCausalLM.from_pretrained(teacher_path).eval()


def served(url, tokenizer, **kwargs):
    kwargs = {"timeout": 5.0, "retry_backoff": 0.01, **kwargs}
    return TeacherServerClient(url, tokenizer, len(tokenizer), **kwargs)


def _sequences(tokenizer):
    texts = ["Question: 3 + 4 = ? Answer: 7", "The capital of the lab is", "12 * 3 is 36, so"]
    return [tokenizer(t)["input_ids"] for t in texts], [4, 2, 5]


def test_logps_are_the_teachers_exact_log_probs(teacher_server, teacher, tokenizer):
    sequences, starts = _sequences(tokenizer)
    logps = served(teacher_server.url, tokenizer, chunk_size=2).logps(sequences, starts)
    for row, sequence, start in zip(logps, sequences, starts):
        with torch.no_grad():
            expected = teacher(torch.tensor([sequence])).logits[0, :-1].float().log_softmax(-1)
        expected = expected[torch.arange(len(sequence) - 1), torch.tensor(sequence[1:])][start - 1 :]
        torch.testing.assert_close(torch.tensor(row), expected, atol=1e-5, rtol=1e-5)
    assert served(teacher_server.url, tokenizer).logps([], []) == []


def test_greedy_continuations_are_the_teachers_from_each_prefix(teacher_server, teacher, tokenizer):
    prefixes, _ = _sequences(tokenizer)
    eos = [tokenizer.eos_token_id]
    continuations = served(teacher_server.url, tokenizer).generate(prefixes, 6, eos, temperature=0.0)
    for prefix, continuation in zip(prefixes, continuations):
        out = teacher.generate(torch.tensor([prefix]), max_new_tokens=6, do_sample=False, eos_token_id=eos)
        expected = out[0, len(prefix) :].tolist()
        assert continuation == (expected[: expected.index(eos[0]) + 1] if eos[0] in expected else expected)


def test_sampled_continuations_follow_the_seed_and_stop_at_eos(teacher_server, tokenizer):
    client = served(teacher_server.url, tokenizer)
    prefixes, _ = _sequences(tokenizer)
    first = client.generate(prefixes, 8, [tokenizer.eos_token_id], top_k=20, seeds=[3, 4, 5])
    assert first == client.generate(prefixes, 8, [tokenizer.eos_token_id], top_k=20, seeds=[3, 4, 5])
    assert all(1 <= len(c) <= 8 for c in first)
    # An eos id the server does not stop at still ends the continuation, where the student's eos is
    stop = first[0][1]
    cut = client.generate(prefixes[:1], 8, [stop], top_k=20, seeds=[3])[0]
    assert cut == first[0][: first[0].index(stop) + 1]


def test_the_server_seeds_every_prompt_of_a_request_alike_as_vllm(teacher_server, tokenizer):
    """vLLM gives each prompt of a request a generator seeded with the request's `seed`: identical prompts sample
    identically, and sample j of `n` uses `seed + j`. Unseeded, every prompt draws its own noise."""
    client = served(teacher_server.url, tokenizer).client
    prompt = _sequences(tokenizer)[0][0]
    seeded = client.generate([prompt] * 3, max_tokens=12, generation_kwargs={"seed": 7})["completion_ids"]
    assert seeded[0] == seeded[1] == seeded[2]
    pairs = client.generate([prompt], n=2, max_tokens=12, generation_kwargs={"seed": 7})["completion_ids"]
    assert pairs[0] == seeded[0] and pairs[1] != pairs[0]
    assert pairs[1] == client.generate([prompt], max_tokens=12, generation_kwargs={"seed": 8})["completion_ids"][0]
    unseeded = client.generate([prompt] * 3, max_tokens=12)["completion_ids"]
    assert len({tuple(row) for row in unseeded}) == 3


def test_identical_prefixes_get_their_own_teacher_samples(teacher_server, tokenizer):
    client = served(teacher_server.url, tokenizer)
    prefix = _sequences(tokenizer)[0][0]
    eos = [tokenizer.eos_token_id]
    rows = client.generate([prefix] * 4, 12, eos, seeds=[11, 12, 13, 14])
    assert len({tuple(row) for row in rows}) == 4
    assert rows == client.generate([prefix] * 4, 12, eos, seeds=[11, 12, 13, 14])
    assert rows[1] == client.generate([prefix], 12, eos, seeds=[12])[0]  # a row's sample is its seed's alone


def test_unreachable_server_fails_fast_with_a_clear_error(tokenizer):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there once the probe socket closed
    with pytest.raises(TeacherServerError, match=r"not usable after 1s: cannot connect.*vllm serve"):
        served(url, tokenizer, timeout=1.0)


def test_served_vocabulary_must_hold_the_students_ids(teacher_path, tokenizer):
    with TestTeacherServer(teacher_path, vocab_size=len(tokenizer) - 8) as server:
        with pytest.raises(TeacherServerError, match="id 1023 is out of its vocabulary"):
            served(server.url, tokenizer)


def test_a_teacher_padded_past_the_students_vocabulary_scores_and_writes_student_ids(teacher_path, tokenizer, caplog):
    """An output layer padded further than the student's (same tokenizer; Qwen2.5-7B over 0.5B): the student's ids
    are scored under the teacher's whole softmax, and a continuation ends before any id past the student's."""
    sequences, starts = _sequences(tokenizer)
    with TestTeacherServer(teacher_path, vocab_size=len(tokenizer) + 64) as server:
        client = served(server.url, tokenizer)
        padded = server.model
        logps = client.logps(sequences, starts)
        for row, sequence, start in zip(logps, sequences, starts):
            with torch.no_grad():
                expected = padded(torch.tensor([sequence])).logits[0, :-1].float().log_softmax(-1)  # 1088 columns
            expected = expected[torch.arange(len(sequence) - 1), torch.tensor(sequence[1:])][start - 1 :]
            torch.testing.assert_close(torch.tensor(row), expected, atol=1e-5, rtol=1e-5)
        # what the server wrote, with a padding id in the first row: the continuation ends before it
        written = {"completion_ids": [[11, len(tokenizer) + 3, 12], [13, 14]], "prompt_ids": None, "logprobs": None}
        client.client.generate = lambda *args, **kwargs: written
        with caplog.at_level("WARNING"):
            assert client.generate(sequences[:2], 3, [tokenizer.eos_token_id]) == [[11], [13, 14]]
        assert "wrote id 1027, past the student's vocabulary (1024 ids)" in caplog.text


def test_teacher_tokenizer_must_map_tokens_like_the_students(teacher_server, tokenizer, tokenizer_path, tmp_path):
    served(teacher_server.url, tokenizer, teacher_tokenizer=str(tokenizer_path))  # the same tokenizer passes
    other = AutoTokenizer.from_pretrained(tokenizer_path)
    other.add_tokens(["<|tool|>"])  # same size of output layer on the server, one more token in the tokenizer
    with pytest.raises(TeacherServerError, match="maps tokens to ids differently"):
        served(teacher_server.url, tokenizer, teacher_tokenizer=other)


def test_a_server_at_vllms_default_log_prob_cap_serves_training(teacher_path, tokenizer):
    """Training asks for the actual token's log-prob only (prompt_logprobs=0), the start-up probe too: no
    --max-logprobs flag is needed."""
    sequences, starts = _sequences(tokenizer)
    with TestTeacherServer(teacher_path, max_logprobs=20) as server:  # vLLM's default cap
        client = served(server.url, tokenizer)
        assert [len(row) for row in client.logps(sequences, starts)] == [len(s) - n for s, n in zip(sequences, starts)]
        assert all(0 < len(c) <= 4 for c in client.generate(sequences, 4, [tokenizer.eos_token_id]))


def test_transient_failures_are_retried_then_reported(teacher_path, tokenizer):
    sequences, starts = _sequences(tokenizer)
    # The probe is request 1; the next two scoring requests fail with 503 and the third attempt succeeds
    with TestTeacherServer(teacher_path, fail_after=1, fail_times=2) as server:
        client = served(server.url, tokenizer, max_retries=2)
        logps = client.logps(sequences, starts)
        assert client.retries == 2 and server.failed == 2
        assert [len(row) for row in logps] == [len(s) - start for s, start in zip(sequences, starts)]
    with TestTeacherServer(teacher_path, fail_after=1) as server:  # fails from then on
        client = served(server.url, tokenizer, max_retries=2)
        with pytest.raises(TeacherServerError, match=r"failed scoring 3 times in a row \(last: HTTP 503.*checkpoint"):
            client.logps(sequences, starts)
        assert server.failed == 3


def test_requests_the_server_rejects_are_not_retried(teacher_server, tokenizer):
    client = served(teacher_server.url, tokenizer)
    before = teacher_server.requests
    with pytest.raises(TeacherServerError, match=r"rejected generation: HTTP 400.*maximum context length"):
        client.generate([[1, 2, 3]], teacher_server.max_model_len, [tokenizer.eos_token_id])
    assert teacher_server.requests == before + 1 and client.retries == 0


# ----- OnPolicyDistillTrainer with teacher_model_server_url -----------------------------------------------------------
def opd_config(tmp_path, **kwargs):
    defaults = dict(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=8,
        num_generations=2,
        max_completion_length=16,
        learning_rate=1e-3,
    )
    if kwargs.get("teacher_model_server_url"):  # quick retries against the test server (read by served teachers only)
        defaults["teacher_server_retry_backoff"] = 0.01
    defaults["preflight"] = (
        "off"  # these tests count training's own teacher calls and forwards; the preflight's are tested in test_preflight.py
    )
    return OnPolicyDistillConfig(**{**defaults, **CPU, **kwargs})


def log_history(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def spy_batches(trainer):
    """The batches the trainer makes, with their teacher log-probs waited for (a served teacher's arrive later)."""
    batches = []
    original = trainer._generate_and_score_completions

    def spy(inputs):
        output = original(inputs)
        batches.append({**output, "teacher_logps": trainer._resolve_teacher_logps(output)})
        return output

    trainer._generate_and_score_completions = spy
    return batches


def test_reverse_kl_through_the_server_matches_the_in_process_teacher(
    tmp_path, teacher_server, student_path, teacher_path, math_dataset
):
    runs = {}
    for name, teacher, kwargs in (
        ("local", str(teacher_path), {}),
        ("served", None, {"teacher_model_server_url": teacher_server.url}),
    ):
        trainer = OnPolicyDistillTrainer(
            model=str(student_path),
            teacher_model=teacher,
            args=opd_config(tmp_path / name, **kwargs),
            train_dataset=math_dataset,
            callbacks=[StateLoggingCallback()],
        )
        batches = spy_batches(trainer)
        trainer.train()
        runs[name] = (trainer, batches[0])
    (local, local_batch), (served_trainer, served_batch) = runs["local"], runs["served"]
    assert served_trainer.teacher_model is None  # no teacher weights in the training process
    assert torch.equal(local_batch["completion_ids"], served_batch["completion_ids"])  # the same rollouts
    mask = local_batch["completion_mask"].bool()
    assert mask.sum() > 50
    torch.testing.assert_close(served_batch["teacher_logps"], local_batch["teacher_logps"], atol=1e-5, rtol=1e-5)
    for key in ("loss", "teacher_kl/sampled", "teacher_nll", "grad_norm"):
        assert log_history(served_trainer, key) == pytest.approx(log_history(local, key), rel=1e-4, abs=1e-6), key
    ledgers = [read_jsonl(tmp_path / name / "statelens" / "steps.jsonl") for name in ("local", "served")]
    assert ledgers[1][0]["teacher_kl/supervised"] == pytest.approx(
        ledgers[0][0]["teacher_kl/supervised"], rel=1e-4, abs=1e-6
    )


def spy_scoring(trainer):
    """The thread each scoring request ran on, and the teacher log-probs each micro-batch's loss read."""
    threads, resolved = [], []
    logps, resolve = trainer.teacher.server.logps, trainer._resolve_teacher_logps

    def spy_logps(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return logps(*args, **kwargs)

    def spy_resolve(inputs):
        resolved.append(resolve(inputs))
        return resolved[-1]

    trainer.teacher.server.logps, trainer._resolve_teacher_logps = spy_logps, spy_resolve
    return threads, resolved


@pytest.mark.parametrize("signal", ["reverse_kl", "continuation"])
def test_overlapped_scoring_gives_the_same_teacher_logps_and_loss(
    tmp_path, teacher_server, student_path, math_dataset, signal
):
    runs = {}
    for overlap in (True, False):
        trainer = OnPolicyDistillTrainer(
            model=str(student_path),
            args=opd_config(
                tmp_path / str(overlap),
                teacher_model_server_url=teacher_server.url,
                teacher_server_overlap=overlap,
                signal=signal,
                **({"continuation_length": 4} if signal == "continuation" else {}),
                max_steps=2,
                gradient_accumulation_steps=2,  # two micro-batches per generation: shuffled and split with the batch
            ),
            train_dataset=math_dataset,
        )
        threads, resolved = spy_scoring(trainer)
        trainer.train()
        runs[overlap] = threads, resolved, log_history(trainer, "loss"), log_history(trainer, "grad_norm")
    (threads_on, resolved_on, loss_on, grad_on), (threads_off, resolved_off, loss_off, grad_off) = (
        runs[True],
        runs[False],
    )
    assert threads_on == ["teacher-server"] * 2 and threads_off == ["MainThread"] * 2  # one request per generation
    assert len(resolved_on) == len(resolved_off) == 4
    for on, off in zip(resolved_on, resolved_off):
        assert (on != 0).sum() > 20 and torch.equal(on, off)  # bit for bit, in the same shuffled order
    assert len(loss_on) == 2 and loss_on == loss_off and grad_on == grad_off


@pytest.mark.parametrize(
    "status, message", [(503, "failed scoring 2 times in a row"), (400, "rejected scoring: HTTP 400: .*EngineCore")]
)
def test_a_failed_background_request_stops_training_before_the_update(
    tmp_path, teacher_path, student_path, math_dataset, status, message
):
    # the vocabulary probe passes; every scoring request after it fails (503 is retried once, 400 is not)
    with TestTeacherServer(teacher_path, fail_after=1, fail_status=status) as server:
        trainer = OnPolicyDistillTrainer(
            model=str(student_path),
            args=opd_config(tmp_path, teacher_model_server_url=server.url, teacher_server_max_retries=1),
            train_dataset=math_dataset,
        )
        start = [p.detach().clone() for p in trainer.model.parameters()]
        threads, resolved = spy_scoring(trainer)
        with pytest.raises(TeacherServerError, match=message):
            trainer.train()
        assert server.failed == (2 if status == 503 else 1)
    assert threads == ["teacher-server"] and resolved == []  # it failed in the background, raised in the loss
    assert all(torch.equal(a, b) for a, b in zip(start, trainer.model.parameters()))


@pytest.mark.slow
def test_a_crash_with_a_request_in_flight_exits_at_once(tmp_path, student_path, teacher_path):
    """The step's scoring request waits on a one-minute answer when the reward function raises: the process exits
    within seconds, not once the request is answered (or has timed out, retries included)."""
    script = Path(__file__).parent / "scripts" / "served_teacher_crash.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(script), str(student_path), str(teacher_path), str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    exited = time.time()
    assert result.returncode != 0 and "ZeroDivisionError: a bug in the reward function" in result.stderr
    crashed = float(result.stdout.split("crashed ")[1].split()[0])
    assert exited - crashed < 15.0  # the answer would have come after 60 s


@pytest.mark.slow
def test_continuation_and_teacher_states_train_through_the_server(
    tmp_path, teacher_server, student_path, math_dataset
):
    before = teacher_server.requests
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=None,
        args=opd_config(
            tmp_path,
            teacher_model_server_url=teacher_server.url,
            max_steps=2,
            signal="continuation",
            continuation_length=6,
            state_source_mix={"learner": 0.5, "teacher": 0.5},
        ),
        train_dataset=math_dataset,
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
    )
    start = [p.detach().clone() for p in trainer.model.parameters()]
    batches = spy_batches(trainer)
    trainer.train()
    # the vocabulary probe, then per step: a request per teacher rollout and per continuation (each row has its own
    # seed), and one scoring request
    teacher_rows = sum(int((batch["row_source"] == source_code("teacher")).sum()) for batch in batches)
    assert teacher_server.requests - before == 1 + teacher_rows + 2 * (8 + 1)
    for batch in batches:
        continuation = batch["loss_mask"].sum(1)
        assert (continuation >= 1).all() and (continuation <= 6).all()
    assert all(torch.isfinite(torch.tensor(log_history(trainer, "loss"))))
    assert any(not torch.equal(a, b) for a, b in zip(start, trainer.model.parameters()))
    states = read_jsonl(tmp_path / "statelens" / "states.jsonl")
    assert {s["source"] for s in states} == {"learner", "teacher"}


def test_teacher_rows_and_continuations_of_one_prefix_are_sampled_apart_and_reproducibly(
    tmp_path, teacher_server, student_path, math_dataset
):
    """A prompt's teacher rows (num_generations of them) share their prefix, the prompt: each gets its own teacher
    sample. So do identical continuation prefixes. The same run seed gives the same samples."""

    def trainer(name):
        return OnPolicyDistillTrainer(
            model=str(student_path),
            args=opd_config(
                tmp_path / name, teacher_model_server_url=teacher_server.url, state_source_mix={"teacher": 1.0}
            ),
            train_dataset=math_dataset,
            state_logging=False,
        )

    runs = []
    for name in ("first", "again"):
        opd = trainer(name)
        batches = spy_batches(opd)
        opd.train()
        prefix = opd._tokenizer(math_dataset[0]["prompt"])["input_ids"]
        runs.append((batches[0]["completion_ids"].tolist(), opd.teacher.generate([prefix] * 4, 8)))
    rows, continuations = runs[0]
    # GRPO repeats each prompt num_generations=2 times in a row: rows 2i and 2i+1 are one prompt's
    assert all(rows[i] != rows[i + 1] for i in range(0, len(rows), 2)), rows
    assert len({tuple(c) for c in continuations}) == 4
    assert runs[1] == runs[0]


# ----- the teacher seam: one batch, either teacher ------------------------------------------------------------------
def _loss_and_grads(trainer, batch):
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]


@pytest.mark.parametrize(
    "signal, jsd_beta",
    [("reverse_kl", 1.0), ("continuation", 1.0), ("divergence", 1.0), ("divergence", 0.5), ("divergence", 0.0)],
)
def test_in_process_and_served_teachers_give_equal_logps_and_losses_on_one_batch(
    tmp_path, teacher_server, student_path, teacher_path, tokenizer, math_dataset, signal, jsd_beta
):
    """The same batch scored by each teacher kind: equal teacher log-probs, and equal losses and gradients. With
    `divergence` the served teacher's top-k covers the whole vocabulary (k = V): its top-k plus tail estimator is then
    the exact full-vocabulary divergence the in-process teacher computes."""
    kwargs = dict(signal=signal, jsd_beta=jsd_beta) if signal == "divergence" else dict(signal=signal)
    if signal == "continuation":
        kwargs["continuation_length"] = 4
    top_k = {"teacher_top_k": len(tokenizer)} if signal == "divergence" else {}  # read by a served teacher only
    local, served_ = (
        OnPolicyDistillTrainer(
            model=str(student_path),
            teacher_model=teacher,
            args=opd_config(tmp_path / name, **kwargs, **server),
            train_dataset=math_dataset,
            state_logging=False,
        )
        for name, teacher, server in (
            ("local", str(teacher_path), {}),
            ("served", None, {"teacher_model_server_url": teacher_server.url, **top_k}),
        )
    )
    for trainer in (local, served_):
        trainer.model.train()
    batch = local._generate_and_score_completions([math_dataset[i] for i in range(4)] * 2)
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"])]
    lengths = batch["completion_mask"].sum(1).tolist()
    completions = [ids[:n].tolist() for ids, n in zip(batch["completion_ids"], lengths)]
    rows = {name: t.teacher.score(prompts, completions) for name, t in (("local", local), ("served", served_))}
    logps = {name: local._resolve_teacher_logps({**batch, "teacher_scores": r}) for name, r in rows.items()}
    assert (logps["local"] != 0).sum() > 30
    torch.testing.assert_close(logps["served"], logps["local"], atol=1e-5, rtol=1e-5)

    if signal == "divergence":  # what `_generate` asks for: nothing ahead in-process, the top-k from the server
        rows = {
            name: t.teacher.score(prompts, completions, True) for name, t in (("local", local), ("served", served_))
        }
        assert rows["local"] is None and len(rows["served"]) == 8
    (local_loss, local_grads), (served_loss, served_grads) = (
        _loss_and_grads(trainer, {**batch, "teacher_scores": rows[name]})
        for name, trainer in (("local", local), ("served", served_))
    )
    assert local_loss.abs() > 1e-3
    torch.testing.assert_close(served_loss, local_loss, atol=1e-6, rtol=1e-5)
    assert len(served_grads) == len(local_grads) > 0
    for served_grad, local_grad in zip(served_grads, local_grads):
        torch.testing.assert_close(served_grad, local_grad, atol=1e-6, rtol=1e-4)
    metrics = [t._metrics["train"]["teacher_kl/sampled"] for t in (local, served_)]
    assert metrics[1] == pytest.approx(metrics[0], rel=1e-4, abs=1e-6)


# ----- divergence from a served teacher: its top-k log-probs plus a tail bucket ---------------------------------------
def test_top_logps_are_the_teachers_top_k_by_position(teacher_server, teacher, tokenizer):
    sequences, starts = _sequences(tokenizer)
    rows = served(teacher_server.url, tokenizer).top_logps(sequences, starts, 5)
    for row, sequence, start in zip(rows, sequences, starts):
        with torch.no_grad():
            expected = teacher(torch.tensor([sequence])).logits[0, start - 1 : -1].float().log_softmax(-1)
        values, ids = expected.topk(5, dim=-1)
        assert torch.equal(torch.tensor(row["logprob_token_ids"]), ids)
        torch.testing.assert_close(torch.tensor(row["logprobs"]), values, atol=1e-5, rtol=1e-5)
        actual = expected.gather(-1, torch.tensor(sequence[start:])[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(row["actual_logprobs"]), actual, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_top_k_tail_divergence_is_the_generalised_jsd_on_k_plus_one_categories(tokenizer, beta):
    from trl_statelens.heads import topk_tail_divergence
    from trl_statelens.lab import build_model

    torch.manual_seed(0)
    student = build_model("test", tokenizer)
    hidden = torch.randn(2, 3, student.config.hidden_size, requires_grad=True)
    teacher = torch.randn(2, 3, len(tokenizer)).mul(3).log_softmax(-1)
    top_logps, top_ids = teacher.topk(4, dim=-1)
    top_logps[0, 1, 3] = float("-inf")  # an answer with 3 tokens only at one position: padded, absent
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss = topk_tail_divergence(student, hidden, top_ids, top_logps, mask, beta, normalizer=5.0)

    expected = 0.0
    log_s = student.get_output_embeddings()(hidden).double().log_softmax(-1)
    for b, t in mask.nonzero().tolist():
        present = torch.isfinite(top_logps[b, t])
        ids = top_ids[b, t][present]
        p_t = torch.cat([top_logps[b, t][present].double().exp(), torch.zeros(1)])
        p_t[-1] = 1 - p_t[:-1].sum()
        p_s = log_s[b, t].exp()[ids]
        p_s = torch.cat([p_s, 1 - p_s.sum()[None]])
        if beta == 0.0:
            expected = expected + (p_t * (p_t / p_s).log()).sum()
        elif beta == 1.0:
            expected = expected + (p_s * (p_s / p_t).log()).sum()
        else:
            m = (1 - beta) * p_s + beta * p_t
            expected = expected + beta * (p_t * (p_t / m).log()).sum() + (1 - beta) * (p_s * (p_s / m).log()).sum()
    expected = expected / 5.0
    torch.testing.assert_close(loss.double(), expected, atol=1e-6, rtol=1e-5)
    (grad,) = torch.autograd.grad(loss, hidden)
    (expected_grad,) = torch.autograd.grad(expected, hidden)
    torch.testing.assert_close(grad, expected_grad.float(), atol=1e-6, rtol=1e-4)
    assert grad[1, 2].abs().sum() == 0  # an unsupervised position


def test_divergence_trains_through_the_server_on_the_teachers_top_k(
    tmp_path, teacher_server, student_path, math_dataset
):
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        args=opd_config(
            tmp_path, teacher_model_server_url=teacher_server.url, signal="divergence", teacher_top_k=8, max_steps=2
        ),
        train_dataset=math_dataset,
        callbacks=[StateLoggingCallback()],
    )
    start = [p.detach().clone() for p in trainer.model.parameters()]
    asked = []
    top_logps = trainer.teacher.server.top_logps
    trainer.teacher.server.top_logps = lambda *args: asked.append(args[2]) or top_logps(*args)
    trainer.train()
    assert asked == [8, 8]  # one top-k request per step
    losses, kl = log_history(trainer, "loss"), log_history(trainer, "teacher_kl/sampled")
    assert len(losses) == 2 and all(loss > 0 for loss in losses) and all(torch.isfinite(torch.tensor(kl)))
    assert any(not torch.equal(a, b) for a, b in zip(start, trainer.model.parameters()))
    assert read_jsonl(tmp_path / "statelens" / "steps.jsonl")[0]["teacher_kl/supervised"] == pytest.approx(
        kl[0], abs=1e-5
    )


def test_a_server_capping_log_probs_below_teacher_top_k_is_refused_at_start_up(
    tmp_path, teacher_path, student_path, tokenizer, math_dataset
):
    with TestTeacherServer(teacher_path, max_logprobs=20) as server:  # vLLM's default cap
        url = server.url
        args = opd_config(tmp_path, teacher_model_server_url=server.url, signal="divergence", teacher_top_k=32)
        with pytest.raises(TeacherServerError, match=r"refuses 32 log-probs.*--max-logprobs 32"):
            OnPolicyDistillTrainer(model=str(student_path), args=args, train_dataset=math_dataset)
        assert server.requests == 1  # the probe, before any training work
        args = opd_config(tmp_path, teacher_model_server_url=server.url, signal="divergence", teacher_top_k=20)
        OnPolicyDistillTrainer(model=str(student_path), args=args, train_dataset=math_dataset)  # within the cap
    args = opd_config(tmp_path, teacher_model_server_url=url, signal="divergence", teacher_top_k=2048)
    with pytest.raises(ValueError, match="teacher_top_k=2048 is more than the student's vocabulary \\(1024 ids\\)"):
        OnPolicyDistillTrainer(model=str(student_path), args=args, train_dataset=math_dataset)


def test_other_temperatures_and_a_top_k_below_one_are_rejected_with_a_server(tmp_path):
    with pytest.raises(ValueError, match="teacher_top_k must be at least 1.*got 0"):
        opd_config(tmp_path, signal="divergence", teacher_top_k=0, teacher_model_server_url="http://127.0.0.1:8000")
    with pytest.raises(ValueError, match="temperature=0.7.*temperature 1"):
        opd_config(tmp_path, temperature=0.7, teacher_model_server_url="http://127.0.0.1:8000")


def test_a_teacher_instance_with_a_server_is_refused(tmp_path, student_path, tokenizer, math_dataset):
    from trl_statelens.lab import build_model

    args = opd_config(tmp_path, teacher_model_server_url="http://127.0.0.1:8000")
    with pytest.raises(ValueError, match="must not be a model instance"):
        OnPolicyDistillTrainer(
            model=str(student_path),
            teacher_model=build_model("test", tokenizer),
            args=args,
            train_dataset=math_dataset,
        )


def test_unreachable_server_fails_before_training(tmp_path, student_path, math_dataset):
    args = opd_config(tmp_path, teacher_model_server_url=f"http://127.0.0.1:{free_port()}", teacher_server_timeout=0.5)
    with pytest.raises(TeacherServerError, match="cannot connect"):
        OnPolicyDistillTrainer(model=str(student_path), args=args, train_dataset=math_dataset)


@pytest.mark.slow
def test_server_failing_mid_run_leaves_ledger_and_checkpoint_for_a_resume(
    tmp_path, teacher_path, student_path, math_dataset
):
    def trainer_for(url, **kwargs):
        return OnPolicyDistillTrainer(
            model=str(student_path),
            args=opd_config(
                tmp_path,
                teacher_model_server_url=url,
                teacher_server_max_retries=1,
                save_strategy="steps",
                save_steps=1,
                **kwargs,
            ),
            train_dataset=math_dataset,
            callbacks=[StateLoggingCallback()],
        )

    # requests: the vocabulary probe, one scoring request per step; step 3's scoring fails, and its retry
    with TestTeacherServer(teacher_path, fail_after=3) as server:
        trainer = trainer_for(server.url, max_steps=4)
        with pytest.raises(TeacherServerError, match="failed scoring 2 times in a row"):
            trainer.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
    assert [s["step"] for s in read_jsonl(tmp_path / "statelens" / "steps.jsonl")] == [1, 2]
    # once the server is back, the run resumes from the last checkpoint and the ledger continues
    with TestTeacherServer(teacher_path) as server:
        trainer_for(server.url, max_steps=3).train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert [s["step"] for s in read_jsonl(tmp_path / "statelens" / "steps.jsonl")] == [1, 2, 3]


@pytest.mark.slow
def test_recipe_with_a_served_teacher_writes_the_in_process_ledger(
    tmp_path, monkeypatch, teacher_server, student_path, teacher_path
):
    from test_recipes import RECIPE_FLAGS, run_in_process

    flags = ["--model_name_or_path", str(student_path), "--eval_before", "false", "--eval_limit", "1",
             "--eval_max_new_tokens", "4", "--num_probes", "0", "--logging_steps", "1", "--max_steps", "2",
             "--signal", "reverse_kl",  # exact through a server (the lab config's divergence would use the top-k)
             *RECIPE_FLAGS["opd"]]  # fmt: skip
    teachers = {
        "local": ["--teacher_model_name_or_path", str(teacher_path)],
        "served": ["--teacher_model_server_url", teacher_server.url],  # the lab teacher is not built
    }
    results = {
        name: run_in_process("opd", [*flags, *teacher, "--output_dir", str(tmp_path / name)], monkeypatch)
        for name, teacher in teachers.items()
    }
    assert results["served"]["teacher"] == teacher_server.url
    assert results["served"]["distributed"]["teacher_engine"] is None
    kl = {
        name: [s["teacher_kl/supervised"] for s in read_jsonl(tmp_path / name / "statelens" / "steps.jsonl")]
        for name in teachers
    }
    assert len(kl["served"]) == 2 and kl["served"] == pytest.approx(kl["local"], rel=1e-4, abs=1e-6)


# ----- the recipe's stock arm with a served teacher: TRL's ServerDistillationTrainer -----------------------------------
@pytest.mark.parametrize("jsd_beta, loss_top_k", [(0.0, 8), (0.5, 1), (1.0, 1)])
def test_stock_server_config_copies_the_run_with_the_support_trl_allows(tmp_path, jsd_beta, loss_top_k):
    from trl.experimental.server_distillation import ServerDistillationConfig

    ours = opd_config(tmp_path, teacher_model_server_url="http://127.0.0.1:8000", signal="divergence",
                      jsd_beta=jsd_beta, teacher_top_k=8, max_steps=7, seed=5, vllm_server_port=8123)  # fmt: skip
    stock = ours.to_server_distillation_config()
    assert isinstance(stock, ServerDistillationConfig)
    assert (stock.beta, stock.loss_top_k, stock.loss_add_tail) == (jsd_beta, loss_top_k, True)
    for name in ("teacher_model_server_url", "learning_rate", "max_steps", "per_device_train_batch_size",
                 "max_completion_length", "temperature", "seed", "vllm_server_port"):  # fmt: skip
        assert getattr(stock, name) == getattr(ours, name), name


def test_stock_arm_with_beta_above_zero_runs_trl_top_1_and_says_so(
    tmp_path, teacher_server, student_path, math_dataset
):
    from test_recipes import RECIPES

    recipe = runpy.run_path(str(RECIPES / "opd.py"))  # the recipe's functions, without running main
    args = opd_config(tmp_path, teacher_model_server_url=teacher_server.url, signal="divergence", teacher_top_k=8)
    before = teacher_server.requests
    with pytest.warns(UserWarning, match="only loss_top_k=1 with beta > 0.*not on the teacher's top 8 tokens"):
        trainer = recipe["stock_served_trainer"](
            str(student_path), None, args, math_dataset, ModelConfig(), TrainerCallback()
        )
    assert type(trainer).__name__ == "ServerDistillationTrainer"
    assert (trainer.beta, trainer.loss_top_k) == (1.0, 1)
    assert teacher_server.requests == before + 1  # our start-up probe of the server, before any training work


def test_stock_arm_refuses_a_server_capping_log_probs_below_its_top_k_at_start_up(
    tmp_path, teacher_path, student_path, math_dataset
):
    """TRL's trainer would first ask at its first step; the recipe checks the server as our served arm does."""
    from test_recipes import RECIPES

    recipe = runpy.run_path(str(RECIPES / "opd.py"))
    with TestTeacherServer(teacher_path, max_logprobs=20) as server:  # vLLM's default cap
        args = opd_config(
            tmp_path, teacher_model_server_url=server.url, signal="divergence", jsd_beta=0.0, teacher_top_k=32
        )
        with pytest.raises(TeacherServerError, match=r"refuses 32 log-probs.*--max-logprobs 32"):
            recipe["stock_served_trainer"](
                str(student_path), None, args, math_dataset, ModelConfig(), TrainerCallback()
            )


def test_stock_arm_refuses_several_teachers(tmp_path, monkeypatch, student_path):
    """TRL's only multi-teacher trainer needs a vLLM server for the student with weight-update endpoints (README)."""
    from test_recipes import run_in_process

    argv = ["--model_name_or_path", str(student_path), "--baseline", "stock", "--output_dir", str(tmp_path),
            "--teacher_model_name_or_path", "a=http://127.0.0.1:1,b=http://127.0.0.1:2"]  # fmt: skip
    with pytest.raises(ValueError, match="several teachers have no stock counterpart here"):
        run_in_process("opd", argv, monkeypatch)


@pytest.mark.slow
def test_recipe_stock_arm_runs_server_distillation_with_our_loss_at_beta_0(
    tmp_path, monkeypatch, student_path, math_trained_path
):
    """`--baseline stock` with a served teacher runs TRL's ServerDistillationTrainer, with the callback's drift
    ledger. At jsd_beta=0 with one rollout per prompt both arms sample the same rollouts (the same seed, sampler
    and generation) and compute the same loss, the top-8 forward KL plus a tail: equal first-step losses. A
    math-trained teacher, so that its top 8 hold real mass (a random-init one is near-uniform)."""
    from test_recipes import RECIPE_FLAGS, run_in_process

    flags = ["--model_name_or_path", str(student_path), "--eval_before", "false", "--eval_tasks", "gsm8k",
             "--eval_limit", "1", "--eval_max_new_tokens", "4", "--num_probes", "2", "--probe_steps", "1",
             "--logging_steps", "1", "--max_steps", "2", *RECIPE_FLAGS["opd"], "--num_generations", "1",
             "--signal", "divergence", "--jsd_beta", "0", "--teacher_top_k", "8"]  # fmt: skip
    with TestTeacherServer(math_trained_path) as server:
        url = server.url
        flags += ["--teacher_model_server_url", url]
        results = {
            baseline: run_in_process(
                "opd", [*flags, "--baseline", baseline, "--output_dir", str(tmp_path / baseline)], monkeypatch
            )
            for baseline in ("stock", "statelens")
        }
    stock, ours = results["stock"], results["statelens"]
    assert (stock["trainer"], ours["trainer"]) == ("ServerDistillationTrainer", "OnPolicyDistillTrainer")
    assert stock["global_steps"] == ours["global_steps"] == 2 and stock["teacher"] == url
    assert stock["distributed"]["teacher_engine"] is None  # no teacher weights in the training process
    drift = read_jsonl(tmp_path / "stock" / "statelens" / "drift.jsonl")
    assert [d["step"] for d in drift] == [1, 2] and stock["final_drift"] == drift[-1]
    assert not (tmp_path / "stock" / "statelens" / "steps.jsonl").exists()  # per-step states need our trainer
    logs = {name: json.loads((tmp_path / name / "log_history.json").read_text()) for name in results}
    logged = {name: {key: [e[key] for e in log if key in e] for key in ("loss", "grad_norm", "num_tokens")}
              for name, log in logs.items()}  # fmt: skip
    assert len(logged["stock"]["loss"]) == 2 and logged["stock"]["loss"][0] > 0.05
    assert logged["stock"]["num_tokens"] == logged["statelens"]["num_tokens"]  # the same rollouts' tokens
    # the same loss on the same batch, hence the same update and the same second step (measured: equal to float32)
    for key in ("loss", "grad_norm"):
        assert logged["stock"][key] == pytest.approx(logged["statelens"][key], rel=1e-5), key


@pytest.mark.multiproc
@pytest.mark.slow
def test_two_ranks_score_their_own_rows_through_the_server(tmp_path, teacher_server, teacher, student_path):
    accelerate = Path(sys.executable).parent / "accelerate"
    before = teacher_server.requests
    command = [
        str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        str(TWO_RANKS), str(student_path), teacher_server.url, str(tmp_path),
    ]  # fmt: skip
    launch(command, {"TOKENIZERS_PARALLELISM": "false"}, timeout=300, outputs=tmp_path)
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert all(rank["world_size"] == 2 for rank in ranks)
    # each rank sent its vocabulary probe and one scoring request per step, for its own rows
    assert teacher_server.requests - before == 2 * (1 + 2)
    assert ranks[0]["batches"][0]["completion_ids"] != ranks[1]["batches"][0]["completion_ids"]
    for rank in ranks:
        for batch in rank["batches"]:  # the log-probs each rank trained on are the teacher's own on its rows
            b = {key: torch.tensor(value) for key, value in batch.items()}
            input_ids = torch.cat([b["prompt_ids"], b["completion_ids"]], dim=1)
            attention_mask = torch.cat([b["prompt_mask"], b["completion_mask"]], dim=1)
            with torch.no_grad():
                logits = teacher(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
            num_completion = b["completion_ids"].size(1)
            expected = logits.log_softmax(-1)[:, -num_completion:].gather(-1, b["completion_ids"][..., None])
            expected = expected.squeeze(-1) * b["completion_mask"]
            torch.testing.assert_close(b["teacher_logps"], expected, atol=1e-4, rtol=1e-4)
    assert len(ranks[0]["teacher_kl"]) == 2 and ranks[0]["teacher_kl"] == ranks[1]["teacher_kl"]  # gathered


def test_a_served_teachers_unknown_size_leaves_the_flops_uncounted(
    tmp_path, teacher_server, student_path, math_dataset
):
    """The training processes cannot know a served teacher's size: `compute` says `None` rather than 0."""
    from trl_statelens.reports.runs import compute_counts

    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        args=opd_config(tmp_path, teacher_model_server_url=teacher_server.url),
        train_dataset=math_dataset,
        state_logging=False,
    )
    counts = compute_counts(trainer)
    assert counts["student_parameters"] > 0
    assert (counts["teacher_parameters"], counts["flops_per_token"], counts["flops"]) == (None, None, None)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_request_failed_on_one_rank_stops_every_rank_together(
    tmp_path, teacher_server, teacher_path, student_path, math_dataset, monkeypatch, overlap
):
    """Two ranks played by two threads (tests/test_collective.py's `TwoRanks`: a gather answers each rank with both
    ranks' counts; a gather the other rank never joins fails with `UnmatchedGather`, where real ranks would hang).
    Rank 0's server rejects every scoring request, rank 1's answers. Rank 0 raises its own `TeacherServerError` where
    it reads the answer (the loss, or at once without `teacher_server_overlap`), and rank 1 raises one naming process 0
    at the same point, not later in a collective rank 0 never joins. (Review 2026-12-01, item 11.)"""
    from test_collective import TwoRanks

    with TestTeacherServer(teacher_path, fail_after=1, fail_status=400) as failing:  # the vocabulary probe passes
        trainers = [
            OnPolicyDistillTrainer(
                model=str(student_path),
                args=opd_config(
                    tmp_path / f"rank{rank}", teacher_model_server_url=url, teacher_server_overlap=overlap
                ),
                train_dataset=math_dataset,
                state_logging=False,
            )
            for rank, url in enumerate((failing.url, teacher_server.url))
        ]
        ranks = TwoRanks(timeout=30)
        monkeypatch.setattr(collective, "gather_counts", ranks.gather_counts)
        errors = [None, None]

        def run(rank):
            ranks.local.rank = rank
            try:
                trainers[rank].train()
            except BaseException as error:  # noqa: BLE001 (checked below, in the test's thread)
                errors[rank] = error
            ranks.finish(rank)  # a rank done makes no more gathers: one the other still makes fails at once

        threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert isinstance(errors[0], TeacherServerError) and "rejected scoring: HTTP 400" in str(errors[0]), errors
    assert isinstance(errors[1], TeacherServerError), errors  # not an unmatched gather: a hang under real ranks
    assert "process 0: a request to the teacher server failed" in str(errors[1])
    assert [trainer.state.global_step for trainer in trainers] == [0, 0]
