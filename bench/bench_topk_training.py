"""A training run per k (issue 27, item 3): OPD `divergence` from a served teacher on its top-k plus a tail bucket
(`teacher_top_k`), against the in-process exact run, same seed, prompts and steps.

On the lab: the lab base model learns from the lab math teacher with the lab OPD settings (`divergence`, jsd_beta 1,
one rollout per prompt, up to 96 tokens, lr 3e-4 constant), `--batch` lab math train prompts a step for `--steps`
steps. The exact arm scores with the teacher in the training process; each k arm with the same teacher behind
`tests/vllm_test_server.py` (its own process, one torch thread). Each run is a forked child. Per run:

- `teacher_kl/sampled` during training (the trainer's sampled reverse KL on the student's rollouts, exact in every arm: the
  server gives each sampled token's log-prob): the first step and the mean of the last `LAST_STEPS`;
- after training, the exact full-vocabulary reverse KL per position of the final student's samples on the first
  `--kl_prompts` lab math dev problems (one rollout each, a fixed seed), and the target: greedy accuracy on the lab
  math dev split (`--dev` problems).

    .venv/bin/python bench/bench_topk_training.py [--steps 24] [--batch 16] [--ks 1 8 32 128]
    .venv/bin/python bench/bench_topk_training.py --smoke --student S --teacher T --ks 2 1024 --out /tmp/r  # the test

Time, from a 3-step timing of the exact and k = 128 arms (2026-12-01, load average 2-4 on the 2 cores): a step of 16
prompts took 2.1 s in-process and 5.0 s served at k = 128 (the server's JSON grows with k; k <= 32 estimated at
2.8 s), and each run's start and evaluations 18 s: 24 steps, 5 runs, about 8 minutes.
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from bench_topk_divergence import exact_jsd, position_log_probs, rollouts
from common import CPU_ARGS, RESULTS_DIR, run_forked, say, scratch_dir, write_results
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.trainer_callback import PrinterCallback

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer
from trl_statelens.data import load_gsm8k
from trl_statelens.lab import LabWorld, format_plain, score_math
from trl_statelens.reports.runs import resolve_model

SERVER = Path(__file__).resolve().parents[1] / "tests" / "vllm_test_server.py"
LAST_STEPS = 4


def run_arm(k, student, teacher, url, options) -> dict:
    """One training run (`k` None: the in-process exact teacher) and its final teacher KL and dev score."""
    prompts = load_gsm8k("lab", "train", limit=options.steps * options.batch, seed=0)["prompt"]
    config = dict(CPU_ARGS, learning_rate=3e-4, lr_scheduler_type="constant")
    trainer = OnPolicyDistillTrainer(
        model=student,
        teacher_model=teacher,  # with a URL, only its tokenizer is read
        args=OnPolicyDistillConfig(
            output_dir=scratch_dir("bench-topk-training-"),
            signal="divergence",
            jsd_beta=1.0,
            max_steps=options.steps,
            per_device_train_batch_size=options.batch,
            num_generations=1,
            max_completion_length=options.max_completion_length,
            temperature=1.0,
            teacher_model_server_url=None if k is None else url,
            teacher_top_k=k or 32,
            **config,
        ),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
    )
    trainer.remove_callback(PrinterCallback)  # the per-step log lines would flood the table
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    kl = [entry["teacher_kl/sampled"] for entry in trainer.state.log_history if "teacher_kl/sampled" in entry]
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    tokenizer = AutoTokenizer.from_pretrained(student)
    dev = LabWorld(seed=0).math("dev", n=options.dev)
    rows = rollouts(model, tokenizer, [format_plain(r["question"]) for r in dev[: options.kl_prompts]], seed=1)
    student_logits = position_log_probs(model, rows)
    teacher_logps = position_log_probs(AutoModelForCausalLM.from_pretrained(teacher).eval(), rows).log_softmax(-1)
    return {
        "k": k,
        "teacher_kl": kl,
        "teacher_kl_first": kl[0],
        "teacher_kl_last": statistics.mean(kl[-LAST_STEPS:]),
        "final_teacher_kl": exact_jsd(student_logits, teacher_logps, 1.0).mean().item(),
        "dev_accuracy": score_math(model, tokenizer, dev),
        "train_seconds": round(seconds, 1),
    }


def main(options) -> dict:
    student = options.student or resolve_model("lab")
    teacher = options.teacher or resolve_model("lab-teacher")
    server = subprocess.Popen(
        [sys.executable, str(SERVER), teacher, "--threads", "1"], stdout=subprocess.PIPE, text=True
    )
    try:
        url = server.stdout.readline().strip()
        say(f"teacher server at {url}")
        runs = []
        for k in [None, *options.ks]:
            started = time.perf_counter()
            runs.append(run_forked(run_arm, k, student, teacher, url, options))
            say(f"{'exact' if k is None else f'k={k}'}: {time.perf_counter() - started:.0f} s")
    finally:
        server.terminate()
        server.wait()
    print(f"\n{'teacher':>10} {'teacher_kl first':>17} {'last':>8} {'final exact KL':>15} {'dev accuracy':>13}")
    for r in runs:
        name = "exact" if r["k"] is None else f"top-{r['k']}"
        print(f"{name:>10} {r['teacher_kl_first']:>17.4f} {r['teacher_kl_last']:>8.4f} {r['final_teacher_kl']:>15.4f} "
              f"{r['dev_accuracy']:>13.3f}")  # fmt: skip
    setup = {key: value for key, value in vars(options).items() if key != "out"}
    results = {"setup": {**setup, "student": student, "teacher": teacher, "last_steps": LAST_STEPS}, "runs": runs}
    say(f"results: {write_results('topk_training', results, Path(options.out))}")
    return results


if __name__ == "__main__":
    torch.manual_seed(0)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch", type=int, default=16, help="prompts (one rollout each) a step")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--max_completion_length", type=int, default=96)
    parser.add_argument("--dev", type=int, default=100, help="lab math dev problems of the target score")
    parser.add_argument("--kl_prompts", type=int, default=32, help="dev prompts of the final exact teacher KL")
    parser.add_argument("--student", help="default: the lab base model")
    parser.add_argument("--teacher", help="default: the lab math teacher")
    parser.add_argument("--out", default=str(RESULTS_DIR), help="folder of topk_training.json")
    parser.add_argument("--smoke", action="store_true", help="2 steps of 4 prompts, 8 tokens, 4 dev problems")
    options = parser.parse_args()
    if options.smoke:
        options.steps, options.batch, options.max_completion_length, options.dev, options.kl_prompts = 2, 4, 8, 4, 4
    main(options)
