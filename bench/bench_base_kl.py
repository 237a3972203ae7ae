"""`base_kl` on the lab: the estimators' error against the exact KL, and what the metric adds to a probe step.

- `error`: pi_0 is the lab base model; pi_theta is a moved copy of it, the lab teacher (moved far) or the base after a
  few steps of SFT on lab math (moved a little). pi_0 samples the probe prompts (16 lab math prompts x 64 tokens, 3
  seeds) and at every position of those completions this compares, from the callback's own functions
  (`base_policy_row`, `base_divergences`), `base_kl_topk` at several k and the sampled `base_kl` with the exact
  full-vocabulary KL(pi_0 || pi_theta).
- `cost`: the probe step of `bench_scaling.measure_probe_step` (a StateLensSFTTrainer run, each in a forked child)
  with `base_kl` and without it, arms alternating, at the default probe set (16 x 64) and at section 5.1's 64 x 256:
  the probe step, the training step, and the `base_kl` parts timed directly.

    .venv/bin/python bench/bench_base_kl.py [--only error|cost] [--repeats 5]

Results: `bench/results/base_kl.json`; the tables are printed (`--tables` prints them again from the JSON).
"""

import argparse
import json
import statistics
import time

import bench_scaling
import torch
from common import RESULTS_DIR, run_forked, say, write_results
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_statelens.lab import LabWorld, format_plain
from trl_statelens.lens.probes import base_divergences, base_policy_row, seeded_rng
from trl_statelens.reports.runs import resolve_model

TOP_KS = (1, 4, 8, 16, 32, 64, 128)
NUM_PROBES, PROBE_TOKENS, SEEDS = 16, 64, (0, 1, 2)
SFT_STEPS, SFT_BATCH, SFT_LEARNING_RATE = (
    15,
    16,
    5e-4,
)  # a quarter of the lab's mild SFT (recipes/configs/lab/sft.yaml)
COST_SIZES = ((16, 64), (64, 256))  # (probes, tokens): the default probe set, and section 5.1's probe step


def briefly_trained(model_path, tokenizer, world):
    """The lab base after `SFT_STEPS` steps of plain teacher forcing on lab math at the mild SFT's learning rate."""
    model = AutoModelForCausalLM.from_pretrained(model_path)
    rows = world.math("train", n=SFT_STEPS * SFT_BATCH, seed=5)
    texts = [format_plain(r["question"], r["answer"]) + tokenizer.eos_token for r in rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LEARNING_RATE)
    torch.manual_seed(0)
    for step in range(SFT_STEPS):
        batch = tokenizer(texts[step * SFT_BATCH : (step + 1) * SFT_BATCH], return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


@torch.no_grad()
def position_logps(model, tokenizer, prompts, completion_ids):
    """Per completion, the `(tokens, vocabulary)` float32 log-probs at its positions (one sequence at a time)."""
    rows = []
    for prompt, ids in zip(prompts, completion_ids):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        logits = model(input_ids=torch.tensor([p + ids])).logits[0, len(p) - 1 : len(p) + len(ids) - 1]
        rows.append(torch.log_softmax(logits[:, : len(tokenizer)].float(), -1))
    return rows


@torch.no_grad()
def sample(model, tokenizer, prompts, seed):
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    with seeded_rng(torch.device("cpu"), seed):
        output = model.generate(**inputs, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                max_new_tokens=PROBE_TOKENS)  # fmt: skip
    texts = tokenizer.batch_decode(output[:, inputs["input_ids"].size(1) :], skip_special_tokens=True)
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]  # as the callback scores them


def measure_error() -> dict:
    world = LabWorld(seed=0)
    base_path = resolve_model("lab")
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    base = AutoModelForCausalLM.from_pretrained(base_path).eval()
    moved = {
        "lab-teacher": AutoModelForCausalLM.from_pretrained(resolve_model("lab-teacher")).eval(),
        f"base + {SFT_STEPS} SFT steps": briefly_trained(base_path, tokenizer, world),
    }
    prompts = [format_plain(r["question"]) for r in world.math("dev")[:NUM_PROBES]]
    results = {"vocabulary": len(tokenizer), "top_ks": TOP_KS, "seeds": SEEDS, "pairs": {}}
    for name, model in moved.items():
        exact, topk, log_ratio, p_rest = [], {k: [] for k in TOP_KS}, [], {k: [] for k in TOP_KS}
        per_seed = []
        for seed in SEEDS:
            completions = sample(base, tokenizer, prompts, seed)
            base_logps = position_logps(base, tokenizer, prompts, completions)
            moved_logps = position_logps(model, tokenizer, prompts, completions)
            seed_exact, seed_ratio = [], []
            for ids, p, q in zip(completions, base_logps, moved_logps):
                ids = torch.tensor(ids, dtype=torch.long)
                seed_exact.append((p.double().exp() * (p.double() - q.double())).sum(-1))
                for k in TOP_KS:
                    row = base_policy_row(ids, p, k)
                    ratio, bucketed = base_divergences(row, ids, q)
                    topk[k].append(bucketed)
                    p_rest[k].append(row["tail_mass"].double())
                seed_ratio.append(ratio)
            seed_exact, seed_ratio = torch.cat(seed_exact), torch.cat(seed_ratio)
            exact.append(seed_exact)
            log_ratio.append(seed_ratio)
            per_seed.append(
                {
                    "tokens": seed_exact.numel(),
                    "exact_kl": seed_exact.mean().item(),
                    "base_kl": seed_ratio.mean().item(),
                    "base_kl_standard_error": (seed_ratio.std() / seed_ratio.numel() ** 0.5).item(),
                }
            )
        exact, log_ratio = torch.cat(exact), torch.cat(log_ratio)
        rows = []
        for k in TOP_KS:
            values = torch.cat(topk[k])
            deficit = (exact - values) / exact.clamp(min=1e-12)
            rows.append(
                {
                    "k": k,
                    "base_kl_topk": values.mean().item(),
                    "relative_error_of_mean": values.mean().item() / exact.mean().item() - 1,
                    "per_position_deficit_median": deficit.median().item(),
                    "per_position_deficit_p90": deficit.quantile(0.9).item(),
                    "mean_p_rest": torch.cat(p_rest[k]).mean().item(),
                    "reference_numbers_per_token": 2 * k + 2,
                }
            )
        results["pairs"][name] = {
            "tokens": exact.numel(),
            "exact_kl": exact.mean().item(),
            "base_kl": log_ratio.mean().item(),
            "per_seed": per_seed,
            "topk": rows,
        }
        say(f"{name}: exact KL {exact.mean().item():.4f} over {exact.numel()} positions")
    return results


def measure_cost(repeats: int) -> dict:
    world = LabWorld(seed=0)
    sizes = {}
    for probes, tokens in COST_SIZES:
        config = {"probe_step": {**bench_scaling.FULL["probe_step"], "probes": probes, "tokens": tokens}}
        runs = {True: [], False: []}
        for repeat in range(repeats):
            for with_base_kl in (True, False) if repeat % 2 == 0 else (False, True):
                start = time.perf_counter()
                runs[with_base_kl].append(run_forked(bench_scaling.measure_probe_step, config, world, with_base_kl))
                run = runs[with_base_kl][-1]
                say(
                    f"{probes} x {tokens} base_kl={with_base_kl}: probe step {run['probe_step_seconds']:.2f}s, "
                    f"training step {run['training_step_seconds']:.3f}s ({time.perf_counter() - start:.0f}s)"
                )
        sizes[f"{probes}x{tokens}"] = {"with": runs[True], "without": runs[False]}
    return {"repeats": repeats, "sizes": sizes}


def cost_rows(cost) -> list[tuple[str, list[float]]]:
    """(label, values over repeats) per size: the parts timed directly, and the A/B probe steps."""
    rows = []
    for size, runs in cost["sizes"].items():
        with_, without = runs["with"], runs["without"]
        probe = [r["probe_step_seconds"] for r in with_]
        probe_without = [r["probe_step_seconds"] for r in without]
        training = [r["training_step_seconds"] for r in with_ + without]
        base_kl = [r["base_kl_seconds"][0] for r in with_]
        rows += [
            (f"{size}: base_kl at the probe step, s", base_kl),
            (f"{size}: base_kl at step 0 (scoring the reference), s", [r["reference_scoring_seconds"] for r in with_]),
            (f"{size}: probe step with base_kl, s", probe),
            (f"{size}: probe step without base_kl, s", probe_without),
            (f"{size}: training step, s", training),
            (f"{size}: base_kl / probe step without it", [b / p for b, p in zip(base_kl, probe_without)]),
            (f"{size}: base_kl / training step", [b / statistics.median(training) for b in base_kl]),
            (f"{size}: probe step with base_kl / training step", [p / statistics.median(training) for p in probe]),
            (
                f"{size}: probe step without base_kl / training step",
                [p / statistics.median(training) for p in probe_without],
            ),
        ]
    return rows


def tables(results) -> str:
    lines = []
    if "error" in results:
        error = results["error"]
        names = list(error["pairs"])
        lines += [
            "| k | "
            + " | ".join(f"{n}: mean / exact - 1 | per-position deficit median, p90 | mean p_rest" for n in names)
            + " |",
            "|---:|" + "---:|---|---:|" * len(names),
        ]
        for i, k in enumerate(error["top_ks"]):
            cells = []
            for n in names:
                row = error["pairs"][n]["topk"][i]
                cells.append(
                    f"{row['relative_error_of_mean']:+.2%} | {row['per_position_deficit_median']:.2%}, "
                    f"{row['per_position_deficit_p90']:.2%} | {row['mean_p_rest']:.3f}"
                )
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        for n in names:
            pair = error["pairs"][n]
            seeds = ", ".join(
                f"{s['base_kl'] / s['exact_kl'] - 1:+.1%} (se {s['base_kl_standard_error'] / s['exact_kl']:.1%})"
                for s in pair["per_seed"]
            )
            lines.append(
                f"\n{n}: exact KL {pair['exact_kl']:.4f} per token over {pair['tokens']} positions; "
                f"sampled base_kl / exact - 1 per seed: {seeds}"
            )
    if "cost" in results:
        lines += ["", "| quantity | min | median | max |", "|---|---:|---:|---:|"]
        for label, values in cost_rows(results["cost"]):
            lines.append(f"| {label} | {min(values):.3g} | {statistics.median(values):.3g} | {max(values):.3g} |")
    return "\n".join(lines)


def main(only=None, repeats=5):
    path = RESULTS_DIR / "base_kl.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    if only in (None, "error"):
        results["error"] = measure_error()
    if only in (None, "cost"):
        results["cost"] = measure_cost(repeats)
    say(f"wrote {write_results('base_kl', results)}")
    print(tables(results))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("error", "cost"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tables", action="store_true", help="print the tables from bench/results/base_kl.json")
    options = parser.parse_args()
    if options.tables:
        print(tables(json.loads((RESULTS_DIR / "base_kl.json").read_text())))
    else:
        main(options.only, options.repeats)
