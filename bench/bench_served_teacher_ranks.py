"""Several processes and a served teacher: each rank scoring its own rows vs the main process batching everyone's.

`OnPolicyDistillTrainer` has every rank send its own scoring request (no collective). The alternative gathers every
rank's rows on the main process, sends one request and scatters the answer back. This times both patterns with two
processes (`accelerate launch --num_processes 2`, gloo on CPU) against `tests/vllm_test_server.py` (one torch
thread, its answers delayed by `--latency` seconds to imitate a remote GPU server's round trip), on rows of the size
`bench_served_teacher.py` trains on (8 rows per rank of 48 + 32 tokens, its 32M-parameter teacher, V=1024). It also
times one process's request against its number of rows, which is what the server's batching has to work with.

The stand-in runs one forward at a time and does not batch concurrent requests, as vLLM's continuous batching does:
per-rank requests are served one after the other here, so the per-rank numbers are an upper bound for vLLM.

    .venv/bin/python bench/bench_served_teacher_ranks.py [--latency 0.5] [--iterations 8]
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT_TOKENS, COMPLETION_TOKENS, ROWS_PER_RANK = 48, 32, 8
SERVER = Path(__file__).resolve().parents[1] / "tests" / "vllm_test_server.py"


def worker(url: str, vocab_size: int, iterations: int, output: str) -> None:
    import torch
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list, gather_object

    from trl_statelens.teachers import TeacherServerClient

    torch.set_num_threads(1)
    state = PartialState(cpu=True)  # gloo: this benchmark runs on CPU
    served = TeacherServerClient(url, None, vocab_size, timeout=60.0)
    generator = torch.Generator().manual_seed(state.process_index)
    tokens = PROMPT_TOKENS + COMPLETION_TOKENS
    rows = [torch.randint(1, vocab_size, (tokens,), generator=generator).tolist() for _ in range(ROWS_PER_RANK)]
    lengths = [PROMPT_TOKENS] * ROWS_PER_RANK

    def per_rank():
        return served.logps(rows, lengths)

    def main_process_batches():
        everyone = gather_object([rows])  # one list of rows per rank
        answer = [None]
        if state.is_main_process:
            flat = served.logps([r for rank_rows in everyone for r in rank_rows], lengths * len(everyone))
            answer = [[flat[i * ROWS_PER_RANK : (i + 1) * ROWS_PER_RANK] for i in range(len(everyone))]]
        broadcast_object_list(answer)
        return answer[0][state.process_index]

    assert per_rank() == main_process_batches()  # the same log-probs either way (the stand-in scores rows alone)
    seconds = {}
    for name, fn in (("per_rank", per_rank), ("main_process", main_process_batches)) * 2:  # ABAB
        for _ in range(iterations):
            state.wait_for_everyone()
            start = time.perf_counter()
            fn()
            state.wait_for_everyone()  # a step goes on when every rank has its log-probs
            seconds.setdefault(name, []).append(time.perf_counter() - start)
    by_rows = {}
    if state.is_main_process:  # one process alone: request time against its rows
        for count in (4, 8, 16, 32):
            many = (rows * 4)[:count]
            times = []
            for _ in range(iterations):
                start = time.perf_counter()
                served.logps(many, [PROMPT_TOKENS] * count)
                times.append(time.perf_counter() - start)
            by_rows[count] = statistics.median(times)
        result = {
            "world_size": state.num_processes,
            "step_seconds": {name: statistics.median(values) for name, values in seconds.items()},
            "request_seconds_by_rows": by_rows,
            "requests_per_step": {"per_rank": state.num_processes, "main_process": 1},
        }
        Path(output).write_text(json.dumps(result, indent=2))
    state.wait_for_everyone()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(latency: float, iterations: int) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_served_teacher import TEACHER
    from common import say, scratch_dir

    from trl_statelens.lab import LabWorld, build_qwen3, build_tokenizer

    tokenizer = build_tokenizer(LabWorld(seed=0), vocab_size=1024, num_documents=2000)
    teacher_path = f"{scratch_dir('bench-ranks-')}/teacher"
    build_qwen3(tokenizer, **TEACHER, seed=1).save_pretrained(teacher_path)
    tokenizer.save_pretrained(teacher_path)
    server = subprocess.Popen(
        [sys.executable, str(SERVER), teacher_path, "--threads", "1", "--latency", str(latency)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = server.stdout.readline().strip()
        output = f"{scratch_dir('bench-ranks-')}/result.json"
        accelerate = Path(sys.executable).parent / "accelerate"
        command = [
            str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
            __file__, "--worker", url, "--vocab-size", str(len(tokenizer)), "--iterations", str(iterations),
            "--output", output,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        subprocess.run(command, env=env, check=True)
    finally:
        server.terminate()
        server.wait()
    result = {"latency_s": latency, **json.loads(Path(output).read_text())}
    say(json.dumps(result))
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--latency", type=float, default=0.0, help="seconds the test server adds to each answer")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--vocab-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.vocab_size, args.iterations, args.output)
    else:
        main(args.latency, args.iterations)
