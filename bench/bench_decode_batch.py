"""How SmolLM2-135M-Instruct's sampling scales with the number of rollouts decoded together, on real GSM8K prompts.

A real OPD step's largest part is `generate` (BENCHMARKS.md 6.1), and a decode step at batch 8 spends about 5x the
time its weight reads need. More rows per decode step share each read of the weights; this measures how much that
saves (BENCHMARKS.md 6.1: 32 rollouts cost 0.66x four calls of 8 on 2 cores, 2026-12-05): for each batch size, the plain cached `generate` the trainer's
floor uses (`do_sample`, temperature 1, exactly `--tokens` new tokens through `min_new_tokens`), on the first
`batch` GSM8K train prompts in the chat template, both cores, `--repeats` timed calls after one warm-up; per batch
the median seconds per call, per decode step and per sampled token.

    .venv/bin/python bench/bench_decode_batch.py [--batches 8 16 32 64] [--tokens 128] [--repeats 3]

Needs ../shared/data/gsm8k (real prompts); writes bench/results/decode_batch.json.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from common import say, write_results
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_statelens.data import load_gsm8k
from trl_statelens.real_models import SMOLLM2
from trl_statelens.reports.runs import resolve_model

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
THREADS = 2  # both cores, as a real run on this machine uses them (bench/common.py pins 1 for its A/B runs)


def time_generate(model, tokenizer, prompts: list[str], tokens: int, repeats: int) -> list[float]:
    """Seconds of `repeats` sampled `generate` calls over `prompts` (left-padded), after one untimed call."""
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    settings = dict(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=tokens, min_new_tokens=tokens)
    seconds = []
    with torch.no_grad():
        for repeat in range(repeats + 1):
            torch.manual_seed(repeat)
            start = time.perf_counter()
            out = model.generate(**batch, **settings, pad_token_id=tokenizer.pad_token_id)
            if repeat:
                seconds.append(time.perf_counter() - start)
    assert out.shape[1] - batch["input_ids"].shape[1] == tokens, "generate stopped before --tokens new tokens"
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[8, 16, 32, 64])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not (DATA / "train.jsonl").exists():
        sys.exit(f"needs real GSM8K prompts at {DATA} (see ../shared/data/README.md)")
    torch.set_num_threads(THREADS)
    path = resolve_model(SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = load_gsm8k(str(DATA), split="train", prompt_format="chat").select(range(max(args.batches)))
    prompts = [
        tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False) for row in rows
    ]
    results = {"model": SMOLLM2, "threads": THREADS, "tokens": args.tokens, "repeats": args.repeats, "batches": {}}
    for size in args.batches:
        seconds = time_generate(model, tokenizer, prompts[:size], args.tokens, args.repeats)
        call = statistics.median(seconds)
        results["batches"][size] = {
            "seconds": seconds,
            "median_s": call,
            "ms_per_decode_step": 1000 * call / args.tokens,
            "ms_per_token": 1000 * call / (args.tokens * size),
        }
        say(f"batch {size:3d}: {call:6.1f} s a call, {1000 * call / args.tokens:6.1f} ms a decode step, "
            f"{1000 * call / (args.tokens * size):5.2f} ms a sampled token")  # fmt: skip
    write_results("decode_batch", results)


if __name__ == "__main__":
    main()
