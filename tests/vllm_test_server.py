"""A CPU stand-in for `vllm serve` in tests: the part of vLLM's OpenAI-compatible API that TRL's `VLLMClient` uses.

Not part of the package: users run vLLM. This serves a transformers causal LM on 127.0.0.1 with

- `GET /health`: 200 with an empty body (vLLM's answer while its engine runs);
- `GET /v1/models`: `{"object": "list", "data": [{"id": <served name>, "object": "model", ...}]}`;
- `POST /v1/completions` from token-id prompts, answered as vLLM 0.31 serialises a `CompletionResponse`
  (`vllm/entrypoints/openai/completion/{protocol,serving}.py`): every field present, choices prompt-major,
  - `prompt_logprobs` (when asked for `K`): one entry per prompt token, `null` first; entry `i` maps token-id strings
    to `{"logprob", "rank", "decoded_token"}`, the actual token first with its true rank, then the top-`K` with ranks
    `1..K` (`K=-1`: the whole vocabulary, `K=0`: the actual token only), computed at temperature 1 whatever the
    request's temperature (vLLM scores prompts with unscaled logits), `-inf` sent as `-9999.0`;
  - generation: `max_tokens` tokens sampled with the request's temperature/top_p/top_k/min_p/repetition_penalty
    (temperature 0 is greedy; as in vLLM, `seed` seeds every prompt of the request alike, sample `j` of `n` with
    `seed + j`), stopping at the model's eos (kept, `finish_reason` `"stop"`);
    `token_ids`/`prompt_token_ids` with `return_token_ids`; `logprobs` (`{"text_offset", "token_logprobs", "tokens",
    "top_logprobs"}`, log-probs after temperature and truncation as `--logprobs-mode processed_logprobs`) when asked;
- `POST /tokenize` (`{"prompt", "add_special_tokens"}`): `{"count", "max_model_len", "tokens"}`, as vLLM answers (off
  with `tokenize=False`, a server without it);
- errors as vLLM shapes them: `{"error": {"message", "type", "param", "code"}}` with 400 (bad request) or 404
  (unknown model or path).

Switches for failure tests: `fail_after` (the completions requests after the first `fail_after` are answered with
`fail_status`, by default vLLM's 503 for a dead engine), `fail_times` (how many of them, then it recovers; `None`:
never) and `vocab_size` (serve the model with its embedding resized to another vocabulary, as a server started with
another model would). `max_logprobs` mirrors `vllm serve --max-logprobs` (vLLM's default is 20; `-1` is unlimited).
`latency` adds that many seconds to every completions answer, slept outside the one-forward lock and without using a
core: it imitates a remote GPU server's network round trip and queueing, for benchmarks of request overlap.

Run it as a process for multi-process runs and benchmarks: `python tests/vllm_test_server.py MODEL_PATH` prints its
URL on the first line of stdout and serves until killed.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

CLAMP = -9999.0  # vLLM's JSON-safe stand-in for -inf


class _BadRequest(Exception):
    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


class TestTeacherServer:
    """Serves `model_path` (model and tokenizer) on a free loopback port from a background thread.

    Use as a context manager or call `start()`/`stop()`; `url` is the base URL once started. `requests` counts the
    completions requests received, `failed` those answered with `fail_status`."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        model_path,
        served_model_name: str = "teacher",
        max_logprobs: int = -1,
        fail_after: int | None = None,
        fail_times: int | None = None,
        fail_status: int = 503,
        vocab_size: int | None = None,
        seed: int = 0,
        latency: float = 0.0,
        tokenize: bool = True,
    ):
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path).eval()
        if vocab_size is not None:
            self.model.resize_token_embeddings(vocab_size)
        self.vocab_size = self.model.config.get_text_config().vocab_size
        eos = self.model.generation_config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}
        self.max_model_len = self.model.config.max_position_embeddings
        self.served_model_name = served_model_name
        self.max_logprobs = max_logprobs
        self.latency = latency
        self.tokenize = tokenize
        self.fail_after, self.fail_times, self.fail_status = fail_after, fail_times, fail_status
        self.requests = self.failed = 0
        self._lock = threading.Lock()  # one forward at a time, as one engine would
        self._counter_lock = threading.Lock()
        self._seeds = random.Random(seed)  # a request without a seed samples with the next one
        self._httpd = None
        self._thread = None

    # ----- life cycle ---------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self, port: int = 0) -> TestTeacherServer:
        server = self

        class Handler(_Handler):
            teacher = server

        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self):
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join()
            self._httpd = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ----- /v1/completions ----------------------------------------------------------------------------------------
    def should_fail(self) -> bool:
        with self._counter_lock:
            self.requests += 1
            if self.fail_after is None or self.requests <= self.fail_after:
                return False
            if self.fail_times is not None and self.failed >= self.fail_times:
                return False
            self.failed += 1
            return True

    def complete(self, body: dict) -> dict:
        if body.get("model") != self.served_model_name:
            raise _BadRequest(f"The model `{body.get('model')}` does not exist.", HTTPStatus.NOT_FOUND, param="model")
        prompts = body.get("prompt")
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        if not (isinstance(prompts, list) and prompts and all(isinstance(p, list) and p for p in prompts)):
            raise _BadRequest("this test server only takes token-id prompts: a list[int] or a list[list[int]]")
        num_prompt_logprobs = body.get("prompt_logprobs")
        num_logprobs = body.get("logprobs")
        for name, k in (("prompt_logprobs", num_prompt_logprobs), ("logprobs", num_logprobs)):
            if k is not None and self.max_logprobs != -1 and (k == -1 or k > self.max_logprobs):
                raise _BadRequest(
                    f"Requested {name} of {k}, which is greater than max allowed: {self.max_logprobs}", param=name
                )
        max_tokens = body.get("max_tokens", 16)
        n = body.get("n", 1)
        for prompt in prompts:
            if max(prompt) >= self.vocab_size or min(prompt) < 0:
                raise _BadRequest(f"Token id {max(prompt)} is out of vocabulary")
            if len(prompt) + max_tokens > self.max_model_len:
                raise _BadRequest(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, your request has "
                    f"{len(prompt)} input tokens and requests {max_tokens} output tokens."
                )

        choices = []
        prefill_only = num_prompt_logprobs is not None and max_tokens == 1 and n == 1 and num_logprobs is None
        # Sampling never touches the caller's random state: tests run the server in the trainer's process. A scoring
        # request (prefill only) draws from its own generator, and generation forks the global RNG and restores it:
        # done for a scoring request sent from the trainer's background thread, that restore would rewind the RNG
        # the training thread keeps drawing from meanwhile.
        with self._lock, torch.no_grad(), torch.random.fork_rng(devices=[], enabled=not prefill_only):
            scored = None if num_prompt_logprobs is None else self._score(prompts)
            for i, prompt in enumerate(prompts):
                # As vLLM: each prompt is its own engine request, whose generator is seeded with the request's `seed`
                # (so identical prompts sample identically), and sample j of n with `seed + j`; unseeded, each prompt
                # draws its own noise
                seed = body.get("seed")
                seed = self._seeds.randrange(2**31) if seed is None else seed
                prompt_logprobs = None
                if scored is not None:
                    prompt_logprobs = self._prompt_logprobs(prompt, scored[i][0], num_prompt_logprobs)
                if prefill_only:  # vLLM's prefill gives the one token
                    generator = torch.Generator().manual_seed(seed)
                    samples = [self._first_token(scored[i][1], body.get("temperature", 1.0), generator)]
                else:
                    samples = [self._sample(prompt, body, max_tokens, seed + j) for j in range(n)]
                for sample in samples:
                    choices.append(
                        {
                            "index": len(choices),
                            "text": self.tokenizer.decode(sample["token_ids"]),
                            "logprobs": self._completion_logprobs(sample, num_logprobs, body),
                            "finish_reason": sample["finish_reason"],
                            "stop_reason": None,
                            "token_ids": sample["token_ids"] if body.get("return_token_ids") else None,
                            "prompt_logprobs": prompt_logprobs,
                            "prompt_token_ids": prompt if body.get("return_token_ids") else None,
                            "routed_experts": None,
                        }
                    )
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(c["token_ids"] or []) for c in choices)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.served_model_name,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _entry(self, token_id: int, logprob: float, rank: int) -> tuple[str, dict]:
        value = CLAMP if logprob == float("-inf") else logprob
        return str(token_id), {"logprob": value, "rank": rank, "decoded_token": self.tokenizer.decode([token_id])}

    def _score(self, prompts: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One forward over the right-padded prompts: per prompt, the log-probs (temperature 1) at the positions that
        predict its tokens 2..L, and the logits after its last token (which the first generated token comes from)."""
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
        attention_mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
        return [(logits[i, : len(p) - 1].log_softmax(-1), logits[i, len(p) - 1]) for i, p in enumerate(prompts)]

    def _first_token(self, logits: torch.Tensor, temperature: float, generator: torch.Generator) -> dict:
        """The one token a scoring request (`max_tokens=1`) generates, sampled from the prefill's last logits."""
        if temperature > 0:
            token = int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator))
        else:
            token = int(logits.argmax())
        return {"token_ids": [token], "finish_reason": "stop" if token in self.eos_token_ids else "length"}

    def _prompt_logprobs(self, prompt: list[int], logprobs: torch.Tensor, k: int) -> list[dict | None]:
        """vLLM's prompt log-probs: temperature 1, the actual token first with its true rank, then the top-k."""
        k = logprobs.size(-1) if k == -1 else k
        top_values, top_ids = logprobs.topk(k, dim=-1)
        entries = [None]
        for position, token in enumerate(prompt[1:]):
            row = logprobs[position]
            actual = row[token].item()
            entry = dict([self._entry(token, actual, int((row >= actual).sum()))])
            for rank, (value, token_id) in enumerate(zip(top_values[position].tolist(), top_ids[position].tolist())):
                key, item = self._entry(token_id, value, rank + 1)
                entry.setdefault(key, item)
            entries.append(entry)
        return entries

    def _sample(self, prompt: list[int], body: dict, max_tokens: int, seed: int) -> dict:
        temperature = body.get("temperature", 1.0)
        top_k = body.get("top_k", 0)
        config = GenerationConfig(
            max_new_tokens=max_tokens,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_p=body.get("top_p", 1.0),
            top_k=top_k if top_k and top_k > 0 else 0,
            min_p=body.get("min_p", 0.0) or None,
            repetition_penalty=body.get("repetition_penalty", 1.0),
            eos_token_id=sorted(self.eos_token_ids),
            pad_token_id=self.tokenizer.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        input_ids = torch.tensor([prompt])
        torch.manual_seed(seed)
        out = self.model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
        )
        # Scores are the processed logits (temperature, truncation): log_softmax gives processed log-probs
        logprobs = torch.stack(out.scores, dim=1)[0].float().log_softmax(-1)  # (steps, V)
        row = out.sequences[0, len(prompt) :].tolist()
        ends = [j for j, t in enumerate(row) if t in self.eos_token_ids]
        token_ids = row[: ends[0] + 1] if ends else row
        return {
            "token_ids": token_ids,
            "logprobs": logprobs[: len(token_ids)],
            "finish_reason": "stop" if ends else "length",
        }

    def _completion_logprobs(self, sample: dict, num_logprobs: int | None, body: dict) -> dict | None:
        if num_logprobs is None:
            return None
        as_ids = body.get("return_tokens_as_token_ids")
        name = (lambda t: f"token_id:{t}") if as_ids else (lambda t: self.tokenizer.decode([t]))  # noqa: E731
        result = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        offset = 0
        for token, row in zip(sample["token_ids"], sample["logprobs"]):
            value = max(row[token].item(), CLAMP)
            top = {name(token): value}
            if num_logprobs > 0:
                values, ids = row.topk(num_logprobs)
                for v, t in zip(values.tolist(), ids.tolist()):
                    top.setdefault(name(t), max(v, CLAMP))
            result["text_offset"].append(offset)
            result["token_logprobs"].append(value)
            result["tokens"].append(name(token))
            result["top_logprobs"].append(top)
            offset += len(name(token))
        return result


class _Handler(BaseHTTPRequestHandler):
    teacher: TestTeacherServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # keep test output quiet
        pass

    def _send(self, status: int, payload: dict | None):
        data = b"" if payload is None else json.dumps(payload, allow_nan=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, param: str | None = None):
        kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
        self._send(status, {"error": {"message": message, "type": kind, "param": param, "code": status}})

    def do_GET(self):
        if self.path == "/health":
            self._send(200, None)
        elif self.path == "/v1/models":
            name = self.teacher.served_model_name
            model = {
                "id": name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "vllm",
                "root": name,
                "parent": None,
                "max_model_len": self.teacher.max_model_len,
                "permission": [],
            }
            self._send(200, {"object": "list", "data": [model]})
        else:
            self._error(404, f"Not Found: {self.path}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/tokenize" and self.teacher.tokenize:
            ids = self.teacher.tokenizer(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
            count = len(ids["input_ids"])
            self._send(200, {"count": count, "max_model_len": self.teacher.max_model_len, "tokens": ids["input_ids"]})
        elif self.path != "/v1/completions":
            self._error(404, f"Not Found: {self.path}")
        elif self.teacher.should_fail():
            self._error(self.teacher.fail_status, "EngineCore encountered an issue (test server failure switch)")
        else:
            time.sleep(self.teacher.latency)
            try:
                self._send(200, self.teacher.complete(body))
            except _BadRequest as error:
                self._error(error.status, str(error), error.param)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_path")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--served-model-name", default="teacher")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the teacher's forwards")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added to every completions answer")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    server = TestTeacherServer(args.model_path, served_model_name=args.served_model_name, latency=args.latency)
    server.start(args.port)
    print(server.url, flush=True)
    try:
        server._thread.join()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
