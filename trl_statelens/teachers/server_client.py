"""A teacher served by vLLM (`vllm serve`), reached through TRL's `VLLMClient`.

[`TeacherServerClient`] checks the server before any training work (reachable, serves a model, same vocabulary as the
student), then answers what on-policy distillation asks a teacher: the log-prob of given tokens (exact: vLLM's
prompt log-probs always include the actual token, whatever its rank), optionally with the teacher's top-k tokens and
log-probs at each position (`top_logps`), and continuations of given token prefixes. Failed requests are retried a bounded number of times with exponential backoff when the failure
can pass (no connection, timeout, 5xx, 429), then raise [`TeacherServerError`]; a request the server rejects
(4xx) raises at once, with the server's message.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import queue
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from unittest import mock

import requests
import trl.generation.vllm_client as trl_vllm_client
from requests.adapters import HTTPAdapter
from transformers import AutoTokenizer
from trl.generation.vllm_client import VLLMClient

from .vocabulary import padding_allowance, token_id_mismatch

logger = logging.getLogger(__name__)

# Text whose token ids the server's tokenizer and the student's must agree on (words, digits, punctuation, spaces)
TOKENIZATION_PROBE = "The 12 apples cost $3.50 each.\nHow much are 7?"

SERVE_HINT = (
    "Start the teacher with `vllm serve TEACHER --max-model-len N` (README: 'A teacher served by "
    "vLLM') and pass its address as teacher_model_server_url, e.g. http://HOST:8000."
)


class TeacherServerError(RuntimeError):
    """The teacher server cannot be used or stopped answering: the message says why and what to do."""


@contextmanager
def client_without_local_vllm():
    """TRL's `VLLMClient` refuses to start unless vLLM is importable, though its module-level vLLM imports only serve
    weight synchronisation (NCCL), which a teacher client never uses. A training machine that only talks HTTP to the
    teacher need not install vLLM."""
    if importlib.util.find_spec("vllm") is not None:
        yield
    else:
        with mock.patch.object(trl_vllm_client, "is_vllm_available", return_value=True):
            yield


class _TimeoutAdapter(HTTPAdapter):
    """No urllib3 retries (ours are bounded and reported) and a timeout on every request (TRL's client sets none)."""

    def __init__(self, timeout: float, pool_maxsize: int):
        super().__init__(max_retries=0, pool_maxsize=pool_maxsize)
        self.timeout = timeout

    def send(self, request, **kwargs):
        kwargs["timeout"] = kwargs.get("timeout") or self.timeout
        return super().send(request, **kwargs)


def _raise_for_status(response, *args, **kwargs):
    response.raise_for_status()  # an HTTPError that keeps the status code, where TRL's client raises a bare Exception


def _transient(error: Exception) -> bool:
    if isinstance(error, (requests.ConnectionError, requests.Timeout)):
        return True
    if isinstance(error, requests.HTTPError) and error.response is not None:
        return error.response.status_code >= 500 or error.response.status_code in (408, 429)
    return False


def _server_message(error: Exception) -> str:
    if isinstance(error, requests.HTTPError) and error.response is not None:
        return f"HTTP {error.response.status_code}: {error.response.text[:500]}"
    return f"{type(error).__name__}: {error}"


class BackgroundRequests:
    """Runs calls one at a time, in the order submitted, on a daemon thread, each answered through a `Future`.

    Not a `concurrent.futures.ThreadPoolExecutor`: Python joins its worker threads at exit, so a process whose
    training stopped (or crashed) with a request in flight would wait for that request, up to (retries + 1) times
    the timeout. A daemon thread is dropped at exit; `shutdown` cancels the calls not started.
    """

    def __init__(self, name: str):
        self._calls = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> Future:
        future = Future()
        self._calls.put((future, fn, args))
        return future

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # raised where the answer is read
                future.set_exception(error)

    def shutdown(self) -> None:
        """Cancel the calls not started and stop the thread after the one in flight, without waiting for it."""
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                call[0].cancel()
        self._calls.put(None)


def run_concurrently(fn, calls: list[tuple], max_workers: int) -> list:
    """`[fn(*args) for args in calls]`, on up to `max_workers` daemon threads when there are several calls (not a
    `ThreadPoolExecutor`, whose threads Python joins at exit: see [`BackgroundRequests`])."""
    if len(calls) == 1:
        return [fn(*calls[0])]
    workers = [BackgroundRequests(f"teacher-request-{i}") for i in range(min(max_workers, len(calls)))]
    try:
        futures = [workers[i % len(workers)].submit(fn, *args) for i, args in enumerate(calls)]
        return [future.result() for future in futures]
    finally:
        for worker in workers:
            worker.shutdown()


class TeacherServerClient:
    """The HTTP client of a teacher of on-policy distillation behind a vLLM server (see [`ServedTeacher`] for the
    teacher the trainer asks).

    Args:
        base_url (`str`): the server's address, e.g. `"http://localhost:8000"`.
        student_tokenizer: the student's tokenizer.
        student_vocab_size (`int`): rows of the student's output layer; the served model must have at least as many
            (more when its output layer is padded further, same tokenizer: the student's ids are scored under its
            whole softmax, and a continuation ends before any id past the student's vocabulary).
        teacher_tokenizer (`str` or tokenizer, *optional*): the teacher's tokenizer (or its path/hub id). Given, its
            vocabulary must map every token to the same id as the student's. Without it only the vocabulary size is
            checked, by scoring the student's largest id.
        timeout (`float`): seconds to wait for the server to come up and for each answer.
        max_retries (`int`): retries of a request that failed in a way that can pass.
        retry_backoff (`float`): seconds before the first retry, doubled for each further one.
        chunk_size (`int`): sequences per scoring request (`0`: one request per call), sent on up to
            `max_concurrent_requests` threads, as TRL's `get_sequence_logprobs` does.
        top_k (`int`): the most top log-probs per position training will ask for (`top_logps`); the start-up probe
            asks for as many, so that a server whose `--max-logprobs` cap is lower is refused before training.
            `0`: the actual token's only.
    """

    def __init__(
        self,
        base_url: str,
        student_tokenizer,
        student_vocab_size: int,
        teacher_tokenizer=None,
        timeout: float = 300.0,
        max_retries: int = 3,
        retry_backoff: float = 2.0,
        chunk_size: int = 0,
        max_concurrent_requests: int = 4,
        top_k: int = 0,
    ):
        self.base_url = base_url.rstrip("/")
        self.max_retries, self.retry_backoff = max_retries, retry_backoff
        self.student_vocab_size = student_vocab_size
        self.top_k = top_k
        self.chunk_size, self.max_concurrent_requests = chunk_size, max_concurrent_requests
        self.retries = 0  # requests repeated after a transient failure, over this object's life
        self._wait_until_healthy(timeout)
        try:
            with client_without_local_vllm():
                self.client = VLLMClient(base_url=self.base_url, connection_timeout=timeout)
        except Exception as error:  # TRL's client raises bare `Exception`s, or a KeyError/IndexError on an odd answer
            raise TeacherServerError(
                f"the server at {self.base_url} answers /health but names no model at /v1/models ({error!r}): is it "
                f"a vLLM server? {SERVE_HINT}"
            ) from error
        adapter = _TimeoutAdapter(timeout, pool_maxsize=max(4, max_concurrent_requests))
        self.client.session.mount("http://", adapter)
        self.client.session.mount("https://", adapter)
        self.client.session.hooks["response"] = [_raise_for_status]
        self.model = self.client.model
        self._check_vocabulary(student_tokenizer, student_vocab_size, teacher_tokenizer)

    # ----- checks before training -----------------------------------------------------------------------------------
    def _wait_until_healthy(self, timeout: float) -> None:
        """vLLM answers `/health` with 200 once its engine runs (503 once it died). TRL's check retries a non-200
        answer forever; this one gives up after `timeout` seconds with the reason."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                response = requests.get(f"{self.base_url}/health", timeout=max(1.0, min(timeout, 30.0)))
                if response.status_code == 200:
                    return
                reason = f"/health answered HTTP {response.status_code}"
            except requests.RequestException as error:
                reason = f"cannot connect ({type(error).__name__})"
            if time.monotonic() >= deadline:
                raise TeacherServerError(
                    f"the teacher server at {self.base_url} is not usable after {timeout:.0f}s: {reason}. {SERVE_HINT}"
                )
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))

    def _check_vocabulary(self, student_tokenizer, student_vocab_size: int, teacher_tokenizer) -> None:
        hint = (
            "Serve a teacher with the student's tokenizer; for one of another tokenizer, give its path or hub id "
            "(teacher_model, with teacher_model_server_url) so that it is read as such (docs/cross-tokenizer.md)."
        )
        if teacher_tokenizer is not None:
            name = teacher_tokenizer if isinstance(teacher_tokenizer, str) else type(teacher_tokenizer).__name__
            if isinstance(teacher_tokenizer, str):
                teacher_tokenizer = AutoTokenizer.from_pretrained(teacher_tokenizer)
            mismatch = token_id_mismatch(student_tokenizer, teacher_tokenizer, name)
            if mismatch:
                raise TeacherServerError(f"{mismatch} {hint}")
        else:
            self._check_tokenization(student_tokenizer, student_vocab_size, hint)
        # Score the student's largest id: vLLM refuses ids past the served model's vocabulary. As many log-probs are
        # asked for as training will ask (`top_k`; 0, the actual token's only, needs no --max-logprobs flag), so
        # that vLLM's cap on them is met now rather than at the first step.
        probe = [0, student_vocab_size - 1]
        payload = {
            "model": self.model,
            "prompt": [probe],
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": self.top_k,
        }
        try:
            choice = self._request(
                "a vocabulary probe", self.client.session.post, f"{self.base_url}/v1/completions", json=payload
            ).json()["choices"][0]
        except TeacherServerError as error:
            if self.top_k and "logprobs" in str(error) and "HTTP 400" in str(error):
                raise TeacherServerError(
                    f"the server at {self.base_url} refuses {self.top_k} log-probs per position ({error}): vLLM caps "
                    f"them at --max-logprobs (20 by default). Restart it with `--max-logprobs {self.top_k}` (or "
                    "`--max-logprobs -1`, the whole vocabulary), or lower teacher_top_k."
                ) from error
            if "out of vocabulary" in str(error):
                raise TeacherServerError(
                    f"the served model {self.model!r} has fewer tokens than the tokenizer it is checked against "
                    f"({getattr(student_tokenizer, 'name_or_path', '')}, {student_vocab_size} ids): id "
                    f"{student_vocab_size - 1} is out of its vocabulary. {hint}"
                ) from error
            raise
        scored = (choice.get("prompt_logprobs") or [None, None])[1] or {}
        if str(student_vocab_size - 1) not in scored:
            raise TeacherServerError(
                f"the server at {self.base_url} scored the vocabulary probe without the log-prob of its token "
                f"({scored!r}): is it vLLM? {SERVE_HINT}"
            )

    def _check_tokenization(self, tokenizer, vocab_size: int, hint: str) -> None:
        """Without the teacher's tokenizer: the server's own tokenization of a probe text (vLLM's `/tokenize`) must be
        `tokenizer`'s; a server without that endpoint must not score an id clearly past `vocab_size` (more rows than
        padding of the same tokenizer would add), which says its tokenizer is another."""
        try:
            answer = self.client.session.post(
                f"{self.base_url}/tokenize",
                json={"model": self.model, "prompt": TOKENIZATION_PROBE, "add_special_tokens": False},
            ).json()
            served = answer.get("tokens")
        except requests.HTTPError as error:
            if error.response is None or error.response.status_code not in (404, 405):
                raise TeacherServerError(
                    f"the server at {self.base_url} failed a tokenization probe: {_server_message(error)}"
                ) from error
            served = None
        except requests.RequestException as error:
            raise TeacherServerError(
                f"the server at {self.base_url} failed a tokenization probe: {_server_message(error)}"
            ) from error
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        if served is not None:
            expected = tokenizer(TOKENIZATION_PROBE, add_special_tokens=False)["input_ids"]
            if served != expected:
                raise TeacherServerError(
                    f"the served model {self.model!r} tokenizes {TOKENIZATION_PROBE!r} as {served}, and {name} as "
                    f"{expected}: their tokenizers map text to ids differently, so the server would read these ids "
                    f"as other text. {hint}"
                )
            return
        beyond = vocab_size + padding_allowance(vocab_size)
        payload = {"model": self.model, "prompt": [[0, beyond]], "max_tokens": 1, "prompt_logprobs": 0}
        try:
            self.client.session.post(f"{self.base_url}/v1/completions", json=payload)
        except requests.RequestException:
            return  # refused: the served vocabulary is no larger than padding of the same tokenizer would make it
        raise TeacherServerError(
            f"the served model {self.model!r} has an id {beyond}, far past {name}'s {vocab_size}: its tokenizer is most "
            f"likely another, whose ids mean other text (the server has no /tokenize to compare them). {hint}"
        )

    # ----- requests -----------------------------------------------------------------------------------------------
    def _request(self, what: str, send, *args, **kwargs):
        """`send(*args, **kwargs)`, repeated up to `max_retries` times after failures that can pass."""
        for attempt in range(self.max_retries + 1):
            try:
                return send(*args, **kwargs)
            except requests.RequestException as error:
                if not _transient(error):
                    raise TeacherServerError(
                        f"the teacher server at {self.base_url} rejected {what}: {_server_message(error)}. "
                        "Check the server's flags against the README ('A teacher served by vLLM'): --max-model-len at "
                        "least the longest prompt plus completion."
                    ) from error
                if attempt == self.max_retries:
                    raise TeacherServerError(
                        f"the teacher server at {self.base_url} failed {what} {attempt + 1} times in a row (last: "
                        f"{_server_message(error)}); giving up. Training stopped before this step's update: the state "
                        "ledger and the last checkpoint are as they were. Restart the server, then resume from the "
                        "checkpoint."
                    ) from error
                self.retries += 1
                time.sleep(self.retry_backoff * 2**attempt)

    def logps(self, sequences: list[list[int]], prompt_lengths: list[int]) -> list[list[float]]:
        """The teacher's log-prob of each token of `sequences[i][prompt_lengths[i]:]` given the tokens before it,
        at temperature 1 (vLLM scores prompts with unscaled logits, whatever the request's temperature)."""
        return [row["actual_logprobs"] for row in self._score(sequences, prompt_lengths, 0)]

    def top_logps(self, sequences: list[list[int]], prompt_lengths: list[int], top_k: int) -> list[dict]:
        """As `logps`, plus the teacher's `top_k` most likely tokens at each of those positions: per sequence a dict
        with `"actual_logprobs"` (one value per scored token), `"logprob_token_ids"` and `"logprobs"` (`top_k` per
        position, most likely first, from vLLM's `prompt_logprobs=top_k`; an answer with fewer is padded with id 0 at
        `-inf`, as TRL pads it)."""
        return self._score(sequences, prompt_lengths, top_k)

    def _score(self, sequences: list[list[int]], prompt_lengths: list[int], top_k: int) -> list[dict]:
        if not sequences:
            return []

        # TRL's `get_sequence_logprobs` request and parsing, sent from daemon threads (see `run_concurrently`)
        def score(chunk_sequences: list[list[int]], chunk_prompt_lengths: list[int]) -> list[dict]:
            payload = {
                "model": self.model,
                "prompt": chunk_sequences,
                "max_tokens": 1,
                "temperature": 1.0,
                # 0: the actual token only (vLLM always returns it, so nothing is truncated); k: the top-k as well
                "prompt_logprobs": top_k,
            }
            choices = self.client._post(f"{self.base_url}/v1/completions", json=payload)["choices"]
            return [
                VLLMClient._format_sequence_logprobs(choice, sequence, start, top_k)
                for choice, sequence, start in zip(choices, chunk_sequences, chunk_prompt_lengths, strict=True)
            ]

        size = self.chunk_size or len(sequences)
        chunks = [(sequences[i : i + size], prompt_lengths[i : i + size]) for i in range(0, len(sequences), size)]
        answers = run_concurrently(
            lambda *chunk: self._request("scoring", score, *chunk), chunks, self.max_concurrent_requests
        )
        rows = [row for answer in answers for row in answer]
        for row, sequence, start in zip(rows, sequences, prompt_lengths, strict=True):
            row["actual_logprobs"] = logps = [position[0] for position in row["actual_logprobs"]]
            if len(logps) != len(sequence) - start or any(math.isinf(v) for v in logps):
                raise TeacherServerError(
                    f"the teacher server at {self.base_url} answered without the log-prob of every given token "
                    f"({len(logps)} values for {len(sequence) - start} tokens, or a missing token): is it vLLM?"
                )
        return rows

    def generate(
        self,
        prefixes: list[list[int]],
        max_tokens: int,
        eos_token_ids: list[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seeds: list[int] | None = None,
    ) -> list[list[int]]:
        """The teacher's continuation of each token prefix, at most `max_tokens` tokens sampled with the given
        settings, ending at (and including) its first token in `eos_token_ids`.

        With `seeds`, prefix `i` is sampled with seed `seeds[i]`, in a request of its own (up to
        `max_concurrent_requests` at a time): vLLM seeds every prompt of a request with the request's one `seed`, so
        identical prefixes in one request would get identical continuations, and different ones the same noise.
        Without, one request for all prefixes, each sampled with its own unseeded noise.
        """
        if not prefixes:
            return []
        settings = dict(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k if top_k else 0,
            min_p=min_p or 0.0,
            repetition_penalty=repetition_penalty,
            max_tokens=max_tokens,
            logprobs=None,
        )

        def request(batch: list[list[int]], seed: int | None) -> list[list[int]]:
            kwargs = None if seed is None else {"seed": seed}
            result = self._request("generation", self.client.generate, batch, **settings, generation_kwargs=kwargs)
            return result["completion_ids"]

        if seeds is None:
            rows = request(prefixes, None)
        else:
            if len(seeds) != len(prefixes):
                raise ValueError(f"{len(seeds)} seeds for {len(prefixes)} prefixes: give one seed per prefix")
            requests_ = [([prefix], seed) for prefix, seed in zip(prefixes, seeds)]
            rows = [row for part in run_concurrently(request, requests_, self.max_concurrent_requests) for row in part]
        continuations = []
        for row in rows:
            ends = [j for j, token in enumerate(row) if token in eos_token_ids]
            continuations.append(row[: ends[0] + 1] if ends else row)
        return [self._student_ids(continuation) for continuation in continuations]

    def _student_ids(self, continuation: list[int]) -> list[int]:
        """The continuation up to its first id past the student's vocabulary, if any: a padding row of a teacher whose
        output layer is wider than the student's (same tokenizer), which the student can neither read nor be scored
        on. A trained teacher puts next to no mass there (an in-process teacher is kept from writing them)."""
        cut = next((j for j, token in enumerate(continuation) if token >= self.student_vocab_size), None)
        if cut is None:
            return continuation
        logger.warning(
            "The served teacher wrote id %d, past the student's vocabulary (%d ids): its continuation ends before it.",
            continuation[cut],
            self.student_vocab_size,
        )
        return continuation[:cut]
