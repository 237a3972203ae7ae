"""`ServedTeacher` against `tests/vllm_test_server.py`, a CPU stand-in for `vllm serve` speaking vLLM's wire format."""

import socket

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm_test_server import TestTeacherServer

from trl_statelens.served_teacher import ServedTeacher, TeacherServerError


@pytest.fixture(scope="module")
def teacher_server(teacher_path):
    with TestTeacherServer(teacher_path) as server:
        yield server


@pytest.fixture(scope="module")
def teacher(teacher_path):
    return AutoModelForCausalLM.from_pretrained(teacher_path).eval()


def served(url, tokenizer, **kwargs):
    kwargs = {"timeout": 5.0, "retry_backoff": 0.01, **kwargs}
    return ServedTeacher(url, tokenizer, len(tokenizer), **kwargs)


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
    first = client.generate(prefixes, 8, [tokenizer.eos_token_id], top_k=20, seed=3)
    assert first == client.generate(prefixes, 8, [tokenizer.eos_token_id], top_k=20, seed=3)
    assert all(1 <= len(c) <= 8 for c in first)
    # An eos id the server does not stop at still ends the continuation, where the student's eos is
    stop = first[0][1]
    cut = client.generate(prefixes[:1], 8, [stop], top_k=20, seed=3)[0]
    assert cut == first[0][: first[0].index(stop) + 1]


def test_unreachable_server_fails_fast_with_a_clear_error(tokenizer):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    with pytest.raises(TeacherServerError, match=r"not usable after 1s: cannot connect.*vllm serve"):
        served(f"http://127.0.0.1:{port}", tokenizer, timeout=1.0)


@pytest.mark.parametrize("extra_tokens", [64, -8])
def test_served_vocabulary_must_be_the_students(teacher_path, tokenizer, extra_tokens):
    with TestTeacherServer(teacher_path, vocab_size=len(tokenizer) + extra_tokens) as server:
        message = "vocabulary of 1088 tokens, the student 1024" if extra_tokens > 0 else "out of its vocabulary"
        with pytest.raises(TeacherServerError, match=message):
            served(server.url, tokenizer)


def test_teacher_tokenizer_must_map_tokens_like_the_students(teacher_server, tokenizer, tokenizer_path, tmp_path):
    served(teacher_server.url, tokenizer, teacher_tokenizer=str(tokenizer_path))  # the same tokenizer passes
    other = AutoTokenizer.from_pretrained(tokenizer_path)
    other.add_tokens(["<|tool|>"])  # same size of output layer on the server, one more token in the tokenizer
    with pytest.raises(TeacherServerError, match="maps tokens to ids differently"):
        served(teacher_server.url, tokenizer, teacher_tokenizer=other)


def test_a_server_capping_log_probs_names_the_flag(teacher_path, tokenizer):
    with TestTeacherServer(teacher_path, max_logprobs=20) as server:  # vLLM's default cap
        with pytest.raises(TeacherServerError, match=r"max allowed: 20.*--max-logprobs -1"):
            served(server.url, tokenizer)


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
