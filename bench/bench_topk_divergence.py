"""How close the served teacher's top-k plus tail divergence is to the exact one, on the lab (`teacher_top_k`).

A served teacher gives its top-k log-probs per position (vLLM's `prompt_logprobs=k`), and `signal="divergence"`
then computes the generalised JSD on the teacher's top-k tokens plus one tail bucket
(`trl_statelens.heads.topk_tail_jsd`). Here the lab is the ground truth: the lab base model samples one rollout
per prompt on `--prompts` lab math prompts (temperature 1, up to 96 tokens, as the lab OPD recipe), the lab math
teacher scores every completion position in-process, and for each k and `jsd_beta`:

- the relative error of the estimator's batch loss (sum over all completion positions) against the exact
  full-vocabulary generalised JSD, `|L_k - L| / L`, and the median over positions of the per-position relative error;
- the cosine between the estimator's gradient with respect to the student's logits (every position, every vocabulary
  column, flattened) and the exact gradient, and the mean over positions of the per-position cosine.

The teacher's top-k is taken from its full log-softmax here, which is what the served path receives (the test server's
top-k answer equals the in-process teacher's, tests/test_served_teacher.py); the exact loss uses the same formula over
all V categories (k = V gives it, tested). A training run per k: `bench/bench_topk_training.py`.

    .venv/bin/python bench/bench_topk_divergence.py [--prompts 32] [--ks 1 8 32 128] [--betas 1.0 0.5]
"""

import argparse
import time

import torch
from common import say, write_results
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_statelens.data import load_gsm8k
from trl_statelens.heads import topk_tail_jsd
from trl_statelens.reports.runs import resolve_model

MAX_NEW_TOKENS = 96  # the lab OPD recipe's max_completion_length


def rollouts(student, tokenizer, prompts: list[str], seed: int):
    """One sampled completion per prompt (temperature 1), as token ids: prompt and completion of each row."""
    torch.manual_seed(seed)
    rows = []
    eos = tokenizer.eos_token_id
    for prompt in prompts:
        prompt_ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            out = student.generate(
                torch.tensor([prompt_ids]), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
        completion = out[0, len(prompt_ids) :].tolist()
        if eos in completion:
            completion = completion[: completion.index(eos) + 1]
        rows.append((prompt_ids, completion))
    return rows


def position_log_probs(model, rows) -> torch.Tensor:
    """The model's next-token logits at every completion position of every row, stacked: `(N, V)` float64."""
    out = []
    for prompt_ids, completion in rows:
        ids = torch.tensor([prompt_ids + completion])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]
        out.append(logits.double())
    return torch.cat(out)


def exact_jsd(student_logits: torch.Tensor, teacher_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """TRL's generalised JSD over the whole vocabulary per position, `(N,)` (as its chunked kernel defines it)."""
    log_s = student_logits.log_softmax(-1)
    if beta == 0.0:
        return (teacher_logps.exp() * (teacher_logps - log_s)).sum(-1)
    if beta == 1.0:
        return (log_s.exp() * (log_s - teacher_logps)).sum(-1)
    log_m = torch.logaddexp(log_s + torch.tensor(1 - beta).log(), teacher_logps + torch.tensor(beta).log())
    return beta * (teacher_logps.exp() * (teacher_logps - log_m)).sum(-1) + (1 - beta) * (
        log_s.exp() * (log_s - log_m)
    ).sum(-1)


def per_position_and_grad(fn, logits, *args):
    """`fn(logits, *args)` per position, and the gradient of its sum with respect to the logits."""
    z = logits.clone().requires_grad_(True)
    per_position = fn(z, *args)
    (grad,) = torch.autograd.grad(per_position.sum(), z)
    return per_position.detach(), grad


def estimator(student_logits, top_ids, top_logps, beta):
    return topk_tail_jsd(student_logits.log_softmax(-1), top_ids, top_logps, beta)


def measure(student_logits, teacher_logps, ks, betas) -> list[dict]:
    results = []
    for beta in betas:
        exact, exact_grad = per_position_and_grad(exact_jsd, student_logits, teacher_logps, beta)
        for k in ks:
            top_logps, top_ids = teacher_logps.topk(k, dim=-1)
            estimate, grad = per_position_and_grad(estimator, student_logits, top_ids, top_logps, beta)
            position_cosine = torch.nn.functional.cosine_similarity(grad, exact_grad, dim=-1)
            results.append(
                {
                    "k": k,
                    "jsd_beta": beta,
                    "exact_loss": exact.sum().item(),
                    "estimated_loss": estimate.sum().item(),
                    "loss_relative_error": ((estimate.sum() - exact.sum()).abs() / exact.sum()).item(),
                    "median_position_relative_error": ((estimate - exact).abs() / exact).median().item(),
                    "grad_cosine": torch.nn.functional.cosine_similarity(
                        grad.flatten(), exact_grad.flatten(), 0
                    ).item(),
                    "mean_position_grad_cosine": position_cosine.mean().item(),
                    "min_position_grad_cosine": position_cosine.min().item(),
                }
            )
    return results


def main(num_prompts: int, ks: list[int], betas: list[float], seed: int = 0) -> dict:
    start = time.perf_counter()
    student_path, teacher_path = resolve_model("lab"), resolve_model("lab-teacher")
    tokenizer = AutoTokenizer.from_pretrained(student_path)
    student = AutoModelForCausalLM.from_pretrained(student_path).eval()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path).eval()
    prompts = load_gsm8k("lab", "train", limit=num_prompts, seed=seed)["prompt"]
    rows = rollouts(student, tokenizer, prompts, seed)
    student_logits = position_log_probs(student, rows)
    teacher_logps = position_log_probs(teacher, rows).log_softmax(-1)
    say(f"{len(rows)} rollouts, {student_logits.size(0)} completion positions, vocabulary {student_logits.size(1)}")
    teacher_mass = {k: teacher_logps.topk(k, dim=-1).values.exp().sum(-1).median().item() for k in ks}
    results = {
        "prompts": num_prompts,
        "positions": student_logits.size(0),
        "vocab_size": student_logits.size(1),
        "student": student_path,
        "teacher": teacher_path,
        "median_teacher_top_k_mass": teacher_mass,
        "rows": measure(student_logits, teacher_logps, ks, betas),
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(f"\n{'k':>5} {'beta':>5} {'loss rel. err':>14} {'median pos. err':>16} {'grad cosine':>12} "
          f"{'mean pos. cos':>14} {'min pos. cos':>13}")  # fmt: skip
    for r in results["rows"]:
        print(
            f"{r['k']:>5} {r['jsd_beta']:>5} {r['loss_relative_error']:>14.4f} "
            f"{r['median_position_relative_error']:>16.4f} {r['grad_cosine']:>12.4f} "
            f"{r['mean_position_grad_cosine']:>14.4f} {r['min_position_grad_cosine']:>13.4f}"
        )
    say(f"results: {write_results('topk_divergence', results)}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--betas", type=float, nargs="+", default=[1.0, 0.5])
    options = parser.parse_args()
    main(options.prompts, options.ks, options.betas)
